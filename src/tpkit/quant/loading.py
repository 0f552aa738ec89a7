"""`tpkit.from_pretrained(..., quantization_config=...)`: each rank quantizes its own slice.

The model is built on meta and split as usual; before the split, the linears to quantize are
chosen (every ``nn.Linear`` but the skipped ones, transformers' rule) and their splits checked
against the format (`tpkit.quant.checks`), on every rank before any collective. After the split,
each chosen linear's float slice is read from the checkpoint, quantized at once and installed
(`tpkit.quant.linear.install`) before the next is read, so a rank's peak is its quantized shards
plus one layer's float slice; the remaining parameters then stream in as usual.

Quantizing a rank's rows, or its block-aligned input features, gives the very bytes a
single-process bitsandbytes load gives (`tpkit.quant.pack`), so the sharded model is the
single-process quantized model, split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tpkit.quant.checks import check_splits, derive_for, tp_of
from tpkit.quant.extension import shard_of
from tpkit.quant.linear import QuantizedLinear, install
from tpkit.quant.pack import quantize_4bit, quantize_8bit
from tpkit.quant.scheme import default_skip, scheme_of, skipped
from tpkit.safetensors_io import CheckpointIndex

__all__ = ["QuantizedLoad"]


class QuantizedLoad:
    """The quantization part of one `tpkit.from_pretrained` call (see the module docstring):
    built on the meta model before the split (every refusal happens here), then `stream` after
    it."""

    def __init__(
        self,
        model: nn.Module,
        quantization_config: Any,
        options: Any,
        device_ids: Sequence | None = None,
    ) -> None:
        self.scheme = scheme_of(quantization_config)
        if self.scheme.bits == 4:
            import bitsandbytes  # noqa: F401 - a clear ImportError now, not mid-load

        skip = self.scheme.skip or default_skip(model)
        self.targets = [
            n
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear)
            and not isinstance(m, QuantizedLinear)
            and not skipped(n, skip)
        ]
        _refuse_tied(model, self.targets)
        tp = tp_of(options, device_ids)
        if tp > 1 and self.targets:
            info = dict.fromkeys(self.targets, (self.scheme.kind, self.scheme.blocksize))
            check_splits(model, derive_for(model, options, tp), tp, info)

    def stream(
        self,
        model: nn.Module,
        index: CheckpointIndex,
        keys: dict[str, str | None],
        device: torch.device,
    ) -> None:
        """Read, quantize and install each target's slice, one layer at a time."""
        modules = dict(model.named_modules())
        s = self.scheme
        for name in self.targets:
            module = modules[name]
            weight = module._parameters["weight"]
            dim, ranges = shard_of(weight)
            key = keys[f"{name}.weight"]
            read_dim, read_ranges = (dim, ranges) if dim is not None else (0, None)
            shape = index.local_shape(key, read_dim, read_ranges)
            local = torch.empty(shape, dtype=weight.dtype, device=device)
            index.read(key, read_dim, read_ranges, out=local)
            if s.bits == 4:
                packed = quantize_4bit(local, s.kind, s.blocksize)
            else:
                group = weight.device_mesh.get_group() if isinstance(weight, DTensor) else None
                packed = quantize_8bit(local, dim, group)
            del local
            install(module, packed, tuple(weight.shape), s.kind, s.blocksize, s.compute_dtype)


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
