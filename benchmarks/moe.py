"""A mixture of experts at ep=2 against tp=2, transformers' own EP and one process (issue 42).

A small Qwen3-MoE (`MOE`: 8 experts of width 256, top-2, every layer MoE; ~11M parameters) is
saved once and loaded by every layout, each in its own torchrun group (`LAYOUTS`):

- ``tpkit_ep2``: ``tpkit.from_pretrained(ckpt, ep_size=2)``: attention split by TP over the 2
  ranks, whole experts placed over the same 2 (4 each), each routed pair run on its expert's
  rank (all-reduce dispatch: both ranks hold the batch);
- ``tpkit_tp2``: ``tpkit.from_pretrained(ckpt, tp_size=2)``: every expert split along its
  intermediate width (each rank runs all 8 experts at half width);
- ``transformers_ep2``: ``from_pretrained(ckpt, distributed_config=DistributedConfig(tp_size=2,
  ep_size=2))``;
- ``plain``: the model in one process with 2 intra-op threads (the same 2 cores), and with 1
  (``plain_1thread``: on a busy 2-core machine, 2 OpenMP threads spin against the other load
  and lose 50x; measured here, so both are shown).

Per layout: the forward (batch x seq tokens, no grad), a training step (forward, backward and
AdamW on the causal-LM loss with the router aux loss) and greedy decode (tokens/s), medians of
the repeats, the slowest rank's; the greedy tokens must equal the one-process model's.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import cache_root, make_inputs, median
from benchmarks.suites import Suite

#: the benchmarked MoE: Qwen3-MoE, every layer sparse
MOE = dict(
    hidden_size=256,
    intermediate_size=704,
    moe_intermediate_size=256,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    vocab_size=8000,
    max_position_embeddings=2048,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    output_router_logits=True,
    tie_word_embeddings=False,
)
#: name -> (ranks, label)
LAYOUTS = {
    "tpkit_ep2": (2, "tpkit ep=2 (tp=2 attention, 4 whole experts per rank)"),
    "tpkit_tp2": (2, "tpkit tp=2 (every expert split in width)"),
    "transformers_ep2": (2, "transformers DistributedConfig(tp_size=2, ep_size=2)"),
    "plain": (1, "one process, 2 threads"),
    "plain_1thread": (1, "one process, 1 thread"),
}


def launches(spec: dict) -> list[tuple[str, int]]:
    return [(name, ranks) for name, (ranks, _) in LAYOUTS.items()]


def ensure_moe_checkpoint(seed: int = 0) -> Path:
    """The MoE saved once (float32 safetensors); every layout loads it. Rank 0 writes."""
    import transformers as tf

    key = hashlib.sha1(json.dumps({"cfg": MOE, "seed": seed}, sort_keys=True).encode())
    path = cache_root() / f"qwen3moe-{key.hexdigest()[:12]}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not (path / "config.json").exists():
        torch.manual_seed(seed)
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**MOE)).float()
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()
    return path


def _load(name: str, path: Path, dtype: torch.dtype):
    import transformers as tf

    if name == "tpkit_ep2":
        import tpkit

        return tpkit.from_pretrained(path, dtype=dtype, ep_size=2)
    if name == "tpkit_tp2":
        import tpkit

        return tpkit.from_pretrained(path, dtype=dtype, tp_size=2)
    if name == "transformers_ep2":
        from transformers.distributed import DistributedConfig

        config = DistributedConfig(tp_size=2, ep_size=2)
        return tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=config)
    torch.set_num_threads(1 if name == "plain_1thread" else 2)  # 2: the 2-rank layouts' cores
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def _timed(ctx, fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        ctx.sync()
        t0 = time.perf_counter()
        fn()
        ctx.sync()
        times.append(time.perf_counter() - t0)
    return times


def _slowest(values: dict) -> dict:
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, values)
        return {k: max(v[k] for v in every) for k in values}
    return values


def run(ctx, name: str, path: Path) -> list[dict]:
    spec = ctx.spec
    ranks, label = LAYOUTS[name]
    row = {**ctx.base_row(name), "layout": label, "ranks": ranks}
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != ranks:
        return [{**row, "status": f"needs {ranks} ranks, got {world}"}]
    ckpt = ensure_moe_checkpoint()
    model = _load(name, ckpt, ctx.dtype).eval()
    model.generation_config.pad_token_id = 0
    x = make_inputs(MOE["vocab_size"], spec["batch"], spec["seq"])
    prompt = make_inputs(MOE["vocab_size"], spec["gen_batch"], spec["prompt_len"], seed=2)
    new = spec["new_tokens"]
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    with torch.no_grad():
        model(input_ids=x)  # warm-up
        tokens = model.generate(prompt, **kw)
        fwd = _timed(ctx, lambda: model(input_ids=x), spec["repeats"])
        dec = _timed(ctx, lambda: model.generate(prompt, **kw), spec["gen_repeats"])
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step():
        opt.zero_grad(set_to_none=True)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()

    step()  # allocates the optimizer state
    steps = _timed(ctx, step, spec["step_repeats"])
    figures = _slowest(
        {
            "forward_ms": median(fwd) * 1e3,
            "step_ms": median(steps) * 1e3,
            "decode_tok_s": new * spec["gen_batch"] / median(dec),
        }
    )
    return [{**row, **figures, "tokens": tokens.flatten().tolist()}]


def finish(rows: list[dict]) -> list[dict]:
    """Ratios to tpkit tp=2 and to transformers' EP, and whether each layout's greedy tokens
    equal the one-process model's."""
    by = {r["system"]: r for r in rows if r.get("status") == "ok"}
    plain, tp2, tf = by.get("plain"), by.get("tpkit_tp2"), by.get("transformers_ep2")
    for r in rows:
        if r.get("status") != "ok":
            continue
        if plain:
            r["same_tokens"] = r.get("tokens") == plain.get("tokens")
            r["step_vs_plain"] = r["step_ms"] / plain["step_ms"]
        for ref, tag in ((tp2, "tp2"), (tf, "transformers")):
            if ref:
                r[f"forward_vs_{tag}"] = r["forward_ms"] / ref["forward_ms"]
                r[f"step_vs_{tag}"] = r["step_ms"] / ref["step_ms"]
                r[f"decode_vs_{tag}"] = r["decode_tok_s"] / ref["decode_tok_s"]
    for r in rows:
        r.pop("tokens", None)
    return rows


SUITE = Suite(
    name="moe",
    title="A mixture of experts: ep=2 against tp=2, transformers' EP and one process",
    run=run,
    isolated=True,
    package=False,
    launches=launches,
    finish=finish,
    columns=[
        ("layout", "layout", "str"),
        ("ranks", "ranks", "int"),
        ("forward_ms", "forward ms", "ms"),
        ("step_ms", "step ms", "ms"),
        ("decode_tok_s", "decode tok/s", "f1"),
        ("forward_vs_tp2", "forward ÷ tp2", "x"),
        ("step_vs_tp2", "step ÷ tp2", "x"),
        ("decode_vs_tp2", "decode ÷ tp2", "x"),
        ("forward_vs_transformers", "forward ÷ transformers EP", "x"),
        ("decode_vs_transformers", "decode ÷ transformers EP", "x"),
        ("same_tokens", "greedy tokens = one process", "str"),
    ],
    explain=(
        "A Qwen3-MoE of 8 experts (width 256, top-2, 4 layers, hidden 256, ~11M parameters), "
        "saved once and loaded by each layout in its own torchrun group, one OpenMP thread per "
        "rank; the one-process layout uses 2 threads (the same 2 cores). Forward: batch x seq "
        "tokens without grad; step: forward, backward and AdamW on the causal-LM loss with the "
        "router aux loss; decode: greedy tokens per second after a prompt. Medians of the "
        "repeats, the slowest rank's. Ratios below 1 (times) / above 1 (tok/s) favour the row. "
        "Layouts run one after another: their ratios carry the machine's drift between runs."
    ),
)
