"""Loading memory: peak RSS per rank over the baseline while loading a checkpoint with
``tpkit.from_pretrained`` (tp=1/2), transformers' TP and plain ``from_pretrained``.

Each (system, tp, dtype, checkpoint) is its own torchrun group (`launches`), so one load's freed
heap never hides the next one's peak. Checkpoints: the float32 one-file checkpoint every suite
uses, and derived from it (in the launching process, before any run) a bfloat16 copy and sharded
copies of both (``model-0000k-of-0000n.safetensors`` + index), so the suite covers float32 and
bfloat16 as stored, float32 read into bfloat16 parameters, one file and sharded. tpkit's goal is
the physical limit: a rank holds its shard, so its peak is ≤ 1.05 × its parameter bytes + 16 MiB.

Plug-in point: this suite runs only when ``tpkit.from_pretrained`` exists."""

from __future__ import annotations

import dataclasses
import gc
import json
import shutil
from pathlib import Path

import torch

from benchmarks.common import (
    DTYPES,
    goal_row,
    make_inputs,
    param_bytes,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)
from benchmarks.memory import MIB, gather_max, warm_up
from benchmarks.suites import Suite
from benchmarks.systems import load_plain, load_transformers, tpkit_system

# checkpoint variant -> (stored dtype, shards)
CHECKPOINTS = {"f32": ("float32", 1), "f32-sharded": ("float32", 4), "bf16": ("bfloat16", 1)}
CHECKPOINTS["bf16-sharded"] = ("bfloat16", 4)
CKPT_LABELS = {
    "f32": "float32, 1 file",
    "f32-sharded": "float32, 4 files",
    "bf16": "bfloat16, 1 file",
    "bf16-sharded": "bfloat16, 4 files",
}
SLACK_MIB = 16  # the goal's allowance over 1.05 x the rank's parameter bytes


def available() -> str | None:
    import tpkit

    return None if hasattr(tpkit, "from_pretrained") else "tpkit.from_pretrained does not exist yet"


def variant_dir(base: Path, variant: str) -> Path:
    return base if variant == "f32" else base.with_name(f"{base.name}-{variant}")


def ensure_variant(base: Path, variant: str) -> Path:
    """The float32 checkpoint ``base`` stored as ``variant`` (dtype, number of files), made once."""
    from safetensors.torch import load_file, save_file

    out = variant_dir(base, variant)
    if out == base or (out / "config.json").exists():
        return out
    dtype, shards = CHECKPOINTS[variant]
    tensors = {
        k: v.to(DTYPES[dtype]) for k, v in load_file(str(base / "model.safetensors")).items()
    }
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in ("config.json", "generation_config.json"):
        if (base / f).exists():
            shutil.copy(base / f, tmp / f)
    if shards == 1:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        keys = list(tensors)
        weight_map = {}
        for i in range(shards):
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k] for k in keys[i::shards]}
            save_file(part, str(tmp / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, name))
        index = {"metadata": {}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    tmp.rename(out)
    return out


def launches(spec: dict) -> list[tuple[str, int]]:
    """Runs ``system/dtype/checkpoint`` at each TP size asked; the checkpoints are made here.

    Every variant runs in the first ``--isolated-dtype`` pass (it names its own dtype)."""
    if spec["dtype"] != spec["isolated_dtype"][0]:
        return []
    base = Path(spec["checkpoint"])
    systems, tps = spec["systems"], spec["tp"]
    runs = []
    if 1 in tps:
        runs += [("plain/float32/f32", 1), ("tpkit/float32/f32", 1)]
    for tp in (t for t in tps if t > 1):
        runs += [(f"tpkit/float32/{c}", tp) for c in ("f32", "f32-sharded")]
        runs += [(f"tpkit/bfloat16/{c}", tp) for c in ("bf16", "bf16-sharded", "f32")]
        runs += [
            (f"transformers/{d}/{c}", tp) for d, c in (("float32", "f32"), ("bfloat16", "bf16"))
        ]
    runs = [(n, t) for n, t in runs if n.split("/")[0] in systems]
    for variant in {n.split("/")[2] for n, _ in runs}:
        ensure_variant(base, variant)
    return runs


def _load_tpkit(ctx, path):
    import tpkit

    model = tpkit.from_pretrained(str(path), dtype=ctx.dtype).eval()
    return tpkit_system(model, ctx, "tpkit.from_pretrained (straight into shards)")


def run(ctx, run_name, path):
    name, dtype, variant = run_name.split("/")
    ctx = dataclasses.replace(ctx, dtype=DTYPES[dtype], dtype_name=dtype)
    path = variant_dir(Path(path), variant)
    loaders = {"plain": load_plain, "tpkit": _load_tpkit, "transformers": load_transformers}
    warm_up(ctx, lambda p: loaders[name](ctx, p))
    gc.collect()
    base = rss_bytes()
    reset_peak_rss()
    system = loaders[name](ctx, path)
    figures = {
        "load_peak_mib": (peak_rss_bytes() - base) / MIB,
        "steady_mib": (rss_bytes() - base) / MIB,
        "param_mib": param_bytes(system.params) / MIB,
    }
    # transformers memory-maps safetensors: weights it does not copy become resident only when
    # first used, so the peak through one forward is the comparable figure.
    x = make_inputs(ctx.cfg["vocab_size"], 1, 8)
    reset_peak_rss()
    with torch.no_grad():
        system.model(input_ids=x, use_cache=False)
    figures["load_fwd_peak_mib"] = (peak_rss_bytes() - base) / MIB
    worst, per_rank = gather_max(figures)
    full = ctx.spec["n_params"] * torch.empty((), dtype=ctx.dtype).element_size() / MIB
    limit = 1.05 * worst["param_mib"] + SLACK_MIB
    return [
        {
            **ctx.base_row(name),
            "checkpoint": CKPT_LABELS[variant],
            **worst,
            "load_peak_vs_params": worst["load_peak_mib"] / worst["param_mib"],
            "load_peak_vs_limit": worst["load_peak_mib"] / limit,
            "load_peak_vs_full": worst["load_peak_mib"] / full,
            "load_fwd_peak_vs_full": worst["load_fwd_peak_mib"] / full,
            "per_rank": per_rank,
            "note": system.note,
        }
    ]


def goals(rows):
    return [
        goal_row(
            f"load peak RSS/rank ÷ (1.05 × its params + {SLACK_MIB} MiB), tpkit tp={r['tp']}, "
            f"{r['checkpoint']}",
            r["dtype"],
            r["load_peak_vs_limit"],
            1.0,
        )
        for r in rows
        if r["system"] == "tpkit" and r["status"] == "ok" and r.get("load_peak_vs_limit")
    ]


SUITE = Suite(
    name="load",
    title="Loading a checkpoint: peak RSS per rank",
    run=run,
    isolated=True,
    package=False,
    available=available,
    launches=launches,
    goals=goals,
    columns=[
        ("checkpoint", "checkpoint", "str"),
        ("param_mib", "params MiB/rank", "f1"),
        ("load_peak_mib", "load peak MiB", "f1"),
        ("load_peak_vs_params", "peak ÷ params/rank", "x"),
        ("load_peak_vs_limit", "peak ÷ (1.05·params + 16 MiB)", "x"),
        ("load_peak_vs_full", "peak ÷ full model", "x"),
        ("steady_mib", "after load MiB", "f1"),
        ("load_fwd_peak_mib", "load + 1st forward peak MiB", "f1"),
        ("load_fwd_peak_vs_full", "÷ full model", "x"),
    ],
    explain=(
        "One torchrun group per (system, tp, dtype, checkpoint): peak RSS (VmHWM) over the "
        "process baseline (after the same loader, a forward and a train step on a tiny model, so "
        "imports and kernels are in the baseline) while loading, max over ranks. `peak ÷ "
        "(1.05·params + 16 MiB)` ≤ 1 is tpkit's goal (a rank must hold its shard); `peak ÷ full "
        "model` compares with the unsharded model's parameter bytes at that dtype. A bfloat16 "
        "row from a float32 checkpoint converts as it reads. transformers memory-maps "
        "safetensors, so weights it does not copy become resident only when first used: `load + "
        "1st forward peak` is the comparable figure."
    ),
)
