"""Load straight into shards: `from_pretrained`, `convert_state_dict`, `load_local_state_dict`.

The model is built on the meta device, the plan is derived, validated and applied there (every
parameter a DTensor with a meta local tensor), and only then is each rank's slice read from the
safetensors files (`tpkit.safetensors_io`, which reads just the slice's bytes) into a freshly
allocated local shard. No rank ever holds the whole model.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from tpkit.comm import chunk_offset, chunk_sizes
from tpkit.fsdp import apply_fsdp
from tpkit.mesh import dist_env
from tpkit.parallelize import tensor_parallel
from tpkit.plan import Plan, PlanLike, derive_plan, param_layout
from tpkit.plan.validate import param_layouts
from tpkit.safetensors_io import CheckpointIndex
from tpkit.styles import placement_for


# ---- where a rank's slice lives --------------------------------------------------------------
def local_ranges(placement: Placement, size: int, tp: int, rank: int) -> list[tuple[int, int]]:
    """Half-open ranges along the placement's dim that make up ``rank``'s shard (concatenated)."""
    if isinstance(placement, _StridedShard):
        sf = placement.split_factor
        part = size // sf
        off, n = chunk_offset(part, tp, rank), chunk_sizes(part, tp)[rank]
        return [(k * part + off, k * part + off + n) for k in range(sf)]
    if isinstance(placement, Shard):
        off = chunk_offset(size, tp, rank)
        return [(off, off + chunk_sizes(size, tp)[rank])]
    return [(0, size)]


def _slice(t: torch.Tensor, placement: Placement, tp: int, rank: int) -> torch.Tensor:
    if not isinstance(placement, (Shard, _StridedShard)):
        return t
    dim = placement.dim
    parts = [t.narrow(dim, a, b - a) for a, b in local_ranges(placement, t.shape[dim], tp, rank)]
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0].clone()


# ---- materialising parameters ----------------------------------------------------------------
def _set_local(module: nn.Module, pname: str, local: torch.Tensor) -> nn.Parameter:
    """Replace ``module.<pname>`` (DTensor or plain, meta or real) by one holding ``local``."""
    old = module._parameters[pname]
    if isinstance(old, DTensor):
        value = DTensor.from_local(
            local,
            old.device_mesh,
            old.placements,
            run_check=False,
            shape=old.shape,
            stride=old.stride(),
        )
    else:
        value = local
    new = nn.Parameter(value, requires_grad=old.requires_grad)
    module._parameters[pname] = new
    return new


def _param_owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """id(param) -> [(module, local name, full name)]: tied parameters share one entry."""
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is not None:
                full = f"{mod_name}.{pname}" if mod_name else pname
                owners.setdefault(id(p), []).append((module, pname, full))
    return owners


def _tp_coords(p: torch.Tensor) -> tuple[Placement, int, int]:
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        return p.placements[-1], mesh.size(-1), mesh.get_local_rank(mesh.ndim - 1)
    return Replicate(), 1, 0


def load_local_state_dict(
    model: nn.Module,
    local_state_dict: Mapping[str, torch.Tensor],
    device: torch.device | None = None,
) -> list[str]:
    """Put per-rank shards (from `convert_state_dict`) into a tensor-parallel model, meta or real.

    Returns the names of the model's parameters the dict did not cover.
    """
    device = device or rank_device(model)
    done, missing = set(), []
    for owners in _param_owners(model).values():
        names = [full for _, _, full in owners]
        key = next((n for n in names if n in local_state_dict), None)
        if key is None:
            missing += names[:1]
            continue
        p = owners[0][0]._parameters[owners[0][1]]
        local = local_state_dict[key].to(device=device, dtype=p.dtype)
        new = _set_local(owners[0][0], owners[0][1], local)
        for module, pname, _ in owners[1:]:
            module._parameters[pname] = new
        done.update(names)
    return missing


def convert_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    plan_or_model: nn.Module | Plan,
    world_size: int,
    rank: int | None = None,
    model: nn.Module | None = None,
) -> dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]:
    """Split a full (or partial) state dict into per-rank shards, as `tensor_parallel` would.

    ``plan_or_model`` is a model (meta is fine; its plan is derived the way tensor_parallel
    derives it) or a `Plan` (then pass ``model`` too for Conv1D-style modules, whose weights are
    transposed). With ``rank=None`` returns a list of ``world_size`` dicts.
    """
    if isinstance(plan_or_model, Plan):
        plan, ref = plan_or_model, model
    else:
        ref = plan_or_model
        state = getattr(ref, "_tpkit", None)
        plan = state.plan if state is not None else derive_plan(ref)
    layouts = param_layouts(ref, plan) if ref is not None else {}

    def placement(key: str, t: torch.Tensor) -> Placement:
        if key in layouts:
            return placement_for(layouts[key][1])
        if ref is not None:  # the model names all its parameters: the rest are buffers
            return Replicate()
        hit = plan.style_for(key.rsplit(".", 1)[0]) or plan.style_for(key)
        if hit is None:
            return Replicate()
        return placement_for(param_layout(hit[0], key.rsplit(".", 1)[-1], t.ndim))

    placements = {key: placement(key, t) for key, t in state_dict.items()}
    ranks = range(world_size) if rank is None else [rank]
    out = [
        {key: _slice(t, placements[key], world_size, r) for key, t in state_dict.items()}
        for r in ranks
    ]
    return out[0] if rank is not None else out


def infer_sharded_device_map(model: nn.Module) -> dict[str, torch.device]:
    """Module name -> this rank's device, for streaming loaders that want a device map.

    Under tensor parallelism every module lives on the rank's device; each holds its own shard.
    """
    device = rank_device(model)
    return {name: device for name, _ in model.named_modules()}


def rank_device(model: nn.Module) -> torch.device:
    state = getattr(model, "_tpkit", None)
    if state is not None and state.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if state is not None:
        return torch.device(state.mesh.device_type)
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    if torch.cuda.is_available() and dist_env().is_distributed:
        return torch.device("cuda", dist_env().local_rank % torch.cuda.device_count())
    return torch.device("cpu")


# ---- from_pretrained -------------------------------------------------------------------------
def _model_class(config, model_cls):
    import transformers

    if model_cls is not None:
        return getattr(transformers, model_cls) if isinstance(model_cls, str) else model_cls
    for name in getattr(config, "architectures", None) or []:
        if hasattr(transformers, name):
            return getattr(transformers, name)
    return transformers.AutoModelForCausalLM


def _instantiate(cls, config, dtype: torch.dtype | None = None) -> nn.Module:
    """A model of ``cls`` (a concrete class or an Auto class) from ``config``."""
    kwargs = {"dtype": dtype} if dtype is not None else {}
    if hasattr(cls, "_from_config"):
        return cls._from_config(config, **kwargs)
    return cls.from_config(config, **kwargs)


def _resolve_dtype(dtype, config) -> torch.dtype:
    dtype = dtype if dtype not in (None, "auto") else getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype or torch.float32


def _checkpoint_key(full: str, index: CheckpointIndex, prefix: str) -> str | None:
    if full in index:
        return full
    if prefix and full.startswith(prefix + ".") and full[len(prefix) + 1 :] in index:
        return full[len(prefix) + 1 :]
    if prefix and f"{prefix}.{full}" in index:
        return f"{prefix}.{full}"
    return None


def from_pretrained(
    path: str | os.PathLike,
    *,
    tp_size: int | None = None,
    dp_size: int | None = None,
    dtype: torch.dtype | str | None = None,
    model_cls: type | str | None = None,
    plan: PlanLike = "auto",
    device_ids: Sequence | None = None,
    sharded: bool | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    param_dtype: torch.dtype | None = None,
    **kwargs,
) -> nn.Module:
    """Build ``model_cls`` from ``path``'s config on meta, shard it, then read each rank's slices.

    Peak memory per rank is its shards plus one read block (8 MiB), whatever the model size.
    ``dtype`` defaults to the config's dtype (else float32); every slice is converted as it is
    read. Checkpoints whose keys transformers renames or fuses at load time (e.g. per-expert MoE
    weights) fall back to transformers' loader for the whole model, with a warning. The other
    arguments are `tensor_parallel`'s; FSDP2 (``sharded``, default on when dp_size > 1) is applied
    after the weights are in.
    """
    import transformers
    from accelerate import init_empty_weights

    path = Path(path)
    config = transformers.AutoConfig.from_pretrained(str(path), **kwargs)
    cls = _model_class(config, model_cls)
    dtype = _resolve_dtype(dtype, config)
    index = CheckpointIndex(path)
    with init_empty_weights(include_buffers=False):
        model = _instantiate(cls, config, dtype)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # on meta too: tied parameters must be one object before sharding
    prefix = getattr(model, "base_model_prefix", "")
    owners = _param_owners(model)
    keys = {}
    for group in owners.values():
        key = next((k for _, _, full in group if (k := _checkpoint_key(full, index, prefix))), None)
        keys[group[0][2]] = key
    _check_against_model(model, index, keys, path)
    unmapped = [n for n, k in keys.items() if k is None]
    options = dict(
        tp_size=tp_size,
        dp_size=dp_size,
        plan=plan,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
    )
    if unmapped:
        if dist_env().rank == 0:
            logging.getLogger("tpkit").warning(
                f"{len(unmapped)} parameters (e.g. {unmapped[0]}) are not stored under their own names in "
                f"{path}; loading through transformers (full model in memory) instead."
            )
        model = cls.from_pretrained(str(path), dtype=dtype, **kwargs)
        model = tensor_parallel(model, device_ids, sharded=False, **options)
        _mark_loaded(model, "transformers")
    else:
        model = tensor_parallel(model, device_ids, sharded=False, **options)
        device = rank_device(model)
        _move_buffers(model, device)
        _stream_params(model, index, keys, dtype, device)
        _mark_loaded(model, "slices")
    state = getattr(model, "_tpkit", None)
    if state is not None and (state.dp_size > 1 if sharded is None else sharded):
        apply_fsdp(model, state.mesh["dp"], param_dtype=param_dtype)
    elif param_dtype is not None:
        raise ValueError("param_dtype is FSDP2's mixed precision and needs dp_size > 1.")
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        with contextlib.suppress(OSError):
            model.generation_config = transformers.GenerationConfig.from_pretrained(str(path))
    return model.eval()


def _check_against_model(
    model: nn.Module, index: CheckpointIndex, keys: dict[str, str | None], path: Path
) -> None:
    """Every stored tensor the model will read must have the model's global shape and a dtype
    that converts to it; checked on every rank before any collective, so a checkpoint of another
    model size (a 512-row embedding into a 256-vocab model) is one clear error, never a silent
    partial load."""
    params = dict(model.named_parameters(remove_duplicate=False))
    problems = []
    for name, key in keys.items():
        if key is None:
            continue
        entry, p = index.entries[key], params[name]
        if tuple(entry.shape) != tuple(p.shape):
            problems.append(
                f"{name}: the model expects shape {tuple(p.shape)}, {entry.file} holds {key!r} "
                f"with shape {tuple(entry.shape)}"
            )
        elif p.is_floating_point() != entry.dtype.is_floating_point:
            problems.append(
                f"{name}: the model expects {p.dtype}, {entry.file} holds {key!r} as "
                f"{entry.dtype} (a quantized or integer checkpoint is not a float one)"
            )
    if problems:
        more = f"\n- ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ValueError(
            f"The checkpoint in {path} does not fit the model built from its config "
            f"({type(model).__name__}):\n- " + "\n- ".join(problems[:10]) + more + "\nCheck "
            "that config.json belongs to these weights (vocab_size, hidden sizes, layers)."
        )


def _mark_loaded(model: nn.Module, how: str) -> None:
    """Record how the weights arrived: "slices" (each rank read only its shard) or
    "transformers" (full model loaded, then sharded)."""
    model.__dict__["_tpkit_loaded_from"] = how


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)


def _stream_params(model, index, keys, dtype, device) -> None:
    from tqdm.auto import tqdm

    groups = list(_param_owners(model).values())
    bar = tqdm(groups, desc="tpkit: loading shards", disable=dist_env().rank != 0, unit="tensor")
    for owners in bar:
        module, pname, full = owners[0]
        p = module._parameters[pname]
        placement, tp, rank = _tp_coords(p)
        dim = placement.dim if isinstance(placement, (Shard, _StridedShard)) else 0
        ranges = local_ranges(placement, p.shape[dim], tp, rank) if p.ndim else None
        local = index.read(
            keys[full], dim, ranges, dtype=p.dtype if p.is_floating_point() else None
        )
        new = _set_local(module, pname, local.to(device))
        for mod, name, _ in owners[1:]:
            mod._parameters[name] = new
