"""Expert-parallel coverage: does every MoE architecture of the installed transformers keep
parity with its experts placed whole on the ranks of an EP group?

Enumerates every family `benchmarks.coverage` knows (causal LM, seq2seq, image-text-to-text,
...), keeps the architectures whose tiny config counts more than one expert
(`tests.ep_checks.is_moe`), turns their MoE layers on where a tiny 2-layer config leaves them
dense (`tests.ep_checks.moe_on`: ``first_k_dense_replace``, ``mlp_only_layers``, ... by field
name), and on 2 gloo ranks compares the first output and every gradient of the model split by
expert parallelism with the unsharded model's, in three layouts: ep=2 over ranks that hold the
same batch (``tensor_parallel(model, ep_size=2)``: tp=2 with the experts over the same two
ranks, all-reduce dispatch; and ``ep_implementation="all_to_all"``: disjoint row slices
exchanged), and ep=2 over ranks that hold a batch each (``tp_size=1``: dp=2 with FSDP2 on the
dense weights, all-to-all between the batches). A row is at EP parity when all three hold
(|diff| <= 1e-5 x max(1, max |value|)); the others say why (no experts module EP can place:
the probe's reason; a failure: its message).

    python -m benchmarks.coverage_ep                 # every MoE architecture, ~10 min on 2 cores
    python -m benchmarks.coverage_ep --only qwen3_moe dbrx --out /tmp/cov

Writes ``benchmarks/results/coverage_ep.json`` and ``coverage_ep.md`` (rewritten after every row).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

RESULTS = Path(__file__).parent / "results"
TOL = 1e-5
#: the `tpkit.tensor_parallel` options of each layout a row is checked in
LAYOUTS = (
    {"ep_size": 2},
    {"ep_size": 2, "ep_implementation": "all_to_all"},
    {"ep_size": 2, "tp_size": 1},
)


def moe_architectures(only: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(model_type, class, family) of every architecture whose tiny config counts experts."""
    from tests.ep_checks import is_moe
    from tests.tiny_family import family_architectures, tiny_family_config

    out = []
    for model_type, class_name, family in family_architectures(None):
        if only and model_type not in only:
            continue
        try:
            config = tiny_family_config(model_type, class_name)
        except Exception:  # noqa: BLE001 - not buildable: not counted (coverage.py reports it)
            continue
        if config is not None and is_moe(config):
            out.append((model_type, class_name, family))
    return out


def build_moe(model_type: str, class_name: str):
    """The tiny model with its MoE layers on; the fields changed."""
    import torch
    import transformers

    from tests.ep_checks import moe_on
    from tests.tiny_family import tiny_family_config

    config = tiny_family_config(model_type, class_name)
    changed = moe_on(config)
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config)
    return model.float().eval(), changed


def ep_check(model_type: str, class_name: str, family: str) -> dict:
    """Run on both ranks: the architecture's experts modules (kinds, sources) and its parity
    in every `LAYOUTS`; an unsharded forward that fails is said so before any collective."""
    from tests.ep_checks import compare_split, first_output
    from tests.tiny_inputs import family_inputs
    from tpkit.sources.expert_placement import expert_modules

    ref, changed = build_moe(model_type, class_name)
    entries, notes = expert_modules(ref)
    row = {
        "moe_on": changed,
        "experts_modules": len(entries),
        "sources": sorted({e.source for e in entries.values()}),
        "kinds": sorted({e.kind for e in entries.values()}),
    }
    if not entries:
        row["why"] = "; ".join(f"{k}: {v}" for k, v in list(notes.items())[:2]) or (
            "no module with an expert count and expert-indexed weights EP can place"
        )
        return row
    x = family_inputs(ref, family)
    try:
        first_output(ref(**x))
    except Exception as exc:  # noqa: BLE001 - the tiny config, not expert parallelism
        row["why"] = f"unsharded reference forward fails: {type(exc).__name__}: {exc}"[:300]
        return row
    row["layouts"] = []
    for options in LAYOUTS:
        try:
            r = compare_split(ref, x, **options)
        except Exception as exc:  # noqa: BLE001 - the same on every rank: said in the row
            row["why"] = f"{_layout(options)}: {type(exc).__name__}: {exc}"[:300]
            row.pop("layouts")
            return row
        r["layout"] = _layout(options)
        r["ok"] = bool(
            r["out"] <= TOL * max(1.0, r["out_scale"])
            and r["grad"] <= TOL * max(1.0, r["scale"])
            and not r["missing"]
        )
        row["layouts"].append(r)
    return row


def _layout(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items())


def run(only: list[str] | None, out_dir: Path, timeout: float) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import importlib

    from tests.harness import RankError, RankGroup

    me = importlib.import_module("benchmarks.coverage_ep")
    rows: list[dict] = []
    group = RankGroup(2)
    t0 = time.time()
    try:
        for model_type, class_name, family in moe_architectures(only):
            row = {"architecture": model_type, "class": class_name, "family": family}
            started = time.time()
            try:
                row.update(
                    group.run(me.ep_check, model_type, class_name, family, timeout=timeout)[0]
                )
            except RankError as exc:
                row["why"] = _short(str(exc))
            row["status"] = _status(row)
            row["seconds"] = round(time.time() - started, 1)
            rows.append(row)
            _write(out_dir, rows, time.time() - t0)
            print(
                f"{model_type:28s} {class_name:44s} {row['status']:8s} {row.get('why', '')[:70]}",
                flush=True,
            )
    finally:
        group.close()
    return _write(out_dir, rows, time.time() - t0)


def _short(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(" ")]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors[-1] if errors else (lines[-1] if lines else text))[:300]


def _status(row: dict) -> str:
    layouts = row.get("layouts")
    if not layouts:
        return "error" if row.get("experts_modules") else "no ep"
    if all(r["ok"] for r in layouts):
        return "parity"
    bad = next(r for r in layouts if not r["ok"])
    row["why"] = (
        f"{bad['layout']}: out diff {bad['out']:.1e}, grad diff {bad['grad']:.1e} "
        f"(scale {bad['scale']:.1e}), missing {bad['missing']}"
    )
    return "mismatch"


def summarize(rows: list[dict], seconds: float) -> dict:
    ok = [r for r in rows if r["status"] == "parity"]
    return {
        "moe_architectures": len(rows),
        "ep_parity": len(ok),
        "ep_parity_share": round(len(ok) / max(1, len(rows)), 3),
        "without_ep_plan_at_parity": sum(1 for r in ok if r.get("sources") == ["inferred"]),
        "layouts": [_layout(o) for o in LAYOUTS],
        "seconds": round(seconds, 1),
    }


def markdown(summary: dict, rows: list[dict]) -> str:
    s = summary
    lines = [
        "# tpkit expert-parallel coverage (ep=2, parity of output and every gradient, CPU gloo)",
        "",
        f"- MoE architectures (tiny config counts > 1 expert, every family): "
        f"{s['moe_architectures']}",
        f"- **at EP parity in every layout: {s['ep_parity']} ({s['ep_parity_share']:.1%})**; "
        f"of those without a transformers `base_model_ep_plan` (placement inferred): "
        f"{s['without_ep_plan_at_parity']}",
        f"- layouts (`tpkit.tensor_parallel` options, 2 ranks): {'; '.join(s['layouts'])}",
        f"- wall time: {s['seconds']} s",
        "",
        "| architecture | class | family | EP | experts modules | kind | source | out diff | "
        "grad rel diff | held | why not |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        layouts = r.get("layouts", [])
        out = max((x["out"] for x in layouts), default=None)
        rel = max((x["grad"] / max(1.0, x["scale"]) for x in layouts), default=None)
        held = min((x["held"] for x in layouts), default=None)
        lines.append(
            f"| {r['architecture']} | {r['class']} | {r['family']} | {r['status']} | "
            f"{r.get('experts_modules', '')} | {', '.join(r.get('kinds', []))} | "
            f"{', '.join(r.get('sources', []))} | {'' if out is None else f'{out:.1e}'} | "
            f"{'' if rel is None else f'{rel:.1e}'} | {'' if held is None else f'{held:.0%}'} | "
            f"{r.get('why', '').replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def _write(out_dir: Path, rows: list[dict], seconds: float) -> dict:
    summary = summarize(rows, seconds)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("coverage_ep.json", json.dumps({"summary": summary, "rows": rows}, indent=1)),
        ("coverage_ep.md", markdown(summary, rows)),
    ):
        tmp = out_dir / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out_dir / name)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="model types to run (default: every MoE)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--timeout", type=int, default=240, help="seconds per architecture")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.only, args.out, args.timeout), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
