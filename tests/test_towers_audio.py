"""Audio-LLM towers traced at every size, not the text-only retry (issue 29, continued).

Before, GLM-ASR's audio tower stayed whole (tower share split, tiny family model on meta, tp=2:
0.0; full size: 69% of the 2-D elements split, its tower all whole) and AudioFlamingo3's at its
default (full) size (the tiny build traced). Two general causes, each fixed once:

- the made-up placeholders were counted with every row of the tower's output selected, while
  the forward keeps the rows its own length formula allows: GLM-ASR stacks frames by the audio
  config's ``intermediate_size / hidden_size`` (4 at full size, 2 in the tiny build) but counts
  valid frames with a fixed merge of 4 ("tokens: 96, features: 48"). The count now runs under
  `tpkit.trace.shadow.ShadowValues` with the feature mask's values kept
  (`tpkit.trace.shadow.keep_value`): the count the forward's formula gives, at any size;
- at full size the placeholder mask is ``expand_as`` the [batch, seq, 3584] embeddings, over
  the shadow run's `tpkit.trace.shadow.LIMIT`, so the expanded mask had no value and the
  selection ``inputs_embeds[mask]`` could not be sized. A view reads its other inputs' shapes
  only: they now stand in as one expanded zero.

Parity: tp=2 against the unsharded tiny model, first output and every gradient within 1e-5,
the audio tower and projector asserted split (`tests.test_families.family_parity`, on the
made-up audio inputs). Full size: the default configs on meta, depth cut to 2 layers per
stack (the widths, frames and merge ratios the bugs depend on are the defaults).
"""

from __future__ import annotations

import pytest

from tests.test_families import _check, family_parity

GLMASR = ("glmasr", "GlmAsrForConditionalGeneration")
AUDIOFLAMINGO3 = ("audioflamingo3", "AudioFlamingo3ForConditionalGeneration")
#: the family name that makes `tests.tiny_inputs.family_inputs` give the made-up audio, not text alone
AUDIO = "audio-text-to-text"
#: modules of the audio side, by name part
TOWER = ("audio_tower", "multi_modal_projector")


def test_a_mask_expanded_along_a_dimension_counts_as_its_sum():
    """The shadow run counts an expanded placeholder mask once per repeated slice (its hidden
    dim at full size: 9M entries per forward); the count must be the mask's true sum."""
    import torch

    from tpkit.trace import shadow

    torch.manual_seed(0)
    for base in (torch.rand(3, 7, 1), torch.rand(2, 1, 5), torch.rand(4), torch.rand(())):
        mask = base > 0.5
        shapes = [mask.shape, tuple(9 if s == 1 else s for s in mask.shape)]
        for view in (mask.expand(shape) for shape in shapes):
            want = int(view.sum())
            assert shadow._true_count(view) == want == shadow._true_count(view.contiguous())


def test_audio_placeholders_match_the_features_the_forward_keeps():
    """Pure: the made-up ids of the tiny GLM-ASR carry as many placeholders per row as its own
    ``get_audio_features`` returns for the made-up audio, run for real (16: half the tower's
    rows, whose merge the tiny build halves; it was 32)."""
    import torch

    from tests.tiny_family import build_family
    from tpkit.trace.inputs import synthesize_inputs

    model = build_family(*GLMASR)
    _, kw = synthesize_inputs(model, 2, 8)
    per_row = (kw["input_ids"] == model.config.audio_token_id).sum(-1).tolist()
    features = torch.zeros(tuple(kw["input_features"].shape))
    with torch.no_grad():
        out = model.get_audio_features(features, kw["input_features_mask"])
    assert per_row == [out.pooler_output.shape[0] // 2] * 2, (per_row, out.pooler_output.shape)


def test_glmasr_audio_tower_split_tp2(ranks2):
    r = _check(ranks2.run(family_parity, *GLMASR, AUDIO))
    for part in (
        "audio_tower.layers.0.self_attn.q_proj",
        "audio_tower.layers.1.mlp.fc2",
        "multi_modal_projector.linear_1",
    ):
        assert any(part in n for n in r["sharded"]), (part, sorted(r["sharded"]))


def full_size_tower(cases: list[tuple[str, str]]) -> dict[str, dict]:
    """Run on every rank, no collectives: this rank's share of ``cases`` (every world-th), each
    the default config on meta with 2 layers per stack, planned at tp=2: whether the trace
    kept to the text, the audio side's plan entries, and the share of the audio side's >=2-D
    parameter elements the plan splits."""
    import torch
    import torch.distributed as dist
    import transformers

    from tests.tiny import full_config
    from tpkit.plan import derive_plan, param_layouts
    from tpkit.trace.analysis import Analysis

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for model_type, class_name in cases[rank::world]:
        config = full_config(model_type, class_name)
        for sub in (config.text_config, config.audio_config):
            sub.num_hidden_layers = 2
        with torch.device("meta"):
            model = getattr(transformers, class_name)(config).float().eval()
        analysis = Analysis(model)
        plan = derive_plan(model, "auto", 2, analysis=analysis)
        layouts = param_layouts(model, plan)
        total = split = 0
        for name, p in model.named_parameters():
            if p.ndim >= 2 and any(part in name.split(".") for part in TOWER):
                total += p.numel()
                split += p.numel() if layouts[name][1].sharded else 0
        out[model_type] = {
            "text_only": analysis.recipe.text_only,
            "share": split / max(1, total),
            "tower": sorted(k for k in plan if any(part in k for part in TOWER)),
        }
    return out


@pytest.fixture(scope="module")
def full_size(ranks2) -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for part in ranks2.run(full_size_tower, [GLMASR, AUDIOFLAMINGO3], timeout=600):
        merged.update(part)
    return merged


@pytest.mark.parametrize("arch", [GLMASR, AUDIOFLAMINGO3], ids=lambda a: a[0])
def test_full_size_audio_tower_traced_and_split(full_size, arch):
    r = full_size[arch[0]]
    assert not r["text_only"], r
    for part in ("self_attn.q_proj", "fc2", "multi_modal_projector.linear_1"):
        assert any(k.endswith(part) for k in r["tower"]), (part, r)
    # all but the tower's input convolutions and AudioFlamingo3's position table (7% and 11%
    # of the audio side at 2 layers; GLM-ASR's at full depth: 99% split)
    assert r["share"] >= 0.85, r
