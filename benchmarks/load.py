"""Loading memory: peak RSS per rank over the baseline while loading the same checkpoint with
``tpkit.from_pretrained`` (tp=1/2), transformers' TP and plain ``from_pretrained``.

Plug-in point: this suite runs only when ``tpkit.from_pretrained`` exists."""

from __future__ import annotations

import gc

import torch

from benchmarks.common import make_inputs, param_bytes, peak_rss_bytes, reset_peak_rss, rss_bytes
from benchmarks.memory import MIB, _gather_max, warm_up
from benchmarks.suites import Suite
from benchmarks.systems import load_plain, load_transformers, tpkit_system


def available() -> str | None:
    import tpkit

    return None if hasattr(tpkit, "from_pretrained") else "tpkit.from_pretrained does not exist yet"


def _load_tpkit(ctx, path):
    import tpkit

    model = tpkit.from_pretrained(str(path), dtype=ctx.dtype).eval()
    return tpkit_system(model, ctx, "tpkit.from_pretrained (straight into shards)")


def run(ctx, name, path):
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
    worst, per_rank = _gather_max(figures)
    full = ctx.spec["n_params"] * torch.empty((), dtype=ctx.dtype).element_size() / MIB
    return [
        {
            **ctx.base_row(name),
            **worst,
            "load_peak_vs_full": worst["load_peak_mib"] / full,
            "load_fwd_peak_vs_full": worst["load_fwd_peak_mib"] / full,
            "per_rank": per_rank,
            "note": system.note,
        }
    ]


SUITE = Suite(
    name="load",
    title="Loading a checkpoint: peak RSS per rank",
    run=run,
    isolated=True,
    package=False,
    available=available,
    columns=[
        ("param_mib", "params MiB/rank", "f1"),
        ("load_peak_mib", "load peak MiB", "f1"),
        ("load_peak_vs_full", "peak ÷ full model", "x"),
        ("steady_mib", "after load MiB", "f1"),
        ("load_fwd_peak_mib", "load + 1st forward peak MiB", "f1"),
        ("load_fwd_peak_vs_full", "÷ full model", "x"),
    ],
    explain=(
        "One torchrun group per system: peak RSS (VmHWM) over the process baseline while "
        "loading the float32 safetensors checkpoint at the given dtype, max over ranks; `peak ÷ "
        "full model` compares it with the unsharded model's parameter bytes. transformers "
        "memory-maps safetensors, so weights it does not copy become resident only when first "
        "used: `load + 1st forward peak` (peak from the baseline through one short forward) is "
        "the comparable figure."
    ),
)
