"""The analysis as one value (`tpkit.trace.analysis.Analysis`): built once per derivation,
handed to every stage, every question answered once, nothing kept between analyses.

Pure: meta models, no ranks. Forwards are counted with a pre-hook on the model (each trace,
dry run or reference run is one forward of it)."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from tests.tiny import build
from tpkit.plan import Plan, derive_plan, validate
from tpkit.settle.dryrun import dry_run
from tpkit.settle.settle import settle
from tpkit.trace.analysis import Analysis, plan_key


def _counted(model: nn.Module) -> list[int]:
    """A list that grows by one on every forward of ``model``."""
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def _llama() -> nn.Module:
    return build("llama", "LlamaForCausalLM", device="meta")


def test_validation_with_the_derivations_analysis_runs_no_forward():
    """Every dry run validation asks was asked by the derivation already (the plan's content
    at the same tp): handed the same analysis, validating runs nothing."""
    model = _llama()
    analysis = Analysis(model)
    plan = derive_plan(model, "auto", 4, analysis=analysis)
    calls = _counted(model)
    validate(model, plan, 4, analysis=analysis)
    assert calls == []
    validate(model, plan, 4)  # a fresh analysis runs its own forwards
    assert calls


def test_a_dry_run_of_the_same_question_runs_once():
    """The same plan content at the same tp is one forward however often it is asked; notes
    never change a run; another tp or another entry is another question."""
    model = _llama()
    analysis = Analysis(model)
    plan = derive_plan(model, "auto", 2, analysis=analysis)
    calls = _counted(model)
    first = dry_run(analysis, plan, 3)
    ran = len(calls)
    assert ran >= 1
    noted = plan.copy()
    noted.notes["anything"] = "a note changes no run"
    assert dry_run(analysis, noted, 3) == first and dry_run(analysis, plan, 3) == first
    assert len(calls) == ran
    dry_run(analysis, plan, 4)
    assert len(calls) > ran
    ran = len(calls)
    other = plan.copy()
    other.set("lm_head", "replicate")
    assert plan_key(other) != plan_key(plan)
    dry_run(analysis, other, 3)
    assert len(calls) > ran


def test_the_trace_runs_once_per_analysis_and_a_failure_is_kept():
    model = _llama()
    analysis = Analysis(model)
    calls = _counted(model)
    assert analysis.trace() is analysis.trace()
    assert len(calls) == 1
    broken = Analysis(nn.Sequential(nn.Linear(4, 8), nn.Linear(5, 2)))
    with pytest.raises(RuntimeError):
        broken.trace()
    calls = _counted(broken.model)
    with pytest.raises(RuntimeError):
        broken.trace()
    assert broken.traced() is None and calls == []


def test_how_a_model_is_fed_lives_on_its_analysis_only():
    """GPT-2's classifier without a pad token refuses 3 rows: its analysis settles on one row;
    the next analysis of the same model starts afresh (nothing kept on the side) and settles
    the same way, to the same plan."""
    config = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=101)
    config.pad_token_id = None
    with torch.device("meta"):
        model = transformers.GPT2ForSequenceClassification(config)
    first, second = Analysis(model), Analysis(model)
    plan = derive_plan(model, "auto", 2, analysis=first)
    assert first.recipe.one_row and not second.recipe.one_row
    again = derive_plan(model, "auto", 2, analysis=second)
    assert second.recipe.one_row
    assert plan_key(again) == plan_key(plan) and again.notes == plan.notes


def test_settling_returns_a_new_plan_and_leaves_its_input_as_it_was():
    """Every pass is Plan -> Plan: settling KV heads fewer than tp rewrites a copy."""
    model = build("qwen3", "Qwen3ForCausalLM", device="meta")
    analysis = Analysis(model)
    plan = derive_plan(model, "infer", analysis=analysis)
    before = (plan_key(plan), dict(plan.notes))
    settled = settle(model, plan, 8, lambda trial, tp: dry_run(analysis, trial, tp))
    assert (plan_key(plan), dict(plan.notes)) == before
    assert plan_key(settled) != plan_key(plan)


def test_derive_plan_keeps_its_public_signature():
    model = _llama()
    assert plan_key(derive_plan(model, "auto", 2)) == plan_key(
        derive_plan(model, "auto", 2, analysis=Analysis(model))
    )
    user = derive_plan(model, {"lm_head": "replicate"}, 2)
    assert user["lm_head"] == "replicate"
    assert isinstance(Plan(), Plan)
