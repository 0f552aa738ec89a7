"""Folding layers that test their index, and layers the model calls in cycles
(`tpkit.trace.fold`, `tpkit.trace.watched`).

A layer that only compares its index (RWKV's ``if self.layer_id == 0``) runs once per answer:
a twin stands on a call whose recorded comparisons its own index answers alike. A layer the
model calls again (HRM's stacks, run in cycles with a ``cycle_offset``) runs its forward on its
first call only. Each plan is the unfolded one, entry for entry. Pure: meta-free CPU models,
no ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tpkit.plan import Plan, derive_plan
from tpkit.trace.analysis import Analysis, plan_key
from tpkit.trace.watched import FoldBroken, Guards, Watched, holds


class _Block(nn.Module):
    """Scales by 2 where ``test(layer_idx)`` holds; handed ``cycle_offset`` (unread)."""

    def __init__(self, width: int, layer_idx: int, test=None):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.layer_idx, self.test = layer_idx, test

    def forward(self, x: torch.Tensor, cycle_offset: int = 0, scale: float = 1.0) -> torch.Tensor:
        h = torch.relu(self.up(x))
        if self.test is not None and self.test(self.layer_idx):
            h = h * 2
        return x + scale * self.down(h)


class _Stack(nn.Module):
    """Six alike layers; ``cycles``: each cycle runs them all again, with a per-cycle
    ``cycle_offset`` (HRM) and the given ``scale`` per (cycle, layer)."""

    def __init__(self, test=None, cycles: int = 1, scales=None):
        super().__init__()
        self.layers = nn.ModuleList(_Block(8, i, test) for i in range(6))
        self.head = nn.Linear(8, 4)
        self.cycles, self.scales = cycles, scales or (lambda c, i: 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c in range(self.cycles):
            for i, layer in enumerate(self.layers):
                x = layer(x, cycle_offset=6 * c, scale=self.scales(c, i))
        return self.head(x)


def _runs(model: nn.Module) -> list[int]:
    """The indices of the layers whose own forward ran, in order."""
    calls: list[int] = []
    for i, layer in enumerate(model.layers):
        layer.up.register_forward_pre_hook(lambda *_, i=i: calls.append(i))
    return calls


def _plans(model: nn.Module) -> tuple[Analysis, Plan, Plan]:
    example = (torch.randn(2, 3, 8),)
    folded = Analysis(model, example)
    plan = derive_plan(model, "auto", 2, analysis=folded)
    unfolded = Analysis(model, example)
    unfolded.fold = False
    return folded, plan, derive_plan(model, "auto", 2, analysis=unfolded)


@pytest.mark.parametrize(
    ("test", "runs"),
    [
        (lambda i: i == 0, [0, 1]),  # RWKV's first block: it alone answers True
        (lambda i: i % 2, [0, 1]),  # odd layers: two kinds of answer
        (lambda i: (i + 1) % 3 == 0 and i > 4, [0, 2, 5]),  # arithmetic, two tests
        (lambda i: 3 <= i, [0, 3]),  # noqa: SIM300 - a reflected comparison
    ],
)
def test_a_layer_that_tests_its_index_runs_once_per_answer(test, runs):
    model = _Stack(test)
    analysis = Analysis(model, (torch.randn(2, 3, 8),))
    calls = _runs(model)
    analysis.trace()
    assert calls == runs and analysis.tally == {"run": len(runs), "stood": 6 - len(runs)}
    assert not analysis.distinguishing and not analysis.unfolded
    folded, plan, unfolded = _plans(model)
    assert plan_key(plan) == plan_key(unfolded) and plan.notes == unfolded.notes
    # every forward of the derivation (the trace, each dry run) folded alike
    assert folded.tally["stood"] * len(runs) == folded.tally["run"] * (6 - len(runs))


def test_layers_run_in_cycles_run_once():
    """HRM's stacks: every layer called three times, handed its cycle's offset (unread). The
    first layer's first call runs; every other call stands on it."""
    model = _Stack(cycles=3)
    analysis = Analysis(model, (torch.randn(2, 3, 8),))
    calls = _runs(model)
    analysis.trace()
    assert calls == [0] and analysis.tally == {"run": 1, "stood": 17} and not analysis.broke
    folded, plan, unfolded = _plans(model)
    assert plan_key(plan) == plan_key(unfolded) and plan.notes == unfolded.notes
    assert plan["layers.*.up"] == "colwise" and plan["layers.*.down"] == "rowwise"


class _Seeded(_Stack):
    """HRM's low stack: the stream starts from a bare parameter (``z_L_init``), and each
    cycle hands the last layer's output to the first layer again."""

    def __init__(self) -> None:
        super().__init__(cycles=3)
        self.z_init = nn.Parameter(torch.zeros(8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.z_init)


def test_cycles_whose_stream_carries_a_bare_parameter_fold():
    """The first layer's later calls carry in what the last layer's stand-in handed on (its
    own token for the bare parameter): each call adds to what its token stands for, and the
    tokens, naming each other in a cycle, resolve to the parameter. The trace folds, and the
    plan is the unfolded one."""
    model = _Seeded()
    analysis = Analysis(model, (torch.randn(2, 3, 8),))
    calls = _runs(model)
    analysis.trace()
    assert calls == [0] and not analysis.broke and not analysis.unfolded
    folded, plan, unfolded = _plans(model)
    assert plan_key(plan) == plan_key(unfolded) and plan.notes == unfolded.notes
    assert folded.tally["stood"] > 0 and not folded.unfolded


def test_cycles_called_otherwise_run_again_and_fold():
    """The second cycle calls every layer otherwise (another scale: Inkling-2-Loop's later
    passes hand their layers messages): the first layer runs again, once per way it is
    called, and every other call stands on its last one; the plan is the unfolded one."""
    model = _Stack(cycles=3, scales=lambda c, i: 1.0 if c == 0 else 0.5)
    analysis = Analysis(model, (torch.randn(2, 3, 8),))
    calls = _runs(model)
    analysis.trace()
    assert calls == [0, 0] and analysis.tally == {"run": 2, "stood": 16} and not analysis.broke
    folded, plan, unfolded = _plans(model)
    assert plan_key(plan) == plan_key(unfolded) and plan.notes == unfolded.notes
    assert not folded.unfolded and folded.tally["stood"] == 8 * folded.tally["run"]


class _Again(_Stack):
    """The first layer alone is called once more, otherwise (another scale), after the
    others stood on its first call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.layers[0](x, scale=0.5))


@pytest.mark.parametrize(
    ("model", "why"),
    [
        # the third cycle calls layer 1 as the first did (its own first call, not the last
        # call of layer 0, which ran again in the second): it would stand on an older call
        (
            _Stack(cycles=3, scales=lambda c, i: 0.5 if c == 1 and i == 0 else 1.0),
            "runs more than once and stood on layers.0",
        ),
        # layer 1 runs with 0.5 in the first cycle; layer 0 meets 0.5 in the second and would
        # stand on layer 1's call after its own: its records come from two layers
        (
            _Stack(cycles=2, scales=lambda c, i: 0.5 if (c, i) in ((0, 1), (1, 0)) else 1.0),
            "calls of 2 layers",
        ),
        # the layers after the first stood on its first call only; it ran again after: what
        # it recorded adds up both calls, more than theirs would
        (_Again(), "some of the calls"),
    ],
)
def test_cycles_called_otherwise_run_unfolded(model, why):
    """Where a layer's later call cannot stand on what its first call stood on, the fold
    breaks and the trace runs unfolded; the plan is the unfolded one."""
    analysis = Analysis(model, (torch.randn(2, 3, 8),))
    analysis.trace()
    assert why in analysis.broke and "trace" in analysis.unfolded
    _, plan, unfolded = _plans(model)
    assert plan_key(plan) == plan_key(unfolded) and plan.notes == unfolded.notes


def test_a_watched_index_answers_comparisons_and_breaks_on_its_value():
    guards = Guards()
    idx = Watched("layer_idx", 3, "layer_idx", "layers.3", guards, key="i")
    guards.begin("layers.3")
    assert (idx == 3) is True and bool(idx % 2) is True
    assert (0 < idx) is True  # noqa: SIM300 - reflected
    assert ((2 * idx + 1) // 7 == 1) is True and (idx != None) is True  # noqa: E711
    found = guards.end()
    assert len(found) == 5
    assert holds(found, {"i": 3})
    assert not holds(found, {"i": 5})  # 5 == 3 is False
    for use in (lambda: list(range(9))[idx], lambda: float(idx)):
        guards.begin("layers.3")
        with pytest.raises(FoldBroken) as broke:
            use()
        assert broke.value.index == "layer_idx"
        guards.end()
    with pytest.raises(FoldBroken):  # read while another layer runs: its value would leak
        guards.begin("layers.4")
        _ = idx == 3
    with pytest.raises(FoldBroken):  # compared with what is no plain value
        guards.begin("layers.3")
        _ = idx == torch.tensor(3)


def test_layers_holding_a_partial_of_partials_made_per_layer_fold():
    """xLSTM's backend holds ``partial(kernel, step=partial(step_kernel, dtype=...))`` made per
    layer: equal nested partials leave the layers alike (their 32 blocks fold); other
    arguments two partials deep do not."""
    import functools

    from tpkit.trace.fold import find_twins

    def kernel(x, step=None):
        return x

    model = _Stack()
    for layer in model.layers:  # made per layer: only their contents are equal
        layer.fn = functools.partial(kernel, step=functools.partial(kernel, step=torch.float32))
    layers = list(model.layers.named_children())
    assert len(find_twins(layers).rep) == 5
    odd = functools.partial(kernel, step=torch.bfloat16)
    model.layers[3].fn = functools.partial(kernel, step=odd)
    assert "3" not in find_twins(layers).rep and len(find_twins(layers).rep) == 4


class _Messaged(nn.Module):
    """A loop layer (Inkling-2-Loop's): later passes hand it a message, which its own gate
    (a linear the first pass never calls) mixes in, and each pass its own cache offset."""

    def __init__(self, width: int, layer_idx: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.gate = nn.Linear(width, 2 * width)
        self.layer_idx = layer_idx

    def forward(self, x, message=None, cache_offset: int = 0) -> torch.Tensor:
        h = self.up(x)
        if message is not None:
            h = h * torch.sigmoid(self.gate(message))
        return x + self.down(torch.relu(h))


class _Passes(nn.Module):
    """Three passes over six alike layers, each later pass restarting from the input and
    handing every layer the previous pass's output as its message."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Messaged(8, i) for i in range(6))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, message = x, None
        for p in range(3):
            h = x
            for layer in self.layers:
                h = layer(h, message, cache_offset=6 * p) if message is not None else layer(h)
            message = h
        return self.head(h)


def test_passes_handing_messages_run_each_way_once_and_trace_as_unfolded():
    """Each pass calls the layers otherwise (no message, then a message and another offset):
    the first layer runs once per pass and the others stand on its call of that pass. The
    trace's records (each module's inputs, the gate that only later passes call, the bare
    parameters and the nodes) and the plan are the unfolded ones."""
    model = _Passes()
    example = (torch.randn(2, 3, 8),)
    analysis = Analysis(model, example)
    calls = _runs(model)
    folded = analysis.trace()
    assert calls == [0, 0, 0] and analysis.tally == {"run": 3, "stood": 15}
    assert not analysis.broke
    plain = Analysis(model, example)
    plain.fold = False
    unfolded = plain.trace()
    assert folded.nodes == unfolded.nodes and folded.input_params == unfolded.input_params
    assert folded.module_inputs == unfolded.module_inputs
    assert "layers.5.gate" in folded.nodes and folded.nodes["layers.5.gate"].consumers
    folded_analysis, plan, plan_unfolded = _plans(model)
    assert plan_key(plan) == plan_key(plan_unfolded) and plan.notes == plan_unfolded.notes
    assert not folded_analysis.unfolded
