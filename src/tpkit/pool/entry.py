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
from tpkit.parallel.dims import SIZE_KEYWORDS, ParallelDims, sizes_of

__all__ = [
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


def pool_world(device_ids: Sequence | None, options: Any) -> int | None:
    """How many workers this call asks for (``options``: a `tpkit.state.TPOptions`), or None
    when it is not a pool's call (inside a rank, a mesh given, fewer than two devices). The
    sizes are resolved by `tpkit.parallel.dims.ParallelDims` (`ParallelDims.sizes`), the one
    place that multiplies them; ill-typed sizes are left to the core's checks."""
    if options.mesh is not None or inside_a_rank():
        return None
    given = {k: getattr(options, k) for k in SIZE_KEYWORDS}
    if options.distributed_config is not None:
        given.update(sizes_of(options.distributed_config))
    if any(v is not None and (type(v) is not int or v < 1) for v in given.values()):
        return None  # tp_size="2", 0, True: the core's own check names the fix
    asked = 1
    for key in ("tp_size", "dp_replicate_size", "dp_shard_size", "cp_size"):
        asked *= given[key] or 1
    if given["dp_replicate_size"] is None and given["dp_shard_size"] is None:
        asked *= given["dp_size"] or 1
    asked = max(
        asked, given["ep_size"] or 1
    )  # ep is carved out of dp_shard x tp: ep ranks at least
    world = max(len(device_ids or ()), asked)
    if device_ids and len(device_ids) > 1 and world != len(device_ids):
        raise ValueError(
            f"device_ids names {len(device_ids)} devices but the sizes ({_spelled(given)}) ask "
            f"for {world} workers; name one device per worker."
        )
    if world < 2:
        return None
    sizes = ParallelDims.sizes(world, sharded=options.sharded, **given)
    product = sizes["dp_replicate"] * sizes["dp_shard"] * sizes["cp"] * sizes["tp"]
    if product != world:
        raise ValueError(
            f"{_spelled(given)} does not make {world} workers: use sizes whose product is "
            f"{world}, or name as many devices as their product."
        )
    return world


def _spelled(given: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in given.items() if v is not None) or "no sizes"


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
    world = pool_world(device_ids, options)
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
    path: str | os.PathLike, device_ids: Sequence | None, named: dict, kwargs: dict
):
    """A `ModelHandle` (with ``output_loading_info``: ``(handle, info)``) for
    ``from_pretrained(path, ...)`` outside torchrun, or None when the call is not a pool's.
    ``named``: `tpkit.from_pretrained`'s own keywords; ``kwargs``: the rest (tensor_parallel's
    options and transformers' keywords), sorted here as the rank would sort them."""
    from tpkit.io.load_kwargs import sort_kwargs
    from tpkit.state import TPOptions

    tp_fields = [f.name for f in dataclasses.fields(TPOptions)]
    merged = {**(named.get("config_kwargs") or {}), **kwargs}
    call = sort_kwargs(merged, tp_fields, named.get("dtype"))
    world = pool_world(device_ids, TPOptions.of(call.tp_options))
    if world is None:
        return None
    env = _device_env(device_ids, world)
    source = str(path)
    if os.path.exists(source):
        source = os.path.abspath(source)  # the workers resolve it, not the caller's cwd
    load = {
        k: v for k, v in kwargs.items() if k not in call.tp_options and k != "distributed_config"
    }
    spec = ("pretrained", source, {**named, **load, **call.tp_options}, None)
    handle = _start(world, spec, env, device_ids)
    return (handle, handle.loading_info) if named.get("output_loading_info") else handle
