"""Streaming a rank's slices from safetensors files into its (meta) shards.

Each parameter of a split model on the meta device gets a freshly allocated local shard on its
device, and the byte ranges of its slice are read straight into it (`tpkit.io.safetensors` reads
them; `tpkit.io.shards` says which ranges), converted to the parameter's dtype as they are read.
Nothing else is read and nothing the size of a tensor is allocated besides the shard, so a rank's
peak is its shards plus one read block.

Three things make it fast. A slice that is one run of the file's bytes (whole tensors, rows of
the first dimension: column-parallel weights, vocabulary-split embeddings, replicated norms) wanted
on the CPU in its stored dtype is not read at all but mapped copy-on-write
(`CheckpointIndex.mapped`): its pages come from the page cache at the first forward, shared by
the ranks of a host, as transformers' own loads do. The other slices are read into shards
whose pages the kernel faults in at once (`tpkit.parallel.shard_memory.empty_shard`; huge pages
opt-in). And `prefetch` asks the kernel, when the index is opened, to read the files into the
page cache in the background (``POSIX_FADV_WILLNEED``), so that a cold checkpoint is read from
disk while the model is built, planned and split, not after.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import Shard

from tpkit.compat import StridedShard
from tpkit.io.safetensors import CheckpointIndex
from tpkit.io.shards import local_ranges, local_slice, param_owners, set_local, tp_coords
from tpkit.parallel.mesh import dist_env
from tpkit.parallel.shard_memory import empty_shard

__all__ = [
    "move_buffers",
    "prefetch",
    "stream_buffers",
    "stream_params",
]


def prefetch(files: Iterable[str | os.PathLike], budget_bytes: int | None = None) -> None:
    """Ask the kernel to read ``files`` into the page cache in the background, when they fit in
    half of the memory available (``budget_bytes``, default from /proc/meminfo): the reads then
    overlap with building, planning and splitting the model. Nothing when the OS lacks
    ``posix_fadvise``; never an error."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    files = [Path(f) for f in files]
    try:
        total = sum(f.stat().st_size for f in files)
        budget = budget_bytes if budget_bytes is not None else _available_bytes() // 2
        if total > budget:
            return
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
    except OSError:
        return


def _available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


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
    bar = tqdm(  # rank 0's, shown once reading has taken more than 2 s (as transformers' bar)
        groups, desc="tpkit: loading shards", disable=dist_env().rank != 0, unit="tensor", delay=2
    )
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
            local = None
            if device.type == "cpu" and dtype == index.entries[key].dtype:
                local = index.mapped(key, dim, ranges)  # a run of the file: mapped, not read
            if local is None:
                local = empty_shard(index.local_shape(key, dim, ranges), dtype, device)
                index.read(key, dim, ranges, out=local)
        new = set_local(module, pname, local)
        for mod, name, _ in owners[1:]:
            mod._parameters[name] = new
