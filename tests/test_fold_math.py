"""Folding layers that compute with their index beyond comparisons (`tpkit.trace.watched`):
a function of `math` of it (Beam's depth-scaled residual), float tensors scaled by it, and the
uses that must still tell layers apart (integer tensors made of it, torch calls handed it).
Each plan is the unfolded one, entry for entry. Pure: meta-free CPU models, no ranks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.test_fold_guards import _plans, _runs
from tpkit.trace.analysis import Analysis, plan_key
from tpkit.trace.watched import FoldBroken, Guards, Watched, holds, math_watched


def _depth_scaled(x: torch.Tensor, residual: torch.Tensor, idx) -> torch.Tensor:
    """Beam's ``depth_scaled_residual_add`` (the residual first: the stream a twin hands on
    is then tagged as its own layer's, see tests/test_fold_guards.py)."""
    return residual * math.sqrt((idx - 1) / idx) + x * (1.0 / math.sqrt(idx))


class _Block(nn.Module):
    """Beam's layer: its residual add is scaled by its own ``residual_add_idx``; ``use``
    reads it otherwise too (a test, an integer tensor, a torch call)."""

    def __init__(self, width: int, layer_idx: int, use: str = ""):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.residual_add_idx = 2 * (layer_idx + 1)
        self.use = use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        if self.use == "test" and math.sqrt(self.residual_add_idx) > 3:  # layers 4 and 5
            h = h * 2
        if self.use == "positions":  # an integer tensor made of it: its value steers
            positions = torch.arange(x.shape[-1], device=x.device) + self.residual_add_idx
            h = h + positions.float().mean()
        if self.use == "torch":  # handed to torch: read as a value there
            h = h + torch.full((1,), self.residual_add_idx, device=x.device)
        return _depth_scaled(self.down(h), x, self.residual_add_idx)


class _Stack(nn.Module):
    """Six alike layers."""

    def __init__(self, use: str = ""):
        super().__init__()
        self.layers = nn.ModuleList(_Block(8, i, use) for i in range(6))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize(("use", "runs"), [("", [0]), ("test", [0, 4])])
def test_a_layer_scaled_by_a_function_of_its_index_folds(use, runs):
    """``math.sqrt`` of the index is an expression of it, and a float tensor scaled by it is
    what a layer alike but for its weights gives: the layers fold (once per answer where the
    root is also compared), and the plan is the unfolded one."""
    model = _Stack(use)
    analysis = Analysis(model, (torch.randn(2, 3, 8),))
    calls = _runs(model)
    analysis.trace()
    assert calls == runs and not analysis.broke and not analysis.distinguishing
    folded, plan, unfolded = _plans(model)
    assert plan_key(plan) == plan_key(unfolded) and plan.notes == unfolded.notes
    assert plan["layers.*.up"] == "colwise" and plan["layers.*.down"] == "rowwise"
    assert folded.tally["stood"] > 0 and not folded.unfolded


@pytest.mark.parametrize(("use", "unfolded"), [("positions", False), ("torch", True)])
def test_an_index_whose_value_is_read_tells_layers_apart(use, unfolded):
    """An integer tensor made of the index breaks the fold on that index (then compared: each
    layer its own kind); one handed to a torch call (a TypeError there, not a read) breaks it
    for the whole trace. Either way the plan is the unfolded one."""
    model = _Stack(use)
    analysis = Analysis(model, (torch.randn(2, 3, 8),))
    analysis.trace()
    assert analysis.broke
    assert ("trace" in analysis.unfolded) is unfolded
    assert bool(analysis.distinguishing) is not unfolded
    _, plan, plain = _plans(model)
    assert plan_key(plan) == plan_key(plain) and plan.notes == plain.notes


def test_math_of_a_watched_index_is_watched_and_guarded():
    guards = Guards()
    idx = Watched("residual_add_idx", 4, "t", "layers.1", guards, key="i")
    guards.begin("layers.1")
    with math_watched():
        root = math.sqrt(idx)
        assert isinstance(root, Watched) and math.sqrt(16) == 4.0  # plain values as math does
        assert (root > 1.5) is True
        scaled = torch.ones(2) * (1.0 / root)
        assert not isinstance(scaled, Watched) and scaled.tolist() == [0.5, 0.5]
        with math_watched():  # nested: the outer block puts math back, not this one
            pass
        assert isinstance(math.log2(idx), Watched)
    assert math.sqrt(4) == 2.0 and type(math.sqrt).__name__ == "builtin_function_or_method"
    found = guards.end()
    assert holds(found, {"i": 9}) and not holds(found, {"i": 1})  # sqrt(1) > 1.5 is False
    guards.begin("layers.1")
    with pytest.raises(FoldBroken) as broke:  # an integer tensor: its values steer shapes
        _ = torch.arange(3) + idx
    assert broke.value.index == "t"
    guards.end()
