"""Issue 29: what a model whose dataflow cannot be traced still gets split, and MobileBERT's
tiny family config at tp=2.

- A composite model whose transformers plan names no layer of it (a VLM's text-config plan)
  and whose forward cannot be traced (the default GLM-4V config: its text rotary makes 64
  frequencies that its ``mrope_section`` [8, 12, 12] does not add up to) took transformers'
  plan as it was: the vocabulary split, 88% of the weights whole. It now gets the per-layer
  fallback, fused experts (GLM-4.5V's) split by their intermediate width too.
- MobileBERT's family config (``embedding_size == hidden_size``) has a zero-size weight in
  the unsharded model, whose gradient the coverage's comparison fed to ``max()``.
"""

from __future__ import annotations

import pytest

from tests.parity import full_size_report

pytestmark = pytest.mark.timeout(600)

#: full size in every width, cut in depth: the share still counts each kind of layer
DEPTH = {"text_config.num_hidden_layers": 2, "vision_config.depth": 2}


def _full_size(model_type: str, class_name: str) -> dict:
    """`full_size_report` of the default config (as `tests.tiny.full_config` builds it) cut to
    `DEPTH` layers."""
    import tests.tiny as tiny

    build = tiny.full_config

    def shallow(mt: str, cn: str):
        config = build(mt, cn)
        for key, value in DEPTH.items():
            sub, attr = key.split(".")
            setattr(getattr(config, sub), attr, value)
        return config

    tiny.full_config = shallow
    try:
        return full_size_report(class_name, model_type=model_type)
    finally:
        tiny.full_config = build


@pytest.mark.parametrize(
    ("model_type", "class_name"),
    [
        ("glm4v", "Glm4vForConditionalGeneration"),
        ("glm4v_moe", "Glm4vMoeForConditionalGeneration"),
    ],
)
def test_untraceable_vlm_full_size_is_split(model_type: str, class_name: str) -> None:
    r = _full_size(model_type, class_name)
    assert r["share"] >= 0.9, r


def test_mobilebert_family_parity(ranks2) -> None:
    """The coverage's own tp=2 check (`benchmarks.coverage.check_parity`: logits and every
    gradient against the unsharded model) on MobileBERT's family config, whose output head
    has a [0, vocab] weight (``hidden_size - embedding_size`` rows): nothing to compare there,
    where ``max()`` of an empty difference raised."""
    from benchmarks.coverage import check_parity

    results = ranks2.run(
        check_parity, "mobilebert", "MobileBertForMaskedLM", "masked-lm", timeout=300
    )
    for r in results:
        assert r["parity"] and r["grad_parity"], r
        assert r["max_diff"] <= 1e-5, r  # gradients: within 1e-5 of the largest (grad_parity)
        assert r["share_sharded"] > 0, r
