"""KV heads fewer than tp: each KV head replicated over tp / kv ranks (vLLM's layout), query
heads still split; logits and every gradient (the replicated K/V weights' too, summed over the
ranks sharing a head) match the unsharded model at tp=2 and tp=4. Bad layouts are one clear
ValueError before any collective."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.parity import assert_parity, full_size_share, tiny_parity
from tests.tiny import tiny_config


def _tiny_meta(kv: int, model_type="llama", cls="LlamaForCausalLM"):
    config = tiny_config(model_type, cls)
    config.num_key_value_heads = kv
    with torch.device("meta"):
        return getattr(transformers, cls)(config)


@pytest.mark.parametrize(("kv", "tp"), [(2, 4), (1, 2), (1, 4)])
def test_plan_replicates_kv_heads(kv, tp):
    from tpkit.plan import derive_plan, validate

    model = _tiny_meta(kv)
    plan = derive_plan(model, "auto", tp)
    validate(model, plan, tp)
    for proj in ("k_proj", "v_proj"):
        style, pattern = plan.style_for(f"model.layers.0.self_attn.{proj}")
        assert style == "colwise_replicated_heads" and plan.args_for(pattern) == {"heads": kv}
    assert plan.style_for("model.layers.0.self_attn.q_proj")[0] == "colwise"
    assert plan.fixups_for("model.layers.0.self_attn")["set"] == {"num_key_value_groups": 4 // tp}


def test_kv_heads_tp_divides_stay_plain_colwise():
    from tpkit.plan import derive_plan

    plan = derive_plan(_tiny_meta(2), "auto", 2)
    assert plan.style_for("model.layers.0.self_attn.k_proj")[0] == "colwise"


def test_bad_replicated_heads_refused_with_the_numbers():
    from tpkit.plan import derive_plan, validate

    model = _tiny_meta(2)
    user = {"model.layers.*.self_attn.k_proj": "colwise_replicated_heads"}
    plan = derive_plan(model, user, 3)
    plan.args["model.layers.*.self_attn.k_proj"] = {"heads": 2}
    with pytest.raises(ValueError, match=r"k_proj is colwise_replicated_heads with 2 KV heads"):
        validate(model, plan, 3)


def test_full_size_mqa_share():
    share, whole = full_size_share("LlamaForCausalLM", 2, num_key_value_heads=1)
    assert share >= 0.97, (share, whole)  # only the whole K/V projections stay replicated


def test_parity_tp2(ranks2):
    for model_type, cls in (("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")):
        assert_parity(ranks2.run(tiny_parity, model_type, cls, {"num_key_value_heads": 1}))


def test_parity_tp4(ranks4):
    for kv in (2, 1):
        overrides = {"num_key_value_heads": kv}
        assert_parity(ranks4.run(tiny_parity, "llama", "LlamaForCausalLM", overrides))
    overrides = {"num_key_value_heads": 2}  # per-head k_norm on the replicated heads
    assert_parity(ranks4.run(tiny_parity, "qwen3", "Qwen3ForCausalLM", overrides))


def test_an_mlp_as_wide_as_the_kv_heads_is_not_taken_for_them():
    """An MLP whose width equals kv x head_dim (8 x 16 = 128) and whose down projection is as
    wide as the queries (32 x 16 = 512) is no attention: at tp=16 (8 KV heads) only the real
    K/V projections keep their heads whole; before, up_proj did too and the MLP failed its
    dry run."""
    from tests.tiny import on_meta
    from tpkit.plan import derive_plan, validate

    model = on_meta(
        "Qwen2ForCausalLM",
        hidden_size=512,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=256,
    )
    plan = derive_plan(model, "auto", 16)
    validate(model, plan, 16)
    layer = "model.layers.0"
    assert plan.style_for(f"{layer}.self_attn.k_proj")[0] == "colwise_replicated_heads"
    assert plan.style_for(f"{layer}.mlp.up_proj")[0] == "colwise"
    assert plan.style_for(f"{layer}.mlp.gate_proj")[0] == "colwise"
