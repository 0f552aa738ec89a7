"""What the model's trace never ran (`tpkit.sources.untraced`): towers planned on their own,
other layers split per layer.

A VLM or audio LLM traced on its text alone (its tower inputs could not be made up) used to
leave every tower whole: Voxtral's audio tower, MOSS-Transcribe's, GIT's vision encoder
(full-size shares 0.51-0.86). Each untraced tower that is a model of its own (a config and a
main input) now gets its own plan, joined under its path, and the split model still gives the
unsharded outputs and gradients when the tower does run. Layers run only under some inputs
(Longformer's global projections) take the per-layer fallback's split; tables no trace ran
stay whole (their weight may be read by hand).
"""

from __future__ import annotations

import copy
import traceback

import torch
from torch import nn

from tests.test_families import check_parity

TOL = 1e-5


class TextWithTower(nn.Module):
    """A text model with a ViT tower its forward runs only when given pixels, and a table and
    a projection it runs only when given extra ids."""

    def __init__(self):
        super().__init__()
        from transformers import ViTConfig, ViTModel

        config = ViTConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            image_size=16,
            patch_size=8,
        )
        self.tower = ViTModel(config, add_pooling_layer=False)
        self.emb = nn.Embedding(50, 32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.head = nn.Linear(32, 50)
        self.extra = nn.Embedding(64, 32)
        self.side = nn.Linear(32, 32)

    def forward(self, ids, pixel_values=None, extra_ids=None):
        x = self.emb(ids)
        if extra_ids is not None:
            x = x + self.side(self.extra(extra_ids))
        if pixel_values is not None:
            x = x + self.tower(pixel_values=pixel_values).last_hidden_state.mean(1, keepdim=True)
        return self.head(x + self.down(torch.relu(self.up(x))))


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 50, (2, 5), generator=g), torch.randn(2, 3, 16, 16, generator=g)


def run_parity() -> dict:
    """Run on every rank: traced on ids alone, run with the tower; outputs and gradients."""
    try:
        import tpkit
        from tpkit.state import tp_state

        torch.manual_seed(0)
        ref = TextWithTower().eval()
        ids, pixels = _inputs()
        model = tpkit.tensor_parallel(copy.deepcopy(ref), example_inputs=(ids,))
        outs = []
        for m in (ref, model):
            y = m(ids, pixel_values=pixels, extra_ids=(ids * 7) % 64)
            (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
            outs.append(y.detach())
        want = dict(ref.named_parameters())
        grad, missing = 0.0, []
        for n, p in model.named_parameters():
            if (p.grad is None) != (want[n].grad is None):
                missing.append(n)
            elif p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grad = max(grad, (g - want[n].grad).abs().max().item())
        plan = tp_state(model).plan
        return {
            "out": (outs[0] - outs[1]).abs().max().item(),
            "grad": grad,
            "missing": missing,
            "styles": dict(plan.items()),
            "notes": dict(plan.notes),
        }
    except Exception:  # noqa: BLE001 - shown by the test
        return {"error": traceback.format_exc()}


def test_untraced_tower_is_planned_on_its_own_and_matches_unsharded(ranks2):
    for r in ranks2.run(run_parity, timeout=300):
        assert "error" not in r, r.get("error")
        assert r["out"] <= TOL and r["grad"] <= TOL and not r["missing"], r
        tower = {k: v for k, v in r["styles"].items() if k.startswith("tower.")}
        assert tower.get("tower.layers.*.attention.q_proj") == "colwise", tower
        assert tower.get("tower.layers.*.mlp.fc2") == "rowwise", tower
        assert "tower" in r["notes"]["TextWithTower towers"]
        assert r["styles"].get("extra", "replicate") == "replicate", r["styles"]  # unseen table
        assert r["styles"]["side"] == "colwise_gather_output", r["styles"]


def test_a_traced_tower_keeps_the_model_plan():
    """Traced with pixels, the tower's entries come from the model's own trace (no towers
    note); a user's entry inside the tower keeps the tower from being planned as a model
    (the user's entry stands; its other layers are then split per layer)."""
    from tpkit.plan import derive_plan

    torch.manual_seed(0)
    model = TextWithTower().eval()
    ids, pixels = _inputs()
    plan = derive_plan(model, "auto", 2, example_inputs={"ids": ids, "pixel_values": pixels})
    assert "TextWithTower towers" not in plan.notes
    assert plan.style_for("tower.layers.0.attention.q_proj")[0] == "colwise"
    user = derive_plan(model, {"tower.layers.0.mlp.fc2": "replicate"}, 2, (ids,))
    assert "TextWithTower towers" not in user.notes
    assert user["tower.layers.0.mlp.fc2"] == "replicate"
    assert user.style_for("tower.layers.1.mlp.fc2")[0] == "colwise_gather_output"


def hunyuan_parity() -> dict:
    """Run on every rank: HunYuan-VL, whose vision tower the model's trace never runs and whose
    own trace fails (its per-layer fallback plans it), and whose position table is read by
    hand (``position_embedding.weight[1:]`` interpolated to the image grid)."""
    try:
        from tests.test_families import family_parity
        from tests.tiny_family import build_family
        from tpkit.plan import derive_plan

        arch = ("hunyuan_vl", "HunYuanVLForConditionalGeneration")
        r = family_parity(*arch, "image-text-to-text")
        plan = derive_plan(build_family(*arch, device="meta"), "auto", 2)
        r["table"] = plan.style_for("model.vision_tower.embeddings.position_embedding")
        r["towers"] = plan.notes.get("HunYuanVLForConditionalGeneration towers", "")
        return r
    except Exception:  # noqa: BLE001 - shown by the test
        return {"error": traceback.format_exc()}


def test_a_table_no_trace_saw_stays_whole(ranks2):
    """A split table read by hand was a DTensor amid plain tensors ("mixed torch.Tensor and
    DTensor"): tables the trace never ran stay whole, the rest of the tower is split."""
    for r in check_parity(ranks2.run(hunyuan_parity, timeout=300)):
        assert r["table"] is None or r["table"][0] == "replicate", r["table"]
        assert "model.vision_tower" in r["towers"], r["towers"]
        assert any(n.startswith("model.vision_tower.layers.") for n in r["sharded"]), r["sharded"]


#: two hybrid layers: the second's shared block is tied to the first's, weight for weight, and
#: each calls one of the block's two adapters
ZAMBA2_TIED = {
    "num_hidden_layers": 4,
    "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
    "hybrid_layer_ids": [1, 3],
}


def test_an_uncalled_layer_tied_to_a_called_one_follows_it():
    """The per-layer fallback splits a layer the trace never ran, unless a layer it ran holds
    its weights: that layer's entry lays them out. Zamba2 ties every hybrid layer's shared block
    to the first's, and each layer calls one adapter of its block: at full size and tp=8 the
    fallback gathered the adapters a layer leaves uncalled, whose weights another layer computes
    with whole. Its dry run failed, the hybrid layers' linear and the blocks' down_proj were left
    whole with them, and validation dry-ran the plan again."""
    import transformers

    from tests.tiny import full_config
    from tpkit.plan import derive_plan, validate
    from tpkit.trace.analysis import Analysis

    with torch.device("meta"):
        model = transformers.Zamba2ForCausalLM(full_config("zamba2", "Zamba2ForCausalLM"))
    analysis = Analysis(model)
    plan = derive_plan(model, "auto", 8, analysis=analysis)
    assert [a for a in analysis.answers.values() if a is not None] == []  # no failing try
    assert not [p for p in plan if "adapter_list" in p]  # the called adapters' entries hold
    assert plan.style_for("model.layers.6.linear")[0] == "rowwise"
    down = "model.layers.12.shared_transformer.feed_forward.down_proj"
    assert plan.style_for(down)[0] == "colwise"
    asked = len(analysis.answers)
    validate(model, plan, 8, analysis=analysis)
    assert len(analysis.answers) == asked  # the plan derivation ran: nothing asked again


def test_tied_blocks_with_uncalled_adapters_match_unsharded(ranks2):
    """The same tie on a tiny Zamba2 with two hybrid layers, split at tp=2: outputs and every
    gradient as the unsharded model's."""
    from tests.parity import assert_parity, tiny_parity

    results = ranks2.run(tiny_parity, "zamba2", "Zamba2ForCausalLM", ZAMBA2_TIED, timeout=300)
    assert_parity(results, TOL)
    assert all(r["share"] > 0.4 for r in results), results
