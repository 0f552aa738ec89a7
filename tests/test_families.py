"""Every model family, towers split too (issue 29).

A multimodal model's vision and audio towers run in the trace only when their inputs are made up
with the token ids (`tpkit.trace.inputs`): before, a tiny LLaVA's trace fed ``input_ids`` alone,
its CLIP vision tower and projector never ran, and inference left every one of their linears
whole ("its output reaches no row-parallel partner"). Each check here is tp=2 against the
unsharded tiny model (`tests.tiny_family.build_family`, inputs from `tests.tiny_inputs.family_inputs`): the
first output and every gradient within 1e-5, and the tower's linears asserted split.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

TOL = 1e-5
LLAVA = ("llava", "LlavaForConditionalGeneration", "image-text-to-text")


def _first(out):
    return out.logits if hasattr(out, "logits") else out[0]


def _split_family(model_type: str, class_name: str, family: str) -> tuple:
    """The tiny model, its inputs and ``tensor_parallel`` of a copy (run on every rank)."""
    import tpkit
    from tests.tiny_family import build_family
    from tests.tiny_inputs import family_inputs

    ref = build_family(model_type, class_name)
    x = family_inputs(ref, family)
    return ref, tpkit.tensor_parallel(copy.deepcopy(ref)), x


def family_parity(model_type: str, class_name: str, family: str) -> dict:
    """Run on every rank: max |diff| of the first output and of every gradient (backward of a
    fixed random projection of it), tp=2 vs unsharded, and which >=2-D weights are sharded."""
    return _parity(*_split_family(model_type, class_name, family))


def _parity(ref: torch.nn.Module, model: torch.nn.Module, x: dict) -> dict:
    """`family_parity` on a split already made."""
    w = None
    outs = []
    for m in (ref, model):
        out = _first(m(**x))
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)) if w is None else w
        (out * w).sum().backward()
        outs.append(out.detach())
    ref_params = dict(ref.named_parameters())
    grad, top, missing, sharded = 0.0, 0.0, [], []
    for name, p in model.named_parameters():
        g, want = p.grad, ref_params[name].grad
        if (g is None) != (want is None):
            missing.append(name)
            continue
        if isinstance(p, DTensor) and not p.placements[0].is_replicate() and p.ndim >= 2:
            sharded.append(name)
        if g is not None:
            g = g.full_tensor() if isinstance(g, DTensor) else g
            grad, top = max(grad, (g - want).abs().max().item()), max(top, want.abs().max().item())
    return {
        "out": (outs[1] - outs[0]).abs().max().item(),
        "scale": outs[0].abs().max().item(),
        "grad": grad,
        "grad_scale": top,
        "missing": missing,
        "sharded": sharded,
    }


def check_parity(results: list[dict]) -> list[dict]:
    """Assert each rank's `_parity` result (or its ``error`` traceback): output and every
    gradient within `TOL` of the unsharded model's, relative to their scale above 1, and no
    parameter with a gradient on one side only. Returns the results for the test's own checks."""
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["out"] <= TOL * max(1.0, r["scale"]), r
        assert r["grad"] <= TOL * max(1.0, r["grad_scale"]), r
        assert not r["missing"], r
    return results


def _check(results: list[dict]) -> dict:
    return check_parity(results)[0]


def test_vlm_trace_inputs_reach_the_vision_tower():
    """Pure: the made-up trace inputs of a VLM carry pixel values sized from its vision config."""
    from tests.tiny_family import build_family
    from tpkit.trace.inputs import synthesize_inputs

    model = build_family(*LLAVA[:2], device="meta")
    _, kwargs = synthesize_inputs(model, 2, 9)
    assert kwargs["pixel_values"].shape == (2, 3, 32, 32)
    assert kwargs["input_ids"].shape == (2, 9)


@pytest.fixture(scope="module")
def llava(ranks2) -> list[tuple]:
    """Each rank's (parity, tokens) of one tp=2 split of the tiny LLaVA."""
    return ranks2.run(vlm_parity_and_generate, *LLAVA)


def test_llava_vision_tower_and_projector_split_tp2(llava):
    r = _check([parity for parity, _ in llava])
    sharded = set(r["sharded"])
    for name in (
        "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight",
        "model.vision_tower.encoder.layers.1.self_attn.out_proj.weight",
        "model.vision_tower.encoder.layers.0.mlp.fc1.weight",
        "model.vision_tower.encoder.layers.1.mlp.fc2.weight",
        "model.multi_modal_projector.linear_1.weight",
        "model.multi_modal_projector.linear_2.weight",
        "model.language_model.layers.0.mlp.down_proj.weight",
    ):
        assert name in sharded, (name, sorted(sharded))


@pytest.mark.parametrize(
    "arch",
    [
        ("clip", "CLIPModel", "dual-encoder"),
        ("whisper", "WhisperForConditionalGeneration", "speech-seq2seq"),
    ],
    ids=lambda a: a[0],
)
def test_dual_encoder_and_speech_towers_split_tp2(ranks2, arch):
    r = _check(ranks2.run(family_parity, *arch))
    towers = ("vision_model.encoder", "text_model.encoder", "model.encoder", "model.decoder")
    hit = {t for t in towers for n in r["sharded"] if n.startswith(t) and "fc1" in n}
    assert len(hit) == 2, sorted(r["sharded"])


def vlm_parity_and_generate(model_type: str, class_name: str, family: str) -> tuple:
    """Run on every rank: one split of the VLM serves both LLaVA tests (building and splitting
    it is most of their time): `family_parity`'s figures, then `_generate`'s tokens (the
    gradients of the parity step do not touch the weights or the cache)."""
    ref, model, x = _split_family(model_type, class_name, family)
    return _parity(ref, model, x), _generate(ref, model, x)


def _generate(ref: torch.nn.Module, model: torch.nn.Module, x: dict) -> tuple[list, list]:
    """6 greedy tokens after an image and a prompt, with the cache on, unsharded and tp=2."""
    kw = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    kw["use_cache"] = True
    with torch.no_grad():
        want = ref.generate(**x, **kw)
        got = model.generate(**x, **kw)
    assert any(
        isinstance(p, DTensor) and not p.placements[0].is_replicate()
        for p in model.model.vision_tower.parameters()
    )
    return want.tolist(), got.tolist()


def test_vlm_generate_with_an_image_gives_the_unsharded_tokens(llava):
    for _, (want, got) in llava:
        assert got == want


# -- issue 29, continued: grid VLMs, CTC, audio-LLMs ------------------------------------------

QWEN2_VL = ("qwen2_vl", "Qwen2VLForConditionalGeneration", "image-text-to-text")


def test_grid_vlm_trace_inputs_agree():
    """Pure: a grid VLM's made-up inputs are one image per row, flattened patches as wide as
    channels x temporal x patch**2, the grid with real values and as many placeholders per row
    as the tower gives features, marked in ``mm_token_type_ids``."""
    from tests.tiny_family import build_family
    from tpkit.trace.inputs import GRID_IMAGE, synthesize_inputs

    model = build_family(*QWEN2_VL[:2], device="meta")
    v = model.config.vision_config
    _, kw = synthesize_inputs(model, 3, 7)
    side = GRID_IMAGE * v.spatial_merge_size
    assert kw["image_grid_thw"].tolist() == [[1, side, side]] * 3
    width = v.in_channels * v.temporal_patch_size * v.patch_size**2
    assert tuple(kw["pixel_values"].shape) == (3 * side * side, width)
    placeholders = (kw["input_ids"] == model.config.image_token_id).sum(-1)
    assert placeholders.tolist() == [GRID_IMAGE**2] * 3
    assert torch.equal(
        kw["mm_token_type_ids"].bool(), kw["input_ids"] == model.config.image_token_id
    )


def test_qwen2_vl_vision_tower_split_tp2(ranks2):
    r = _check(ranks2.run(family_parity, *QWEN2_VL))
    tower = [n for n in r["sharded"] if n.startswith("model.visual.")]
    for part in ("blocks.0.attn.qkv", "blocks.1.attn.proj", "blocks.0.mlp.fc1", "blocks.1.mlp.fc2"):
        assert any(part in n for n in tower), (part, sorted(r["sharded"]))


@pytest.mark.parametrize(
    "arch",
    [
        ("lfm2_vl", "Lfm2VlForConditionalGeneration", "image-text-to-text"),
        ("mistral3", "Mistral3ForConditionalGeneration", "image-text-to-text"),
    ],
    ids=lambda a: a[0],
)
def test_naflex_and_pixtral_towers_split_tp2(ranks2, arch):
    """LFM2-VL's NaFlex tower takes rows of patches with their ``spatial_shapes`` (the image
    made up as [batch, channels, height, width] failed its trace: the tower was whole, 0%);
    Mistral-3's Pixtral tower takes ``image_sizes``."""
    r = _check(ranks2.run(family_parity, *arch))
    assert any(n.startswith("model.vision_tower.") for n in r["sharded"]), sorted(r["sharded"])


def test_ctc_encoder_split_tp2(ranks2):
    r = _check(ranks2.run(family_parity, "wav2vec2", "Wav2Vec2ForCTC", "ctc"))
    assert any(".encoder.layers.0.feed_forward." in n for n in r["sharded"]), sorted(r["sharded"])


# -- issue 29, continued: audio-LLM towers, config-sized index arguments ----------------------

QWEN2_AUDIO = ("qwen2_audio", "Qwen2AudioForConditionalGeneration", "audio-text-to-text")


def test_audio_llm_trace_inputs_agree():
    """Pure: an audio-LLM's made-up inputs are one whole audio per row, its feature mask all
    ones, and as many audio placeholders per row as its tower gives features (measured: the
    tiny Qwen2-Audio's 64 frames, conv stride 2 then pooling 2: 16), so the audio tower runs
    in the trace instead of the text-only retry."""
    from tests.tiny_family import build_family
    from tpkit.trace.inputs import synthesize_inputs

    model = build_family(*QWEN2_AUDIO[:2])
    _, kw = synthesize_inputs(model, 3, 7)
    frames = kw["input_features"].shape[-1]
    assert kw["feature_attention_mask"].tolist() == [[1] * frames] * 3
    with torch.no_grad():
        x = torch.randn(tuple(kw["input_features"].shape))
        n = model.model.audio_tower(x[:1]).last_hidden_state.shape[1]
    assert n > 1
    placeholders = (kw["input_ids"] == model.config.audio_token_id).sum(-1)
    assert placeholders.tolist() == [n] * 3


def test_qwen2_audio_tower_split_tp2(ranks2):
    r = _check(ranks2.run(family_parity, *QWEN2_AUDIO))
    tower = [n for n in r["sharded"] if n.startswith("model.audio_tower.")]
    for part in ("layers.0.self_attn.q_proj", "layers.1.self_attn.out_proj", "layers.0.fc1"):
        assert any(part in n for n in tower), (part, sorted(r["sharded"]))


def test_xmod_full_size_without_a_default_language_is_traced():
    """X-MOD's forward reads ``lang_ids`` (an index into ``config.languages``) and raises
    without them unless a default language was set: the made-up inputs carry them, so the
    full-size default config on meta is traced, not split per layer by the fallback."""
    import transformers

    from tpkit.plan import derive_plan
    from tpkit.trace.inputs import synthesize_inputs

    config = transformers.XmodConfig()
    assert config.default_language is None
    with torch.device("meta"):
        model = transformers.XmodForMaskedLM(config)
    _, kw = synthesize_inputs(model, 3, 7)
    assert kw["lang_ids"].tolist() == [0, 0, 0]
    plan = derive_plan(model, "auto", 2)
    keys = sorted(plan.keys())
    assert {str(plan.source(k)) for k in keys} == {"inferred"}, keys
    assert "roberta.encoder.layer.*.output.dense" in keys, keys


def test_full_width_audio_llm_on_meta_traces_its_tower():
    """Qwen2-Audio at full width (one layer per side) on meta: 750 placeholders per audio,
    and its forward selects the valid frames of [3, 750, 3584] features, too large to compute
    for real in the shadow run: the selection's shape comes from the mask's value
    (`ShadowValues._selected`), so the tower is traced instead of the text-only retry."""
    import transformers

    from tpkit.plan import derive_plan
    from tpkit.trace import inputs as plan_inputs

    config = transformers.Qwen2AudioConfig()
    config.text_config.num_hidden_layers = 1
    config.audio_config.encoder_layers = 1
    with torch.device("meta"):
        model = transformers.Qwen2AudioForConditionalGeneration(config)
    _, kw = plan_inputs.synthesize_inputs(model, 3, 7)
    assert (kw["input_ids"] == config.audio_token_id).sum(-1).tolist() == [750] * 3
    keys = sorted(derive_plan(model, "auto", 2).keys())
    assert any(k.startswith("model.audio_tower.layers.") and "fc1" in k for k in keys), keys
