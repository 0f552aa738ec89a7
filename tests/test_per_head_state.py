"""Per-head state read with split heads, found by issue 29's sweep: no wrong number without error.

MLCD's vision model holds ``class_pos_emb``, an ``nn.Parameter`` of the model itself that its
forward concatenates into the rotary angles; their cos/sin multiply every head's queries and
keys. With the heads split, each rank's gradient for it covers that rank's heads only: the
output matched the unsharded model while the gradient was 0.72 off at tp=2, with no error, and
the replicas would drift apart after one optimizer step. The trace now follows every bare
parameter (one held by a module that is not linear-like) to where its values meet a column
layer's split output with no linear in between, and the settled plan names it
``replicated_with_grad_allreduce``, per parameter: the module holding it may have others whose
gradient is whole (summing those would double them).

Donut-Swin's integer ``relative_position_index``, as long as the heads by chance at the tiny
window, was cut per head like a per-head buffer: a scrambled position bias, hidden by tables
that start at zero. Only floating-point buffers are per-head values now.

Each check: output and every gradient within 1e-5 of the unsharded model at tp=2.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tests.parity import module_parity
from tests.test_families import _check, family_parity

TOL = 1e-5
DIM, HEADS = 16, 4


class TableAttention(nn.Module):
    """Self-attention whose per-head queries are scaled by a table the *parent* holds."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM)
        self.k_proj = nn.Linear(DIM, DIM)
        self.v_proj = nn.Linear(DIM, DIM)
        self.o_proj = nn.Linear(DIM, DIM)
        self.num_heads = HEADS

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            p(x).view(b, s, self.num_heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q = q * table  # [head_dim]: every head reads the same table
        att = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        return self.o_proj(att.transpose(1, 2).reshape(b, s, -1))


class TableModel(nn.Module):
    """Holds two bare parameters: ``table`` (read with split heads: partial gradient per rank)
    and ``gain`` (on the whole stream: whole gradient on every rank, must not be summed)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(DIM // HEADS))
        self.gain = nn.Parameter(torch.randn(DIM))
        self.attn = TableAttention()
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.gain
        h = h + self.attn(h, torch.tanh(self.table) + 1)
        return self.out(h)


def check_table_model() -> dict:
    import tpkit

    torch.manual_seed(0)
    ref = TableModel()
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    x = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(1))
    r = module_parity(ref, model, x)
    plan = model._tpkit.plan
    r["entries"] = {k: plan[k] for k in plan if k in ("table", "gain")}
    r["q_split"] = plan.style_for("attn.q_proj")
    return r


def test_a_bare_parameter_on_split_heads_gets_its_gradient_all_reduced(ranks2):
    r = ranks2.run(check_table_model)[0]
    assert r["q_split"] is not None and r["q_split"][0] == "colwise", r
    assert r["entries"] == {"table": "replicated_with_grad_allreduce"}, r
    assert r["out"] <= TOL * max(1.0, r["out_scale"]), r
    assert r["grad"] <= TOL * max(1.0, r["scale"]), r  # table's and gain's both
    assert not r["missing"], r


def test_mlcd_class_pos_emb_gradient_matches_unsharded(ranks2):
    r = _check(ranks2.run(family_parity, "mlcd", "MLCDVisionModel", "vision-encoder"))
    assert any("self_attn.q_proj" in n for n in r["sharded"]), r


def test_the_plan_names_the_parameter_not_its_module():
    """Pure, on meta: MLCD's settled tp=2 plan holds a parameter entry for ``class_pos_emb``
    (the model itself holds it, with other parameters) and says why."""
    from tests.tiny_family import build_family
    from tpkit.plan import derive_plan

    model = build_family("mlcd", "MLCDVisionModel", device="meta")
    plan = derive_plan(model, "auto", 2)
    hits = [t for t in plan.resolve(model) if t.name == "class_pos_emb"]
    assert [(t.kind, t.style) for t in hits] == [("param", "replicated_with_grad_allreduce")]
    assert "split output" in plan.notes["class_pos_emb"]


def check_donut_swin_trained_bias() -> dict:
    """Donut-Swin's tiny model with its position bias tables filled (they start at zero, which
    hid a scrambled bias from the output): first output and every gradient against unsharded."""
    import tpkit
    from tests.test_families import _parity
    from tests.tiny_family import build_family
    from tests.tiny_inputs import family_inputs

    torch.manual_seed(0)
    ref = build_family("donut-swin", "DonutSwinForImageClassification")
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("relative_position_bias_table"):
                p.normal_(0.0, 1.0)
    x = family_inputs(ref, "image-classification")
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    fixups = model._tpkit.plan.fixups
    r = _parity(ref, model, x)
    r["head_buffers"] = [k for k, v in fixups.items() if "head_buffers" in v]
    return r


def test_an_index_buffer_as_long_as_the_heads_is_not_cut_per_head(ranks2):
    """Donut-Swin's ``relative_position_index`` is [window area, window area]: 4 x 4 at the
    tiny 2-patch window, as many as its 4 heads. Read as a per-head buffer it was cut to each
    rank's "heads", which scrambled the position bias (output 0.05 and gradients 0.46 off
    once the tables are trained, gradients 0.016 off as initialised, no error). An integer
    buffer is an index, never per-head values."""
    r = _check(ranks2.run(check_donut_swin_trained_bias))
    assert r["head_buffers"] == [], r["head_buffers"]
