"""``nn.MultiheadAttention`` split by heads (`MultiheadAttentionStyle`, style ``mha_heads``).

torch's attention module keeps its projections as bare parameters (``in_proj_weight`` packs
[q; k; v], or ``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight`` when key and value have
their own widths) and reads ``out_proj.weight`` directly inside
``F.multi_head_attention_forward``; ``out_proj`` is never called. No linear style can reach
those reads, and ``F.multi_head_attention_forward`` derives the head width from the input's
width, so it cannot run a rank's heads either. torch's DTensor styles have nothing for it; this
style runs the same computation as torch's function on the rank's heads:

    Q_i, K_i, V_i = X W_i (+ b_i)       each of q, k, v split by output rows: whole heads
    O_i = softmax(Q_i K_i^T / sqrt(d) + mask_i) V_i      this rank's heads (bias_k / bias_v and
                                                         a per-head 3-D mask sliced alike)
    Y = sum_i O_i Wo_i + bo             ``out_proj`` (its own ``rowwise`` entry), one all-reduce

f on the inputs (their gradients are partial over the heads), g on the output. The averaged
attention weights are each rank's sum over its heads, all-reduced, over the head count; per
head weights are all-gathered. Exact, up to float summation order.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tpkit.parallel.comm import copy_to_tp, gather_from_tp, reduce_from_tp
from tpkit.styles.base import TPStyle, implements, style_of

__all__ = ["FunctionalAttentionStyle", "MultiheadAttentionStyle", "heads_attention"]


@implements
class MultiheadAttentionStyle(TPStyle):
    """``nn.MultiheadAttention`` on this rank's heads (see the module docstring). Its
    ``out_proj`` must carry ``rowwise`` (the plan tpkit infers adds both entries)."""

    name = "mha_heads"

    def _setup(self, module: nn.Module) -> None:
        heads = int(module.num_heads)
        if heads % self.tp:
            raise ValueError(
                f"{self.module_name or type(module).__name__} (mha_heads): tp_size={self.tp} "
                f"does not divide num_heads={heads}; use a tp that divides it or keep the module "
                "whole ('replicate')."
            )
        self.heads = heads // self.tp
        self.head_dim = module.embed_dim // heads
        module.forward = types.MethodType(_forward, module)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", heads={getattr(self, 'heads', '?')} per rank"

    def out_params(self, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``out_proj``'s local weight (split by input features) and bias (whole), with the
        autograd edges its own style gives them; never called, so never swapped by its hooks."""
        out = module.out_proj
        style = style_of(out)
        grad = torch.is_grad_enabled()
        local = []
        for name in ("weight", "bias"):
            p = out._parameters.get(name)
            if isinstance(p, DTensor):
                p = style._local(p, grad, name) if style is not None else p.to_local()
            local.append(p)
        w = local[0]
        if w is None or w.shape[-1] != self.heads * self.head_dim:
            raise ValueError(
                f"{self.module_name} (mha_heads): out_proj must be split by its input features "
                "('rowwise') with the module's heads; give it that entry."
            )
        return w, local[1]

    def attend(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        need_weights: bool,
        attn_mask: torch.Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """torch's ``multi_head_attention_forward`` (sequence first, batched) on this rank's
        heads, the module's parameters already local."""
        b = module.in_proj_bias
        bq, bk, bv = b.chunk(3) if b is not None else (None, None, None)
        if module._qkv_same_embed_dim:
            wq, wk, wv = module.in_proj_weight.chunk(3)
        else:
            wq, wk, wv = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
        wo, bo = self.out_params(module)
        return heads_attention(
            self,
            query,
            key,
            value,
            module.num_heads,
            (wq, wk, wv, wo),
            (bq, bk, bv, bo),
            (module.bias_k, module.bias_v),
            module.add_zero_attn,
            module.dropout if module.training else 0.0,
            key_padding_mask,
            need_weights,
            attn_mask,
            average_attn_weights,
            is_causal,
        )


@implements
class FunctionalAttentionStyle(TPStyle):
    """A module whose forward calls torch's ``multi_head_attention_forward`` on its child
    linears' weights (WavLM's attention: its gated relative position bias is the call's
    per-head mask), split by heads: the children carry ``colwise`` (q, k, v) and ``rowwise``
    (out) entries but are never called, so for the span of this module's forward their local
    shards are swapped in and torch's function is replaced by `heads_attention` on the rank's
    heads. Everything else the module computes (the position bias) stays whole."""

    name = "mha_functional"

    def __init__(
        self,
        *,
        q: str = "q_proj",
        k: str = "k_proj",
        v: str = "v_proj",
        out: str = "out_proj",
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.roles = {"q": q, "k": k, "v": v, "out": out}
        self._child_saved: list[list[tuple[nn.Module, str, DTensor]]] = []
        self._originals: list[Any] = []

    def _setup(self, module: nn.Module) -> None:
        self.children = [module.get_submodule(name) for name in self.roles.values()]

    def _swap_in(self, module: nn.Module) -> None:
        super()._swap_in(module)
        grad = torch.is_grad_enabled()
        saved = []
        for child in self.children:
            child_style = style_of(child)
            for name, p in list(child._parameters.items()):
                if isinstance(p, DTensor):
                    saved.append((child, name, p))
                    local = child_style._local(p, grad, name) if child_style else p.to_local()
                    child._parameters[name] = local
        self._child_saved.append(saved)
        self._originals.append(F.multi_head_attention_forward)
        F.multi_head_attention_forward = self._local_call

    def _swap_out(self, module: nn.Module) -> None:
        if self._originals:
            F.multi_head_attention_forward = self._originals.pop()
        if self._child_saved:
            for child, name, p in self._child_saved.pop():
                child._parameters[name] = p
        super()._swap_out(module)

    def _local_call(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        embed_dim_to_check: int,
        num_heads: int,
        in_proj_weight: torch.Tensor | None,
        in_proj_bias: torch.Tensor | None,
        bias_k: torch.Tensor | None,
        bias_v: torch.Tensor | None,
        add_zero_attn: bool,
        dropout_p: float,
        out_proj_weight: torch.Tensor,
        out_proj_bias: torch.Tensor | None,
        training: bool = True,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        use_separate_proj_weight: bool = False,
        q_proj_weight: torch.Tensor | None = None,
        k_proj_weight: torch.Tensor | None = None,
        v_proj_weight: torch.Tensor | None = None,
        static_k: torch.Tensor | None = None,
        static_v: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """torch's ``multi_head_attention_forward`` signature, on this rank's heads."""
        if not use_separate_proj_weight or static_k is not None or static_v is not None:
            raise ValueError(
                f"{self.module_name} (mha_functional): split for separate q/k/v weights, but "
                "this call packs them or passes static keys; keep the module whole "
                "('replicate' on it and its projections)."
            )
        batched = query.dim() == 3
        if not batched:
            query, key, value, key_padding_mask = _as_batch(query, key, value, key_padding_mask)
        width = q_proj_weight.shape[0]
        bq, bk, bv = in_proj_bias.chunk(3) if in_proj_bias is not None else (None,) * 3
        mine = slice(self.rank * width, (self.rank + 1) * width)  # whole bias_k / bias_v
        bias_kv = tuple(b[..., mine] if b is not None else None for b in (bias_k, bias_v))
        out, probs = heads_attention(
            self,
            query,
            key,
            value,
            num_heads,
            (q_proj_weight, k_proj_weight, v_proj_weight, out_proj_weight),
            (bq, bk, bv, out_proj_bias),
            bias_kv,
            add_zero_attn,
            dropout_p if training else 0.0,
            key_padding_mask,
            need_weights,
            attn_mask,
            average_attn_weights,
            is_causal,
        )
        return (out, probs) if batched else _unbatch(out, probs)


def heads_attention(
    style: TPStyle,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    heads: int,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    biases: tuple[torch.Tensor | None, ...],
    bias_kv: tuple[torch.Tensor | None, torch.Tensor | None],
    add_zero_attn: bool,
    dropout_p: float,
    key_padding_mask: torch.Tensor | None,
    need_weights: bool,
    attn_mask: torch.Tensor | None,
    average_attn_weights: bool,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch's ``multi_head_attention_forward`` (sequence first, batched [L, B, E]) on this
    rank's heads: ``weights`` are the local q, k, v rows and the out projection's local input
    columns, ``biases`` theirs (the out bias whole, added after the all-reduce), ``bias_kv``
    the local ``bias_k`` / ``bias_v``; ``heads`` is the model's head count and ``attn_mask``
    the whole mask (a per-head 3-D one is sliced here, f first: a rank's heads read only
    their slice, so the gradient of whatever made the mask is summed over the ranks)."""
    group, rank, tp = style.group, style.rank, style.tp
    grad = torch.is_grad_enabled()
    seen: dict[int, torch.Tensor] = {}

    def f(x: torch.Tensor) -> torch.Tensor:  # one all-reduce per distinct input
        if not grad or not x.requires_grad:
            return x
        if id(x) not in seen:
            seen[id(x)] = copy_to_tp(x, group)
        return seen[id(x)]

    query, key, value = f(query), f(key), f(value)
    tgt_len, bsz, _ = query.shape
    h = heads // tp
    wq, wk, wv, wo = weights
    bq, bk, bv, bo = biases
    d = wq.shape[0] // h
    q, k, v = F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    attn_mask = _float_mask(attn_mask, query.dtype)
    key_padding_mask = _float_mask(key_padding_mask, query.dtype)
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # the hint alone, as torch does
    elif key_padding_mask is not None:
        is_causal = False
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            attn_mask = attn_mask.unsqueeze(0)
        else:  # [bsz * heads, L, S]: this rank's heads
            mine = f(attn_mask).view(bsz, heads, *attn_mask.shape[1:])
            mine = mine[:, rank * h : (rank + 1) * h]
            attn_mask = mine.reshape(bsz * h, *attn_mask.shape[1:])
    bias_k, bias_v = bias_kv
    if bias_k is not None and bias_v is not None:
        k = torch.cat([k, bias_k.repeat(1, bsz, 1)])
        v = torch.cat([v, bias_v.repeat(1, bsz, 1)])
        attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))
    q = q.view(tgt_len, bsz * h, d).transpose(0, 1)
    k = k.view(k.shape[0], bsz * h, d).transpose(0, 1)
    v = v.view(v.shape[0], bsz * h, d).transpose(0, 1)
    if add_zero_attn:
        zeros = torch.zeros((bsz * h, 1, d), dtype=k.dtype, device=k.device)
        k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
        attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))
    src_len = k.size(1)
    if key_padding_mask is not None:
        kpm = key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, h, -1, -1)
        kpm = kpm.reshape(bsz * h, 1, src_len)
        attn_mask = kpm if attn_mask is None else attn_mask + kpm

    probs = None
    if need_weights:
        if is_causal and attn_mask is None:
            raise RuntimeError("need_weights with is_causal needs attn_mask (as in torch).")
        q_scaled = q * math.sqrt(1.0 / float(d))
        if attn_mask is not None:
            probs = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
        else:
            probs = torch.bmm(q_scaled, k.transpose(-2, -1))
        probs = F.softmax(probs, dim=-1)
        if dropout_p > 0.0:
            probs = F.dropout(probs, p=dropout_p)
        out = torch.bmm(probs, v)
        out = out.transpose(0, 1).reshape(tgt_len * bsz, h * d)
        probs = probs.view(bsz, h, tgt_len, src_len)
        if average_attn_weights:
            probs = reduce_from_tp(probs.sum(dim=1), group) / heads
        else:
            probs = gather_from_tp(probs.movedim(1, -1), [h] * tp, rank, group).movedim(-1, 1)
    else:
        if attn_mask is not None:
            if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0)
            else:
                attn_mask = attn_mask.view(bsz, h, -1, src_len)
        q = q.view(bsz, h, tgt_len, d)
        k = k.view(bsz, h, src_len, d)
        v = v.view(bsz, h, src_len, d)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, h * d)
    out = reduce_from_tp(F.linear(out, wo), group)
    if bo is not None:
        out = out + bo
    return out.view(tgt_len, bsz, out.size(-1)), probs


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as torch's ``_canonical_mask`` makes it: -inf where True."""
    if mask is None or torch.is_floating_point(mask):
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def _forward(
    self: nn.MultiheadAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``nn.MultiheadAttention.forward``'s contract (batch first or not, unbatched input) on the
    rank's heads (bound to a split module by `MultiheadAttentionStyle`)."""
    style = style_of(self)
    batched = query.dim() == 3
    if not batched:  # [L, E]: one sequence
        query, key, value, key_padding_mask = _as_batch(query, key, value, key_padding_mask)
    elif self.batch_first:
        same_kv = key is value
        same_q = query is key
        query = query.transpose(1, 0)
        key = query if same_q else key.transpose(1, 0)
        value = key if same_kv else value.transpose(1, 0)
    out, weights = style.attend(
        self,
        query,
        key,
        value,
        key_padding_mask,
        need_weights,
        attn_mask,
        average_attn_weights,
        is_causal,
    )
    if not batched:
        return _unbatch(out, weights)
    if self.batch_first:
        out = out.transpose(1, 0)
    return out, weights


def _as_batch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """An unbatched call ([L, E], a [S] padding mask) as a batch of one, as torch's own
    ``multi_head_attention_forward`` reads it."""
    query, key, value = (x.unsqueeze(1) for x in (query, key, value))
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.unsqueeze(0)
    return query, key, value, key_padding_mask


def _unbatch(
    out: torch.Tensor, weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_as_batch`'s batch of one back to the unbatched shapes torch returns."""
    return out.squeeze(1), weights.squeeze(0) if weights is not None else None
