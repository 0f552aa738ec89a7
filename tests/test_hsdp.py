"""HSDP (dp_replicate x dp_shard [x tp]) and FSDP2's own settings, from every spelling, against
one plain process training the same model on the whole batch.

4-rank checks run on the session ``ranks4``; the 8-rank ones (dp_replicate=2 x dp_shard=2 x
tp=2) share one module group and as few ``group.run`` calls as possible.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankGroup
from tests.models import batch, build, full

LOSS_REL, WEIGHT_ABS, STEPS = 1e-5, 1e-4, 3


def _dp_coords(model) -> tuple[int, int]:
    from tpkit import get_mesh, tp_state

    state = tp_state(model)
    dp_mesh = None if state is None else get_mesh(state.mesh, "dp")
    return (0, 1) if dp_mesh is None else (dp_mesh.get_local_rank(), dp_mesh.size())


def _reference(name: str, steps: int = STEPS) -> tuple[torch.nn.Module, list[float]]:
    """One process, the whole batch: the numbers every layout must give."""
    ref = build(name).train()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for step in range(steps):
        x = batch(ref.config.vocab_size, shape=(8, 8), seed=step)
        opt.zero_grad()
        loss = ref(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return ref, losses


def train_steps(model, vocab: int, steps: int = STEPS, opt=None, first: int = 0) -> list[float]:
    """``steps`` AdamW steps, each data rank on its rows of the global (8 x 8) batch; returns the
    global mean loss of each step (every rank's loss averaged over the world)."""
    dp_rank, dp = _dp_coords(model)
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for step in range(first, first + steps):
        x = batch(vocab, shape=(8, 8), seed=step).chunk(dp)[dp_rank]
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        total = loss.detach().float().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(total.item() / (dist.get_world_size() if dist.is_initialized() else 1))
    return losses


def _compare(model, ref, losses, ref_losses) -> dict:
    ref_params = dict(ref.named_parameters())
    some = next(
        p for n, p in model.named_parameters() if n.endswith("q_proj.weight") or "c_attn" in n
    )
    return {
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "weight_abs": max(
            (full(p).float() - ref_params[n].float()).abs().max().item()
            for n, p in model.named_parameters()
        ),
        "placements": [type(pl).__name__ for pl in some.placements],
        "losses": losses,
    }


def check_parity(name: str, **tp_kwargs) -> dict:
    """tensor_parallel(model, **tp_kwargs), STEPS AdamW steps, against one process."""
    import tpkit

    ref, ref_losses = _reference(name)
    model = tpkit.tensor_parallel(build(name).train(), **tp_kwargs)
    losses = train_steps(model, ref.config.vocab_size)
    return _compare(model, ref, losses, ref_losses)


def _assert_parity(results: list[dict], placements: list[str]) -> None:
    for r in results:
        assert r["loss_rel"] <= LOSS_REL and r["weight_abs"] <= WEIGHT_ABS, r
        assert r["placements"] == placements, r


# ---- 4 ranks: dp_replicate=2 x dp_shard=2 ------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hsdp_2x2_matches_one_process(ranks4, name):
    results = ranks4.run(check_parity, name, dp_replicate_size=2, dp_shard_size=2)
    _assert_parity(results, ["Replicate", "Shard"])


def test_replicas_alone_all_reduce_gradients(ranks4):
    """dp_replicate=4, dp_shard=1: FSDP2 over an (R, 1) mesh keeps whole replicas."""
    results = ranks4.run(check_parity, "llama", dp_replicate_size=4)
    _assert_parity(results, ["Replicate", "Shard"])


def test_hsdp_with_tp_on_four_ranks(ranks4):
    """dp_replicate=2 x tp=2 (dp_shard=1): TP weights under an (R, 1) data mesh."""
    results = ranks4.run(check_parity, "gpt2", dp_replicate_size=2, tp_size=2)
    _assert_parity(results, ["Replicate", "Shard", "_StridedShard"])


# ---- 8 ranks: one group for the module ----------------------------------------------------------
@pytest.fixture(scope="module")
def ranks8():
    group = RankGroup(8)
    yield group
    group.close()


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


def check_checkpoint_across_layouts(name: str, path: str, hf_dir: str, **load_sizes) -> dict:
    """At dp_replicate=2 x dp_shard=2 x tp=2: 2 steps, a DCP checkpoint with the optimizer,
    save_pretrained, a third step (the uninterrupted run); then a fresh model at
    ``load_sizes`` loads the checkpoint and takes the third step."""
    import tpkit

    sizes = dict(dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    model = tpkit.tensor_parallel(build(name).train(), **sizes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    vocab = model.config.vocab_size
    train_steps(model, vocab, 2, opt)
    tpkit.save_checkpoint(path, model, opt, step=2)
    saved = _weights(model)
    model.save_pretrained(hf_dir)
    (uninterrupted,) = train_steps(model, vocab, 1, opt, first=2)
    return {"uninterrupted": uninterrupted, **check_resume(name, path, saved, **load_sizes)}


def check_resume(name: str, path: str, saved: dict | None = None, **sizes) -> dict:
    """A differently initialised model at ``sizes`` loads the checkpoint (model and optimizer)
    and takes step 3; its loaded weights are compared with ``saved`` where given."""
    import tpkit

    model = build(name, seed=7).train()
    if sizes:
        model = tpkit.tensor_parallel(model, **sizes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    extra = tpkit.load_checkpoint(path, model, opt)
    loaded = _weights(model)
    diff = max((loaded[n] - saved[n]).abs().max().item() for n in saved) if saved else None
    step = train_steps(model, model.config.vocab_size, 1, opt, first=2)[0]
    return {"extra": extra, "loaded_diff": diff, "resumed": step, "weights": loaded}


def check_eight(path: str, hf_dir: str) -> dict:
    """Every 8-rank check of the core in one call: parity of Llama (the model's own FSDP plan)
    and GPT-2 (inferred TP plan, packed biases left out of FSDP) at dp_replicate=2 x
    dp_shard=2 x tp=2, and the checkpoint written there resumed at tp=4 x dp_shard=2."""
    sizes = dict(dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    out = {name: check_parity(name, **sizes) for name in ("llama", "gpt2")}
    moved = check_checkpoint_across_layouts("gpt2", path, hf_dir, tp_size=4, dp_shard_size=2)
    if dist.get_rank():
        moved.pop("weights")  # rank 0's copy is enough for the other layouts' comparisons
    return {**out, "moved": moved}


@pytest.fixture(scope="module")
def eight(ranks8, tmp_path_factory):
    """The 8-rank core checks, run once (`check_eight`), and where they wrote."""
    root = tmp_path_factory.mktemp("hsdp8")
    path, hf_dir = str(root / "ck"), str(root / "hf")
    results = ranks8.run(check_eight, path, hf_dir, timeout=600)
    return {"results": results, "path": path, "hf_dir": hf_dir}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hsdp_2x2x2_matches_one_process(eight, name):
    # FSDP2 over (dp_replicate, dp_shard) outside TP's split: Llama's q_proj (Shard(0) on tp)
    # gets a strided dp shard of the same dim; GPT-2's c_attn (split on dim 1) a plain one
    placements = {
        "llama": ["Replicate", "_StridedShard", "Shard"],
        "gpt2": ["Replicate", "Shard", "_StridedShard"],
    }[name]
    _assert_parity([r[name] for r in eight["results"]], placements)


def _uninterrupted(eight) -> float:
    return eight["results"][0]["moved"]["uninterrupted"]


def _saved(eight) -> dict:
    return eight["results"][0]["moved"]["weights"]


def test_checkpoint_2x2x2_resumes_at_tp4_dp_shard2(eight):
    for r in eight["results"]:
        moved = r["moved"]
        assert moved["extra"] == {"step": 2} and moved["loaded_diff"] == 0.0, moved
        assert abs(moved["resumed"] - moved["uninterrupted"]) <= LOSS_REL * moved["uninterrupted"]


def test_checkpoint_2x2x2_resumes_at_tp2_alone(eight, ranks2):
    results = ranks2.run(check_resume, "gpt2", eight["path"], _saved(eight), tp_size=2)
    for r in results:
        assert r["extra"] == {"step": 2} and r["loaded_diff"] == 0.0, r
        assert abs(r["resumed"] - _uninterrupted(eight)) <= LOSS_REL * _uninterrupted(eight), r


def test_checkpoint_2x2x2_resumes_in_one_process(eight):
    r = check_resume("gpt2", eight["path"], _saved(eight))
    assert r["extra"] == {"step": 2} and r["loaded_diff"] == 0.0, r
    assert abs(r["resumed"] - _uninterrupted(eight)) <= LOSS_REL * _uninterrupted(eight), r


def test_save_pretrained_from_2x2x2_is_the_plain_checkpoint(eight):
    import transformers as tf

    plain = tf.AutoModelForCausalLM.from_pretrained(eight["hf_dir"])
    saved = _saved(eight)
    for n, p in plain.named_parameters():
        assert torch.equal(p.detach(), saved[n]), n
