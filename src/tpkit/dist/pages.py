"""Transparent huge pages for the large buffers a rank fills on one core.

A fresh tensor of tens of MiB is fresh memory: its first write takes one page fault per 4 KiB
page, with the kernel zeroing each. For a forward's gathered logits (4 x 128 x 32000 float32,
65 MB) that is 16,000 faults on the rank's one thread, ~60 ms of a ~550 ms forward on a 2-core
host, more than the copy itself (measured: 88 ms -> 24 ms with huge pages). A plain process pays
the same faults for its logits, but spread over all its threads inside the matmul.

Two remedies, both torch's or the kernel's, none a cache of ours (a reused output buffer would
be overwritten under a caller who kept the last result):

- the ranks tpkit starts (``tpkit run``, `tpkit.launch`, `tpkit.pool`, launch/torchrun.sh) get
  ``THP_MEM_ALLOC_ENABLE=1`` unless it is set: torch's CPU allocator then aligns every
  allocation of 2 MiB or more to 2 MiB and advises huge pages for it (c10's ``alloc_cpu``);
- `huge_empty`, for the buffers tpkit allocates itself under plain ``torchrun``: an empty tensor
  whose 2 MiB-aligned interior is advised ``MADV_HUGEPAGE`` before its first write (Linux, where
  ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``). Elsewhere, or
  when the advice fails, it is a plain ``torch.empty``.
"""

from __future__ import annotations

import ctypes
import sys

import torch

__all__ = ["HUGE_PAGE", "huge_empty"]

HUGE_PAGE = 2 << 20
_MIN_BYTES = 8 << 20  # below this the faults cost less than the call
_MADV_HUGEPAGE = 14
_STATE: dict[str, object] = {}  # "madvise": the libc function, or None where unavailable


def _madvise():
    if "madvise" not in _STATE:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _STATE["madvise"] = fn
    return _STATE["madvise"]


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, its whole 2 MiB pages advised huge before
    anything touches them (see the module doc): the same tensor, fewer page faults."""
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    madvise = _madvise() if nbytes >= _MIN_BYTES else None
    if madvise is not None:
        start = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (out.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: a failure changes nothing
    return out
