"""A conformer's convolution module split as one packed pair (`tpkit.sources.convs`,
``conv_packed_colwise``): pointwise conv (C -> 2C) -> GLU over the channels -> padding mask ->
depthwise conv -> BatchNorm -> activation -> pointwise conv (C -> C), one all-reduce. Output and
every gradient against the unsharded module at tp=2 and 3 (uneven halves too), what must not
pair (a GLU over time, a norm before the GLU, a reader of the unhalved channels), and two tiny
real models (Parakeet's encoder, Wav2Vec2-Conformer) split by the inferred plan."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests.harness import RankGroup
from tests.parity import module_parity

TOL = 1e-5


class ConformerConv(nn.Module):
    """The conformer convolution module on [batch, time, C] with an optional padding mask
    [batch, time] (Parakeet's ``masked_fill`` before the depthwise conv)."""

    def __init__(self, c: int, glu_dim: int = 1, norm_first: bool = False, depthwise: bool = True):
        super().__init__()
        self.glu_dim, self.norm_first = glu_dim, norm_first
        self.layer_norm = nn.LayerNorm(c)
        self.pointwise_conv1 = nn.Conv1d(c, 2 * c, 1)
        self.pre_norm = nn.BatchNorm1d(2 * c) if norm_first else nn.Identity()
        self.depthwise_conv = nn.Conv1d(c, c, 3, padding=1, groups=c) if depthwise else None
        self.norm = nn.BatchNorm1d(c)
        self.pointwise_conv2 = nn.Conv1d(c, c, 1, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.pointwise_conv1(self.layer_norm(x).transpose(1, 2))
        h = nn.functional.glu(self.pre_norm(h), dim=self.glu_dim)
        if mask is not None:
            h = h.masked_fill(~mask[:, None, :], 0.0)
        if self.depthwise_conv is not None:
            h = self.depthwise_conv(h)
        h = nn.functional.silu(self.norm(h))
        return x + self.pointwise_conv2(h).transpose(1, 2)


class ReadsHalves(nn.Module):
    """The GLU's halves read unhalved by a second convolution too: no one layout serves both."""

    def __init__(self, c: int):
        super().__init__()
        self.pw1 = nn.Conv1d(c, 2 * c, 1)
        self.pw2 = nn.Conv1d(c, c, 1)
        self.side = nn.Conv1d(2 * c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pw1(x)
        return self.pw2(nn.functional.glu(h, dim=1)) + self.side(torch.relu(h))


def _mask() -> torch.Tensor:
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False  # the second sample padded
    return mask


def _styles(model: nn.Module, tp: int, *example) -> dict[str, str]:
    from tpkit.sources.convs import conv_pairs, shared_params, splittable_conv

    shared = shared_params(model)
    return conv_pairs(model, tp, lambda _, m: splittable_conv(m, shared), example).styles


# -- the plan, no ranks -------------------------------------------------------------------
def test_glu_pair_is_packed():
    """pointwise_conv1 -> GLU(dim=1) -> mask -> depthwise -> BatchNorm -> SiLU -> pointwise_conv2
    is one packed pair (the mask broadcast over the channels does not break it)."""
    styles = _styles(ConformerConv(6), 2, torch.randn(2, 7, 6), _mask())
    assert styles == {
        "pointwise_conv1": "conv_packed_colwise",
        "depthwise_conv": "channelwise",
        "norm": "norm_channelwise",
        "pointwise_conv2": "conv_rowwise",
    }


@pytest.mark.parametrize(
    "model",
    [ConformerConv(6, glu_dim=2), ConformerConv(6, norm_first=True), ReadsHalves(6)],
    ids=["glu-over-time", "norm-before-glu", "reads-halves"],
)
def test_glu_breaks(model):
    """A GLU over another dim, a norm on the unhalved channels, or a second reader of them:
    the first pointwise conv does not pair (it is gathered by the fallback, or left whole)."""
    x = torch.randn(2, 6, 7) if isinstance(model, ReadsHalves) else torch.randn(2, 7, 6)
    first = "pw1" if isinstance(model, ReadsHalves) else "pointwise_conv1"
    assert _styles(model, 2, x).get(first) is None


def test_inferred_plan_pairs_parakeet():
    """The inferred plan of a model whose linears it splits pairs its conformer convolutions
    too (they were left whole), as one group settling can keep whole where tp does not divide
    the depthwise groups."""
    from tpkit.plan import derive_plan

    plan = derive_plan(_parakeet(), "auto", 2)
    assert plan.get("layers.*.conv.pointwise_conv1") == "conv_packed_colwise"
    assert plan.get("layers.*.conv.pointwise_conv2") == "conv_rowwise"
    group = next(g for g in plan.groups if "layers.*.conv.pointwise_conv1" in g.modules)
    assert group.counts == {"groups of layers.*.conv.depthwise_conv": 24}
    odd = derive_plan(_parakeet(), "auto", 5)  # 5 does not divide 24 channels: whole
    assert odd.get("layers.*.conv.pointwise_conv1") in (None, "replicate")


# -- parity on ranks ----------------------------------------------------------------------
def _parakeet() -> nn.Module:
    import transformers

    cfg = transformers.ParakeetEncoderConfig(
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        subsampling_conv_channels=8,
        num_mel_bins=16,
    )
    torch.manual_seed(0)
    return transformers.ParakeetEncoder(cfg)


def _w2v_conformer() -> nn.Module:
    import transformers

    cfg = transformers.Wav2Vec2ConformerConfig(
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        conv_dim=(8, 8),
        conv_stride=(2, 2),
        conv_kernel=(3, 3),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        conv_depthwise_kernel_size=3,
    )
    torch.manual_seed(0)
    return transformers.Wav2Vec2ConformerModel(cfg)


class Hidden(nn.Module):
    """A transformers encoder's last hidden state as one tensor (for `module_parity`)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if len(args) == 2:
            return self.inner(args[0], attention_mask=args[1]).last_hidden_state
        return self.inner(args[0]).last_hidden_state


def _case(name: str):
    g = torch.Generator().manual_seed(1)
    if name == "conformer":
        return ConformerConv(6), (torch.randn(2, 7, 6, generator=g), _mask()), "pointwise_conv1"
    if name == "uneven":  # 5 channels per half: 3 + 2 at tp=2, no depthwise conv
        model = ConformerConv(5, depthwise=False)
        return model, (torch.randn(2, 7, 5, generator=g), _mask()), "pointwise_conv1"
    if name == "parakeet":
        mask = torch.ones(2, 40, dtype=torch.long)
        mask[1, 28:] = 0
        x = torch.randn(2, 40, 16, generator=g)
        return Hidden(_parakeet()), (x, mask), "inner.layers.0.conv.pointwise_conv1"
    x = torch.randn(2, 64, generator=g)
    return Hidden(_w2v_conformer()), (x,), "inner.encoder.layers.0.conv_module.pointwise_conv1"


def check_parity(name: str, train: bool) -> dict:
    """Run on every rank: the split module against the unsharded one (`module_parity`), and
    whether the first pointwise conv's weight is split."""
    import tpkit
    from tpkit.styles import style_of

    torch.manual_seed(0)
    ref, args, first = _case(name)
    for m in ref.modules():  # non-trivial norm parameters and running statistics
        if isinstance(m, nn.BatchNorm1d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    ref = ref.float().train(train)
    for m in ref.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    if isinstance(ref, Hidden):  # the model itself split: its own made-up trace inputs
        model = Hidden(tpkit.tensor_parallel(copy.deepcopy(ref.inner)))
    else:
        model = tpkit.tensor_parallel(copy.deepcopy(ref), example_inputs=args)
    out = module_parity(ref, model, *args)
    w = model.get_submodule(first).weight
    style = style_of(model.get_submodule(first))
    out["split"] = isinstance(w, DTensor) and w.to_local().shape[0] < w.shape[0]
    out["style"] = style.name if style is not None else None
    return out


def _assert(results: list[dict]) -> None:
    for r in results:
        assert r["split"] and r["style"] == "conv_packed_colwise", (r["style"], r)  # no gather
        assert r["out"] <= TOL * max(1.0, r["out_scale"]), r
        assert r["grad"] <= TOL * max(1.0, r["scale"]), r
        assert not r["missing"], r


@pytest.mark.parametrize(
    ("name", "train"),
    [("conformer", True), ("uneven", True), ("parakeet", False)],
)
def test_parity_tp2(ranks2: RankGroup, name: str, train: bool):
    _assert(ranks2.run(check_parity, name, train))


def test_parity_w2v_conformer_tp2(ranks2: RankGroup):
    _assert(ranks2.run(check_parity, "w2v_conformer", False))  # training draws masks, layerdrop


def test_parity_tp3(ranks3: RankGroup):
    _assert(ranks3.run(check_parity, "conformer", True))
