"""Which quantization a ``quantization_config`` asks for, and which linears it covers.

One reading of transformers' ``BitsAndBytesConfig`` (or a dict of its fields) for both ways a
quantized base reaches tpkit: `tpkit.from_pretrained` quantizing each rank's own slice, and
``tensor_parallel`` of a model transformers already quantized. What tpkit cannot shard exactly
is refused here, with the fix, before any collective (so every rank raises the same error).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["BLOCKSIZE_4BIT", "QuantScheme", "default_skip", "scheme_of", "skipped"]

#: 4-bit blocks bitsandbytes quantizes with (one absmax per 64 values of a row)
BLOCKSIZE_4BIT = 64


@dataclass(frozen=True)
class QuantScheme:
    """A quantization tpkit can shard: ``kind`` is "nf4", "fp4" or "int8"; ``blocksize`` the
    number of input features one 4-bit scale covers (0 for int8: one scale per output row);
    ``compute_dtype`` what 4-bit matmuls run in (None: the input's dtype); ``skip`` module
    names (or name parts) left in floating point, as transformers' ``llm_int8_skip_modules``."""

    kind: str
    blocksize: int
    compute_dtype: torch.dtype | None = None
    skip: tuple[str, ...] = ()

    @property
    def bits(self) -> int:
        return 8 if self.kind == "int8" else 4


def _field(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _dtype(value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    return getattr(torch, str(value).removeprefix("torch."))


def scheme_of(config: Any) -> QuantScheme:
    """The `QuantScheme` of a ``BitsAndBytesConfig`` (or its ``to_dict()``) for a load that
    quantizes each rank's slice; ValueError naming the field and the fix for anything else."""
    method = str(
        getattr(_field(config, "quant_method", ""), "value", _field(config, "quant_method", ""))
    )
    if method not in ("bitsandbytes", ""):
        raise ValueError(
            f"quantization_config: tpkit shards bitsandbytes quantization only (got quant_method="
            f"{method!r}); pass transformers.BitsAndBytesConfig(load_in_4bit=True, ...) or "
            "load_in_8bit=True."
        )
    four, eight = bool(_field(config, "load_in_4bit")), bool(_field(config, "load_in_8bit"))
    skip = tuple(_field(config, "llm_int8_skip_modules") or ())
    if eight and not four:
        if _field(config, "llm_int8_has_fp16_weight"):
            raise ValueError(
                "quantization_config: llm_int8_has_fp16_weight=True keeps float weights and "
                "re-quantizes them every step; tpkit shards int8 weights only. Use "
                "llm_int8_has_fp16_weight=False (the default)."
            )
        return QuantScheme("int8", 0, None, skip)
    if not four:
        raise ValueError(
            "quantization_config asks for neither load_in_4bit nor load_in_8bit; set one of them."
        )
    return _four_bit(config, skip)


def _four_bit(config: Any, skip: tuple[str, ...]) -> QuantScheme:
    kind = _field(config, "bnb_4bit_quant_type", "fp4")
    if kind not in ("nf4", "fp4"):
        raise ValueError(f"quantization_config: bnb_4bit_quant_type={kind!r}; use 'nf4' or 'fp4'.")
    if _field(config, "bnb_4bit_use_double_quant"):
        raise ValueError(
            "quantization_config: bnb_4bit_use_double_quant=True quantizes the 4-bit scales "
            "against their mean over the whole tensor; quantized per rank, each slice would get "
            "its own mean (scales off by ~4e-4) and the ranks would not hold the model you asked "
            "for. Use bnb_4bit_use_double_quant=False (it saves ~0.4 bits per weight), or load "
            "with transformers first and call tpkit.tensor_parallel(model), which slices the "
            "already quantized bytes exactly."
        )
    storage = _dtype(_field(config, "bnb_4bit_quant_storage", None)) or torch.uint8
    if storage != torch.uint8:
        raise ValueError(
            f"quantization_config: bnb_4bit_quant_storage={storage} packs values across rows of "
            "the weight; tpkit splits uint8 storage only. Use the default (torch.uint8)."
        )
    compute = _dtype(_field(config, "bnb_4bit_compute_dtype", None))
    return QuantScheme(kind, BLOCKSIZE_4BIT, compute, skip)


def skipped(name: str, skip: tuple[str, ...]) -> bool:
    """transformers' rule for ``llm_int8_skip_modules``: an entry names a module or a part of
    its dotted name."""
    return any(name == key or f"{key}." in f"{name}." for key in skip)


def default_skip(model: nn.Module) -> tuple[str, ...]:
    """What transformers leaves unquantized when the config names nothing: the output head
    (its logits stay exact, and it is often tied to the input embedding)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return tuple(n for n, m in model.named_modules() if head is not None and m is head)
