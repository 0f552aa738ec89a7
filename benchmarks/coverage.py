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
ones; `tests.tiny_family.FAMILIES`): ``--families`` enumerates their mappings instead, builds each tiny
model with every sub-config shrunk (`tests.tiny_family.tiny_family_config`), feeds it the inputs its
forward reads (`tests.tiny_inputs.family_inputs`: pixels, audio, image placeholders; no downloads),
checks tp=2 parity of its first output and every gradient, and reports per family. It writes
``coverage_families.json`` / ``.md``.

Both reports are rewritten after every architecture (atomically), so a sweep can run in pieces:
a killed run loses at most the row it was on, and ``--resume`` runs only the rows not written
yet (``--retry timeout error``: those too). Each architecture's work runs on the rank group
under ``--timeout`` seconds per call (the full-size meta checks under ``--meta-timeout``: a
plan of a 300B-parameter default on meta takes minutes on 2 busy cores); a group that hangs is
killed, the row says "timeout" (a rank that died instead, of memory or a crash, is said so),
and the sweep goes on with a fresh group. ``--markdown-only`` re-renders the markdown (summary
included) from the JSON.

    python -m benchmarks.coverage --families image-text-to-text dual-encoder
    python -m benchmarks.coverage --families all --resume   # every family, hours on 2 cores
    python -m benchmarks.coverage --families all --markdown-only
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import sys
import time
from pathlib import Path

from tests.tiny import architectures, full_config, tiny_config
from tests.tiny_family import FAMILIES, build_family, family_architectures, tiny_family_config
from tests.tiny_inputs import family_inputs

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

RESULTS = Path(__file__).parent / "results"
TOL = 1e-5


def first_output(out):
    """The first output a family's model gives: logits, CLIP's logits_per_image (which reads
    both towers), an encoder's last hidden state; a backbone's feature maps (a tuple, one per
    stage: TimmBackbone's) flattened into one tensor, so every stage is compared."""
    import torch

    first = out.logits if hasattr(out, "logits") else out[0]
    if isinstance(first, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in first):
        return torch.cat([t.flatten() for t in first])
    return first


build = build_family


def inputs(model, kind: str) -> dict:
    """`tests.tiny_inputs.family_inputs` (the text kinds as before)."""
    return family_inputs(model, kind)


def check_parity(model_type: str, class_name: str, kind: str) -> dict:
    """Run on both ranks: tp=2 logits and every gradient vs the unsharded model's.

    One forward of each model, with autograd on, gives both the logits compared and the graph
    the gradients come from (a second, no-grad forward only repeated the first: a wav2vec2 CTC
    head's conv stack made that 3.5 s of its 17). The unsharded forward runs before any
    collective, so a shrunk config it cannot run fails on every rank alike."""
    import copy

    import torch
    from torch.distributed.tensor import DTensor, Replicate

    import tpkit

    ref = build(model_type, class_name)
    x = inputs(ref, kind)
    model = copy.deepcopy(ref)  # before any forward: no module state a forward leaves behind
    try:
        torch.manual_seed(FORWARD_SEED)
        ref_out = first_output(ref(**x))
    except Exception as exc:  # noqa: BLE001 - the shrunk config, not tensor parallelism
        raise RuntimeError(f"unsharded reference forward fails: {_short(exc)}") from exc
    want = ref_out.detach()
    if not bool(torch.isfinite(want).all()):  # nothing to compare: the tiny config's fault
        raise RuntimeError("unsharded reference forward fails: its output is not finite (NaN/inf)")
    model = tpkit.tensor_parallel(model)
    plan = model._tpkit.plan
    sources = sorted({plan.source(p) for p in plan})
    total = sharded = 0
    for p in model.parameters():
        if p.ndim >= 2:
            total += p.numel()
            if isinstance(p, DTensor) and p.placements[0] != Replicate():
                sharded += p.numel()
    torch.manual_seed(FORWARD_SEED)  # a forward that samples (VibeVoice's speech latents)
    out = first_output(model(**x))
    diff = (out.detach() - want).abs().max().item()
    tol = TOL * max(1.0, want.abs().max().item())  # float32 sums in another order
    grad_diff, grad_scale, missing = compare_grads(ref, model, ref_out, out)
    skipped = bool(missing) and missing[0].startswith("no reference backward")
    if skipped:  # a backward that needs training mode (Reformer's reversible layers)
        grad_diff, grad_scale, missing = _training_grads(ref, model, x, want, missing)
        skipped = bool(missing) and missing[0].startswith("no reference backward")
    grads_ok = grad_diff <= grad_bound(grad_scale) and not missing
    return {
        "source": "config" if "config" in sources else ("inferred" if sources else "none"),
        "max_diff": diff,
        "parity": bool(diff <= tol),
        "grad_diff": grad_diff,
        "grad_scale": grad_scale,
        "grad_rel": grad_rel(grad_diff, grad_scale),
        "grad_parity": None if skipped else bool(grads_ok),
        "grads_missing": missing[:3],
        "share_sharded": sharded / max(1, total),
        "notes": dict(list(plan.notes.items())[:4]),
    }


def _training_grads(ref, model, x: dict, want, why: list[str]) -> tuple[float, float, list[str]]:
    """`compare_grads` with both models in training mode, for a model whose backward asserts
    it (Reformer's reversible layers): only where its training forward gives the evaluation
    forward's output (no dropout active, the same inputs accepted), else skipped with ``why``."""
    import torch

    ref.train()
    model.train()
    try:
        torch.manual_seed(FORWARD_SEED)
        ref_out = first_output(ref(**x))
        if not torch_equal(ref_out.detach(), want):
            return float("nan"), 0.0, [f"{why[0]}; its training forward differs (dropout?)"]
        torch.manual_seed(FORWARD_SEED)
        out = first_output(model(**x))
        return compare_grads(ref, model, ref_out, out)
    except Exception as exc:  # noqa: BLE001 - the same on every rank: skipped alike
        return float("nan"), 0.0, [f"{why[0]}; in training mode: {_short(exc)}"]
    finally:
        ref.eval()
        model.eval()


def torch_equal(a, b) -> bool:
    """Two outputs equal to float32 rounding (a training forward with no dropout repeats the
    evaluation one up to its sums' order)."""
    return bool((a - b).abs().max().item() <= TOL * max(1.0, b.abs().max().item()))


#: the generator state each compared forward starts from: a model that samples in its forward
#: (VibeVoice's speech tokenizer draws its latents' noise) draws the same values in the
#: unsharded and the tensor-parallel run, as every rank does
FORWARD_SEED = 1234


def grad_bound(scale: float) -> float:
    """What a gradient difference may be: `TOL` absolute, relative to the largest reference
    gradient ``scale`` once that exceeds 1 (float32 sums in another order differ in proportion
    to the values summed)."""
    return TOL * max(1.0, scale)


def grad_rel(diff: float, scale: float) -> float:
    """The gradient difference relative to the largest reference gradient (``diff`` itself
    where every gradient is 0): the report's honest figure where gradients are huge (a tiny
    random BLIP-2's reach 1e19, so an absolute difference of 5e13 is 5e-6 of them)."""
    return diff / scale if scale > 0 else diff


def compare_grads(ref, model, ref_out, out) -> tuple[float, float, list[str]]:
    """Backward of the same random projection of both models' logits (``ref_out``, ``out``,
    forwards with autograd on): the largest gradient difference over all parameters, the
    largest reference gradient (the scale `grad_bound` allows for), and parameters that got a
    gradient in one model only."""
    import torch
    from torch.distributed.tensor import DTensor

    w = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(2))
    for m, y in ((ref, ref_out), (model, out)):
        m.zero_grad(set_to_none=True)
        try:
            (y * w).sum().backward()
        except Exception as exc:  # noqa: BLE001
            if m is model:
                raise
            # the unsharded model has no backward here (Reformer's reversible layers run their
            # own backward, which asserts training mode; its training forward takes only
            # sequences of its full axial length): both ranks skip the check alike
            return float("nan"), 0.0, [f"no reference backward: {_short(exc)}"]
    ref_params = dict(ref.named_parameters())
    diff, top, missing = 0.0, 0.0, []
    for name, p in model.named_parameters():
        g, want = p.grad, ref_params[name].grad
        if (g is None) != (want is None):
            missing.append(name)
            continue
        if g is None or want.numel() == 0:  # a zero-size weight (MobileBERT's [0, vocab]
            continue  # head when embedding_size == hidden_size): nothing to compare
        g = g.full_tensor() if isinstance(g, DTensor) else g  # every rank, same order
        diff = max(diff, (g - want).abs().max().item())
        top = max(top, want.abs().max().item())
    return diff, top, missing


def infer_share(model_type: str, class_name: str, model=None) -> dict:
    """Inferred plan on the meta device, no ranks: share of 2-D parameters it shards at tp=2.
    ``model``: the tiny model already built on meta (else built here)."""
    from tpkit.plan import infer_plan, param_layouts, validate

    if model is None:
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
#: what the reports' "parity" means, said in each report's header
PARITY_MEANS = (
    f"'parity': the tp=2 model's first output (logits) within {TOL} of the unsharded model's, "
    f"absolute, or relative to the largest |logit| where that exceeds 1; every gradient (backward "
    f"of a fixed random projection of that output) within {TOL} x max(1, max |grad|): relative "
    "to the gradients' scale, so tiny random towers whose gradients reach 1e19 show a large "
    "absolute 'grad diff' and pass on 'grad rel diff' (that difference over max |grad|), which "
    f"is the figure held to {TOL} there. 'full-size config repaired': what the default config "
    "needed to build at all (`tests.tiny.full_config`)."
)


def full_size(class_name: str, model_type: str) -> dict:
    """The default (full-size) config on the meta device, no ranks: the share of >=2-D
    parameter elements the tp=2 plan shards, and why when it is below `FULL_SIZE_OK`."""
    from tests.parity import full_size_report

    repairs: list[str] = []
    with contextlib.suppress(Exception):  # the same repairs full_size_report's config gets
        full_config(model_type, class_name, repairs)
    note = {"full_size_note": "; ".join(repairs)} if repairs else {}
    try:
        r = full_size_report(class_name, model_type=model_type)
    except Exception as exc:  # noqa: BLE001 - the default config or the plan, reported
        return {"full_size_error": _short(exc), **note}
    out = {"full_size_share": r["share"], **note}
    if r["why"]:
        out["full_size_why"] = r["why"]
    return out


def meta_checks(model_type: str, class_name: str) -> dict:
    """Run on the rank group, no collectives: the row's work on the meta device, split between
    the ranks so that it costs the longer of its two halves instead of their sum, and under the
    group's timeout (a full-size trace that hangs is killed with the group instead of stalling
    the sweep). Rank 0 derives the tp=2 plan of the default config at full size (`full_size`,
    the slow half: 1 to 15 s); the last rank builds the tiny model on meta (``tiny_build_error``
    when it cannot) and infers its plan on that same model (`infer_share`). A group of one rank
    does both."""
    rank, world = _rank()
    out: dict = {}
    if rank == world - 1:
        try:
            model = build(model_type, class_name, device="meta")
        except Exception as exc:  # noqa: BLE001 - the shrunk config, reported
            out["tiny_build_error"] = _short(exc)
        else:
            try:
                out.update(infer_share(model_type, class_name, model))
            except Exception as exc:  # noqa: BLE001
                out["inferred_error"] = _short(exc)
    if rank == 0:
        out.update(full_size(class_name, model_type))
    return out


def _rank() -> tuple[int, int]:
    """This process's (rank, world size): the process group's, else one rank."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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


#: how often (architectures) the rank group is started afresh: it bounds what the modeling
#: modules imported and the caches they fill hold in the ranks over a sweep of hundreds
RESTART_EVERY = 100


def run(
    only: list[str] | None,
    out_dir: Path,
    families: list[str] | None = None,
    resume: bool = False,
    timeout: float = 180.0,
    retry: tuple[str, ...] = (),
    meta_timeout: float | None = None,
) -> dict:
    """The text report (``families`` None) or the families report (``families``: names of
    `tests.tiny_family.FAMILIES`, or ``["all"]``).

    Written after every architecture (JSON and markdown, each atomically: a temporary file
    then `os.replace`), so a run killed at any point loses at most the row it was on; ``resume``
    keeps the rows already written and runs only the others (rows whose status is in ``retry``
    run again). Each architecture's two calls to the rank group (`meta_checks`, then
    `check_parity`) have ``timeout`` seconds each (`meta_checks`: ``meta_timeout``, by default
    `META_TIMEOUT` or ``timeout`` if longer): a group that does not answer is killed, the row
    says so (status "timeout") and the next architecture starts a fresh group."""
    meta_timeout = meta_timeout or max(timeout, META_TIMEOUT)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import importlib

    from tests.harness import RankError, RankGroup

    me = importlib.import_module("benchmarks.coverage")  # ranks find checks by module name
    if families is not None:
        names = None if "all" in families else families
        archs = [a for a in family_architectures(names) if not only or a[0] in only]
        if names:  # in the order given (smaller families first gives a report sooner)
            archs.sort(key=lambda a: names.index(a[2]))
        every, stem = _every_family_architecture(), "coverage_families"
        members = family_members()
    else:
        archs = [a for a in architectures() if not only or a[0] in only]
        every, stem, members = architectures(), "coverage", None
    order = {(t, c): i for i, (t, c, _) in enumerate(every)}
    table: dict[tuple, dict] = {}
    if resume and (out_dir / f"{stem}.json").exists():
        old = json.loads((out_dir / f"{stem}.json").read_text())["rows"]
        table = {(r["architecture"], r["class"]): r for r in old}
    group = RankGroup(2)
    t0, served = time.time(), 0
    try:
        for model_type, class_name, kind in archs:
            key = (model_type, class_name)
            if key in table and table[key].get("status") not in retry:
                continue
            if served == RESTART_EVERY:
                group.close()  # the next run starts a fresh group
                served = 0
            served += 1
            row = {"architecture": model_type, "class": class_name, "kind": kind}
            if not group.alive:  # a fresh group: its start is no architecture's time
                with contextlib.suppress(RankError):  # else the timed calls below say so
                    group.run(me.warm_up, timeout=max(timeout, WARM_UP_TIMEOUT))
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
                else:
                    _check(row, group, me, timeout, RankError, meta_timeout)
            except Exception as exc:  # noqa: BLE001
                row.update(status="error", why=_short(exc))
            row["seconds"] = round(time.time() - started, 2)
            table[key] = row
            rows = sorted(table.values(), key=lambda r: _place(order, r))
            _write(out_dir, stem, rows, members, time.time() - t0)
            print(
                f"{model_type:28s} {row.get('status'):10s} {row.get('source', ''):9s} "
                f"{row['seconds']:6.1f}s {row.get('why', '')[:80]}",
                flush=True,
            )
    finally:
        group.close()
    rows = sorted(table.values(), key=lambda r: _place(order, r))
    return _write(out_dir, stem, rows, members, time.time() - t0)


def _check(
    row: dict, group, me, timeout: float, rank_error: type, meta_timeout: float | None = None
) -> None:
    """One architecture on the rank group: `meta_checks` (under ``meta_timeout``, default
    ``timeout``), then, when the tiny model builds, `check_parity`; the results (or the
    failure, named) into ``row``."""
    name = f"{row['architecture']} ({row['class']})"
    meta_timeout = meta_timeout or timeout
    try:
        parts = _timed_run(
            group, me.meta_checks, row["architecture"], row["class"], timeout=meta_timeout
        )
        for part in parts:
            row.update(part)
    except rank_error as exc:
        row["full_size_error"] = f"meta checks: {_rank_why(exc, meta_timeout)}"
        print(f"{name}: {row['full_size_error']}", file=sys.stderr, flush=True)
    if "tiny_build_error" in row:
        row.update(status="unbuildable", why=f"tiny config: {row.pop('tiny_build_error')}")
        return
    try:
        r = _timed_run(
            group, me.check_parity, row["architecture"], row["class"], row["kind"], timeout=timeout
        )[0]
    except rank_error as exc:
        why = _rank_why(exc, timeout)
        if why.startswith("timed out"):
            status = "timeout"
            print(f"{name}: {why}", file=sys.stderr, flush=True)
        elif why.startswith("a rank process died"):
            status = "error"
            print(f"{name}: {why}", file=sys.stderr, flush=True)
        elif "unsharded reference forward fails" in str(exc):
            status = "reference fails"
        else:
            status = "error"
        row.update(status=status, why=why)
        return
    row.update(r, status="ok" if r["parity"] else "mismatch")
    row.update(_parity_why(r))


#: seconds a fresh rank group may take to start and import what every check needs
WARM_UP_TIMEOUT = 300.0


def warm_up() -> None:
    """Run on a fresh rank group before an architecture's timed calls: the imports every check
    needs (torch.distributed.tensor, transformers, tpkit), so that ``--timeout`` measures the
    architecture, not a cold start (10 to 20 s on 2 busy cores)."""
    import transformers  # noqa: F401
    from torch.distributed.tensor import DTensor  # noqa: F401

    import tpkit  # noqa: F401
    from tpkit.plan import derive_plan  # noqa: F401


#: seconds the full-size meta checks get by default: a 300B-parameter default config's plan
#: (GLM-5-Next, Mistral-Large-4) took over 180 s on 2 busy cores
META_TIMEOUT = 900.0


def _timed_run(group, fn, *args, timeout: float) -> list:
    """``group.run(fn, *args, timeout=timeout)``; a failure it raises carries how long the call
    took (``elapsed``) and the exit codes of the rank processes it started with
    (``exitcodes``), so that `_rank_why` can tell a rank that died from one that hung."""
    procs = list(getattr(group, "procs", None) or [])
    started = time.monotonic()
    try:
        return group.run(fn, *args, timeout=timeout)
    except Exception as exc:
        exc.elapsed = time.monotonic() - started
        exc.exitcodes = [p.exitcode for p in procs]
        raise


def _rank_why(exc: BaseException, timeout: float) -> str:
    """A rank group's failure in one line. The harness says "did not finish" for three things
    told apart here: a rank that raised while the others waited for it in a collective (they
    are killed 20 s later: the raising rank's error is the cause, and the others' wait a
    collective reached by only some ranks), a rank process that died (its exit code), and a
    real timeout; else the rank's error."""
    text = str(exc)
    stuck = re.search(r"ranks? (\[[\d, ]*\]) did not finish", text)
    if stuck and "raised:" in text:
        cause = _short(text[: stuck.start()])
        return (
            f"{cause} (ranks {stuck.group(1)} were left waiting in a collective the raising "
            "rank never reached, and killed)"
        )
    elapsed = getattr(exc, "elapsed", None)
    codes = [c for c in getattr(exc, "exitcodes", []) if c is not None]  # ended on their own
    if stuck and codes and elapsed is not None and elapsed < timeout - 5:
        how = {-9: "SIGKILL: out of memory?", -11: "SIGSEGV: a crash"}
        said = ", ".join(sorted({how.get(c, f"exit code {c}") for c in codes}))
        return (
            f"a rank process died after {elapsed:.0f} s, before the {timeout:.0f} s timeout "
            f"(exit codes {codes}: {said}; a survivor is ended by the harness with SIGKILL): "
            "not a hang; the rank group was restarted"
        )
    if stuck:
        return (
            f"timed out: no answer within {timeout:.0f} s (the rank group was killed and restarted)"
        )
    return _short(exc)


def _place(order: dict, row: dict) -> tuple[int, str, str]:
    """A row's place in the report: its architecture's place in transformers' mappings."""
    key = (row["architecture"], row["class"])
    return (order.get(key, len(order)), *key)


def _write(out_dir: Path, stem: str, rows: list[dict], members: dict | None, wall: float) -> dict:
    """The report of ``rows`` (JSON and markdown), each written atomically; its summary. The
    families report where ``members`` (`family_members`) is given, else the text report."""
    if members is not None:
        summary = summarize_families(rows, wall, members)
        text = markdown_families(summary, rows)
    else:
        summary = summarize(rows, wall)
        text = markdown(summary, rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    _replace(out_dir / f"{stem}.json", json.dumps({"summary": summary, "rows": rows}, indent=1))
    _replace(out_dir / f"{stem}.md", text)
    return summary


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``
    (`os.replace` is atomic): a reader, or a run killed mid-write, sees the old file or the
    new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
            + (f" ({r['grad_rel']:.1e} of max |grad|)" if r.get("grad_rel") is not None else "")
            + (f", only one model has a gradient for {only}" if only else "")
        }
    return {}


def summarize(rows: list[dict], seconds: float) -> dict:
    text = [r for r in rows if r.get("status") != "skipped"]
    tested = [r for r in text if r.get("status") in ("ok", "mismatch", "error", "timeout")]
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
        f"projection of the logits; max |grad diff| <= {TOL} x max(1, max |grad|): relative "
        f"to the gradients' scale, shown as 'grad rel diff'): {s['gradient_parity_ok']}",
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
        PARITY_MEANS,
        "",
        "| architecture | kind | transformers plan | plan used | parity | max diff | grad diff | "
        "grad rel diff | share sharded | inferred share | full-size share | why not | "
        "full size: why below 90% | full-size config repaired |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        diff = f"{r['max_diff']:.1e}" if "max_diff" in r else ""
        gdiff = f"{r['grad_diff']:.1e}" if "grad_diff" in r else ""
        grel = f"{r['grad_rel']:.1e}" if r.get("grad_rel") is not None else ""
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
            f" | {r.get('source', '')} | {r.get('status', '')} | {diff} | {gdiff} | {grel} | "
            f"{share} | {ishare} | {full} | "
            f"{why.replace('|', '/')} | {full_why.replace('|', '/')} | "
            f"{r.get('full_size_note', '').replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def family_members() -> dict[str, set[tuple[str, str]]]:
    """Every family's (model type, class) pairs in the installed transformers, each mapping on
    its own: a class two mappings list counts in both families, whichever family's sweep ran
    it, so a family's counts do not depend on the order the sweep went in."""
    return {
        family: {(t, c) for t, c, _ in family_architectures([family])} for family, _ in FAMILIES
    }


@functools.cache
def _every_family_architecture() -> tuple[tuple[str, str, str], ...]:
    return tuple(family_architectures(None))


#: statuses of a row whose parity was not measured or did not hold
FAILED = ("mismatch", "error", "timeout", "unbuildable", "reference fails")


def _parity_ok(row: dict) -> bool:
    """tp=2 parity of the first output and of every gradient (a gradient check the unsharded
    model cannot run, Reformer's, does not count against it)."""
    return row.get("status") == "ok" and row.get("grad_parity") is not False


def summarize_families(
    rows: list[dict], seconds: float, members: dict[str, set[tuple[str, str]]] | None = None
) -> dict:
    """Per family: architectures enumerated and swept so far, tp=2 parity of the first output
    and of every gradient, >= 90% of the >=2-D weights sharded at full size, and both (issue
    29's goal); ``seconds``: this run's wall time, ``row_seconds``: the rows' own, summed over
    every resumed piece. ``members`` (`family_members`): which rows each family counts; without
    it, a row counts for the family it was swept under."""
    out: dict = {"families": {}, "seconds": round(seconds, 1)}
    for family, _ in FAMILIES:
        if members is None:
            fam = [r for r in rows if r["kind"] == family]
        else:
            fam = [r for r in rows if (r["architecture"], r["class"]) in members[family]]
        if not fam:
            continue
        ok = [r for r in fam if _parity_ok(r)]
        out["families"][family] = {
            "enumerated": len(members[family]) if members else len(fam),
            "architectures": len(fam),
            "tiny_config_broken": sum(
                1 for r in fam if r.get("status") in ("unbuildable", "reference fails")
            ),
            "timeouts": sum(1 for r in fam if r.get("status") == "timeout"),
            "parity_ok": len(ok),
            "full_size_at_least_90": sum(1 for r in fam if _full_ok(r)),
            "parity_and_full_size_90": sum(1 for r in ok if _full_ok(r)),
            "median_full_size_share": _median(
                [r["full_size_share"] for r in fam if "full_size_share" in r]
            ),
        }
    every = set().union(*members.values()) if members else None
    rows = [r for r in rows if every is None or (r["architecture"], r["class"]) in every]
    ok = [r for r in rows if _parity_ok(r)]
    out["enumerated"] = len(every) if every is not None else len(rows)
    out["architectures"] = len(rows)  # each once, however many families list it
    out["parity_ok"] = len(ok)
    out["full_size_at_least_90"] = sum(1 for r in rows if _full_ok(r))
    out["parity_and_full_size_90"] = sum(1 for r in ok if _full_ok(r))
    out["row_seconds"] = round(sum(r.get("seconds", 0) for r in rows), 1)
    return out


def markdown_families(summary: dict, rows: list[dict]) -> str:
    """The families report: one line per family (the README shows these lines), why each
    failing row fails, then `markdown`'s table of every row."""
    lines = [
        "# tpkit coverage by family (tp=2, CPU gloo; tiny configs for parity, default configs on "
        "meta for the share)",
        "",
        PARITY_MEANS,
        "",
        "| family | swept | tp=2 parity (output + every gradient) | >= 90% sharded at full size "
        "| both | tiny config broken | median full-size share |",
        "|---|---|---|---|---|---|---|",
    ]
    for family, f in summary["families"].items():
        swept = f"{f['architectures']} of {f.get('enumerated', f['architectures'])}"
        lines.append(
            f"| {family} | {swept} | {f['parity_ok']} | {f['full_size_at_least_90']} | "
            f"{f['parity_and_full_size_90']} | {f['tiny_config_broken']} | "
            f"{f['median_full_size_share']:.0%} |"
        )
    lines.append(
        f"| **all** | {summary['architectures']} of {summary.get('enumerated', '?')} | "
        f"{summary['parity_ok']} | {summary.get('full_size_at_least_90', '')} | "
        f"{summary['parity_and_full_size_90']} | | |"
    )
    lines += [
        "",
        f"Counts are of the architectures swept so far; {summary.get('row_seconds', 0)} s of "
        f"work over the rows (this run's wall time: {summary['seconds']} s).",
    ]
    elsewhere: dict[str, list[str]] = {}  # rows a run in another venv measured (timm's)
    for r in rows:
        if r.get("environment"):
            elsewhere.setdefault(r["environment"], []).append(f"{r['kind']} / {r['architecture']}")
    for env, names in elsewhere.items():
        lines += ["", f"Measured in another environment ({env}): {', '.join(names)}."]
    lines += [
        "",
        "## Why rows fail",
        "",
        "Parity: the status and its reason; full size: the share below 90% and why.",
        "",
    ]
    failing = len(lines)
    for r in rows:  # each once, under the family it was swept under
        family = r["kind"]
        if r.get("status") != "skipped":
            parts = []
            if not _parity_ok(r):
                parts.append(f"parity {r.get('status', '?')}: {r.get('why', '')}".rstrip(": "))
            if not _full_ok(r):
                share = f"{r['full_size_share']:.0%}" if "full_size_share" in r else "not planned"
                why = r.get("full_size_why") or r.get("full_size_error", "")
                parts.append(f"full size {share}" + (f": {why}" if why else ""))
            if parts:
                lines.append(
                    f"- {family} / {r['architecture']} ({r['class']}): " + "; ".join(parts)
                )
    if len(lines) == failing:
        lines.append("None.")
    table = markdown(summarize(rows, summary["seconds"]), rows).split("\n")
    start = next(i for i, ln in enumerate(table) if ln.startswith("| architecture"))
    return "\n".join([*lines, "", "## Every row", "", *table[start:]])


#: module names of a multimodal model's language side: what is not a tower (`tower_share`)
_TEXT_SIDE = ("language_model", "text_model", "lm_head", "embed_tokens")


def tower_share(model_type: str, class_name: str, tp: int = 2) -> dict:
    """The tiny family model on meta, no ranks: the plan tp would use (`derive_plan`), the share
    of its towers' >=2-D parameter elements it splits (a tower: every parameter outside the
    language model, its embeddings and head, `_TEXT_SIDE`), the share of all of them, and
    whether the trace kept to the text (`tpkit.trace.inputs.text_only`)."""
    from tpkit.plan import derive_plan, param_layouts
    from tpkit.trace import inputs as plan_inputs

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
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows already written and run only the others (the report is written "
        "after every architecture, so a killed run loses at most one row)",
    )
    parser.add_argument(
        "--retry",
        nargs="+",
        default=(),
        metavar="STATUS",
        choices=FAILED,
        help="with --resume: run rows with these statuses again (e.g. timeout error)",
    )
    parser.add_argument(
        "--towers",
        type=Path,
        help="write each --families architecture's tower share on meta (tp=2 plan) to this JSON",
    )
    parser.add_argument(
        "--timeout",
        type=int,
        default=180,
        help="seconds for an architecture's parity call on the rank group; past it the group is "
        "killed, the row says 'timeout' and the sweep goes on",
    )
    parser.add_argument(
        "--meta-timeout",
        type=int,
        default=None,
        help=f"seconds for an architecture's meta checks (full-size plan on meta; default "
        f"{META_TIMEOUT:.0f} or --timeout if longer)",
    )
    args = parser.parse_args(argv)
    if args.towers:
        names = None if not args.families or "all" in args.families else args.families
        towers(names, args.only, args.towers, args.timeout)
        return 0
    if args.markdown_only:  # the summary recomputed from the rows, as the sweep writes it
        stem = "coverage_families" if args.families else "coverage"
        data = json.loads((args.out / f"{stem}.json").read_text())
        rows, seconds = data["rows"], data["summary"].get("seconds", 0.0)
        if args.families:
            text = markdown_families(summarize_families(rows, seconds, family_members()), rows)
        else:
            text = markdown(summarize(rows, seconds), rows)
        _replace(args.out / f"{stem}.md", text)
        return 0
    summary = run(
        args.only,
        args.out,
        args.families,
        args.resume,
        args.timeout,
        tuple(args.retry),
        args.meta_timeout,
    )
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
