"""The attention and mask functions transformers calls under context parallelism.

A model split by `tpkit.parallel.context` runs with ``config._attn_implementation = "tpkit_cp"``,
registered in transformers' ``AttentionInterface`` and ``AttentionMaskInterface``. Each wraps the
implementation the model had (its own ``eager_attention_forward`` or ``sdpa``: the *inner* one),
so sliding windows, softcapping, sinks, GQA and scaling stay the model's own code.

- The mask. transformers builds masks from index functions (causal, sliding window, chunked,
  bidirectional, padding). Under CP the same function is evaluated at the GLOBAL positions of this
  rank's queries against every key in natural order (`CPForward.mask`), so a rank's rows are the
  rows of the unsplit mask. A plain causal or bidirectional mask with no padding is not built.
- All-gather (``allgather``): K and V gathered over cp into natural order, the inner attention on
  this rank's queries and every key. Backward: the K/V gradient summed over cp (reduce-scatter).
- Ring (``ring``, `tpkit.parallel.context.ring`): K/V blocks passed around the ring with an
  online softmax; never holds more than one remote block and saves no score matrix.
- Ulysses (``ulysses``): all-to-all from sequence-split to head-split, the inner attention on the
  whole sequence for heads/cp heads, all-to-all back. Needs heads and KV heads divisible by cp.

Outside a split forward (generation with a cache, a module called on its own) the inner function
runs unchanged.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from tpkit.parallel.comm import all_gather_parts, all_reduce_
from tpkit.parallel.context.layout import Layout
from tpkit.parallel.context.ring import ring_attention, ring_unsupported

__all__ = [
    "IMPLEMENTATION",
    "KWARG",
    "PATHS",
    "CPForward",
    "active",
    "context_attention",
    "context_mask",
    "inner_of",
    "register",
    "set_inner",
]

#: the name the model's config carries under CP
IMPLEMENTATION = "tpkit_cp"
#: the keyword the split forward hands down to every attention call (transformers threads a
#: model's extra keyword arguments to its attention functions; a recomputed checkpointed layer
#: gets them again)
KWARG = "tpkit_cp"
PATHS = ("allgather", "ring", "ulysses")

_ACTIVE: contextvars.ContextVar[CPForward | None] = contextvars.ContextVar(
    "tpkit_cp_forward", default=None
)
#: id(config) -> the implementation the model had before CP ("sdpa" or "eager")
_INNER: dict[int, str] = {}


@dataclass
class CPForward:
    """What one split forward knows: the layout, the cp group, the attention path, and the
    whole-sequence mask inputs (``padding`` [B, T] bool, None when every token attends;
    ``packed`` (sequence ids, positions) [B, T] for packed sequences, else None)."""

    layout: Layout
    group: ProcessGroup
    path: str
    explicit: bool
    padding: torch.Tensor | None = None
    packed: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def cp(self) -> int:
        return self.layout.cp

    def query_index(self) -> torch.Tensor:
        """Global positions of the queries attention sees: this rank's tokens, or all of them
        after Ulysses' all-to-all."""
        if self.path == "ulysses":
            return torch.arange(self.layout.length)
        return self.layout.local_index

    def mask(self, mask_function: Callable, batch: int, device) -> torch.Tensor:
        """transformers' ``mask_function`` at global positions: [B, 1, queries, T] bool."""
        q = self.query_index().to(device)
        kv = torch.arange(self.layout.length, device=device)
        b = torch.arange(batch, device=device)[:, None, None, None]
        h = torch.zeros(1, dtype=torch.long, device=device)[None, :, None, None]
        qi, ki = q[None, None, :, None], kv[None, None, None, :]
        if self.packed is not None:  # transformers' remap and same-sequence rule, on global ids
            seq, pos = (t.to(device) for t in self.packed)
            m = mask_function(b, h, pos[b, qi], pos[b, ki]) & (seq[b, qi] == seq[b, ki])
        else:
            m = mask_function(b, h, qi, ki)
        if self.padding is not None:
            m = m & self.padding.to(device)[b, ki]
        return m.expand(batch, 1, q.numel(), kv.numel())


def active() -> CPForward | None:
    """The split forward in flight (set by the model's forward pre-hook), if any."""
    return _ACTIVE.get()


def set_active(fwd: CPForward | None) -> contextvars.Token:
    return _ACTIVE.set(fwd)


def reset_active(token: contextvars.Token) -> None:
    _ACTIVE.reset(token)


def set_inner(config, implementation: str) -> None:
    """Record the implementation ``config``'s model had before CP."""
    _INNER[id(config)] = implementation


def inner_of(config) -> str:
    return _INNER.get(id(config), "sdpa")


def register() -> None:
    """Register ``tpkit_cp`` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, context_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, context_mask)


# ---- the mask ------------------------------------------------------------------------------
def context_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    config=None,
    **kwargs,
) -> torch.Tensor | None:
    """transformers' mask interface under CP: the inner implementation's own mask outside a split
    forward; inside one, this rank's rows of the whole-sequence mask (bool for sdpa and the ring,
    0 / min float for eager), or None where the inner one would skip it."""
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        bidirectional_mask_function,
        causal_mask_function,
    )

    fwd, inner = _ACTIVE.get(), inner_of(config)
    if fwd is None:
        return ALL_MASK_ATTENTION_FUNCTIONS[inner](
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
            attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip,
            allow_is_bidirectional_skip=allow_is_bidirectional_skip, use_vmap=use_vmap,
            device=device, dtype=dtype, config=config, **kwargs,
        )  # fmt: skip
    if use_vmap:
        raise ValueError(
            "context parallelism: this model adds its own rule to the attention mask (an "
            "or/and mask function, e.g. bidirectional image tokens); such masks are not "
            "supported under cp_size > 1 yet. Train it with cp_size=1."
        )
    mask_function = mask_function or causal_mask_function
    plain = fwd.padding is None and fwd.packed is None
    eager = inner == "eager" and fwd.path != "ring"
    if plain and mask_function is causal_mask_function and allow_is_causal_skip and not eager:
        return None  # the attention builds causal from positions (or the ring skips blocks)
    if plain and mask_function is bidirectional_mask_function and allow_is_bidirectional_skip:
        return None
    mask = fwd.mask(mask_function, batch_size, device)
    if eager:
        return torch.where(
            mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min
        )
    return mask


# ---- the attention -------------------------------------------------------------------------
def _inner_function(module: nn.Module, name: str) -> Callable:
    if name == "eager":
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise ValueError(
                f"context parallelism: {type(module).__name__}'s module has no "
                "eager_attention_forward to wrap; load the model with attn_implementation='sdpa'."
            )
        return fn
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def context_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers' attention interface under CP (query [B, H, Tq, D], key/value [B, Hkv, Tk, D]).

    A split forward hands its `CPForward` in ``kwargs[KWARG]`` (or, for a model that does not
    pass its keyword arguments down, through `active`); without one the inner function runs as
    it would have."""
    fwd = kwargs.pop(KWARG, None)
    name = inner_of(getattr(module, "config", None))
    inner = _inner_function(module, name)
    if fwd is None:
        fwd = _ACTIVE.get()  # a model that does not hand its keyword arguments down (Falcon)
        if fwd is None and torch._C._current_autograd_node() is not None:
            raise RuntimeError(
                f"context parallelism: {type(module).__name__} is recomputed in backward "
                "(gradient checkpointing) without the keyword arguments of the model's forward, "
                "so it cannot know the split; turn gradient checkpointing off for this model."
            )
    if fwd is None:
        return inner(
            module, query, key, value, attention_mask,
            dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs,
        )  # fmt: skip
    if key.shape[2] != fwd.layout.local_length or query.shape[2] != fwd.layout.local_length:
        raise ValueError(
            f"context parallelism: {type(module).__name__} got {query.shape[2]} queries and "
            f"{key.shape[2]} keys, expected this rank's {fwd.layout.local_length} tokens of each "
            "(cross-attention and caches are not split); train it with cp_size=1."
        )
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if attention_mask is None and name == "eager" and fwd.path != "ring":
        causal = False  # eager's mask is never skipped when causal: none means "attend everywhere"
    path = fwd.path
    if path == "ring":
        why = ring_unsupported(module, attention_mask, dropout, kwargs)
        if why:
            if fwd.explicit:
                raise ValueError(
                    f"context parallelism: cp_attention='ring' {why}; use 'allgather'."
                )
            path = "allgather"
    if path == "ring":
        out = ring_attention(query, key, value, attention_mask, causal, scaling, fwd)
        return out, None
    if path == "ulysses":
        return _ulysses(
            module, query, key, value, attention_mask, dropout, scaling, causal, kwargs, inner, fwd
        )
    k, v = gather_sequence(key, fwd), gather_sequence(value, fwd)
    if attention_mask is None and causal:
        q_index = fwd.layout.local_index.to(query.device)
        kv_index = torch.arange(fwd.layout.length, device=query.device)
        attention_mask = (q_index[:, None] >= kv_index[None, :])[None, None]
    if name == "eager" and attention_mask is not None and attention_mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        attention_mask = torch.where(attention_mask, zero, torch.finfo(query.dtype).min)
    return inner(
        module,
        query,
        k,
        v,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=False,
        **kwargs,
    )


# ---- all-gather along the sequence ---------------------------------------------------------
class _GatherSequence(torch.autograd.Function):
    """All-gather of [B, H, T/cp, D] into [B, H, T, D] in natural order; backward: every rank's
    gradient of the whole summed, this rank's part kept (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fwd: CPForward) -> torch.Tensor:
        ctx.fwd = fwd
        return fwd.layout.natural(all_gather_parts(x.contiguous(), fwd.group), dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        fwd: CPForward = ctx.fwd
        if dist.get_backend(fwd.group) == "nccl":
            whole = fwd.layout.rank_major(grad, dim=2).movedim(2, 0).contiguous()
            out = whole.new_empty((whole.shape[0] // fwd.cp, *whole.shape[1:]))
            dist.reduce_scatter_tensor(out, whole, group=fwd.group)
            return out.movedim(0, 2), None
        summed = all_reduce_(grad.contiguous().clone(), fwd.group)
        return fwd.layout.split(summed, dim=2), None


def gather_sequence(x: torch.Tensor, fwd: CPForward) -> torch.Tensor:
    """This rank's [B, H, T/cp, D] gathered over cp into the whole sequence [B, H, T, D]."""
    return _GatherSequence.apply(x, fwd)


# ---- Ulysses: all-to-all between sequence and heads ----------------------------------------
def _seq_to_heads(x: torch.Tensor, fwd: CPForward, seq: int, head: int) -> torch.Tensor:
    """[.., T/cp (this rank's tokens), H, ..] -> [.., T (natural), H/cp (head group rank), ..]."""
    send = [p.contiguous() for p in x.chunk(fwd.cp, dim=head)]
    recv = [torch.empty_like(send[0]) for _ in range(fwd.cp)]
    dist.all_to_all(recv, send, group=fwd.group)
    return fwd.layout.natural(recv, dim=seq)


def _heads_to_seq(x: torch.Tensor, fwd: CPForward, seq: int, head: int) -> torch.Tensor:
    """The inverse of `_seq_to_heads`."""
    send = [fwd.layout.part_of(x, r, seq).contiguous() for r in range(fwd.cp)]
    recv = [torch.empty_like(send[0]) for _ in range(fwd.cp)]
    dist.all_to_all(recv, send, group=fwd.group)
    return torch.cat(recv, dim=head)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd: CPForward, seq: int, head: int, to_heads: bool):
        ctx.args = (fwd, seq, head, to_heads)
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, fwd, seq, head)

    @staticmethod
    def backward(ctx, grad):
        fwd, seq, head, to_heads = ctx.args
        out = (_heads_to_seq if to_heads else _seq_to_heads)(grad.contiguous(), fwd, seq, head)
        return out, None, None, None, None


def _ulysses(module, query, key, value, mask, dropout, scaling, causal, kwargs, inner, fwd):
    cp = fwd.cp
    if query.shape[1] % cp or key.shape[1] % cp:
        raise ValueError(
            f"context parallelism: cp_attention='ulysses' needs this rank's {query.shape[1]} "
            f"query heads and {key.shape[1]} key/value heads to divide by cp_size={cp}; use "
            "cp_attention='allgather' or 'ring'."
        )
    if getattr(module, "sinks", None) is not None:
        raise ValueError(
            f"context parallelism: cp_attention='ulysses' cannot split {type(module).__name__}'s "
            "per-head attention sinks; use cp_attention='allgather'."
        )
    q, k, v = (_AllToAll.apply(t, fwd, 2, 1, True) for t in (query, key, value))
    if mask is not None and mask.shape[1] > 1:  # a per-head bias in the mask: this group's heads
        mask = mask.chunk(cp, dim=1)[fwd.layout.rank]
    out, _ = inner(
        module, q, k, v, mask, dropout=dropout, scaling=scaling, is_causal=causal, **kwargs
    )  # [B, T, H/cp, D]: the whole sequence in order, so causal needs no mask
    return _AllToAll.apply(out, fwd, 1, 2, False), None
