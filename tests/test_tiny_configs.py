"""Issue 29: tiny configs and made-up inputs that did not run even unsharded (the coverage
sweep's "reference fails" / "unbuildable" rows). Pure, single process: the unsharded tiny model
of each fixed architecture runs a forward on `tests.tiny_inputs.family_inputs`."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_family import build_family, tiny_family_config
from tests.tiny_inputs import family_inputs

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
    # made-up features narrower than the conformer's feature projection (trace/inputs.py)
    ("wav2vec2-bert", "Wav2Vec2BertForCTC", "ctc"),
    ("seamless_m4t", "SeamlessM4TForSpeechToText", "speech-seq2seq"),
    ("seamless_m4t_v2", "SeamlessM4Tv2ForSpeechToText", "speech-seq2seq"),
]
#: issue 29, second round: one architecture per kind of fix (`tests.tiny`), each with what had
#: failed unsharded in the coverage sweep
FIXED_2 = [
    # video towers read [batch, frames, channels, height, width] ("expected 5, got 4 / 3")
    ("videomae", "VideoMAEModel", "vision-encoder"),
    ("videoprism_vision_model", "VideoPrismVisionModel", "vision-encoder"),
    # Swin's 7-patch window on a 4 x 4 stage ("16 vs 49")
    ("swin", "SwinForImageClassification", "image-classification"),
    # audio layouts: a waveform with its channel, features as [batch, frames, bins], features
    # of stacked frames, a wrapper's encoder input
    ("omniasr_ctc", "OmniASRForCTC", "ctc"),
    ("omniasr", "OmniASRForConditionalGeneration", "speech-seq2seq"),  # + audio placeholders
    ("speech_to_text", "Speech2TextForConditionalGeneration", "speech-seq2seq"),
    ("granite_speech5_ctc", "GraniteSpeech5ForCTC", "ctc"),  # also a dict sub-config
    ("speech-encoder-decoder", "SpeechEncoderDecoderModel", "speech-seq2seq"),
    # sub-configs not shrunk or kept consistent: Dia's cross-attention, Kyutai's pad id and
    # Mimi's depthwise groups, Moonshine-Streaming's unset KV heads, Tipsv2's stage names
    ("dia", "DiaForConditionalGeneration", "speech-seq2seq"),
    ("kyutai_speech_to_text", "KyutaiSpeechToTextForConditionalGeneration", "speech-seq2seq"),
    ("moonshine_streaming", "MoonshineStreamingForConditionalGeneration", "speech-seq2seq"),
    ("tipsv2", "Tipsv2Model", "dual-encoder"),
    # EfficientNet's top conv width vs its BatchNorm; ALIGN's NaN image embedding
    ("efficientnet", "EfficientNetForImageClassification", "image-classification"),
    ("align", "AlignModel", "dual-encoder"),
    # NaFlex patches, Llama-4's pixel-shuffle adapter, Mllama's tiles
    ("siglip2", "Siglip2ForImageClassification", "image-classification"),
    ("llama4", "Llama4VisionModel", "vision-encoder"),
    ("mllama", "MllamaVisionModel", "vision-encoder"),
    # placeholders counted through an inner model (and one image per row as 5-D)
    ("modernvbert", "ModernVBertForMaskedLM", "masked-lm"),
    ("shieldgemma2", "ShieldGemma2ForImageClassification", "image-classification"),
    # a masked LM's bidirectional Reformer, ESM's pad id, BLIP-2's retrieval Q-Former
    ("reformer", "ReformerForMaskedLM", "masked-lm"),
    ("esm", "EsmForMaskedLM", "masked-lm"),
    ("blip-2", "Blip2ForImageTextRetrieval", "dual-encoder"),
]

#: issue 29, image-text-to-text: one VLM per kind of fix, each with what had failed unsharded
FIXED_VLM = [
    # per-layer override tables keyed past the 2 tiny layers ("keys must be in [0, 2)")
    ("gemma4", "Gemma4ForConditionalGeneration", "image-text-to-text"),
    # per-layer lists left at the default layer count (72 ``kv_source_layers`` for 2 layers)
    ("mistral_large4", "MistralLarge4ForConditionalGeneration", "image-text-to-text"),
    # mrope sections checked as the config is built; and scaled to a partial rotary
    ("cosmos3_edge", "Cosmos3EdgeForConditionalGeneration", "image-text-to-text"),
    ("glm4v_moe", "Glm4vMoeForConditionalGeneration", "image-text-to-text"),
    # a width whose default is 0 (no rotary) kept 0
    ("glm5_next", "Glm5NextForConditionalGeneration", "image-text-to-text"),
    # a tower's output width and another sub-config's tower layer indexes, checked at build
    ("llava_onevision1_5", "LlavaOnevision15ForConditionalGeneration", "image-text-to-text"),
    ("molmo2", "Molmo2ForConditionalGeneration", "image-text-to-text"),
    # a top-k its default leaves None
    ("diffusion_gemma", "DiffusionGemmaForBlockDiffusion", "image-text-to-text"),
    # no image token id in the default config, and no text ids made up
    ("instructblip", "InstructBlipForConditionalGeneration", "image-text-to-text"),
    # any-resolution tiles and the image sizes get_image_features needs
    ("llava_next", "LlavaNextForConditionalGeneration", "image-text-to-text"),
]
#: issue 29, image-text-to-text round 3: one architecture per kind of fix (`tests.tiny`), each
#: with what had failed unsharded in the coverage sweep
FIXED_VLM_3 = [
    # a sub-config's own default bug patched by its model type (rope_parameters {} for the
    # layer types), an MLA head that is its nope + rope parts
    ("cohere_compass", "CohereCompassForConditionalGeneration", "image-text-to-text"),
    ("mistral4", "Mistral4ForCausalLM", "image-text-to-text"),
    # an audio frame mask the code reads unconditionally (Apertus-1.5's code ranges: below,
    # its forward takes 20 s)
    ("qwen2_5_omni_thinker", "Qwen2_5OmniThinkerForConditionalGeneration", "image-text-to-text"),
    # a tower width left at the text model's default, a projector's width at the tower's, a
    # table of queries by patch count, out-of-range hidden-state indexes
    ("florence2", "Florence2ForConditionalGeneration", "image-text-to-text"),
    ("kimi_k25", "Kimi_K25ForConditionalGeneration", "image-text-to-text"),  # + patch layout
    ("aria", "AriaForConditionalGeneration", "image-text-to-text"),
    ("vipllava", "VipLlavaForConditionalGeneration", "image-text-to-text"),
    # placeholders re-counted against the tower's rows; tile mask; a position mask; a video
    # given as pixel_values; a second (high-res) image input
    ("hunyuan_vl", "HunYuanVLForConditionalGeneration", "image-text-to-text"),
    ("granite_docling", "GraniteDoclingForConditionalGeneration", "image-text-to-text"),
    ("kosmos-2", "Kosmos2ForConditionalGeneration", "image-text-to-text"),
    ("instructblipvideo", "InstructBlipVideoForConditionalGeneration", "image-text-to-text"),
    ("deepseek_vl_hybrid", "DeepseekVLHybridForConditionalGeneration", "image-text-to-text"),
    # patches of two frames (Muse), a waveform cut to whole codec frames
    ("muse_spark", "MuseSparkForConditionalGeneration", "image-text-to-text"),
    # stacked audio features, half as many frames, with a frame mask
    ("fun_asr_nano", "FunAsrNanoForConditionalGeneration", "speech-seq2seq"),
]
#: issue 29, round 4: rows whose unsharded reference could not run, one per kind of fix, each
#: with what had failed
FIXED_4 = [
    # a sibling tower's width copied in a nested sub-config (diarization head vs its encoder)
    ("nemo_speechlm", "Nemotron3_5TranscribeForConditionalGeneration", "seq2seq"),
    # features padded to whole chunks of 2 x n_window frames; the audio projector's output_dim
    ("qwen3_asr", "Qwen3ASRForConditionalGeneration", "speech-seq2seq"),
    # patch_size is the sub-ViTs' image size: 8-px patches of the 32-px image
    ("depth_pro", "DepthProModel", "vision-encoder"),
    # cross-attention images [batch, images, C, H, W] with their image_attention_mask
    ("idefics", "IdeficsForVisionText2Text", "image-text-to-text"),
    # per-token layout boxes (and the page image) a document model reads
    ("udop", "UdopForConditionalGeneration", "image-text-to-text"),
    # a SAM neck's last conv stage feeds the sibling encoder
    ("unlimited_ocr", "UnlimitedOcrForConditionalGeneration", "image-text-to-text"),
    ("deepseek_ocr2", "DeepseekOcr2ForConditionalGeneration", "image-text-to-text"),
    # flattened patches led by their row and column
    ("pix2struct", "Pix2StructForConditionalGeneration", "image-text-to-text"),
    # blocks of merged patches, channels last; the head's unpadded vocabulary
    ("inkling2", "Inkling2ForConditionalGeneration", "image-text-to-text"),
    # each audio chunk's length in waveform samples
    ("dots3_note", "Dots3NoteForConditionalGeneration", "image-text-to-text"),
    # configs whose model did not build: deepstack map; VQ tokenizers' vocabulary maps
    ("granite4_vision", "Granite4VisionForConditionalGeneration", "image-text-to-text"),
    ("chameleon", "ChameleonForConditionalGeneration", "image-text-to-text"),
    ("emu3", "Emu3ForConditionalGeneration", "image-text-to-text"),
    # a timm backbone (timm is not installed) built by transformers' own ResNet, shrunk
    ("detr", "DetrModel", "vision-encoder"),
    ("deformable_detr", "DeformableDetrModel", "vision-encoder"),
]
#: issue 29, round 5: image-text-to-text rows whose inputs the trace could not make, each with
#: what had failed unsharded
FIXED_5 = [
    # an action-chunk policy's state, noise, timestep and camera prefix ("normal_kernel_cpu"
    # not implemented for 'Long'; no pixels, so no prefix cache: "'NoneType' object has no
    # attribute 'get_seq_length'")
    ("pi0", "PI0ForConditionalGeneration", "image-text-to-text"),
    ("pi05", "PI05ForConditionalGeneration", "image-text-to-text"),
    # patches of two frames, channels last, which the tower folds 4 x 4 then 2 x 2 x 2 (its
    # layer plan needs scipy's linear_sum_assignment: scipy is in the test extra)
    ("inkling_mm_model", "InklingForConditionalGeneration", "image-text-to-text"),
]
ALL_FIXED = FIXED + FIXED_2 + FIXED_VLM + FIXED_VLM_3 + FIXED_4 + FIXED_5


def _case_id(case) -> str:
    return case.values[1] if hasattr(case, "values") else case[1]


@pytest.mark.parametrize(
    ("model_type", "cls", "family"), ALL_FIXED, ids=[_case_id(f) for f in ALL_FIXED]
)
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
    from tpkit.trace.inputs import synthesize_inputs

    model = build_family("wav2vec2-bert", "Wav2Vec2BertForCTC")
    _, made = synthesize_inputs(model, 2, 9)
    assert made["input_features"].shape[-1] == model.config.feature_projection_input_dim
    real = torch.randn(tuple(made["input_features"].shape))
    with torch.no_grad():
        assert torch.isfinite(model(input_features=real).logits).all()


def test_masking_noise_is_given() -> None:
    """ViT-MAE masks patches by random noise unless given one: `family_inputs` gives it, so two
    runs on the same inputs (the reference and the tensor-parallel one) mask the same patches."""
    model = build_family("vit_mae", "ViTMAEModel")
    x = family_inputs(model, "vision-encoder")
    assert x["noise"].shape == (2, 16)
    with torch.no_grad():
        assert torch.equal(model(**x).last_hidden_state, model(**x).last_hidden_state)


def test_windows_and_video_fit_the_tiny_image() -> None:
    """Swin's window is 2 patches and its image wide enough for a window at its last stage;
    a video config has 2 temporal patches and a tubelet at most half the image."""
    config = tiny_family_config("swin", "SwinModel")
    assert config.window_size == 2 and config.image_size == 4 * 2 * 2**3
    config = tiny_family_config("vivit", "VivitModel")
    assert config.num_frames == 4 and config.tubelet_size == [2, 16, 16]
    config = tiny_family_config("videoprism", "VideoPrismClipModel").vision_config
    assert config.tubelet_size == [1, 16, 16] and config.num_spatial_layers == 2


def test_wav2vec2_feature_extractor_is_tiny() -> None:
    """The conv feature extractor is capped at 32 channels and its positional conv at 16 taps:
    the default 512 channels made these rows 20 times slower than the rest."""
    config = tiny_family_config("wav2vec2", "Wav2Vec2ForCTC")
    assert max(config.conv_dim) == 32 and config.num_conv_pos_embeddings == 16


def test_vlm_layer_fields_follow_the_tiny_layers() -> None:
    """Per-layer tables keep only the 2 tiny layers (and none of their unshrunk sizes), per-layer
    lists have 2 entries, and the mrope sections add up to half the (partial) rotary width."""
    text = tiny_family_config("gemma4", "Gemma4ForConditionalGeneration").text_config
    assert [layer.head_dim for layer in text.per_layer_config] == [16, 16]  # no 512 override
    text = tiny_family_config("mistral_large4", "MistralLarge4ForConditionalGeneration").text_config
    assert text.kv_source_layers == [0, 1]
    text = tiny_family_config("glm4v_moe", "Glm4vMoeForConditionalGeneration").text_config
    rope, head = text.rope_parameters, text.hidden_size // text.num_attention_heads
    assert sum(rope["mrope_section"]) == int(head * rope["partial_rotary_factor"]) // 2


def test_vlm_round3_config_relations() -> None:
    """Config relations kept as the tiny config is built (cheap: no model)."""
    config = tiny_family_config("apertus1p5", "Apertus1p5ForConditionalGeneration")
    end = config.audio_token_offset + config.audio_config.codebook_size
    assert (
        config.image_token_offset + config.vision_config.codebook_size == config.audio_token_offset
    )
    assert end <= config.text_config.vocab_size
    config = tiny_family_config("vipllava", "VipLlavaForConditionalGeneration")
    assert config.vision_feature_layer == [-1, -2]  # a top-level list: [-2, -5, -8, -11, 6]
    config = tiny_family_config("aria", "AriaForConditionalGeneration")
    assert config.projector_patch_to_query_dict == {16: 4}
    assert config.max_value_projector_patch_to_query_dict == 4
    text = tiny_family_config("mistral4", "Mistral4ForCausalLM")
    assert text.head_dim == text.qk_nope_head_dim + text.qk_rope_head_dim == 32


def test_ctc_full_config_has_a_vocabulary():
    """Wav2Vec2-BERT's and -Conformer's default configs leave ``vocab_size`` None, which their
    CTC head refuses: the full-size share of their CTC rows could not be measured."""
    from tests.tiny import full_config

    for model_type, cls in (
        ("wav2vec2-bert", "Wav2Vec2BertForCTC"),
        ("wav2vec2-conformer", "Wav2Vec2ConformerForCTC"),
    ):
        assert full_config(model_type, cls).vocab_size == 32


def test_block_diffusion_canvas_is_given():
    """DiffusionGemma draws its decoder canvas with ``torch.randint`` when none is given: each
    rank and each run saw other tokens (its sweep row's 1.21 "mismatch")."""
    from tests.tiny_family import build_family
    from tests.tiny_inputs import family_inputs

    model = build_family("diffusion_gemma", "DiffusionGemmaForBlockDiffusion", device="meta")
    x = family_inputs(model, "image-text-to-text")
    assert x["decoder_input_ids"].shape == (x["input_ids"].shape[0], model.config.canvas_length)


def test_round4_config_relations() -> None:
    """Relations between (nested) sub-configs kept as the tiny config is built (cheap: no model)."""
    config = tiny_family_config("nemo_speechlm", "Nemotron3_5TranscribeForConditionalGeneration")
    diarization = config.audio_config.diarization_config
    assert diarization.head_config.audio_hidden_size == diarization.audio_config.hidden_size
    assert len(config.text_config.layers_block_type) == 3  # one layer of each kind, not 52
    config = tiny_family_config(
        "deepseek_ocr2", "DeepseekOcr2ForConditionalGeneration"
    ).vision_config
    assert config.sam_config.downsample_channels[-1] == config.encoder_config.hidden_size
    config = tiny_family_config(
        "unlimited_ocr", "UnlimitedOcrForConditionalGeneration"
    ).vision_config
    assert config.sam_config.downsample_channels[-1] == config.encoder_config.hidden_size
    config = tiny_family_config("depth_pro", "DepthProModel")
    assert config.image_model_config.image_size == config.patch_size == 8
    config = tiny_family_config("inkling2", "Inkling2ForConditionalGeneration").text_config
    assert config.unpadded_vocab_size == config.vocab_size
    config = tiny_family_config("qwen3_asr", "Qwen3ASRForConditionalGeneration")
    assert config.audio_config.output_dim == config.text_config.hidden_size


def test_timm_backbone_is_replaced() -> None:
    """Without timm, DETR's family builds transformers' own ResNet, with a stage per timm
    ``out_indices`` entry, tiny."""
    import importlib.util

    if importlib.util.find_spec("timm") is not None:
        pytest.skip("timm is installed: its backbone is kept")
    config = tiny_family_config("deformable_detr", "DeformableDetrModel")
    assert config.backbone_config.model_type == "resnet"
    assert config.backbone_config.out_features == ["stage2", "stage3", "stage4"]
    assert max(config.backbone_config.hidden_sizes) <= 64


def test_document_and_patch_inputs() -> None:
    """UDOP's boxes are in the page's [0, 1] units, each x0 <= x1 and y0 <= y1, with its page
    image; Pix2Struct's flattened patches lead with their 1-based row and column."""
    x = family_inputs(build_family("udop", "UdopForConditionalGeneration"), "image-text-to-text")
    boxes = x["bbox"]
    assert boxes.shape == (*x["input_ids"].shape, 4) and x["pixel_values"].ndim == 4
    assert bool((boxes >= 0).all() and (boxes <= 1).all())
    assert bool((boxes[..., 2] >= boxes[..., 0]).all() and (boxes[..., 3] >= boxes[..., 1]).all())
    model = build_family("pix2struct", "Pix2StructForConditionalGeneration")
    patches = family_inputs(model, "image-text-to-text")["flattened_patches"]
    assert patches.shape[-1] == 2 + model.config.vision_config.patch_embed_hidden_size
    assert patches[0, :, :2].min() == 1 and patches[0, :, :2].max() == 4


def test_a_patch_value_is_not_changed_by_the_config_it_builds():
    """A sub-config's patch dict handed to a config that adds to it in place (Cohere-Compass's
    rope parameters get ``mrope_section``) made the second build in one process fail: a sweep
    rank that built the tiny model twice raised while the other waited in a collective."""
    first = tiny_family_config("cohere_compass", "CohereCompassForConditionalGeneration")
    second = tiny_family_config("cohere_compass", "CohereCompassForConditionalGeneration")
    assert first.to_dict() == second.to_dict()


def test_speech_tokenizer_conv_stacks_are_shrunk():
    """VibeVoice's speech tokenizers doubled 32 filters over 7 stages of 3 to 8 blocks: a 1B
    "tiny" model (687M for VibeVoice-ASR) that ran the sweep out of time."""
    import torch

    for model_type, class_name in (
        ("vibevoice", "VibeVoiceForConditionalGeneration"),
        ("vibevoice_asr", "VibeVoiceAsrForConditionalGeneration"),
    ):
        with torch.device("meta"):
            model = build_family(model_type, class_name, device="meta")
        assert sum(p.numel() for p in model.parameters()) < 10_000_000, model_type


def test_action_chunk_policy_inputs() -> None:
    """PI0's forward draws its noise and a Beta timestep when not given them, and its robot
    state is floats: the inputs give all three, a camera per row with its mask, and the image
    placeholders of the PaliGemma inside (its sub-config's token), so two forwards under other
    global seeds (the reference and the tensor-parallel run) predict the same velocities."""
    model = build_family("pi0", "PI0ForConditionalGeneration")
    config = model.config
    x = family_inputs(model, "image-text-to-text")
    assert x["state"].dtype == torch.float32 and x["state"].shape == (2, config.max_state_dim)
    assert x["noise"].shape == (2, config.chunk_size, config.max_action_dim)
    assert x["timestep"].shape == (2,) and bool(((x["timestep"] > 0) & (x["timestep"] < 1)).all())
    assert x["pixel_values"].shape[:2] == (2, 1) and bool(x["pixel_attention_mask"].all())
    tokens = config.vlm_config.text_config.num_image_tokens  # (32 px / 8 px patches)**2
    assert ((x["input_ids"] == config.vlm_config.image_token_id).sum(1) == tokens).all()
    with torch.no_grad():
        torch.manual_seed(0)
        first = model(**x).logits
        torch.manual_seed(1)
        assert torch.equal(first, model(**x).logits)


def test_frame_patches_fit_the_folding_tower() -> None:
    """Inkling's vision tower reads patches of ``temporal_patch_size`` frames, channels last, one
    text token each: the made-up 32-px images are cut into 8-px squares, each repeated over
    the 2 frames, with one placeholder per patch."""
    model = build_family("inkling_mm_model", "InklingForConditionalGeneration")
    vision = model.config.vision_config
    x = family_inputs(model, "image-text-to-text")
    patch = vision.patch_size
    assert x["pixel_values"].shape == (32, vision.temporal_patch_size, patch, patch, 3)
    assert torch.equal(x["pixel_values"][:, 0], x["pixel_values"][:, 1])  # a still image
    assert int((x["input_ids"] == model.config.image_token_id).sum()) == 32
