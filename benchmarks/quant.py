"""Quantized bases on TP shards: per-rank weight bytes and load peak of nf4 / int8 / fp32.

    torchrun --nproc-per-node 2 -m benchmarks.quant [--preset base] [--out benchmarks/results]

Each variant is ``tpkit.from_pretrained(path, quantization_config=...)`` of the same Llama
checkpoint (built from a preset config, never downloaded; the intermediate size is rounded up to
whole 4-bit blocks per rank). Reported per rank, max over ranks: weight bytes (local parameter
shards plus packed quantized weights and scales) ÷ the fp32 model's bytes, the peak RSS the load
added over the process baseline, and one no-grad forward's time. Rank 0 writes ``quant.json``
and ``quant.md``. Needs bitsandbytes (``pip install tpkit[quant]``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import (
    count_params,
    ensure_checkpoint,
    make_inputs,
    model_config,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)

MIB = 2**20
GOAL = 0.14  # nf4 weight bytes per rank at tp=2 over the fp32 model's
NOTE = (
    "Weights: local parameter shards plus packed quantized weights and their scales; the "
    "embedding and head stay float (transformers' default), so their share of the model bounds "
    "the ratio. Load peak: RSS over the process baseline, honest for the first variant of a "
    "process only (later ones reuse freed pages; `--variants int8` runs one alone). Forward: one "
    "no-grad pass of 64 tokens after a warm one, indicative only on a shared CPU (nf4 computes in "
    "bf16 through bitsandbytes' CPU kernels)."
)


def _variants() -> dict[str, object]:
    from transformers import BitsAndBytesConfig

    nf4 = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )
    return {"nf4": nf4, "int8": BitsAndBytesConfig(load_in_8bit=True), "fp32": None}


def _measure(path: Path, tp: int, config, x: torch.Tensor) -> dict[str, float]:
    import tpkit
    from tpkit.quant import quantized_weight_bytes

    gc.collect()
    base = rss_bytes()
    reset_peak_rss()
    model = tpkit.from_pretrained(path, tp_size=tp, dtype=torch.float32, quantization_config=config)
    figures = {
        "weight_mib": quantized_weight_bytes(model) / MIB,
        "load_peak_mib": (peak_rss_bytes() - base) / MIB,
    }
    with torch.no_grad():
        model(input_ids=x)  # warm
        start = time.perf_counter()
        model(input_ids=x)
        figures["forward_ms"] = (time.perf_counter() - start) * 1e3
    del model
    return figures


def _worst(figures: dict[str, float]) -> dict[str, float]:
    if not dist.is_initialized():
        return figures
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, figures)
    return {k: max(r[k] for r in per_rank) for k in figures}


def run(preset: str, vocab: int | None, variants: list[str] | None = None) -> dict:
    """Every variant at this run's world size (the tp size); rows plus the nf4 goal."""
    import bitsandbytes  # noqa: F401 - imported before any baseline, not inside one variant

    cfg = model_config(preset, {"vocab_size": vocab})
    block = 64 * 2  # whole 4-bit blocks per rank at tp=2
    cfg["intermediate_size"] = -(-cfg["intermediate_size"] // block) * block
    tp = dist.get_world_size() if dist.is_initialized() else 1
    if tp > 1 and dist.get_rank() == 0:
        ensure_checkpoint(cfg)  # written once, before the other ranks look for it
    if tp > 1:
        dist.barrier()
    path = ensure_checkpoint(cfg)
    full = count_params(cfg) * 4 / MIB
    x = make_inputs(cfg["vocab_size"], 1, 64)
    rows = []
    for name, config in _variants().items():
        if variants and name not in variants:
            continue
        worst = _worst(_measure(path, tp, config, x))
        rows.append({"variant": name, "tp": tp, **worst, "fraction": worst["weight_mib"] / full})
    nf4 = next((r for r in rows if r["variant"] == "nf4" and r["tp"] == 2), None)
    goal = None
    if nf4 is not None:
        goal = {"figure": nf4["fraction"], "target": GOAL, "met": nf4["fraction"] <= GOAL}
    return {"preset": preset, "config": cfg, "fp32_model_mib": full, "rows": rows, "goal": goal}


def markdown(result: dict) -> str:
    lines = [
        f"# Quantized bases per rank ({result['preset']}, fp32 model "
        f"{result['fp32_model_mib']:.1f} MiB)",
        "",
        "| variant | tp | weights MiB/rank | ÷ fp32 model | load peak MiB | forward ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['variant']} | {r['tp']} | {r['weight_mib']:.2f} | {r['fraction']:.3f} | "
            f"{r['load_peak_mib']:.1f} | {r['forward_ms']:.1f} |"
        )
    g = result["goal"]
    if g is not None:
        lines += [
            "",
            f"nf4 ÷ fp32 at tp=2: {g['figure']:.3f} (goal <= {g['target']}, met: {g['met']})",
        ]
    lines += ["", NOTE]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument(
        "--vocab",
        type=int,
        default=4096,
        help="vocabulary (embedding and head stay float: 4096 gives base ~11%% of the "
        "parameters there, Llama-2-7B has ~4%%)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--variants", default="", help="comma list of nf4,int8,fp32 (default all)")
    args = parser.parse_args(argv)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    result = run(args.preset, args.vocab, [v for v in args.variants.split(",") if v])
    if not dist.is_initialized() or dist.get_rank() == 0:
        text = markdown(result)
        print(text)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "quant.json").write_text(json.dumps(result, indent=1, default=str))
            (args.out / "quant.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
