"""What context parallelism needs of a model, checked before anything is installed or any
collective runs (pure: a meta model is fine), and what it does to one, in words (`tpkit plan`).

CP wraps a model's attention through transformers' ``AttentionInterface``: the model must be a
transformers model whose attention modules call it ('sdpa' or 'eager'), not an encoder-decoder.
Ulysses gives each cp rank heads/cp of a rank's heads, so both head counts must divide.
"""

from __future__ import annotations

from torch import nn

from tpkit.parallel.context.attention import IMPLEMENTATION, PATHS

__all__ = [
    "ATTENTION_CHOICES",
    "RING_BYTES",
    "check_context",
    "check_model",
    "check_ulysses",
    "describe",
    "is_causal",
    "is_causal_lm",
]

ATTENTION_CHOICES = ("auto", *PATHS)
#: auto picks the ring once one layer's scores (B x H x T/cp x T float32) would pass this size
RING_BYTES = 256 * 2**20


def is_causal(model: nn.Module) -> bool:
    flags = [
        m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)
    ]
    return any(flags) if flags else True


def is_causal_lm(model: nn.Module) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def check_model(model: nn.Module, attention: str) -> str:
    """What CP needs of a model, checked before anything is installed; returns its attention
    implementation (the inner one)."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"cp_attention={attention!r}: choose one of {list(ATTENTION_CHOICES)}.")
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(
            f"context parallelism splits transformers models; {name} is not one (it has no "
            "config and no attention interface to hand the rest of the sequence to)."
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"context parallelism: {name} is an encoder-decoder (cross-attention over another "
            "sequence); it is not supported under cp_size > 1 yet. Use cp_size=1."
        )
    inner = config._attn_implementation
    if inner == IMPLEMENTATION:
        raise ValueError(f"context parallelism is already installed on {name}.")
    if inner not in ("sdpa", "eager") or not type(model)._can_set_attn_implementation():
        why = (
            f"uses attn_implementation={inner!r}"
            if inner not in ("sdpa", "eager")
            else "does not call transformers' AttentionInterface"
        )
        raise ValueError(
            f"context parallelism: {name} {why}; CP wraps 'sdpa' or 'eager' attention. Load it "
            "with attn_implementation='sdpa' (or 'eager'), or use cp_size=1."
        )
    return inner


def check_ulysses(model: nn.Module, tp: int, cp: int) -> None:
    """Ulysses gives each cp rank heads/cp of a rank's heads: both counts must divide."""
    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", 0) or 0
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads and ((heads // tp) % cp or max(1, kv // tp) % cp):
        raise ValueError(
            f"context parallelism: cp_attention='ulysses' gives each cp rank heads/cp of a "
            f"rank's heads, but {heads} heads and {kv} key/value heads at tp_size={tp} do not "
            f"divide by cp_size={cp}; use cp_attention='allgather' or 'ring'."
        )


def check_context(
    model: nn.Module, attention: str, sequence_parallel: bool = False, cp: int = 2, tp: int = 1
) -> None:
    """Everything `apply_context_parallel` would refuse, before any collective (pure)."""
    check_model(model, attention)
    if attention == "ulysses":
        check_ulysses(model, tp, cp)
    if sequence_parallel:
        raise ValueError(
            "sequence_parallel=True with cp_size > 1 is not supported yet: context parallelism "
            "already splits every activation along the sequence; pass sequence_parallel=False."
        )


def describe(model: nn.Module, cp: int, attention: str = "auto", tp: int = 1) -> str:
    """What CP at ``cp`` does to ``model``, in words (`tpkit plan --cp`); checks it first."""
    check_context(model, attention, cp=cp, tp=tp)
    zigzag = is_causal(model)
    parts = 2 * cp if zigzag else cp
    layout = (
        f"zigzag: {parts} chunks, rank r holds chunks r and {parts - 1}-r (causal load balance)"
        if zigzag
        else f"contiguous: rank r holds chunk r of {cp} (bidirectional attention)"
    )
    how = {
        "auto": f"all-gather K/V, the ring once one layer's scores pass {RING_BYTES >> 20} MiB",
        "allgather": "keys and values all-gathered over cp (backward: reduce-scatter)",
        "ring": "keys and values passed around the cp ring, online softmax",
        "ulysses": "all-to-all from sequence to heads and back (heads/cp heads per rank)",
    }[attention]
    return "\n".join(
        [
            f"cp_size={cp}: every sequence split over {cp} ranks, {layout};",
            f"  sequence lengths must divide by {parts} (pad_to_multiple_of={parts}).",
            f"attention ({attention}): {how}; wraps the model's "
            f"{check_model(model, attention)} attention.",
            "positions, masks and labels from the whole sequence; the loss over its target count.",
            "FSDP2 shards over dp_shard x cp (cp ranks hold the same parameters).",
        ]
    )
