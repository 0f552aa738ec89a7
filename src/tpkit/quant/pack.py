"""The bytes of a quantized weight, cut to one rank's shard or quantized from it.

bitsandbytes' 4-bit format stores a weight (N out, K in) row-major, two values per byte, with one
absmax scale per block of 64 consecutive values. When K is a multiple of the block size, no block
crosses a row, so the packed bytes reshape to (N, K/2) and the scales to (N, K/64): a rank's
output rows (column-parallel) or its input features (row-parallel, when its slice starts and ends
on block boundaries) are plain slices of both, and quantizing a rank's own float slice gives the
same bytes bit for bit. Double quantization (scales quantized again against a tensor-wide mean)
is undone here into float scales, which slice exactly.

LLM.int8() stores int8 values with one scale per output row (the row's absmax): rows slice
trivially; a row-parallel rank's columns keep the whole row's scale, which a load that quantizes
per rank gets by one all-reduce (max) of its rows' local absmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Packed4bit",
    "Packed8bit",
    "float_absmax",
    "quantize_4bit",
    "quantize_8bit",
    "slice_4bit",
    "slice_8bit",
]

Ranges = list[tuple[int, int]]


@dataclass
class Packed4bit:
    """A 4-bit weight of ``shape`` (N, K): ``data`` (N*K/2 bytes), ``absmax`` (float32, one per
    block, never double-quantized), ``code`` (the 16 values of nf4 or fp4), ``dtype`` (what
    dequantizing gives)."""

    data: torch.Tensor
    absmax: torch.Tensor
    code: torch.Tensor
    shape: tuple[int, int]
    dtype: torch.dtype


@dataclass
class Packed8bit:
    """An int8 weight (N, K) and its per-row scales ``scb`` (float32, N)."""

    data: torch.Tensor
    scb: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)


def float_absmax(state: Any) -> torch.Tensor:
    """A bitsandbytes QuantState's per-block scales as float32 (double quantization undone the
    way ``dequantize_4bit`` undoes it, so the dequantized weight is unchanged)."""
    import bitsandbytes.functional as F

    if not state.nested:
        return state.absmax.float()
    absmax = F.dequantize_blockwise(state.absmax, state.state2)
    absmax += state.offset
    return absmax.float()


def _take(t: torch.Tensor, dim: int, ranges: Ranges, scale: int = 1) -> torch.Tensor:
    parts = [t.narrow(dim, a // scale, (b - a) // scale) for a, b in ranges]
    return torch.cat(parts, dim)  # a copy even of one part: the whole weight must not stay alive


def slice_4bit(w: Packed4bit, dim: int | None, ranges: Ranges, blocksize: int) -> Packed4bit:
    """This rank's shard of ``w``: output rows ``ranges`` (``dim`` 0) or input features
    ``ranges`` (``dim`` 1, block-aligned: checked before the split), or all of it (None)."""
    n, k = w.shape
    if dim is None:
        return w
    rows, scales = w.data.reshape(n, k // 2), w.absmax.reshape(n, k // blocksize)
    if dim == 0:
        data, absmax = _take(rows, 0, ranges), _take(scales, 0, ranges)
        shape = (sum(b - a for a, b in ranges), k)
    else:
        data, absmax = _take(rows, 1, ranges, 2), _take(scales, 1, ranges, blocksize)
        shape = (n, sum(b - a for a, b in ranges))
    return Packed4bit(data.reshape(-1, 1), absmax.reshape(-1), w.code, shape, w.dtype)


def quantize_4bit(weight: torch.Tensor, kind: str, blocksize: int) -> Packed4bit:
    """``weight`` (a rank's float slice) quantized as bitsandbytes does, without double
    quantization."""
    import bitsandbytes.functional as F

    data, state = F.quantize_4bit(
        weight.contiguous(),
        blocksize=blocksize,
        compress_statistics=False,
        quant_type=kind,
        quant_storage=torch.uint8,
    )
    return Packed4bit(data, state.absmax.float(), state.code, tuple(weight.shape), weight.dtype)


def slice_8bit(w: Packed8bit, dim: int | None, ranges: Ranges) -> Packed8bit:
    """This rank's rows (``dim`` 0, with their scales) or columns (``dim`` 1, every row's
    scale kept) of ``w``; all of it for None."""
    if dim is None:
        return w
    if dim == 0:
        return Packed8bit(_take(w.data, 0, ranges), _take(w.scb, 0, ranges))
    return Packed8bit(_take(w.data, 1, ranges), w.scb.clone())


def quantize_8bit(weight: torch.Tensor, dim: int | None, group: Any) -> Packed8bit:
    """LLM.int8() of a rank's float slice, bit for bit what bitsandbytes gives the whole weight:
    fp16 values, ``round(w * 127 / absmax_row)``. A row-parallel slice (``dim`` 1) holds part of
    each row, so the row absmax is the max over the TP ``group`` (one all-reduce, the same on
    every rank)."""
    half = weight.to(torch.float16)
    scb = half.abs().amax(dim=1).float()
    if dim == 1 and group is not None:
        dist.all_reduce(scb, op=dist.ReduceOp.MAX, group=group)
    data = torch.round(half * (127.0 / scb.unsqueeze(-1))).to(torch.int8)
    return Packed8bit(data, scb)
