"""Grouped convolutions read whole and convolutions that transform their own weight
(`tpkit.sources.convs`, `tpkit.styles.conv`): split by output channels and gathered, exact at
tp=2, 3 and 4 (outputs and every gradient against the unsharded model), including groups tp
does not divide (rows padded to whole groups); weight standardization (BiT) split only by
output channels, never read split; a transform over the whole weight kept whole; and the
tiny BiT, RegNet and SqueezeBERT against their unsharded models, with their full-size shares."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.models.bit.modeling_bit import WeightStandardizedConv2d

from tests.harness import RankGroup
from tests.parity import full_size_share, module_parity
from tpkit.plan.layout import GroupedRows, chunk_sizes
from tpkit.sources.convs import conv_pairs, rows_exact, shared_params, splittable_conv

TOL = 1e-5


# -- models ---------------------------------------------------------------------------------
class GroupedStack(nn.Module):
    """SqueezeBERT's feed-forward on [batch, channels, seq]: grouped 1x1 conv1d, GELU, grouped
    1x1 conv1d, then the residual (the split output never meets the whole stream)."""

    def __init__(self, c: int = 12, groups: int = 3, mult: int = 4):
        super().__init__()
        self.up = nn.Conv1d(c, mult * c, 1, groups=groups)
        self.down = nn.Conv1d(mult * c, c, 1, groups=groups)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


class GroupedBlock(nn.Module):
    """RegNet's X block: 1x1 conv, BatchNorm, ReLU, grouped 3x3 conv (``groups``), BatchNorm,
    ReLU, 1x1 conv, the residual."""

    def __init__(self, c: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.conv3 = nn.Conv2d(c, c, 1, bias=False)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        return torch.relu(x + self.conv3(y))


class StandardizedBlock(nn.Module):
    """BiT's pre-activation bottleneck: GroupNorm, weight-standardized 1x1, GroupNorm, 3x3,
    GroupNorm, 1x1, the residual."""

    def __init__(self, c: int = 16, mid: int = 8):
        super().__init__()
        self.norm1 = nn.GroupNorm(4, c)
        self.conv1 = WeightStandardizedConv2d(c, mid, 1, eps=1e-8)
        self.norm2 = nn.GroupNorm(4, mid)
        self.conv2 = WeightStandardizedConv2d(mid, mid, 3, eps=1e-8)
        self.norm3 = nn.GroupNorm(4, mid)
        self.conv3 = WeightStandardizedConv2d(mid, c, 1, eps=1e-8)

    def forward(self, x):
        y = self.conv1(torch.relu(self.norm1(x)))
        y = self.conv2(torch.relu(self.norm2(y)))
        return x + self.conv3(torch.relu(self.norm3(y)))


class WholeStandardizedConv2d(nn.Conv2d):
    """A transform over the whole weight (one mean and std for all of it): no rank can compute
    its rows from its own rows."""

    def forward(self, x):
        w = (self.weight - self.weight.mean()) / (self.weight.std() + 1e-5)
        return nn.functional.conv2d(x, w, self.bias, self.stride, self.padding)


def grouped_stack(groups: int = 3) -> nn.Module:
    return nn.Sequential(GroupedStack(12, groups), GroupedStack(12, groups))


def grouped_blocks(groups: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 12, 3, padding=1), GroupedBlock(12, groups))


def standardized() -> nn.Module:
    stem = WeightStandardizedConv2d(3, 16, 3, eps=1e-8)
    return nn.Sequential(stem, StandardizedBlock(), StandardizedBlock())


def whole_standardized() -> nn.Module:
    return nn.Sequential(WholeStandardizedConv2d(3, 8, 3, padding=1), nn.ReLU())


MODELS = {
    "grouped_stack": (grouped_stack, (2, 12, 5)),
    "grouped_stack_4": (lambda: grouped_stack(4), (2, 12, 5)),
    "grouped_blocks_3": (lambda: grouped_blocks(3), (2, 3, 6, 6)),
    "grouped_blocks_5": (lambda: nn.Sequential(nn.Conv2d(3, 15, 1), GroupedBlock(15, 5)), None),
    "standardized": (standardized, (2, 3, 9, 9)),
}


def _input(name: str) -> torch.Tensor:
    shape = MODELS[name][1] or (2, 3, 6, 6)
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


# -- on the ranks ---------------------------------------------------------------------------
def split_parity(name: str) -> dict:
    """Run on every rank: ``name``'s model split by tpkit's own plan against the unsharded
    one, with the plan's styles."""
    import tpkit

    torch.manual_seed(0)
    ref = MODELS[name][0]().float().train()
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    plan = model._tpkit.plan
    styles = {t.name: t.style for t in plan.resolve(model) if t.kind == "module"}
    out = module_parity(ref, model, _input(name))
    return {**out, "styles": styles, "notes": dict(plan.notes)}


def raising_forward_restores() -> dict:
    """Run on every rank: a grouped convolution's forward that raises (a split input of the
    wrong width) leaves its DTensor weight and its groups as they were, and the next forward
    is exact (the style's padding and groups are put back by an always-called hook)."""
    from torch.distributed.tensor import DTensor

    import tpkit

    torch.manual_seed(0)
    ref = grouped_stack().float().train()
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    convs = {n: m for n, m in model.named_modules() if isinstance(m, nn.Conv1d)}
    before = {n: (m.groups, tuple(m.weight.to_local().shape)) for n, m in convs.items()}
    try:
        model(torch.randn(2, 10, 5))
        error = ""
    except ValueError as e:
        error = str(e)
    after = {
        n: (m.groups, tuple(m.weight.to_local().shape))
        for n, m in convs.items()
        if isinstance(m.weight, DTensor)
    }
    out = module_parity(ref, model, _input("grouped_stack"))
    return {**out, "error": error, "before": before, "after": after}


def family_parity(model_type: str, class_name: str, kind: str) -> dict:
    """Run on every rank: the sweep's own tiny-model check (`benchmarks.coverage`)."""
    from benchmarks.coverage import check_parity

    return check_parity(model_type, class_name, kind)


def _assert_exact(r: dict) -> None:
    assert not r["missing"], r["missing"]
    assert r["out"] <= TOL * max(1.0, r["out_scale"]), r
    assert r["grad"] <= TOL * max(1.0, r["scale"]), r


# -- tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["grouped_stack", "grouped_stack_4", "grouped_blocks_3"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_grouped_convs_read_whole_are_gathered_exactly(name: str, world: int, request) -> None:
    """A grouped convolution whose input is whole takes ``conv_colwise_gather`` whether or not
    tp divides its groups (3 groups at tp=2 and 4, 4 at tp=3); between a pair whose column tp
    divides (3 groups at tp=3) it stays ``channelwise``. Before, one read whole stayed whole."""
    group: RankGroup = request.getfixturevalue(f"ranks{world}")
    r = group.run(split_parity, name)[0]
    _assert_exact(r)
    grouped = [n for n in r["styles"] if n.endswith(("up", "down", "conv2"))]
    assert grouped, r["styles"]
    paired = name == "grouped_blocks_3" and world == 3
    want = "channelwise" if paired else "conv_colwise_gather"
    assert all(r["styles"][n] == want for n in grouped), r["styles"]


def test_grouped_rows_not_on_group_bounds(ranks2: RankGroup) -> None:
    """15 channels in 5 groups of 3 at tp=2: rank 0's 8 rows end inside group 3, padded."""
    r = ranks2.run(split_parity, "grouped_blocks_5")[0]
    _assert_exact(r)
    assert r["styles"].get("1.conv2") == "conv_colwise_gather", (r["styles"], r["notes"])


def test_raising_forward_leaves_the_grouped_conv_as_it_was(ranks2: RankGroup) -> None:
    """A forward that raises inside a gathered grouped convolution (its input 10 channels
    wide, not 12) puts back its weight shard and groups; the next forward is exact."""
    r = ranks2.run(raising_forward_restores)[0]
    assert "needs its whole input (12 channels" in r["error"], r["error"]
    assert r["after"] == r["before"], (r["before"], r["after"])
    _assert_exact(r)


@pytest.mark.parametrize("world", [2, 4])
def test_weight_standardized_convs_split_by_output_channels(world: int, request) -> None:
    """BiT's weight standardization is per output channel: exact split by output channels
    (gathered), never read split (its statistics span the input channels)."""
    group: RankGroup = request.getfixturevalue(f"ranks{world}")
    r = group.run(split_parity, "standardized")[0]
    _assert_exact(r)
    convs = [n for n in r["styles"] if "conv" in n or n == "0"]
    assert len(convs) == 7, r["styles"]
    assert {r["styles"][n] for n in convs} <= {"conv_colwise_gather", "conv_colwise"}, r["styles"]


def test_rows_exact_probe() -> None:
    """The probe: weight standardization per output channel passes, a standardization over
    the whole weight does not, a plain convolution is not asked (its forward is torch's)."""
    assert rows_exact(WeightStandardizedConv2d(4, 6, 3, eps=1e-8))
    with torch.device("meta"):  # full-size models are derived on meta
        assert rows_exact(WeightStandardizedConv2d(4, 6, 3, eps=1e-8))
    assert not rows_exact(WholeStandardizedConv2d(4, 6, 3))
    assert not rows_exact(nn.Conv2d(4, 6, 3))
    assert splittable_conv(nn.Conv2d(4, 6, 3), set())


def test_whole_weight_transform_stays_whole() -> None:
    """A convolution whose forward computes over its whole weight is neither paired nor
    gathered: nothing shows that a rank's rows give its channels."""
    model = whole_standardized()
    shared = shared_params(model)
    pairs = conv_pairs(model, 2, lambda _, m: splittable_conv(m, shared), (_input("standardized"),))
    assert "0" not in pairs.styles, pairs.styles


def test_transformed_conv_never_reads_split() -> None:
    """In a standardized block no weight-standardized convolution is a row convolution."""
    model = standardized()
    shared = shared_params(model)
    x = (_input("standardized"),)
    pairs = conv_pairs(model, 2, lambda _, m: splittable_conv(m, shared), x)
    assert "conv_rowwise" not in pairs.styles.values(), pairs.styles
    assert pairs.styles.get("1.conv2") == "conv_colwise_gather", pairs.styles


@pytest.mark.parametrize(
    ("model_type", "class_name", "kind"),
    [
        ("bit", "BitForImageClassification", "image-classification"),
        ("regnet", "RegNetForImageClassification", "image-classification"),
        ("squeezebert", "SqueezeBertForMaskedLM", "masked-lm"),
    ],
)
def test_family_rows(model_type: str, class_name: str, kind: str, ranks2: RankGroup) -> None:
    """The sweep's rows: tiny parity of output and every gradient, and >= 90% of the
    full-size model's >=2-D parameters split at tp=2 (BiT 0%, RegNet 71%, SqueezeBERT 59%
    before)."""
    r = ranks2.run(family_parity, model_type, class_name, kind)[0]
    assert r["parity"] and r["grad_parity"], r
    share, whole = full_size_share(class_name, tp=2, model_type=model_type)
    assert share >= 0.9, whole


@pytest.mark.parametrize(
    ("groups", "per_in", "per_out"), [(17, 2, 4), (3, 2, 2), (6, 1, 1), (4, 3, 6)]
)
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_grouped_rows_cover_the_whole_output(groups: int, per_in: int, per_out: int, tp: int):
    """Every rank's `GroupedRows` computation, concatenated, is the whole grouped convolution,
    bit for bit in float64 (17 groups at tp=2: rank 0's rows end inside group 9), and the
    module's groups and parameters are put back after each."""
    conv = nn.Conv2d(groups * per_in, groups * per_out, 3, padding=1, groups=groups).double()
    x = torch.randn(2, groups * per_in, 5, 5, dtype=torch.float64)
    whole = conv(x)
    parts, start = [], 0
    for rank, size in enumerate(chunk_sizes(conv.out_channels, tp)):
        if not size:
            continue
        rows = GroupedRows.of(conv, tp, rank)
        local = copy.deepcopy(conv)
        local.weight = nn.Parameter(conv.weight[start : start + size].clone())
        local.bias = nn.Parameter(conv.bias[start : start + size].clone())
        state = rows.enter(local)
        y = local(rows.narrow_input(x, 2))
        GroupedRows.leave(local, state)
        assert local.groups == groups and local.weight.shape[0] == size
        parts.append(rows.narrow_output(y, 2))
        start += size
    assert torch.equal(torch.cat(parts, 1), whole)
