"""Fresh memory for a rank's shards: CPU shards of `MAPPED_MIN_BYTES` or more in their own
anonymous mapping, its pages faulted in by the kernel at once (``MAP_POPULATE``).

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
import mmap

import torch

from tpkit import config

__all__ = ["MAPPED_MIN_BYTES", "empty_shard"]

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
