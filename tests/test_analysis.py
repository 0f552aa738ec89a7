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


def test_layers_holding_their_own_copies_of_one_config_fold():
    """A heterogeneous transformers model hands each layer its own copy of the config
    (``config.per_layer_config[i]``): copies that say the same leave layers alike (the trace
    runs one, the plan is the unfolded one); a copy with another value (a layer's override)
    makes that layer its own kind."""
    import copy

    from tpkit.trace.fold import find_twins

    model = _Stack()
    config = transformers.LlamaConfig(hidden_size=8, num_attention_heads=2)
    for layer in model.layers:
        layer.config = copy.copy(config)  # what transformers' per-layer view returns
    layers = list(model.layers.named_children())
    assert len(find_twins(layers).rep) == 5
    example = (torch.randn(2, 3, 8),)
    analysis, calls = Analysis(model, example), _layer_calls(model)
    analysis.trace()
    assert calls == [0] and analysis.tally == {"run": 1, "stood": 5}
    _, plan, unfolded = _plans(model, example)
    assert plan_key(plan) == plan_key(unfolded) and plan.notes == unfolded.notes
    model.layers[3].config.rms_norm_eps = 1e-3
    assert "3" not in find_twins(layers).rep and len(find_twins(layers).rep) == 4


def test_the_trace_records_the_reshapes_the_dry_runs_reference_would(monkeypatch):
    """The dry run compares each reshape of a split run with the unsplit model's same one
    (`tpkit.settle.dryrun`). A plain fake trace runs that unsplit forward already: it records
    the reshapes, the dry run reads them instead of running the reference again, and they
    are what the reference run records (folded or not)."""
    from tpkit.settle import dryrun

    once = dryrun._dry_run_once
    runs = _reference_runs(monkeypatch)
    for fold in (True, False):
        model = _llama()  # its attention views its projections as heads
        analysis = Analysis(model)
        analysis.fold = fold
        trace = analysis.trace()
        assert any(where.endswith("self_attn") for where in trace.reshapes)
        twins = analysis.twins()
        assert analysis.references == {(False, tuple(twins.rep.items())): trace.reshapes}
        plan = derive_plan(model, "infer", 2)  # its own analysis
        runs.clear()
        assert dry_run(analysis, plan, 2) is None
        assert runs and not any(runs)  # split runs only: no reference run
        record: dict = {}
        error = once(analysis, Plan(), 1, real=False, record=record, twins=twins)
        assert error is None and record == trace.reshapes


def test_a_fake_mode_keeps_the_stack_it_was_made_on_and_reads_its_lines_on_demand():
    """`tpkit.compat.fake_mode`: torch's fake mode records where it was made, as ever, without
    reading every source file on the stack when it is made (the first analysis in a process
    paid for that); a line is read when asked for, and torch's module is put back as it was."""
    import importlib
    import traceback

    from tpkit.compat import fake_mode

    fake_tensor = importlib.import_module("torch._subclasses.fake_tensor")

    mode = fake_mode()
    here = traceback.extract_stack()
    assert fake_tensor.traceback is traceback
    stack = mode._stack_trace
    assert [f.name for f in stack[-3:]] == [here[-1].name, "fake_mode", "__init__"]
    assert [(f.filename, f.name) for f in stack[:-3]] == [(f.filename, f.name) for f in here[:-1]]
    assert stack[-1]._line is None  # not read yet
    assert "extract_stack()" in stack[-1].line and "extract_stack()" in mode.stack


def _reference_runs(monkeypatch) -> list[bool]:
    """Each dry-run forward from now on: whether it was an unsplit reference run."""
    from tpkit.settle import dryrun

    runs: list[bool] = []
    once = dryrun._dry_run_once
    monkeypatch.setattr(
        dryrun,
        "_dry_run_once",
        lambda *a, **k: runs.append(k.get("record") is not None) or once(*a, **k),
    )
    return runs


def _fresh_reference(analysis: Analysis, values: bool) -> dict:
    """The dry run's unsplit reference run, made afresh with the analysis's twins."""
    from tpkit.settle import dryrun

    record: dict = {}
    twins = analysis.twins()
    error = dryrun._dry_run_once(
        analysis, Plan(), 1, real=False, values=values, record=record, twins=twins
    )
    assert error is None
    return record


def test_the_trace_leaves_out_the_calls_a_dry_runs_fold_would_stand(monkeypatch):
    """Tiny GPT-2's second layer is handed other tags than its first: the trace runs both,
    a dry run's fold (shapes only) stands the second on the first. The trace's record leaves
    out what that second call recorded, and is then the reference the dry run would make.
    A layer handed another shape runs in both folds, and its reshapes stay."""
    runs = _reference_runs(monkeypatch)
    model = build("gpt2", "GPT2LMHeadModel", device="meta")
    analysis = Analysis(model)
    trace = analysis.trace()
    assert analysis.tally == {"run": 2}  # both layers ran in the trace
    assert any(w.startswith("transformer.h.0.") for w in trace.reshapes)
    assert not any(w.startswith("transformer.h.1.") for w in trace.reshapes)
    assert trace.reshapes == _fresh_reference(analysis, values=False)
    plan = derive_plan(model, "infer", 2)  # its own analysis
    runs.clear()
    assert dry_run(analysis, plan, 2) is None
    assert runs and not any(runs)  # split runs only (rank 0's, the last's): no reference

    model = _Stack()
    analysis = Analysis(model, (torch.randn(2, 3, 8),))
    original = model.forward

    def forward(x):  # the third layer handed a tensor of another shape: called otherwise
        for i, layer in enumerate(model.layers):
            x = layer(x if i != 2 else x[:1])
        return model.head(x)

    model.forward = forward
    try:
        trace = analysis.trace()
        assert analysis.tally["run"] == 2
        assert trace.reshapes == _fresh_reference(analysis, values=False)
    finally:
        model.forward = original


_FILLED: set = set()  # the cache `_Caching` fills on its first forward in a process


class _Caching(_Stack):
    """A stack whose first forward in the process fills a cache, with one reshape more than
    any later forward records (DINOv3's patch grid, under ``functools.lru_cache``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape not in _FILLED:
            _FILLED.add(x.shape)
            x = x.reshape(-1, x.shape[-1])
        return super().forward(x.view(-1, 3, x.shape[-1]))


def test_a_dry_run_that_records_other_reshapes_than_the_trace_runs_its_own_reference(
    monkeypatch,
):
    """The trace is the model's first forward: where a split run records another number of
    reshapes in a module than the trace did, the trace's record is not taken for its
    reference; the reference is run, and the trace's record dropped."""
    _FILLED.clear()
    runs = _reference_runs(monkeypatch)
    model = _Caching()
    analysis = Analysis(model, (torch.randn(2, 3, 8),))
    trace = analysis.trace()
    assert len(trace.reshapes[""]) == 2 and analysis.borrowed  # one more than later runs
    plan = derive_plan(model, "infer", 2, analysis=Analysis(model, (torch.randn(2, 3, 8),)))
    runs.clear()
    assert dry_run(analysis, plan, 2) is None
    assert runs == [False, True]  # the split run, then the reference run it compares with
    assert not analysis.borrowed and len(next(iter(analysis.references.values()))[""]) == 1


class _Routed(nn.Module):
    """A stack whose layers read a value (how many rows to route), as a MoE's code does:
    a plain fake forward stops there; one with shadow values runs."""

    def __init__(self, n: int = 4, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(32, width)
        self.layers = nn.ModuleList(_RoutedBlock(width) for _ in range(n))
        self.head = nn.Linear(width, 32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _RoutedBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = int((x.sum(-1) == x.sum(-1)).sum())  # a value: data-dependent on fake tensors
        h = torch.relu(self.up(x)).view(rows, 4, -1)  # heads of the up projection
        return x + self.down(h.view(x.shape[:-1] + (-1,)))


def test_a_trace_with_shadow_values_stands_for_the_dry_runs_reference_and_first_try(
    monkeypatch,
):
    """A model whose code reads a value traces with shadow values (`tpkit.trace.shadow`).
    Its dry runs then start with values (no plain try that learns nothing), and the trace's
    record is their reference: equal to the reference run with values, which never runs."""
    from tpkit.settle import dryrun

    tries: list[bool] = []  # each dry-run forward: whether it had values
    once = dryrun._dry_run_once
    monkeypatch.setattr(
        dryrun,
        "_dry_run_once",
        lambda *a, **k: (
            tries.append((k.get("values"), k.get("record") is not None)) or once(*a, **k)
        ),
    )
    model = _Routed()
    analysis = Analysis(model, (torch.randint(0, 32, (2, 3)),))
    trace = analysis.trace()
    assert trace.values and analysis.needs_values
    assert any(w.endswith("layers.0") for w in trace.reshapes)
    assert analysis.references == {(True, tuple(analysis.twins().rep.items())): trace.reshapes}
    plan = derive_plan(model, "infer", 2)  # its own analysis
    tries.clear()
    assert dry_run(analysis, plan, 2) is None
    assert tries == [(True, False)]  # with values at once, and no reference run
    assert trace.reshapes == _fresh_reference(analysis, values=True)


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
    assert analysis.distinguishing == {"layers.0:layer_idx"}  # the kind that read it
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


class _Gain(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class _Carrying(_Block):
    """A block whose bare parameter reaches the stream (an MoE's expert weights do): every
    later stream carries it; with ``meets`` a column output meets the stream broadcast over its
    split (`Node.partial_params`)."""

    def __init__(self, width: int, layer_idx: int, meets: bool):
        super().__init__(width, layer_idx)
        self.gain, self.meets = _Gain(width), meets

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        if self.meets:
            h = h * x[..., :1]
        return x + self.gain(self.down(h))


@pytest.mark.parametrize("meets", [False, True])
def test_layers_whose_stream_carries_bare_parameters_fold(meets: bool):
    """Each layer's stream carries the bare parameters of every layer before (a longer list
    each time): they go by one name per layer while it runs, so the layers after the second
    stand on its call (the first is given a stream that carries none), and the trace's
    records (the bare parameters each module is handed, those each column output meets) and
    the plan are the unfolded ones."""
    model = _Stack()
    model.layers = nn.ModuleList(_Carrying(8, i, meets) for i in range(6))
    example = (torch.randn(2, 3, 8),)
    analysis = Analysis(model, example)
    calls = _layer_calls(model)
    folded = analysis.trace()
    assert calls == [0, 1] and analysis.tally == {"run": 2, "stood": 4} and not analysis.broke
    plain = Analysis(model, example)
    plain.fold = False
    unfolded = plain.trace()
    assert folded.nodes == unfolded.nodes and folded.input_params == unfolded.input_params
    earlier = {f"layers.{i}.gain.weight" for i in range(4)}
    assert folded.input_params["layers.4.up"]["arg:0"] == earlier
    assert folded.nodes["layers.4.up"].partial_params == (earlier if meets else set())
    _, plan, plan_unfolded = _plans(model, example)
    assert plan_key(plan) == plan_key(plan_unfolded) and plan.notes == plan_unfolded.notes
    if not meets:
        assert plan["layers.*.up"] == "colwise" and plan["layers.*.down"] == "rowwise"


class _Remembering(_Carrying):
    """A block also handed the stack of earlier streams (Inkling-2's block states: one
    tensor, grown every third layer, the same object for the layers in between), which
    carries the bare parameters of every layer before."""

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x + memory.mean(-2)))
        return x + self.gain(self.down(h))


class _Memory(_Stack):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Remembering(8, i, False) for i in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = x.unsqueeze(-2)
        for i, layer in enumerate(self.layers):
            if i == 3:
                memory = torch.cat([memory, x.unsqueeze(-2)], dim=-2)
            x = layer(x, memory)
        return self.head(x)


def test_layers_handed_one_tensor_that_carries_bare_parameters_fold():
    """Layers 3 to 5 are handed the same memory, which carries the bare parameters of the
    layers before 3: it goes by one name per layer while it runs, as the stream does, so 4
    and 5 stand on 3's call (the memory grew at 3: another shape than 0 to 2 were given);
    the trace's records and the plan are the unfolded ones."""
    model = _Memory()
    example = (torch.randn(2, 3, 8),)
    analysis = Analysis(model, example)
    calls = _layer_calls(model)
    folded = analysis.trace()
    assert calls == [0, 1, 3] and analysis.tally == {"run": 3, "stood": 3} and not analysis.broke
    plain = Analysis(model, example)
    plain.fold = False
    unfolded = plain.trace()
    assert folded.nodes == unfolded.nodes and folded.input_params == unfolded.input_params
    assert folded.module_inputs == unfolded.module_inputs
    earlier = {f"layers.{i}.gain.weight" for i in range(3)}
    assert folded.input_params["layers.5"]["arg:1"] == earlier
    _, plan, plan_unfolded = _plans(model, example)
    assert plan_key(plan) == plan_key(plan_unfolded) and plan.notes == plan_unfolded.notes


class _Noting(_Block):
    """Keeps its input's dtype in an attribute (Switch Transformers' router does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.input_dtype = x.dtype
        return super().forward(x)


def test_a_layer_that_keeps_a_plain_value_folds_and_its_twins_keep_it_too():
    """A forward that writes a plain value into its own attribute folds: each twin gets the
    same write (as its own forward would have made it), and the plan is the unfolded one. A
    tensor written there still breaks the fold."""
    model = _Stack()
    model.layers = nn.ModuleList(_Noting(8, i) for i in range(6))
    example = (torch.randn(2, 3, 8),)
    analysis = Analysis(model, example)
    calls = _layer_calls(model)
    analysis.trace()
    assert calls == [0] and analysis.tally == {"run": 1, "stood": 5} and not analysis.broke
    # the twins got the write inside the run; after it, planning leaves the model as it was
    # (`tpkit.trace.kept_state`)
    assert not any(hasattr(layer, "input_dtype") for layer in model.layers)
    folded, plan, unfolded = _plans(model, example)
    assert plan_key(plan) == plan_key(unfolded) and plan.notes == unfolded.notes

    class Caching(_Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.last = x
            return super().forward(x)

    model = _Stack()
    model.layers = nn.ModuleList(Caching(8, i) for i in range(6))
    analysis = Analysis(model, example)
    analysis.trace()
    assert "changes its own attributes" in analysis.broke and "trace" in analysis.unfolded


class _Biased(_Block):
    """Adds a table it is handed (T5's position bias) or, the first layer, makes it."""

    def __init__(self, width: int, layer_idx: int):
        super().__init__(width, layer_idx)
        self.table = nn.Embedding(4, width) if layer_idx == 0 else None

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None):
        if self.table is not None:
            bias = self.table(torch.zeros(x.shape[:-1], dtype=torch.long, device=x.device))
        return super().forward(x + bias), bias


class _BiasStack(_Stack):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Biased(8, i) for i in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None
        for layer in self.layers:
            x, bias = layer(x, bias)
        return self.head(x)


def test_layers_handed_a_table_of_a_layer_with_no_twins_fold():
    """The first layer (alike to none) makes a table every later layer is handed: the later
    layers read it by its own name, not relative to each (the same table for all), so they
    fold onto the second one; the trace's records and the plan are the unfolded ones."""
    model = _BiasStack()
    example = (torch.randn(2, 3, 8),)
    analysis = Analysis(model, example)
    calls = _layer_calls(model)
    folded = analysis.trace()
    assert calls == [0, 1] and analysis.tally == {"run": 1, "stood": 4} and not analysis.broke
    plain = Analysis(model, example)
    plain.fold = False
    unfolded = plain.trace()
    assert folded.nodes == unfolded.nodes and folded.module_inputs == unfolded.module_inputs
    _, plan, plan_unfolded = _plans(model, example)
    assert plan_key(plan) == plan_key(plan_unfolded) and plan.notes == plan_unfolded.notes


class _Sharing(_Block):
    """Kolibri-1.1's layers: ``kv_source_layer`` is the layer's own index (an index under
    another name) except where it reads another layer's states; storing layers write theirs
    under their own index (they read ``layer_idx``); every layer computes a cache slot from
    its index and uses it only with a cache (Inkling-2's ``layer_idx + cache_offset``)."""

    def __init__(self, width: int, layer_idx: int, source: int, stores: bool):
        super().__init__(width, layer_idx)
        self.kv_source_layer, self.stores = source, stores
        self.reads = source != layer_idx

    def forward(self, x: torch.Tensor, shared: dict, cache: dict | None = None) -> torch.Tensor:
        slot = self.layer_idx + 1
        h = torch.relu(self.up(x))
        if cache is not None:
            cache[slot] = h
        if self.reads:
            h = h * shared[str(self.kv_source_layer)]
        if self.stores:
            shared[str(self.layer_idx)] = h
        return x + self.down(h)


class _SharingStack(_Stack):
    #: (kv_source_layer, stores) per layer: 0, 1 plain; 2, 4 store; 3, 5 read layer 2's
    LAYOUT = ((0, False), (1, False), (2, True), (2, False), (4, True), (2, False))

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            _Sharing(8, i, source, stores) for i, (source, stores) in enumerate(self.LAYOUT)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared: dict = {}
        for layer in self.layers:
            x = layer(x, shared)
        return self.head(x)


def test_an_index_under_another_name_and_a_kind_that_reads_its_index():
    """``kv_source_layer`` equal to the layer's own index is an index (watched, not compared):
    layers 0 and 1 fold, as do the two storing layers until the first reads its ``layer_idx``;
    from then on that kind only tells its layers apart, and the others keep folding (an index
    read by one kind does not unfold every layer). The slot computed from the index, never
    used without a cache, breaks nothing. The plan is the unfolded one."""
    from tpkit.trace.fold import find_twins

    model = _SharingStack()
    layers = list(model.layers.named_children())
    assert find_twins(layers).rep == {"1": "0", "4": "2", "5": "3"}
    assert find_twins(layers, frozenset({"2:layer_idx"})).rep == {"1": "0", "5": "3"}
    example = (torch.randn(2, 3, 8),)
    analysis = Analysis(model, example)
    analysis.trace()
    assert analysis.distinguishing == {"layers.2:layer_idx"}
    assert analysis.twins().rep == {"layers.1": "layers.0", "layers.5": "layers.3"}
    folded, plan, unfolded = _plans(model, example)
    assert plan_key(plan) == plan_key(unfolded) and plan.notes == unfolded.notes
    assert folded.tally["stood"] > 0


def test_a_count_equal_to_one_layers_index_is_no_index():
    """An integer equal to the layer's index in one layer only (8 heads in layer 8) is an
    ordinary attribute, compared as before: it does not set that layer apart."""
    from tpkit.trace.fold import find_twins

    model = _Stack()
    for layer in model.layers:
        layer.heads = 3
    assert len(find_twins(list(model.layers.named_children())).rep) == 5


class _Slotted(_Block):
    """Computes a slot from its index: used only with a cache, compared (``use="compared"``:
    odd layers scale), or read by its value (``use="read"``: a table indexed with it)."""

    def __init__(self, width: int, layer_idx: int, use: str):
        super().__init__(width, layer_idx)
        self.use = use

    def forward(self, x: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        slot = 2 * (self.layer_idx + 1) - 1
        h = torch.relu(self.up(x))
        if cache is not None:
            cache[slot] = h
        if self.use == "compared" and slot % 4 == 3:  # odd layers scale: two kinds of answer
            h = h * 2
        if self.use == "read":  # odd layers scale, by a table read at the slot: not alike
            h = h * (1.0, 2.0)[(slot // 2) % 2]
        return x + self.down(h)


@pytest.mark.parametrize("use", ["unused", "compared", "read"])
def test_arithmetic_on_an_index_is_watched_in_turn(use: str):
    """``2 * (layer_idx + 1) - 1`` is watched as the index is: unused, the layers fold;
    compared, the comparison is a guard (`tpkit.trace.watched`) and the layers fold once per
    answer; read by its value, it breaks the fold naming the index for its kind
    (``<kind>:<place>``), and every layer runs as itself."""
    model = _Stack()
    model.layers = nn.ModuleList(_Slotted(8, i, use) for i in range(6))
    example = (torch.randn(2, 3, 8),)
    analysis = Analysis(model, example)
    calls = _layer_calls(model)
    analysis.trace()
    if use == "read":
        assert analysis.distinguishing == {"layers.0:layer_idx"}
        assert calls[-6:] == [0, 1, 2, 3, 4, 5] and not analysis.twins()
    elif use == "compared":
        assert calls == [0, 1] and not analysis.broke
    else:
        assert calls == [0] and not analysis.broke
    _, plan, unfolded = _plans(model, example)
    assert plan_key(plan) == plan_key(unfolded) and plan.notes == unfolded.notes


def test_metadata_reads_pass_the_analysis_modes_untouched():
    """Torch hands every ``x.shape`` / ``x.dtype`` / ``x.size()`` to each active function
    mode: the analysis's modes hand them straight on (`tpkit.trace.shadow.metadata_only`),
    but never an attribute or method that returns a tensor (``x.T``, a view), which the
    tracer follows and the dry run's reshape record counts."""
    from torch.overrides import TorchFunctionMode

    from tpkit.trace.shadow import metadata_only

    seen: list = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.zeros(2, 3)
    with Record():
        _ = (x.shape, x.dtype, x.device, x.requires_grad, x.ndim, x.size(), x.dim(), len(x))
        _ = (x.is_floating_point(), x.numel(), x.stride())
        meta = len(seen)
        _ = (x.T, x.mT, x.data, x.view(3, 2), x.float(), x + 1)
    assert meta == 11 and all(metadata_only(f) for f in seen[:meta])
    assert len(seen) > meta and not any(metadata_only(f) for f in seen[meta:])


class _OwnLinear(nn.Linear):
    """A linear with its own forward: it may read its weight's height."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (self.weight.shape[0] / self.out_features)


def test_a_gathered_vocabulary_head_split_unevenly_needs_no_last_rank_dry_run(monkeypatch):
    """A dry run of a plan whose shards are smaller on the last rank runs that rank's shapes
    too. Not for a plain ``nn.Linear`` whose output is gathered (a vocabulary head of a size tp
    does not divide): its forward takes any height and hands on the gathered width, so the
    last rank's run is rank 0's. A linear with its own forward still gets its own run."""
    from tpkit.settle import dryrun

    ranks: list[int] = []
    once = dryrun._dry_run_once
    monkeypatch.setattr(
        dryrun,
        "_dry_run_once",
        lambda *a, **k: (k.get("record") is None and ranks.append(k["rank"])) or once(*a, **k),
    )  # the split runs' ranks (not the unsplit reference run's)
    plan = Plan.from_dict({"layers.*.up": "colwise", "layers.*.down": "rowwise"})
    plan.set("head", "colwise_gather_output")
    for head, expected in ((nn.Linear, [0]), (_OwnLinear, [0, 3])):
        model = _Stack()
        model.head = head(8, 10)  # 10 rows at tp=4: 3, 3, 3, 1
        analysis = Analysis(model, (torch.randn(2, 3, 8),))
        ranks.clear()
        assert dry_run(analysis, plan, 4) is None
        assert ranks == expected
