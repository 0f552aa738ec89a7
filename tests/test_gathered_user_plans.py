"""A user's plan that gathers the column output feeding a module: that module's code sees whole
activations, so the fix-ups written for its split heads (head counts divided, per-head inputs
sliced) must not apply. Issue 46, item 1: on a bare BLOOM block the plan below, which the old
``tensor_parallel`` package runs, was refused at tp=2, 3 and 4 ("shape '[3, 7, 6, 3, 8]' is
invalid for input of size 6048": 12 heads divided while the attention reshapes all 12)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

TOL = 1e-5
#: qkv gathered (whole heads reach the attention), the attention's dense layer split by its
#: output and gathered too, the MLP a plain column/row pair
PLAN = {
    "self_attention.query_key_value": "colwise_gather_output",
    "self_attention.dense": "colwise_gather_output",
    "mlp.dense_h_to_4h": "colwise",
    "mlp.dense_4h_to_h": "rowwise",
}


def _block():
    from transformers.models.bloom.modeling_bloom import BloomBlock

    torch.manual_seed(0)
    config = tf.BloomConfig(
        hidden_size=96, n_head=12, n_layer=1, vocab_size=101, hidden_dropout=0.0
    )
    return BloomBlock(config, layer_idx=0).eval()


def _inputs() -> dict:
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 7, 96, generator=g, requires_grad=True)
    causal = torch.full((7, 7), float("-inf")).triu(1)
    return {
        "hidden_states": hidden,
        "alibi": build_alibi_tensor(torch.ones(3, 7), 12, torch.float32),
        "attention_mask": causal.expand(3, 1, 7, 7),
    }


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_the_plan_keeps_the_attention_whole_headed(tp):
    """No process group: the derived plan drops the attention's head fix-ups and validates."""
    from tpkit.plan import derive_plan, validate

    block = _block()
    plan = derive_plan(block, PLAN, tp)
    assert plan.fixups_for("self_attention") == {}, plan.fixups
    validate(block, plan, tp)  # raised "fails a tp=... forward on fake tensors" before


def check_block_parity() -> dict:
    """The block split with the user's plan against the unsharded block: output, attention
    weights, the input's gradient and every parameter's."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import tpkit

    ref = _block()
    model = tpkit.tensor_parallel(copy.deepcopy(ref), plan=PLAN)
    outs, grads = [], []
    for m in (ref, model):
        x = _inputs()
        out, attn = m(**x, output_attentions=True)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append((out.detach(), attn.detach()))
        grads.append(x["hidden_states"].grad)
    want = dict(ref.named_parameters())
    param = max(
        ((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - want[n].grad)
        .abs()
        .max()
        .item()
        for n, p in model.named_parameters()
    )
    qkv = model.self_attention.query_key_value.weight
    return {
        "out": (outs[0][0] - outs[1][0]).abs().max().item(),
        "attn": (outs[0][1] - outs[1][1]).abs().max().item(),
        "input_grad": (grads[0] - grads[1]).abs().max().item(),
        "param_grad": param,
        "heads": model.self_attention.num_heads,
        "qkv_local_rows": qkv.to_local().shape[0],
        "tp": dist.get_world_size(),
    }


@pytest.mark.parametrize("ranks", ["ranks2", "ranks3", "ranks4"])
def test_a_gathered_packed_qkv_matches_unsharded(request, ranks):
    for r in request.getfixturevalue(ranks).run(check_block_parity, timeout=180):
        assert r["out"] <= TOL and r["attn"] <= TOL, r
        assert r["input_grad"] <= TOL and r["param_grad"] <= TOL, r
        assert r["heads"] == 12, r  # the attention sees every head
        assert r["qkv_local_rows"] == 288 // r["tp"], r  # the weight is still split
