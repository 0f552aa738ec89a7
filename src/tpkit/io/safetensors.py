"""Read one rank's slice of a tensor from safetensors files without touching the rest.

safetensors' ``safe_open(...).get_slice`` memory-maps the file: a slice along any dimension but
the first faults in every page of the source tensor, and file-backed pages count in the process's
RSS (PEERS.md: transformers' TP peaks at 0.82x a full load per rank at tp=2 for that reason).
This reader parses the header itself and ``pread``s only the byte ranges of the slice, straight
into the destination shard where it can (a CPU tensor of the stored dtype) and otherwise through one
reusable buffer of at most ``BLOCK_BYTES`` (strided slices, dtype conversion, GPU shards), so the
peak is the shard plus one block, never a temporary copy of the tensor.

A slice that is one run of bytes in the file (a whole tensor, or rows of the first dimension)
and wanted on the CPU in its stored dtype need not be read at all: `CheckpointIndex.mapped`
returns it as a view of the file mapped copy-on-write (``UntypedStorage.from_file(shared=False)``,
what safetensors' own ``safe_open`` does), so its pages come from the page cache when first
touched, are shared by every rank on the host, and are copied only if written. It maps whole
pages of that run only: the rest of the file is never faulted in.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

__all__ = [
    "BLOCK_BYTES",
    "DTYPES",
    "MAX_HEADER_BYTES",
    "CheckpointError",
    "CheckpointIndex",
    "Entry",
    "read_weight_map",
]

BLOCK_BYTES = 8 << 20

#: safetensors' dtype names -> torch dtypes (read-only: the format's own table)
DTYPES = MappingProxyType(
    {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
    }
)


@dataclass(frozen=True)
class Entry:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in the file


#: safetensors' own limit on the JSON header (``MAX_HEADER_SIZE`` in the Rust crate).
MAX_HEADER_BYTES = 100_000_000


class CheckpointError(ValueError):
    """A safetensors file whose header does not describe its bytes (truncated, overlapping or
    out-of-range offsets, malformed JSON) or does not fit the model it is loaded into."""


def _read_header(path: str) -> dict[str, Entry]:
    """Parse and check a safetensors header against the file's size, before any byte is trusted.

    Checks what the safetensors library checks (header length, JSON, dtype, shapes, offsets that
    match each tensor's byte size, lie inside the file and neither overlap nor leave holes), so a
    truncated or crafted file is refused here, on every rank alike, with the file and tensor
    named, instead of loading wrong bytes or failing mid-load on one rank.
    """
    size = os.path.getsize(path)
    if size < 8:
        raise _corrupt(path, f"{size} bytes is too short for a safetensors header")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise _corrupt(path, f"header length {n} exceeds the file ({size} bytes) or 100 MB")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _corrupt(path, f"the header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "the header is not a JSON object")
    base = 8 + n
    out: dict[str, Entry] = {}
    spans = []
    for key, info in header.items():
        if key != "__metadata__":
            out[key] = _entry(path, key, info, base, size)
            spans.append((out[key].offset - base, out[key].offset - base + _nbytes(out[key]), key))
    spans.sort()
    at = 0
    for begin, end, key in spans:
        if begin != at:
            what = "overlaps the tensor before it" if begin < at else "leaves a hole before it"
            raise _corrupt(path, f"tensor {key!r} at data_offsets [{begin}, {end}] {what}")
        at = end
    if base + at != size:
        raise _corrupt(path, f"the tensors end at byte {base + at} but the file has {size}")
    return out


def _corrupt(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}; the file is corrupt or truncated.")


def _entry(path: str, key: str, info: object, base: int, size: int) -> Entry:
    """One header entry, checked: dtype known, shape and offsets whole numbers, offsets that span
    exactly the tensor's bytes and end inside the file."""

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise _corrupt(path, f"tensor {key!r} lacks dtype, shape or data_offsets")
    if info["dtype"] not in DTYPES:
        raise CheckpointError(
            f"{path}: tensor {key!r} has unsupported dtype {info['dtype']!r} (tpkit reads "
            f"{', '.join(DTYPES)})."
        )
    shape, offsets = info["shape"], info["data_offsets"]
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise _corrupt(path, f"tensor {key!r} has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise _corrupt(path, f"tensor {key!r} has invalid data_offsets {offsets!r}")
    entry = Entry(path, DTYPES[info["dtype"]], tuple(shape), base + offsets[0])
    begin, end = offsets
    if end - begin != _nbytes(entry):
        raise _corrupt(
            path,
            f"tensor {key!r} ({info['dtype']} {shape}) needs {_nbytes(entry)} bytes but its "
            f"data_offsets {offsets} span {end - begin}",
        )
    if base + end > size:
        raise _corrupt(
            path, f"tensor {key!r} ends at byte {base + end}, past the end of the file ({size})"
        )
    return entry


def _nbytes(entry: Entry) -> int:
    return math.prod(entry.shape) * torch.empty((), dtype=entry.dtype).element_size()


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class CheckpointIndex:
    """Every tensor of a checkpoint: a directory with ``model.safetensors`` or a sharded set with
    ``model.safetensors.index.json``, or a single ``.safetensors`` file. ``files`` (with the
    ``index`` file that maps their tensors, if sharded) names the files instead of a directory's
    glob: what `tpkit.io.hub` resolved for a hub id, a variant or a subfolder."""

    def __init__(
        self,
        path: str | os.PathLike,
        files: list[Path] | None = None,
        index: Path | None = None,
    ):
        path = Path(path)
        weight_map: dict[str, str] = {}
        if files is None:
            files, index = _files_of(path)
        if index is not None:
            weight_map = read_weight_map(index)
            absent = [str(index.parent / f) for f in sorted(set(weight_map.values()))]
            absent = [f for f in absent if not Path(f).is_file()]
            if absent:
                raise CheckpointError(
                    f"{index} names {len(absent)} file(s) that do not exist, e.g. "
                    f"{absent[0]}; the checkpoint is incomplete."
                )
        if not files:
            raise FileNotFoundError(
                f"No safetensors checkpoint in {path} (tpkit loads safetensors, or "
                "pytorch_model*.bin read without running code: see tpkit.io.hub)."
            )
        self.entries: dict[str, Entry] = {}
        self._maps: dict[str, torch.Tensor] = {}  # file -> its bytes, mapped copy-on-write
        self._handed: set[str] = set()  # keys `mapped` has viewed: a second view would alias
        # one reusable read buffer, grown to at most BLOCK_BYTES: allocating and freeing a block
        # per tensor fragments the heap (glibc raises its mmap threshold after the first free)
        self._scratch = torch.empty(0, dtype=torch.uint8)
        for f in files:
            self.entries.update(_read_header(str(f)))
        lost = [k for k, f in weight_map.items() if k not in self.entries]
        if lost:
            raise CheckpointError(
                f"{path}: the index maps {len(lost)} tensor(s) to files that do not hold them, "
                f"e.g. {lost[0]!r} -> {weight_map[lost[0]]}."
            )

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def keys(self):
        return self.entries.keys()

    def local_shape(
        self, key: str, dim: int = 0, ranges: list[tuple[int, int]] | None = None
    ) -> tuple[int, ...]:
        """The shape `read` returns for these ``ranges`` along ``dim`` of ``key``."""
        e = self.entries[key]
        if not e.shape:
            return ()
        picked = sum(b - a for a, b in ranges) if ranges else e.shape[dim]
        return (*e.shape[:dim], picked, *e.shape[dim + 1 :])

    def mapped(
        self, key: str, dim: int = 0, ranges: list[tuple[int, int]] | None = None
    ) -> torch.Tensor | None:
        """Rows ``ranges`` along ``dim`` of ``key`` as a view of the file mapped copy-on-write,
        in the stored dtype, when they are one run of bytes (whole, or one range of the first
        non-trivial dimension) aligned for the dtype; None when they are not (then `read`), and
        for a key viewed before: two parameters loaded from one key must not share memory.

        Writing to the result copies the pages it writes (``MAP_PRIVATE``); the file is never
        changed. The mapping lives as long as any tensor viewing it, so a file replaced by an
        atomic save (a new inode, as `tpkit.io.atomic` writes) leaves it intact.
        """
        e = self.entries[key]
        full = e.shape or (1,)
        esize = torch.empty((), dtype=e.dtype).element_size()
        if ranges and ranges != [(0, full[dim])]:
            if len(ranges) != 1 or math.prod(full[:dim]) != 1:
                return None  # strided: every page of the tensor would be faulted in
            inner = math.prod(full[dim + 1 :])
            start, count = ranges[0][0] * inner, (ranges[0][1] - ranges[0][0]) * inner
        else:
            start, count = 0, math.prod(full)
        if count == 0 or (e.offset + start * esize) % esize or key in self._handed:
            return None
        self._handed.add(key)
        data = self._maps.get(e.file)
        if data is None:
            nbytes = os.path.getsize(e.file)
            storage = torch.UntypedStorage.from_file(e.file, shared=False, nbytes=nbytes)
            data = self._maps[e.file] = torch.empty(0, dtype=torch.uint8).set_(storage)
        at = e.offset + start * esize
        return data[at : at + count * esize].view(e.dtype).view(self.local_shape(key, dim, ranges))

    def _block(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` (<= BLOCK_BYTES) of the reusable buffer, grown in powers of two."""
        if self._scratch.numel() < nbytes:
            size = min(BLOCK_BYTES, 1 << max(16, (nbytes - 1).bit_length()))
            self._scratch = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self._scratch = torch.empty(max(size, nbytes), dtype=torch.uint8)
        return self._scratch[:nbytes]

    def read(
        self,
        key: str,
        dim: int = 0,
        ranges: list[tuple[int, int]] | None = None,
        dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows ``ranges`` (half-open, concatenated) along ``dim`` of tensor ``key``.

        Read straight into ``out`` (any device, any dtype: converted as it is read; shape
        `local_shape`) when given, else into a fresh tensor of ``dtype`` (default: the stored
        one). Nothing the size of the tensor is allocated besides the result: contiguous byte
        ranges are ``pread`` into it directly when it is a CPU tensor of the stored dtype, and
        everything else goes through one reusable buffer of at most ``BLOCK_BYTES``.
        """
        e = self.entries[key]
        shape = self.local_shape(key, dim, ranges)
        if out is None:
            out = torch.empty(shape, dtype=dtype or e.dtype)
        elif tuple(out.shape) != shape:
            raise ValueError(f"read({key!r}): out has shape {tuple(out.shape)}, not {shape}")
        if out.numel() == 0:
            return out
        if not out.is_contiguous():  # rare: through a contiguous copy
            out.copy_(self.read(key, dim, ranges, dtype=out.dtype))
            return out
        full = e.shape or (1,)
        ranges = ranges or [(0, full[dim])]
        outer, inner = math.prod(full[:dim]), math.prod(full[dim + 1 :])
        fd = os.open(e.file, os.O_RDONLY)
        try:
            _Reader(self, fd, e).fill(out.view(outer, -1), full[dim], inner, ranges)
        finally:
            os.close(fd)
        return out


class _Reader:
    """One tensor's reads: spans of the file into a destination, directly or block by block."""

    def __init__(self, index: CheckpointIndex, fd: int, entry: Entry):
        self.index, self.fd, self.e = index, fd, entry
        self.esize = torch.empty((), dtype=entry.dtype).element_size()

    def fill(self, flat: torch.Tensor, size: int, inner: int, ranges) -> None:
        """``flat`` (outer x picked*inner) from the rows ``ranges`` of a (outer, size, inner)
        tensor: whole contiguous runs as spans, strided ones by blocks of whole rows."""
        outer, row = flat.shape[0], size * inner * self.esize
        if ranges == [(0, size)]:  # the whole tensor: one run of bytes
            self.span(0, flat.view(-1))
            return
        if outer == 1:  # slices of the first dim: one run of bytes each
            col = 0
            for a, b in ranges:
                w = (b - a) * inner
                self.span(a * inner * self.esize, flat[0, col : col + w])
                col += w
            return
        if row > BLOCK_BYTES:  # rows too long for a block: each (row, range) is its own span
            for o in range(outer):
                col = 0
                for a, b in ranges:
                    w = (b - a) * inner
                    self.span(o * row + a * inner * self.esize, flat[o, col : col + w])
                    col += w
            return
        step = max(1, BLOCK_BYTES // row)
        for o0 in range(0, outer, step):
            o1 = min(outer, o0 + step)
            block = self.index._block((o1 - o0) * row)
            _pread_into(self.fd, block, self.e.offset + o0 * row, (o1 - o0) * row)
            block = block.view(self.e.dtype).view(o1 - o0, size * inner)
            col = 0
            for a, b in ranges:
                w = (b - a) * inner
                flat[o0:o1, col : col + w].copy_(block[:, a * inner : b * inner])
                col += w

    def span(self, at: int, dst: torch.Tensor) -> None:
        """The file's bytes from ``at`` (relative to the tensor) into 1-D contiguous ``dst``."""
        nbytes = dst.numel() * self.esize
        if dst.device.type == "cpu" and dst.dtype == self.e.dtype:
            _pread_into(self.fd, dst, self.e.offset + at, nbytes)
            return
        per = max(1, BLOCK_BYTES // self.esize)  # elements per block
        for i in range(0, dst.numel(), per):
            n = min(per, dst.numel() - i)
            block = self.index._block(n * self.esize)
            _pread_into(self.fd, block, self.e.offset + at + i * self.esize, n * self.esize)
            dst[i : i + n].copy_(block.view(self.e.dtype))


def _files_of(path: Path) -> tuple[list[Path], Path | None]:
    """(files, index file or None) of a safetensors checkpoint directory or file."""
    if path.is_file():
        return [path], None
    index = sorted(path.glob("*.safetensors.index.json"))
    if index:
        return sorted({path / f for f in read_weight_map(index[0]).values()}), index[0]
    return sorted(path.glob("*.safetensors")), None


def read_weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a sharded checkpoint's index (``model.safetensors.index.json`` or
    ``pytorch_model.bin.index.json``): tensor name -> a file name inside the checkpoint, checked
    so that no entry points outside it."""
    try:
        data = json.loads(Path(index).read_text())
        weight_map = data["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a checkpoint index ({exc!r}).") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str)
        and isinstance(v, str)
        and v
        and not Path(v).is_absolute()
        and ".." not in Path(v).parts
        for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{index}: weight_map must map tensor names to file names inside the checkpoint."
        )
    return weight_map


def _pread_into(fd: int, dst: torch.Tensor, offset: int, nbytes: int) -> None:
    view = memoryview(dst.view(torch.uint8).numpy())  # raw bytes: works for bf16 / fp8 too
    got = 0
    while got < nbytes:
        n = os.preadv(fd, [view[got:nbytes]], offset + got)
        if n <= 0:
            raise OSError(f"short read at byte {offset + got} (wanted {nbytes - got} more)")
        got += n
