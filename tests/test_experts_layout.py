"""Experts once left whole for a layout reason, split by a general mechanism: fused experts
whose intermediate width tp does not divide (DeepSeek-V2's 1407), split into torch.chunk sizes
per packed part of gate|up and the same chunks of down's input; parity of logits and every
gradient on tiny DeepSeek-V2 and Mixtral with intermediate 37 at tp=2 and tp=3, and the plan
on meta (no ranks)."""

from __future__ import annotations

import pytest
import torch

from tests.harness import RankGroup
from tests.parity import assert_parity, full_size_share, tiny_parity

# model_type, class, overrides: each expert 37 wide (odd, prime: no tp > 1 divides it); torch's
# CPU grouped_mm refuses its 148-byte rows even unsharded, so the batched and eager kernels
UNEVEN = [
    (
        "deepseek_v2",
        "DeepseekV2ForCausalLM",
        {"moe_intermediate_size": 37, "_experts_implementation": "batched_mm"},
    ),
    (
        "mixtral",
        "MixtralForCausalLM",
        {"intermediate_size": 37, "_experts_implementation": "eager"},
    ),
]


def _tiny_on_meta(model_type: str, class_name: str, overrides: dict):
    import transformers

    from tests.tiny import tiny_config

    config = tiny_config(model_type, class_name)
    for k, v in overrides.items():
        setattr(config, k, v)
    with torch.device("meta"):
        return getattr(transformers, class_name)(config).float().eval()


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize(("model_type", "class_name", "overrides"), UNEVEN)
def test_uneven_fused_experts_split_in_chunks(model_type, class_name, overrides, tp):
    from tpkit.plan import derive_plan, param_layouts, validate
    from tpkit.plan.layout import local_shape

    model = _tiny_on_meta(model_type, class_name, overrides)
    plan = derive_plan(model, "auto", tp)
    validate(model, plan, tp)
    layouts = param_layouts(model, plan)
    experts = "model.layers.0.mlp.experts"
    style, layout, _ = layouts[f"{experts}.gate_up_proj"]
    assert (style, layout.split_factor) == ("packed_colwise", 2), (style, layout, plan.notes)
    assert layouts[f"{experts}.down_proj"][0] == "rowwise", plan.notes
    gate_up = model.get_submodule(experts).gate_up_proj
    e, _, h = gate_up.shape
    chunks = [-(-37 // tp)] * (tp - 1) + [37 - (tp - 1) * -(-37 // tp)]  # 19 18 / 13 13 11
    for rank, n in enumerate(chunks):  # rank r: chunk r of gate and chunk r of up
        assert local_shape(tuple(gate_up.shape), layout, tp, rank) == (e, 2 * n, h)


@pytest.mark.parametrize(("model_type", "class_name", "overrides"), UNEVEN)
def test_uneven_fused_experts_parity_tp2(ranks2, model_type, class_name, overrides):
    results = ranks2.run(tiny_parity, model_type, class_name, overrides, timeout=180)
    assert_parity(results)
    assert results[0]["share"] > 0.5, results[0]  # the experts are most of the weights


@pytest.fixture(scope="module")
def ranks3():
    group = RankGroup(3)
    yield group
    group.close()


@pytest.mark.parametrize(("model_type", "class_name", "overrides"), UNEVEN)
def test_uneven_fused_experts_parity_tp3(ranks3, model_type, class_name, overrides):
    results = ranks3.run(tiny_parity, model_type, class_name, overrides, timeout=180)
    assert_parity(results)
    assert results[0]["share"] > 0.4, results[0]  # 4 heads at tp=3: attention whole


def test_deepseek_v2_full_size_shards_its_experts():
    """DeepSeek-V2's default config (its experts 1407 wide; 6 routed per token, which the
    default leaves unset and the router needs): 0.08 of >=2-D elements sharded at tp=2 before
    (every expert whole)."""
    share, whole = full_size_share("DeepseekV2ForCausalLM", 2, num_experts_per_tok=6)
    assert share >= 0.95, (share, whole)
