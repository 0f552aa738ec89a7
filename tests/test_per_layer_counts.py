"""Layers of one kind whose counts differ are settled per layer (issue 29).

Inference collapses a group found in every layer to ``*`` patterns; its counts used to be the
first layer's. Swin-v2 has 3, 6, 12 and 24 heads per stage: at tp=2 the first stage's 3 heads
made every stage's attention whole (full-size share 0.63). A kind whose layers' counts differ
now keeps its groups per layer, so only the layers tp does not divide stay whole.
"""

from __future__ import annotations

import copy
import traceback

from tests.test_families import check_parity


def _swinv2():
    import torch
    from transformers import Swinv2Config, Swinv2Model

    config = Swinv2Config(
        image_size=56,
        patch_size=4,
        embed_dim=24,
        depths=[1, 1],
        num_heads=[2, 3],  # stage 0: 2 heads (tp=2 divides), stage 1: 3 (it does not)
        window_size=7,
        mlp_ratio=2.0,
    )
    torch.manual_seed(0)
    return Swinv2Model(config).float().eval()


def test_only_the_stage_tp_does_not_divide_stays_whole():
    from tpkit.plan import derive_plan

    plan = derive_plan(_swinv2(), "auto", 2)
    attn = "encoder.layers.{}.blocks.0.attention.self.query"
    assert plan.style_for(attn.format(0))[0] == "colwise", plan
    assert plan.style_for(attn.format(1))[0] == "replicate", plan
    assert "num_attention_heads=3" in plan.notes[attn.format(1)]


def swin_parity() -> dict:
    try:
        import torch

        import tpkit
        from tests.test_families import _parity

        ref = _swinv2()
        x = {"pixel_values": torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(1))}
        return _parity(ref, tpkit.tensor_parallel(copy.deepcopy(ref)), x)
    except Exception:  # noqa: BLE001 - shown by the test
        return {"error": traceback.format_exc()}


def test_swinv2_split_per_stage_matches_unsharded(ranks2):
    for r in check_parity(ranks2.run(swin_parity, timeout=300)):
        assert r["sharded"], r
