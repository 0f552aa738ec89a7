"""Widths tp does not divide: plain column / row pairs split into torch.chunk sizes (exact:
each rank's columns feed its own rows), checked on rank 0's and the last rank's shards; what
cannot split unevenly (packed parts, heads, CodeGen's 4 fixed qkv groups) is one clear
ValueError naming the module, the numbers and the tp sizes that work, before any collective."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.parity import assert_parity, tiny_parity
from tests.tiny import tiny_config

TOL = 1e-5


def _meta(model_type: str, cls: str, **fields):
    config = tiny_config(model_type, cls)
    for k, v in fields.items():
        setattr(config, k, v)
    with torch.device("meta"):
        return getattr(transformers, cls)(config)


@pytest.mark.parametrize("tp", [2, 4])
def test_uneven_mlp_is_split(tp):
    from tpkit.plan import derive_plan, validate

    model = _meta("llama", "LlamaForCausalLM", intermediate_size=37)
    plan = derive_plan(model, "auto", tp)
    validate(model, plan, tp)
    assert plan.style_for("model.layers.0.mlp.up_proj")[0] == "colwise"
    assert plan.style_for("model.layers.0.mlp.down_proj")[0] == "rowwise"


def test_inferred_uneven_mlp_is_not_settled_whole():
    from tpkit.plan import derive_plan

    plan = derive_plan(_meta("gpt2", "GPT2LMHeadModel", n_inner=37), "auto", 2)
    assert plan.style_for("transformer.h.0.mlp.c_fc")[0] == "colwise"
    assert plan.style_for("transformer.h.0.mlp.c_proj")[0] == "rowwise"


def test_codegen_fixed_qkv_groups_refused_at_tp3():
    from tpkit.plan import derive_plan, validate

    model = _meta("codegen", "CodeGenForCausalLM", n_head=12, n_embd=192)
    validate(model, derive_plan(model, "auto", 2), 2)  # 2 of the 4 groups per rank: fine
    plan = derive_plan(model, "config", 3)  # "auto" gathers the attention instead
    with pytest.raises(ValueError) as info:
        validate(model, plan, 3)
    msg = str(info.value)
    assert "tp_size=3: transformer.h.0.attn cannot run on its shards" in msg, msg
    assert "mp_num=4" in msg and "use tp_size 1, 2, 4" in msg, msg


def test_packed_uneven_experts_split_in_chunks():
    """A packed gate|up whose width tp does not divide is split per part in torch.chunk sizes
    (exact: act(gate) * up is per channel; parity in tests/test_experts_layout.py), by a user's
    plan and by inference alike, instead of refused or kept whole."""
    from tpkit.plan import derive_plan, validate

    model = _meta("qwen3_moe", "Qwen3MoeForCausalLM", moe_intermediate_size=37)
    experts = {  # as transformers' plans named them up to 5.24
        "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "model.layers.*.mlp.experts.down_proj": "rowwise",
        "model.layers.*.mlp.experts": "moe_tp_experts",
    }
    validate(model, derive_plan(model, experts, 2), 2)
    inferred = derive_plan(model, "infer", 2)
    validate(model, inferred, 2)
    assert inferred.style_for("model.layers.0.mlp.experts")[0] != "replicate", inferred.notes


def _assert_parity(results):
    assert_parity(results, TOL)
    for r in results:
        assert r["share"] > 0.4, r


def test_parity_tp2(ranks2):
    llama = {"intermediate_size": 37}
    _assert_parity(ranks2.run(tiny_parity, "llama", "LlamaForCausalLM", llama))
    _assert_parity(ranks2.run(tiny_parity, "gpt2", "GPT2LMHeadModel", {"n_inner": 37}))


def test_parity_tp4(ranks4):
    for inter in (37, 5):  # 10, 10, 10, 7 and 2, 2, 1, 0 columns per rank
        overrides = {"intermediate_size": inter}
        _assert_parity(ranks4.run(tiny_parity, "llama", "LlamaForCausalLM", overrides))


class _GatedPacked(torch.nn.Module):
    """A fused [gate; up] linear whose half-width (5) tp=2 does not divide, read back with
    chunk(2): each rank holds chunk r of gate and of up, so chunk(2) still pairs them."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = torch.nn.Linear(8, 10)
        self.down = torch.nn.Linear(5, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


def packed_uneven_parity() -> dict:
    import copy

    import tpkit
    from tests.parity import module_parity

    torch.manual_seed(0)
    ref = _GatedPacked()
    plan = {"gate_up": "packed_colwise", "down": "rowwise"}
    model = tpkit.tensor_parallel(copy.deepcopy(ref), plan=plan)
    x = torch.randn(2, 3, 8)
    rows = model.gate_up.weight.to_local().shape[0]  # 3 + 3 on rank 0, 2 + 2 on rank 1
    return {**module_parity(ref, model, x), "rows": rows}


def test_packed_uneven_linear_parity(ranks2):
    """packed_colwise is uneven-ok: a 2-D fused gate|up split per part in torch.chunk sizes
    (3 and 2 rows of each half) gives the unsharded output and gradients."""
    results = ranks2.run(packed_uneven_parity)
    assert [r["rows"] for r in results] == [6, 4], results
    for r in results:
        assert not r["missing"], r
        assert r["out"] <= 1e-5 and r["grad"] <= 1e-5 * max(1.0, r["scale"]), r
