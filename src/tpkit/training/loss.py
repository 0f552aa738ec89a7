"""Vocab-parallel cross-entropy: the loss of vocab-sharded logits without gathering them.

Megatron's trick: with logits split by vocabulary over t ranks, the softmax needs only three
numbers per token from the other ranks: the row max, the sum of exponentials, and the target's
logit (owned by one rank). Three all-reduces of one float per token (~12 bytes) replace an
all-gather of the whole vocabulary row (V/t·(t−1)·4 bytes). torch has ``loss_parallel()`` for
DTensor logits; this version works on the local shards our styles produce, needs no context
manager around backward, and plugs into transformers' ``model.loss_function``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from tpkit.parallel.comm import all_reduce_
from tpkit.plan.layout import chunk_offset

__all__ = ["causal_lm_loss", "enable_loss_parallel", "vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, ignore_index, group):
        # logits: [N, V_local] float32; target: [N] global ids
        local_max = logits.max(dim=-1).values
        local_max = all_reduce_(local_max, group, dist.ReduceOp.MAX)
        shifted = logits - local_max.unsqueeze(-1)
        v_local = logits.shape[-1]
        ignored = target == ignore_index
        local_t = target - vocab_start
        mine = (local_t >= 0) & (local_t < v_local) & ~ignored
        idx = local_t.clamp(0, max(v_local - 1, 0))
        picked = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * mine
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([picked, sum_exp])  # one collective for both sums
        both = all_reduce_(both, group)
        picked, sum_exp = both[0], both[1]
        loss = (sum_exp.log() - picked).masked_fill(ignored, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, idx, mine, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, mine, ignored = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * ~ignored).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    rank: int,
    tp: int,
    group: ProcessGroup,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token loss ([N]) of ``local_logits`` ([N, V/tp], this rank's torch.chunk slice of the
    vocabulary) against global ``target`` ids ([N]); 0 where ``target == ignore_index``."""
    start = chunk_offset(vocab_size, tp, rank)
    return _VocabParallelCE.apply(local_logits.float(), target, start, ignore_index, group)


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` on vocab-sharded DTensor logits (``Shard(-1)``)."""
    if not isinstance(logits, DTensor):
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(
            logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs
        )
    mesh = logits.device_mesh
    local = logits.to_local()
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    target = shift_labels.reshape(-1).to(local.device)
    per_token = vocab_parallel_cross_entropy(
        local.reshape(-1, local.shape[-1]),
        target,
        vocab_size,
        mesh.get_local_rank(),
        mesh.size(),
        mesh.get_group(),
        ignore_index,
    )
    total = per_token.sum()
    if num_items_in_batch is None:
        return total / (target != ignore_index).sum().clamp(min=1)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def enable_loss_parallel(model: nn.Module) -> None:
    """Make ``model``'s loss the vocab-parallel cross-entropy. Its head's style was built with
    ``loss_parallel`` (validation checked it gathers and that forward calls loss_function)."""
    model.loss_function = causal_lm_loss
