"""Grouped convolutions in the per-layer fallback (`tpkit.sources.fallback`) and the whole-input
guard of `tpkit.plan.layout.GroupedRows` (issue 29).

A model whose forward cannot be traced takes the per-layer fallback; a grouped convolution
(not depthwise) there is now split by output channels and gathered (``conv_colwise_gather``:
rows padded to whole groups, exact whether or not tp divides the groups), a depthwise one
(DaViT's position-encoding convolution) stays whole with its reason. Checked against the
unsharded model at tp=2 (output and every gradient), groups tp does not divide included.
`GroupedRows` refuses an input that is not whole: a slice of a split input could have the
right shape on some ranks and hold other channels. The tiny Florence-2 (DaViT tower): exact at
tp=2 with its tower's linears split around the whole depthwise convolutions."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.harness import RankGroup
from tests.parity import module_parity
from tpkit.plan.layout import GroupedRows

TOL = 1e-5


class UntracedDaViT(nn.Module):
    """A DaViT-like stage on a dict input (no made-up input matches it: the per-layer
    fallback): a grouped 3x3 conv (``groups`` tp need not divide), a depthwise 3x3
    position-encoding conv with a residual, channels-last LayerNorm and an MLP, back to
    channels-first."""

    def __init__(self, c: int = 12, groups: int = 3):
        super().__init__()
        self.grouped = nn.Conv2d(c, c, 3, padding=1, groups=groups)
        self.pos = nn.Conv2d(c, c, 3, padding=1, groups=c)  # depthwise: stays whole
        self.norm = nn.LayerNorm(c)
        self.fc1 = nn.Linear(c, 2 * c)
        self.fc2 = nn.Linear(2 * c, c)

    def forward(self, batch):
        x = torch.relu(self.grouped(batch["pixels"]))
        x = self.pos(x) + x
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        t = t + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(t))))
        return t.transpose(1, 2).reshape(b, c, h, w)


class Wrap(nn.Module):
    """Calls the model on a plain tensor (for `module_parity`)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model({"pixels": x})


def _model(groups: int) -> nn.Module:
    torch.manual_seed(0)
    return UntracedDaViT(c=12 if groups != 5 else 10, groups=groups).float().eval()


def fallback_parity(groups: int) -> dict:
    """Run on every rank: the fallback's split of `UntracedDaViT` against the unsharded one."""
    import tpkit
    from tpkit.state import tp_state

    ref = _model(groups)
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    plan = tp_state(model).plan
    x = torch.randn(2, ref.grouped.in_channels, 5, 6, generator=torch.Generator().manual_seed(1))
    r = module_parity(Wrap(ref), Wrap(model), x)
    r["styles"] = {n: plan.get(n) for n in ("grouped", "pos", "fc1", "fc2")}
    r["notes"] = dict(plan.notes)
    return r


def test_fallback_plan_gathers_grouped_keeps_depthwise_whole() -> None:
    from tpkit.plan.checks import validate
    from tpkit.plan.derive import derive_plan

    model = _model(3)
    plan = derive_plan(model, "auto", 2)
    validate(model, plan, 2)  # the dry run pads the rows to whole groups too
    assert plan["grouped"] == "conv_colwise_gather", plan.notes.get("grouped")
    assert plan.notes["grouped"].startswith("per-layer fallback: the dataflow could not be")
    assert "pos" not in plan
    assert plan.notes["pos"] == (
        "replicated: depthwise (groups=12): a kernel per channel, not worth an all-gather"
    )
    assert plan["fc1"] == plan["fc2"] == "colwise_gather_output"


def test_fallback_keeps_a_grouped_conv_whole_where_a_rank_would_get_no_rows() -> None:
    """torch.chunk of 9 channels at tp=4 is 3, 3, 3, 0: the last rank's rows could not be
    padded to whole groups (its conv got groups=0 and raised); kept whole, with the reason."""
    from tpkit.sources.fallback import fallback_plan

    model = nn.Sequential(nn.Conv2d(9, 9, 3, groups=3)).eval()
    plan = fallback_plan(model, "per-layer fallback", 4)
    assert "0" not in plan, dict(plan.items())
    assert "its 9 output channels give a rank 0" in plan.notes["0"], plan.notes


@pytest.mark.parametrize("groups", [3, 5])  # 5 groups at tp=2: rows padded to whole groups
def test_fallback_grouped_conv_parity_tp2(ranks2: RankGroup, groups: int) -> None:
    for r in ranks2.run(fallback_parity, groups):
        assert r["styles"]["grouped"] == "conv_colwise_gather", r["notes"].get("grouped")
        assert r["styles"]["pos"] is None, r["notes"].get("pos")
        assert r["out"] <= TOL * max(1.0, r["out_scale"]), r
        assert r["grad"] <= TOL * max(1.0, r["scale"]), r
        assert not r["missing"], r
        assert r["sharded"] >= 6, r  # grouped's weight and bias, fc1's and fc2's


def test_grouped_rows_refuse_a_split_input() -> None:
    """A grouped convolution gathered by output channels must read its whole input: rank 0's
    narrowed slice of a half-width input has the right shape but other channels' values."""
    conv = nn.Conv2d(8, 8, 3, groups=4)
    rows = GroupedRows.of(conv, 2, 0)
    whole = torch.randn(1, 8, 4, 4)
    assert rows.narrow_input(whole, 2).shape[1] == rows.width
    with pytest.raises(ValueError, match=r"whole input \(8 channels at dim 1\), got 4"):
        rows.narrow_input(whole[:, :4], 2)


def florence2_parity() -> dict:
    """Run on every rank: the sweep's own tiny-model check (`benchmarks.coverage`)."""
    from benchmarks.coverage import check_parity

    return check_parity("florence2", "Florence2ForConditionalGeneration", "image-text-to-text")


def test_florence2_davit_tower_split(ranks2: RankGroup) -> None:
    """The tiny Florence-2 at tp=2: output and every gradient exact, and its DaViT tower's
    linears split around the depthwise position-encoding convolutions (which stay whole):
    before, each row linear's output was read as needed whole by the next block's depthwise
    convolution, and 11% of the tiny model was split (82% at full size)."""
    r = ranks2.run(florence2_parity)[0]
    assert r["parity"] and r["grad_parity"] and not r["grads_missing"], r
    assert r["share_sharded"] >= 0.8, r
    assert not any("needs its whole output" in v for v in r["notes"].values()), r["notes"]
