"""Grid VLM towers traced, not the text-only retry (issue 29, continued).

Before, GLM-4V, Qwen3-VL, VideoLLaMA-3 and PaddleOCR-VL fell back to the text-only trace and
their vision towers stayed whole (tower share split, tiny family models on meta, tp=2: 0.0,
0.035, 0.0, 0.0). The causes, each fixed by a general rule:

- GLM-4V / Qwen3-VL: the tiny builds handed the text model 4096 / 3584-wide features against
  its 64-wide embeddings (``out_hidden_size`` left at its default) and Qwen3-VL's deepstack taps
  (blocks 8, 16, 24) named no block of the 2-block tower (`tests.tiny.OUTPUT_WIDTHS`,
  `tests.tiny.LAYER_INDEXES`);
- VideoLLaMA-3's forward takes each image's merge size (``image_merge_sizes``): now made up;
- PaddleOCR-VL's patch embedding takes each patch as [channels, patch, patch], not flattened:
  the trace retries with the patches unflattened (`tpkit.trace.inputs.unflattened_patches`)
  before it keeps to the text, and its rotary's code-default sections are scaled to the tiny
  head (`tests.tiny_family._fit_rotary_sections`).

UnlimitedOCR's towers (SAM and CLIP encoders) were left whole too: its trace with shadow values
failed (a real tensor met a fake one in an ``&``) and kept to the text. Since metadata reads
(``x.shape``) pass the shadow values untouched (`tpkit.trace.shadow.metadata_only`), it runs.

Parity: tp=2 against the unsharded tiny model, first output and every gradient within 1e-5,
the tower's linears asserted split (`tests.test_families.family_parity`).
"""

from __future__ import annotations

import pytest

from tests.test_families import _check, family_parity

GLM4V = ("glm4v", "Glm4vForConditionalGeneration", "image-text-to-text")
QWEN3_VL = ("qwen3_vl", "Qwen3VLForConditionalGeneration", "image-text-to-text")
VIDEO_LLAMA_3 = ("video_llama_3", "VideoLlama3ForConditionalGeneration", "image-text-to-text")
PADDLE = ("paddleocr_vl", "PaddleOCRVLForConditionalGeneration", "image-text-to-text")
UNLIMITED_OCR = ("unlimited_ocr", "UnlimitedOcrForConditionalGeneration", "image-text-to-text")


def _traced_tower(arch: tuple[str, str, str]) -> dict:
    """The tiny model on meta, planned at tp=2: whether the trace kept to the text, and which
    vision-side modules the plan splits."""
    from tests.tiny_family import build_family
    from tpkit.plan import derive_plan
    from tpkit.trace.analysis import Analysis

    model = build_family(*arch[:2], device="meta")
    analysis = Analysis(model)
    plan = derive_plan(model, "auto", 2, analysis=analysis)
    text_only = analysis.recipe.text_only  # the retry's own record
    keys = [k for k in sorted(plan.keys()) if any(w in k for w in ("visual", "vision_"))]
    return {"text_only": text_only, "tower": keys, "model": model}


@pytest.mark.parametrize("arch", [GLM4V, PADDLE], ids=lambda a: a[0])
def test_grid_vlm_tower_is_traced(arch):
    """Pure, on meta: the trace runs the tower (no text-only retry) and the plan splits its
    attention and MLP linears (Qwen3-VL and VideoLLaMA-3: by their tp=2 parity below)."""
    r = _traced_tower(arch)
    assert not r["text_only"], r["tower"]
    assert any("attn" in k for k in r["tower"]), r["tower"]
    assert any("mlp" in k for k in r["tower"]), r["tower"]


def test_merge_sizes_and_unflattened_patches_are_made_up():
    """Pure: VideoLLaMA-3 gets one merge size per image; PaddleOCR-VL, after its trace,
    keeps its patches as [patches, channels, patch, patch], its grid and placeholders
    unchanged."""
    from tests.tiny_family import build_family
    from tpkit.trace.inputs import GRID_IMAGE, InputRecipe, synthesize_inputs, unflattened_patches

    video = build_family(*VIDEO_LLAMA_3[:2], device="meta")
    _, kw = synthesize_inputs(video, 3, 7)
    assert kw["image_merge_sizes"].tolist() == [1, 1, 1]
    assert kw["image_grid_thw"].tolist() == [[1, GRID_IMAGE, GRID_IMAGE]] * 3

    paddle = build_family(*PADDLE[:2], device="meta")
    v = paddle.config.vision_config
    _, flat = synthesize_inputs(paddle, 3, 7)
    recipe = InputRecipe()
    with unflattened_patches(paddle, recipe) as grid:
        assert grid
    _, kw = synthesize_inputs(paddle, 3, 7, recipe)
    side = GRID_IMAGE * v.spatial_merge_size
    assert tuple(kw["pixel_values"].shape) == (3 * side * side, v.num_channels, 8, 8)
    assert tuple(flat["pixel_values"].shape) == (3 * side * side, v.num_channels * 64)
    assert kw["image_grid_thw"].tolist() == flat["image_grid_thw"].tolist()
    assert kw["input_ids"].tolist() == flat["input_ids"].tolist()


TOWER_PARTS = {
    "qwen3_vl": ("blocks.0.attn.qkv", "blocks.1.mlp.linear_fc2", "deepstack_merger_list.0."),
    "video_llama_3": ("layers.0.self_attn.q_proj", "layers.1.mlp.fc2", "projector.readout.0"),
    "unlimited_ocr": ("sam_encoder.layers.0.mlp.lin1", "vision_encoder.encoder.layers.0.mlp.fc1"),
}


@pytest.mark.parametrize("arch", [QWEN3_VL, VIDEO_LLAMA_3, UNLIMITED_OCR], ids=lambda a: a[0])
def test_grid_vlm_tower_split_tp2(ranks2, arch):
    r = _check(ranks2.run(family_parity, *arch))
    for part in TOWER_PARTS[arch[0]]:
        assert any(part in n for n in r["sharded"]), (part, sorted(r["sharded"]))
