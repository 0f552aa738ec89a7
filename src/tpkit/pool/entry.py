"""When ``tensor_parallel`` / ``from_pretrained`` start a pool, and with what.

Outside torchrun (a notebook, a REPL, ``python script.py``), a call that asks for two or more
devices (``device_ids`` with 2+ entries, or ``tp_size`` x ``dp_size`` >= 2) starts one worker
process per device and returns a `ModelHandle`. A call that names no devices or sizes keeps
today's meaning (the model unsplit, so a torchrun script also runs as one process), and inside
a rank (torchrun, ``tpkit.launch``, a live process group) nothing here applies.

Every check of the arguments runs here, before any process starts: one clear error in the
caller instead of N worker tracebacks.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tpkit import config

__all__ = [
    "explain",
    "explain_split",
    "inside_a_rank",
    "pool_from_pretrained",
    "pool_tensor_parallel",
    "pool_world",
]


def inside_a_rank() -> bool:
    """True in a process torchrun (or ``tpkit.launch``) started, or with a live process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True
    return config.rank_given() or config.under_torchelastic()


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def pool_world(
    device_ids: Sequence | None, tp_size: Any = None, dp_size: Any = None, mesh: Any = None
) -> int | None:
    """How many workers this call asks for, or None when it is not a pool's call (inside a
    rank, a mesh given, fewer than two devices). Ill-typed sizes are left to the core's checks."""
    if mesh is not None or inside_a_rank():
        return None
    if any(v is not None and (type(v) is not int or v < 1) for v in (tp_size, dp_size)):
        return None  # tp_size="2", 0, True: the core's own check names the fix
    world = max(len(device_ids or ()), _int(tp_size) * _int(dp_size))
    if device_ids and len(device_ids) > 1 and world != len(device_ids):
        raise ValueError(
            f"device_ids names {len(device_ids)} devices but tp_size={tp_size} x "
            f"dp_size={dp_size or 1} asks for {world} workers; name one device per worker."
        )
    if world < 2:
        return None
    tp = _int(tp_size) if tp_size else world // _int(dp_size)
    dp = _int(dp_size) if dp_size else world // tp
    if tp * dp != world:
        raise ValueError(
            f"tp_size={tp_size} x dp_size={dp_size} does not make {world} workers: "
            f"use a tp_size that divides {world}, or name tp_size x dp_size devices."
        )
    return world


def _device_env(device_ids: Sequence | None, world: int) -> dict[str, str]:
    """Each worker's environment: which GPUs it sees (worker i uses the i-th one, so the core
    picks its device from the local rank as under torchrun), and its share of the CPU threads."""
    env: dict[str, str] = {}
    if config.omp_num_threads() is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # macOS
            cores = os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(max(1, cores // world))
    if device_ids:
        devices = [
            torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in device_ids
        ]
    elif torch.cuda.is_available():
        devices = [torch.device("cuda", i) for i in range(world)]
    else:
        devices = [torch.device("cpu")] * world
    kinds = sorted({d.type for d in devices})
    if kinds == ["cpu"]:
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU even on a machine with GPUs
        return env
    if kinds != ["cuda"]:
        raise ValueError(
            f"device_ids={list(device_ids or ())}: a tpkit pool runs on CPUs or on CUDA GPUs, "
            f"one kind for all workers; got {kinds}."
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise RuntimeError(
            f"device_ids={[str(d) for d in devices]} names CUDA GPUs, but this process sees "
            f"none (torch.cuda.is_available() is False); for {world} CPU workers pass "
            f"{['cpu'] * world}, or run on a machine with {world} GPUs."
        )
    index = [d.index for d in devices]
    if None in index or len(set(index)) != len(index) or max(index) >= count:
        raise ValueError(
            f"device_ids={[str(d) for d in devices]}: name {world} distinct GPUs among the "
            f"{count} this process sees (cuda:0 .. cuda:{count - 1}), one per worker."
        )
    physical = config.cuda_visible_devices() or [str(i) for i in range(count)]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(physical[i] for i in index)
    return env


def _start(world: int, spec: tuple, env: dict[str, str], device_ids, cleanup=None):
    from tpkit.pool.handle import ModelHandle
    from tpkit.pool.workers import Pool

    pool = Pool(world, spec, env)
    try:
        info = pool.start()
    except BaseException:
        if cleanup is not None:
            cleanup()
        raise
    if device_ids and info["device"].type == "cuda":  # the caller's name, not the worker's
        first = device_ids[0]
        info["device"] = (
            torch.device("cuda", first) if isinstance(first, int) else torch.device(first)
        )
    return ModelHandle(pool, info, cleanup)


def pool_tensor_parallel(model: nn.Module, device_ids: Sequence | None, options: Any):
    """A `ModelHandle` for ``tensor_parallel(model, device_ids, **options)`` outside torchrun,
    or None when the call is not a pool's. The model crosses once: a transformers model as its
    ``save_pretrained`` checkpoint (each worker streams only its slices), any other module
    saved whole with ``torch.save`` (its class must be importable by the workers)."""
    world = pool_world(device_ids, options.tp_size, options.dp_size, options.mesh)
    if world is None:
        return None
    env = _device_env(device_ids, world)
    tp_kwargs = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    del tp_kwargs["mesh"]
    folder = tempfile.mkdtemp(prefix="tpkit-pool-model-")

    def cleanup() -> None:
        shutil.rmtree(folder, ignore_errors=True)

    try:
        if _is_transformers_model(model):
            model.save_pretrained(folder)
            spec = ("pretrained", folder, {"model_cls": type(model), **tp_kwargs}, model.training)
        else:
            torch.save(model, os.path.join(folder, "model.pt"))
            spec = ("pickled", os.path.join(folder, "model.pt"), tp_kwargs, model.training)
    except BaseException:
        cleanup()
        raise
    return _start(world, spec, env, device_ids, cleanup)


def _is_transformers_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(model, PreTrainedModel) and not hasattr(model, "peft_config")


def pool_from_pretrained(
    path: str | os.PathLike, device_ids: Sequence | None, tp_options: dict, **load: Any
):
    """A `ModelHandle` (with ``output_loading_info``: ``(handle, info)``) for
    ``from_pretrained(path, ...)`` outside torchrun, or None when the call is not a pool's."""
    world = pool_world(device_ids, tp_options.get("tp_size"), tp_options.get("dp_size"))
    if world is None:
        return None
    env = _device_env(device_ids, world)
    source = str(path)
    if os.path.exists(source):
        source = os.path.abspath(source)  # the workers resolve it, not the caller's cwd
    handle = _start(world, ("pretrained", source, {**load, **tp_options}, None), env, device_ids)
    return (handle, handle.loading_info) if load.get("output_loading_info") else handle


def explain_split(model: nn.Module) -> str:
    """The plan applied to ``model`` as `tpkit.explain` prints it (run on every worker)."""
    from tpkit.parallelize import tp_state
    from tpkit.plan import explain

    state = tp_state(model)
    if state is None:
        return f"{type(model).__name__} was not split by tpkit."
    return explain(state.plan, model, tp_size=state.tp_size)


def explain(plan: Any, model: nn.Module | None = None, tp_size: int = 1) -> str:
    """`tpkit.plan.explain`, and for a `ModelHandle` (``tpkit.explain(model)``) the plan its
    workers applied. Without a model: the plan's entries; with one: the table ``tpkit plan``
    prints (parameters, styles, global -> local shapes, bytes per rank, collectives)."""
    from tpkit.plan import explain as explain_plan
    from tpkit.pool.handle import ModelHandle

    if isinstance(plan, ModelHandle):
        return plan.explain()
    return explain_plan(plan, model, tp_size)
