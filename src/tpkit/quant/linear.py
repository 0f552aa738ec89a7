"""The quantized linear of a tensor-parallel model: this rank's packed shard, computed locally.

A DTensor cannot hold bitsandbytes' ``Params4bit`` with its quant state (the packed bytes are
not the weight's shape, and the scales live beside them), so a quantized linear keeps its
rank's shard as tpkit's own record instead: the packed bytes as the ``weight`` buffer, the
scales beside them, and `QuantRecord` (scheme, global and local shapes). ``in_features`` and
``out_features`` stay global, as on every tpkit layer. The module keeps the style tpkit applied
to it (``_tpkit_style``): column-parallel, it computes its local output rows after f;
row-parallel, it computes partial sums over its local input features and the style all-reduces
them (g) and adds the bias once. The buffers are not in ``state_dict()``: like the frozen base
of any QLoRA run, they are re-made from the base checkpoint, and only adapters (or a DCP
checkpoint of adapters and optimizer) are saved; tpkit's gathering ``save_pretrained`` refuses
the base (`QuantizedLinear.tpkit_not_saved`) rather than write a checkpoint without them.

The class is a plain ``nn.Linear`` subclass, not bitsandbytes', so plain ``peft`` wraps it in
its ordinary LoRA layer and tpkit lays the adapters out by the base's style
(`tpkit.integrations.lora`). The arithmetic is bitsandbytes': 4-bit through ``matmul_4bit`` in
the compute dtype, int8 as bitsandbytes' CPU training path (the int8 weight dequantized by its
row scales), in every mode: its inference path quantizes activations per row over all input
features, which a row-parallel shard cannot reproduce without gathering its input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tpkit.quant.pack import Packed4bit, Packed8bit

__all__ = ["Linear4bitShard", "Linear8bitShard", "QuantRecord", "QuantizedLinear", "install"]


@dataclass(frozen=True)
class QuantRecord:
    """What a quantized shard is: ``kind`` ("nf4", "fp4", "int8"), ``blocksize`` (4-bit),
    ``global_shape`` and ``local_shape`` (out, in), ``compute_dtype`` and ``dtype`` (the float
    dtype the weight dequantizes to)."""

    kind: str
    blocksize: int
    global_shape: tuple[int, int]
    local_shape: tuple[int, int]
    compute_dtype: torch.dtype | None
    dtype: torch.dtype


class QuantizedLinear(nn.Linear):
    """Base of tpkit's quantized linears (see the module docstring)."""

    quant: QuantRecord
    #: read by tpkit's gathering ``save_pretrained`` (`tpkit.io.save`), which refuses on every rank
    tpkit_not_saved = (
        "holds this rank's quantized shard, which is not in state_dict(): saving the quantized "
        "base is not supported. Save the adapter (peft_model.save_pretrained(dir)) or a "
        "resumable checkpoint (tpkit.save_checkpoint(dir, model, optimizer)); the base is "
        "re-made from its checkpoint."
    )

    def extra_repr(self) -> str:
        q = self.quant
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, quant={q.kind}, local={q.local_shape}"
        )

    def _apply(self, fn, recurse: bool = True):
        """``model.to(device)`` moves the scales; ``model.half()`` / ``.to(torch.bfloat16)`` must
        not cast them (bitsandbytes keeps them float32 inside its quant state, out of reach of a
        cast; a float16 absmax would change every dequantized weight)."""
        scales = {n: b for n, b in self._buffers.items() if n in _SCALES and b is not None}
        for name in scales:
            del self._buffers[name]
        try:
            return super()._apply(fn, recurse)
        finally:
            for name, b in scales.items():
                device = fn(torch.empty(0, dtype=b.dtype, device=b.device)).device
                self._buffers[name] = b.to(device)

    def weight_bytes(self) -> int:
        """Bytes this rank holds for the quantized weight (packed values and scales)."""
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))


class Linear4bitShard(QuantizedLinear):
    """4-bit (nf4 / fp4) shard: ``weight`` packed bytes, ``absmax`` per block, ``quant_code``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes as bnb
        from bitsandbytes.functional import QuantState

        q = self.quant
        state = QuantState(
            absmax=self.absmax,
            shape=torch.Size(q.local_shape),
            code=self.quant_code,
            blocksize=q.blocksize,
            quant_type=q.kind,
            dtype=q.dtype,
        )
        dtype = x.dtype
        if q.compute_dtype is not None:
            x = x.to(q.compute_dtype)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return bnb.matmul_4bit(x, self.weight.t(), quant_state=state, bias=bias).to(dtype)


class Linear8bitShard(QuantizedLinear):
    """int8 shard: ``weight`` int8 values, ``scb`` one scale per (local) output row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(x.dtype).mul_(self.scb.unsqueeze(1).mul(1.0 / 127.0))
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return nn.functional.linear(x, w, bias)


#: float32 scales and code book: they follow the module's device, never its dtype
_SCALES = ("absmax", "quant_code", "scb")

#: attributes of bitsandbytes' own linears that hold the whole weight or its state
_BNB_ATTRS = (
    "quant_state",
    "state",
    "compute_dtype",
    "compute_type_is_set",
    "quant_storage",
    "support_avx512bf16_for_cpu",
    "index",
)


def install(
    module: nn.Linear,
    packed: Packed4bit | Packed8bit,
    global_shape: tuple[int, int],
    kind: str,
    blocksize: int = 0,
    compute_dtype: torch.dtype | None = None,
    dtype: torch.dtype = torch.float32,
) -> QuantizedLinear:
    """Turn ``module`` (an ``nn.Linear`` tpkit split, or a bitsandbytes linear) into this rank's
    quantized shard, in place: the object stays the one the plan named, with its style's hooks,
    record and parent, so nothing that refers to it needs to change."""
    module._parameters.pop("weight", None)
    for name in _BNB_ATTRS:
        module.__dict__.pop(name, None)
    if isinstance(packed, Packed4bit):
        module.__class__ = Linear4bitShard
        buffers = {"weight": packed.data, "absmax": packed.absmax, "quant_code": packed.code}
        dtype = packed.dtype
    else:
        module.__class__ = Linear8bitShard
        buffers = {"weight": packed.data, "scb": packed.scb}
    for name, value in buffers.items():
        module.register_buffer(name, value, persistent=False)
    module.quant = QuantRecord(
        kind, blocksize, tuple(global_shape), tuple(packed.shape), compute_dtype, dtype
    )
    return module
