"""Per-rank shards of state dicts: where a rank's slice lives, and putting slices in place.

- `local_ranges`: the ranges along a placement's dim that make up a rank's shard (strided parts
  included): what `from_pretrained` reads from a file and `convert_state_dict` slices.
- `convert_state_dict`: a full (or partial) state dict cut into per-rank shards, as
  `tensor_parallel` would lay them out, for loaders that stream their own tensors.
- `load_local_state_dict`: per-rank shards put into a tensor-parallel model, meta or real.
- `infer_sharded_device_map`: module -> this rank's device, for loaders that want a device map.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from tpkit.compat import StridedShard, as_parameter
from tpkit.parallel.mesh import dist_env
from tpkit.plan import Plan, derive_plan, param_layout, param_layouts
from tpkit.plan.layout import chunk_ranges
from tpkit.styles import placement_for

__all__ = [
    "convert_state_dict",
    "dtensor_like",
    "infer_sharded_device_map",
    "load_local_state_dict",
    "local_ranges",
    "local_slice",
    "param_owners",
    "rank_device",
    "set_local",
    "tp_coords",
]


# ---- where a rank's slice lives --------------------------------------------------------------
def local_ranges(placement: Placement, size: int, tp: int, rank: int) -> list[tuple[int, int]]:
    """Half-open ranges along the placement's dim that make up ``rank``'s shard (concatenated):
    `chunk_ranges` of a ``Shard`` / ``_StridedShard`` placement, the whole dim otherwise."""
    if isinstance(placement, StridedShard):
        return chunk_ranges(size, tp, rank, placement.split_factor)
    if isinstance(placement, Shard):
        return chunk_ranges(size, tp, rank)
    return [(0, size)]


def local_slice(t: torch.Tensor, placement: Placement, tp: int, rank: int) -> torch.Tensor:
    """This rank's part of the full tensor ``t`` under ``placement`` (a copy)."""
    if not isinstance(placement, (Shard, StridedShard)):
        return t
    dim = placement.dim
    parts = [t.narrow(dim, a, b - a) for a, b in local_ranges(placement, t.shape[dim], tp, rank)]
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0].clone()


# ---- materialising parameters ----------------------------------------------------------------
def dtensor_like(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor laid out like ``like`` (its mesh, placements, global shape and
    stride), or ``local`` itself when ``like`` is a plain tensor. No communication."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def set_local(module: nn.Module, pname: str, local: torch.Tensor) -> nn.Parameter:
    """Replace ``module.<pname>`` (DTensor or plain, meta or real) by one holding ``local``."""
    old = module._parameters[pname]
    new = as_parameter(dtensor_like(old, local), old.requires_grad)
    module._parameters[pname] = new
    return new


def param_owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """id(param) -> [(module, local name, full name)]: tied parameters share one entry."""
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is not None:
                full = f"{mod_name}.{pname}" if mod_name else pname
                owners.setdefault(id(p), []).append((module, pname, full))
    return owners


def tp_coords(p: torch.Tensor) -> tuple[Placement, int, int]:
    """(TP placement, tp size, this rank's TP index) of a parameter; a plain one is replicated."""
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
    for owners in param_owners(model).values():
        names = [full for _, _, full in owners]
        key = next((n for n in names if n in local_state_dict), None)
        if key is None:
            missing += names[:1]
            continue
        p = owners[0][0]._parameters[owners[0][1]]
        local = local_state_dict[key].to(device=device, dtype=p.dtype)
        new = set_local(owners[0][0], owners[0][1], local)
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
        {key: local_slice(t, placements[key], world_size, r) for key, t in state_dict.items()}
        for r in ranks
    ]
    return out[0] if rank is not None else out


def infer_sharded_device_map(model: nn.Module) -> dict[str, int | str]:
    """Module name -> this rank's device, for loaders that take a device map (accelerate's
    ``load_checkpoint_in_model``, which then puts each rank's slice in place on tpkit models).

    Under tensor parallelism every module lives on the rank's device; each holds its own shard.
    The values are what accelerate device maps hold and safetensors accepts: a CUDA index or a
    device type such as ``"cpu"``.
    """
    device = rank_device(model)
    value: int | str = device.index if device.type == "cuda" else device.type
    return {name: value for name, _ in model.named_modules()}


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
