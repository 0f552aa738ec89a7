"""``tensor_parallel`` of a model transformers already quantized: slice the packed bytes.

A split extension (`tpkit.extensions.SplitExtension`, installed by the package ``__init__`` in
the one ordered list), so the core never knows about it. ``adapt`` (before the plan is derived)
takes each bitsandbytes linear's packed weight and scales aside and leaves a float ``nn.Linear``
of the global shape on the meta device in its place (the same object, so a parent or a wrapper
that refers to it still does), so the plan, its checks and the styles see ordinary linears.
``prepare`` (after the split derived its one plan) checks the splits of that plan against the
format (`tpkit.quant.checks`), still before any collective; on a refusal the split calls
``undo``, which puts the bitsandbytes linears back. ``finish`` (styles applied) cuts each rank's
shard out of the bytes as the applied style laid the weight out and installs it
(`tpkit.quant.linear.install`). Nothing is re-quantized: the shards dequantize to exactly the
single-process model's values, double quantization included.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import Shard

from tpkit.compat import StridedShard
from tpkit.extensions import SplitExtension
from tpkit.io.shards import local_ranges, tp_coords
from tpkit.plan import Plan
from tpkit.quant.checks import check_splits
from tpkit.quant.linear import install
from tpkit.quant.pack import Packed4bit, Packed8bit, float_absmax, slice_4bit, slice_8bit

if TYPE_CHECKING:
    from tpkit.state import TPOptions

__all__ = ["QuantExtension", "bnb_linears", "shard_of"]


@dataclass
class _Source:
    """One bitsandbytes linear taken apart: its packed weight and what ``prepare`` replaced."""

    packed: Packed4bit | Packed8bit
    kind: str
    blocksize: int
    compute_dtype: torch.dtype | None
    saved: dict[str, Any]


def bnb_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Every bitsandbytes 4-bit or 8-bit linear of ``model`` (none when bitsandbytes was never
    imported: then there can be none, and tpkit does not import it)."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return {}
    kinds = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    return {n: m for n, m in model.named_modules() if isinstance(m, kinds)}


def _take_apart(name: str, module: nn.Module) -> _Source:
    import bitsandbytes as bnb

    weight = module.weight
    saved = {"__class__": type(module), "weight": weight, "__dict__": dict(module.__dict__)}
    if isinstance(module, bnb.nn.Linear4bit):
        state = weight.quant_state
        if getattr(state, "packing_format_for_cpu", False):
            raise ValueError(
                f"{name}: its 4-bit weight was repacked for bitsandbytes' AVX512-BF16 CPU "
                "kernel by an eval forward; split the model before running it."
            )
        n, k = state.shape
        packed = Packed4bit(weight.data, float_absmax(state), state.code, (n, k), state.dtype)
        return _Source(packed, state.quant_type, state.blocksize, module.compute_dtype, saved)
    scb = weight.SCB if getattr(weight, "SCB", None) is not None else module.state.SCB
    if weight.dtype != torch.int8 or scb is None:
        raise ValueError(
            f"{name}: an 8-bit linear with float weights (has_fp16_weights=True) has no int8 "
            "shard to split; load with llm_int8_has_fp16_weight=False."
        )
    return _Source(Packed8bit(weight.data, scb.float()), "int8", 0, None, saved)


def _stand_in(module: nn.Module, dtype: torch.dtype) -> None:
    """The bitsandbytes linear as a float ``nn.Linear`` of its global shape, weight on meta."""
    module.__class__ = nn.Linear
    shape = (module.out_features, module.in_features)
    module._parameters["weight"] = nn.Parameter(
        torch.empty(shape, device="meta", dtype=dtype), requires_grad=False
    )


def _restore(module: nn.Module, source: _Source) -> None:
    module.__dict__.clear()
    module.__dict__.update(source.saved["__dict__"])
    module._parameters["weight"] = source.saved["weight"]
    module.__class__ = source.saved["__class__"]


def shard_of(weight: torch.Tensor) -> tuple[int | None, list[tuple[int, int]]]:
    """The split dim of a (DTensor) weight and this rank's ranges along it."""
    placement, tp, rank = tp_coords(weight)
    if not isinstance(placement, (Shard, StridedShard)):
        return None, []
    return placement.dim, local_ranges(placement, weight.shape[placement.dim], tp, rank)


class QuantExtension(SplitExtension):
    """The split extension for bitsandbytes-quantized models (see the module docstring)."""

    def handle(
        self, model: nn.Module, device_ids: Sequence | None, options: TPOptions
    ) -> nn.Module | None:
        """Refuse a PEFT model on a bitsandbytes base: peft wrapped its layers in its
        bitsandbytes LoRA classes, which tpkit's adapter layouts do not take."""
        peft = sys.modules.get("peft")
        if peft is not None and isinstance(model, peft.PeftModel) and bnb_linears(model):
            raise ValueError(
                f"tensor_parallel got a PEFT model on a bitsandbytes-quantized base "
                f"({type(model).__name__}); split the quantized base first, then add adapters: "
                "peft.get_peft_model(tpkit.tensor_parallel(base), config), or load saved ones: "
                "peft.PeftModel.from_pretrained(tpkit.tensor_parallel(base), adapter_dir)."
            )
        return None

    def adapt(self, model: nn.Module, options: TPOptions) -> Any:
        """Each bitsandbytes linear's bytes taken aside, a float meta ``nn.Linear`` in its
        place, so the plan is derived on ordinary linears."""
        found = bnb_linears(model)
        if not found:
            return None
        sources = {name: _take_apart(name, m) for name, m in found.items()}
        float_dtype = _float_dtype(model)
        for name, module in found.items():
            packed = sources[name].packed
            _stand_in(module, packed.dtype if isinstance(packed, Packed4bit) else float_dtype)
        return sources

    def prepare(
        self, model: nn.Module, plan: Plan, tp: int, options: TPOptions, adapted: Any
    ) -> Any:
        """The derived plan's split of each taken-apart linear checked against its format."""
        if adapted is None:
            return None
        targets = {n: (s.kind, s.blocksize) for n, s in adapted.items()}
        check_splits(model, plan, tp, targets)
        return adapted

    def undo(self, model: nn.Module, adapted: Any) -> None:
        """The bitsandbytes linears back, as they were before `adapt`."""
        modules = dict(model.named_modules())
        for name, source in adapted.items():
            _restore(modules[name], source)

    def finish(self, model: nn.Module, context: Any, tp_mesh: Any) -> None:
        modules = dict(model.named_modules())
        for name, source in context.items():
            module = modules[name]
            weight = module._parameters["weight"]
            dim, ranges = shard_of(weight)
            if isinstance(source.packed, Packed4bit):
                packed = slice_4bit(source.packed, dim, ranges, source.blocksize)
            else:
                packed = slice_8bit(source.packed, dim, ranges)
            shape = tuple(weight.shape)
            install(module, packed, shape, source.kind, source.blocksize, source.compute_dtype)


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The model's float dtype (what its unquantized parameters are in)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
