"""Read one rank's slice of a tensor from ``pytorch_model*.bin`` files without running their code.

A ``.bin`` checkpoint is a pickle: unpickled the ordinary way it can call any function it names
(``os.system`` among them). Each file is opened with ``torch.load(weights_only=True, mmap=True)``:
torch's restricted unpickler builds tensors, containers and dtypes only and refuses any other
global, so a crafted file raises `tpkit.UnsafeCheckpointError` (naming the file and torch's
reason) before a byte of it runs, on every rank alike and before any collective. ``mmap=True``
maps the file's storages instead of reading them: a rank then copies its slices out of the
mapping into its shards, and only the pages those slices touch are read, so the peak stays the
shards plus the pages of the tensor being copied (file-backed, reclaimable), never the file.
Files in the pre-1.6 (non-zip) format cannot be mapped; they are read whole, with a warning.

`BinCheckpointIndex` has `tpkit.io.safetensors.CheckpointIndex`'s interface (``entries`` with
each tensor's file, dtype and shape; ``read``), so checks and streaming treat both formats alike.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from tpkit.io.dcp import UnsafeCheckpointError
from tpkit.io.safetensors import CheckpointError, CheckpointIndex, Entry, read_weight_map
from tpkit.log import get_logger

__all__ = ["BinCheckpointIndex", "load_bin"]

log = get_logger(__name__)


def load_bin(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], bool]:
    """The tensors of one ``.bin`` file, memory-mapped, unpickled with torch's weights-only
    unpickler (no code runs), and whether they are mapped (a legacy-format file is read whole).
    Raises `UnsafeCheckpointError` for a file that asks for anything else and `CheckpointError`
    for one that is not a flat ``{name: tensor}`` state dict."""
    path = str(path)
    mapped = True
    try:
        try:
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "zip" not in str(exc).lower() and "mmap" not in str(exc).lower():
                raise
            log.warning(f"{path} is in torch's legacy (non-zip) format: read whole, not mapped.")
            data = torch.load(path, map_location="cpu", weights_only=True)
            mapped = False
    except pickle.UnpicklingError as exc:
        reason = str(exc).strip().splitlines()
        raise UnsafeCheckpointError(
            f"{path}: refused to unpickle it, because loading it could run code: "
            f"{' '.join(reason[:3])} tpkit reads .bin checkpoints with "
            "torch.load(weights_only=True) only. Convert a checkpoint you trust to safetensors "
            "(load it with transformers and save_pretrained) or get its safetensors files."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({exc}).") from None
    if not isinstance(data, Mapping):
        raise CheckpointError(f"{path}: holds a {type(data).__name__}, not a state dict.")
    bad = [str(k) for k, v in data.items() if not (isinstance(k, str) and torch.is_tensor(v))]
    if bad:
        raise CheckpointError(
            f"{path}: {len(bad)} entr(ies) are not name -> tensor, e.g. {bad[0]!r}; a "
            "pytorch_model.bin holds a model's state dict (nested training checkpoints are not "
            "weights files)."
        )
    return dict(data), mapped


class BinCheckpointIndex(CheckpointIndex):
    """Every tensor of ``pytorch_model.bin`` or of the files a ``pytorch_model.bin.index.json``
    names, each file mapped once; `read` copies a rank's slices out of the mapping."""

    def __init__(
        self, path: str | os.PathLike, files: list[Path], index: Path | None = None
    ):  # the parent's header parsing is safetensors': not called
        weight_map = read_weight_map(index) if index is not None else {}
        if index is not None:
            absent = [
                f for f in sorted(set(weight_map.values())) if not (index.parent / f).is_file()
            ]
            if absent:
                raise CheckpointError(
                    f"{index} names {len(absent)} file(s) that do not exist, e.g. "
                    f"{absent[0]}; the checkpoint is incomplete."
                )
        self.entries: dict[str, Entry] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        self._mapped: set[str] = set()  # keys whose pages may be given back (file-backed)
        for f in files:
            tensors, mapped = load_bin(f)
            for key, t in tensors.items():
                self._tensors[key] = t
                if mapped:
                    self._mapped.add(key)
                self.entries[key] = Entry(str(f), t.dtype, tuple(t.shape), 0)
        lost = [k for k in weight_map if k not in self.entries]
        if lost:
            raise CheckpointError(
                f"{path}: the index maps {len(lost)} tensor(s) to files that do not hold them, "
                f"e.g. {lost[0]!r} -> {weight_map[lost[0]]}."
            )

    def mapped(self, key: str, dim: int = 0, ranges=None) -> None:
        """Never a view: an unpickled file's tensors are not laid out as safetensors' runs."""
        return None

    def read(
        self,
        key: str,
        dim: int = 0,
        ranges: list[tuple[int, int]] | None = None,
        dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows ``ranges`` (half-open, concatenated) along ``dim`` of tensor ``key``, copied
        (and converted) from the mapping straight into ``out`` (or a fresh tensor)."""
        src = self._tensors[key]
        shape = self.local_shape(key, dim, ranges)
        if out is None:
            out = torch.empty(shape, dtype=dtype or src.dtype)
        elif tuple(out.shape) != shape:
            raise ValueError(f"read({key!r}): out has shape {tuple(out.shape)}, not {shape}")
        if out.numel() == 0:
            return out
        if not src.dim():
            out.copy_(src)
            return out
        col = 0
        for a, b in ranges or [(0, src.shape[dim])]:
            out.narrow(dim, col, b - a).copy_(src.narrow(dim, a, b - a))
            col += b - a
        if key in self._mapped:
            _drop_pages(src)
        return out


def _madvise():
    """libc's ``madvise`` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_MADVISE = _madvise()
_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _drop_pages(t: torch.Tensor) -> None:
    """Give back the mapped file pages ``t`` was read from, once its slices are copied: a slice
    along any dim but the first touches every page of the tensor, and file-backed pages count in
    the rank's memory until unmapped, so without this a load's peak would grow by every page
    read, up to the whole file. The mapping is private and never written, so the pages are
    clean: dropped, a later read faults them in from the file again."""
    if _MADVISE is None or t.device.type != "cpu" or not t.numel():
        return
    storage = t.untyped_storage()
    begin = storage.data_ptr()
    end = begin + storage.nbytes()
    begin = (begin + _PAGE - 1) // _PAGE * _PAGE  # whole pages inside the storage only
    end = end // _PAGE * _PAGE
    if end > begin:
        _MADVISE(begin, end - begin, _MADV_DONTNEED)
