"""Planning a multimodal / audio model fast and small: the inferred plan is derived once per
analysis, the conv-pair forwards fold the layers that hold no convolution
(`tpkit.sources.convs.conv_pairs` with an analysis), and the audio tower run that counts an
audio-LLM's placeholders (`tpkit.trace.inputs`) is not recorded by the trace.

Pure: meta or tiny CPU models, no ranks. Each fold is checked against the same question asked
unfolded: a fold that changed an answer would be a wrong plan."""

from __future__ import annotations

import torch
from torch import nn

from tests.tiny_family import build_family
from tpkit.sources.convs import conv_pairs
from tpkit.sources.infer import infer
from tpkit.trace import trace as trace_module
from tpkit.trace.analysis import Analysis

CHANNELS, TIME, LAYERS = 8, 16, 4


class _Block(nn.Module):
    """A layer with no convolution: a linear over time, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(TIME, TIME)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x)


class _Stem(nn.Module):
    """A pointwise conv pair (``inner`` output channels between them), then identical layers
    (``through``: the layers sit between the two convs, so the split channels reach them)."""

    def __init__(self, through: bool) -> None:
        super().__init__()
        self.through = through
        self.conv1 = nn.Conv1d(CHANNELS, 64, 1)
        self.conv2 = nn.Conv1d(64, CHANNELS, 1)
        self.layers = nn.ModuleList(_Block() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        if not self.through:
            x = self.conv2(torch.relu(x))
        for layer in self.layers:
            x = layer(x)
        return self.conv2(x) if self.through else x


def _pairs(model: nn.Module, analysis: Analysis | None):
    example = (torch.randn(2, CHANNELS, TIME),)
    found = conv_pairs(model, 2, lambda *_: True, example, None, analysis)
    return found.styles, found.broken, found.fixups


def test_conv_pairs_fold_the_layers_that_hold_no_convolution():
    """The convs pair ahead of identical layers: those layers fold (three stand on the first)
    and the pairs are the ones found unfolded."""
    torch.manual_seed(0)
    model = _Stem(through=False)
    analysis = Analysis(model, (torch.randn(2, CHANNELS, TIME),))
    folded = _pairs(model, analysis)
    assert folded == _pairs(model, None)
    assert folded[0] == {"conv1": "conv_colwise", "conv2": "conv_rowwise"}
    assert analysis.tally.get("stood", 0) == LAYERS - 1
    assert "conv pairs" not in analysis.unfolded


def test_split_channels_reaching_a_folded_layer_run_it_unfolded():
    """A conv's split channels flow into the layers: a fold cannot stand for what they do with
    them, so the conv-pair forward runs unfolded and answers as it always did."""
    torch.manual_seed(0)
    model = _Stem(through=True)
    analysis = Analysis(model, (torch.randn(2, CHANNELS, TIME),))
    assert _pairs(model, analysis) == _pairs(model, None)
    assert "conv pairs" in analysis.unfolded


def _counted(model: nn.Module) -> list[int]:
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_the_inferred_plan_is_derived_once_per_analysis():
    """ "auto" asks for the inferred plan twice (transformers' plan checked, then completed at a
    tp): the second answer runs no forward, equals the first and is the caller's own copy."""
    model = build_family("qwen2_audio", "Qwen2AudioForConditionalGeneration")
    analysis = Analysis(model)
    first = infer(analysis)
    calls = _counted(model)
    second = infer(analysis)
    assert calls == []
    assert dict(second) == dict(first) and second.groups == first.groups
    second.notes["mine"] = "a caller's note"
    assert "mine" not in infer(analysis).notes


def test_the_audio_placeholder_count_is_not_traced(monkeypatch):
    """Making an audio-LLM's inputs runs its audio tower once to count placeholders: the
    trace's hooks see only the trace's own forward (each tower layer entered once), so they
    record and keep none of the probe's tensors (GLM-ASR's full-size probe left 0.8 GB held
    in the trace's records, planning's peak 1.26 GB)."""
    seen: dict[int, list[str]] = {}  # each forward's hooks -> the modules they saw entered
    pre = trace_module._TraceHooks.pre

    def counted(self, mod, args, kwargs):
        seen.setdefault(id(self), []).append(self.names[id(mod)])
        return pre(self, mod, args, kwargs)

    monkeypatch.setattr(trace_module._TraceHooks, "pre", counted)
    model = build_family("qwen2_audio", "Qwen2AudioForConditionalGeneration")
    Analysis(model).trace()
    counts = [
        (n.count("model.audio_tower.layers.0"), n.count("model.language_model.layers.0"))
        for n in seen.values()
    ]  # a first forward may stop early (then one with values)
    assert all(tower <= 1 for tower, _ in counts)
    assert (1, 1) in counts


class _Mixer(nn.Module):
    """A Mamba-like layer: a linear in, a causal convolution (depthwise, or ``groups`` groups
    of many channels each), a linear out, residual."""

    def __init__(self, groups: int | None) -> None:
        super().__init__()
        self.inp = nn.Linear(CHANNELS, 64)
        self.conv = nn.Conv1d(64, 64, 4, groups=groups or 64, padding=3)
        self.out = nn.Linear(64, CHANNELS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.inp(x).transpose(1, 2))[..., : x.shape[1]]
        return x + self.out(torch.relu(h).transpose(1, 2))


class _Mixers(nn.Module):
    def __init__(self, groups: int | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Mixer(groups) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _mixer_pairs(model: nn.Module):
    found = conv_pairs(model, 2, lambda *_: True, (torch.randn(2, TIME, CHANNELS),))
    return found.styles, found.broken, found.fixups, found.groups


def test_conv_pairs_run_no_forward_where_no_convolution_can_take_a_role(monkeypatch):
    """Depthwise convolutions only (Zamba's, Mamba's): none can be a column or be gathered, so
    nothing can pair and no forward runs; forced to run, the forward finds the same nothing."""
    from tpkit.sources import convs

    torch.manual_seed(0)
    model = _Mixers(groups=None)
    calls = _counted(model)
    skipped = _mixer_pairs(model)
    assert calls == []
    assert skipped == ({}, {}, {}, [])
    monkeypatch.setattr(convs, "_may_take_a_role", lambda *_: True)
    assert _mixer_pairs(model) == skipped
    assert calls  # the forced forward ran


def test_conv_pairs_still_run_where_a_grouped_convolution_can_be_gathered():
    """Two groups of 32 channels, read whole: gathered by output channels, so the forward
    runs and finds it (the skip is for convolutions that can take no role at all)."""
    torch.manual_seed(0)
    model = _Mixers(groups=2)
    calls = _counted(model)
    styles = _mixer_pairs(model)[0]
    assert calls
    assert styles == {f"layers.{i}.conv": "conv_colwise_gather" for i in range(LAYERS)}
