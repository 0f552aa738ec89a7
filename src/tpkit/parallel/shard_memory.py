"""Fresh memory for a rank's shards: CPU shards of `HUGE_MIN_BYTES` or more in transparent huge
pages.

Filling fresh memory (reading a slice into it, or copying a shard out of a whole weight) is
mostly page faults, one per 4 KiB page; a 2 MiB page takes 512 times fewer (measured: 130 MiB
read from the page cache in 0.027 s instead of 0.072 s). torch's ``THP_MEM_ALLOC_ENABLE`` does
this for every allocation of a process; this does it for the shards only, which are allocated
once and live as long as the model.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

__all__ = ["HUGE_MIN_BYTES", "empty_shard"]

#: CPU shards of at least this many bytes go in transparent huge pages (2 MiB each)
HUGE_MIN_BYTES = 4 << 20


def empty_shard(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor for a shard: on CPU and of `HUGE_MIN_BYTES` or more, backed by
    its own anonymous mapping advised to use transparent huge pages (the tensor keeps the
    mapping alive; memory is given back when the tensor goes); else ``torch.empty``."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    huge = getattr(mmap, "MADV_HUGEPAGE", None)
    if device.type != "cpu" or nbytes < HUGE_MIN_BYTES or huge is None:
        return torch.empty(shape, dtype=dtype, device=device)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # THP off in this kernel: ordinary pages, still right
        area.madvise(huge)
    return torch.frombuffer(area, dtype=torch.uint8).view(dtype).view(shape)
