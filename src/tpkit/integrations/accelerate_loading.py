"""accelerate's loading helpers on tpkit models: ``load_checkpoint_in_model`` and friends.

The old ``tensor_parallel`` package documented this flow, and scripts still use it::

    with accelerate.init_empty_weights():
        model = tpkit.tensor_parallel(AutoModelForCausalLM.from_config(config))
    accelerate.load_checkpoint_in_model(
        model, checkpoint, device_map=tpkit.infer_sharded_device_map(model)
    )

accelerate puts every tensor in place with ``set_module_tensor_to_device``, which knows nothing
of DTensors: it rebuilds the parameter as ``type(param)(value)`` (a DTensor without its spec) and
compares the value's shape with the *global* shape. `patch_accelerate` wraps that one function:
for a DTensor target it takes either the full tensor (it keeps this rank's slice, as
`tpkit.convert_state_dict` would) or this rank's shard (what ``convert_state_dict`` produced),
and puts it in place (in place when the parameter holds memory, so tied weights stay tied; a new
parameter shared by every tied owner when it is on meta). Every other tensor goes to accelerate's
own function untouched. ``import tpkit`` applies the patch when accelerate is (or gets) imported.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from tpkit.compat import StridedShard
from tpkit.integrations.patching import unpatch_all, wrap
from tpkit.io.shards import local_slice, param_owners, set_local

__all__ = ["patch_accelerate", "set_dtensor", "unpatch_accelerate"]


def patch_accelerate() -> None:
    """Make accelerate's ``set_module_tensor_to_device`` place DTensor shards (idempotent;
    `unpatch_accelerate` undoes it).

    accelerate's own modules import the function by name, so every module of accelerate that
    holds the original gets the wrapper (`tpkit.integrations.patching`'s ``holders``), and gets
    the original back on undo."""
    import accelerate.utils.modeling as modeling

    wrap(
        modeling,
        "set_module_tensor_to_device",
        _placing_dtensors,
        versions="accelerate",
        holders="accelerate",
    )


def unpatch_accelerate() -> None:
    """Undo `patch_accelerate`, in every accelerate module that holds the wrapper."""
    unpatch_all("accelerate")


def _placing_dtensors(original):
    def set_module_tensor_to_device(module, tensor_name, device, value=None, dtype=None, **kw):
        owner, name = _owner(module, tensor_name)
        target = owner._parameters.get(name) if name in owner._parameters else None
        if not isinstance(target, DTensor):
            return original(module, tensor_name, device, value=value, dtype=dtype, **kw)
        set_dtensor(module, tensor_name, device, value, dtype)
        return None

    return set_module_tensor_to_device


def _owner(module: nn.Module, tensor_name: str) -> tuple[nn.Module, str]:
    path, _, name = tensor_name.rpartition(".")
    return (module.get_submodule(path) if path else module), name


def set_dtensor(
    model: nn.Module,
    tensor_name: str,
    device: Any,
    value: torch.Tensor | None,
    dtype: torch.dtype | str | None = None,
) -> None:
    """Put ``value`` (the full tensor or this rank's shard) into the DTensor parameter
    ``tensor_name`` of ``model`` on ``device``."""
    owner, name = _owner(model, tensor_name)
    param = owner._parameters[name]
    local = param.to_local()
    if value is None:
        if local.is_meta:
            raise ValueError(f"{tensor_name} is on the meta device: a value is needed to load it.")
        value = local
    elif tuple(value.shape) == tuple(param.shape):
        value = _rank_slice(value, param)
    elif tuple(value.shape) != tuple(local.shape):
        raise ValueError(
            f"{tensor_name}: a tensor of shape {tuple(value.shape)} fits neither the full "
            f"parameter {tuple(param.shape)} nor this rank's shard {tuple(local.shape)}; the "
            "checkpoint does not match the model (or was split for another tp size)."
        )
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    value = value.to(device=_device(device), dtype=dtype or param.dtype)
    with torch.no_grad():
        if not local.is_meta and local.device == value.device and local.dtype == value.dtype:
            local.copy_(value)
            return
    old = param
    new = set_local(owner, name, value.contiguous())
    for module, pname, _ in param_owners(model).get(id(old), []):  # tied: one parameter
        module._parameters[pname] = new


def _rank_slice(value: torch.Tensor, param: DTensor, dim: int = 0) -> torch.Tensor:
    """This rank's shard of the full ``value`` under every mesh dim of ``param`` (dp x tp too).

    DTensor placements nest left to right: mesh dim 0 cuts the full tensor, the next one cuts
    that part. FSDP2's ``_StridedShard`` over dp means the reverse on its dim: the later (tp)
    cut first, then dp's chunk of that rank's TP shard (exact for uneven sizes too)."""
    if dim == param.device_mesh.ndim:
        return value
    mesh, placement = param.device_mesh, param.placements[dim]
    size, rank = mesh.size(dim), mesh.get_local_rank(dim)
    if isinstance(placement, StridedShard):
        inner = _rank_slice(value, param, dim + 1)
        return local_slice(inner, Shard(placement.dim), size, rank)
    return _rank_slice(local_slice(value, placement, size, rank), param, dim + 1)


def _device(device: Any) -> torch.device:
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)
