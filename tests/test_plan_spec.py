"""Plan data, transformers plans and validation: pure analysis, no process group."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tests.models import build
from tpkit.plan import (
    Plan,
    derive_plan,
    explain,
    hf_plan,
    local_shape,
    matches,
    param_layout,
    spec,
    validate,
)


def test_wildcard_matches_one_component():
    assert matches("model.layers.*.mlp.up_proj", "model.layers.11.mlp.up_proj")
    assert not matches("model.layers.*.mlp.up_proj", "model.layers.1.2.mlp.up_proj")
    assert not matches("layers.*.mlp", "model.layers.0.mlp")


def test_later_entries_win_and_merge_overrides_entry_by_entry():
    base = Plan({"a.*": "colwise", "a.b": "rowwise"}, source="config")
    assert base.style_for("a.b") == ("rowwise", "a.b")
    merged = base.merged({"a.*": "replicate"})
    assert merged.style_for("a.c") == ("replicate", "a.*")
    assert merged.style_for("a.b") == ("replicate", "a.*")  # user entry now last
    assert merged.source("a.*") == "user" and merged.source("a.b") == "config"


def test_yaml_round_trip(tmp_path):
    plan = Plan({"x.*.q": "colwise", "lm_head": "gather_output"})
    path = tmp_path / "plan.yaml"
    path.write_text(plan.to_yaml())
    back = Plan.from_yaml(path)
    assert back.to_dict() == {"x.*.q": "colwise", "lm_head": "colwise_gather_output"}


def test_unknown_style_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown tensor-parallel style 'diagonal'"):
        Plan({"a": "diagonal"})


def test_param_layouts_follow_weight_conventions():
    lin = nn.Linear(4, 8)
    assert param_layout("colwise", "weight", 2, lin).dim == 0
    assert param_layout("colwise", "bias", 1, lin).dim == 0
    assert param_layout("rowwise", "weight", 2, lin).dim == 1
    assert not param_layout("rowwise", "bias", 1, lin).sharded
    packed = param_layout("packed_colwise", "gate_up_proj", 3)
    assert (packed.dim, packed.split_factor) == (1, 2)
    assert local_shape((101, 64), param_layout("vocab_parallel", "weight", 2), 2, 1) == (50, 64)


def test_hf_plan_adds_embedding_and_head():
    plan = hf_plan(build("llama"))
    assert plan["model.embed_tokens"] == "vocab_parallel"
    assert plan["lm_head"] == "colwise_gather_output"
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert plan.source("lm_head") == "class"


def test_user_dict_overrides_the_config_plan():
    model = build("llama")
    plan = derive_plan(model, {"model.layers.*.mlp.down_proj": "replicate"})
    assert plan.style_for("model.layers.0.mlp.down_proj")[0] == "replicate"
    assert plan.style_for("model.layers.0.mlp.up_proj")[0] == "colwise"


def test_explain_reports_shapes_and_collectives():
    model = build("llama")
    text = explain(derive_plan(model), model, tp_size=2)
    # repeated layers collapse into one row group
    assert "model.layers.*.self_attn.q_proj.weight (x2)" in text and "(64, 64) -> (32, 64)" in text
    assert "collectives per forward:" in text and "5 all_reduce" in text and "1 all_gather" in text


# ---- validation: every case is one ValueError naming module, numbers and the fix -------------
def test_heads_not_divisible():
    model = build("llama")  # 4 heads
    with pytest.raises(ValueError) as exc:
        validate(model, derive_plan(model), 3)
    msg = str(exc.value)
    assert "tp_size=3 does not divide num_attention_heads=4 of model.layers.0.self_attn" in msg
    assert "use tp_size 1, 2 or 4" in msg


def test_kv_heads_not_divisible():
    model = build("mistral")  # 2 KV heads
    with pytest.raises(
        ValueError, match="num_key_value_heads=2 of model.layers.0.self_attn; use tp_size 1 or 2"
    ):
        validate(model, derive_plan(model), 4)


def test_width_not_divisible_splits_in_chunks():
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8))
    validate(model, derive_plan(model, {"0": "colwise", "2": "rowwise"}), 4)  # 2, 2, 2, 0: exact
    packed = derive_plan(model, {"0": "packed_colwise", "2": "packed_rowwise"})
    validate(model, packed, 4)  # each part (3) in torch.chunk sizes 1, 1, 1, 0: exact


def test_world_size_not_divisible():
    from tpkit.parallel.dims import ParallelDims
    from tpkit.parallel.mesh import DistEnv

    with pytest.raises(ValueError, match="tp_size=3 does not divide the world size 4"):
        ParallelDims.resolve(3, None, env=DistEnv(0, 4, 0))


def test_device_map_conflicts():
    model = build("llama")
    model.hf_device_map = {"model": 0, "lm_head": "cpu"}
    with pytest.raises(ValueError, match="loaded with a device_map"):
        validate(model, derive_plan(model), 2)


def test_pattern_matching_nothing():
    model = build("llama")
    with pytest.raises(
        ValueError, match="plan pattern 'model.layers.*.mlp.fc9'.*matches no module"
    ):
        validate(model, derive_plan(model, {"model.layers.*.mlp.fc9": "colwise"}), 2)


def test_tied_weights_split_differently():
    model = build("llama_tied")
    plan = derive_plan(model, {"lm_head": "replicate"})
    with pytest.raises(ValueError, match="tied parameters would be split differently"):
        validate(model, plan, 2)


def test_validation_passes_for_a_good_plan():
    for name in ("llama", "qwen3", "qwen3_moe", "llama_tied"):
        model = build(name)
        validate(model, derive_plan(model), 2)  # no exception


def test_style_for_is_the_last_matching_entry_through_its_index():
    """`Plan.style_for` tries only entries with the name's component count and last component
    (or ``*``): the answer is still the last matching entry in plan order, after replacements
    (which keep their position) and merges (which move an entry to the end)."""
    plan = Plan(
        {
            "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.*": "replicate",
            "model.layers.0.mlp.up_proj": "rowwise",
        }
    )
    assert plan.style_for("model.layers.0.mlp.up_proj") == ("rowwise", "model.layers.0.mlp.up_proj")
    assert plan.style_for("model.layers.1.mlp.up_proj") == ("replicate", "model.layers.*.mlp.*")
    assert plan.style_for("model.layers.1.mlp") is None  # one component fewer
    assert plan.style_for("model.layers.1.mlp.up_proj.x") is None
    plan.set("model.layers.*.mlp.up_proj", "packed_colwise")  # replaced in place: still first
    assert plan.style_for("model.layers.1.mlp.up_proj")[0] == "replicate"
    moved = plan.merged({"model.layers.*.mlp.up_proj": "colwise"})  # now the last entry
    assert moved.style_for("model.layers.0.mlp.up_proj") == (
        "colwise",
        "model.layers.*.mlp.up_proj",
    )
    assert plan.style_for("model.layers.0.mlp.up_proj")[0] == "rowwise"  # the original unchanged


_PARTS = ("layers", "0", "1", "up", "*")


@settings(max_examples=300, deadline=None)
@given(
    patterns=st.lists(st.lists(st.sampled_from(_PARTS), min_size=1, max_size=3), max_size=12),
    data=st.data(),
)
def test_style_for_is_what_matching_every_entry_in_order_says(patterns, data):
    """The bit-set buckets answer as the plain definition: the last entry whose pattern
    `matches` the name (``*`` one component, anything else exactly). Names are drawn from the
    patterns themselves (each ``*`` filled), so most match several entries."""
    plan = Plan({".".join(p): "colwise" if i % 2 else "rowwise" for i, p in enumerate(patterns)})
    fill = st.sampled_from(_PARTS[:-1])
    names = [[data.draw(fill) if c == "*" else c for c in p] for p in patterns]
    names += data.draw(st.lists(st.lists(fill, min_size=1, max_size=3), max_size=4))
    for name in map(".".join, names):
        hits = [p for p in plan if matches(p, name)]
        expected = (plan[hits[-1]], hits[-1]) if hits else None
        assert plan.style_for(name) == expected, (list(plan), name)


def test_resolve_walks_modules_as_named_modules_does():
    """`Plan.resolve`'s own walk: pre-order, a shared module once under its first name, a
    None child skipped, parameters as ``named_parameters(recurse=False)`` gives them."""
    shared = nn.Linear(2, 2)
    model = nn.Sequential(
        nn.Sequential(shared, nn.ReLU()), nn.ModuleDict({"a": shared, "b": nn.Linear(2, 3)})
    )
    model[0].register_module("gone", None)
    model[1]["b"].register_parameter("bias", None)
    walked = spec._named_modules(model)
    assert [(n, id(m)) for n, m in walked] == [(n, id(m)) for n, m in model.named_modules()]
    plan = Plan({"*.*": "colwise", "*.*.weight": "replicate", "*.*.bias": "replicate"})
    names = [(t.name, t.kind) for t in plan.resolve(model)]
    params = [n for n, _ in model.named_parameters() if n.count(".") == 2]
    assert names == [
        ("0.0", "module"),
        ("0.0.weight", "param"),
        ("0.0.bias", "param"),
        ("0.1", "module"),
        ("1.b", "module"),
        ("1.b.weight", "param"),
    ]
    assert set(params) == {"0.0.weight", "0.0.bias", "1.b.weight"}


def test_style_for_answers_follow_every_change_of_the_entries():
    """`Plan.style_for` remembers its answers by name; each change of an entry forgets them."""
    plan = Plan({"a.*": "colwise"})
    assert plan.style_for("a.b") == ("colwise", "a.*")
    plan.set("a.b", "rowwise")  # a later, more specific entry
    assert plan.style_for("a.b") == ("rowwise", "a.b")
    plan.set("a.*", "replicate")  # replaced in place: a.b stays the later entry
    assert plan.style_for("a.c") == ("replicate", "a.*")
    assert plan.style_for("a.b") == ("rowwise", "a.b")
    merged = plan.merged({"a.*": "colwise"})  # re-inserted last: it wins now
    assert merged.style_for("a.b") == ("colwise", "a.*")
    assert plan.style_for("a.b") == ("rowwise", "a.b")
    assert plan.copy().style_for("x.y") is None


@settings(max_examples=200, deadline=None)
@given(
    patterns=st.lists(
        st.lists(
            st.sampled_from(("0", "1", "a", "b", "weight", "bias", "*")), min_size=1, max_size=4
        ),
        max_size=12,
    )
)
def test_unmatched_is_what_matching_every_name_says(patterns):
    """`Plan.unmatched` only matches a pattern against names of its length ending as it ends,
    and a pattern without ``*`` by lookup: the same answer as every name tried, a module shared
    under two names (its parameters named under both) and ``*`` anywhere included."""
    shared = nn.Linear(2, 2)
    model = nn.Sequential(
        nn.Sequential(shared, nn.ReLU()), nn.ModuleDict({"a": shared, "b": nn.Linear(2, 3)})
    )
    plan = Plan({".".join(p): "colwise" for p in patterns})
    names = [n for n, _ in model.named_modules() if n]
    names += [n for n, _ in model.named_parameters(remove_duplicate=False)]
    expected = [p for p in plan if not any(matches(p, n) for n in names)]
    assert plan.unmatched(model) == expected
    assert "1.a.weight" in names  # the shared weight under its second name
