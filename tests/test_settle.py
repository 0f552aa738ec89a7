"""Settling (`tpkit.settle.settle`): what a plan becomes at one tp size, decided in one place and
unit-tested here with the dry run handed in as a callable; and the typed plan data (`Group`,
`Source`) it works on. Pure: meta models, no process group."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as tf
import yaml

from tests.tiny import build as build_tiny
from tpkit.plan import Group, Plan, Source, derive_plan, infer_plan
from tpkit.settle.settle import fewest_replicated, settle, settle_heads, undivided_groups

ATTN = "model.layers.*.self_attn"
BART = "model.decoder.layers.*.self_attn"
RESHAPE = "RuntimeError: shape '[2, 9, 64]' is invalid for input of size 576"


def _meta_qwen3(heads: int, kv_heads: int) -> tf.Qwen3ForCausalLM:
    """A one-layer Qwen3 on the meta device with ``heads`` heads of 16."""
    config = tf.Qwen3Config(
        hidden_size=16 * heads,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=101,
    )
    with torch.device("meta"):
        return tf.Qwen3ForCausalLM(config)


@pytest.fixture(scope="module")
def bart():
    """A tiny BART decoder (attention owners with head fix-ups) and its inferred plan."""
    model = build_tiny("bart", "BartForCausalLM")
    return model, infer_plan(model)


@pytest.fixture(scope="module")
def qwen3_6heads():
    """Qwen3 with 6 heads: inference's tp=2 dry run passes; at tp=4 the heads do not divide."""
    model = _meta_qwen3(heads=6, kv_heads=6)
    return model, infer_plan(model)


def _attention(plan: Plan, attn: str = ATTN) -> Group:
    return next(g for g in plan.groups if f"{attn}.q_proj" in g.modules)


# -- typed plan data ---------------------------------------------------------------------------
def test_group_round_trips_through_plain_data_and_is_frozen():
    group = Group(("a.q", "a.o"), ("a",), {"output features of a.q": 48, "a.num_heads": 3})
    data = yaml.safe_load(yaml.safe_dump(group.to_dict()))
    assert data == {
        "modules": ["a.q", "a.o"],
        "owners": ["a"],
        "counts": {"output features of a.q": 48, "a.num_heads": 3},
    }
    assert Group.from_dict(data) == group
    assert Group.from_dict({"modules": ["x"]}) == Group(("x",))
    assert "a.num_heads" in repr(group)  # printable as it is
    with pytest.raises(dataclasses.FrozenInstanceError):
        group.modules = ()  # type: ignore[misc]
    counts = {"n": 4}
    assert Group(("x",), counts=counts).counts is not counts  # copied, never shared
    with pytest.raises(ValueError, match=r"owners: \[\.\.\.\].*got keys \['module'\]"):
        Group.from_dict({"module": ["x"]})


def test_source_is_typed_and_compares_as_its_name():
    plan = Plan({"a": "colwise"}, source="config")
    assert plan.source("a") is Source.CONFIG
    assert plan.source("a") == "config" and f"{plan.source('a')}" == "config"
    assert sorted([Source.USER, Source.CONFIG]) == ["config", "user"]
    with pytest.raises(ValueError, match=r"Unknown plan entry source 'infered'; use one of"):
        Plan({"a": "colwise"}, source="infered")


def test_inferred_groups_are_typed_and_copies_never_share_a_rewrite():
    """KV heads settled on a copy leave the original's group counts as they were (the groups
    were dicts shared by every copy and rewritten in place)."""
    model = _meta_qwen3(heads=4, kv_heads=2)
    plan = infer_plan(model)
    assert all(isinstance(g, Group) for g in plan.groups)
    k_width = f"output features of {ATTN}.k_proj"
    assert _attention(plan).counts[k_width] == 32
    copy = plan.copy()
    assert settle_heads(model, copy, 4) == [ATTN]
    assert k_width not in _attention(copy).counts
    assert _attention(plan).counts[k_width] == 32


# -- settling decisions ------------------------------------------------------------------------
def test_undivided_groups_name_the_count(bart):
    _, plan = bart
    found = {g.modules[-1]: why for g, why in undivided_groups(plan, 3)}
    assert found["model.decoder.layers.*.encoder_attn.out_proj"] == (
        f"tp_size=3 does not divide {BART}.num_heads = 4, {BART}.embed_dim = 64"
    )
    assert "model.decoder.layers.*.fc2" not in found  # 128 features: chunks split it exactly
    assert not undivided_groups(plan, 2) and not undivided_groups(plan, 4)


def test_group_tp_does_not_divide_is_gathered_where_the_dry_run_runs_it(bart):
    model, plan = bart
    asked = []

    def runs(trial: Plan, tp: int) -> None:
        asked.append(tp)

    plan = plan.copy()
    plan = settle(model, plan, 3, runs)
    assert asked and set(asked) == {3}
    assert plan[f"{BART}.q_proj"] == "colwise_gather_output"
    assert plan[f"{BART}.out_proj"] == "rowwise_split_input"
    assert "tp_size=3 does not divide" in plan.notes[f"{BART}.out_proj"]
    assert not plan.fixups_for("model.decoder.layers.0.self_attn")  # whole heads: no fix-ups
    assert plan["model.decoder.layers.*.fc2"] == "rowwise"  # still split
    assert not undivided_groups(plan, 3)


def test_group_tp_does_not_divide_is_whole_where_the_dry_run_fails_it(bart):
    model, plan = bart
    plan = plan.copy()
    plan = settle(model, plan, 3, lambda trial, tp: "RuntimeError: no")
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        assert plan[f"{BART}.{name}"] == "replicate"
        assert plan.notes[f"{BART}.{name}"] == (
            f"replicated: tp_size=3 does not divide {BART}.num_heads = 4, {BART}.embed_dim = 64"
        )
    assert not plan.fixups_for("model.decoder.layers.0.self_attn")
    assert plan["model.decoder.layers.*.fc2"] == "rowwise"


def test_head_count_read_off_the_config_settles_the_group(qwen3_6heads):
    """Qwen3's attention keeps no head counts of its own: its 6 heads come from the config, and
    its widths (96) divide tp=4, so the group is settled by the head count."""
    model, plan = qwen3_6heads
    assert plan[f"{ATTN}.q_proj"] == "colwise"
    assert not undivided_groups(plan, 4)
    whole = plan.copy()
    whole = settle(model, whole, 4, lambda trial, tp: "RuntimeError: no")
    assert whole[f"{ATTN}.q_proj"] == "replicate"
    assert whole.notes[f"{ATTN}.q_proj"] == (
        "replicated: tp_size=4 does not divide num_attention_heads=6 of model.layers.0.self_attn"
    )
    assert whole["model.layers.*.mlp.down_proj"] == "rowwise"


def test_derive_settles_through_the_real_dry_run(qwen3_6heads):
    """derive_plan hands settle the dry run: Qwen3's 6 heads at tp=4 run gathered."""
    model, _ = qwen3_6heads
    plan = derive_plan(model, "infer", 4)
    assert plan[f"{ATTN}.q_proj"] == "colwise_gather_output"
    assert plan[f"{ATTN}.o_proj"] == "rowwise_split_input"


def test_kv_heads_fewer_than_tp_are_kept_whole_per_rank():
    model = _meta_qwen3(heads=4, kv_heads=2)
    plan = infer_plan(model)
    at3 = plan.copy()
    plan = settle(model, plan, 4, lambda trial, tp: None)  # nothing to try: every trial "runs"
    for name in ("k_proj", "v_proj"):
        assert plan[f"{ATTN}.{name}"] == "colwise_replicated_heads"
        assert plan.args_for(f"{ATTN}.{name}") == {"heads": 2}
    assert plan[f"{ATTN}.q_proj"] == "colwise"  # the queries still split by heads
    # tp=3 is no multiple of the 2 KV heads and does not divide the 4 query heads: the group
    # is settled as a whole instead (gathered: the dry run says it runs)
    at3 = settle(model, at3, 3, lambda trial, tp: None)
    assert at3[f"{ATTN}.k_proj"] == "colwise_gather_output"


def test_merge_heads_repairs_a_reshape_that_does_not_fit(bart):
    """A reshape to a width read off the input: the same plan with the row layers' input widths
    as ``merge_heads`` fix-ups on the groups' owners, nothing left whole."""
    model, plan = bart

    def runs(trial: Plan, tp: int) -> str | None:
        merged = any("merge_heads" in fix for fix in trial.fixups.values())
        return None if merged else RESHAPE

    out = fewest_replicated(model, plan, runs)
    assert out.fixups[BART] == {"divide": ["num_heads", "embed_dim"], "merge_heads": [64]}
    assert out[f"{BART}.q_proj"] == "colwise" and out[f"{BART}.out_proj"] == "rowwise"
    assert "replicate" not in out.values()
    assert "merge_heads" not in plan.fixups[BART]  # the plan it was given is unchanged


def test_fewest_whole_then_gathered_where_that_runs(bart):
    """The code cannot run attention split (a global head count read where no fix-up reaches):
    only the attention group is taken out of the split, then gathered since that runs; when
    gathered does not run either it stays whole, noted with the dry run's error."""
    model, plan = bart

    def attention_whole(trial: Plan, tp: int) -> str | None:
        return None if trial[f"{BART}.q_proj"] != "colwise" else "ValueError: heads"

    out = fewest_replicated(model, plan, attention_whole)
    assert out[f"{BART}.q_proj"] == "colwise_gather_output"
    assert out["model.decoder.layers.*.fc1"] == "colwise"  # the MLP kept its split
    assert "ValueError: heads" in out.notes[f"{BART}.q_proj"]

    def only_whole(trial: Plan, tp: int) -> str | None:
        return None if trial[f"{BART}.q_proj"] == "replicate" else "ValueError: heads"

    out = fewest_replicated(model, plan, only_whole)
    assert out[f"{BART}.q_proj"] == "replicate"
    assert out.notes[f"{BART}.q_proj"] == (
        "replicated: a dry run of the split forward failed: ValueError: heads"
    )
    assert out["model.decoder.layers.*.fc2"] == "rowwise"


def test_dry_runs_after_a_data_dependent_branch_start_with_values(monkeypatch):
    """A MoE's plain fake forward meets its routing and learns nothing: its trace's did, so
    the analysis remembers it and every dry run starts with made-up values, asking the plain
    run only where those fail. Every answer is the one a fresh analysis gives."""
    from tpkit.settle import dryrun
    from tpkit.trace.analysis import Analysis

    model = build_tiny("dbrx", "DbrxForCausalLM").eval()  # its experts loop over routed ones
    plans = [
        Plan(),
        derive_plan(model, "auto", 2),
        Plan({"transformer.blocks.*.norm_attn_norm.attn.Wqkv": "colwise"}),  # fails: an error
        Plan({"transformer.blocks.*.norm_attn_norm.attn.out_proj": "rowwise"}),
    ]
    fresh = [dryrun.dry_run(Analysis(model), p, 2) for p in plans]
    assert fresh[0] is None and fresh[2] is not None
    calls = []
    once = dryrun._dry_run_once

    def counted(*args, **kwargs):
        calls.append(bool(kwargs.get("values")))
        return once(*args, **kwargs)

    monkeypatch.setattr(dryrun, "_dry_run_once", counted)
    shared = Analysis(model)
    assert [dryrun.dry_run(shared, p, 2) for p in plans] == fresh
    assert shared.needs_values
    assert calls[0] is True  # the trace met the routing already: values from the first
    # a plain run only where the run with values failed: once per failing plan
    assert calls.count(False) == sum(answer is not None for answer in fresh) == 2
