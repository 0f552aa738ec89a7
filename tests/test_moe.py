"""MoE experts sharded at full size: plans derived on the meta device for data-dependent
routing (JetMoE's ``expert_size.tolist()``, Switch Transformers' ``nonzero`` and per-expert
module names), JetMoE's 3-D ``ParallelExperts`` split per expert, and grouped_mm experts whose
shard rows are narrower than 16 bytes run as batched_mm, experts kept as a module's own 3-D
weights and applied with bmm (Inkling's shared experts) split by their shapes; parity of logits and every gradient
on tiny configs at tp=2 and tp=4."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.parity import assert_parity, full_size_reports, tiny_parity


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
    # routed experts fused (inferred from 5.25 on), shared ones 3-D weights applied with bmm
    "InklingForCausalLM": ({}, 0.99),
}


@pytest.fixture(scope="module")
def full_size(request, ranks2) -> dict[str, dict]:
    """The full-size reports of the classes this run selected (all, or those ``-k`` kept),
    derived on the session's two ranks two at a time (`tests.parity.full_size_reports`: one
    process leaves the other core idle), in name order."""
    wanted = sorted(
        {
            item.callspec.params["class_name"]
            for item in request.session.items
            if item.module is request.module and item.originalname == "test_full_size_share"
        }
    )
    cases = [(c, FULL_SIZE[c][0]) for c in wanted]
    return dict(zip(wanted, full_size_reports(ranks2, cases), strict=True))


@pytest.mark.parametrize("class_name", sorted(FULL_SIZE))
def test_full_size_share(full_size, class_name):
    r = full_size[class_name]
    assert "error" not in r, r.get("error")
    assert r["share"] >= FULL_SIZE[class_name][1], (r["share"], r["whole"])


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


class _BmmExperts(nn.Module):
    """Shared experts as the module's own 3-D weights applied with bmm (Inkling's layout:
    ``x W^T``), or stored the other way round (``x W``); ``inter`` == width is ambiguous, and
    a residual added inside (``residual``) makes the output more than the experts' sum."""

    def __init__(self, width=8, inter=12, transposed=False, residual=False):
        super().__init__()
        self.transposed, self.residual = transposed, residual
        shape_in, shape_out = (2, inter, width), (2, width, inter)
        if transposed:
            shape_in, shape_out = shape_out, shape_in
        self.gate = nn.Parameter(torch.randn(shape_in) / 8)
        self.up = nn.Parameter(torch.randn(shape_in) / 8)
        self.down = nn.Parameter(torch.randn(shape_out) / 8)

    def forward(self, x):
        h = x.reshape(1, -1, x.shape[-1]).expand(2, -1, -1)
        w = (lambda p: p) if self.transposed else (lambda p: p.transpose(1, 2))  # noqa: E731
        a = torch.nn.functional.silu(torch.bmm(h, w(self.gate))) * torch.bmm(h, w(self.up))
        out = torch.bmm(a, w(self.down)).sum(0).view(x.shape)
        return x + out if self.residual else out


class _BmmStack(nn.Module):
    def __init__(self, inter: int = 12):
        super().__init__()
        self.layers = nn.ModuleList(
            [_BmmExperts(inter=inter), _BmmExperts(transposed=True), _BmmExperts(residual=True)]
        )

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def bmm_parity() -> dict:
    import copy

    import tpkit

    torch.manual_seed(0)
    ref = _BmmStack()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    model = tpkit.tensor_parallel(copy.deepcopy(ref), example_inputs=(x,))
    outs = [m(x) for m in (ref, model)]
    for out in outs:
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    want = dict(ref.named_parameters())
    grads = [
        (p.grad.full_tensor() - want[n].grad).abs().max().item()
        for n, p in model.named_parameters()
    ]
    return {
        "out": (outs[0] - outs[1]).abs().max().item(),
        "grad": max(grads),
        "local": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()},
    }


def test_bmm_experts_split_by_their_shapes_either_way_stored(ranks2):
    for r in ranks2.run(bmm_parity):
        assert r["out"] <= 1e-5 and r["grad"] <= 1e-5, r
        local = r["local"]
        assert local["layers.0.gate"] == (2, 6, 8) and local["layers.0.down"] == (2, 8, 6), local
        assert local["layers.1.gate"] == (2, 8, 6) and local["layers.1.down"] == (2, 6, 8), local
        assert local["layers.2.gate"] == (2, 12, 8), local  # a residual inside: left whole


def test_bmm_experts_as_wide_as_their_input_stay_whole():
    from tpkit.plan import infer_plan

    with torch.device("meta"):
        model = _BmmStack(inter=8)  # layer 0: every dim is 8, nothing says which one to split
    plan = infer_plan(model, (torch.zeros(2, 5, 8, device="meta"),))
    assert plan.style_for("layers.0") is None and plan.style_for("layers.0.gate") is None
    assert plan.style_for("layers.1")[0] == "moe_tp_experts"
    assert plan.style_for("layers.2") is None  # checked on random weights: not a sum of slices


def mixtral_tester_parity() -> dict:
    """transformers' own TP test config for Mixtral (intermediate 37): torch's CPU grouped_mm
    refuses its 148-byte rows even unsharded, so tpkit runs those experts as batched_mm. The
    reference runs batched_mm too (grouped_mm raises); forward, backward and generate compared."""
    import copy

    import torch.distributed as dist
    import transformers as tf

    import tpkit

    torch.manual_seed(0)
    cfg = tf.MixtralConfig(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    ref = tf.MixtralForCausalLM(cfg)
    model = tpkit.tensor_parallel(copy.deepcopy(ref), tp_size=2)
    ref.config._experts_implementation_internal = "batched_mm"
    torch.manual_seed(0)
    x = torch.randint(0, 99, (2, 64))
    out, want = model(x, labels=x), ref(x, labels=x)
    out.loss.backward()
    want.loss.backward()
    grads = dict(ref.named_parameters())
    grad = max(
        (p.grad.full_tensor() - grads[n].grad).abs().max().item()
        for n, p in model.named_parameters()
    )
    with torch.no_grad():
        tokens = model.generate(x[:1, :10], max_new_tokens=6, do_sample=False)
        ref_tokens = ref.generate(x[:1, :10], max_new_tokens=6, do_sample=False)
    return {
        "logits": (out.logits - want.logits).abs().max().item(),
        "grad": grad,
        "tokens_equal": torch.equal(tokens, ref_tokens),
        "style": repr(model.model.layers[0].mlp.experts._tpkit_style),
        "rank": dist.get_rank(),
    }


def test_grouped_mm_rows_narrower_than_16_bytes_run_as_batched_mm(ranks2):
    for r in ranks2.run(mixtral_tester_parity):
        assert r["logits"] <= 1e-5 and r["grad"] <= 1e-5 and r["tokens_equal"], r
        assert "batched_mm" in r["style"], r
