"""The systems compared, each behind one small interface that every suite uses.

A `System` is a loaded model plus what a suite needs to drive it: the module to call, the
parameters this rank holds, the transformer blocks (for per-block collective counts), how to count
its collectives and whether it can ``generate``. Loaders run on every rank of a torchrun group;
the ``tensor-parallel`` package builds its own `System` in `benchmarks.tp_package`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import CollectiveLog, CountCollectives, find_blocks

TORCHRUN_SYSTEMS = ("plain", "tpkit", "transformers")
PACKAGE_SYSTEM = "tensor_parallel"
ALL_SYSTEMS = (*TORCHRUN_SYSTEMS, PACKAGE_SYSTEM)

LABELS = {
    "plain": "unsharded model",
    "tpkit": "tpkit",
    "transformers": "transformers TP",
    "tensor_parallel": "tensor-parallel 2.0.0",
    "tpkit_gloo": "tpkit, shm off",
    "plain_all": "plain, all cores",
}

PLAIN_ALL = "plain_all"  # the unsharded model in one process on every core: the limit on one host


def all_cores() -> int:
    """The cores this process may run on (what one plain process would use)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def on_all_cores(ctx: Ctx, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0 with one thread per core (`all_cores`), the other ranks idle (they
    wait at the timing barrier, blocked, not spinning): one plain process using the whole host,
    measured in the same rounds as the TP systems. Returns None on the other ranks."""
    if ctx.rank != 0:
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(all_cores())
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


GLOO = "tpkit_gloo"  # the tpkit model with tpkit.parallel.shm's fast path off: every collective on gloo


def without_shm(fn: Callable[[], Any]) -> Any:
    """``fn()`` with tpkit's shared-memory collectives off (`GLOO` rows). Every rank runs the same
    round, so every rank has the same setting, as `tpkit.parallel.shm.set_shm_enabled` requires."""
    from tpkit.parallel.shm import set_shm_enabled

    before = set_shm_enabled(False)
    try:
        return fn()
    finally:
        set_shm_enabled(before)


@dataclass
class System:
    name: str
    model: nn.Module
    params: list[nn.Parameter]
    blocks: nn.ModuleList | None
    # Context manager factory that records this system's collectives into a CollectiveLog.
    count: Callable[[CollectiveLog], Any] = field(default=lambda log: CountCollectives(log))
    # None when generate works; else the reason it cannot run.
    no_generate: str | None = None
    note: str = ""
    # Parameters one rank holds, when ``params`` (what the optimizer steps) spans several ranks.
    rank_params: list[nn.Parameter] | None = None


@dataclass
class Ctx:
    """What a suite gets in the worker: settings, the TP size, this rank, and a barrier."""

    spec: dict[str, Any]
    tp: int
    rank: int
    dtype: torch.dtype
    dtype_name: str
    sync: Callable[[], None]
    emulated_rs: bool = True  # gloo emulates reduce-scatter with an all-reduce

    @property
    def cfg(self) -> dict[str, Any]:
        return self.spec["model"]

    def base_row(self, system: str) -> dict[str, Any]:
        return {"system": system, "tp": self.tp, "dtype": self.dtype_name, "status": "ok"}


def _load_hf(path: Path, dtype: torch.dtype, **kwargs) -> nn.Module:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs)
    model.generation_config.pad_token_id = 0
    return model.eval()


def _system(name: str, model: nn.Module, ctx: Ctx, note: str = "") -> System:
    blocks = find_blocks(model, ctx.cfg["num_hidden_layers"])
    return System(name, model, list(model.parameters()), blocks, note=note)


def load_plain(ctx: Ctx, path: Path) -> System:
    note = "a full copy on every rank, no communication" if ctx.tp > 1 else ""
    return _system("plain", _load_hf(path, ctx.dtype), ctx, note)


@contextlib.contextmanager
def count_tpkit(log: CollectiveLog):
    """c10d ops as every system's, plus tpkit's same-host shared-memory collectives (which are not
    c10d ops: `tpkit.parallel.shm` reports them to observers instead)."""
    from tpkit.parallel.shm import observe_shm

    with CountCollectives(log), observe_shm(log.record):
        yield


def tpkit_system(model: nn.Module, ctx: Ctx, note: str = "") -> System:
    system = _system("tpkit", model, ctx, note)
    system.count = count_tpkit
    return system


def load_tpkit(ctx: Ctx, path: Path) -> System:
    import tpkit

    model = tpkit.tensor_parallel(_load_hf(path, ctx.dtype))
    note = "tensor_parallel() returns the model unchanged at world size 1" if ctx.tp == 1 else ""
    return tpkit_system(model, ctx, note)


def load_transformers(ctx: Ctx, path: Path) -> System:
    from transformers.distributed import DistributedConfig

    model = _load_hf(path, ctx.dtype, distributed_config=DistributedConfig(tp_size=ctx.tp))
    return _system("transformers", model, ctx, "from_pretrained(distributed_config=...)")


LOADERS: dict[str, Callable[[Ctx, Path], System]] = {
    "plain": load_plain,
    "tpkit": load_tpkit,
    "transformers": load_transformers,
}


@contextlib.contextmanager
def training(system: System, lr: float = 1e-5):
    """Yield a step function (zero_grad, forward with labels, backward, AdamW step); free the
    optimizer state and gradients afterwards."""
    model = system.model
    model.train()
    opt = torch.optim.AdamW([p for p in system.params if p.requires_grad], lr=lr)
    state: dict[str, float] = {}

    def step(x: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        state["loss"] = float(loss.detach())

    try:
        yield step, state
    finally:
        opt.zero_grad(set_to_none=True)
        opt.state.clear()
        model.eval()
