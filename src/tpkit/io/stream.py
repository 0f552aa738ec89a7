"""Streaming a rank's slices from safetensors files into its (meta) shards.

Each parameter of a split model on the meta device gets a freshly allocated local shard on its
device, and the byte ranges of its slice are read straight into it (`tpkit.io.safetensors` reads
them; `tpkit.io.shards` says which ranges), converted to the parameter's dtype as they are read.
Nothing else is read and nothing the size of a tensor is allocated besides the shard, so a rank's
peak is its shards plus one read block.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import Shard

from tpkit.compat import StridedShard
from tpkit.io.safetensors import CheckpointIndex
from tpkit.io.shards import local_ranges, local_slice, param_owners, set_local, tp_coords
from tpkit.parallel.mesh import dist_env

__all__ = ["move_buffers", "stream_buffers", "stream_params"]


def move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)


def stream_buffers(
    model: nn.Module,
    index: CheckpointIndex,
    keys: dict[str, str | None],
    fresh: Mapping[str, torch.Tensor],
    device: torch.device,
) -> None:
    """Persistent buffers the checkpoint holds (``keys``: first name -> key), read whole (buffers
    are never split), or taken from ``fresh``; the others keep the values the model built."""
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for name, b in module._buffers.items():
            full = f"{mod_name}.{name}" if mod_name else name
            if b is None or name in module._non_persistent_buffers_set:
                continue
            if keys.get(full) is None and full not in fresh:
                continue
            if full in fresh:
                value = fresh[full].to(device=device, dtype=b.dtype)
            else:
                value = torch.empty(b.shape, dtype=b.dtype, device=device)
                index.read(keys[full], out=value)
            module._buffers[name] = value


def stream_params(
    model: nn.Module,
    index: CheckpointIndex,
    keys: dict[str, str | None],
    device: torch.device,
    fresh: Mapping[str, torch.Tensor] | None = None,
    skip: set[str] = frozenset(),
) -> None:
    """Read each (tied) parameter's local slice from ``index`` into a fresh shard on ``device``,
    in the parameter's dtype. ``keys``: first name of each parameter -> its checkpoint key;
    a parameter in ``fresh`` (full values of a new weight) takes its slice from there; one in
    ``skip`` is read by another (`tpkit.io.expert_stream`: experts stored one per key)."""
    from tqdm.auto import tqdm

    fresh = fresh or {}
    groups = list(param_owners(model).values())
    bar = tqdm(groups, desc="tpkit: loading shards", disable=dist_env().rank != 0, unit="tensor")
    for owners in bar:
        module, pname, full = owners[0]
        if full in skip:
            continue
        p = module._parameters[pname]
        placement, tp, rank = tp_coords(p)
        if full in fresh:
            local = local_slice(fresh[full], placement, tp, rank)
            local = local.to(device=device, dtype=p.dtype).contiguous()
        else:
            dim = placement.dim if isinstance(placement, (Shard, StridedShard)) else 0
            ranges = local_ranges(placement, p.shape[dim], tp, rank) if p.ndim else None
            key = keys[full]
            dtype = p.dtype if p.is_floating_point() else index.entries[key].dtype
            local = torch.empty(index.local_shape(key, dim, ranges), dtype=dtype, device=device)
            index.read(key, dim, ranges, out=local)
        new = set_local(module, pname, local)
        for mod, name, _ in owners[1:]:
            mod._parameters[name] = new
