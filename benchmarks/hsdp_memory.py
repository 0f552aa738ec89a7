"""Training state per rank and step time at 4 ranks: FSDP2 (dp_shard=4) vs HSDP (dp_replicate=2
x dp_shard=2) vs whole replicas at tp=1, and HSDP dp_replicate=2 x tp=2 vs FSDP2 x TP (dp_shard=2
x tp=2) (issue 41).

What each rank holds after the AdamW steps, counted from the tensors (local shards): parameters,
gradients and AdamW's two moments, the figures sharding changes (activations are the same in
every layout at one tp). Exact byte counts. The step time (forward, backward, AdamW on a global
batch of 8 x 128 tokens) is the median of the timed steps after one untimed warm-up step (which
allocates AdamW's state), the slowest rank's; every layout is built first and their steps are
interleaved round by round, so a ratio between two layouts carries little of the machine's drift.
"step ÷ FSDP2" divides by FSDP2 at the same tp (FSDP2 4 at tp=1, FSDP2 x TP at tp=2). One
torchrun group, every layout on the same model and the same 4 ranks:

    torchrun --nproc-per-node 4 -m benchmarks.hsdp_memory [--preset small]

Rank 0 writes benchmarks/results/hsdp_memory.{json,md}. `make bench` runs the same measurement as
the launched suite `hsdp` (one 4-rank group, the --train-size preset).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import count_params, make_inputs, median, model_config
from benchmarks.suites import Suite

__all__ = ["LAYOUTS", "SUITE", "main", "measure"]

MIB = 2**20
STEPS = 3
BATCH, SEQ = 8, 128

#: name -> tensor_parallel keywords (4 ranks)
LAYOUTS = {
    "replicas (sharded=False)": dict(dp_size=4, sharded=False),
    "replicas (FSDP2, (4, 1) mesh)": dict(dp_replicate_size=4),
    "HSDP 2 x 2": dict(dp_replicate_size=2, dp_shard_size=2),
    "FSDP2 4": dict(dp_shard_size=4),
    "HSDP 2 x tp2": dict(dp_replicate_size=2, dp_shard_size=1, tp_size=2),
    "FSDP2 2 x tp2": dict(dp_shard_size=2, tp_size=2),
}
#: the layout each one's step time is divided by: FSDP2 at the same tp
BASELINE = {1: "FSDP2 4", 2: "FSDP2 2 x tp2"}


def _local_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        local = getattr(t, "_local_tensor", t)
        total += local.numel() * local.element_size()
    return total


def _setup(cfg: dict, kwargs: dict, dtype: torch.dtype):
    """The model split with ``kwargs``, its AdamW and this rank's part of the global batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import tpkit

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(dtype).train()
    model = tpkit.tensor_parallel(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dp_mesh = tpkit.get_mesh(tpkit.tp_state(model).mesh, "dp")
    x = make_inputs(cfg["vocab_size"], BATCH, SEQ).chunk(dp_mesh.size())[dp_mesh.get_local_rank()]
    return model, opt, x


def _step(model, opt, x) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    dist.barrier()  # the slowest rank's step
    return (time.perf_counter() - t0) * 1e3


def measure(
    cfg: dict, layouts: dict = LAYOUTS, steps: int = STEPS, dtype: torch.dtype = torch.float32
) -> list[dict]:
    """One row per layout: bytes of the fullest rank after 1 + ``steps`` AdamW steps of a Llama
    ``cfg``, the median step time (ms, slowest rank) and ÷ FSDP2 at the same tp."""
    built = {name: _setup(cfg, kw, dtype) for name, kw in layouts.items()}
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for i in range(steps + 1):  # round 0 allocates AdamW's state: untimed
        for name, (model, opt, x) in built.items():
            t = _step(model, opt, x)
            if i:
                times[name].append(t)
    rows = []
    for name, (model, opt, _) in built.items():
        params = list(model.parameters())
        moments = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
        figures = [_local_bytes(params), _local_bytes(p.grad for p in params)]
        figures += [_local_bytes(moments), 0, median(times[name])]
        figures[3] = sum(figures[:3])
        figures = torch.tensor(figures, dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the fullest / slowest rank
        row = dict(zip(("params", "grads", "adam", "total"), (int(v) for v in figures[:4])))
        tp = layouts[name].get("tp_size", 1)
        rows.append({"layout": name, "tp": tp, **row, "step_ms": float(figures[4])})
    by = {r["layout"]: r for r in rows}
    for r in rows:
        base = by.get(BASELINE.get(r["tp"], ""))
        r["step_vs_fsdp"] = r["step_ms"] / base["step_ms"] if base else None
    return rows


def _markdown(rows: list[dict], preset: str, n_params: int) -> str:
    base = next(r for r in rows if r["layout"] == "replicas (sharded=False)")["total"]
    lines = [
        f"# Training state per rank at 4 ranks (Llama '{preset}', {n_params / 1e6:.1f}M params, "
        "float32, AdamW)",
        "",
        "| layout | tp | params MiB | grads MiB | AdamW MiB | total MiB | vs replicas | step ms "
        "| step ÷ FSDP2 (same tp) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs = f"{r['step_vs_fsdp']:.2f}x" if r["step_vs_fsdp"] is not None else "-"
        lines.append(
            f"| {r['layout']} | {r['tp']} | {r['params'] / MIB:.1f} | {r['grads'] / MIB:.1f} | "
            f"{r['adam'] / MIB:.1f} | {r['total'] / MIB:.1f} | {r['total'] / base:.2f}x | "
            f"{r['step_ms']:.0f} | {vs} |"
        )
    lines += [
        "",
        f"Bytes of the local tensors on the fullest rank after {STEPS + 1} steps (exact; "
        "activations, the same in every layout at one tp, left out). Step time: median of "
        f"{STEPS} steps after a warm-up, the slowest rank's, layouts interleaved round by round; "
        "CPU (gloo), for the ratios, not the absolute figures.",
    ]
    return "\n".join(lines) + "\n"


# ---- the `hsdp` suite of `make bench` ----------------------------------------------------------


def launches(spec: dict) -> list[tuple[str, int]]:
    return [("tpkit", 4)]


def run(ctx, name: str, path) -> list[dict]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != 4:
        return [{**ctx.base_row(name), "status": f"needs 4 ranks, got {world}"}]
    rows = measure(ctx.cfg, dtype=ctx.dtype, steps=ctx.spec.get("train_steps") or STEPS)
    out = []
    for r in rows:
        mib = {k + "_mib": r.pop(k) / MIB for k in ("params", "grads", "adam", "total")}
        out.append({**ctx.base_row(name), **r, **mib, "ranks": 4})
    full = next(r for r in out if r["layout"] == "replicas (sharded=False)")["total_mib"]
    for r in out:
        r["vs_replicas"] = r["total_mib"] / full
    return out


SUITE = Suite(
    name="hsdp",
    title="HSDP against FSDP2 and replicas at 4 ranks: training state per rank and step time",
    run=run,
    isolated=True,
    package=False,
    launches=launches,
    train_model=True,
    columns=[
        ("layout", "layout", "str"),
        ("params_mib", "params MiB/rank", "f1"),
        ("grads_mib", "grads MiB/rank", "f1"),
        ("adam_mib", "AdamW MiB/rank", "f1"),
        ("total_mib", "total MiB/rank", "f1"),
        ("vs_replicas", "÷ replicas", "x"),
        ("step_ms", "step ms", "ms"),
        ("step_vs_fsdp", "step ÷ FSDP2 (same tp; FSDP2 × TP at tp=2)", "x"),
    ],
    explain=__doc__.split("\n\n", 1)[1].split("\n\n    torchrun")[0],
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    if dist.get_world_size() != 4:
        raise SystemExit("run on 4 ranks: torchrun --nproc-per-node 4 -m benchmarks.hsdp_memory")
    cfg = model_config(a.preset)
    rows = measure(cfg, steps=a.steps)
    if dist.get_rank() == 0:
        n = count_params(cfg)
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        payload = {"preset": a.preset, "ranks": 4, "n_params": n, "steps": a.steps, "rows": rows}
        (out / "hsdp_memory.json").write_text(json.dumps(payload, indent=2) + "\n")
        (out / "hsdp_memory.md").write_text(_markdown(rows, a.preset, n))
        print(_markdown(rows, a.preset, n))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
