"""Fused experts whose shards torch's CPU grouped_mm refuses (rows not a multiple of 16 bytes) run
batched_mm on every path: forward, backward and ``generate``. Issue 46, item 2: transformers'
Mixtral tester config (intermediate 37) at tp=2, whose packed gate/up splits 38 and 36 rows per
rank (grouped_mm takes a 38-row weight forward and refuses it backward: "strides should be
multiple of 16 bytes"). The split is kept; the kernel is what changes, also when the model is
switched to grouped_mm after the split (the switch rewrites the config the experts share)."""

from __future__ import annotations

import copy

import pytest
import torch

TOL = 1e-5


def _tester(implementation: str):
    """transformers' MixtralModelTester config (intermediate 37, 8 experts, gelu, jitter)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.MixtralConfig(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="gelu",
        max_position_embeddings=512,
        pad_token_id=0,
        router_jitter_noise=0.1,
        experts_implementation=implementation,
    )
    return tf.MixtralForCausalLM(config)


def check_every_path(when: str) -> dict:
    """Split at tp=2 on grouped_mm (``"at_split"``) or on eager, then the model switched to
    grouped_mm (``"switched_after"``); the unsharded reference on batched_mm (grouped_mm
    refuses its 37-wide experts too). Training forward, backward, then greedy generate."""
    from torch.distributed.tensor import DTensor

    import tpkit

    ref = _tester("grouped_mm" if when == "at_split" else "eager")
    model = tpkit.tensor_parallel(copy.deepcopy(ref), tp_size=2)
    if when == "switched_after":
        model.set_experts_implementation("grouped_mm")
    ref.set_experts_implementation("batched_mm")
    experts = model.model.layers[0].mlp.experts
    local_rows = experts.gate_up_proj.to_local().shape[1]
    x = torch.randint(3, 99, (13, 7), generator=torch.Generator().manual_seed(0))
    out = {"local_rows": local_rows}
    for m in (ref, model):
        m.train()
    torch.manual_seed(5)  # the router's jitter draws alike (TP ranks share the RNG state)
    got = model(x, labels=x)
    torch.manual_seed(5)
    want = ref(x, labels=x)
    got.loss.backward()
    want.loss.backward()
    grads = dict(ref.named_parameters())
    out["logits"] = (got.logits - want.logits).abs().max().item()
    out["grad"] = max(
        ((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - grads[n].grad)
        .abs()
        .max()
        .item()
        for n, p in model.named_parameters()
    )
    for m in (ref, model):
        m.eval()
    with torch.no_grad():
        tokens = model.generate(x[:2], max_new_tokens=5, do_sample=False)
        expected = ref.generate(x[:2], max_new_tokens=5, do_sample=False)
    out["tokens_equal"] = torch.equal(tokens, expected)
    return out


@pytest.mark.parametrize("when", ["at_split", "switched_after"])
def test_uneven_experts_run_batched_mm_forward_backward_and_generate(ranks2, when):
    rows = []
    for r in ranks2.run(check_every_path, when, timeout=240):
        assert r["logits"] <= TOL and r["grad"] <= TOL and r["tokens_equal"], r
        rows.append(r["local_rows"])
    assert rows == [38, 36], rows  # the uneven packed split is kept
