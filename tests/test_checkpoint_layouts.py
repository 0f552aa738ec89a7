"""A checkpoint written under one layout of the new axes and read under another: HSDP
(dp_replicate x dp_shard), a user's own ``("dp_shard", "tp")`` mesh, plain tp. DCP records global
shapes, so every load must give back the saved parameters and optimizer state exactly, and the
next step within float noise (another layout reduces in another order). Layouts that do not
exist yet (cp, ep) are refused before any collective: tests/test_bad_parallel_input.py."""

from __future__ import annotations

import pytest
import torch

from tests.models import batch, build, full

STEP_TOL = 1e-3  # one AdamW step in another layout: float reductions differ, not the state


def _fresh(layout: str, seed: int):
    """A GPT-2 (packed q|k|v) split under ``layout``, and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh

    import tpkit

    model = build("gpt2", seed=seed)
    if layout == "hsdp":  # 2 replicas x 2 FSDP shards, tp 1
        model = tpkit.tensor_parallel(model, dp_replicate_size=2, dp_shard_size=2, tp_size=1)
    elif layout == "user_mesh":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        model = tpkit.tensor_parallel(model, mesh=mesh)
    else:
        model = tpkit.tensor_parallel(model, tp_size=int(layout.removeprefix("tp")))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, seed: int) -> None:
    x = batch(model.config.vocab_size, seed=seed)
    opt.zero_grad()
    model(input_ids=x, labels=x).loss.backward()
    opt.step()


def _state(model, opt) -> dict[str, torch.Tensor]:
    out = {f"{n}": full(p).detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                out[f"{n}.{k}"] = full(v).detach().clone()
    return out


def check_layout_change(save: str, load: str, path: str) -> dict:
    import tpkit

    model, opt = _fresh(save, seed=0)
    _step(model, opt, seed=1)
    tpkit.save_checkpoint(path, model, opt, step=1)
    saved = _state(model, opt)
    _step(model, opt, seed=2)  # the continuation to reproduce
    other, other_opt = _fresh(load, seed=99)
    extra = tpkit.load_checkpoint(path, other, other_opt)
    loaded = _state(other, other_opt)
    _step(other, other_opt, seed=2)
    after = {n: full(p) for n, p in model.named_parameters()}
    assert loaded.keys() == saved.keys(), sorted(set(loaded) ^ set(saved))
    return {
        "extra": extra,
        "state": max((loaded[k] - saved[k]).abs().max().item() for k in saved),
        "n": len(saved),
        "step": max((full(p) - after[n]).abs().max().item() for n, p in other.named_parameters()),
    }


@pytest.mark.parametrize(
    ("save", "load"),
    # HSDP with tp > 1 (a 3-D mesh) is left out here: its manual gradient average over a 2-D
    # data mesh is the HSDP work's (issue 41), not on this branch's main yet
    [("hsdp", "tp4"), ("tp2", "hsdp"), ("user_mesh", "tp4"), ("tp4", "user_mesh")],
)
def test_a_checkpoint_loads_under_another_layout(ranks4, tmp_path, save, load):
    for r in ranks4.run(check_layout_change, save, load, str(tmp_path / "ck"), timeout=240):
        assert r["extra"] == {"step": 1} and r["n"] > 0, r
        assert r["state"] == 0.0 and r["step"] <= STEP_TOL, r
