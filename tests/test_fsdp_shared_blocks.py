"""FSDP2 over a model whose repeated blocks share a weight (DiffusionGemma's encoder and decoder
share their attention projections): no unit may own the shared weight alone, so neither block
gets a unit and the weight falls to the root's, gathered for the whole forward. One unit per
block would fail at the first forward ("Parameter ... is shared with a parameter already managed
by another FSDP group") or, worse, free the weight after the first block.
"""

from __future__ import annotations

import torch

from tests.models import batch, build, full

STEPS, LOSS_REL, WEIGHT_ABS = 3, 1e-5, 1e-4


def shared_blocks() -> torch.nn.Module:
    """Tiny llama whose second block's q_proj weight is the first block's (one nn.Parameter held
    by two nn.Linear modules, DiffusionGemma's kind of sharing)."""
    model = build("llama")
    layers = model.model.layers
    layers[1].self_attn.q_proj.weight = layers[0].self_attn.q_proj.weight
    return model


def test_blocks_sharing_a_weight_get_no_unit_of_their_own():
    from tpkit.parallel.fsdp_plan import fsdp_units

    units = {u.name for u in fsdp_units(shared_blocks())}
    assert "model.layers.0" not in units and "model.layers.1" not in units, units
    assert {"model.embed_tokens", "model.norm", "lm_head"} <= units, units


def _train(model, dp_rank: int, dp: int) -> list[float]:
    """STEPS AdamW steps, this data rank on its rows of the global (8 x 8) batch; the global
    mean loss of each step."""
    import torch.distributed as dist

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for step in range(STEPS):
        x = batch(model.config.vocab_size, shape=(8, 8), seed=step).chunk(dp)[dp_rank]
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(total)
        losses.append(total.item() / dp)
    return losses


def check_shared_blocks_fsdp() -> dict:
    """tensor_parallel(tp_size=1, dp_size=2) of `shared_blocks`, trained against one process."""
    import torch.distributed as dist

    import tpkit

    ref = shared_blocks().train()
    ref_losses = _train(ref, 0, 1)
    model = tpkit.tensor_parallel(shared_blocks().train(), tp_size=1, dp_size=2)
    losses = _train(model, dist.get_rank(), 2)
    want = dict(ref.named_parameters())
    layers = model.model.layers
    return {
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "weight_abs": max(
            (full(p) - want[n]).abs().max().item() for n, p in model.named_parameters()
        ),
        "still_shared": layers[1].self_attn.q_proj.weight is layers[0].self_attn.q_proj.weight,
        "sharded": type(layers[0].self_attn.q_proj.weight).__name__,
    }


def test_blocks_sharing_a_weight_train_exactly_under_fsdp(ranks2):
    for r in ranks2.run(check_shared_blocks_fsdp):
        assert r["loss_rel"] <= LOSS_REL and r["weight_abs"] <= WEIGHT_ABS, r
        assert r["still_shared"] and r["sharded"] == "DTensor", r
