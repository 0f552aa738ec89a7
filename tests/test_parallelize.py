"""tensor_parallel() on models that ship a transformers plan: parity with the unsharded model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from tests.models import FACTORIES, batch, build, forward_backward_diffs, full, pair

TOL = 1e-5


# ---- checks (run on every rank) --------------------------------------------------------------
def check_parity(name: str) -> dict:
    ref, model = pair(name)
    not_dtensor = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    diffs = forward_backward_diffs(ref, model, batch(ref.config.vocab_size))
    return {**diffs, "not_dtensor": not_dtensor, "type": type(model).__name__}


def _is_replicated_param(name: str) -> bool:
    return "norm" in name or name.endswith("mlp.gate.weight")  # norms, MoE router


def check_param_bytes(name: str) -> dict:
    ref, model = pair(name)
    tp = dist.get_world_size()
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    replicated = sum(
        p.numel() * p.element_size() for n, p in ref.named_parameters() if _is_replicated_param(n)
    )
    local = sum(
        p.to_local().numel() * p.element_size() for p in model.parameters()
    )  # parameters() deduplicates tied weights
    model(
        input_ids=batch(ref.config.vocab_size), labels=batch(ref.config.vocab_size)
    ).loss.backward()
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    return {
        "local": local,
        "expected": (total - replicated) / tp + replicated,
        "embed_sharded": embed.placements[0] != Replicate(),
        "embed_grad_sharded": embed.grad.placements[0] != Replicate(),
        "head_sharded": head.placements[0] != Replicate(),
        "tied_still_tied": (head is embed)
        == (ref.get_output_embeddings().weight is ref.get_input_embeddings().weight),
    }


def check_training_drift(name: str, steps: int = 4) -> dict:
    """Replicated parameters that see sharded activations (q_norm) must not drift over steps."""
    ref, model = pair(name)
    # lr 1e-3: AdamW turns gradient elements at the float noise floor (rarely routed experts,
    # unseen vocabulary rows) into steps of size lr, so the parameter tolerance scales with lr;
    # drift between replicas is checked bitwise below, whatever the lr
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x = batch(ref.config.vocab_size, seed=step)
        for m, o in ((ref, opt_r), (model, opt)):
            o.zero_grad()
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            o.step()
            losses.append(loss.item())
    ref_params = dict(ref.named_parameters())
    param_diff = max(
        (full(p) - ref_params[n]).abs().max().item() for n, p in model.named_parameters()
    )
    # the replicated shards of every rank must be bitwise equal
    local_norm = torch.cat(
        [p.to_local().flatten() for n, p in model.named_parameters() if "norm" in n]
    )
    gathered = [torch.empty_like(local_norm) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local_norm)
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(losses[0::2], losses[1::2])),
        "param_diff": param_diff,
        "replicas_equal": all(torch.equal(gathered[0], g) for g in gathered),
    }


def check_rng_synced() -> bool:
    import tpkit

    torch.manual_seed(100 + dist.get_rank())  # ranks start out different
    tpkit.tensor_parallel(build("llama"))
    draw = torch.rand(8)
    gathered = [torch.empty_like(draw) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, draw)
    return all(torch.equal(gathered[0], g) for g in gathered)


def check_raises(name: str, **kwargs) -> str:
    import tpkit

    try:
        tpkit.tensor_parallel(build(name), **kwargs)
    except ValueError as exc:
        return str(exc)
    return "no error"


# ---- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_parity_tp2(ranks2, name):
    for r in ranks2.run(check_parity, name):
        assert r["not_dtensor"] == []
        assert r["type"] == type(FACTORIES[name]()).__name__  # the class is kept
        assert r["logits"] <= TOL and r["grad"] <= TOL and r["loss"] <= TOL, r


@pytest.mark.parametrize("name", ["llama", "qwen3", "llama_tied", "qwen3_moe"])
def test_parity_tp4(ranks4, name):
    cfg_kv = FACTORIES[name]().config.num_key_value_heads
    assert cfg_kv % 4 == 0
    for r in ranks4.run(check_parity, name):
        assert r["logits"] <= TOL and r["grad"] <= TOL and r["loss"] <= TOL, r


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen3_moe"])
def test_local_param_bytes_are_a_tp_share(ranks2, name):
    for r in ranks2.run(check_param_bytes, name):
        assert abs(r["local"] - r["expected"]) <= 0.05 * r["expected"], r
        assert r["embed_sharded"] and r["embed_grad_sharded"] and r["head_sharded"], r
        assert r["tied_still_tied"], r


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_training_does_not_drift(ranks2, name):
    for r in ranks2.run(check_training_drift, name):
        assert r["loss_diff"] <= TOL and r["param_diff"] <= 1e-4, r
        assert r["replicas_equal"], r


def test_rng_synced_across_tp_group(ranks2):
    assert all(ranks2.run(check_rng_synced))


def test_kv_heads_fewer_than_tp_are_replicated(ranks4):
    # 2 KV heads on 4 ranks: each KV head on 2 ranks (tests/test_kv_replication.py), no refusal
    for r in ranks4.run(check_parity, "mistral"):
        assert r["logits"] <= TOL and r["grad"] <= TOL and r["loss"] <= TOL, r


def test_world_not_divisible_raises(ranks4):
    for msg in ranks4.run(check_raises, "llama", tp_size=3):
        assert "tp_size=3 does not divide the world size 4" in msg


def test_single_process_returns_model_unchanged():
    import tpkit

    ref = build("llama")
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    x = batch(ref.config.vocab_size)
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    torch.testing.assert_close(model(input_ids=x).logits, ref(input_ids=x).logits, rtol=0, atol=0)


def test_single_process_many_devices_refused_before_a_pool_starts():
    """Outside torchrun 2+ devices start a worker pool (tests/test_notebook.py); what it cannot
    serve is one clear error before any process starts."""
    import tpkit

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="sees none"):
            tpkit.tensor_parallel(build("llama"), ["cuda:0", "cuda:1"])
    with pytest.raises(ValueError, match=r"names 2 devices but the sizes \(tp_size=4\)"):
        tpkit.tensor_parallel(build("llama"), ["cpu", "cpu"], tp_size=4)


# ---- a shard cut from a weight in memory: what distribute_tensor gives, in fresh memory ----------
def check_own_shards() -> list[str]:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from tpkit.plan.layout import ParamLayout
    from tpkit.styles.base import distribute_param, placement_for

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    wrong = []
    torch.manual_seed(0)
    for shape, layout in [
        ((6, 5), ParamLayout(dim=0)),
        ((5, 7), ParamLayout(dim=1)),  # uneven: the last rank's chunk is shorter
        ((12, 4), ParamLayout(dim=0, split_factor=3)),  # packed q/k/v: each part split
        ((3,), ParamLayout(dim=0)),
        ((4, 4), ParamLayout(dim=None)),  # replicated
    ]:
        weight = torch.randn(shape)
        module = nn.Module()
        module.weight = nn.Parameter(weight.clone())
        got = distribute_param(module, "weight", layout, mesh)
        want = distribute_tensor(weight, mesh, [placement_for(layout)], src_data_rank=None)
        same = (
            got.placements == want.placements
            and got.shape == want.shape
            and got.stride() == want.stride()
            and torch.equal(got.to_local(), want.to_local())
            and torch.equal(got.full_tensor(), weight)
        )
        shares = got.to_local().untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
        if not same or shares or not isinstance(module.weight, nn.Parameter):
            wrong.append(f"{shape} {layout}")
        # a parameter as nn.Parameter makes one (`tpkit.compat.as_parameter` skips its detach)
        (got.to_local() * 2).sum().backward()
        param = got.is_leaf and got.requires_grad and module.weight is got
        if not param or not torch.equal(got.grad.to_local(), torch.full_like(got.to_local(), 2)):
            wrong.append(f"{shape} {layout}: not a trainable leaf parameter")
        frozen = nn.Module()
        with torch.device("meta"):
            frozen.weight = nn.Parameter(torch.empty(shape), requires_grad=False)
        on_meta = distribute_param(frozen, "weight", layout, mesh)
        if not isinstance(frozen.weight, nn.Parameter) or on_meta.requires_grad:
            wrong.append(f"{shape} {layout}: a frozen meta weight")
        if list(frozen.parameters()) != [on_meta] or not on_meta.is_meta:
            wrong.append(f"{shape} {layout}: meta parameter not registered")
    return wrong


def test_a_shard_cut_from_memory_is_distribute_tensors(ranks2):
    for wrong in ranks2.run(check_own_shards):
        assert not wrong, wrong
