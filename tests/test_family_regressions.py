"""Three models tpkit itself failed on (issue 29), each checked tp=2 against the unsharded model.

- Tied weights the derived plan split two ways: DiffusionGemma's decoder shares every weight of
  its encoder's text layers, but its attention runs whole (transformers' plan names the
  encoder's only), so ``o_proj``'s weight was row-parallel under one name and whole under the
  other, and the plan was refused. A whole linear tied to a row-parallel weight now computes
  with it as ``rowwise_split_input`` (`tpkit.settle.complete.complete_tied_layers`), and a whole
  module whose weights are all tied to a split twin's takes the twin's entry where a dry run
  passes (DiffusionGemma's decoder attention, which appends to the encoder's split cache).
- Kyutai speech-to-text takes ``input_ids`` [batch, seq, 1 + codebooks]; the made-up trace ids
  stacked the codebooks in the batch (MusicGen's layout), its trace failed and it took the
  per-layer fallback. The layout is now read off the input embedding
  (`tpkit.trace.inputs._codebook_ids_shape`).
- Ovis2.5's ``visual_embeddings_table`` is a linear that its own forward also uses as an
  embedding table (``F.embedding(ids, self.weight.T)``): split by rows (``rowwise_split_input``)
  each rank looked ids up in its half ("IndexError: index out of range"). The trace now marks
  such a linear read outside its forward, so it stays whole.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.parity import module_parity

TOL = 1e-5


class TiedRow(nn.Module):
    """An MLP (``up`` -> ``down``, split column/row by the model's own transformers-style plan,
    as DiffusionGemma's encoder is) plus ``other``, a linear that shares ``down``'s weight and
    reads a whole input no column layer produced: no entry names it, so it stayed whole while
    its weight was split by rows."""

    def __init__(self, d: int = 8, h: int = 16):
        super().__init__()
        self.config = SimpleNamespace(base_model_tp_plan={"up": "colwise", "down": "rowwise"})
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.other = nn.Linear(h, d, bias=False)
        self.other.weight = self.down.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))) + self.other(torch.cat([x, x * x], -1))


def _tied_row() -> TiedRow:
    torch.manual_seed(0)
    return TiedRow()


def test_tied_row_weight_plan_agrees():
    """Pure: the plan tpkit derives from the model's own plan (forced, as "auto" keeps it for
    DiffusionGemma) gives both names of the tied weight the same layout (no refusal), ``other``
    computing with the row split on its whole input."""
    from tpkit.plan import derive_plan
    from tpkit.plan.checks import problems
    from tpkit.plan.layout import param_layouts

    model = _tied_row()
    plan = derive_plan(model, "config", 2)
    assert problems(model, plan, 2) == []
    layouts = param_layouts(model, plan)
    assert layouts["down.weight"][1] == layouts["other.weight"][1]
    assert layouts["down.weight"][1].sharded
    assert plan.style_for("other")[0] == "rowwise_split_input"


def test_tied_row_user_conflict_still_refused():
    """A user's explicit entries that split the tied weight two ways still get the error."""
    from tpkit.plan import derive_plan
    from tpkit.plan.checks import problems

    model = _tied_row()
    plan = derive_plan(model, {"up": "colwise", "down": "rowwise", "other": "replicate"}, 2)
    found = problems(model, plan, 2)
    assert any("tied parameters would be split differently" in p for p in found), found


def test_tied_split_two_ways_is_kept_whole():
    """Pure: a derived plan whose tie no split fits both names of (here ``other`` gathered by
    output features beside ``down``'s rows) keeps both whole, the group too, with a note,
    and validation passes: tpkit does not refuse a plan it derived for a tie."""
    from tpkit.plan import Plan
    from tpkit.plan.checks import problems
    from tpkit.plan.layout import param_layouts
    from tpkit.plan.spec import Group, Source
    from tpkit.settle.complete import agree_tied

    model = _tied_row()
    entries = {"up": "colwise", "down": "rowwise", "other": "colwise_gather_output"}
    plan = Plan(entries, source=Source.INFERRED)
    plan.groups.append(Group(("up", "down")))
    assert problems(model, plan, 2)  # refused as it is
    agree_tied(model, plan)
    assert problems(model, plan, 2) == []
    layouts = param_layouts(model, plan)
    assert not any(layouts[n][1].sharded for n in ("up.weight", "down.weight", "other.weight"))
    assert "tied" in plan.notes["down"] and "tied" in plan.notes["other"], plan.notes


def tied_row_parity() -> dict:
    import tpkit

    ref = _tied_row()
    model = tpkit.tensor_parallel(copy.deepcopy(ref), plan="config")
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    return module_parity(ref, model, x)


def test_tied_row_weight_parity_tp2(ranks2):
    for r in ranks2.run(tied_row_parity):
        assert r["out"] <= TOL * max(1.0, r["out_scale"]), r
        assert r["grad"] <= TOL * max(1.0, r["scale"]), r
        assert not r["missing"], r
        assert r["sharded"] >= 2, r


DIFFUSION_GEMMA = ("diffusion_gemma", "DiffusionGemmaForBlockDiffusion", "image-text-to-text")


def diffusion_gemma_parity() -> dict:
    """`tests.test_families.family_parity` with the decoder's canvas given: left out, the model
    draws it with ``torch.randint`` on each call (each rank and each run different tokens)."""
    import tpkit
    from tests.test_families import _parity
    from tests.tiny_family import build_family
    from tests.tiny_inputs import family_inputs

    ref = build_family(*DIFFUSION_GEMMA[:2])
    x = family_inputs(ref, DIFFUSION_GEMMA[2])
    canvas = (x["input_ids"].shape[0], ref.config.canvas_length)
    g = torch.Generator().manual_seed(3)
    x["decoder_input_ids"] = torch.randint(
        0, ref.config.text_config.vocab_size, canvas, generator=g
    )
    return _parity(ref, tpkit.tensor_parallel(copy.deepcopy(ref)), x)


def test_diffusion_gemma_parity_tp2(ranks2):
    """Not refused; output and every gradient as unsharded, its decoder's attention (whose keys
    and values join the encoder's cache) split as its encoder's, whose weights it shares."""
    from tests.test_families import _check

    r = _check(ranks2.run(diffusion_gemma_parity))
    for name in ("q_proj", "o_proj"):
        assert f"model.encoder.language_model.layers.0.self_attn.{name}.weight" in r["sharded"]


KYUTAI = (
    "kyutai_speech_to_text",
    "KyutaiSpeechToTextForConditionalGeneration",
    "speech-seq2seq",
)


def test_kyutai_trace_ids_follow_its_embedding():
    """Pure: the made-up ids have one last-dim entry per text and codebook token, as Kyutai's
    embedding adds its per-codebook offsets; the dataflow is traced (no per-layer fallback)
    and the layers' attention is split by heads."""
    from tests.tiny_family import build_family
    from tpkit.plan import derive_plan
    from tpkit.trace.inputs import synthesize_inputs

    model = build_family(*KYUTAI[:2], device="meta")
    _, kwargs = synthesize_inputs(model, 2, 9)
    assert kwargs["input_ids"].shape == (2, 9, model.config.num_codebooks + 1)
    plan = derive_plan(model, "auto", 2)
    # the codec tower, which forward never runs, is planned on its own; the text model is traced
    fallback = [k for k, why in plan.notes.items() if "fallback" in why and k.startswith("model.")]
    assert not fallback, fallback
    assert plan.style_for("model.layers.0.self_attn.q_proj.linear")[0] == "colwise"
    assert plan.style_for("model.layers.0.self_attn.o_proj.linear")[0] == "rowwise"


def test_musicgen_trace_ids_stay_stacked():
    """Pure: MusicGen's decoder still gets its codebooks stacked in the batch."""
    from tests.tiny import build
    from tpkit.trace.inputs import synthesize_inputs

    model = build("musicgen", "MusicgenForCausalLM", device="meta")
    _, kwargs = synthesize_inputs(model, 2, 9)
    assert kwargs["input_ids"].shape == (2 * model.config.num_codebooks, 9)


def test_kyutai_parity_tp2(ranks2):
    from tests.test_families import _check, family_parity

    r = _check(ranks2.run(family_parity, *KYUTAI))
    assert "model.layers.0.self_attn.q_proj.linear.weight" in r["sharded"], r["sharded"]


class LookupLinear(nn.Linear):
    """Ovis2.5's visual embedding table: a linear that also looks rows of its transposed weight
    up by id."""

    def forward(self, x: torch.Tensor, *, lookup: bool = False) -> torch.Tensor:
        return F.embedding(x, self.weight.T) if lookup else super().forward(x)


class Lookup(nn.Module):
    """``up`` -> softmax -> ``table`` (a pair inference would gather), then ``table`` looked
    up by ids in its own forward, as Ovis2.5 adds its visual indicator tokens."""

    def __init__(self, d: int = 8, h: int = 16):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.table = LookupLinear(h, d, bias=False)
        self.register_buffer("ids", torch.arange(h - 4, h), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.table(torch.softmax(self.up(x), -1))
        return y + self.table(self.ids, lookup=True).sum(0)


def _lookup() -> Lookup:
    torch.manual_seed(0)
    return Lookup()


def test_table_lookup_keeps_linear_whole():
    """Pure: a linear whose weight its forward also looks ids up in stays whole."""
    from tpkit.plan import derive_plan
    from tpkit.trace.trace import trace

    model = _lookup()
    assert trace(model)["nodes"]["table"].read_outside
    plan = derive_plan(model, "auto", 2)
    hit = plan.style_for("table")
    assert hit is None or hit[0] == "replicate", plan.to_dict()


def lookup_parity() -> dict:
    import tpkit

    ref = _lookup()
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    return module_parity(ref, model, x)


def test_table_lookup_parity_tp2(ranks2):
    for r in ranks2.run(lookup_parity):
        assert r["out"] <= TOL * max(1.0, r["out_scale"]), r
        assert r["grad"] <= TOL * max(1.0, r["scale"]), r
        assert not r["missing"], r


OVIS = ("ovis2_5", "Ovis2_5ForConditionalGeneration", "image-text-to-text")


def test_ovis2_5_parity_tp2(ranks2):
    """Its text and vision layers split, the visual embedding table whole, as unsharded."""
    from tests.test_families import _check, family_parity

    r = _check(ranks2.run(family_parity, *OVIS))
    assert "model.multi_modal_projector.visual_embeddings_table.weight" not in r["sharded"]
    assert "model.vision_tower.layers.0.mlp.fc1.weight" in r["sharded"], r["sharded"]


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
