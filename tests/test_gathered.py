"""The gathered fallback (`tpkit.settle.gathered`): a column/row group the model's code cannot run
split keeps its weights split, its column outputs all-gathered and its row layers splitting
their whole input. BitNet (a norm over the split features), Mamba-2 (an unequal packed
in_proj: z | x | B | C | dt), Moshi (fc1's features indexed), GPTBigCode (multi-query c_attn
cut unevenly, found by a dry run): logits and every gradient match the unsharded model at
tp=2 and tp=4, generation gives the same tokens, and the full-size share reaches 90%."""

from __future__ import annotations

import pytest
import torch

from tests.parity import assert_parity, full_size_reports, greedy_parity, tiny_parity
from tests.tiny import build
from tpkit.plan import infer_plan

# class -> least share of >= 2-D parameter elements sharded at the default full size (before:
# BitNet 0.24, Mamba-2 0.04, Moshi 0.35, GPTBigCode 0.86, xLSTM 0.69, Zamba 0.02)
FULL_SIZE = {
    "BitNetForCausalLM": 0.99,
    "Mamba2ForCausalLM": 0.99,
    "MoshiForCausalLM": 0.99,
    "GPTBigCodeForCausalLM": 0.99,
    "xLSTMForCausalLM": 0.99,
}

PARITY = (
    ("bitnet", "BitNetForCausalLM"),
    ("mamba2", "Mamba2ForCausalLM"),
    ("moshi", "MoshiForCausalLM"),
    ("gpt_bigcode", "GPTBigCodeForCausalLM"),
)


@pytest.fixture(scope="module")
def full_size(request, ranks2) -> dict[str, dict]:
    """The full-size reports of the classes this run selected (all, or those ``-k`` kept),
    derived on the session's two ranks two at a time (`tests.parity.full_size_reports`: one
    process leaves the other core idle), in name order."""
    wanted = sorted(
        {
            item.callspec.params["class_name"]
            for item in request.session.items
            if item.module is request.module and item.originalname == "test_full_size_share"
        }
    )
    cases = [(c, {}) for c in wanted]
    return dict(zip(wanted, full_size_reports(ranks2, cases), strict=True))


@pytest.mark.parametrize("class_name", sorted(FULL_SIZE))
def test_full_size_share(full_size, class_name):
    r = full_size[class_name]
    assert "error" not in r, r.get("error")
    assert r["share"] >= FULL_SIZE[class_name], (r["share"], r["whole"])


def test_a_norm_over_split_features_gathers_its_pair():
    plan = infer_plan(build("bitnet", "BitNetForCausalLM", device="meta"))
    mlp = "model.layers.0.mlp"
    assert plan.style_for(f"{mlp}.gate_proj")[0] == "colwise_gather_output"
    assert plan.style_for(f"{mlp}.up_proj")[0] == "colwise_gather_output"
    assert plan.style_for(f"{mlp}.down_proj")[0] == "rowwise_split_input"
    assert plan.style_for(f"{mlp}.ffn_sub_norm") is None  # whole, on whole activations
    assert "ffn_sub_norm needs its whole output" in plan.notes["model.layers.*.mlp.down_proj"]
    assert not plan.fixups.get("model.layers.*.self_attn", {}).get("divide")


def test_a_failing_dry_run_gathers_the_group():
    """GPTBigCode's multi-query c_attn is split [q | k | v] unevenly by the code: the split
    c_attn fails a dry run; gathered it runs, and the MLP stays split as before."""
    plan = infer_plan(build("gpt_bigcode", "GPTBigCodeForCausalLM", device="meta"))
    assert plan.style_for("transformer.h.0.attn.c_attn")[0] == "colwise_gather_output"
    assert plan.style_for("transformer.h.0.attn.c_proj")[0] == "rowwise_split_input"
    assert plan.style_for("transformer.h.0.mlp.c_fc")[0] == "colwise"
    assert plan.style_for("transformer.h.0.mlp.c_proj")[0] == "rowwise"
    assert "gathered" in plan.notes["transformer.h.*.attn.c_attn"]


def test_parity_tp2(ranks2):
    for model_type, cls in PARITY:
        results = ranks2.run(tiny_parity, model_type, cls, timeout=180)
        assert_parity(results)
        assert results[0]["share"] > 0.9, (model_type, results[0])


def test_uneven_widths(ranks2):
    """An intermediate width tp does not divide: gathered in torch.chunk sizes, exact."""
    results = ranks2.run(tiny_parity, "bitnet", "BitNetForCausalLM", {"intermediate_size": 37})
    assert_parity(results)


def test_parity_tp4(ranks4):
    # tp=4 chunks: Mamba-2's in_proj and BitNet's MLP widths split unevenly where 4 does not
    # divide them; the gather puts them back in order
    for model_type, cls in PARITY[:2]:
        assert_parity(ranks4.run(tiny_parity, model_type, cls, timeout=180))


# head counts tp=4 does not divide, where inference's tp=2 dry run passed: gathered at tp=4
HEADS_TP4 = (
    ("qwen3", "Qwen3ForCausalLM", {"num_attention_heads": 6, "num_key_value_heads": 6}),
    ("qwen3", "Qwen3ForCausalLM", {"num_attention_heads": 6, "num_key_value_heads": 2}),
    ("gpt_neo", "GPTNeoForCausalLM", {"num_heads": 6, "hidden_size": 48}),
)


def test_head_counts_tp_does_not_divide_are_gathered():
    """6 heads at tp=4 passed inference's tp=2 dry run; at tp=4 the attention keeps its weights
    split, gathered, with the reason noted (before: a refusal, 'use tp_size 1, 2, 3 or 6')."""
    from tests.tiny import tiny_config
    from tpkit.plan import derive_plan, validate

    for model_type, cls, overrides in HEADS_TP4:
        import transformers

        config = tiny_config(model_type, cls)
        for k, v in overrides.items():
            setattr(config, k, v)
        with torch.device("meta"):
            model = getattr(transformers, cls)(config)
        plan = derive_plan(model, "infer", 4)
        validate(model, plan, 4)
        attn = next(n for n, _ in model.named_modules() if n.endswith("q_proj"))
        assert plan.style_for(attn)[0] == "colwise_gather_output", (cls, overrides)
        assert "does not divide" in plan.notes[plan.style_for(attn)[1]], plan.notes


def test_auto_leaves_a_transformers_plan_whose_heads_tp_does_not_divide():
    """Qwen2.5-0.5B's 14 heads at tp=4: transformers' plan cannot split them, and its entries
    are never rewritten, so "auto" takes the inferred plan (attention gathered, MLP split) and
    says why; at tp=2, where 14 divides, transformers' plan stays."""
    from tests.tiny import on_meta
    from tpkit.plan import derive_plan, validate

    model = on_meta(
        "Qwen2ForCausalLM",
        hidden_size=14 * 8,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=256,
    )
    plan = derive_plan(model, "auto", 4)
    validate(model, plan, 4)
    q, up = "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"
    assert plan.style_for(q)[0] == "colwise_gather_output"
    assert plan.style_for(up)[0] == "colwise" and plan.source(plan.style_for(up)[1]) == "inferred"
    assert "num_attention_heads=14" in plan.notes["Qwen2ForCausalLM"]
    at2 = derive_plan(model, "auto", 2)
    assert at2.style_for(q)[0] == "colwise" and at2.source(at2.style_for(q)[1]) == "config"


def test_head_counts_tp_does_not_divide_parity_tp4(ranks4):
    cases = [(*case, "infer") for case in HEADS_TP4] + [(*HEADS_TP4[0], "auto")]
    for model_type, cls, overrides, plan in cases:
        results = ranks4.run(tiny_parity, model_type, cls, overrides, plan=plan, timeout=180)
        assert_parity(results)


def gathered_generate(model_type: str, class_name: str) -> dict:
    """Greedy generation at tp vs unsharded (the recurrent state cached whole on every rank),
    and the local width of the first gathered layer's weight."""
    from torch.distributed.tensor import DTensor

    ref, model, equal = greedy_parity(model_type, class_name)
    plan = model._tpkit.plan
    name = next(
        n
        for n, _ in model.named_modules()
        if n
        and (hit := plan.style_for(n))
        and hit[0] == "colwise_gather_output"
        and "lm_head" not in n
    )
    w = model.get_submodule(name).weight
    local = w.to_local().shape[0] if isinstance(w, DTensor) else w.shape[0]
    return {"equal": equal, "local": local, "full": ref.get_submodule(name).weight.shape[0]}


def test_generation_matches(ranks2):
    for model_type, cls in (("mamba2", "Mamba2ForCausalLM"), ("bitnet", "BitNetForCausalLM")):
        for r in ranks2.run(gathered_generate, model_type, cls, timeout=180):
            assert r["equal"], (model_type, r)
            assert r["local"] < r["full"], (model_type, r)  # the weight is split
