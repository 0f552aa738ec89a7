"""Architecture coverage: does ``tpkit.tensor_parallel`` keep tp=2 forward parity on every text
architecture transformers knows?

Enumerates ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and ``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES``,
builds a tiny random model for each from its default config (a generic shrinker of sizes: no
weights are downloaded), and on 2 gloo ranks compares the logits of ``tensor_parallel(model)``
(plan "auto": transformers' plan when the architecture ships one, else the inferred one) with the
unsharded model's. Besides, on the meta device and without ranks, it infers a plan for every
architecture (also those with a transformers plan) and records the share of parameters it shards,
and it builds each architecture's *default* (full-size) config on the meta device, derives the
plan tp=2 would use and records the share of >=2-D parameter elements it shards, with the reason
(the largest pattern left whole and the plan's note on it) wherever that share is below 90%.

    python -m benchmarks.coverage              # all, ~5-10 min on 2 CPU cores
    python -m benchmarks.coverage --only gpt2 t5 --out /tmp/cov

Writes ``benchmarks/results/coverage.json`` and ``coverage.md``.

Every family a user loads with an Auto class (issue 29: image-text-to-text, speech-to-text,
CTC, audio and image classification, vision encoders, masked LM, dual encoders, besides the text
ones; `tests.tiny.FAMILIES`): ``--families`` enumerates their mappings instead, builds each tiny
model with every sub-config shrunk (`tests.tiny.tiny_family_config`), feeds it the inputs its
forward reads (`tests.tiny.family_inputs`: pixels, audio, image placeholders; no downloads),
checks tp=2 parity of its first output and every gradient, and reports per family. It writes
``coverage_families.json`` / ``.md``; ``--resume`` keeps the rows already there.

    python -m benchmarks.coverage --families image-text-to-text dual-encoder
    python -m benchmarks.coverage --families all --resume   # every family, hours on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from tests.tiny import (
    FAMILIES,
    architectures,
    build_family,
    family_architectures,
    family_inputs,
    tiny_config,
    tiny_family_config,
)

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

RESULTS = Path(__file__).parent / "results"
TOL = 1e-5


def _logits(out):
    """The first output a family's model gives: logits, CLIP's logits_per_image (which reads
    both towers), an encoder's last hidden state."""
    return out.logits if hasattr(out, "logits") else out[0]


build = build_family


def inputs(model, kind: str) -> dict:
    """`tests.tiny.family_inputs` (the text kinds as before)."""
    return family_inputs(model, kind)


def check_parity(model_type: str, class_name: str, kind: str) -> dict:
    """Run on both ranks: tp=2 logits vs the unsharded model's."""
    import copy

    import torch
    from torch.distributed.tensor import DTensor, Replicate

    import tpkit

    ref = build(model_type, class_name)
    x = inputs(ref, kind)
    try:
        with torch.no_grad():
            want = _logits(ref(**x))
    except Exception as exc:  # noqa: BLE001 - the shrunk config, not tensor parallelism
        raise RuntimeError(f"unsharded reference forward fails: {_short(exc)}") from exc
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    plan = model._tpkit.plan
    sources = sorted({plan.source(p) for p in plan})
    total = sharded = 0
    for p in model.parameters():
        if p.ndim >= 2:
            total += p.numel()
            if isinstance(p, DTensor) and p.placements[0] != Replicate():
                sharded += p.numel()
    with torch.no_grad():
        got = _logits(model(**x))
    diff = (got - want).abs().max().item()
    tol = TOL * max(1.0, want.abs().max().item())  # float32 sums in another order
    grad_diff, grad_tol, missing = _grad_diff(ref, model, x, want.shape)
    skipped = bool(missing) and missing[0].startswith("no reference backward")
    return {
        "source": "config" if "config" in sources else ("inferred" if sources else "none"),
        "max_diff": diff,
        "parity": bool(diff <= tol),
        "grad_diff": grad_diff,
        "grad_parity": None if skipped else bool(grad_diff <= grad_tol and not missing),
        "grads_missing": missing[:3],
        "share_sharded": sharded / max(1, total),
        "notes": dict(list(plan.notes.items())[:4]),
    }


def _grad_diff(ref, model, x: dict, shape) -> tuple[float, float, list[str]]:
    """Backward of the same random projection of the logits through both models: the largest
    gradient difference over all parameters, its tolerance, and parameters that got a
    gradient in one model only."""
    import torch
    from torch.distributed.tensor import DTensor

    w = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        try:
            (_logits(m(**x)) * w).sum().backward()
        except Exception as exc:  # noqa: BLE001
            if m is model:
                raise
            # the unsharded model has no backward here (Reformer's needs training mode):
            # both ranks skip the check alike
            return float("nan"), 0.0, [f"no reference backward: {_short(exc)}"]
    ref_params = dict(ref.named_parameters())
    diff, top, missing = 0.0, 0.0, []
    for name, p in model.named_parameters():
        g, want = p.grad, ref_params[name].grad
        if (g is None) != (want is None):
            missing.append(name)
            continue
        if g is None:
            continue
        g = g.full_tensor() if isinstance(g, DTensor) else g  # every rank, same order
        diff = max(diff, (g - want).abs().max().item())
        top = max(top, want.abs().max().item())
    return diff, TOL * max(1.0, top), missing


def infer_share(model_type: str, class_name: str) -> dict:
    """Inferred plan on the meta device, no ranks: share of 2-D parameters it shards at tp=2."""
    from tpkit.plan import infer_plan, param_layouts, validate

    model = build(model_type, class_name, device="meta")
    plan = infer_plan(model)
    validate(model, plan, 2)
    layouts = param_layouts(model, plan)
    total = sharded = 0
    seen = set()
    for name, p in model.named_parameters():
        if p.ndim < 2 or id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        sharded += p.numel() if layouts[name][1].sharded else 0
    return {"inferred_share": sharded / max(1, total), "inferred_notes": len(plan.notes)}


FULL_SIZE_OK = 0.9


def full_size(class_name: str, model_type: str) -> dict:
    """The default (full-size) config on the meta device, no ranks: the share of >=2-D
    parameter elements the tp=2 plan shards, and why when it is below `FULL_SIZE_OK`."""
    from tests.parity import full_size_report

    try:
        r = full_size_report(class_name, model_type=model_type)
    except Exception as exc:  # noqa: BLE001 - the default config or the plan, reported
        return {"full_size_error": _short(exc)}
    out = {"full_size_share": r["share"]}
    if r["why"]:
        out["full_size_why"] = r["why"]
    return out


def hf_plan_facts(config) -> dict:
    """Whether transformers ships a plan for the config, and whether it names a layer (a
    ``layers.*`` pattern) rather than only the vocabulary embedding, as some shipped plans do."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    for sub in ("text_config", "vision_config", "audio_config"):  # a tower's own plan
        plan = plan or getattr(getattr(config, sub, None), "base_model_tp_plan", None) or {}
    return {
        "transformers_plan": bool(plan),
        "transformers_plan_names_layers": any("*" in k for k in plan),
    }


def _short(exc: BaseException | str) -> str:
    text = str(exc).strip().splitlines()
    last = [ln for ln in text if ln.strip()]
    msg = next((ln for ln in reversed(last) if "Error" in ln or "Exception" in ln), "")
    msg = msg or (last[0] if last else repr(exc))
    return msg.strip()[:220]


def run(
    only: list[str] | None,
    out_dir: Path,
    families: list[str] | None = None,
    resume: bool = False,
) -> dict:
    """The text report (``families`` None) or the families report (``families``: names of
    `tests.tiny.FAMILIES`, or ``["all"]``); ``resume`` keeps the families rows already written."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import importlib

    from tests.harness import RankError, RankGroup

    me = importlib.import_module("benchmarks.coverage")  # ranks find checks by module name
    if families is not None:
        names = None if "all" in families else families
        archs = [a for a in family_architectures(names) if not only or a[0] in only]
        stem = "coverage_families"
    else:
        archs = [a for a in architectures() if not only or a[0] in only]
        stem = "coverage"
    done: dict[tuple, dict] = {}
    if resume and (out_dir / f"{stem}.json").exists():
        old = json.loads((out_dir / f"{stem}.json").read_text())["rows"]
        done = {(r["architecture"], r["class"]): r for r in old}
    rows = []
    group = RankGroup(2)
    t0 = time.time()
    try:
        for model_type, class_name, kind in archs:
            if (model_type, class_name) in done:
                rows.append(done.pop((model_type, class_name)))
                continue
            row = {"architecture": model_type, "class": class_name, "kind": kind}
            started = time.time()
            try:
                if families is not None:
                    config = tiny_family_config(model_type, class_name)
                else:
                    config = tiny_config(model_type, class_name)
                row.update(hf_plan_facts(config))
                if config is None:
                    row.update(
                        status="skipped",
                        why="not a text architecture (its config holds vision, audio or text sub-configs)",
                    )
                    rows.append(row)
                    continue
                try:
                    row.update(infer_share(model_type, class_name))
                except Exception as exc:  # noqa: BLE001
                    row["inferred_error"] = _short(exc)
                row.update(full_size(class_name, model_type))
                try:
                    build(model_type, class_name, device="meta")
                except Exception as exc:  # noqa: BLE001
                    row.update(status="unbuildable", why=f"tiny config: {_short(exc)}")
                    rows.append(row)
                    continue
                r = group.run(me.check_parity, model_type, class_name, kind, timeout=120)[0]
                row.update(r, status="ok" if r["parity"] else "mismatch")
                row.update(_parity_why(r))
            except RankError as exc:
                why = _short(exc)
                bad_ref = "unsharded reference forward fails" in str(exc)
                row.update(status="reference fails" if bad_ref else "error", why=why)
            except Exception as exc:  # noqa: BLE001
                row.update(status="error", why=_short(exc))
            row["seconds"] = round(time.time() - started, 2)
            rows.append(row)
            print(
                f"{model_type:28s} {row.get('status'):10s} {row.get('source', ''):9s} "
                f"{row.get('why', '')[:90]}",
                flush=True,
            )
    finally:
        group.close()
    rows += list(done.values())  # resumed rows outside this run's selection
    out_dir.mkdir(parents=True, exist_ok=True)
    if families is not None:
        summary = summarize_families(rows, time.time() - t0)
        text = markdown_families(summary, rows)
    else:
        summary = summarize(rows, time.time() - t0)
        text = markdown(summary, rows)
    (out_dir / f"{stem}.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    (out_dir / f"{stem}.md").write_text(text)
    return summary


def _parity_why(r: dict) -> dict:
    """The row's ``why`` for a parity result that is not a plain pass."""
    if not r["parity"]:
        return {"why": f"max |logits diff| = {r['max_diff']:.2e}"}
    if r["grad_parity"] is None:
        return {"why": f"gradients not checked: {r['grads_missing'][0]}"}
    if not r["grad_parity"]:
        only = r["grads_missing"]
        return {
            "why": f"gradients: max |diff| = {r['grad_diff']:.2e}"
            + (f", only one model has a gradient for {only}" if only else "")
        }
    return {}


def summarize(rows: list[dict], seconds: float) -> dict:
    text = [r for r in rows if r.get("status") != "skipped"]
    tested = [r for r in text if r.get("status") in ("ok", "mismatch", "error")]
    bad_ref = [r for r in text if r.get("status") in ("unbuildable", "reference fails")]
    ok = [r for r in text if r.get("status") == "ok"]
    inferred_ok = [r for r in ok if r.get("source") == "inferred"]
    return {
        "enumerated": len(rows),
        "text_architectures": len(text),
        "buildable": len(tested),
        "tiny_config_broken": len(bad_ref),
        "parity_ok": len(ok),
        "parity_ok_share_of_text": round(len(ok) / max(1, len(text)), 3),
        "parity_ok_share_of_buildable": round(len(ok) / max(1, len(tested)), 3),
        "parity_ok_with_inferred_plan": len(inferred_ok),
        "gradient_parity_ok": sum(1 for r in ok if r.get("grad_parity")),
        "parity_ok_sharding_half": sum(1 for r in ok if r.get("share_sharded", 0) >= 0.5),
        "transformers_plan_on_text": sum(1 for r in text if r.get("transformers_plan")),
        "transformers_plan_naming_layers": sum(
            1 for r in text if r.get("transformers_plan_names_layers")
        ),
        "median_inferred_share": _median(
            [r["inferred_share"] for r in text if "inferred_share" in r]
        ),
        "full_size_planned": sum(1 for r in text if "full_size_share" in r),
        "full_size_at_least_90": sum(1 for r in text if _full_ok(r)),
        "median_full_size_share": _median(
            [r["full_size_share"] for r in text if "full_size_share" in r]
        ),
        # issue 16's goal: tiny parity and >= 90% sharded at full size, over the text rows
        "parity_and_full_size_90": len(goal := [r for r in ok if _full_ok(r)]),
        "parity_and_full_size_90_share": round(len(goal) / max(1, len(text)), 3),
        "seconds": round(seconds, 1),
    }


def _full_ok(row: dict) -> bool:
    return row.get("full_size_share", 0) >= FULL_SIZE_OK


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return round(xs[len(xs) // 2], 3) if xs else 0.0


def markdown(summary: dict, rows: list[dict]) -> str:
    s = summary
    lines = [
        "# tpkit architecture coverage (tp=2, forward parity, CPU gloo)",
        "",
        f"- enumerated: {s['enumerated']} (causal-LM + seq2seq mappings); text-only: "
        f"{s['text_architectures']}; runnable unsharded from a shrunk default config: "
        f"{s['buildable']} ({s['tiny_config_broken']} tiny configs broken: not built or the "
        "unsharded forward fails)",
        f"- **tp=2 forward parity (max |diff| <= {TOL} x max(1, max |logits|)): "
        f"{s['parity_ok']} of "
        f"{s['text_architectures']} text architectures ({s['parity_ok_share_of_text']:.1%}); "
        f"{s['parity_ok_share_of_buildable']:.1%} of the runnable ones**",
        f"- of those, with a plan inferred by tpkit: {s['parity_ok_with_inferred_plan']} (the "
        "rest use transformers' plan, applied by tpkit's styles)",
        f"- of those, every parameter's gradient also matches (backward of a fixed random "
        f"projection of the logits, same tolerance): {s['gradient_parity_ok']}",
        "- 'share sharded': 2-D parameters sharded by the plan used; 'inferred share': the same "
        "for the plan tpkit infers (traced on the meta device), also where transformers has one",
        f"- of those, the plan used shards at least half of the 2-D parameters: "
        f"{s['parity_ok_sharding_half']} (tiny configs skew this: a 101-row vocabulary, 2 layers, "
        "fused 3-D MoE experts that inferred plans leave whole)",
        f"- transformers ships a TP plan for {s['transformers_plan_on_text']} of the "
        f"{s['text_architectures']} text architectures; "
        f"{s['transformers_plan_naming_layers']} of them name a layer, the others only the "
        "embedding",
        f"- median share of 2-D parameters an inferred plan shards: {s['median_inferred_share']:.1%}",
        f"- **full size** (each default config on the meta device, the tp=2 plan): "
        f"{s.get('full_size_planned', 0)} planned, {s.get('full_size_at_least_90', 0)} shard at "
        f"least 90% of the >=2-D parameter elements; median "
        f"{s.get('median_full_size_share', 0):.1%}; the table says why for each one below",
        f"- **tiny parity and at least 90% sharded at full size: "
        f"{s.get('parity_and_full_size_90', 0)} of {s['text_architectures']} "
        f"({s.get('parity_and_full_size_90_share', 0):.1%})**",
        f"- wall time: {s['seconds']} s",
        "",
        "| architecture | kind | transformers plan | plan used | parity | max diff | grad diff | "
        "share sharded | inferred share | full-size share | why not | full size: why below 90% |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        diff = f"{r['max_diff']:.1e}" if "max_diff" in r else ""
        gdiff = f"{r['grad_diff']:.1e}" if "grad_diff" in r else ""
        share = f"{r['share_sharded']:.0%}" if "share_sharded" in r else ""
        ishare = f"{r['inferred_share']:.0%}" if "inferred_share" in r else ""
        if "inferred_error" in r:
            ishare = "trace failed"
        why = r.get("why", "")
        full = f"{r['full_size_share']:.0%}" if "full_size_share" in r else ""
        full_why = r.get("full_size_why") or (
            f"not planned: {r['full_size_error']}" if "full_size_error" in r else ""
        )
        lines.append(
            f"| {r['architecture']} | {r['kind']} | {'yes' if r.get('transformers_plan') else 'no'}"
            f" | {r.get('source', '')} | {r.get('status', '')} | {diff} | {gdiff} | {share} | "
            f"{ishare} | {full} | "
            f"{why.replace('|', '/')} | {full_why.replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def summarize_families(rows: list[dict], seconds: float) -> dict:
    """Per family: architectures enumerated, tp=2 parity of the first output and of every
    gradient, >= 90% of the >=2-D weights sharded at full size, and both (issue 29's goal)."""
    out: dict = {"families": {}, "seconds": round(seconds, 1)}
    for family, _ in FAMILIES:
        fam = [r for r in rows if r["kind"] == family]
        if not fam:
            continue
        ok = [r for r in fam if r.get("status") == "ok" and r.get("grad_parity") is not False]
        out["families"][family] = {
            "architectures": len(fam),
            "tiny_config_broken": sum(
                1 for r in fam if r.get("status") in ("unbuildable", "reference fails")
            ),
            "parity_ok": len(ok),
            "full_size_at_least_90": sum(1 for r in fam if _full_ok(r)),
            "parity_and_full_size_90": sum(1 for r in ok if _full_ok(r)),
            "median_full_size_share": _median(
                [r["full_size_share"] for r in fam if "full_size_share" in r]
            ),
        }
    fams = out["families"].values()
    out["architectures"] = sum(f["architectures"] for f in fams)
    out["parity_ok"] = sum(f["parity_ok"] for f in fams)
    out["parity_and_full_size_90"] = sum(f["parity_and_full_size_90"] for f in fams)
    return out


def markdown_families(summary: dict, rows: list[dict]) -> str:
    """The families report: one line per family, then `markdown`'s table of every row."""
    lines = [
        "# tpkit coverage by family (tp=2, CPU gloo; tiny configs for parity, default configs on "
        "meta for the share)",
        "",
        "| family | architectures | tiny config broken | parity (output + every gradient) | "
        ">= 90% sharded at full size | both | median full-size share |",
        "|---|---|---|---|---|---|---|",
    ]
    for family, f in summary["families"].items():
        lines.append(
            f"| {family} | {f['architectures']} | {f['tiny_config_broken']} | {f['parity_ok']} | "
            f"{f['full_size_at_least_90']} | {f['parity_and_full_size_90']} | "
            f"{f['median_full_size_share']:.0%} |"
        )
    lines.append(
        f"| **all** | {summary['architectures']} | | {summary['parity_ok']} | | "
        f"{summary['parity_and_full_size_90']} | |"
    )
    table = markdown(summarize(rows, summary["seconds"]), rows).split("\n")
    start = next(i for i, ln in enumerate(table) if ln.startswith("| architecture"))
    return "\n".join([*lines, "", f"wall time: {summary['seconds']} s", "", *table[start:]])


#: module names of a multimodal model's language side: what is not a tower (`tower_share`)
_TEXT_SIDE = ("language_model", "text_model", "lm_head", "embed_tokens")


def tower_share(model_type: str, class_name: str, tp: int = 2) -> dict:
    """The tiny family model on meta, no ranks: the plan tp would use (`derive_plan`), the share
    of its towers' >=2-D parameter elements it splits (a tower: every parameter outside the
    language model, its embeddings and head, `_TEXT_SIDE`), the share of all of them, and
    whether the trace kept to the text (`tpkit.plan.inputs.text_only`)."""
    from tpkit.plan import derive_plan, param_layouts
    from tpkit.plan import inputs as plan_inputs

    model = build(model_type, class_name, device="meta")
    plan = derive_plan(model, "auto", tp)
    layouts = param_layouts(model, plan)
    out = {"tower": 0, "tower_split": 0, "all": 0, "all_split": 0}
    seen = set()
    for name, p in model.named_parameters():
        if p.ndim < 2 or id(p) in seen:
            continue
        seen.add(id(p))
        split = p.numel() if layouts[name][1].sharded else 0
        out["all"], out["all_split"] = out["all"] + p.numel(), out["all_split"] + split
        if not any(part in name.split(".") for part in _TEXT_SIDE):
            out["tower"], out["tower_split"] = out["tower"] + p.numel(), out["tower_split"] + split
    text_only = getattr(plan_inputs, "_TEXT_ONLY", ())
    return {
        "tower_share": round(out["tower_split"] / out["tower"], 3) if out["tower"] else None,
        "share": round(out["all_split"] / max(1, out["all"]), 3),
        "tower_params": out["tower"],
        "text_only": model in text_only,
    }


def towers(families: list[str], only: list[str] | None, out: Path, timeout: int) -> list[dict]:
    """`tower_share` of every architecture of ``families`` (one process each, ``timeout`` s),
    written to ``out`` (JSON) row by row; ``--towers`` on the command line."""
    import subprocess

    rows = []
    for model_type, class_name, family in family_architectures(families):
        if only and model_type not in only:
            continue
        row = {"architecture": model_type, "class": class_name, "family": family}
        code = (
            "import json, benchmarks.coverage as c; "
            f"print('ROW', json.dumps(c.tower_share({model_type!r}, {class_name!r})))"
        )
        started = time.time()
        try:
            run = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
            )
            found = [ln for ln in run.stdout.splitlines() if ln.startswith("ROW ")]
            row.update(json.loads(found[-1][4:]) if found else {"error": _short(run.stderr)})
        except subprocess.TimeoutExpired:
            row["error"] = f"timeout {timeout} s"
        row["s"] = round(time.time() - started, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        out.write_text(json.dumps(rows, indent=1))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="model types to run (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--markdown-only", action="store_true", help="rewrite coverage.md from coverage.json"
    )
    parser.add_argument(
        "--families",
        nargs="+",
        choices=[f for f, _ in FAMILIES] + ["all"],
        help="the families report (coverage_families.*) over these Auto-class families",
    )
    parser.add_argument("--resume", action="store_true", help="keep the rows already written")
    parser.add_argument(
        "--towers",
        type=Path,
        help="write each --families architecture's tower share on meta (tp=2 plan) to this JSON",
    )
    parser.add_argument("--timeout", type=int, default=180, help="seconds per architecture")
    args = parser.parse_args(argv)
    if args.towers:
        names = None if not args.families or "all" in args.families else args.families
        towers(names, args.only, args.towers, args.timeout)
        return 0
    if args.markdown_only:
        stem = "coverage_families" if args.families else "coverage"
        data = json.loads((args.out / f"{stem}.json").read_text())
        render = markdown_families if args.families else markdown
        (args.out / f"{stem}.md").write_text(render(data["summary"], data["rows"]))
        return 0
    summary = run(args.only, args.out, args.families, args.resume)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
