"""Dataflow the plan inference must read right (issue 28, found by `tests/test_property.py`):
where today's inferred plan gave a wrong number with no error, or a split the code cannot run.

- two column outputs joined (``cat`` / ``stack``) into a row linear: each rank holds
  [a_r | b_r], the row's rows are cut as [a | b];
- a replicated linear cut unevenly whose tail also reaches the column linear
  (``tail_grad_allreduce`` summed a gradient that was already whole);
- a child's weight read in its parent's forward (``proj.weight.abs().mean()``): split anyway;
- a tied head and its table: each reads the shared weight inside its own forward.

Each model is split with plan "auto" at tp=2 and tp=3 and checked against the unsharded model:
output and every gradient within 1e-5 (`tests.parity.module_parity`).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.parity import module_parity

TOL = 1e-5


class CatIntoRow(nn.Module):
    """``head(cat([a(h), b(h)], -1))``: two column outputs concatenated into one row linear."""

    def __init__(self, join: str = "cat") -> None:
        super().__init__()
        self.join = join
        self.inp = nn.Linear(8, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(32, 9)

    def forward(self, x):
        h = self.inp(x)
        a, b = self.a(h), self.b(h)
        if self.join == "cat":
            y = torch.cat([a, b], -1)
        elif self.join == "stack_last":  # interleaved: [a0 b0 a1 b1 ...]
            y = torch.stack([a, b], -1).flatten(-2)
        else:  # stack before the features: [a | b]
            y = torch.stack([a, b], -2).flatten(-2)
        return self.head(y)


class StackSummed(nn.Module):
    """Two column outputs stacked on a new leading dim and summed over it (a MoE's experts):
    a join that leaves the features alone, so the pair stays split."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 9)

    def forward(self, x):
        h = self.inp(x)
        return self.head(torch.stack([self.a(h), self.b(h)], 0).sum(0))


class GatedSplitTail(nn.Module):
    """gate_up cut unevenly [12 | 14], both parts reaching ``down``: ``silu(a) * b[..., :12]``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.gate_up = nn.Linear(16, 26)
        self.down = nn.Linear(12, 16)
        self.out = nn.Linear(16, 24)

    def forward(self, x):
        a, b = self.gate_up(self.inp(x)).split([12, 14], -1)
        return self.out(self.down(F.silu(a) * b[..., :12]))


class FusedGQA(nn.Module):
    """Attention with a fused qkv cut [q | k | v], 2 KV heads for 4 query heads, then a linear:
    ``o`` pairs with ``out`` as a column, its input as wide as the q part by coincidence, and
    the k / v parts reach ``o`` too."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.qkv = nn.Linear(16, 32)
        self.o = nn.Linear(16, 16)
        self.out = nn.Linear(16, 24)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.inp(x)).split([16, 8, 8], -1)
        q, k, v = (y.view(b, t, -1, 4).transpose(1, 2) for y in (q, k, v))
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(self.o(out.transpose(1, 2).reshape(b, t, -1)))


class ChildWeightStatistic(nn.Module):
    """A parent scaling its child's output by a statistic of the child's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 12)
        self.l2 = nn.Linear(12, 16)
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        y = self.l2(self.inp(x))
        return self.proj(y) * self.proj.weight.abs().mean()


MODELS = {
    "cat": lambda: CatIntoRow("cat"),
    "stack_last": lambda: CatIntoRow("stack_last"),
    "stack_before": lambda: CatIntoRow("stack_before"),
    "stack_summed": StackSummed,
    "gated_split_tail": GatedSplitTail,
    "fused_gqa": FusedGQA,
    "child_weight_statistic": ChildWeightStatistic,
}


def parity(name: str) -> dict:
    """Run on every rank: plan "auto" split vs the unsharded model, and the plan's styles."""
    import tpkit
    from tpkit.state import tp_state

    torch.manual_seed(0)
    ref = MODELS[name]().float().eval()
    x = torch.randn(2, 7, 8, generator=torch.Generator().manual_seed(1))
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    r = module_parity(ref, model, x)
    plan = tp_state(model).plan
    return {**r, "styles": {t.name: t.style for t in plan.resolve(model)}}


def _check(results: list[dict]) -> dict:
    for r in results:
        assert r["out"] <= TOL * max(1.0, r["out_scale"]), r
        assert r["grad"] <= TOL * max(1.0, r["scale"]), r
        assert not r["missing"], r
    return results[0]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_parity_tp2(ranks2, name):
    r = _check(ranks2.run(parity, name))
    assert r["sharded"], r  # the check proves something: weights were split


@pytest.mark.parametrize("name", sorted(MODELS))
def test_parity_tp3(ranks3, name):
    _check(ranks3.run(parity, name))


def test_cat_pair_is_gathered():
    """The joined columns are gathered, the row slices the whole joined input."""
    from tpkit.plan import derive_plan

    model = CatIntoRow("cat")
    styles = {t.name: t.style for t in derive_plan(model, "auto", 2).resolve(model)}
    assert styles["a"] == styles["b"] == "colwise_gather_output", styles
    assert styles["head"] == "rowwise_split_input", styles


def test_stack_summed_stays_split():
    """A stack over a dim away from the features (summed over) keeps the pair split."""
    from tpkit.plan import derive_plan

    model = StackSummed()
    styles = {t.name: t.style for t in derive_plan(model, "auto", 2).resolve(model)}
    assert styles["a"] == styles["b"] == "colwise" and styles["head"] == "rowwise", styles


def test_cut_reach_records_each_part():
    """The trace says which linear each part of an uneven cut reaches."""
    from tpkit.trace.trace import trace

    node = trace(GatedSplitTail(), (torch.randn(2, 7, 8),))["nodes"]["gate_up"]
    assert node.cuts == [12, 14] and node.cut_reach == [{"down"}, {"down"}], node


def test_child_weight_read_keeps_row_whole():
    from tpkit.plan import derive_plan

    model = ChildWeightStatistic()
    styles = {t.name: t.style for t in derive_plan(model, "auto", 2).resolve(model)}
    assert styles.get("proj", "replicate") == "replicate", styles


def test_tied_head_is_not_read_outside():
    """A head tied to its table reads the shared weight in its own forward, and the table in
    its own: neither is a read outside (which would keep both whole)."""
    from tpkit.trace.trace import trace

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(40, 16)
            self.head = nn.Linear(16, 40, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    nodes = trace(Tied(), (torch.randint(0, 40, (2, 7)),))["nodes"]
    assert not nodes["embed"].read_outside and not nodes["head"].read_outside, nodes
