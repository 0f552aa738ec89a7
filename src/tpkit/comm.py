"""Megatron's communication primitives as tiny autograd functions on local tensors.

torch's DTensor styles issue the same collectives through per-op dispatch; these do it once per
layer on plain tensors, which is what makes no-grad decode cheap (no DTensor dispatch per op) and
keeps a block at exactly two all-reduces forward and two backward.

- ``copy_to_tp`` (Megatron's *f*): identity forward, all-reduce backward. Put before a
  column-parallel layer: each rank's input gradient is a partial sum over its columns.
- ``reduce_from_tp`` (Megatron's *g*): all-reduce forward, identity backward. Put after a
  row-parallel layer: each rank's output is a partial sum over its rows.
- ``gather_from_tp``: all-gather along the last dim forward, keep own slice backward (gathered
  logits). Handles torch.chunk-style uneven splits (e.g. GPT-2's 50257-token vocabulary).
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tpkit.mesh import tpkit_timeout


def _all_reduce(t: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    dist.all_reduce(t, group=group)
    return t


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def chunk_sizes(size: int, parts: int) -> list[int]:
    """Sizes torch.chunk (and DTensor's Shard) gives: ceil-sized chunks, the tail shorter or 0."""
    chunk = -(-size // parts)
    return [max(0, min(chunk, size - r * chunk)) for r in range(parts)]


def chunk_offset(size: int, parts: int, rank: int) -> int:
    return min(size, rank * -(-size // parts))


def _gather_last(x: torch.Tensor, sizes: list[int], group: ProcessGroup) -> torch.Tensor:
    width = max(sizes)
    x = x.contiguous()
    if x.shape[-1] < width:
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    parts = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(parts, x, group=group)
    return torch.cat([p[..., :s] for p, s in zip(parts, sizes)], dim=-1)


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], rank: int, group: ProcessGroup):
        ctx.start, ctx.size = sum(sizes[:rank]), sizes[rank]
        return _gather_last(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[..., ctx.start : ctx.start + ctx.size].contiguous(), None, None, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (Megatron's f)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _CopyToTP.apply(x, group)
    return x


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward (Megatron's g). In-place when no grad is needed."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _ReduceFromTP.apply(x, group)
    return _no_grad_all_reduce(x, group)


def gather_from_tp(x: torch.Tensor, sizes: list[int], rank: int, group: ProcessGroup):
    """All-gather along the last dim (uneven ``sizes`` allowed); backward keeps this rank's slice."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _GatherFromTP.apply(x, sizes, rank, group)
    return _gather_last(x, sizes, group)


# -- opt-in same-host shared-memory all-reduce for no-grad CPU decode ----------------------------
#
# gloo's all-reduce of a decode step's few KiB costs ~1 ms on a loaded CPU host (a TCP round trip
# plus hand-offs to gloo's worker thread on every rank); a decode step issues 2 per block. With
# TPKIT_CPU_SHM_ALLREDUCE=1, no-grad all-reduces of CPU tensors up to ``ShmChannel.SLOT`` bytes
# on a gloo group whose ranks share a host go through a shared-memory buffer instead: each rank
# writes its partial sum to its slot, posts one byte to every peer's pipe, waits for the peers'
# bytes, and sums the slots in rank order (the same bits on every rank). Two buffers alternate,
# so one post per all-reduce is enough. Off by default: experimental, and invisible to
# collective counters that watch c10d ops.

_SHM_CHANNELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> channel


class ShmChannel:
    SLOT = 1 << 18  # bytes per rank per buffer

    def __init__(self, group: ProcessGroup):
        import tempfile
        import uuid

        self.t, self.r = dist.get_world_size(group), dist.get_rank(group)
        root = dist.get_process_group_ranks(group)[0]
        shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        name = [os.path.join(shm_dir, f"tpkit-{uuid.uuid4().hex}") if self.r == 0 else None]
        dist.broadcast_object_list(name, src=root, group=group)
        base, nbytes = name[0], 2 * self.t * self.SLOT
        if self.r == 0:
            with open(base, "wb") as f:
                f.truncate(nbytes)
            for i in range(self.t):
                os.mkfifo(f"{base}.{i}")
        dist.barrier(group=group)
        self.buf = torch.from_file(base, shared=True, size=nbytes, dtype=torch.uint8)
        self.rd = os.open(f"{base}.{self.r}", os.O_RDWR)
        self.wr = [os.open(f"{base}.{i}", os.O_RDWR) for i in range(self.t) if i != self.r]
        dist.barrier(group=group)
        if self.r == 0:  # mapped and opened everywhere: nothing is left behind on exit
            os.unlink(base)
            for i in range(self.t):
                os.unlink(f"{base}.{i}")
        self.k, self.pending, self.me = 0, [0] * self.t, bytes([self.r])
        self.timeout = tpkit_timeout()  # a dead peer fails like a gloo collective would

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import select

        nb = x.numel() * x.element_size()
        s = self.k & 1
        self.k += 1
        slots = self.buf[s * self.t * self.SLOT : (s + 1) * self.t * self.SLOT].view(self.t, -1)
        slots = slots[:, :nb].view(x.dtype)
        slots[self.r].copy_(x.reshape(-1))
        for fd in self.wr:
            os.write(fd, self.me)
        pending, r = self.pending, self.r
        while any(pending[i] == 0 for i in range(self.t) if i != r):
            if not select.select([self.rd], [], [], self.timeout)[0]:
                missing = [i for i in range(self.t) if i != r and pending[i] == 0]
                raise RuntimeError(
                    f"tpkit shm all-reduce: timed out after {self.timeout:g} s waiting for "
                    f"group rank(s) {missing}; a peer died or skipped this collective. "
                    "TPKIT_TIMEOUT sets the timeout in seconds."
                )
            for b in os.read(self.rd, 256):
                pending[b] += 1
        for i in range(self.t):
            if i != r:
                pending[i] -= 1
        torch.sum(slots, dim=0, out=x.view(-1))
        return x


def _shm_channel(group: ProcessGroup) -> ShmChannel | None:
    key = group if group is not None else dist.group.WORLD
    if key not in _SHM_CHANNELS:
        import socket

        ok = dist.get_backend(group) == "gloo" and dist.get_world_size(group) < 256
        hosts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        _SHM_CHANNELS[key] = ShmChannel(group) if ok and len(set(hosts)) == 1 else None
    return _SHM_CHANNELS[key]


def _no_grad_all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    x = x if x.is_contiguous() else x.contiguous()
    if _SHM and x.device.type == "cpu" and x.numel() * x.element_size() <= ShmChannel.SLOT:
        ch = _shm_channel(group)
        if ch is not None:
            return ch.all_reduce(x)
    return _all_reduce(x, group)


_SHM = os.environ.get("TPKIT_CPU_SHM_ALLREDUCE", "0") == "1"
