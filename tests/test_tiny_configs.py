"""Issue 29: tiny configs and made-up inputs that did not run even unsharded (the coverage
sweep's "reference fails" / "unbuildable" rows). Pure, single process: the unsharded tiny model
of each fixed architecture runs a forward on `tests.tiny.family_inputs`."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import build_family, family_inputs, tiny_family_config

#: (model_type, class, family) fixed here, each with what had failed
FIXED = [
    # per-stage list fields set to a plain int by the shrinker (strict configs refuse it)
    ("pvt", "PvtForImageClassification", "image-classification"),
    ("pvt_v2", "PvtV2ForImageClassification", "image-classification"),
    ("levit", "LevitForImageClassification", "image-classification"),
    ("cvt", "CvtForImageClassification", "image-classification"),
    ("hiera", "HieraForImageClassification", "image-classification"),
    # a conv stem's patch and stages (or output stride) larger than the 32 px image
    ("convnext", "ConvNextForImageClassification", "image-classification"),
    ("convnextv2", "ConvNextV2ForImageClassification", "image-classification"),
    ("mobilevitv2", "MobileViTV2ForImageClassification", "image-classification"),
    # made-up features narrower than the conformer's feature projection (plan/inputs.py)
    ("wav2vec2-bert", "Wav2Vec2BertForCTC", "ctc"),
    ("seamless_m4t", "SeamlessM4TForSpeechToText", "speech-seq2seq"),
    ("seamless_m4t_v2", "SeamlessM4Tv2ForSpeechToText", "speech-seq2seq"),
]


@pytest.mark.parametrize(("model_type", "cls", "family"), FIXED, ids=[f[0] for f in FIXED])
def test_unsharded_reference_runs(model_type: str, cls: str, family: str) -> None:
    model = build_family(model_type, cls)
    with torch.no_grad():
        out = model(**family_inputs(model, family))
    first = out.logits if hasattr(out, "logits") else out[0]
    assert torch.isfinite(first).all()


def test_per_stage_lists_stay_lists() -> None:
    """A size field whose default is a per-stage list keeps one entry per stage, each shrunk."""
    config = tiny_family_config("pvt", "PvtForImageClassification")
    assert config.num_attention_heads == [4, 4, 4, 4]
    config = tiny_family_config("cvt", "CvtForImageClassification")
    assert config.embed_dim == [64, 64, 64] and config.num_heads == [4, 4, 4]


def test_image_fits_the_stages() -> None:
    """One-tower vision models keep their patch; the image is 4 patches (and one patch at the
    output stride) wide: LeViT's 16-px stem, MobileViT-v2's stride 32."""
    assert tiny_family_config("levit", "LevitForImageClassification").image_size == 64
    assert tiny_family_config("mobilevitv2", "MobileViTV2ForImageClassification").image_size == 64
    assert tiny_family_config("convnext", "ConvNextForImageClassification").patch_size == 4


def test_made_up_features_fit_the_feature_projection() -> None:
    """`synthesize_inputs` sizes a conformer's input_features by ``feature_projection_input_dim``
    (160: two stacked frames), not by its layers' convs, and the real model runs on them."""
    from tpkit.plan.inputs import synthesize_inputs

    model = build_family("wav2vec2-bert", "Wav2Vec2BertForCTC")
    _, made = synthesize_inputs(model, 2, 9)
    assert made["input_features"].shape[-1] == model.config.feature_projection_input_dim
    real = torch.randn(tuple(made["input_features"].shape))
    with torch.no_grad():
        assert torch.isfinite(model(input_features=real).logits).all()
