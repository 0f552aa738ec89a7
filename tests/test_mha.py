"""``nn.MultiheadAttention`` split by heads (``mha_heads``, `tpkit.styles.attention`).

torch's attention module computes with bare parameters and reads its ``out_proj``'s weight
without calling it, so it used to stay whole, silently, in every user's
``nn.TransformerEncoder`` (its FFN split, its attention not). Now each one is split by heads,
in an inferred plan and in the per-layer fallback, with the unsharded model's outputs,
attention weights (averaged and per head) and every gradient, for each way torch's module can
be built and called: packed or separate q/k/v weights (kdim / vdim), ``bias_k`` / ``bias_v``,
``add_zero_attn``, batch first or not, unbatched input, 2-D and per-head 3-D masks, boolean
key padding masks, the causal hint. A head count tp does not divide keeps the module whole.
"""

from __future__ import annotations

import copy
import traceback

import torch
from torch import nn

TOL = 1e-5


class Encoder(nn.Module):
    """A user's own transformer: token table, torch's encoder layers, a head."""

    def __init__(self, batch_first: bool = True):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=batch_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 50)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(ids if self.batch_first else ids.t())
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1 if self.batch_first else 0])
        return self.head(self.enc(x, mask=mask, src_key_padding_mask=pad, is_causal=True))


class Seq2Seq(nn.Module):
    """torch's decoder layers: self-attention under a causal mask, cross-attention on memory."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=False)
        self.dec = nn.TransformerDecoder(layer, 2)

    def forward(self, ids: torch.Tensor, memory: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).transpose(0, 1)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[0])
        return self.dec(x, memory, tgt_mask=mask, memory_key_padding_mask=pad)


class Odd(nn.Module):
    """Every option of torch's module at once: its own key / value widths (separate
    projection weights), bias_k / bias_v, add_zero_attn, per-head attention weights."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(
            32, 4, kdim=24, vdim=20, add_bias_kv=True, add_zero_attn=True, batch_first=True
        )

    def forward(self, q, k, v, mask):
        out, weights = self.attn(q, k, v, attn_mask=mask, average_attn_weights=False)
        return torch.cat([out.flatten(), weights.flatten()])


class Averaged(nn.Module):
    """Averaged attention weights, a float key padding mask, and one unbatched sequence."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4)

    def forward(self, x, pad, single):
        out, weights = self.attn(x, x, x, key_padding_mask=pad)
        one, _ = self.attn(single, single, single, need_weights=False)
        return torch.cat([out.flatten(), weights.flatten(), one.flatten()])


class Untraceable(nn.Module):
    """A dict input no made-up input matches: the per-layer fallback, attention included."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.fc = nn.Linear(32, 16)

    def forward(self, batch):
        x = self.emb(batch["ids"])
        return self.fc(x + self.attn(x, x, x, need_weights=False)[0])


def _inputs(name: str) -> tuple:
    g = torch.Generator().manual_seed(1)
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ids = torch.randint(0, 50, (2, 7), generator=g)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    if name in ("encoder", "encoder_seq_first"):
        return ids, pad
    if name == "seq2seq":
        return ids, rand(5, 2, 32), torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    if name == "odd":
        mask = rand(2 * 4, 6, 5)  # per head: [batch * heads, L, S]
        return rand(2, 6, 32), rand(2, 5, 24), rand(2, 5, 20), mask
    if name == "averaged":
        return rand(6, 2, 32), torch.where(pad[:, :6], -1e4, 0.0), rand(3, 32)
    return ({"ids": ids},)


BUILD = {
    "encoder": Encoder,
    "encoder_seq_first": lambda: Encoder(batch_first=False),
    "seq2seq": Seq2Seq,
    "odd": Odd,
    "averaged": Averaged,
    "untraceable": Untraceable,
}


def _run(name: str, train_steps: int = 0) -> dict:
    """Run on every rank: outputs and every gradient of the split model vs the unsharded one
    (``train_steps`` SGD steps first: the losses of each)."""
    import tpkit
    from tpkit.state import tp_state

    torch.manual_seed(0)
    ref = BUILD[name]().float().eval()
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    args = _inputs(name)
    losses = [[], []]
    for i, m in enumerate((ref, model)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(train_steps):
            loss = m(*args).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[i].append(loss.item())
    outs = []
    for m in (ref, model):
        y = m(*args)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
        (y * w).sum().backward()
        outs.append(y.detach())
    want = dict(ref.named_parameters())
    grad, scale, missing = 0.0, 0.0, []
    for n, p in model.named_parameters():
        if (p.grad is None) != (want[n].grad is None):
            missing.append(n)
        elif p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grad = max(grad, (g - want[n].grad).abs().max().item())
            scale = max(scale, want[n].grad.abs().max().item())
    plan = tp_state(model).plan
    return {
        "out": (outs[0] - outs[1]).abs().max().item(),
        "grad": grad,
        "scale": scale,
        "missing": missing,
        "losses": losses,
        "styles": {k: v for k, v in plan.items()},
        "notes": dict(plan.notes),
        "local": {
            n: tuple(p.to_local().shape)
            for n, p in model.named_parameters()
            if hasattr(p, "placements") and not p.placements[0].is_replicate()
        },
    }


def run_all(names: list[str]) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = _run(name, train_steps=3 if name == "encoder" else 0)
        except Exception:  # noqa: BLE001 - reported by the test that owns the case
            out[name] = traceback.format_exc()
    return out


def _ok(r: dict | str) -> dict:
    assert not isinstance(r, str), r
    assert r["out"] <= TOL, r
    assert r["grad"] <= TOL * max(1.0, r["scale"]), r
    assert not r["missing"], r
    return r


def test_every_way_of_calling_torch_attention_matches_unsharded(ranks2):
    results = ranks2.run(run_all, list(BUILD), timeout=300)
    for name in BUILD:
        for per_rank in results:
            _ok(per_rank[name])
    enc = results[0]["encoder"]
    assert enc["styles"]["enc.layers.*.self_attn"] == "mha_heads"
    assert enc["styles"]["enc.layers.*.self_attn.out_proj"] == "rowwise"
    assert enc["local"]["enc.layers.0.self_attn.in_proj_weight"] == (48, 32)  # 3 x 2 heads of 8
    assert enc["local"]["enc.layers.0.self_attn.out_proj.weight"] == (32, 16)
    ref_losses, tp_losses = enc["losses"]
    assert len(ref_losses) == 3 and ref_losses[0] != ref_losses[-1]
    assert max(abs(a - b) for a, b in zip(ref_losses, tp_losses, strict=True)) <= TOL
    odd = results[1]["odd"]["local"]
    assert odd["attn.k_proj_weight"] == (16, 24) and odd["attn.bias_k"] == (1, 1, 16)
    assert results[0]["seq2seq"]["styles"]["dec.layers.0.multihead_attn"] == "mha_heads"
    fallback = results[0]["untraceable"]
    assert fallback["styles"]["attn"] == "mha_heads", fallback["styles"]
    assert fallback["notes"]["attn"].startswith("per-layer fallback, split by heads")


def test_heads_tp_does_not_divide_stay_whole():
    """6 heads at tp=4: the attention is kept whole (settled, not refused), the rest split; a
    user's explicit ``mha_heads`` at that tp is refused, naming the module and the count."""
    import pytest

    from tpkit.plan import Plan, derive_plan, validate

    plan = derive_plan(Untraceable6(), "auto", 4)
    assert plan.style_for("attn") is None or plan.style_for("attn")[0] == "replicate", plan
    assert plan["fc"] != "replicate"
    plan = derive_plan(Untraceable6(), "auto", 2)
    assert plan["attn"] == "mha_heads" and plan["attn.out_proj"] == "rowwise"
    with pytest.raises(ValueError, match=r"attn.*num_heads=6|num_heads=6.*attn"):
        validate(Untraceable6(), Plan({"attn": "mha_heads", "attn.out_proj": "rowwise"}), 4)


class Untraceable6(Untraceable):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 24)
        self.attn = nn.MultiheadAttention(24, 6, batch_first=True)
        self.fc = nn.Linear(24, 16)


def test_a_subclass_with_its_own_forward_stays_whole():
    from tpkit.plan import derive_plan

    class Mine(nn.MultiheadAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model = Untraceable()
    model.attn = Mine(32, 4, batch_first=True)
    plan = derive_plan(model, "auto", 2)
    assert "attn" not in plan and "attn.out_proj" not in plan
    assert "its own forward" in plan.notes["attn"]
