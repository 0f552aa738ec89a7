"""One batch under context parallelism: what may be split, the whole sequence's positions and
packed-sequence ids, a fingerprint that tells whether two ranks were given the same batch, and the
per-token loss summed over a rank's tokens.

Everything but the loss is pure and runs before any collective, so a bad batch is one clear
ValueError on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

__all__ = [
    "SPLIT",
    "TAKEN",
    "check_inputs",
    "fingerprint",
    "has_cache",
    "packed_sequences",
    "token_loss_sum",
    "whole_positions",
]

#: inputs split along the sequence with the batch
SPLIT = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids")
#: inputs the split consumes (the mask is handed on whole)
TAKEN = ("labels", "shift_labels", "num_items_in_batch", "attention_mask")


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ cross-entropy over this rank's tokens (-100 ignored), as transformers' loss sums it."""
    if isinstance(logits, DTensor):  # vocab-parallel logits (loss_parallel)
        from tpkit.training.loss import vocab_parallel_cross_entropy

        mesh, local = logits.device_mesh, logits.to_local()
        return vocab_parallel_cross_entropy(
            local.reshape(-1, local.shape[-1]), targets.reshape(-1).to(local.device),
            logits.shape[-1], mesh.get_local_rank(), mesh.size(), mesh.get_group(),
        ).sum()  # fmt: skip
    flat = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(
        flat, targets.reshape(-1).to(flat.device), ignore_index=-100, reduction="sum"
    )


def has_cache(bound: dict) -> bool:
    return any(bound.get(k) is not None for k in ("past_key_values", "cache", "cache_position"))


def check_inputs(bound: dict, b: int, t: int) -> None:
    """Refuse what the split cannot carry, before any collective."""
    for name, value in bound.items():
        if not isinstance(value, torch.Tensor) or name in SPLIT + TAKEN:
            continue
        raise ValueError(
            f"context parallelism does not know how to split the input {name!r} "
            f"(shape {tuple(value.shape)}); text inputs only (input_ids or inputs_embeds, "
            "attention_mask, position_ids, token_type_ids, labels). Use cp_size=1 for this model."
        )
    mask = bound.get("attention_mask")
    if mask is not None and tuple(mask.shape) != (b, t):
        raise ValueError(
            f"context parallelism takes a 2-D padding mask [batch, seq] = [{b}, {t}]; got "
            f"attention_mask of shape {tuple(mask.shape)}."
        )
    for name in ("labels", "shift_labels", "token_type_ids"):
        if bound.get(name) is not None and tuple(bound[name].shape[:2]) != (b, t):
            raise ValueError(
                f"context parallelism: {name} has shape {tuple(bound[name].shape)}, the inputs "
                f"[{b}, {t}]; per-token {name} of the same length are split with them."
            )
    keep = bound.get("logits_to_keep")
    if isinstance(keep, int) and keep != 0:
        raise ValueError(
            "context parallelism: logits_to_keep must be 0 (every rank keeps its tokens)."
        )


def whole_positions(position_ids, b: int, t: int, device) -> torch.Tensor:
    if position_ids is None:
        return torch.arange(t, device=device).expand(b, t)
    if position_ids.ndim == 1:
        position_ids = position_ids[None]
    if position_ids.ndim != 2 or position_ids.shape[-1] != t:
        raise ValueError(
            f"context parallelism takes position_ids of shape [batch, {t}]; got "
            f"{tuple(position_ids.shape)} (multi-axis positions such as M-RoPE are not split yet)."
        )
    return position_ids.expand(b, t)


def packed_sequences(positions: torch.Tensor):
    from transformers.masking_utils import find_packed_sequence_indices

    seq = find_packed_sequence_indices(positions)
    return None if seq is None else (seq, positions)


def fingerprint(x: torch.Tensor | None, device) -> torch.Tensor:
    """An int64 summary that differs when two ranks' tensors differ (and never from summation
    order: integer arithmetic on the values, or on float bits)."""
    if x is None:
        return torch.tensor(-1, dtype=torch.int64, device=device)
    x = x.detach().reshape(-1)
    if x.is_floating_point():
        x = x[:: max(1, x.numel() // 4096)].float().view(torch.int32)
    x = x.to(device=device, dtype=torch.int64)
    weights = torch.arange(x.numel(), device=device, dtype=torch.int64) % 1_000_003 + 1
    return (x * weights).sum()
