"""A same-host shared-memory all-reduce and all-gather for no-grad CPU work (on by default).

gloo's all-reduce of a decode step's few KiB costs ~1 ms on a loaded CPU host (a TCP round trip
plus hand-offs to gloo's worker thread on every rank); a decode step issues 2 per block. When every
rank of a gloo group runs on one host, no-grad collectives of plain CPU tensors up to
``ShmChannel.SLOT`` bytes go through a shared-memory buffer instead: each rank writes its part to
its slot, posts one byte to every peer's pipe, waits for the peers' bytes, and sums (or gathers)
the slots in rank order, so every rank gets the same bits. Two buffers alternate, so one post per
call is enough. DeepSpeed and vLLM's CPU backends sum TP partials through shared memory on one host
for the same reason.

Safety, in order:

- The group's decision is taken once, at its first eligible call, by every rank together: one
  ``all_gather_object`` of (TPKIT_CPU_SHM_ALLREDUCE, hostname, boot id, backend), then the buffer
  is created by rank 0 and every rank checks it sees rank 0's nonce through its own mapping (two
  containers with one hostname but separate ``/dev/shm`` fall back). Any "no" anywhere means gloo
  for the whole group, on every rank.
- Every later choice depends only on what is the same on every rank of a TP group: the tensor's
  device, type and byte size (TP ranks hold the same shapes), and whether torch.compile is
  tracing. `set_shm_enabled` must be called on every rank alike.
- A peer that never posts fails the call after TPKIT_TIMEOUT with a RuntimeError naming it.
- Every fast-path collective is counted (`shm_counts`) and reported to observers (`observe_shm`),
  so collective counters that see only c10d ops can add these.

``TPKIT_CPU_SHM_ALLREDUCE=0`` turns it off (the group's agreement then says no, once).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tpkit.timeouts import tpkit_timeout

__all__ = [
    "ShmChannel",
    "observe_shm",
    "prepare_shm",
    "set_shm_enabled",
    "shm_all_gather",
    "shm_all_reduce",
    "shm_counts",
    "shm_enabled",
]

_SHM_CHANNELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> channel | None
_COUNTS = {"all_reduce": 0, "all_gather": 0}
_OBSERVERS: list[Callable[[str, int], None]] = []
_ENV_ON = os.environ.get("TPKIT_CPU_SHM_ALLREDUCE", "1") != "0"  # what each group votes
_STATE = {"on": _ENV_ON}  # the run-time switch (set_shm_enabled), checked after the vote


class ShmChannel:
    """Two alternating buffers of ``SLOT`` bytes per rank, and one pipe per rank for the posts.

    Constructing one is a collective over ``group`` (every rank calls it); it raises RuntimeError
    on every rank alike when the buffer cannot be created or is not shared by all of them.
    """

    SLOT = 1 << 20  # bytes per rank per buffer: a decode step's KiB, a 2 x 64-token fp32 prefill

    def __init__(self, group: ProcessGroup):
        self.t, self.r = dist.get_world_size(group), dist.get_rank(group)
        root = dist.get_process_group_ranks(group)[0]
        nbytes = 2 * self.t * self.SLOT
        made = [_create(self.t, nbytes) if self.r == 0 else None]
        dist.broadcast_object_list(made, src=root, group=group)
        base, nonce, why = made[0]
        self.rd, self.wr = -1, []
        if base is not None:
            why = self._open(base, nbytes, nonce)
        whys: list = [None] * self.t
        dist.all_gather_object(whys, why, group=group)  # also: mapped and opened everywhere
        if self.r == 0 and base is not None:  # nothing is left behind on exit
            for path in [base, *(f"{base}.{i}" for i in range(self.t))]:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        failed = [f"rank {i}: {w}" for i, w in enumerate(whys) if w]
        if failed:
            self.close()
            raise RuntimeError("tpkit shm channel unavailable: " + "; ".join(failed))
        self.k, self.pending, self.me = 0, [0] * self.t, bytes([self.r])
        self.timeout = tpkit_timeout()  # a dead peer fails like a gloo collective would
        weakref.finalize(self, _close_fds, [self.rd, *self.wr])

    def _open(self, base: str, nbytes: int, nonce: bytes) -> str | None:
        """Map the buffer and open the pipes; the reason it failed, or None."""
        try:
            self.buf = torch.from_file(base, shared=True, size=nbytes, dtype=torch.uint8)
            if bytes(self.buf[: len(nonce)].tolist()) != nonce:
                return "the buffer is not shared with rank 0 (a separate /dev/shm?)"
            self.rd = os.open(f"{base}.{self.r}", os.O_RDWR)
            self.wr = [os.open(f"{base}.{i}", os.O_RDWR) for i in range(self.t) if i != self.r]
        except (OSError, RuntimeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def close(self) -> None:
        _close_fds([self.rd, *self.wr])
        self.rd, self.wr = -1, []

    def _slots(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        s = self.k & 1
        self.k += 1
        slots = self.buf[s * self.t * self.SLOT : (s + 1) * self.t * self.SLOT].view(self.t, -1)
        return slots[:, :nbytes].view(dtype)

    def _exchange(self) -> None:
        """Post to every peer, then wait until every peer has posted for this call."""
        import select

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

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum contiguous ``x`` over the group in place (in rank order) and return it."""
        slots = self._slots(x.numel() * x.element_size(), x.dtype)
        slots[self.r].copy_(x.reshape(-1))
        self._exchange()
        torch.sum(slots, dim=0, out=x.view(-1))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's contiguous ``x`` (same shape everywhere), stacked in rank order (a copy)."""
        slots = self._slots(x.numel() * x.element_size(), x.dtype)
        slots[self.r].copy_(x.reshape(-1))
        self._exchange()
        return slots.clone().view(self.t, *x.shape)


def _create(t: int, nbytes: int) -> tuple[str | None, bytes, str | None]:
    """Rank 0: the buffer file (its first bytes a nonce) and one pipe per rank."""
    import tempfile
    import uuid

    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    base, nonce = os.path.join(shm_dir, f"tpkit-{uuid.uuid4().hex}"), uuid.uuid4().bytes
    try:
        with open(base, "wb") as f:
            f.write(nonce)
            f.truncate(nbytes)
        for i in range(t):
            os.mkfifo(f"{base}.{i}")
    except OSError as exc:
        for path in [base, *(f"{base}.{i}" for i in range(t))]:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return None, nonce, f"{type(exc).__name__}: {exc}"
    return base, nonce, None


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _host_id() -> tuple[str, str]:
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


def prepare_shm(group: ProcessGroup | None) -> bool:
    """Take ``group``'s decision now (a collective: call it on every rank of the group), so its
    first forward issues no setup collectives; whether the group uses shared memory."""
    return _shm_channel(group) is not None


def _shm_channel(group: ProcessGroup | None) -> ShmChannel | None:
    """The group's channel, or None for gloo: decided once, by every rank together."""
    if not dist.is_initialized():
        return None
    key = group if group is not None else dist.group.WORLD
    if not isinstance(key, dist.ProcessGroup):  # not a group: let torch.distributed say so
        return None
    try:
        return _SHM_CHANNELS[key]
    except KeyError:
        pass
    t = dist.get_world_size(group)
    mine = (_ENV_ON, _host_id(), "gloo" in str(dist.get_backend(group)))
    votes: list = [None] * t
    dist.all_gather_object(votes, mine, group=group)
    channel = None
    if t < 256 and all(v[0] and v[2] for v in votes) and len({v[1] for v in votes}) == 1:
        try:
            channel = ShmChannel(group)
        except RuntimeError:  # raised on every rank alike: gloo everywhere
            channel = None
    _SHM_CHANNELS[key] = channel
    return channel


def _eligible(x: torch.Tensor, nbytes: int) -> bool:
    # only what is the same on every TP rank: device, type, size, tracing
    return (
        type(x) is torch.Tensor
        and x.device.type == "cpu"
        and nbytes <= ShmChannel.SLOT
        and not torch.compiler.is_compiling()
    )


def _count(kind: str, nbytes: int) -> None:
    _COUNTS[kind] += 1
    for fn in _OBSERVERS:
        fn(kind, nbytes)


def shm_all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor | None:
    """Sum a contiguous CPU tensor over ``group`` in place through shared memory and return it,
    or None when the fast path does not apply (off, not a plain CPU tensor, too large, not one
    host, not gloo, compiling): the caller then uses the process group."""
    ch = _channel_for(x, group, "all_reduce")
    return None if ch is None else ch.all_reduce(x)


def shm_all_gather(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor | None:
    """Every rank's contiguous CPU ``x`` stacked in rank order (shape ``(t, *x.shape)``), or None
    when the fast path does not apply (as `shm_all_reduce`)."""
    ch = _channel_for(x, group, "all_gather")
    return None if ch is None else ch.all_gather(x)


def _channel_for(x: torch.Tensor, group: ProcessGroup | None, kind: str) -> ShmChannel | None:
    """The channel ``kind`` of ``x`` takes (counted), or None when the fast path does not apply."""
    nbytes = x.numel() * x.element_size()
    if not _eligible(x, nbytes):
        return None
    ch = _shm_channel(group)
    if ch is None or not _STATE["on"]:
        return None
    _count(kind, nbytes)
    return ch


def shm_enabled() -> bool:
    """Whether eligible no-grad collectives take the shared-memory path (TPKIT_CPU_SHM_ALLREDUCE,
    default on, or the last `set_shm_enabled`)."""
    return _STATE["on"]


def set_shm_enabled(on: bool) -> bool:
    """Turn the fast path on or off from now on; returns the previous setting. Call it on every
    rank alike (a rank on gloo and a peer on shared memory both time out). Turning it on does not
    revive a group that already agreed on gloo (with TPKIT_CPU_SHM_ALLREDUCE=0 every group does)."""
    before, _STATE["on"] = _STATE["on"], bool(on)
    return before


def shm_counts() -> dict[str, int]:
    """Fast-path collectives taken by this process so far, by kind (``all_reduce``,
    ``all_gather``): a counter of c10d ops adds these to see every collective."""
    return dict(_COUNTS)


@contextlib.contextmanager
def observe_shm(fn: Callable[[str, int], None]) -> Iterator[None]:
    """Call ``fn(kind, input_bytes)`` for every fast-path collective inside the block, as a
    TorchDispatchMode sees c10d ops (``input_bytes``: this rank's input, as c10d counts it)."""
    _OBSERVERS.append(fn)
    try:
        yield
    finally:
        _OBSERVERS.remove(fn)
