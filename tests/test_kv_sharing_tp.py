"""A derived plan is never refused at a tp above the KV heads: Gemma-3n's KV-sharing layers
(no K/V projection of their own: they read an earlier layer's keys and values) keep its
attention group from splitting by heads, and the one-KV-head fix-ups of the layers that do
have K/V projections went with the split (``num_key_value_groups`` = local query heads left on
a whole attention: 8 query heads against 2 KV heads, refused at tp=4 and tp=8). Attentions
that only read K/V handed in by their caller (Gemma-4's assistants) take the per-layer
fallback where transformers' plan cannot run. Each split is exact: logits and every gradient
match the unsharded model."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.parity import assert_parity, tiny_parity
from tests.tiny import full_config, tiny_config

#: a tiny Gemma-3n with 2 of its 4 layers reading the K/V of the 2 before them; the first
#: layer's MLP is sparse (a top-k of its gate: gathered); the per-layer input table shrunk
#: (262144 x 4 x 256 by default: 1 GB a copy)
SHARED = {
    "vocab_size_per_layer_input": 128,
    "hidden_size_per_layer_input": 16,
    "num_hidden_layers": 4,
    "num_kv_shared_layers": 2,
    "num_attention_heads": 8,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "intermediate_size": [128] * 4,
    "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
}


def _gemma3n(kv: int, device: str = "meta") -> torch.nn.Module:
    config = tiny_config("gemma3n_text", "Gemma3nForCausalLM")
    for k, v in {**SHARED, "num_key_value_heads": kv}.items():
        setattr(config, k, v)
    with torch.device(device):
        return transformers.Gemma3nForCausalLM(config).float().eval()


@pytest.mark.parametrize(("kv", "tp"), [(2, 4), (2, 8), (1, 4)])
def test_kv_sharing_plan_validates(kv, tp):
    """The attention group is gathered (weights still split), with no fix-up left on the
    attentions, and the plan validates; before, validation refused it ("use tp_size 1")."""
    from tpkit.plan import derive_plan, validate

    model = _gemma3n(kv)
    assert model.model.layers[2].self_attn.is_kv_shared_layer
    plan = derive_plan(model, "auto", tp)
    validate(model, plan, tp)
    for layer in (0, 2):
        attn = f"model.layers.{layer}.self_attn"
        assert plan.style_for(f"{attn}.q_proj")[0] == "colwise_gather_output"
        assert plan.style_for(f"{attn}.o_proj")[0] == "rowwise_split_input"
        assert not plan.fixups_for(attn), plan.fixups_for(attn)
    assert plan.style_for("model.layers.0.self_attn.k_proj")[0] == "colwise_gather_output"


def test_kv_replication_kept_without_kv_sharing():
    """Without KV-sharing layers the K/V heads are still replicated per rank (the faster
    layout), their fix-ups kept."""
    from tpkit.plan import derive_plan, validate

    config = tiny_config("gemma3n_text", "Gemma3nForCausalLM")
    config.num_attention_heads, config.num_key_value_heads = 8, 2
    with torch.device("meta"):
        model = transformers.Gemma3nForCausalLM(config)
    plan = derive_plan(model, "auto", 4)
    validate(model, plan, 4)
    assert plan.style_for("model.layers.0.self_attn.k_proj")[0] == "colwise_replicated_heads"
    assert plan.fixups_for("model.layers.0.self_attn")["set"] == {"num_key_value_groups": 2}


@pytest.mark.parametrize(
    ("model_type", "cls"),
    [
        ("gemma3n_text", "Gemma3nForCausalLM"),
        ("gemma4_assistant", "Gemma4AssistantForCausalLM"),
        ("gemma4_unified_assistant", "Gemma4UnifiedAssistantForCausalLM"),
    ],
)
def test_full_size_tp8_plan_validates(model_type, cls):
    """The default (full-size) configs on meta: the derived tp=8 plan validates (each was
    refused: 2 KV heads with KV-sharing layers; 4 KV heads read from the caller)."""
    from tpkit.plan import derive_plan, validate
    from tpkit.trace.analysis import Analysis

    with torch.device("meta"):
        model = getattr(transformers, cls)(full_config(model_type, cls)).float().eval()
    analysis = Analysis(model)  # validation reuses derivation's dry runs
    plan = derive_plan(model, "auto", 8, analysis=analysis)
    validate(model, plan, 8, analysis=analysis)
    assert plan.style_for("model.layers.0.self_attn.q_proj")[0] == "colwise_gather_output"


def test_parity_tp4_kv_sharing(ranks4):
    """tp=4 above 2 KV heads and MQA's 1, with KV-sharing layers: exact."""
    for kv in (2, 1):
        overrides = {**SHARED, "num_key_value_heads": kv}
        assert_parity(ranks4.run(tiny_parity, "gemma3n_text", "Gemma3nForCausalLM", overrides))
