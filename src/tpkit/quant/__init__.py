"""Quantized bases on tensor-parallel shards: QLoRA at tp > 1 with bitsandbytes (4-bit, 8-bit).

    model = tpkit.from_pretrained(path, tp_size=2, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16))
    model = peft.get_peft_model(model, LoraConfig(...))   # adapters laid out by the base's style

or ``tpkit.tensor_parallel(model)`` of a model transformers loaded quantized (its packed bytes
are sliced). The rooms:

    scheme.py     which quantization a config asks for; what cannot be sharded is refused
    checks.py     each quantized linear's split against its format, before any collective
    pack.py       the bytes of a quantized weight cut to a shard, or quantized from one
    linear.py     the quantized linear a rank computes with (its shard as tpkit's own record)
    extension.py  tensor_parallel of a bitsandbytes model (a split extension)
    loading.py    from_pretrained's per-rank quantization

bitsandbytes stays optional (``pip install tpkit[quant]``): nothing here imports it until a
quantized model or config is actually handled. Importing this package registers nothing: the
package ``__init__`` installs `QuantExtension` in the one ordered list of `tpkit.extensions`.
"""

from tpkit.quant.extension import QuantExtension
from tpkit.quant.linear import Linear4bitShard, Linear8bitShard, QuantizedLinear, QuantRecord
from tpkit.quant.loading import QuantizedLoad
from tpkit.quant.scheme import QuantScheme, scheme_of

__all__ = [
    "Linear4bitShard",
    "Linear8bitShard",
    "QuantExtension",
    "QuantRecord",
    "QuantScheme",
    "QuantizedLinear",
    "QuantizedLoad",
    "quantized_weight_bytes",
    "scheme_of",
]


def quantized_weight_bytes(model) -> int:
    """Bytes this rank holds for its weights: local shards of every parameter plus the packed
    quantized weights and their scales."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            total += m.weight_bytes()
    return total
