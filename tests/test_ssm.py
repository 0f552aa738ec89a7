"""Selective state-space mixers split by channels at full size (Mamba-1: Mamba, FalconMamba,
Jamba's Mamba layers: in_proj packed colwise, conv per channel, x_proj rowwise then f, dt_proj
per channel, A and D per channel, out_proj rowwise), and hybrids' mixed layer lists traced as
blocks; gated short convolutions (LFM2, LFM3: in_proj's B, C, x parts colwise, the depthwise
conv per channel, out_proj rowwise); logits and every gradient match the unsharded model at
tp=2 and tp=4, and generation with the conv state cached gives the same tokens."""

from __future__ import annotations

import pytest

from tests.parity import assert_parity, full_size_share, greedy_parity, tiny_parity

FULL_SIZE = {
    "MambaForCausalLM": ({}, 0.99),
    "FalconMambaForCausalLM": ({}, 0.99),
    # 8 of its 32 layers keep the test fast; attention, MoE, dense MLP and Mamba layers all in
    "JambaForCausalLM": ({"num_hidden_layers": 8}, 0.97),
    # the short conv left whole with its in_proj and out_proj: 0.87 before (LFM3)
    "Lfm2ForCausalLM": ({}, 0.99),
    "Lfm3ForCausalLM": ({}, 0.99),
}


@pytest.mark.parametrize("class_name", sorted(FULL_SIZE))
def test_full_size_share(class_name):
    overrides, least = FULL_SIZE[class_name]
    share, whole = full_size_share(class_name, **overrides)
    assert share >= least, (share, whole)


def test_mixer_styles():
    import torch
    import transformers

    from tests.tiny import tiny_config
    from tpkit.plan import derive_plan

    with torch.device("meta"):
        model = transformers.MambaForCausalLM(tiny_config("mamba", "MambaForCausalLM"))
    plan = derive_plan(model, "auto", 2)
    want = {
        "in_proj": "packed_colwise",
        "conv1d": "channelwise",
        "x_proj": "rowwise_feeds_split",
        "dt_proj": "channelwise",
        "out_proj": "rowwise",
        "A_log": "channelwise",
        "D": "channelwise",
    }
    for child, style in want.items():
        assert plan.style_for(f"backbone.layers.0.mixer.{child}")[0] == style, child


def test_parity_tp2(ranks2):
    for model_type, cls in (
        ("mamba", "MambaForCausalLM"),
        ("falcon_mamba", "FalconMambaForCausalLM"),
        ("jamba", "JambaForCausalLM"),
    ):
        results = ranks2.run(tiny_parity, model_type, cls, timeout=120)
        assert_parity(results)
        assert results[0]["share"] > 0.5, (model_type, results[0])


def test_parity_tp4(ranks4):
    assert_parity(ranks4.run(tiny_parity, "mamba", "MambaForCausalLM", timeout=120))


def test_short_conv_styles():
    import torch
    import transformers

    from tests.tiny import tiny_config
    from tpkit.plan import derive_plan

    with torch.device("meta"):
        model = transformers.Lfm3ForCausalLM(tiny_config("lfm3", "Lfm3ForCausalLM"))
    plan = derive_plan(model, "auto", 2)
    layer = next(i for i, t in enumerate(model.config.layer_types) if t == "conv")
    want = {"in_proj": "packed_qkv_colwise", "conv": "channelwise", "out_proj": "rowwise"}
    for child, style in want.items():
        assert plan.style_for(f"model.layers.{layer}.conv.{child}")[0] == style, child


def short_conv_generate() -> dict:
    """Greedy generation of the tiny LFM3 (a conv layer and an attention layer) at tp vs
    unsharded: the conv state is cached per rank for its channels."""
    _, model, equal = greedy_parity("lfm3", "Lfm3ForCausalLM")
    conv = model.get_submodule(next(n for n, _ in model.named_modules() if n.endswith("conv.conv")))
    return {"equal": equal, "channels": conv.weight.to_local().shape[0]}


def test_short_conv_parity_and_generation(ranks2, ranks4):
    assert_parity(ranks2.run(tiny_parity, "lfm3", "Lfm3ForCausalLM", timeout=120))
    assert_parity(ranks4.run(tiny_parity, "lfm3", "Lfm3ForCausalLM", timeout=120))
    for r in ranks2.run(short_conv_generate, timeout=120):
        assert r["equal"], r
        assert r["channels"] == 32, r  # 64 channels, half on each rank
