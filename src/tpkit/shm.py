"""A same-host shared-memory all-reduce for no-grad CPU decode (opt-in).

gloo's all-reduce of a decode step's few KiB costs ~1 ms on a loaded CPU host (a TCP round trip
plus hand-offs to gloo's worker thread on every rank); a decode step issues 2 per block. With
TPKIT_CPU_SHM_ALLREDUCE=1, no-grad all-reduces of CPU tensors up to ``ShmChannel.SLOT`` bytes on
a gloo group whose ranks share a host go through a shared-memory buffer instead: each rank writes
its partial sum to its slot, posts one byte to every peer's pipe, waits for the peers' bytes, and
sums the slots in rank order (the same bits on every rank). Two buffers alternate, so one post
per all-reduce is enough. A peer that never posts fails the call after TPKIT_TIMEOUT. DeepSpeed
and vLLM's CPU backends sum TP partials through shared memory on one host for the same reason.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tpkit.timeouts import tpkit_timeout

__all__ = ["ShmChannel", "shm_all_reduce"]

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


_SHM = os.environ.get("TPKIT_CPU_SHM_ALLREDUCE", "0") == "1"


def shm_all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor | None:
    """Sum a contiguous CPU tensor over ``group`` in place through shared memory and return it,
    or None when the fast path does not apply (off, not CPU, too large, not one host, not gloo):
    the caller then uses the process group."""
    if not _SHM or x.device.type != "cpu" or x.numel() * x.element_size() > ShmChannel.SLOT:
        return None
    ch = _shm_channel(group)
    return ch.all_reduce(x) if ch is not None else None
