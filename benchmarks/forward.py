"""Forward latency (prefill): one no-grad forward over batch x seq tokens, no KV cache."""

from __future__ import annotations

import torch

from benchmarks.common import (
    NOISE,
    error_text,
    make_inputs,
    median,
    time_goals,
    time_interleaved,
    timing_figures,
)
from benchmarks.suites import Suite, failed_rows, ok
from benchmarks.systems import GLOO, PLAIN_ALL, all_cores, on_all_cores, without_shm


def run(ctx, systems):
    spec = ctx.spec
    rows = failed_rows(ctx, systems)
    x = make_inputs(ctx.cfg["vocab_size"], spec["batch"], spec["seq"])
    fns, logits = {}, {}
    with torch.no_grad():
        for name, s in ok(systems).items():
            try:
                logits[name] = s.model(input_ids=x, use_cache=False).logits.float()
                fns[name] = lambda m=s.model: m(input_ids=x, use_cache=False)
            except Exception as e:  # noqa: BLE001 - recorded in the row
                rows.append({**ctx.base_row(name), "status": error_text(e)})
        if "tpkit" in fns and ctx.tp > 1:  # the same model with the shm fast path off
            m = ok(systems)["tpkit"].model
            logits[GLOO] = without_shm(lambda: m(input_ids=x, use_cache=False).logits.float())
            fns[GLOO] = lambda: without_shm(lambda: m(input_ids=x, use_cache=False))
        if "plain" in fns and ctx.tp > 1:  # the limit: the same model on all cores, one process
            m = ok(systems)["plain"].model
            got = on_all_cores(ctx, lambda: m(input_ids=x, use_cache=False).logits.float())
            logits[PLAIN_ALL] = got if got is not None else logits["plain"]
            fns[PLAIN_ALL] = lambda: on_all_cores(ctx, lambda: m(input_ids=x, use_cache=False))
        times = time_interleaved(fns, spec["repeats"], spec["warmup"], ctx.sync)
    med = {n: median(t) for n, t in times.items()}
    tokens = x.numel()
    for name, t in times.items():
        diff = None
        if "plain" in logits and name != "plain":
            diff = (logits[name] - logits["plain"]).abs().max().item()
        rows.append(
            {
                **ctx.base_row(name),
                "median_ms": med[name] * 1e3,
                "min_ms": min(t) * 1e3,
                "tokens_per_s": tokens / med[name],
                **timing_figures(times, name),
                "max_abs_diff": diff,
                "repeats": len(t),
                "note": getattr(ok(systems).get(name), "note", "")
                or ("every collective on gloo" if name == GLOO else "")
                or (_ALL_CORES_NOTE.format(all_cores()) if name == PLAIN_ALL else ""),
            }
        )
    return rows


_ALL_CORES_NOTE = "one process, {} threads (rank 0; the other ranks idle)"


def goals(rows):
    return time_goals(rows, "forward")


SUITE = Suite(
    name="forward",
    title="Forward latency (prefill, no grad, no KV cache)",
    run=run,
    goals=goals,
    columns=[
        ("median_ms", "median ms", "ms"),
        ("min_ms", "min ms", "ms"),
        ("tokens_per_s", "tokens/s", "int"),
        ("vs_plain", "÷ unsharded", "x"),
        ("vs_plain_all", "÷ plain, all cores", "x"),
        ("vs_plain_all_iqr", "÷ plain, all cores, IQR", "range"),
        ("vs_transformers", "÷ transformers TP", "x"),
        ("vs_transformers_iqr", "÷ transformers TP, IQR of rounds", "range"),
        ("vs_transformers_verdict", "vs transformers TP", "str"),
        ("vs_transformers_min", "÷ transformers TP (min)", "x"),
        ("max_abs_diff", "max |Δlogits| vs unsharded", "e"),
    ],
    explain=(
        "Median wall time of one forward over batch × seq tokens (`use_cache=False`, no grad), "
        "the slowest rank's, systems interleaved round by round after warm-up. Ratios are medians "
        "of per-round ratios within one run (`(min)`: ratio of best times): < 1 means faster. "
        + NOISE
        + " At tp=2 the unsharded model runs a full copy on each rank at once (one core each), so "
        "`÷ unsharded` is the TP speed-up's inverse. `plain, all cores` is the limit on one host: "
        "the unsharded model in one process with one thread per core (rank 0, the other ranks "
        "idle), in the same rounds; `÷ plain, all cores` is what TP costs against it."
    ),
)
