"""Training-state memory per rank at 4 ranks: FSDP2 (dp_shard=4) vs HSDP (dp_replicate=2 x
dp_shard=2) vs whole replicas (FSDP2 over a (4, 1) mesh, and tpkit's plain replicas).

What each rank holds after one AdamW step, counted from the tensors (local shards): parameters,
gradients and AdamW's two moments, the figures sharding changes (activations are the same in
every layout). Exact byte counts, not timings; the step time is shown for scale only (CPU, the
machine's other load). One torchrun group, every layout in turn on the same model:

    torchrun --nproc-per-node 4 -m benchmarks.hsdp_memory [--preset small]

Rank 0 writes benchmarks/results/hsdp_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import make_inputs, model_config

__all__ = ["LAYOUTS", "main", "measure"]

#: name -> tensor_parallel keywords (4 ranks, tp=1: the data axes alone)
LAYOUTS = {
    "replicas (sharded=False)": dict(dp_size=4, sharded=False),
    "replicas (FSDP2, (4, 1) mesh)": dict(dp_replicate_size=4),
    "HSDP 2 x 2": dict(dp_replicate_size=2, dp_shard_size=2),
    "FSDP2 4": dict(dp_shard_size=4),
}


def _local_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        local = getattr(t, "_local_tensor", t)
        total += local.numel() * local.element_size()
    return total


def measure(preset: str, kwargs: dict, steps: int = 3) -> dict:
    """Bytes this rank holds after ``steps`` AdamW steps of a Llama ``preset`` split with
    ``kwargs``, and the median step time (ms)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import tpkit

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**model_config(preset))).train()
    model = tpkit.tensor_parallel(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dp_mesh = tpkit.get_mesh(tpkit.tp_state(model).mesh, "dp")
    x = make_inputs(model.config.vocab_size, 8, 128).chunk(dp_mesh.size())[dp_mesh.get_local_rank()]
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
    params = list(model.parameters())
    moments = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    out = {
        "params": _local_bytes(params),
        "grads": _local_bytes(p.grad for p in params),
        "adam": _local_bytes(moments),
    }
    out["total"] = sum(out.values())
    figures = torch.tensor(
        [out[k] for k in ("params", "grads", "adam", "total")], dtype=torch.float64
    )
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the fullest rank
    row = dict(zip(("params", "grads", "adam", "total"), (int(v) for v in figures.tolist())))
    row["step_ms"] = sorted(times)[len(times) // 2]
    return row


def _markdown(rows: list[dict], preset: str, n_params: int) -> str:
    base = next(r for r in rows if r["layout"] == "replicas (sharded=False)")["total"]
    mib = 2**20
    lines = [
        f"# Training state per rank at 4 ranks (Llama '{preset}', {n_params / 1e6:.1f}M params, "
        "float32, AdamW)",
        "",
        "| layout | params MiB | grads MiB | AdamW MiB | total MiB | vs replicas | step ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['params'] / mib:.1f} | {r['grads'] / mib:.1f} | "
            f"{r['adam'] / mib:.1f} | {r['total'] / mib:.1f} | {r['total'] / base:.2f}x | "
            f"{r['step_ms']:.0f} |"
        )
    lines += [
        "",
        "Bytes of the local tensors on the fullest rank after 3 steps (exact; activations, the same "
        "in every layout, left out). Step time: median of 3, CPU, for scale only.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    if dist.get_world_size() != 4:
        raise SystemExit("run on 4 ranks: torchrun --nproc-per-node 4 -m benchmarks.hsdp_memory")
    rows = [{"layout": name, **measure(a.preset, kw)} for name, kw in LAYOUTS.items()]
    if dist.get_rank() == 0:
        from transformers import LlamaConfig, LlamaForCausalLM

        with torch.device("meta"):
            n = sum(
                p.numel()
                for p in LlamaForCausalLM(LlamaConfig(**model_config(a.preset))).parameters()
            )
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        payload = {"preset": a.preset, "ranks": 4, "n_params": n, "rows": rows}
        (out / "hsdp_memory.json").write_text(json.dumps(payload, indent=2) + "\n")
        (out / "hsdp_memory.md").write_text(_markdown(rows, a.preset, n))
        print(_markdown(rows, a.preset, n))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
