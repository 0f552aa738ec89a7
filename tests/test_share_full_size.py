"""Every rank busy on the real models: the share of >=2-D parameter elements a derived plan
shards on each family's default (full-size) config, built on the meta device (pure: the
session's two ranks derive two at a time, `tests.parity.full_size_reports`), and tp=2 parity of logits and every gradient on the tiny configs of the same families (one
spawned group, many checks)."""

from __future__ import annotations

import pytest

from tests.parity import full_size_reports, tiny_parity

TOL = 1e-5

# class -> least share of >=2-D parameter elements sharded at tp=2, default config on meta
FULL_SIZE = {
    "LlamaForCausalLM": 0.99,
    # the causal LM's base_model_prefix names no attribute: its plan is found under ``model``
    "Llama4ForCausalLM": 0.99,
    # pad_token_id is the vocabulary's last row: the dry run must see it rank-local
    "MarianMTModel": 0.95,
    # a speech encoder: traced from input_features its first Conv1d and positions imply
    "WhisperForConditionalGeneration": 0.95,
    # a decoder-only model's cross-attention never runs in the trace: split like self-attention
    "BartForCausalLM": 0.95,
    "MarianForCausalLM": 0.95,
    # heads merged back to a width read off the input (merge_heads): 0.60 before
    "TrOCRForCausalLM": 0.99,
    # an ALiBi table as wide as the stream at its block's entry: 0.69 before
    "MptForCausalLM": 0.99,
    # lightning attention's per-head slopes and decays (head_buffers): 0.02 before
    "MiniMaxForCausalLM": 0.95,
    # no _tp_plan names the head: split and gathered like the embedding: 0.67 before
    "NemotronHForCausalLM": 0.9,
    # per-layer token tables, a third of the model, vocab-parallel: 0.64 before
    "Gemma3nForCausalLM": 0.95,
    # the local attention asks its bias table's ``weight.device``: metadata, not a read of
    # the values (it kept every encoder attention whole: 0.90 before)
    "LongT5ForConditionalGeneration": 0.99,
    # a sinusoidal table broadcast over every head's queries and keys: 0.77 before
    "RoFormerForCausalLM": 0.99,
    # a 16384-row position table looked up by arange: split by columns, gathered: 0.88 before
    "LEDForConditionalGeneration": 0.9,
}


@pytest.fixture(scope="module")
def full_size(request, ranks2) -> dict[str, dict]:
    """The full-size reports of the classes this run selected (all, or those ``-k`` kept), in
    name order: the costly ones (Gemma-3n, MiniMax, LED) then fall on alternate ranks."""
    wanted = sorted(
        {
            item.callspec.params["class_name"]
            for item in request.session.items
            if item.module is request.module and item.originalname == "test_full_size_share"
        }
    )
    return dict(zip(wanted, full_size_reports(ranks2, [(c, {}) for c in wanted]), strict=True))


@pytest.mark.parametrize("class_name", sorted(FULL_SIZE))
def test_full_size_share(full_size, class_name):
    r = full_size[class_name]
    assert "error" not in r, r.get("error")
    assert r["share"] >= FULL_SIZE[class_name], (r["share"], r["whole"])


TINY = [
    ("llama4_text", "Llama4ForCausalLM"),
    ("marian", "MarianMTModel"),
    ("whisper", "WhisperForConditionalGeneration"),
]


@pytest.mark.parametrize(("model_type", "class_name"), TINY)
def test_tiny_parity_tp2(ranks2, model_type, class_name):
    for r in ranks2.run(tiny_parity, model_type, class_name, timeout=120):
        assert r["logits"] <= TOL, r
        assert r["grad"] <= TOL * max(1.0, r["grad_scale"]), r  # float32 sums in another order
        assert not r["missing"], r


def test_unused_cross_attention_parity(ranks2, ranks4):
    for group in (ranks2, ranks4):  # with encoder_hidden_states: the cross-attention runs
        for r in group.run(tiny_parity, "bart", "BartForCausalLM", None, 6, timeout=120):
            assert r["logits"] <= TOL, r
            assert r["grad"] <= TOL * max(1.0, r["grad_scale"]), r
            assert not r["missing"] and r["share"] > 0.9, r
