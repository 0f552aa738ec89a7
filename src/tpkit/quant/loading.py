"""`tpkit.from_pretrained(..., quantization_config=...)`: each rank quantizes its own slice.

The model is built on meta and split as usual; before the split, the linears to quantize are
chosen (every ``nn.Linear`` but the skipped ones, transformers' rule). `QuantizedLoad` is a split
extension for that one call (``split(..., extensions=(load,))``): the split derives the plan
once and hands it to ``prepare``, which checks the chosen linears' splits against the format
(`tpkit.quant.checks`), on every rank before any collective. After the split,
each chosen linear's float slice is read from the checkpoint, quantized at once and installed
(`tpkit.quant.linear.install`) before the next is read, into one arena allocated up front, so a
rank's peak is its quantized shards plus one layer's float slice and its quantization
temporaries (`benchmarks/quant.py`: 87 MiB for 26 MiB of nf4 shards of a 100M Llama at tp=2,
against 124 MiB for its 108 MiB of fp32 shards); the remaining parameters then stream in as usual.

Quantizing a rank's rows, or its block-aligned input features, gives the very bytes a
single-process bitsandbytes load gives (`tpkit.quant.pack`), so the sharded model is the
single-process quantized model, split.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tpkit.extensions import SplitExtension
from tpkit.io.safetensors import CheckpointIndex
from tpkit.plan import Plan
from tpkit.quant.checks import check_no_offload, check_splits
from tpkit.quant.extension import shard_of
from tpkit.quant.linear import QuantizedLinear, install
from tpkit.quant.pack import Packed4bit, Packed8bit, quantize_4bit, quantize_8bit
from tpkit.quant.scheme import default_skip, scheme_of, skipped

__all__ = ["QuantizedLoad"]


class QuantizedLoad(SplitExtension):
    """The quantization part of one `tpkit.from_pretrained` call (see the module docstring):
    built on the meta model before the split (the scheme and tied weights refused here), passed
    to that one split as an extension (its splits checked against the derived plan in
    `prepare`), then `stream` after it."""

    def __init__(self, model: nn.Module, quantization_config: Any) -> None:
        self.scheme = scheme_of(quantization_config)
        if self.scheme.bits == 4:
            _need_bitsandbytes()

        skip = self.scheme.skip or default_skip(model)
        self.targets = [
            n
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear)
            and not isinstance(m, QuantizedLinear)
            and not skipped(n, skip)
        ]
        _refuse_tied(model, self.targets)

    def prepare(self, model: nn.Module, plan: Plan, tp: int, options: Any, adapted: Any) -> Any:
        """Every target's split in the split's one derived ``plan``, checked against the format
        (nothing for `finish`: the weights are streamed in after the split); no CPU offload."""
        check_no_offload(options)
        if tp > 1 and self.targets:
            info = dict.fromkeys(self.targets, (self.scheme.kind, self.scheme.blocksize))
            check_splits(model, plan, tp, info)
        return None

    def stream(
        self,
        model: nn.Module,
        index: CheckpointIndex,
        keys: dict[str, str | None],
        device: torch.device,
        fresh: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Read, quantize and install each target's slice, one layer at a time (a new weight's
        slice from its full value in ``fresh``)."""
        fresh = fresh or {}
        modules = dict(model.named_modules())
        s = self.scheme
        weights = {n: modules[n]._parameters["weight"] for n in self.targets}
        shapes = {n: _local_shape(w) for n, w in weights.items()}
        arena = _Arena(shapes.values(), s, device)
        largest = max((a * b for a, b in shapes.values()), default=0)
        buffers: dict[torch.dtype, torch.Tensor] = {}
        for name, weight in weights.items():
            dim, ranges = shard_of(weight)
            read_dim, read_ranges = (dim, ranges) if dim is not None else (0, None)
            buf = buffers.get(weight.dtype)
            if buf is None:
                buf = buffers[weight.dtype] = torch.empty(
                    largest, dtype=weight.dtype, device=device
                )
            local = buf[: shapes[name][0] * shapes[name][1]].view(shapes[name])
            if f"{name}.weight" in fresh:
                local.copy_(_rows(fresh[f"{name}.weight"], read_dim, read_ranges))
            else:
                index.read(keys[f"{name}.weight"], read_dim, read_ranges, out=local)
            if s.bits == 4:
                packed = arena.keep_4bit(quantize_4bit(local, s.kind, s.blocksize))
            else:
                group = weight.device_mesh.get_group() if isinstance(weight, DTensor) else None
                packed = arena.keep_8bit(quantize_8bit(local, dim, group))
            install(
                modules[name], packed, tuple(weight.shape), s.kind, s.blocksize, s.compute_dtype
            )


def _need_bitsandbytes() -> None:
    """A clear ImportError before the load starts, not one mid-way through it."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "quantization_config with load_in_4bit needs bitsandbytes: pip install 'tpkit[quant]'"
        ) from exc


def _rows(full: torch.Tensor, dim: int, ranges: list[tuple[int, int]] | None) -> torch.Tensor:
    """The ``ranges`` along ``dim`` of ``full``, concatenated (what `CheckpointIndex.read`
    returns for them)."""
    if ranges is None:
        return full
    return torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim)


def _local_shape(weight: torch.Tensor) -> tuple[int, int]:
    dim, ranges = shard_of(weight)
    shape = list(weight.shape)
    if dim is not None:
        shape[dim] = sum(b - a for a, b in ranges)
    return shape[0], shape[1]


class _Arena:
    """One allocation for all packed weights and one for all scales of a load, made before the
    first layer is quantized. Without it, each layer's small kept results land between that
    layer's large, freed quantization temporaries, and the heap keeps growing: measured on a
    100M-parameter Llama at tp=2, RSS rose by 3 to 6 times the kept bytes per layer."""

    def __init__(self, shapes, scheme: Any, device: torch.device) -> None:
        shapes = list(shapes)
        if scheme.bits == 4:  # bitsandbytes pads the last byte and the last block of a whole
            values = sum(-(-n * k // 2) for n, k in shapes)  # weight left unsplit
            scales = sum(-(-n * k // scheme.blocksize) for n, k in shapes)
        else:
            values, scales = sum(n * k for n, k in shapes), sum(n for n, _ in shapes)
        self.values = torch.empty(values, dtype=torch.uint8, device=device)
        self.scales = torch.empty(scales, dtype=torch.float32, device=device)
        self.at = [0, 0]

    def _put(self, which: int, t: torch.Tensor) -> torch.Tensor:
        pool = self.values if which == 0 else self.scales
        flat = t.reshape(-1).view(pool.dtype) if which == 0 else t.reshape(-1).float()
        start = self.at[which]
        self.at[which] = start + flat.numel()
        out = pool[start : self.at[which]]
        out.copy_(flat)
        return out.view(t.dtype).view(t.shape) if which == 0 else out.view(t.shape)

    def keep_4bit(self, w: Packed4bit) -> Packed4bit:
        return Packed4bit(self._put(0, w.data), self._put(1, w.absmax), w.code, w.shape, w.dtype)

    def keep_8bit(self, w: Packed8bit) -> Packed8bit:
        return Packed8bit(self._put(0, w.data), self._put(1, w.scb))


def _refuse_tied(model: nn.Module, targets: list[str]) -> None:
    """A quantized weight cannot also be another module's float weight (a tied head)."""
    wanted = set(targets)
    seen: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        w = module._parameters.get("weight")
        if w is not None:
            seen.setdefault(id(w), []).append(name)
    for names in seen.values():
        if len(names) > 1 and wanted & set(names):
            raise ValueError(
                f"{sorted(wanted & set(names))[0]}: its weight is tied to {names}; a quantized "
                "weight cannot also be a float one. Add it to llm_int8_skip_modules."
            )
