"""Long sequences (issue 43): peak memory per rank and step time of one training step at a length
where attention's activations dominate one process's memory, context parallelism at cp=2 (all-gather
and ring attention) against tensor parallelism at tp=2 and one process.

The model is built here from a config (seeded, the same on every rank), not the suite's
checkpoint: a small Llama with eager attention (the attention the other systems' kernels fall back
to on CPU: its B x H x T x T scores are kept for backward), 8 heads, at `LENGTH` tokens, so the
score matrices are most of what a step allocates. Each layout runs in its own torchrun group; the
figures are the max over ranks: peak RSS (VmHWM) over the process baseline during a step
(forward, backward, AdamW), and the median step time, the slowest rank's. Every layout trains the
same batch, so the first loss must agree.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

from benchmarks.common import make_inputs, median, peak_rss_bytes, reset_peak_rss, rss_bytes
from benchmarks.suites import Suite

MIB = 2**20
LENGTH = 2048
STEPS = 3
CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=1024,
    max_position_embeddings=LENGTH,
)

# name -> (ranks, tensor_parallel keywords or None for one process, label)
LAYOUTS: dict[str, tuple[int, dict | None, str]] = {
    "one": (1, None, "one process"),
    "tp2": (2, {"tp_size": 2}, "tp=2"),
    "cp2": (2, {"cp_size": 2, "cp_attention": "allgather"}, "cp=2, all-gather K/V"),
    "cp2_ring": (2, {"cp_size": 2, "cp_attention": "ring"}, "cp=2, ring"),
}


def launches(spec: dict) -> list[tuple[str, int]]:
    return [(name, ranks) for name, (ranks, _, _) in LAYOUTS.items()]


def _model(kwargs: dict | None):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(**CONFIG)
    config._attn_implementation = "eager"
    model = tf.LlamaForCausalLM(config).float().train()
    if kwargs is None:
        return model
    import tpkit

    return tpkit.tensor_parallel(model, **kwargs).train()


def run(ctx, name: str, path) -> list[dict]:
    ranks, kwargs, label = LAYOUTS[name]
    row = {
        "system": "tpkit" if kwargs else "plain",
        "tp": ranks,
        "dtype": "float32",
        "status": "ok",
        "layout": label,
        "ranks": ranks,
        "tokens": LENGTH,
    }
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != ranks:
        return [{**row, "status": f"needs {ranks} ranks, got {world}"}]
    x = make_inputs(CONFIG["vocab_size"], 1, LENGTH)
    gc.collect()
    base = rss_bytes()
    model = _model(kwargs)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    losses, times, peaks = [], [], []
    for _ in range(STEPS + 1):  # the first allocates AdamW's state: untimed
        gc.collect()
        reset_peak_rss()
        ctx.sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        ctx.sync()
        times.append(time.perf_counter() - t0)
        peaks.append((peak_rss_bytes() - base) / MIB)
        losses.append(float(loss.detach()))
    figures = {"peak_mib": max(peaks[1:]), "step_s": median(times[1:])}
    per_rank = [figures]
    if world > 1:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, figures)
    worst = {k: max(r[k] for r in per_rank) for k in figures}
    return [{**row, **worst, "step_ms": worst["step_s"] * 1e3, "first_loss": losses[0]}]


def finish(rows: list[dict]) -> list[dict]:
    one = next((r for r in rows if r.get("layout") == "one process" and r["status"] == "ok"), None)
    tp2 = next((r for r in rows if r.get("layout") == "tp=2" and r["status"] == "ok"), None)
    for r in rows:
        if r.get("status") != "ok":
            continue
        if one:
            r["peak_vs_one"] = r["peak_mib"] / one["peak_mib"]
            r["time_vs_one"] = r["step_ms"] / one["step_ms"]
        if tp2:
            r["peak_vs_tp2"] = r["peak_mib"] / tp2["peak_mib"]
    return rows


def goals(rows):
    """CP's point: at a length where attention dominates, a cp=2 rank needs no more memory than
    a tp=2 rank (TP splits attention's heads too, but not the rest of the activations)."""
    out = []
    for r in rows:
        if r.get("status") == "ok" and r["layout"].startswith("cp=2") and "peak_vs_tp2" in r:
            out.append(
                dict(
                    goal=f"longseq: step peak MiB/rank, {r['layout']} / tp=2 (issue 43)",
                    dtype=r["dtype"],
                    figure=r["peak_vs_tp2"],
                    target="<= 1.0",
                    met=r["peak_vs_tp2"] <= 1.0,
                )
            )
    return out


SUITE = Suite(
    name="longseq",
    title=f"Long sequences ({LENGTH} tokens): context parallelism, memory per rank and step time",
    run=run,
    isolated=True,
    package=False,
    launches=launches,
    finish=finish,
    goals=goals,
    columns=[
        ("layout", "layout", "str"),
        ("ranks", "ranks", "int"),
        ("tokens", "tokens", "int"),
        ("peak_mib", "step peak RSS MiB/rank", "f1"),
        ("peak_vs_one", "÷ one process", "x"),
        ("peak_vs_tp2", "÷ tp=2", "x"),
        ("step_ms", "step ms", "ms"),
        ("time_vs_one", "time ÷ one process", "x"),
        ("first_loss", "first loss", "f3"),
    ],
    explain=(
        f"A {CONFIG['num_hidden_layers']}-layer Llama (hidden {CONFIG['hidden_size']}, "
        f"{CONFIG['num_attention_heads']} heads, eager attention), batch 1 × {LENGTH} tokens: "
        "one process keeps 8 x T x T float32 attention scores per layer for backward, most of a "
        "step's memory. tp=2 splits the heads (and the weights); cp=2 splits the sequence: with "
        "all-gather each rank keeps its half of the queries' scores against every key, with the "
        "ring it keeps none (the backward recomputes one block at a time). One torchrun group per "
        "layout, one OpenMP thread per rank; peak RSS over the process baseline, the max over ranks "
        "and steps; the median of the timed steps. Separate runs: time ratios carry the machine's "
        "drift between them."
    ),
)
