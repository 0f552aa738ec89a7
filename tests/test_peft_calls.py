"""peft's own functions called on tpkit models, as a user coming from transformers / peft writes
them: ``get_peft_model_state_dict`` (full plain tensors on every rank, the unsharded model's dict),
``set_peft_model_state_dict`` (full tensors in, each rank's slices in place), and peft's layout of
LoRA on a vocab-parallel embedding (``lora_embedding_A`` split by vocabulary like its base), with
peft's own tensor-parallel test logic (its ``test_gpu_examples.py::TestLoraTensorParallel``) run
against tpkit."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from tests.models import batch, build, full
from tests.test_peft import LLAMA_TARGETS, lora_config

TOL = 1e-5
ORDERS = ["peft_first", "tpkit_first"]
EMBED = {"target_modules": [*LLAMA_TARGETS, "embed_tokens"]}
#: peft's TP tests' targets (an embedding and the attention)
PEFT_TP_TARGETS = ["embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj"]


def _randomise(model, seed: int = 5) -> None:
    """Random values in every adapter tensor (B and the embedding's A start at zero), the same
    on every rank, so that no comparison compares zeros."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _give(ref, model) -> None:
    """``model``'s adapters (sharded) get ``ref``'s values, each rank its own slices."""
    values = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                whole = values[n].detach()
                if isinstance(p, DTensor):
                    whole = distribute_tensor(
                        whole, p.device_mesh, p.placements, src_data_rank=None
                    )
                    p.to_local().copy_(whole.to_local())
                else:
                    p.copy_(whole)


def _make(order: str, lora: dict | None = None, name: str = "llama", **tp_kwargs):
    """(unsharded peft model, the same adapters on a tpkit model), with plain peft calls:
    ``tpkit.tensor_parallel(peft.get_peft_model(m, cfg))`` or ``peft.get_peft_model(
    tpkit.tensor_parallel(m), cfg)``."""
    import peft

    import tpkit

    cfg = lora_config(name, **{"init_lora_weights": True, **(lora or {})})
    ref = peft.get_peft_model(build(name), copy.deepcopy(cfg))
    _randomise(ref)
    if order == "peft_first":
        return ref, tpkit.tensor_parallel(copy.deepcopy(ref), **tp_kwargs)
    model = peft.get_peft_model(tpkit.tensor_parallel(build(name), **tp_kwargs), cfg)
    _give(ref, model)
    return ref, model


def _diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


# ---- get_peft_model_state_dict ----------------------------------------------------------------
def check_get_state_dict(order: str, tmp: str, lora: dict | None = None, **tp_kwargs) -> dict:
    """peft's ``get_peft_model_state_dict`` on the tpkit model vs on the unsharded one; its
    result saved with safetensors on every rank and loaded into an unsharded peft model."""
    import peft
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    ref, model = _make(order, lora, **tp_kwargs)
    sd_ref = get_peft_model_state_dict(ref)
    sd = get_peft_model_state_dict(model)
    out = {
        "keys": sorted(sd) == sorted(sd_ref),
        "n": len(sd),
        "plain": all(type(v) is torch.Tensor for v in sd.values()),
        "shapes": all(sd[k].shape == sd_ref[k].shape for k in sd_ref if k in sd),
    }
    if not out["keys"] or not out["plain"] or not out["shapes"]:
        return out
    out["values"] = _diff(sd, sd_ref)
    path = os.path.join(tmp, f"{order}_rank{dist.get_rank()}.safetensors")
    save_file(sd, path)  # the crash of issue 27: DTensors cannot be saved
    plain = peft.get_peft_model(build("llama"), lora_config("llama", **(lora or {})))
    loaded = set_peft_model_state_dict(plain, load_file(path))
    out["unexpected"] = list(loaded.unexpected_keys)
    x = batch(101, shape=(2, 8))
    with torch.no_grad():
        out["logits"] = (plain(input_ids=x).logits - ref(input_ids=x).logits).abs().max().item()
    return out


def _assert_get(results):
    for r in results:
        assert r["keys"] and r["plain"] and r["shapes"], r
        assert r["values"] <= 1e-6 and r["logits"] <= TOL and not r["unexpected"], r


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("lora", [None, EMBED], ids=["attn_mlp", "embed"])
def test_get_peft_model_state_dict_tp2_is_the_unsharded_one(ranks2, order, lora, tmp_path):
    _assert_get(ranks2.run(check_get_state_dict, order, str(tmp_path), lora))


@pytest.mark.parametrize("order", ORDERS)
def test_get_peft_model_state_dict_dp2_tp2_is_the_unsharded_one(ranks4, order, tmp_path):
    results = ranks4.run(check_get_state_dict, order, str(tmp_path), EMBED, tp_size=2, dp_size=2)
    _assert_get(results)


# ---- set_peft_model_state_dict ------------------------------------------------------------------
def check_set_state_dict(
    order: str, lora: dict | None = None, name: str = "llama", **tp_kwargs
) -> dict:
    """peft's ``set_peft_model_state_dict`` with full tensors (new values) on the tpkit model:
    each rank's slices in place, the same logits as the unsharded model given the same dict,
    and ``get_peft_model_state_dict`` gives the dict back."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    ref, model = _make(order, lora, name, **tp_kwargs)
    g = torch.Generator().manual_seed(9)
    new = {
        k: v + torch.randn(v.shape, generator=g) * 0.05
        for k, v in get_peft_model_state_dict(ref).items()
    }
    loaded = set_peft_model_state_dict(model, dict(new))
    set_peft_model_state_dict(ref, dict(new))
    wanted = dict(ref.named_parameters())
    slices, n = 0.0, 0
    for name, p in model.named_parameters():
        if "lora_" not in name:
            continue
        assert isinstance(p, DTensor), name
        mine = distribute_tensor(wanted[name].detach(), p.device_mesh, p.placements)
        slices = max(slices, (p.to_local() - mine.to_local()).abs().max().item())
        n += 1
    out = {"n": n, "slices": slices, "unexpected": list(loaded.unexpected_keys)}
    out["round_trip"] = _diff(get_peft_model_state_dict(model), new)
    x = batch(101, shape=(2, 8))
    with torch.no_grad():
        out["logits"] = (model(input_ids=x).logits - ref(input_ids=x).logits).abs().max().item()
    return out


def _assert_set(results):
    for r in results:
        assert r["n"] and not r["unexpected"], r
        assert r["slices"] == 0.0 and r["round_trip"] <= 1e-6 and r["logits"] <= TOL, r


@pytest.mark.parametrize("order", ORDERS)
def test_set_peft_model_state_dict_tp2_puts_each_ranks_slices(ranks2, order):
    _assert_set(ranks2.run(check_set_state_dict, order, EMBED))


def test_set_peft_model_state_dict_tp2_packed_qkv(ranks2):
    """GPT-2's packed q|k|v: lora_B split in strided parts, each rank's parts in place."""
    _assert_set(ranks2.run(check_set_state_dict, "tpkit_first", None, "gpt2"))


def test_set_peft_model_state_dict_dp2_tp2_puts_each_ranks_slices(ranks4):
    _assert_set(ranks4.run(check_set_state_dict, "peft_first", EMBED, tp_size=2, dp_size=2))


# ---- LoRA on a vocab-parallel embedding: peft's layout -----------------------------------------
def check_embedding_layout(order: str, tmp: str) -> dict:
    """LoRA on ``embed_tokens`` (vocab-parallel, 101 tokens: uneven): ``lora_embedding_A`` split
    by vocabulary like its base; logits and every LoRA gradient as unsharded peft; saved and
    loaded back; merged."""
    import peft

    import tpkit

    ref, model = _make(order, EMBED)
    layer = model.get_base_model().model.embed_tokens
    a = layer.lora_embedding_A["default"]
    base = layer.get_base_layer().weight
    out = {
        "a_split": isinstance(a, DTensor) and a.placements[-1].is_shard(1),
        # peft's check, on this rank's tensors: A's vocabulary is the base's
        "a_vocab": a.to_local().shape[1] == base.to_local().shape[0] < base.shape[0],
    }
    ref.train()
    model.train()
    x = batch(101, shape=(2, 8))
    out_r = ref(input_ids=x, labels=x)
    out_r.loss.backward()
    o = model(input_ids=x, labels=x)
    o.loss.backward()
    out["logits"] = (o.logits - out_r.logits).abs().max().item()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if "lora_" in n}
    grads = {n: full(p.grad) for n, p in model.named_parameters() if "lora_" in n}
    out["grad_keys"] = sorted(grads) == sorted(ref_grads)
    out["grad"] = _diff(grads, ref_grads)
    out["embed_grad"] = _diff(
        {k: v for k, v in grads.items() if "embed" in k},
        {k: v for k, v in ref_grads.items() if "embed" in k},
    )
    ref.eval()
    model.eval()
    tp_dir, ref_dir = os.path.join(tmp, f"{order}_tp"), os.path.join(tmp, f"{order}_ref")
    model.save_pretrained(tp_dir)
    if dist.get_rank() == 0:
        ref.save_pretrained(ref_dir)
    dist.barrier()
    from safetensors.torch import load_file

    saved = load_file(os.path.join(tp_dir, "adapter_model.safetensors"))
    saved_ref = load_file(os.path.join(ref_dir, "adapter_model.safetensors"))
    out["saved_keys"] = sorted(saved) == sorted(saved_ref)
    out["saved"] = _diff(saved, saved_ref) if out["saved_keys"] else 1.0
    with torch.no_grad():
        logits_ref = ref(input_ids=x).logits
        loaded = peft.PeftModel.from_pretrained(tpkit.tensor_parallel(build("llama")), ref_dir)
        out["loaded"] = (loaded(input_ids=x).logits - logits_ref).abs().max().item()
        la = loaded.get_base_model().model.embed_tokens.lora_embedding_A["default"]
        out["loaded_split"] = la.to_local().shape[1] < la.shape[1]
        merged = model.merge_and_unload()
        out["merged"] = (merged(input_ids=x).logits - logits_ref).abs().max().item()
    return out


@pytest.mark.parametrize("order", ORDERS)
def test_lora_embedding_takes_peft_layout_and_matches_unsharded(ranks2, order, tmp_path):
    for r in ranks2.run(check_embedding_layout, order, str(tmp_path)):
        assert r["a_split"] and r["a_vocab"] and r["loaded_split"], r
        assert r["grad_keys"] and r["saved_keys"], r
        for k in ("logits", "grad", "embed_grad", "saved", "loaded", "merged"):
            assert r[k] <= TOL, r


def check_embedding_layout_dp2_tp2(tmp: str) -> dict:
    """The same layout under FSDP2 (dp 2 x tp 2): logits and LoRA gradients, saved file."""
    from peft import get_peft_model_state_dict

    ref, model = _make("peft_first", EMBED, tp_size=2, dp_size=2)
    ref.train()
    model.train()
    x = batch(101, shape=(2, 8))  # every dp rank the same batch: the same averaged gradients
    out_r = ref(input_ids=x, labels=x)
    out_r.loss.backward()
    o = model(input_ids=x, labels=x)
    o.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if "lora_" in n}
    grads = {n: full(p.grad) for n, p in model.named_parameters() if "lora_" in n}
    return {
        "logits": (o.logits - out_r.logits).abs().max().item(),
        "grad": _diff(grads, ref_grads) if sorted(grads) == sorted(ref_grads) else 1.0,
        "state_dict": _diff(get_peft_model_state_dict(model), get_peft_model_state_dict(ref)),
    }


def test_lora_embedding_peft_layout_dp2_tp2(ranks4, tmp_path):
    for r in ranks4.run(check_embedding_layout_dp2_tp2, str(tmp_path)):
        assert r["logits"] <= TOL and r["grad"] <= TOL and r["state_dict"] <= 1e-6, r


# ---- peft's own TP tests, written against tpkit ---------------------------------------------------
def check_peft_tp_tests(tmp: str) -> dict:
    """peft's ``_test_load_from_checkpoint``, ``_test_save_unsharded_weights`` and
    ``_test_load_adapter_save`` (tests/test_gpu_examples.py) with a tpkit base instead of
    transformers' TP: the user's own calls, the local-shape checks on this rank's tensors."""
    import peft
    from peft import LoraConfig, PeftModel, get_peft_model_state_dict
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import load_file, save_file

    import tpkit

    ref_dir, tp_dir = os.path.join(tmp, "reference"), os.path.join(tmp, "tp")
    if dist.get_rank() == 0:
        plain = build("llama")
        cfg = LoraConfig(r=4, target_modules=PEFT_TP_TARGETS, init_lora_weights=True)
        plain = peft.get_peft_model(plain, cfg)
        _randomise(plain)
        plain.save_pretrained(ref_dir)
    dist.barrier()
    x = batch(101, shape=(1, 9))
    reference = PeftModel.from_pretrained(build("llama"), ref_dir)

    # _test_load_from_checkpoint
    tp_model = PeftModel.from_pretrained(tpkit.tensor_parallel(build("llama")), ref_dir)
    checked, bad = 0, []
    for name, module in tp_model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer().weight.to_local()
        if "embed_tokens" in name:  # peft: lora_embedding_A vocab == the base's (local) vocab
            a = module.lora_embedding_A["default"].to_local()
            ok = a.shape[1] == base.shape[0]
        elif name.endswith("o_proj"):  # rowwise: lora_A in == local base in
            ok = module.lora_A["default"].weight.to_local().shape[1] == base.shape[1]
        else:  # colwise: lora_B out == local base out
            ok = module.lora_B["default"].weight.to_local().shape[0] == base.shape[0]
        checked += 1
        if not ok:
            bad.append(name)
    tp_model.eval()
    with torch.no_grad():
        loss = tp_model(input_ids=x, labels=x).loss
        logits = (tp_model(input_ids=x).logits - reference(input_ids=x).logits).abs().max()
    out = {"checked": checked, "bad": bad, "finite": bool(torch.isfinite(loss))}
    out["logits"] = logits.item()

    # _test_save_unsharded_weights
    tp_model.save_pretrained(tp_dir)
    dist.barrier()
    a = load_file(os.path.join(ref_dir, "adapter_model.safetensors"))
    b = load_file(os.path.join(tp_dir, "adapter_model.safetensors"))
    out["resaved"] = _diff(b, a) if sorted(a) == sorted(b) else 1.0

    # _test_load_adapter_save: transformers' load_adapter on the (tpkit) model, then peft's
    # get_peft_model_state_dict on every rank and safetensors' save_file
    tp_base = tpkit.tensor_parallel(build("llama"))
    tp_base.load_adapter(ref_dir)
    tp_sd = get_peft_model_state_dict(tp_base)
    path = os.path.join(tmp, f"load_adapter_rank{dist.get_rank()}.safetensors")
    save_file(tp_sd, path)
    saved = load_file(path)
    prefix = "base_model.model."
    want = {k.removeprefix(prefix): v for k, v in a.items()}
    out["load_adapter_keys"] = sorted(saved) == sorted(want)
    out["load_adapter"] = _diff(saved, want) if out["load_adapter_keys"] else 1.0
    with torch.no_grad():
        out["load_adapter_logits"] = (
            (tp_base(input_ids=x).logits - reference(input_ids=x).logits).abs().max().item()
        )
    return out


def test_peft_tp_tests_pass_on_tpkit(ranks2, tmp_path):
    for r in ranks2.run(check_peft_tp_tests, str(tmp_path)):
        assert r["checked"] == 1 + 4 * 2 and not r["bad"] and r["finite"], r
        assert r["load_adapter_keys"], r
        for k in ("logits", "load_adapter_logits"):
            assert r[k] <= TOL, r
        assert r["resaved"] <= 1e-6 and r["load_adapter"] <= 1e-6, r
