"""MoE experts sharded at full size: plans derived on the meta device for data-dependent
routing (JetMoE's ``expert_size.tolist()``, Switch Transformers' ``nonzero`` and per-expert
module names), JetMoE's 3-D ``ParallelExperts`` split per expert, and grouped_mm experts whose
shard rows are narrower than 16 bytes run as batched_mm; parity of logits and every gradient
on tiny configs at tp=2 and tp=4."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.parity import assert_parity, full_size_share, tiny_parity


class _Routed(nn.Module):
    """Top-1 routing that reads values: counts via ``tolist`` and masks via ``nonzero``."""

    def __init__(self, width: int = 8, experts: int = 3):
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.up = nn.ModuleList(nn.Linear(width, 16) for _ in range(experts))
        self.down = nn.ModuleList(nn.Linear(16, width) for _ in range(experts))

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        counts = torch.bincount(choice.flatten(), minlength=len(self.up)).tolist()
        out = torch.zeros_like(x)
        for e, n in enumerate(counts):
            if n:
                rows = (choice == e).nonzero()
                h = x[rows[:, 0], rows[:, 1]]
                out[rows[:, 0], rows[:, 1]] = self.down[e](torch.relu(self.up[e](h)))
        return x + out


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Routed(), _Routed()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_data_dependent_routing_traces_on_meta():
    from tpkit.plan import infer_plan

    with torch.device("meta"):
        model = _Stack()
    plan = infer_plan(model, (torch.zeros(2, 5, 8, device="meta"),))
    for e in range(3):  # every expert is reached by the made-up round-robin routing
        assert plan.style_for(f"layers.1.up.{e}")[0] == "colwise", (list(plan.items()), plan.notes)
        assert plan.style_for(f"layers.1.down.{e}")[0] == "rowwise"


# class -> least share of >=2-D parameter elements sharded at tp=2, default config on meta
FULL_SIZE = {
    "JetMoeForCausalLM": ({}, 0.95),
    "SwitchTransformersForConditionalGeneration": ({}, 0.95),
    # layer drop's torch.rand, and experts the 21 trace tokens never reach (split like the
    # ones they do); 8 of the default 128 experts keep the test fast
    "NllbMoeForConditionalGeneration": ({"num_experts": 8}, 0.95),
}


@pytest.mark.parametrize("class_name", sorted(FULL_SIZE))
def test_full_size_share(class_name):
    overrides, least = FULL_SIZE[class_name]
    share, whole = full_size_share(class_name, **overrides)
    assert share >= least, (share, whole)


GROUPED_MM = {"_experts_implementation": "grouped_mm"}


def test_parity_tp2(ranks2):
    assert_parity(ranks2.run(tiny_parity, "jetmoe", "JetMoeForCausalLM", timeout=120))
    switch = "SwitchTransformersForConditionalGeneration"
    assert_parity(ranks2.run(tiny_parity, "switch_transformers", switch, timeout=120))
    nllb = "NllbMoeForConditionalGeneration"
    assert_parity(ranks2.run(tiny_parity, "nllb-moe", nllb, timeout=120))
    # 12 / 2 = 6 float32 values: 24-byte rows, which torch's grouped_mm refuses
    narrow = {**GROUPED_MM, "moe_intermediate_size": 12}
    r = ranks2.run(tiny_parity, "qwen3_moe", "Qwen3MoeForCausalLM", narrow, timeout=120)
    assert_parity(r)
    assert r[0]["share"] > 0.7, r


def test_parity_tp4(ranks4):
    switch = "SwitchTransformersForConditionalGeneration"
    assert_parity(ranks4.run(tiny_parity, "switch_transformers", switch, timeout=120))
    narrow = {**GROUPED_MM, "moe_intermediate_size": 8}  # 8-byte rows; KV heads 2 < tp
    assert_parity(ranks4.run(tiny_parity, "qwen3_moe", "Qwen3MoeForCausalLM", narrow))
