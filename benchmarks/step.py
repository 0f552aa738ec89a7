"""Training step: zero_grad, forward with labels, backward, AdamW step."""

from __future__ import annotations

from contextlib import ExitStack

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
from benchmarks.systems import GLOO, PLAIN_ALL, all_cores, on_all_cores, training, without_shm


def run(ctx, systems):
    spec = ctx.spec
    rows = failed_rows(ctx, systems)
    x = make_inputs(ctx.cfg["vocab_size"], spec["batch"], spec["seq"])
    fns, states = {}, {}
    with ExitStack() as stack:
        for name, s in ok(systems).items():
            try:
                step, state = stack.enter_context(training(s))
                step(x)  # first step allocates AdamW state: outside the timing
                fns[name], states[name] = (lambda f=step: f(x)), state
            except Exception as e:  # noqa: BLE001 - recorded in the row
                rows.append({**ctx.base_row(name), "status": error_text(e)})
        if "tpkit" in fns and ctx.tp > 1:
            # the same model with the shm fast path off, stepped by its own AdamW at lr=0: the
            # same work, and the weights stay tpkit's (its `loss after` stays comparable)
            step, _ = stack.enter_context(training(ok(systems)["tpkit"], lr=0.0))
            without_shm(lambda f=step: f(x))
            fns[GLOO] = lambda f=step: without_shm(lambda: f(x))
        if "plain" in fns and ctx.tp > 1:
            # the limit: the unsharded model on all cores in one process, stepped by its own AdamW
            # at lr=0 (the same work; the plain row's weights and `loss after` stay its own)
            step, _ = stack.enter_context(training(ok(systems)["plain"], lr=0.0))
            on_all_cores(ctx, lambda f=step: f(x))
            fns[PLAIN_ALL] = lambda f=step: on_all_cores(ctx, lambda: f(x))
        times = time_interleaved(fns, spec["step_repeats"], spec["step_warmup"], ctx.sync)
    med = {n: median(t) for n, t in times.items()}
    for name, t in times.items():
        rows.append(
            {
                **ctx.base_row(name),
                "median_ms": med[name] * 1e3,
                "min_ms": min(t) * 1e3,
                "tokens_per_s": x.numel() / med[name],
                **timing_figures(times, name),
                "loss": states[name].get("loss") if name in states else None,
                "repeats": len(t),
                "note": "every collective on gloo; AdamW at lr=0 (the same work)"
                if name == GLOO
                else f"one process, {all_cores()} threads (rank 0); AdamW at lr=0"
                if name == PLAIN_ALL
                else "",
            }
        )
    return rows


def goals(rows):
    return time_goals(rows, "training step")


SUITE = Suite(
    name="step",
    title="Training step (forward + backward + AdamW)",
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
        ("loss", "loss after", "f3"),
    ],
    explain=(
        "Median wall time of `zero_grad(); model(input_ids=x, labels=x).loss.backward(); "
        "AdamW.step()` on batch × seq tokens, systems interleaved; the first step (which allocates "
        "the optimizer state) is not timed. Every system starts from the same weights and sees "
        "the same batch, so `loss after` should agree across systems. `plain, all cores`: the "
        "unsharded model in one process on every core (rank 0, the other ranks idle), the "
        "limit on one host. " + NOISE
    ),
)
