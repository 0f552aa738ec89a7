"""transformers' own TP plan honoured for VLMs whose plan lives on the text config (issue 29).

A VLM's ``base_model_tp_plan`` sits on its text config (keys like ``layers.*.self_attn.q_proj``)
while its layers sit under ``model.language_model``; tpkit joined the keys to the base model
(``model``), so the plan named only the vocabulary and "auto" fell back to the inferred plan
(exact, but not the plan transformers' ``from_pretrained(tp_plan="auto")`` splits). transformers
joins each sub-model's plan to that sub-model's path (``init_parallel_plans``); `tpkit.sources.hf`
now does the same, and the vision tower, whose config ships no plan, is still split by the
inferred plan (`tpkit.settle.complete.complete_with_inferred`).

Pure tests on meta (tiny family models, `tests.tiny_family.build_family`), and one tp=2 parity check
against the unsharded model (`tests.test_families.family_parity`).
"""

from __future__ import annotations

import pytest

from tests.test_families import _check, family_parity

LLAVA = ("llava", "LlavaForConditionalGeneration", "image-text-to-text")
QWEN2_VL = ("qwen2_vl", "Qwen2VLForConditionalGeneration", "image-text-to-text")
MISTRAL3 = ("mistral3", "Mistral3ForConditionalGeneration", "image-text-to-text")
GEMMA3 = ("gemma3", "Gemma3ForConditionalGeneration", "image-text-to-text")
IDEFICS3 = ("idefics3", "Idefics3ForConditionalGeneration", "image-text-to-text")
ERNIE_VL = ("ernie4_5_vl_moe", "Ernie4_5_VLMoeForConditionalGeneration", "image-text-to-text")

#: where each VLM keeps its language model and its vision tower
PATHS = {
    "llava": ("model.language_model", "model.vision_tower"),
    "qwen2_vl": ("model.language_model", "model.visual"),
    "mistral3": ("model.language_model", "model.vision_tower"),
    "gemma3": ("model.language_model", "model.vision_tower"),
    "idefics3": ("model.text_model", "model.vision_model"),
}


def _derived(arch: tuple[str, str, str]):
    from tests.tiny_family import build_family
    from tpkit.plan import derive_plan

    model = build_family(*arch[:2], device="meta")
    return model, derive_plan(model, "auto", 2)


def _language_layer_targets(model, plan, language: str) -> list:
    """Resolved targets of ``plan`` on the language model's decoder layers."""
    inside = f"{language}.layers."
    return [t for t in plan.resolve(model) if t.name.startswith(inside)]


@pytest.mark.parametrize("arch", [LLAVA, QWEN2_VL, MISTRAL3], ids=lambda a: a[0])
def test_vlm_language_model_takes_transformers_plan(arch):
    """Pure, on meta: every entry on the language model's layers comes from transformers' plan
    (source "config", the text config's styles, joined under the language model's path), and
    the vision tower's attention and MLP are still split (by the inferred plan)."""
    from tpkit.plan import infer_plan, param_layouts
    from tpkit.plan.spec import Source, canonical_style

    model, plan = _derived(arch)
    language, tower = PATHS[arch[0]]
    text_plan = model.config.get_text_config().base_model_tp_plan
    targets = _language_layer_targets(model, plan, language)
    q_proj = [t for t in targets if t.name.endswith("self_attn.q_proj")]
    assert q_proj, sorted(plan.keys())
    wrong = [(t.name, t.source) for t in targets if t.source != Source.CONFIG]
    assert not wrong, wrong
    for t in targets:
        key = t.pattern[len(language) + 1 :]
        assert t.style == canonical_style(text_plan[key]), (t, text_plan.get(key))
    assert "not used" not in " ".join(plan.notes.values()), plan.notes

    layouts = param_layouts(model, plan)
    split = [n for n, p in model.named_parameters() if p.ndim >= 2 and layouts[n][1].sharded]
    in_tower = [n for n in split if n.startswith(tower + ".")]
    assert any("attn" in n or "attention" in n for n in in_tower), in_tower
    assert any("mlp" in n or "feed_forward" in n for n in in_tower), in_tower
    # no less split than the inferred plan alone (Qwen2-VL's merger, an nn.Sequential pair,
    # was left whole once: 0.63 of the tiny model against 0.92)
    inferred = param_layouts(model, infer_plan(model))
    share = sum(p.numel() for n, p in model.named_parameters() if n in split)
    alone = sum(
        p.numel() for n, p in model.named_parameters() if p.ndim >= 2 and inferred[n][1].sharded
    )
    assert share >= alone, (share, alone)


@pytest.mark.parametrize("arch", [GEMMA3, IDEFICS3], ids=lambda a: a[0])
def test_vlm_transformers_plan_checked_on_the_traced_inputs(arch):
    """Pure, on meta: where a tower does not run on the made-up images (Idefics3's, and
    Gemma-3's under earlier tiny configs), the trace keeps to the text. transformers' plan
    used to be dry-run before the trace had made that choice, so it failed in the tower and
    the inferred plan replaced it; now it is checked on the inputs the trace settled on, and
    the language model keeps transformers' entries."""
    from tpkit.plan.spec import Source

    model, plan = _derived(arch)
    language, _ = PATHS[arch[0]]
    targets = _language_layer_targets(model, plan, language)
    assert any(t.name.endswith("self_attn.q_proj") for t in targets), sorted(plan.keys())
    wrong = [(t.name, t.source) for t in targets if t.source != Source.CONFIG]
    assert not wrong, wrong


def test_transformers_plan_completed_where_the_dataflow_is_not_traced(monkeypatch):
    """Pure, on meta: ERNIE-4.5-VL (MoE) as when it could not be traced on made-up inputs (its
    tiny config now can be: the inferred plan is made to fail here). Its transformers plan
    names its language model's layers, but no expert (nor its tower's attention): taken alone
    it split 8% of the tiny model, where the per-layer fallback split 99%. The layers it leaves
    whole take the per-layer fallback; the language model keeps transformers' entries, and the
    share split does not drop."""
    import tpkit.plan.derive as derive
    from tpkit.plan import param_layouts
    from tpkit.plan.spec import Source

    def untraceable(model, example=None):
        raise ValueError("Could not trace (made to fail by the test)")

    monkeypatch.setattr(derive, "infer_plan", untraceable)
    model, plan = _derived(ERNIE_VL)
    targets = _language_layer_targets(model, plan, "model.language_model")
    attn = [t for t in targets if "self_attn." in t.name]
    assert attn and all(t.source == Source.CONFIG for t in attn), attn
    layouts = param_layouts(model, plan)
    weights = {n: p for n, p in model.named_parameters() if p.ndim >= 2}
    split = {n for n in weights if layouts[n][1].sharded}
    experts = [n for n in weights if ".experts." in n]
    assert experts and all(n in split for n in experts), sorted(set(experts) - split)
    assert any(n.startswith("model.vision_tower.") and ".attn." in n for n in split), split
    share = sum(weights[n].numel() for n in split) / sum(p.numel() for p in weights.values())
    assert share > 0.95, share


@pytest.mark.parametrize("arch", [LLAVA, QWEN2_VL, MISTRAL3, GEMMA3, IDEFICS3], ids=lambda a: a[0])
def test_hf_plan_is_transformers_merged_plan(arch):
    """Pure, on meta: `hf_plan` holds exactly the plan transformers builds on the instance
    (``model.tp_plan``: each sub-model's plan under its path, the input embedding by vocab,
    the class's ``lm_head``), style for style."""
    from tests.tiny_family import build_family
    from tpkit.plan.spec import canonical_style
    from tpkit.sources.hf import hf_plan

    model = build_family(*arch[:2], device="meta")
    plan = hf_plan(model)
    theirs = {k: canonical_style(v) for k, v in model.tp_plan.items()}
    assert plan is not None
    assert dict(plan.items()) == theirs


def test_vlm_transformers_plan_tp2_parity(ranks2):
    """tp=2 on gloo, LLaVA under "auto" (now transformers' plan on the language model, the
    inferred one on the tower and projector): first output and every gradient within 1e-5 of
    the unsharded model, both the language model and the tower split."""
    r = _check(ranks2.run(family_parity, *LLAVA))
    for prefix, part in (
        ("model.language_model.", "layers.0.self_attn.q_proj"),
        ("model.language_model.", "layers.1.mlp.down_proj"),
        ("model.vision_tower.", "layers.0.self_attn.q_proj"),
        ("model.vision_tower.", "layers.1.mlp.fc2"),
        ("model.multi_modal_projector.", "linear_1"),
    ):
        hit = [n for n in r["sharded"] if n.startswith(prefix) and part in n]
        assert hit, (prefix, part, sorted(r["sharded"]))


def untraced_family_parity(model_type: str, class_name: str, family: str) -> dict:
    """Run on every rank: `family_parity` with the dataflow made untraceable (``infer_plan``
    raising, as it does for ERNIE-4.5-VL), so "auto" takes transformers' plan completed by the
    per-layer fallback; which sources the split plan's entries have."""
    import tpkit.plan.derive as derive
    from tests.test_families import _parity, _split_family
    from tpkit.state import tp_state

    def untraceable(model, example=None):
        raise ValueError("made untraceable for this test")

    saved, derive.infer_plan = derive.infer_plan, untraceable
    try:
        ref, model, x = _split_family(model_type, class_name, family)
    finally:
        derive.infer_plan = saved
    out = _parity(ref, model, x)
    plan = tp_state(model).plan
    out["sources"] = {str(plan.source(k)) for k in plan}
    return out


def test_transformers_plan_completed_by_the_fallback_tp2_parity(ranks2):
    """tp=2 on gloo, LLaVA with its dataflow made untraceable: transformers' plan on the
    language model, the per-layer fallback on the vision tower and projector beside it; first
    output and every gradient within 1e-5 of the unsharded model."""
    r = _check(ranks2.run(untraced_family_parity, *LLAVA))
    assert {"config", "fallback"} <= r["sources"], r["sources"]
    for prefix, part in (
        ("model.language_model.", "layers.0.self_attn.q_proj"),
        ("model.vision_tower.", "layers.0.self_attn.q_proj"),
        ("model.vision_tower.", "layers.1.mlp.fc2"),
        ("model.multi_modal_projector.", "linear_2"),
    ):
        hit = [n for n in r["sharded"] if n.startswith(prefix) and part in n]
        assert hit, (prefix, part, sorted(r["sharded"]))
