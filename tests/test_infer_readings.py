"""Inference's two readings of a hybrid whose layer list mixes types (`tpkit.sources.infer`,
`tpkit.trace.trace.blocks`' ``mixed``): the unmixed reading is skipped only where it can find
no column/row pair, and the plan is the one both readings give.

Pure: tiny models on meta, no ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.tiny import build
from tests.tiny_family import build_family
from tpkit.plan import Plan
from tpkit.sources import infer as inferring
from tpkit.trace.analysis import Analysis, plan_key
from tpkit.trace.trace import STREAM, blocks


def _readings(monkeypatch) -> list[bool]:
    """The readings inference runs from now on (``mixed`` of each), in order."""
    ran: list[bool] = []
    once = inferring._infer_once

    def spy(analysis: Analysis, mixed: bool) -> Plan:
        ran.append(mixed)
        return once(analysis, mixed)

    monkeypatch.setattr(inferring, "_infer_once", spy)
    return ran


def _both(analysis: Analysis) -> Plan:
    """The plan with both readings run and the one that splits more kept (before the skip)."""
    model = analysis.model
    plan = inferring._infer_once(analysis, mixed=True)
    other = inferring._infer_once(analysis, mixed=False)
    return other if inferring._sharded(model, other) > inferring._sharded(model, plan) else plan


def _same(a: Plan, b: Plan) -> bool:
    return plan_key(a) == plan_key(b) and a.notes == b.notes


def _inferred(monkeypatch, model: nn.Module) -> tuple[Analysis, list[bool]]:
    """Inference of ``model`` on a fresh analysis, checked to give the plan both readings give:
    that analysis and the readings it ran."""
    expected = _both(Analysis(model))
    ran = _readings(monkeypatch)
    analysis = Analysis(model)
    assert _same(inferring.infer(analysis), expected)
    return analysis, ran


def _inkling2(class_name: str = "Inkling2ForCausalLM") -> nn.Module:
    return build("inkling2_text", class_name, device="meta")


def test_a_blockless_unmixed_reading_with_no_writer_is_skipped(monkeypatch):
    """Inkling-2's one layer list mixes sliding and full layers: unmixed, it has no blocks, is
    fed ids and returns the vocabulary head's logits, so it finds no pair. Only the mixed
    reading runs, and the plan is what both readings give."""
    model = _inkling2()
    assert blocks(model) and not blocks(model, mixed=False)
    analysis, ran = _inferred(monkeypatch, model)
    assert ran == [True]
    info = analysis.trace()
    assert not info.fed_floats and info.returns == {"lm_head"}


def test_an_unmixed_reading_whose_blocks_never_run_is_skipped(monkeypatch):
    """Inkling-2's VLM: unmixed, its blocks are the vision tower's layers, which the trace (fed
    the text alone) never runs: no module is a stream boundary, so that reading finds no
    pair. Only the mixed reading runs, and the plan is what both readings give."""
    model = build_family("inkling2", "Inkling2ForConditionalGeneration", device="meta")
    unmixed = blocks(model, mixed=False)
    assert unmixed and blocks(model) != unmixed
    analysis, ran = _inferred(monkeypatch, model)
    assert ran == [True]
    assert not any(name in analysis.trace().module_inputs for name, _ in unmixed)


def test_a_blockless_model_returning_its_stream_is_read_both_ways(monkeypatch):
    """Without its head, Inkling-2's model returns the stream itself: unmixed, every linear
    adding into it writes it, so that reading may pair them; it runs, and the plan is still
    what both readings give."""
    model = _inkling2("Inkling2TextModel")
    assert not blocks(model, mixed=False)
    analysis, ran = _inferred(monkeypatch, model)
    assert ran == [True, False]
    assert STREAM in analysis.trace().returns


def test_a_blockless_model_fed_floats_is_read_both_ways(monkeypatch):
    """Fed its embeddings (floats), the model's own input is the stream in the unmixed
    reading: it runs."""
    model = _inkling2()
    width = model.config.hidden_size
    example = {"inputs_embeds": torch.zeros(2, 5, width, device="meta")}
    ran = _readings(monkeypatch)
    analysis = Analysis(model, example)
    inferring.infer(analysis)
    assert analysis.trace().fed_floats
    assert ran == [True, False]


@pytest.mark.parametrize("model_type, class_name", [("zamba2", "Zamba2ForCausalLM")])
def test_an_unmixed_reading_with_blocks_still_runs(monkeypatch, model_type, class_name):
    """Zamba2's unmixed reading has blocks of its own (inside the hybrid layers): it runs,
    and the plan is what both readings give."""
    model = build(model_type, class_name, device="meta")
    assert blocks(model, mixed=False)
    _, ran = _inferred(monkeypatch, model)
    assert ran == [True, False]
