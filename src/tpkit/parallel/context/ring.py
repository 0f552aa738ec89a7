"""Ring attention: each rank's keys and values go around the cp ring, one block per step.

softmax(QKᵀ)V over the whole sequence = a merge of per-block partial results: each block gives a
row max m_b, a row sum l_b = Σ exp(s − m_b) and an unnormalised output; the running result is
rescaled by exp(m_old − m_new) as each block arrives (the online softmax of FlashAttention). The
backward recomputes each block's probabilities from the saved log-sum-exp (P = exp(S − lse)), so
no score matrix is kept: memory is one block of scores at a time, and no rank ever holds more than
its own K/V and one other rank's. The K/V gradients travel around the ring with their blocks and
arrive home after cp steps.

Why our own: torch's ``context_parallel`` runs ring attention only through SDPA's flash and
efficient kernels (none on CPU), and replaces ``F.scaled_dot_product_attention`` process-wide.

Masks at chunk granularity (`tpkit.parallel.context.layout`): with no mask tensor and causal
attention a (query chunk, key chunk) pair is whole below the diagonal, lower-triangular on it and
skipped above it; with a boolean mask tensor each pair takes its slice and is skipped when the
slice is all False. A query row no key may see gives 0 (as torch's SDPA does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from tpkit.parallel.context.attention import CPForward

__all__ = ["ring_attention", "ring_unsupported"]


def ring_unsupported(module: nn.Module, mask: torch.Tensor | None, dropout: float, kwargs) -> str:
    """Why the ring cannot run this attention call ("" when it can)."""
    if dropout:
        return "does not run attention dropout (set attention_dropout=0.0)"
    if kwargs.get("softcap") is not None:
        return "does not run logit softcapping"
    if getattr(module, "sinks", None) is not None or kwargs.get("s_aux") is not None:
        return "does not run attention sinks"
    if kwargs.get("position_bias") is not None:
        return "does not add a position bias"
    if mask is not None and mask.dtype != torch.bool:
        return "takes boolean masks only (this model adds a bias such as ALiBi to its mask)"
    return ""


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scaling: float | None,
    fwd: CPForward,
) -> torch.Tensor:
    """Attention of this rank's queries [B, H, T/cp, D] over the whole sequence's keys, whose
    blocks [B, Hkv, T/cp, D] come around the ring. ``mask``: [B, 1|H, T/cp, T] bool in natural key
    order, or None (``causal`` then decides). Returns [B, T/cp, H, D] like transformers'
    attention functions."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _Ring.apply(query, key, value, mask, causal, scale, fwd)
    return out.transpose(1, 2).contiguous()


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, fwd):
        out, lse = _forward(q, k, v, mask, causal, scale, fwd)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.args = (causal, scale, fwd)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, mask, dout, *ctx.args)
        return dq, dk, dv, None, None, None, None


# ---- blocks and their masks ----------------------------------------------------------------
def _pairs(fwd: CPForward, src: int, mask: torch.Tensor | None, causal: bool, device):
    """(q slice, k slice, sub-mask or None) for every chunk pair of this rank's queries and rank
    ``src``'s keys that has something to attend; sub-masks are [B, 1|H, c, c] bool."""
    layout = fwd.layout
    c = layout.chunk
    diag = None
    for qi, qc in enumerate(layout.chunks_of(layout.rank)):
        for ki, kc in enumerate(layout.chunks_of(src)):
            qs, ks = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
            if mask is not None:
                sub = mask[:, :, qs, kc * c : (kc + 1) * c]
                if sub.any():
                    yield qs, ks, sub
            elif not causal or kc < qc:
                yield qs, ks, None
            elif kc == qc:
                if diag is None:
                    diag = torch.ones(c, c, dtype=torch.bool, device=device).tril()
                yield qs, ks, diag[None, None]


def _grouped(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """[B, H, T, D] -> [B, Hkv, H/Hkv, T, D] (each KV head with its query heads: GQA, no copy)."""
    b, h, n, d = t.shape
    return t.view(b, hkv, h // hkv, n, d)


def _sub_mask(sub: torch.Tensor, hkv: int) -> torch.Tensor:
    if sub.shape[1] == 1:
        return sub[:, :, None]  # [B, 1, 1, c, c]
    return sub.view(sub.shape[0], hkv, sub.shape[1] // hkv, *sub.shape[2:])


def _scores(qg, kb, sub, scale, hkv):
    s = torch.matmul(qg, kb.unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hkv, rep, cq, ck]
    if sub is not None:
        s = s.masked_fill(~_sub_mask(sub, hkv), float("-inf"))
    return s


# ---- the ring exchange ---------------------------------------------------------------------
def _exchange(t: torch.Tensor, fwd: CPForward):
    """Send ``t`` to the next rank of the ring, receive the previous rank's; returns (buffer,
    pending works)."""
    group, r, cp = fwd.group, fwd.layout.rank, fwd.cp
    recv = torch.empty_like(t)
    ops = [
        dist.P2POp(dist.isend, t, dist.get_global_rank(group, (r + 1) % cp), group),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (r - 1) % cp), group),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for w in works:
        w.wait()


# ---- forward -------------------------------------------------------------------------------
def _forward(q, k, v, mask, causal, scale, fwd):
    hkv, rank, cp = k.shape[1], fwd.layout.rank, fwd.cp
    qg = _grouped(q, hkv).float()
    shape = qg.shape[:-1]
    m = qg.new_full(shape, float("-inf"))
    l_sum = qg.new_zeros(shape)
    acc = torch.zeros_like(qg)
    kv = torch.stack([k, v]).contiguous()
    for step in range(cp):
        src = (rank - step) % cp
        pending = _exchange(kv, fwd) if step < cp - 1 else None
        kb, vb = kv[0].float(), kv[1].float()
        for qs, ks, sub in _pairs(fwd, src, mask, causal, q.device):
            s = _scores(qg[..., qs, :], kb[:, :, ks], sub, scale, hkv)
            m_old = m[..., qs]
            m_new = torch.maximum(m_old, s.amax(-1))
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - safe.unsqueeze(-1))
            alpha = torch.exp(m_old - safe)
            l_sum[..., qs] = l_sum[..., qs] * alpha + p.sum(-1)
            acc[..., qs, :] = acc[..., qs, :] * alpha.unsqueeze(-1) + torch.matmul(
                p, vb[:, :, ks].unsqueeze(2)
            )
            m[..., qs] = m_new
        if pending is not None:
            kv, works = pending
            _wait(works)
    seen = l_sum > 0
    out = torch.where(seen.unsqueeze(-1), acc / l_sum.clamp(min=1e-30).unsqueeze(-1), 0.0)
    lse = torch.where(seen, m + torch.log(l_sum.clamp(min=1e-30)), float("-inf"))
    return out.view_as(q).to(q.dtype), lse


# ---- backward ------------------------------------------------------------------------------
def _backward(q, k, v, out, lse, mask, dout, causal, scale, fwd):
    hkv, rank, cp = k.shape[1], fwd.layout.rank, fwd.cp
    qg = _grouped(q, hkv).float()
    dog = _grouped(dout.contiguous(), hkv).float()
    delta = (dog * _grouped(out, hkv).float()).sum(-1)  # rowsum(dO * O)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    dq = torch.zeros_like(qg)
    kv = torch.stack([k, v]).contiguous()
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    for step in range(cp):
        src = (rank - step) % cp
        pending = _exchange(kv, fwd) if step < cp - 1 else None
        kb, vb = kv[0].float(), kv[1].float()
        for qs, ks, sub in _pairs(fwd, src, mask, causal, q.device):
            s = _scores(qg[..., qs, :], kb[:, :, ks], sub, scale, hkv)
            p = torch.exp(s - lse_safe[..., qs].unsqueeze(-1))  # [B, Hkv, rep, cq, ck]
            do = dog[..., qs, :]
            dkv[1][:, :, ks] += torch.matmul(p.transpose(-1, -2), do).sum(2)
            dp = torch.matmul(do, vb[:, :, ks].unsqueeze(2).transpose(-1, -2))
            ds = p * (dp - delta[..., qs].unsqueeze(-1))
            dq[..., qs, :] += torch.matmul(ds, kb[:, :, ks].unsqueeze(2)) * scale
            dkv[0][:, :, ks] += torch.matmul(ds.transpose(-1, -2), qg[..., qs, :]).sum(2) * scale
        if pending is not None:  # one exchange at a time: kv and dkv never race on a pair
            kv_next, kv_works = pending
            _wait(kv_works)
            kv = kv_next
        dkv, works = _exchange(dkv, fwd)  # the block's gradient travels with it
        _wait(works)
    return dq.view_as(q).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
