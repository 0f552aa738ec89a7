"""A same-host shared-memory all-reduce and all-gather for tpkit's CPU collectives (on by default).

gloo's all-reduce of a decode step's few KiB costs ~1 ms on a loaded CPU host (a TCP round trip
plus hand-offs to gloo's worker thread on every rank), and ~2 ms for a training step's 200 KiB of
bfloat16 activations; a block issues 2 forward and 2 backward. When every rank of a gloo group runs
on one host, the collectives of tpkit's layers on plain CPU tensors (`tpkit.parallel.comm`: forward and
backward, with or without grad) go through a shared-memory buffer instead: each rank writes its
part to its slot, posts one byte to every peer's pipe, waits for the peers' bytes, and sums (or
takes the max, or gathers) the slots in rank order, so every rank gets the same bits. A tensor
larger than a slot goes through in slot-sized pieces, one post each. Two buffers alternate, so
one post per piece is enough: a rank can write a buffer again only after every peer has posted
the next piece, i.e. finished reading this one. Measured on 2 ranks of a 2-core host: 5-15x faster
than gloo up to 1 MiB, 3x at 16 MiB, 2x at 64 MiB. DeepSpeed and vLLM's CPU backends sum TP
partials through shared memory on one host for the same reason.

Safety, in order:

- The group's decision is taken once, at its first eligible call, by every rank together: one
  ``all_gather_object`` of (TPKIT_CPU_SHM_ALLREDUCE, hostname, boot id, backend), then the buffer
  is created by rank 0 and every rank checks it sees rank 0's nonce through its own mapping (two
  containers with one hostname but separate ``/dev/shm`` fall back). Any "no" anywhere means gloo
  for the whole group, on every rank.
- Every later choice depends only on what is the same on every rank of a TP group: the tensor's
  device, type, dtype, byte size and layout (TP ranks hold the same shapes), the op, and whether
  torch.compile is tracing (a traced graph calls `tpkit.parallel.comm`'s ``tpkit::`` ops, which decide
  when they run, as here). `set_shm_enabled` must be called on every rank alike.
- Calls happen in program order, as gloo's must: the same on every rank. Under autograd that
  holds too: the engine runs a CPU graph's backward on the thread that called ``backward()``, in
  an order fixed by the graph, which is the same on every TP rank (a rank whose graph differed
  would hang gloo as well).
- A peer that never posts fails the call after the group's own timeout (what a gloo collective on
  it would wait: TPKIT_TIMEOUT on the groups tpkit creates) with a RuntimeError naming it.
- Every fast-path collective is counted (`shm_counts`) and reported to observers (`observe_shm`),
  so collective counters that see only c10d ops can add these.

``TPKIT_CPU_SHM_ALLREDUCE=0`` turns it off (the group's agreement then says no, once).
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tpkit import config
from tpkit.compat import group_timeout
from tpkit.parallel.timeouts import tpkit_timeout

__all__ = [
    "OP_NAMES",
    "ShmChannel",
    "observe_shm",
    "prepare_shm",
    "set_shm_enabled",
    "shm_all_gather",
    "shm_all_reduce",
    "shm_counts",
    "shm_enabled",
    "shm_gather_last",
    "shm_ready",
    "threads_per_rank",
]

_SHM_CHANNELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> channel | None
# (weak reference to the group last looked up, its channel): one tuple, replaced whole, so a
# reader never pairs one group's reference with another's channel
_LAST: tuple = (None, None)
_READY: dict[str, bool] = {}  # group name -> its channel is up (read while torch.compile traces)
_COUNTS = {"all_reduce": 0, "all_gather": 0}
_OBSERVERS: list[Callable[[str, int], None]] = []
_ENV_ON = config.shm()  # read at import on purpose: what each rank votes
_STATE = {"on": _ENV_ON}  # the run-time switch (set_shm_enabled), checked after the vote


class ShmChannel:
    """Two alternating buffers of ``SLOT`` bytes per rank, and one pipe per rank for the posts.

    Constructing one is a collective over ``group`` (every rank calls it); it raises RuntimeError
    on every rank alike when the buffer cannot be created or is not shared by all of them.
    """

    SLOT = 1 << 20  # bytes per rank per buffer and piece: 4 MiB went no faster, 256 KiB slower

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
        # a dead peer fails when a gloo collective on this group would
        self.timeout = group_timeout(group) or tpkit_timeout()
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
        for fd in self.wr:
            os.write(fd, self.me)
        pending, r = self.pending, self.r
        # (plain loops: this runs for every collective of a decode step, where Python counts)
        while missing := [i for i in range(self.t) if i != r and pending[i] == 0]:
            if not select.select([self.rd], [], [], self.timeout)[0]:
                raise RuntimeError(
                    f"tpkit shm all-reduce: timed out after {self.timeout:g} s waiting for "
                    f"group rank(s) {missing}; a peer died or skipped this collective. The "
                    "group's own timeout applies (TPKIT_TIMEOUT, in seconds, for the groups "
                    "tpkit creates; init_process_group(timeout=...) for the default group)."
                )
            for b in os.read(self.rd, 256):
                pending[b] += 1
        for i in range(self.t):
            if i != r:
                pending[i] -= 1

    def _pieces(self, x: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(start, length, slots) per ``SLOT``-sized piece of flat ``x``, this rank's part of
        ``slots`` already written and every peer's posted: one exchange per piece."""
        per = self.SLOT // x.element_size()
        flat = x.view(-1)
        for start in range(0, flat.numel(), per):
            n = min(per, flat.numel() - start)
            slots = self._slots(n * x.element_size(), x.dtype)
            slots[self.r].copy_(flat[start : start + n])
            self._exchange()
            yield start, n, slots

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce contiguous ``x`` over the group in place (``op`` "sum" or "max", in rank order,
        so every rank gets the same bits) and return it. A tensor larger than a slot goes
        through in slot-sized pieces."""
        if self.t == 1:
            return x
        flat = x.view(-1)
        fn = torch.add if op == "sum" else torch.maximum
        if (
            x.numel() * x.element_size() <= self.SLOT
        ):  # one piece (every decode step's): no generator
            slots = self._slots(x.numel() * x.element_size(), x.dtype)
            slots[self.r].copy_(flat)
            self._exchange()
            self._reduce(fn, slots, flat)
            return x
        for start, n, slots in self._pieces(x):
            self._reduce(fn, slots, flat[start : start + n])
        return x

    def _reduce(self, fn, slots: torch.Tensor, out: torch.Tensor) -> None:
        fn(slots[0], slots[1], out=out)  # elementwise in rank order: fast in any dtype
        for i in range(2, self.t):
            fn(out, slots[i], out=out)

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Every rank's contiguous ``x`` (last dim ``sizes[rank]``, the leading dims the same
        everywhere) concatenated along the last dim, written straight into the result: no
        stacked copy, no padding, no ``torch.cat`` (for a forward's logits, 4 x 128 x 32000
        float32, that was 3 extra passes over 65 MB). Slot rows are ``max(sizes)`` wide and a
        piece is whole rows; None (the caller gathers otherwise) when one row exceeds a slot."""
        width, total = max(sizes), sum(sizes)
        rows = math.prod(x.shape[:-1])
        per = self.SLOT // (width * x.element_size())
        if per == 0 or rows == 0:
            return None
        out = torch.empty((*x.shape[:-1], total), dtype=x.dtype)
        src, dst = x.view(rows, sizes[self.r]), out.view(rows, total)
        offsets = [sum(sizes[:i]) for i in range(self.t)]
        for a in range(0, rows, per):
            n = min(per, rows - a)
            slots = self._slots(n * width * x.element_size(), x.dtype).view(self.t, n, width)
            slots[self.r, :, : sizes[self.r]].copy_(src[a : a + n])
            self._exchange()
            for i, (off, w) in enumerate(zip(offsets, sizes)):
                dst[a : a + n, off : off + w].copy_(slots[i, :, :w])
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's contiguous ``x`` (same shape everywhere), stacked in rank order (a copy)."""
        out = torch.empty((self.t, x.numel()), dtype=x.dtype)
        for start, n, slots in self._pieces(x):
            out[:, start : start + n].copy_(slots)
        return out.view(self.t, *x.shape)


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
            # every page reserved now: a full /dev/shm fails here (ENOSPC: gloo for the group)
            # rather than with SIGBUS at the first write into a sparse page
            os.posix_fallocate(f.fileno(), 0, nbytes)
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


def threads_per_rank(local_ranks: int, cores: int | None = None) -> int:
    """Intra-op threads for each of ``local_ranks`` ranks sharing this host's ``cores`` (default:
    the CPUs this process may run on): ``cores // local_ranks``, at least 1. The policy for a launcher (``torch.set_num_threads`` in each rank): torchrun's
    default of 1 thread per rank leaves cores idle where there are more cores than ranks (tp=2 on
    16 cores would use 2), and more than ``cores // ranks`` oversubscribes, where every OpenMP
    barrier of one rank then waits on a thread the other rank's work displaced, and every
    collective waits on the slowest rank. On a 2-core host at tp=2 it is 1, which is what the
    measured ratios against one process on both cores (issue 30) used."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_ranks))


def prepare_shm(group: ProcessGroup | None) -> bool:
    """Take ``group``'s decision now (a collective: call it on every rank of the group), so its
    first forward issues no setup collectives; whether the group uses shared memory."""
    return _shm_channel(group) is not None


def _shm_channel(group: ProcessGroup | None) -> ShmChannel | None:
    """The group's channel, or None for gloo: decided once, by every rank together."""
    global _LAST
    if not dist.is_initialized():
        return None
    last, last_channel = _LAST
    if group is not None and last is not None and last() is group:
        return last_channel  # the group of the previous call (every call of a decode step's)
    key = group if group is not None else dist.group.WORLD
    if not isinstance(key, dist.ProcessGroup):  # not a group: let torch.distributed say so
        return None
    try:
        channel = _SHM_CHANNELS[key]
        _LAST = (weakref.ref(key), channel)
        return channel
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
    _READY[key.group_name] = channel is not None
    return channel


# what torch.add / torch.maximum reduce in place on CPU (float8 types do not, bool would not sum)
_DTYPES_OK = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def _eligible(x: torch.Tensor, nbytes: int) -> bool:
    # only what is the same on every TP rank: device, type, dtype, size, tracing
    return (
        type(x) is torch.Tensor
        and x.device.type == "cpu"
        and x.dtype in _DTYPES_OK
        and nbytes > 0
        and x.is_contiguous()
        and not torch.compiler.is_compiling()
    )


def _count(kind: str, nbytes: int) -> None:
    _COUNTS[kind] += 1
    for fn in _OBSERVERS:
        fn(kind, nbytes)


OP_NAMES = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max"}  # the reductions it does


def shm_all_reduce(
    x: torch.Tensor, group: ProcessGroup | None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> torch.Tensor | None:
    """Reduce (``op``: SUM or MAX) a contiguous CPU tensor over ``group`` in place through shared
    memory and return it, or None when the fast path does not apply (off, another op, not a plain
    contiguous CPU tensor of a dtype it sums, not one host, not gloo, compiling): the caller then
    uses the process group."""
    name = OP_NAMES.get(op)
    ch = None if name is None else _channel_for(x, group, "all_reduce")
    return None if ch is None else ch.all_reduce(x, name)


def shm_all_gather(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor | None:
    """Every rank's contiguous CPU ``x`` stacked in rank order (shape ``(t, *x.shape)``), or None
    when the fast path does not apply (as `shm_all_reduce`)."""
    ch = _channel_for(x, group, "all_gather")
    return None if ch is None else ch.all_gather(x)


def shm_gather_last(
    x: torch.Tensor, sizes: list[int], group: ProcessGroup | None
) -> torch.Tensor | None:
    """Every rank's contiguous CPU ``x`` concatenated along the last dim (this rank's width
    ``sizes[rank]``, uneven allowed), written straight into the result (`ShmChannel.all_gather_last`),
    or None when the fast path does not apply (as `shm_all_reduce`; also when one row of
    ``max(sizes)`` values exceeds a slot)."""
    if x.ndim == 0 or max(sizes) * x.element_size() > ShmChannel.SLOT:
        return None
    # decided on what is the same on every rank: the leading dims and the widest part (a rank
    # whose part is empty takes the path with the others, or they would wait for it)
    padded = math.prod(x.shape[:-1]) * max(sizes) * x.element_size()
    ch = _channel_for(x, group, "all_gather", padded)
    return None if ch is None else ch.all_gather_last(x, sizes)


def _channel_for(
    x: torch.Tensor, group: ProcessGroup | None, kind: str, nbytes: int | None = None
) -> ShmChannel | None:
    """The channel ``kind`` of ``x`` takes (counted), or None when the fast path does not apply."""
    nbytes = x.numel() * x.element_size() if nbytes is None else nbytes
    if not _eligible(x, nbytes):
        return None
    ch = _shm_channel(group)
    if ch is None or not _STATE["on"]:
        return None
    _count(kind, nbytes)
    return ch


def shm_ready(group_name: str) -> bool:
    """Whether the group named ``group_name`` has agreed on shared memory and the path is on: no
    collective, a dict lookup that torch.compile can trace (a compiled graph then calls the
    ``tpkit::`` ops of `tpkit.parallel.comm`, which decide again, eagerly, on every call)."""
    return _READY.get(group_name, False) and _STATE["on"]


def shm_enabled() -> bool:
    """Whether eligible collectives take the shared-memory path (TPKIT_CPU_SHM_ALLREDUCE,
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
