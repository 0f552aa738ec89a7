"""The analysis as one value (`tpkit.trace.analysis.Analysis`): built once per derivation,
handed to every stage, every question answered once, nothing kept between analyses.

Pure: meta models, no ranks. Forwards are counted with a pre-hook on the model (each trace,
dry run or reference run is one forward of it)."""

from __future__ import annotations

import functools

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


# -- identical layers run once (`tpkit.trace.fold`) ----------------------------------------------
class _Block(nn.Module):
    def __init__(self, width: int, layer_idx: int, reads_index: bool = False):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.layer_idx, self.reads_index = layer_idx, reads_index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        if self.reads_index:  # odd layers scale, by a table read at the index: not alike
            h = h * (1.0, 2.0)[self.layer_idx % 2]
        return x + self.down(h)


class _Stack(nn.Module):
    def __init__(self, n: int = 6, width: int = 8, reads_index: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(_Block(width, i, reads_index) for i in range(n))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _layer_calls(model: nn.Module) -> list[str]:
    """Names of the layers whose own forward ran (their up projection was called)."""
    calls: list[str] = []
    for i, layer in enumerate(model.layers):
        layer.up.register_forward_pre_hook(lambda *_, i=i: calls.append(i))
    return calls


def _plans(model: nn.Module, example: tuple) -> tuple[Analysis, Plan, Plan]:
    folded = Analysis(model, example)
    plan = derive_plan(model, "auto", 2, analysis=folded)
    unfolded = Analysis(model, example)
    unfolded.fold = False
    return folded, plan, derive_plan(model, "auto", 2, analysis=unfolded)


def test_identical_layers_are_traced_and_dry_run_once():
    """Six alike layers: the trace and every dry run run the first one's forward only; the
    others stand on its call, and the plan is the unfolded one, entry for entry."""
    model = _Stack()
    example = (torch.randn(2, 3, 8),)
    analysis = Analysis(model, example)
    calls = _layer_calls(model)
    analysis.trace()
    assert calls == [0] and analysis.tally == {"run": 1, "stood": 5}
    folded, plan, unfolded = _plans(model, example)
    assert plan_key(plan) == plan_key(unfolded) and plan.notes == unfolded.notes
    assert folded.answers and folded.tally["stood"] == 5 * folded.tally["run"]
    assert plan["layers.*.up"] == "colwise" and plan["layers.*.down"] == "rowwise"


def test_layers_alike_but_for_a_partial_made_per_layer_fold():
    """transformers' GELUTanh (Gemma's activation) holds a ``functools.partial`` made per
    instance: equal partials (the same function and arguments) leave layers alike, so a
    26-layer Gemma-2 runs two layers' forwards, not 26; a partial with other arguments does not."""
    from transformers.activations import GELUTanh

    from tpkit.trace.fold import find_twins

    model = _Stack()
    for layer in model.layers:
        layer.act = GELUTanh()
    layers = list(model.layers.named_children())
    assert len(find_twins(layers).rep) == 5
    model.layers[3].act.act = functools.partial(nn.functional.gelu, approximate="none")
    assert "3" not in find_twins(layers).rep and len(find_twins(layers).rep) == 4


def test_a_layer_that_reads_its_index_is_its_own_kind():
    """A layer whose forward reads the value of ``layer_idx`` (indexes a table with it) breaks
    the fold the first time it does: from then on the index tells layers apart, every layer
    runs its own forward, and the plan is the unfolded one. (A comparison is no such read:
    `tests.test_fold_guards`.)"""
    model = _Stack(reads_index=True)
    example = (torch.randn(2, 3, 8),)
    analysis = Analysis(model, example)
    calls = _layer_calls(model)
    analysis.trace()
    assert "layer_idx" in analysis.distinguishing
    assert calls[-6:] == [0, 1, 2, 3, 4, 5]  # the second (unfolded) trace ran every layer
    assert not analysis.twins()
    _, plan, unfolded = _plans(model, example)
    assert plan_key(plan) == plan_key(unfolded) and plan.notes == unfolded.notes


def test_a_layer_called_otherwise_runs_its_own_forward():
    """The model's loop hands the third layer something else (a scale): it is not called as
    the first was, so it runs, and so does every later layer called like it; the rest stand."""

    class Scaled(_Block):
        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return x + scale * self.down(torch.relu(self.up(x)))

    class Loop(_Stack):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Scaled(8, i) for i in range(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i, layer in enumerate(self.layers):
                x = layer(x, scale=0.5 if i >= 2 else 1.0)
            return self.head(x)

    model = Loop()
    analysis = Analysis(model, (torch.randn(2, 3, 8),))
    calls = _layer_calls(model)
    analysis.trace()
    assert calls == [0, 2] and analysis.tally == {"run": 2, "stood": 4}


class _Indexed(_Block):
    """Handed its index by the model's loop (Zamba's ``layer(hidden, original, layer_idx)``)."""

    def forward(self, x: torch.Tensor, layer_idx: int, odd_scales: bool = False) -> torch.Tensor:
        h = torch.relu(self.up(x))
        if odd_scales:  # odd layers scale, by a table read at the index: not alike
            h = h * (1.0, 2.0)[layer_idx % 2]
        return x + self.down(h)


class _IndexLoop(_Stack):
    def __init__(self, odd_scales: bool = False, tied: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(_Indexed(8, i) for i in range(6))
        self.odd_scales = odd_scales
        if tied:  # every layer's down projection is one parameter (Zamba's shared transformer)
            for layer in self.layers:
                layer.down.weight = self.layers[0].down.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, i, odd_scales=self.odd_scales)
        return self.head(x)


@pytest.mark.parametrize("tied", [False, True])
def test_layers_handed_their_index_unread_fold(tied: bool):
    """An index handed as an argument differs per layer by design: unread, it is left out of
    the comparison and the layers fold (also where they tie a parameter, which the trace names
    after one layer: every twin reads it under that name); the plan is the unfolded one."""
    model = _IndexLoop(tied=tied)
    example = (torch.randn(2, 3, 8),)
    analysis = Analysis(model, example)
    calls = _layer_calls(model)
    analysis.trace()
    assert calls == [0] and analysis.tally == {"run": 1, "stood": 5} and not analysis.broke
    folded, plan, unfolded = _plans(model, example)
    assert plan_key(plan) == plan_key(unfolded) and plan.notes == unfolded.notes
    assert folded.tally["stood"] == 5 * folded.tally["run"]


def test_a_layer_that_reads_its_index_argument_is_its_own_kind():
    """A layer whose forward reads the index it is handed breaks the fold: from then on the
    argument is compared, every layer runs its own forward, and the plan is the unfolded one."""
    model = _IndexLoop(odd_scales=True)
    example = (torch.randn(2, 3, 8),)
    analysis = Analysis(model, example)
    calls = _layer_calls(model)
    analysis.trace()
    assert analysis.distinguishing == {"layers.0(layer_idx)"}  # this kind of layer only
    assert calls[-6:] == [0, 1, 2, 3, 4, 5]
    _, plan, unfolded = _plans(model, example)
    assert plan_key(plan) == plan_key(unfolded) and plan.notes == unfolded.notes
