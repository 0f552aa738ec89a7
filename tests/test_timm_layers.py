"""Issue 29: the rows built of timm models (TimmWrapper, TimmBackbone, and the VLMs whose
vision tower is one: FastVLM's FastViT, Perception-LM's PE-core ViT, Gemma-3n's MobileNet-V5).

timm needs torchvision, which cannot be installed beside this venv's torch build, so these rows
are measured in a second venv with timm (`benchmarks.coverage` there); here, without timm, what
the sweep needs of them is checked: a row that needs timm says so in one line (not transformers'
several-line "requires the PIL library" first), the tiny configs name tiny timm towers (a timm
model is built by name, with no size field a shrinker could read), the full-size defaults that
did not build are repaired, and a backbone's tuple of feature maps is compared whole."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.tiny import NeedsTimm, check_timm, full_config, timm_models
from tests.tiny_family import build_family, tiny_family_config

HAS_TIMM = importlib.util.find_spec("timm") is not None


def test_timm_models_are_found_by_field_on_any_sub_config():
    """A timm wrapper's ``architecture`` with ``model_args`` (Gemma-3n's own vision config
    too), a timm backbone's ``backbone``, ``use_timm_backbone``: each named with where it sits;
    a model of none names nothing."""
    from transformers import (
        DetrConfig,
        FastVlmConfig,
        Gemma3nConfig,
        LlamaConfig,
        TimmBackboneConfig,
        TimmWrapperConfig,
    )

    assert timm_models(TimmWrapperConfig(architecture="test_vit")) == ["config: test_vit"]
    assert timm_models(FastVlmConfig()) == ["config.vision_config: fastvit_mci3"]
    assert timm_models(Gemma3nConfig()) == ["config.vision_config: mobilenetv5_300m_enc"]
    assert timm_models(TimmBackboneConfig(backbone="resnet18")) == ["config: resnet18"]
    assert "resnet50" in " ".join(timm_models(DetrConfig(use_timm_backbone=True)))
    assert timm_models(LlamaConfig()) == []
    assert timm_models(DetrConfig(use_timm_backbone=False, backbone_config=None)) == []


@pytest.mark.skipif(HAS_TIMM, reason="timm is installed: these rows build")
@pytest.mark.parametrize(
    ("model_type", "class_name", "name"),
    [
        ("timm_wrapper", "TimmWrapperModel", "test_resnet"),
        ("timm_backbone", "TimmBackbone", "test_resnet"),
        ("fast_vlm", "FastVlmForConditionalGeneration", "fastvit_mci3"),
        ("gemma3n", "Gemma3nForConditionalGeneration", "mobilenetv5_300m_enc"),
    ],
)
def test_a_row_that_needs_timm_says_so_in_one_line(model_type, class_name, name):
    """Without timm, the tiny build and the full-size config both raise `NeedsTimm`: one line
    naming the timm model (the sweep's "why" cell); transformers' own error named PIL first."""
    with pytest.raises(NeedsTimm, match=rf"^needs timm \(.*{name}.*\)") as tiny:
        build_family(model_type, class_name)
    assert "\n" not in str(tiny.value) and "PIL" not in str(tiny.value)
    with pytest.raises(NeedsTimm, match="needs timm"):
        full_config(model_type, class_name)


def test_a_model_without_timm_models_is_not_stopped():
    """`check_timm` stops only configs that build timm models: DETR's default, whose timm
    ResNet-50 backbone is swapped for transformers' own where timm is missing, still builds."""
    check_timm(full_config("detr", "DetrModel"))
    check_timm(tiny_family_config("llava", "LlavaForConditionalGeneration"))


def test_tiny_vlm_towers_are_tiny_timm_models():
    """Each VLM's timm tower is shrunk through the ``model_args`` timm builds it with, and what
    the model reads of it agrees: Perception-LM's projector is ``embed_dim`` wide, Gemma-3n's
    2048-channel MobileNet-V5 output pooled to 2 x 2 = its soft tokens per image, and its
    per-layer token table over the tiny vocabulary (134 M of the 136 M parameters before)."""
    fast = tiny_family_config("fast_vlm", "FastVlmForConditionalGeneration").vision_config
    assert fast.architecture == "fastvit_mci3" and fast.model_args["layers"] == (2, 2)
    assert fast.model_args["inference_mode"]  # the published, reparameterised layout
    plm = tiny_family_config("perception_lm", "PerceptionLMForConditionalGeneration")
    args = plm.vision_config.model_args
    assert plm.vision_config.architecture == "vit_pe_core_large_patch14_336"
    assert args["embed_dim"] == 64 and args["depth"] == 2
    assert args["img_size"] == (plm.vision_config.image_size,) * 2
    g3n = tiny_family_config("gemma3n", "Gemma3nForConditionalGeneration")
    assert g3n.vision_config.model_args["msfa_output_resolution"] ** 2 == 4
    assert g3n.vision_soft_tokens_per_image == 4 and g3n.vision_config.hidden_size == 2048
    assert g3n.text_config.vocab_size_per_layer_input == g3n.text_config.vocab_size
    assert len(g3n.vision_config.model_args["block_args"]) == 3  # 3 stages, each built by timm


def test_full_size_defaults_that_did_not_build_are_repaired(monkeypatch):
    """TimmBackbone's default names no timm model (DETR's family names ResNet-50, 4 stages);
    Perception-LM's default tower has no ``model_args``, from whose ``embed_dim`` its projector
    is built: the published PE-core-L tower. Read off the configs (timm's check set aside, so
    this runs without timm too); with timm, both build on the meta device."""
    import transformers

    monkeypatch.setattr("tests.tiny.check_timm", lambda config: None)
    log: list[str] = []
    plm = full_config("perception_lm", "PerceptionLMForConditionalGeneration", log)
    assert plm.vision_config.architecture == "vit_pe_core_large_patch14_336"
    assert plm.vision_config.model_args["embed_dim"] == 1024
    assert any("vit_pe_core_large" in r for r in log), log
    backbone = full_config("timm_backbone", "TimmBackbone")
    assert backbone.backbone == "resnet50" and list(backbone.out_indices) == [1, 2, 3, 4]
    if HAS_TIMM:
        with torch.device("meta"):
            model = transformers.PerceptionLMForConditionalGeneration(plm)
            assert model.model.multi_modal_projector.linear_1.in_features == 1024
            assert len(transformers.TimmBackbone(backbone).channels) == 4


def test_a_backbones_feature_maps_are_compared_whole():
    """The sweep compares a model's first output; a backbone's is a tuple of feature maps (one
    per stage: TimmBackbone's BackboneOutput), which had no ``detach`` ("'tuple' object has
    no attribute 'detach'"): all stages flattened into one tensor, so a wrong early stage
    counts too."""
    from transformers.modeling_outputs import BackboneOutput

    from benchmarks.coverage import first_output

    maps = (torch.ones(2, 4, 8, 8), torch.full((2, 8, 4, 4), 2.0))
    out = first_output(BackboneOutput(feature_maps=maps))
    assert out.shape == (2 * 4 * 64 + 2 * 8 * 16,) and out[0] == 1 and out[-1] == 2
    bad = first_output(BackboneOutput(feature_maps=(maps[0] + 1, maps[1])))
    assert (bad - out).abs().max() == 1
    logits = torch.zeros(2, 3)
    assert first_output(type("Out", (), {"logits": logits})()) is logits
