"""Memory for a rank's shards: the weight's own, where the shard is one contiguous run of a
weight that its module alone held (`keep_in_place`); else fresh memory, CPU shards of
`MAPPED_MIN_BYTES` or more in their own anonymous mapping, its pages faulted in by the kernel at
once (``MAP_POPULATE``).

Kept in place, a shard costs no fresh page and no copy, and the split never holds more than
the whole weights it started from: ``tensor_parallel(model, plan="infer")`` of a 1.1B Llama in
memory at tp=2 took 3.2 s with every shard copied out, 0.9 s with the contiguous ones kept:
the column-parallel layers', the vocabulary-split embeddings' and the weights kept whole
(``benchmarks/ready.py``). A row-parallel layer's shard (its input dimension split) is a
strided run and still copied: squeezing it together in place would write into memory whose
mapping a module cannot vouch for (shared with another process, or read-only).

Filling fresh memory (reading a slice into it, or copying a shard out of a whole weight) is
mostly page faults, one trap per 4 KiB page. Asking for the pages with the mapping makes that
one system call: 2.4 -> 2.9 GB/s for a first write on this project's 2-core VM (1.5 GB in
23 MB shards, ``benchmarks/ready.py``'s 1.1B row is 2.2 GB a rank).

Transparent huge pages (512 times fewer faults) are opt-in, ``TPKIT_HUGE_PAGES=1``
(`tpkit.config.huge_pages`). They were the default, and are faster for the first few hundred
MB; beyond that, on this project's virtual machine (Firecracker), faults fell to 0.45 GB/s,
four times slower than ordinary pages (no compaction stalls counted: most likely each 2 MiB
fault takes fresh guest memory the host has not backed yet). ``tensor_parallel`` of a 1.1B
Llama at tp=2 took 6.6 s with them instead of 2.7 s. On bare metal the kernel may stall on
compaction for them instead (which is why databases turn them off); measure before turning
them on.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys

import torch

from tpkit import config

__all__ = ["IN_PLACE_MIN_BYTES", "MAPPED_MIN_BYTES", "empty_shard", "give_back", "keep_in_place"]

#: CPU shards of at least this many bytes get their own populated mapping (huge pages if asked)
MAPPED_MIN_BYTES = 4 << 20


def empty_shard(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor for a shard: on CPU and of `MAPPED_MIN_BYTES` or more, backed by
    its own anonymous mapping (the tensor keeps it alive; memory is given back when the tensor
    goes), its pages faulted in at once, or advised to use transparent huge pages when
    ``TPKIT_HUGE_PAGES`` is on; else ``torch.empty``."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < MAPPED_MIN_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    huge = getattr(mmap, "MADV_HUGEPAGE", None) if config.huge_pages() else None
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if huge is None:  # populated now (a huge page advice must come before any fault)
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    area = mmap.mmap(-1, nbytes, flags=flags)
    if huge is not None:
        with contextlib.suppress(OSError):  # THP off in this kernel: ordinary pages, still right
            area.madvise(huge)
    return torch.frombuffer(area, dtype=torch.uint8).view(dtype).view(shape)


#: weights of at least this many bytes may keep their shards in place (`keep_in_place`); below
#: it a copy into ``torch.empty`` costs about as little
IN_PLACE_MIN_BYTES = 64 << 10
#: ``madvise(2)``'s "these pages may go" (Linux): private memory reads back as zeros (anonymous)
#: or as the file (a private file mapping), shared memory keeps its contents elsewhere
_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE


def keep_in_place(whole: torch.Tensor, start: int, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The elements ``[start, start + numel(shape))`` of contiguous CPU ``whole``, as a tensor
    of ``shape`` over ``whole``'s own memory, every other whole page of ``whole`` given back to
    the kernel; None where that cannot be done here (not Linux, not a plain contiguous CPU
    tensor, smaller than `IN_PLACE_MIN_BYTES`).

    A shard that is one contiguous run of its weight (its rows split, or a weight kept whole)
    needs neither fresh memory nor a copy: faulting in fresh pages, copying into them and
    freeing the weights was about half of ``tensor_parallel``'s split of a 292M Llama, and the
    split never needs more memory than the weights it starts from. The tensor gets a storage of exactly its own bytes (so ``torch.save`` of it
    writes the shard, not the weight) that keeps ``whole``'s memory alive.

    A weight transformers loaded is a view of its checkpoint, mapped copy-on-write: its shard
    stays in that mapping, as the unsplit model had it (as `tpkit.io.stream` maps runs of the
    file itself); tpkit's saves replace a file (a new inode), never write into a mapped one.

    The caller must hold ``whole``'s memory alone (`tpkit.compat.storage_holders` is 1 and no
    parameter object is left): the pages given back read as zeros afterwards.
    """
    numel = torch.Size(shape).numel()
    size = whole.element_size()
    if (
        not _plain_cpu(whole)
        or whole.nbytes < IN_PLACE_MIN_BYTES
        or not 0 <= start < start + numel <= whole.numel()
    ):
        return None
    base = whole.data_ptr()
    lo, hi = base + start * size, base + (start + numel) * size
    view = (ctypes.c_ubyte * (hi - lo)).from_address(lo)
    view.owner = whole  # the memory lives while the shard does
    kept = torch.frombuffer(view, dtype=torch.uint8).view(whole.dtype).view(shape)
    _give_back(base, lo)  # last: nothing after it can fail and leave ``whole`` part zeros
    _give_back(hi, base + whole.nbytes)
    return kept


def give_back(whole: torch.Tensor) -> None:
    """Give ``whole``'s pages back to the kernel once its shard has been copied out of it, where
    the caller held it alone (`keep_in_place`'s terms): a no-op off Linux and for what is not a
    contiguous CPU tensor.

    Freeing the tensor does not always do it: a weight transformers loaded is a view of the
    checkpoint's mapping, which stays mapped (and every page the copy read, resident) while any
    other weight's shard kept in place lives there; a heap block keeps its pages too."""
    if _plain_cpu(whole):
        _give_back(whole.data_ptr(), whole.data_ptr() + whole.nbytes)


def _plain_cpu(t: torch.Tensor) -> bool:
    """A plain contiguous CPU tensor on Linux: its bytes are one run at ``data_ptr()`` whose
    pages ``madvise`` may give back."""
    return (
        sys.platform == "linux"
        and type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
    )


def _give_back(lo: int, hi: int) -> None:
    """``madvise(DONTNEED)`` the whole pages in ``[lo, hi)`` (none if there are none). Refused
    (locked pages, say): still right, only not given back."""
    a, b = -(-lo // _PAGE) * _PAGE, hi // _PAGE * _PAGE
    if b > a:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_DONTNEED)
