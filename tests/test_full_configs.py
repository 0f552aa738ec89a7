"""The default (full-size) configs the coverage sweep measures the share on (`tests.tiny.full_config`)
and the sweep's report (`benchmarks.coverage`): fast, no rank groups.

Each default config below did not build a model in the installed transformers (issue 29's "full
size not planned" rows); `full_config` repairs only that, with the published model's values
where they are known, and says what it repaired."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import full_config

#: (model type, class, a repair `full_config` must report): each failed to build before
BROKEN_DEFAULTS = [
    ("aya_vision", "AyaVisionForConditionalGeneration", "vision_config.num_attention_heads=16"),
    ("diffusion_gemma", "DiffusionGemmaForBlockDiffusion", "diffusion_gemma_text.num_experts=128"),
    ("hunyuan_vl", "HunYuanVLForConditionalGeneration", "hunyuan_vl_text.head_dim=128"),
    ("esm", "EsmForMaskedLM", "vocab_size=33"),
    ("reformer", "ReformerForMaskedLM", "is_decoder=False (a masked LM)"),
    ("chameleon", "ChameleonForConditionalGeneration", "vocabulary_map=<8193 entries>"),
    ("emu3", "Emu3ForConditionalGeneration", "vocabulary_map=<32770 entries>"),
    ("granite4_vision", "Granite4VisionForConditionalGeneration", "downsample_rate='4/8'"),
    ("qwen4_exp", "Qwen4ExpForConditionalGeneration", "qwen4_exp_text.indexer_budget=2048"),
    ("cohere_compass", "CohereCompassForConditionalGeneration", "cohere_compass_text.rope_"),
    ("detr", "DetrModel", "use_timm_backbone=False"),
    ("deformable_detr", "DeformableDetrModel", "stages [2, 3, 4]"),
    ("deepseek_ocr2", "DeepseekOcr2ForConditionalGeneration", "deepseek_ocr2_text.mlp_layer_"),
]


@pytest.mark.parametrize(("model_type", "class_name", "repair"), BROKEN_DEFAULTS)
def test_full_config_builds_on_meta(model_type, class_name, repair):
    """The repaired default builds the model on the meta device, and the repair is named."""
    import transformers

    repairs: list[str] = []
    config = full_config(model_type, class_name, repairs)
    assert any(r.startswith(repair) or repair in r for r in repairs), repairs
    with torch.device("meta"):
        model = getattr(transformers, class_name)(config)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_full_config_keeps_the_default_where_it_builds():
    """A default that builds is left alone: no repair, the default's own sizes."""
    from transformers import GPT2Config

    repairs: list[str] = []
    config = full_config("gpt2", "GPT2LMHeadModel", repairs)
    assert repairs == []
    assert config.to_dict() == GPT2Config().to_dict()


def test_full_config_published_values():
    """Repairs give the published model's values, not made-up ones: Aya-Vision's SigLIP tower
    (16 heads of 1152), Reformer's LM a decoder but its masked LM not, ESM-2's 33-token
    vocabulary, Chameleon's image tokens at ids 4.. (the model reads its image token id and the
    code <-> id map from it), DETR's backbone transformers' ResNet-50."""
    aya = full_config("aya_vision", "AyaVisionForConditionalGeneration")
    assert (aya.vision_config.hidden_size, aya.vision_config.num_attention_heads) == (1152, 16)
    assert full_config("reformer", "ReformerModelWithLMHead").is_decoder
    assert not full_config("reformer", "ReformerForMaskedLM").is_decoder
    assert full_config("esm", "EsmForMaskedLM").vocab_size == 33
    cham = full_config("chameleon", "ChameleonForConditionalGeneration").vocabulary_map
    assert cham["<image>"] == 8711 and cham["IMGIMGAZ"] == 4 and cham["IMGIMGBCDZ"] == 4 + 123
    detr = full_config("detr", "DetrModel")
    assert detr.backbone_config.model_type == "resnet" and not detr.use_timm_backbone
    assert detr.backbone_config.hidden_sizes == [256, 512, 1024, 2048]  # ResNet-50


def test_grad_parity_is_relative_and_reported_so():
    """The sweep's gradient check allows `TOL` relative to the largest gradient: the row carries
    the gradients' scale and the relative difference, so a huge absolute difference that passes
    (tiny random towers: 5e13 of 1e19) is shown for what it is."""
    from benchmarks.coverage import TOL, compare_grads, grad_bound, grad_rel

    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    model = torch.nn.Linear(4, 3)
    model.load_state_dict(ref.state_dict())
    x = torch.randn(2, 4) * 1e9  # weight gradients as large as the inputs
    ref_out, out = ref(x), model(x * (1 + 1e-7))  # a float32-sized difference, scaled up
    diff, scale, missing = compare_grads(ref, model, ref_out, out)
    assert missing == [] and scale > 1e9 and diff > 1.0  # large in absolute terms
    assert diff <= grad_bound(scale)
    assert grad_rel(diff, scale) == diff / scale <= TOL
    assert grad_rel(0.0, 0.0) == 0.0


def _row(**extra) -> dict:
    return {"architecture": "blip-2", "class": "Blip2X", "kind": "image-text-to-text", **extra}


def test_report_shows_relative_grad_diff_and_full_size_note():
    """The families markdown says what parity means, has a 'grad rel diff' column and the
    full-size repairs; a row of an older report (no such fields) renders with them blank."""
    from benchmarks.coverage import markdown_families, summarize_families

    new = _row(
        status="ok",
        max_diff=2e-7,
        grad_diff=5.3e13,
        grad_scale=1.1e19,
        grad_rel=5.3e13 / 1.1e19,
        grad_parity=True,
        full_size_share=0.99,
        full_size_note="use_timm_backbone=False: transformers' resnet",
    )
    old = _row(architecture="instructblip", status="ok", max_diff=1e-7, grad_diff=160.0)
    rows = [new, old]
    text = markdown_families(summarize_families(rows, 1.0), rows)
    assert "relative to the gradients' scale" in text and "grad rel diff" in text
    lines = {ln.split(" | ")[0]: ln for ln in text.splitlines() if ln.startswith("| ")}
    header = lines["| architecture"].split(" | ")
    cells = lines["| blip-2"].split(" | ")
    assert cells[header.index("grad diff")] == "5.3e+13"
    assert cells[header.index("grad rel diff")] == "4.8e-06"
    assert "use_timm_backbone=False" in cells[header.index("full-size config repaired |")]
    old_cells = lines["| instructblip"].split(" | ")
    assert old_cells[header.index("grad diff")] == "1.6e+02"
    assert old_cells[header.index("grad rel diff")] == ""


def test_meta_checks_have_their_own_timeout_and_a_dead_rank_is_not_a_hang():
    """The full-size meta checks run under their own, longer timeout than parity (a 300B
    default's plan took over 180 s on 2 busy cores: GLM-5-Next, Mistral-Large-4); a rank
    process that died before the timeout (the harness says "did not finish" for both) is
    reported as a death with its exit code, status "error", not as a "timeout"."""
    import benchmarks.coverage as cov
    from tests.harness import RankError

    class Proc:
        exitcode = None

    class Group:  # the rank group's interface; parity's rank dies at once
        procs = [Proc(), Proc()]
        timeouts: dict[str, float] = {}

        def run(self, fn, *args, timeout: float = 0):
            self.timeouts[fn.__name__] = timeout
            if fn.__name__ == "check_parity":
                self.procs[1].exitcode = -9
                raise RankError(f"ranks [1] did not finish {fn.__name__} within {timeout:.0f}s")
            return [{"full_size_share": 1.0}]

    me = type("Checks", (), {})()
    me.meta_checks = lambda *a: None
    me.meta_checks.__name__ = "meta_checks"
    me.check_parity = lambda *a: None
    me.check_parity.__name__ = "check_parity"
    row = {"architecture": "pi0", "class": "PI0ForConditionalGeneration", "kind": "x"}
    group = Group()
    cov._check(row, group, me, 180.0, RankError, cov.META_TIMEOUT)
    assert group.timeouts == {"meta_checks": cov.META_TIMEOUT, "check_parity": 180.0}
    assert cov.META_TIMEOUT > 180.0
    assert row["status"] == "error", row
    assert row["why"].startswith("a rank process died") and "out of memory" in row["why"], row
    assert "[-9]" in row["why"], row

    raised = RankError(
        "rank 0 raised:\nTraceback (most recent call last):\nValueError: bad split\n"
        "ranks [1] did not finish check_parity within 180s (a collective reached by only some "
        "ranks?); the group was killed."
    )
    raised.elapsed, raised.exitcodes = 28.0, [-9, -9]  # rank 1 killed 20 s after rank 0 raised
    why = cov._rank_why(raised, 180.0)
    assert why.startswith("ValueError: bad split") and "ranks [1] were left waiting" in why, why

    hung = RankError("ranks [0, 1] did not finish check_parity within 180s")
    hung.elapsed, hung.exitcodes = 180.5, [-9, -9]  # killed by the harness at its timeout
    assert cov._rank_why(hung, 180.0).startswith("timed out")
