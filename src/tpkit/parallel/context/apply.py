"""Context parallelism (CP): a model's batch split along the sequence over the "cp" mesh axis.

Tensor parallelism divides weights; at long sequences the activations of one sequence dominate
every rank's memory however the weights are split. CP gives each of cp ranks 1/cp of the
sequence (zigzag chunks for causal models, `tpkit.parallel.context.layout`) and lets attention see
the whole context (`tpkit.parallel.context.attention`: all-gather K/V, ring, or Ulysses).

How a batch is fed: every rank of a cp group passes the WHOLE batch to the model, as without CP,
and gets the whole batch's loss back. A forward pre-hook on the model checks the batch (the same
on every cp rank, a sequence length that splits), shifts the labels before the split (a causal
LM's last token of chunk i predicts the first of chunk i+1), keeps this rank's part of ids,
labels, positions and segment ids, and hands the attention its `CPForward`. The positions are
global, so RoPE, learned and ALiBi positions, sliding windows and padding see the unsplit values.
The model's outputs (logits, hidden states) are this rank's tokens (`ContextParallel.gather`
puts a tensor back in order); its loss is Σ (this rank's summed token losses) / (the batch's
target count), summed over cp: the unsplit model's loss.

Gradients: cp ranks hold the same parameters and each computes the gradient of its tokens' loss,
so they are data ranks. The loss's backward is scaled by cp, so averaging the gradients over
dp × cp (what FSDP2 over ``dp_shard_cp`` and DDP do) gives the whole batch's gradient.

The stock Trainer (`ContextParallel.trainer_mode`) multiplies the loss by its process count and
averages itself: there the loss is this rank's share (Σ this rank's losses / the batch's count),
as accelerate's CP returns it. Generation (a cache passed) runs unsplit, exactly as without CP.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tpkit.parallel.context.attention import (
    IMPLEMENTATION,
    KWARG,
    CPForward,
    register,
    reset_active,
    set_active,
    set_inner,
)
from tpkit.parallel.context.batch import (
    SPLIT,
    TAKEN,
    check_inputs,
    fingerprint,
    has_cache,
    packed_sequences,
    token_loss_sum,
    whole_positions,
)
from tpkit.parallel.context.checks import (
    RING_BYTES,
    check_model,
    check_ulysses,
    is_causal,
    is_causal_lm,
)
from tpkit.parallel.context.layout import Layout, check_length

__all__ = [
    "ContextParallel",
    "apply_context_parallel",
    "average_over_cp",
    "context_of",
    "context_parallel",
    "gather_sequence",
]


class ContextParallel:
    """One model's context parallelism over ``cp_mesh`` (a 1-D mesh, or the "cp" dim).

    ``attention``: "allgather" (gather K/V: exact for any attention code), "ring" (our ring
    attention: memory of one block), "ulysses" (all-to-all to heads: heads must divide by cp),
    or "auto" (all-gather, the ring once a layer's scores pass ``ring_bytes``)."""

    def __init__(
        self,
        model: nn.Module,
        cp_mesh: DeviceMesh,
        attention: str = "auto",
        ring_bytes: int = RING_BYTES,
    ):
        self.inner = check_model(model, attention)
        self.model, self.attention, self.ring_bytes = model, attention, ring_bytes
        self.group, self.rank, self.cp = (
            cp_mesh.get_group(),
            cp_mesh.get_local_rank(),
            cp_mesh.size(),
        )
        self.zigzag = is_causal(model)
        self.shift = is_causal_lm(model)
        self.trainer = False
        #: hand back per-token outputs whole (the notebook pool's caller expects the model's)
        self.whole_outputs = False
        self._stack: list[tuple | None] = []
        self._params = inspect.signature(model.forward).parameters

    # ---- installing ------------------------------------------------------------------------
    def install(self) -> ContextParallel:
        """Register ``tpkit_cp``, switch the model (and its sub-models) to it, add the hooks."""
        register()
        model = self.model
        for m in model.modules():
            if hasattr(m, "config") and hasattr(m.config, "_attn_implementation"):
                set_inner(m.config, self.inner)
        model.set_attn_implementation(IMPLEMENTATION)
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        model.register_forward_hook(self._post, always_call=True)
        model._tpkit_cp = self
        return self

    @contextlib.contextmanager
    def trainer_mode(self) -> Iterator[None]:
        """Inside: the loss is this rank's share (Trainer and accelerate average themselves)."""
        before, self.trainer = self.trainer, True
        try:
            yield
        finally:
            self.trainer = before

    # ---- the hooks -------------------------------------------------------------------------
    def _pre(self, module, args, kwargs):
        bound = dict(zip(self._params, args), **kwargs)
        if bound.get(KWARG) is not None or has_cache(bound):
            self._stack.append(None)  # generation with a cache: unsplit, as without CP
            return None
        fwd, new, targets = self._split(bound)
        token = set_active(fwd)
        self._stack.append((token, targets, bound.get("num_items_in_batch")))
        return (), new

    def _post(self, module, args, output):
        entry = self._stack.pop() if self._stack else None
        if entry is None:
            return None
        token, targets, num_items = entry
        reset_active(token)
        # the Trainer's evaluate / predict gathers predictions over dp only: hand it whole ones
        whole = self.whole_outputs or (self.trainer and not torch.is_grad_enabled())
        if output is None or (targets is None and not whole):
            return None
        fields = dict(output) if isinstance(output, dict) else {"logits": output[0]}
        if targets is not None:
            fields["loss"] = self._loss(fields["logits"], *targets, num_items)
        if whole:
            fields["logits"] = self.gather(fields["logits"], 1)
        if isinstance(output, dict):
            return type(output)(**{"loss": fields.pop("loss", None), **fields})
        rest = (fields["logits"], *output[1:])
        return (fields["loss"], *rest) if targets is not None else rest

    # ---- splitting a batch -----------------------------------------------------------------
    def _split(self, bound: dict) -> tuple[CPForward, dict, tuple | None]:
        ids = bound.get("input_ids")
        seq = ids if ids is not None else bound.get("inputs_embeds")
        if seq is None:
            raise ValueError("context parallelism needs input_ids or inputs_embeds to split.")
        b, t = seq.shape[:2]
        check_inputs(bound, b, t)
        check_length(t, self.cp, self.zigzag)
        layout = Layout(self.cp, self.rank, t, self.zigzag)
        mask = bound.get("attention_mask")
        positions = whole_positions(bound.get("position_ids"), b, t, seq.device)
        targets = self._targets(bound)
        path = self._path(b, t)
        self._check_path(path)
        self._check_agree(seq, mask, positions, targets)
        padding = None if mask is None or bool(mask.bool().all()) else mask.bool()
        packed = (
            packed_sequences(positions)
            if mask is None and bound.get("position_ids") is not None
            else None
        )
        fwd = CPForward(
            layout, self.group, self._path(b, t), self.attention != "auto", padding, packed
        )
        new = {k: v for k, v in bound.items() if k not in TAKEN and k not in SPLIT}
        for name in SPLIT:
            if bound.get(name) is not None:
                new[name] = layout.split(bound[name], 1)
        new["position_ids"] = layout.split(positions, 1)
        # the whole padding mask: transformers reads non-contiguous positions without one as packed
        new["attention_mask"] = (
            mask if mask is not None else torch.ones(b, t, dtype=torch.long, device=seq.device)
        )
        if "use_cache" in self._params:
            new["use_cache"] = False
        new[KWARG] = fwd
        if targets is None:
            return fwd, new, None
        count = (targets != -100).sum()
        return fwd, new, (layout.split(targets, 1), count)

    def _targets(self, bound: dict) -> torch.Tensor | None:
        """The whole batch's targets, shifted for a causal LM (before the split)."""
        if bound.get("shift_labels") is not None:
            return bound["shift_labels"]
        labels = bound.get("labels")
        if labels is None or not self.shift:
            return labels
        return F.pad(labels[..., 1:], (0, 1), value=-100)

    def _path(self, b: int, t: int) -> str:
        if self.attention != "auto":
            return self.attention
        heads = getattr(self.model.config, "num_attention_heads", 1) or 1
        return "ring" if b * heads * (t // self.cp) * t * 4 >= self.ring_bytes else "allgather"

    def _check_path(self, path: str) -> None:
        """What the config says a path cannot run, before any collective (the attention checks
        each call again)."""
        cfg = self.model.config
        if path == "ulysses":
            check_ulysses(
                self.model, getattr(getattr(self.model, "_tpkit", None), "tp_size", 1), self.cp
            )
        if path == "ring" and self.attention == "ring":
            dropout = getattr(cfg, "attention_dropout", 0.0) if self.model.training else 0.0
            for why, found in (
                ("a bias such as ALiBi added to its mask", getattr(cfg, "alibi", False)),
                ("logit softcapping", getattr(cfg, "attn_logit_softcapping", None)),
                ("attention dropout", isinstance(dropout, float) and dropout > 0),
            ):
                if found:
                    raise ValueError(
                        f"context parallelism: cp_attention='ring' does not run {why} "
                        f"({type(self.model).__name__}); use cp_attention='allgather'."
                    )

    def _check_agree(self, seq, mask, positions, targets) -> None:
        """Every cp rank must pass the same whole batch: one tiny all-gather of fingerprints."""
        device = seq.device if seq.device.type != "meta" else torch.device("cpu")
        mine = torch.stack([fingerprint(x, device) for x in (seq, mask, positions, targets)])
        mine = torch.cat([torch.tensor(seq.shape[:2], device=device), mine])
        parts = [torch.empty_like(mine) for _ in range(self.cp)]
        dist.all_gather(parts, mine, group=self.group)
        bad = [r for r, p in enumerate(parts) if not torch.equal(p, parts[0])]
        if bad:
            raise ValueError(
                f"context parallelism: the ranks of a cp group passed different batches (cp ranks "
                f"{bad} differ from cp rank 0); every rank of a cp group passes the same whole "
                "batch. Give each its data rank as rank // (cp_size * tp_size)."
            )

    # ---- the loss --------------------------------------------------------------------------
    def _loss(self, logits, targets, count, num_items) -> torch.Tensor:
        total = token_loss_sum(logits, targets)
        if not self.trainer:
            denom = num_items if num_items is not None else count.clamp(min=1)
            return _SumOverCP.apply(total / denom, self.group, self.cp)
        share = total / num_items if num_items is not None else total * self.cp / count.clamp(min=1)
        if torch.is_grad_enabled():
            return share  # the Trainer scales by its process count and averages gradients
        return _SumOverCP.apply(share, self.group, self.cp) / self.cp  # evaluate: the mean share

    # ---- outputs ---------------------------------------------------------------------------
    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a split-forward output (logits, hidden states) gathered over cp
        into the whole sequence, in order (no gradient)."""
        if isinstance(x, DTensor):
            x = x.full_tensor()
        layout = Layout(self.cp, self.rank, x.shape[dim] * self.cp, self.zigzag)
        parts = [torch.empty_like(x.contiguous()) for _ in range(self.cp)]
        dist.all_gather(parts, x.detach().contiguous(), group=self.group)
        return layout.natural(parts, dim)


def context_parallel(
    model: nn.Module, cp_mesh: DeviceMesh, attention: str = "auto", ring_bytes: int = RING_BYTES
) -> ContextParallel:
    """Install context parallelism on ``model`` over ``cp_mesh``; returns its `ContextParallel`."""
    return ContextParallel(model, cp_mesh, attention, ring_bytes).install()


def apply_context_parallel(
    model: nn.Module, cp_mesh: DeviceMesh, attention: str = "auto", average_grads: bool = False
) -> ContextParallel:
    """`split`'s context step: CP over ``cp_mesh``. ``average_grads``: no FSDP will reduce the
    gradients over cp, so each is averaged over cp as it is produced (as DDP would)."""
    from tpkit.parallel.fsdp import average_grads_over_dp

    cp = context_parallel(model, cp_mesh, attention)
    if average_grads:
        average_grads_over_dp(model.parameters(), cp_mesh)
    return cp


def context_of(model: nn.Module) -> ContextParallel | None:
    """The `ContextParallel` installed on ``model`` (through wrappers: FSDP, PEFT, accelerate)."""
    from tpkit.state import wrapper_chain

    for m in wrapper_chain(model):
        found = getattr(m, "_tpkit_cp", None)
        if isinstance(found, ContextParallel):
            return found
    return None


def gather_sequence(model: nn.Module, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """A per-token output of a context-parallel ``model`` (logits, hidden states: this rank's
    tokens) gathered over cp into the whole sequence, in order; ``x`` itself without CP."""
    cp = context_of(model)
    return x if cp is None else cp.gather(x, dim)


def average_over_cp(model: nn.Module, group) -> None:
    """Average every gradient of ``model`` over ``group`` (cp, or dp x cp) in place: what FSDP or
    DDP does for a model they do not wrap."""
    n = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(local, group=group)
            local.div_(n)


# ---- helpers -------------------------------------------------------------------------------
class _SumOverCP(torch.autograd.Function):
    """Sum over cp forward (every rank gets the whole batch's loss); backward ×cp, so averaging
    gradients over cp gives their sum."""

    @staticmethod
    def forward(ctx, x, group, cp):
        ctx.cp = cp
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.cp, None, None
