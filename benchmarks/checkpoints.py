"""Training with a checkpoint every N steps: no saves, synchronous saves, background saves (issue 45).

One torchrun group of 2 ranks trains the `--train-size` model at tp=2 (AdamW). A timed block is
one save interval: `SAVE_EVERY` training steps and one `tpkit.save_checkpoint` of model and
optimizer (its own directory per mode, replaced atomically each time):

- ``no saves``: the steps alone;
- ``sync saves``: the steps, then ``save_checkpoint(...)``, which returns once the checkpoint is
  on disk (fsynced) and swapped in;
- ``async saves``: ``save_checkpoint(..., async_save=True)`` first, which returns once the state
  is copied to CPU memory, then the steps while it is written, then ``wait_for_checkpoint()``
  (so the block owns its whole save: none spills into the next mode's block).

The modes run interleaved (a round runs each once, the order rotating), each time the slowest
rank's; ``step ms`` is the block time ÷ ``SAVE_EVERY``, ratios are medians of per-round ratios
with their IQR. ``blocked ms / save`` is the time the training loop spent inside the save calls
(and, async, the final wait): what a save costs the loop. On a host whose cores all train, the
background write takes CPU time from the steps, so the step time with async saves need not
drop below sync's; the blocked time does (the goal).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import (
    goal_row,
    make_inputs,
    median,
    noise_verdict,
    paired_ratio,
    ratio_spread,
)
from benchmarks.suites import Suite
from benchmarks.systems import _load_hf

MIB = 2**20
SAVE_EVERY = 4
MODES = {"none": "no saves", "sync": "sync saves", "async": "async saves"}


def launches(spec: dict) -> list[tuple[str, int]]:
    return [("tpkit_tp2", 2)]


def _dir_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / MIB


def run(ctx, name: str, path: Path) -> list[dict]:
    import tpkit

    spec = ctx.spec
    world = dist.get_world_size() if dist.is_initialized() else 1
    base = {**ctx.base_row("tpkit"), "model": f"{spec['n_params'] / 1e6:.1f}M"}
    if world != 2:
        return [{**base, "status": f"needs 2 ranks, got {world}"}]
    model = tpkit.tensor_parallel(_load_hf(path, ctx.dtype)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = make_inputs(ctx.cfg["vocab_size"], spec["batch"], spec["seq"])
    root = Path(spec["out"]).parent / "checkpoints"
    blocked: dict[str, list[float]] = {m: [] for m in MODES}

    def steps() -> None:
        for _ in range(SAVE_EVERY):
            opt.zero_grad(set_to_none=True)
            model(input_ids=x, labels=x).loss.backward()
            opt.step()

    def block(mode: str):
        def fn() -> None:
            t = 0.0
            if mode == "async":
                t0 = time.perf_counter()
                tpkit.save_checkpoint(root / mode, model, opt, step=0, async_save=True)
                t += time.perf_counter() - t0
            steps()
            t0 = time.perf_counter()
            if mode == "sync":
                tpkit.save_checkpoint(root / mode, model, opt, step=0)
            elif mode == "async":
                tpkit.wait_for_checkpoint()
            t += time.perf_counter() - t0
            blocked[mode].append(t)

        return fn

    from benchmarks.common import time_interleaved

    fns = {m: block(m) for m in MODES}
    rounds = max(5, spec.get("step_repeats", 3))
    times = time_interleaved(fns, rounds, warmup=1, sync=ctx.sync)
    size = _dir_mib(root / "sync") if ctx.rank == 0 else None
    rows = []
    for mode, label in MODES.items():
        per_step = [t / SAVE_EVERY for t in times[mode]]
        row = {
            **base,
            "layout": label,
            "save_every": SAVE_EVERY if mode != "none" else None,
            "step_ms": median(per_step) * 1e3,
            "blocked_ms": median(blocked[mode][1:]) * 1e3 if mode != "none" else None,
            "ckpt_mib": size if mode != "none" else None,
            "repeats": len(per_step),
        }
        for other, key in (("none", "vs_none"), ("sync", "vs_sync")):
            if other != mode and not (mode == "none" and other == "sync"):
                row[key] = paired_ratio(times[mode], times[other])
                row[key + "_iqr"] = ratio_spread(times[mode], times[other])
                row[key + "_verdict"] = noise_verdict(row[key + "_iqr"], 1.0, below_is_good=True)
        rows.append(row)
    if ctx.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    os.sync()
    return rows


def goals(rows):
    """What background saves are for: the training loop blocked for less of each save. The step
    time ÷ sync saves is in the table with its verdict: on a host whose cores all train (2 ranks
    on 2 cores here) the write competes with training for the same cores, so it need not drop;
    where the CPU is free while accelerators train, it drops with the blocked time."""
    by = {r["layout"]: r for r in rows if r.get("status") == "ok"}
    sync, bg = by.get(MODES["sync"]), by.get(MODES["async"])
    if not (sync and bg and sync.get("blocked_ms") and bg.get("blocked_ms") is not None):
        return []
    return [
        goal_row(
            f"checkpoint every {SAVE_EVERY} steps: loop blocked per save, async / sync",
            bg["dtype"],
            bg["blocked_ms"] / sync["blocked_ms"],
            0.5,
        )
    ]


SUITE = Suite(
    name="checkpoint",
    title="Training with a checkpoint every N steps: sync against background saves",
    run=run,
    isolated=True,
    package=False,
    launches=launches,
    train_model=True,
    goals=goals,
    columns=[
        ("layout", "saves", "str"),
        ("model", "model params", "str"),
        ("save_every", "every N steps", "int"),
        ("ckpt_mib", "checkpoint MiB", "f1"),
        ("step_ms", "step ms (incl. saves)", "ms"),
        ("vs_none", "÷ no saves", "x"),
        ("vs_none_iqr", "IQR of rounds", "range"),
        ("vs_sync", "÷ sync saves", "x"),
        ("vs_sync_iqr", "IQR of rounds", "range"),
        ("vs_sync_verdict", "vs sync", "str"),
        ("blocked_ms", "loop blocked ms / save", "ms"),
    ],
    explain=__doc__.split("\n\n", 1)[1],
)
