"""Where a tp=2 forward, decode step and training step spend their time, against one plain process
on all the cores: ``torch.profiler`` op tables and *counted* figures (robust to a loaded machine).

    # tpkit at tp=2 (one thread per rank):
    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m benchmarks.profile_tp
    # the limit: one plain process on both cores:
    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.profile_tp

Counted per decode step and per forward: collectives (shared-memory and c10d), bytes they move,
Python function calls (``sys.setprofile``: hooks, input checks, the Python between ops) and the
profiler's op counts; the top ops by self CPU time. ``--json PATH`` writes the counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist


def _config(args):
    import transformers as tf

    return tf.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def _python_calls(fn) -> tuple[int, Counter]:
    """Python function calls made by ``fn()`` (every frame entered), and the busiest callees."""
    calls: Counter = Counter()

    def prof(frame, event, _arg):
        if event == "call":
            code = frame.f_code
            calls[f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sum(calls.values()), calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--train", action="store_true", help="also profile a training step")
    p.add_argument("--json", default="")
    p.add_argument("--no-local", action="store_true", help="skip the local_forward phases")
    args = p.parse_args(argv)

    import transformers as tf

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(_config(args)).float().eval()
    if world > 1:
        import tpkit

        model = tpkit.tensor_parallel(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, args.vocab, (args.batch, args.seq), generator=g)
    prompt = x[:1, : args.prompt]
    out: dict = {"world": world, "threads": torch.get_num_threads(), "rank": rank}

    def forward():
        with torch.no_grad():
            model(input_ids=x, use_cache=False)

    cache = {}

    def prefill():
        with torch.no_grad():
            o = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        cache["pkv"], cache["pos"] = o.past_key_values, prompt.shape[1]
        cache["tok"] = o.logits[:, -1:].argmax(-1)

    def decode():
        with torch.no_grad():
            pos = torch.tensor([cache["pos"]])
            o = model(
                input_ids=cache["tok"],
                past_key_values=cache["pkv"],
                use_cache=True,
                cache_position=pos,
                logits_to_keep=1,
            )
        cache["pos"] += 1
        cache["tok"] = o.logits[:, -1:].argmax(-1)

    opt = torch.optim.SGD(model.parameters(), lr=0.0) if args.train else None

    def step():
        model.train()
        opt.zero_grad(set_to_none=True)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        model.eval()

    phases = [("forward", forward), ("decode", decode)] + ([("step", step)] if args.train else [])
    prefill()
    _measure(phases, out, args)
    if world > 1 and not args.no_local:
        from tpkit.guards.generation import local_forward

        # as inside generate(): the hook-free modules swapped once, for every step
        with local_forward(model):
            _measure([("decode_local", decode), ("forward_local", forward)], out, args)
    if rank == 0:
        print(json.dumps(out, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _measure(phases, out: dict, args) -> None:
    """Counts, the profiler's top ops and a rough wall time of each phase, into ``out``."""
    from tpkit.parallel.shm import shm_counts

    for _name, fn in phases:  # warm-up
        fn()
    for name, fn in phases:
        before = shm_counts()
        n_py, callees = _python_calls(fn)
        after = shm_counts()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        avgs = prof.key_averages()
        ops = sum(e.count for e in avgs if not e.key.startswith("ProfilerStep"))
        top = sorted(avgs, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
        reps = 5
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        wall = (time.perf_counter() - t0) / reps
        out[name] = {
            "python_calls": n_py,
            "top_python": callees.most_common(60),
            "shm": {k: after[k] - before[k] for k in after},
            "profiler_ops": ops,
            "wall_ms": wall * 1e3,
            "top_ops": [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in top],
        }


if __name__ == "__main__":
    sys.exit(main())
