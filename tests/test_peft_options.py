"""Every peft LoRA option on a tpkit model at tp=2, in both orders (peft then
``tpkit.tensor_parallel``, and ``tensor_parallel`` then ``get_peft_model``): parity with the
unsharded peft model (logits, every trainable gradient, and again after an optimizer step), or
one clear error on every rank that names the option and what to do."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from tests.models import batch, build, full
from tests.test_peft import lora_config

TOL = 1e-5
ORDERS = ["peft_first", "tpkit_first"]


def _make(name: str, order: str, lora: dict):
    """(unsharded peft model, the same on a tpkit model): the adapters initialised from the same
    random state in both, so an initialisation that is not exact shows."""
    import peft

    import tpkit
    from tpkit.integrations import peft as tp_peft

    base = build(name)
    torch.manual_seed(1)
    ref = peft.get_peft_model(copy.deepcopy(base), lora_config(name, **lora))
    if order == "peft_first":
        return ref, tp_peft.tensor_parallel(copy.deepcopy(ref))
    split = tpkit.tensor_parallel(copy.deepcopy(base))
    torch.manual_seed(1)
    return ref, tp_peft.get_peft_model(split, lora_config(name, **lora))


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def check_parity(name: str, order: str, lora: dict, train: bool = False) -> dict:
    """Max-abs differences vs unsharded peft: initial trainable values, then logits and
    gradients of two steps (an SGD step between them); also which parameters train."""
    ref, model = _make(name, order, lora)
    ref.train(train)
    model.train(train)
    ref_params = dict(ref.named_parameters())
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    out = {
        "trainable": trainable == sorted(n for n, p in ref.named_parameters() if p.requires_grad),
        "n_trainable": len(trainable),
    }
    out["init"] = max(
        (full(p) - ref_params[n]).abs().max().item() for n, p in model.named_parameters()
    )
    opt_r = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    out["logits"] = out["grad"] = 0.0
    for step in range(2):
        x = batch(101, shape=(2, 8), seed=step)
        torch.manual_seed(10 + step)  # the same dropout masks, if the split draws them alike
        loss_r = ref(input_ids=x, labels=x)
        loss_r.loss.backward()
        torch.manual_seed(10 + step)
        o = model(input_ids=x, labels=x)
        o.loss.backward()
        out["logits"] = max(out["logits"], (o.logits - loss_r.logits).abs().max().item())
        g_r, g = _grads(ref), _grads(model)
        assert g.keys() == g_r.keys(), sorted(g.keys() ^ g_r.keys())[:4]
        out["grad"] = max([out["grad"], *((g[n] - g_r[n]).abs().max().item() for n in g)])
        opt_r.step()
        opt.step()
        opt_r.zero_grad()
        opt.zero_grad()
    out["dropout_active"] = False
    if train and lora.get("lora_dropout"):
        with torch.no_grad():
            x = batch(101, shape=(2, 8))
            a = model(input_ids=x).logits
            b = model(input_ids=x).logits
            out["dropout_active"] = not torch.equal(a, b)
    return out


def _assert_parity(results: list[dict]) -> None:
    for r in results:
        assert r["trainable"] and r["n_trainable"] > 0, r
        assert r["init"] <= TOL and r["logits"] <= TOL and r["grad"] <= TOL, r


def check_error(name: str, order: str, lora: dict) -> str:
    """The error a rank raises for this option (empty when there is none)."""
    try:
        _make(name, order, lora)
    except (ValueError, TypeError) as e:
        return str(e)
    return ""


def _assert_refused(results: list[str], *words: str) -> None:
    assert len(results) == 2 and results[0] == results[1], results  # every rank, alike
    for w in words:
        assert w in results[0], (w, results[0])


# ---- DoRA --------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_dora_matches_unsharded(ranks2, name, order):
    """DoRA's weight norm: local on column bases, one all-reduce of squared norms on row ones;
    GPT-2's packed, transposed Conv1D too."""
    _assert_parity(ranks2.run(check_parity, name, order, {"use_dora": True}))


@pytest.mark.parametrize("order", ORDERS)
def test_dora_with_dropout_matches_unsharded(ranks2, order):
    """With dropout peft's DoRA recomputes the base output on the dropped input."""
    lora = {"use_dora": True, "lora_dropout": 0.3}
    results = ranks2.run(check_parity, "llama", order, lora, True)
    _assert_parity(results)
    assert all(r["dropout_active"] for r in results), results


def check_dora_save_merge(name: str, tmp: str) -> dict:
    ref, model = _make(name, "tpkit_first", {"use_dora": True})
    with torch.no_grad():  # a magnitude that is not the initial norm
        for m in (ref, model):
            for n, p in m.named_parameters():
                if "lora_magnitude_vector" in n:
                    p.mul_(1.5)
    x = batch(101, shape=(2, 8))
    model.save_pretrained(os.path.join(tmp, "tp"))
    if dist.get_rank() == 0:
        ref.save_pretrained(os.path.join(tmp, "ref"))
    dist.barrier()
    from safetensors.torch import load_file

    a = load_file(os.path.join(tmp, "tp", "adapter_model.safetensors"))
    b = load_file(os.path.join(tmp, "ref", "adapter_model.safetensors"))
    with torch.no_grad():
        want = ref(input_ids=x).logits
        merged = model.merge_and_unload()(input_ids=x).logits
    return {
        "same_keys": sorted(a) == sorted(b) and any("magnitude" in k for k in a),
        "saved": max((a[k] - b[k]).abs().max().item() for k in a),
        "merged": (merged - want).abs().max().item(),
    }


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_dora_save_and_merge(ranks2, name, tmp_path):
    """The saved adapter is peft's; merging folds each rank's exact DoRA factor into its shard."""
    for r in ranks2.run(check_dora_save_merge, name, str(tmp_path)):
        assert r["same_keys"] and r["saved"] <= TOL and r["merged"] <= TOL, r


# ---- lora_bias, rslora, patterns, layer subsets, qalora ----------------------------------------
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_lora_bias_matches_unsharded(ranks2, name, order):
    """The bias of a row-parallel base's lora_B is added once, before the single all-reduce."""
    _assert_parity(ranks2.run(check_parity, name, order, {"lora_bias": True}))


SCALING_AND_SELECTION = {
    "rslora": {"use_rslora": True},
    "patterns": {"rank_pattern": {"q_proj": 2, "down_proj": 6}, "alpha_pattern": {"o_proj": 3}},
    "layers_to_transform": {"layers_to_transform": [1]},
    "qalora_on_plain_linear": {"use_qalora": True},  # peft applies it to GPTQ layers only
    "embedding_and_head": {"target_modules": ["q_proj", "o_proj", "embed_tokens", "lm_head"]},
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("flags", list(SCALING_AND_SELECTION))
def test_scaling_and_selection_flags_match_unsharded(ranks2, flags, order):
    _assert_parity(ranks2.run(check_parity, "llama", order, SCALING_AND_SELECTION[flags]))


# ---- initialisations ---------------------------------------------------------------------------
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("init", [True, "gaussian", "orthogonal"])
def test_random_inits_match_unsharded(ranks2, init, order):
    _assert_parity(ranks2.run(check_parity, "llama", order, {"init_lora_weights": init}))


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_2", "olora"])
def test_whole_weight_inits(ranks2, init):
    """Exact when the adapter is added to the unsharded model; refused on a split base (PiSSA
    there used to kill the process group)."""
    _assert_parity(ranks2.run(check_parity, "llama", "peft_first", {"init_lora_weights": init}))
    results = ranks2.run(check_error, "llama", "tpkit_first", {"init_lora_weights": init})
    _assert_refused(results, f"init_lora_weights={init!r}", "tpkit.tensor_parallel(peft.get")


# ---- dropout -----------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_lora_dropout_masks_match_unsharded(ranks2, name, order):
    """The unsharded model's masks: drawn from the synced stream inside TP regions too, and
    whole (then sliced) where a row-parallel base's input is split."""
    results = ranks2.run(check_parity, name, order, {"lora_dropout": 0.3}, True)
    _assert_parity(results)
    assert all(r["dropout_active"] for r in results), results


# ---- modules_to_save ---------------------------------------------------------------------------
@pytest.mark.parametrize("modules", [["lm_head", "embed_tokens"], ["norm"]])
def test_modules_to_save(ranks2, modules):
    """Whole trainable copies of whole-output modules (peft first); refused on a split base, and
    on a module that sees one rank's shard."""
    lora = {"modules_to_save": modules}
    _assert_parity(ranks2.run(check_parity, "llama", "peft_first", lora))
    _assert_refused(ranks2.run(check_error, "llama", "tpkit_first", lora), "modules_to_save")
    refused = ranks2.run(check_error, "llama", "peft_first", {"modules_to_save": ["mlp"]})
    _assert_refused(refused, "mlp: modules_to_save", "whole-output modules")


# ---- other LoRA variants -----------------------------------------------------------------------
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    "lora, flag",
    [
        ({"init_lora_weights": "mica"}, "init_lora_weights='mica'"),
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens=[5, 6]"),
    ],
)
def test_other_variants_refused_naming_the_flag(ranks2, lora, flag, order):
    _assert_refused(ranks2.run(check_error, "llama", order, lora), flag, "LoRA variant")
