"""Speech encoders split at full size (issue 29): Wav2Vec2-BERT and untraced audio towers.

- Wav2Vec2-BERT's relative-distance table is read by every head in
  ``einsum("bhld,lrd->bhlr", query, table)``: the trace used to take the table as a column
  source, split it by columns, and the dry run then kept the whole attention replicated
  (share 0.69). The table is one every head reads: whole, its gradient all-reduced, and the
  attention is split by heads.
- Its conformer convolution module reads the channels across (a LayerNorm over them after the
  depthwise conv), so no convolution pair forms; its two pointwise convolutions (9% + 4.5% of
  the model) now take the per-layer fallback's exact split, output channels gathered, inside
  inferred plans too (wide enough ones: `tpkit.sources.infer._MIN_CONV_CHANNELS`).
- WavLM's attention reads its q / k / v / out linears' weights inside torch's
  ``multi_head_attention_forward`` (its gated relative position bias the call's per-head mask):
  it stayed whole (share 0.60); it is now split by heads (``mha_functional``).
- An audio tower the model's trace never ran (MOSS-Transcribe: its tower inputs could not be
  made up at full size) is planned on its own (`tpkit.plan.towers`).
"""

from __future__ import annotations

import copy
import traceback

from tests.test_families import check_parity

W2VB = ("wav2vec2-bert", "Wav2Vec2BertForSequenceClassification")


def w2vb_parity() -> dict:
    """Run on every rank: a Wav2Vec2-BERT wide enough for its pointwise convolutions to be
    gathered, tp=2 vs unsharded, and the plan."""
    try:
        import torch
        import transformers

        import tpkit
        from tests.test_families import _parity
        from tests.tiny import tiny_config
        from tests.tiny_inputs import family_inputs
        from tpkit.state import tp_state

        config = tiny_config(*W2VB)
        config.hidden_size = config.output_hidden_size = 128
        config.intermediate_size = 256
        config.num_attention_heads = 4
        config.num_hidden_layers = 1
        torch.manual_seed(0)
        ref = getattr(transformers, W2VB[1])(config).float().eval()
        x = family_inputs(ref, "audio-classification")
        model = tpkit.tensor_parallel(copy.deepcopy(ref))
        r = _parity(ref, model, x)
        r["styles"] = dict(tp_state(model).plan.items())
        return r
    except Exception:  # noqa: BLE001 - shown by the test
        return {"error": traceback.format_exc()}


def test_wav2vec2_bert_attention_and_convolutions_split_with_parity(ranks2):
    for r in check_parity(ranks2.run(w2vb_parity, timeout=300)):
        styles = r["styles"]
        attn = "wav2vec2_bert.encoder.layers.*.self_attn"
        assert styles[f"{attn}.linear_q"] == "colwise", styles
        assert styles[f"{attn}.linear_out"] == "rowwise", styles
        assert styles[f"{attn}.distance_embedding"] == "replicated_with_grad_allreduce", styles
        conv = "wav2vec2_bert.encoder.layers.*.conv_module"
        assert styles[f"{conv}.pointwise_conv1"] == "conv_colwise_gather", styles
        assert styles[f"{conv}.pointwise_conv2"] == "conv_colwise_gather", styles


def wavlm_parity() -> dict:
    try:
        from tests.test_families import family_parity
        from tests.tiny_family import build_family
        from tpkit.plan import derive_plan

        r = family_parity("wavlm", "WavLMForSequenceClassification", "audio-classification")
        model = build_family("wavlm", "WavLMForSequenceClassification", device="meta")
        r["styles"] = dict(derive_plan(model, "auto", 2).items())
        return r
    except Exception:  # noqa: BLE001 - shown by the test
        return {"error": traceback.format_exc()}


def test_wavlm_attention_split_by_heads_with_parity(ranks2):
    for r in check_parity(ranks2.run(wavlm_parity, timeout=300)):
        attn = "wavlm.encoder.layers.*.attention"
        assert r["styles"][attn] == "mha_functional", r["styles"]
        assert r["styles"][f"{attn}.q_proj"] == "colwise", r["styles"]
        assert r["styles"][f"{attn}.out_proj"] == "rowwise", r["styles"]
        assert any(n.startswith("wavlm.encoder.layers.0.attention.q_proj") for n in r["sharded"])


def test_full_size_speech_encoders_shard_at_least_90_percent(ranks2):
    from tests.parity import full_size_reports

    cases = [
        ("Wav2Vec2BertForSequenceClassification", {"model_type": "wav2vec2-bert"}),
        ("WavLMForCTC", {"model_type": "wavlm"}),
        (
            "MossTranscribeDiarizeForConditionalGeneration",
            {"model_type": "moss_transcribe_diarize"},
        ),
    ]
    for (name, _), r in zip(cases, full_size_reports(ranks2, cases), strict=True):
        assert "error" not in r, r.get("error")
        assert r["share"] >= 0.94, (name, r["share"], r["why"], r["whole"])
