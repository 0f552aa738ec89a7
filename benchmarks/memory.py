"""Per-rank parameter bytes and peak RSS over the process baseline: setup, forward, train step.

Isolated: each (system, tp, dtype) runs in its own torchrun group, so one system's allocations
never hide another's (freed heap pages would be reused without raising the peak)."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import (
    goal_row,
    make_inputs,
    param_bytes,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)
from benchmarks.suites import Suite
from benchmarks.systems import LOADERS, training

MIB = 2**20


def gather_max(values: dict[str, float]) -> tuple[dict[str, float], list[dict[str, float]]]:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        per_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, values)
    else:
        per_rank = [values]
    return {k: max(r[k] for r in per_rank) for k in values}, per_rank


def warm_up(ctx, build) -> None:
    """Run the same loader, a forward and a train step on the tiny checkpoint first, so lazy
    imports, kernels and allocator pools are in the baseline, not in the figures."""
    warm = ctx.spec.get("warm_checkpoint")
    if not warm:
        return
    system = build(Path(warm))
    x = make_inputs(256, 1, 8)
    with torch.no_grad():
        system.model(input_ids=x, use_cache=False)
    with training(system) as (step, _):
        step(x)
    del system
    gc.collect()


def measure(ctx, name, build, path, note=""):
    """Build a system with ``build(path)`` and probe RSS; every figure is the max over ranks."""
    warm_up(ctx, build)
    gc.collect()
    base = rss_bytes()
    resettable = reset_peak_rss()
    system = build(path)
    figures = {
        "setup_peak_mib": (peak_rss_bytes() - base) / MIB,
        "steady_mib": (rss_bytes() - base) / MIB,
        "param_mib": param_bytes(system.rank_params or system.params) / MIB,
    }
    x = make_inputs(ctx.cfg["vocab_size"], ctx.spec["batch"], ctx.spec["seq"])
    reset_peak_rss()
    with torch.no_grad():
        system.model(input_ids=x, use_cache=False)
    figures["forward_peak_mib"] = (peak_rss_bytes() - base) / MIB
    reset_peak_rss()
    with training(system) as (step, _):
        step(x)
        figures["step_peak_mib"] = (peak_rss_bytes() - base) / MIB
    worst, per_rank = gather_max(figures)
    full = ctx.spec["n_params"] * torch.empty((), dtype=ctx.dtype).element_size() / MIB
    return [
        {
            **ctx.base_row(name),
            **worst,
            "param_fraction": worst["param_mib"] / full,
            "baseline_mib": base / MIB,
            "per_rank": per_rank,
            "peak_resettable": resettable,
            "note": note or getattr(system, "note", ""),
        }
    ]


def run(ctx, name, path):
    return measure(ctx, name, lambda p: LOADERS[name](ctx, p), path)


def goals(rows):
    """After ``tensor_parallel`` of a loaded model a rank should hold about its shards: RSS after
    setup ≤ 0.55 × the full model's parameter bytes at tp=2."""
    return [
        goal_row(
            "RSS/rank after tensor_parallel(loaded model) ÷ full model, tpkit tp=2",
            r["dtype"],
            r["steady_mib"] / (r["param_mib"] / r["param_fraction"]),
            0.55,
        )
        for r in rows
        if r["system"] == "tpkit" and r["tp"] == 2 and r["status"] == "ok" and r["param_fraction"]
    ]


SUITE = Suite(
    name="memory",
    title="Parameter bytes and peak RSS per rank",
    run=run,
    isolated=True,
    goals=goals,
    columns=[
        ("param_mib", "params MiB/rank", "f1"),
        ("param_fraction", "÷ full model", "x"),
        ("setup_peak_mib", "setup peak MiB", "f1"),
        ("steady_mib", "after setup MiB", "f1"),
        ("forward_peak_mib", "forward peak MiB", "f1"),
        ("step_peak_mib", "train-step peak MiB", "f1"),
    ],
    explain=(
        "One torchrun group per system. RSS figures are MiB over the process baseline (after "
        "imports and process-group start), the max over ranks; peaks are the kernel's VmHWM, "
        "reset (`/proc/self/clear_refs` 5) before each phase, so each phase's peak is its own "
        "(still counted from the baseline). Setup = load the checkpoint and shard it (tpkit "
        "shards a full model built on every rank; see the `load` suite for loading straight into "
        "shards); forward = one no-grad prefill; train step = one forward+backward+AdamW step "
        "including optimizer-state allocation. transformers memory-maps safetensors: weights it "
        "does not copy become resident only when first used, so a low setup peak with a high "
        "forward peak is lazy paging, not saving; compare forward and step peaks. The tensor-parallel package runs both shards in "
        "one process: its RSS is the process's, its params MiB one shard's."
    ),
)


# Planning on meta: what `tpkit plan` costs for a full-size config (issue 25, item 8). Not a
# row of the suite above: GLM-5-next's default config takes ~190 s of CPU to plan (its
# linear attention's chunk loop, run on fake tensors by each trace and dry run), too long for
# an isolated torchrun group whose barrier times out at 300 s. Run by hand:
#   .venv/bin/python -m benchmarks.memory plan-meta [TransformersClass ...]
PLAN_META_CLASSES = (
    "Glm5NextForConditionalGeneration",  # 314B, data-dependent routing: the made-up values
    "DeepseekV3ForCausalLM",
    "Llama4ForCausalLM",
    "Qwen3MoeForCausalLM",
)
#: Address space of each measuring process: a runaway plan fails there, not on the machine.
PLAN_META_CAP = 6 * 10**9


def plan_meta_peak(class_name: str, tp: int = 2) -> dict:
    """Peak RSS growth (MiB) of `derive_plan` + `validate` at ``tp`` for ``class_name``'s
    default config built on meta, over the process after the build; run in a fresh process
    (the peak is a high-water mark)."""
    import resource
    import time

    import transformers

    from tpkit.plan import derive_plan, validate

    cls = getattr(transformers, class_name)
    with torch.device("meta"):
        model = cls(cls.config_class()).float().eval()
    base = rss_bytes()
    cpu = time.process_time()
    plan = derive_plan(model, "auto", tp)
    validate(model, plan, tp)
    peak = max(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {
        "model": class_name,
        "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "plan_peak_mib": (peak - base) / MIB,
        "cpu_s": time.process_time() - cpu,
    }


def plan_meta_rows(classes=PLAN_META_CLASSES, timeout: float = 1800) -> list[dict]:
    """`plan_meta_peak` of each class in its own capped subprocess; a failure is its row's
    status."""
    import json
    import resource
    import subprocess
    import sys

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (PLAN_META_CAP, PLAN_META_CAP))

    rows = []
    for name in classes:
        cmd = [sys.executable, "-m", "benchmarks.memory", "plan-meta-one", name]
        root = Path(__file__).resolve().parent.parent
        proc = subprocess.run(
            cmd, cwd=root, capture_output=True, text=True, timeout=timeout, preexec_fn=cap
        )
        if proc.returncode == 0:
            rows.append({**json.loads(proc.stdout.strip().splitlines()[-1]), "status": "ok"})
        else:
            tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            rows.append({"model": name, "status": f"exit {proc.returncode}: {tail[:200]}"})
    return rows


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1:2] == ["plan-meta-one"]:
        print(json.dumps(plan_meta_peak(sys.argv[2])))
    elif sys.argv[1:2] == ["plan-meta"]:
        print("| model | params | plan peak RSS MiB | CPU s | status |\n|---|---|---|---|---|")
        for r in plan_meta_rows(tuple(sys.argv[2:]) or PLAN_META_CLASSES):
            print(
                f"| {r['model']} | {r.get('params_b', 0):.0f}B | "
                f"{r.get('plan_peak_mib', float('nan')):.0f} | {r.get('cpu_s', float('nan')):.0f} "
                f"| {r['status']} |"
            )
    else:
        sys.exit("usage: python -m benchmarks.memory plan-meta [TransformersClass ...]")
