"""PEFT (LoRA) on tensor-parallel models: parity with the unsharded PEFT model, save / load /
merge round trips, collectives per forward, Trainer."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from tests.models import batch, build, full

TOL = 1e-5
STEPS = 3
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config(name: str, **kw):
    from peft import LoraConfig

    if name == "gpt2":
        kw = {"target_modules": ["c_attn", "c_proj", "c_fc"], "fan_in_fan_out": True, **kw}
    else:
        kw = {"target_modules": LLAMA_TARGETS, **kw}
    kw = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "init_lora_weights": False, **kw}
    return LoraConfig(**kw)


def reference(name: str, **kw):
    import peft

    torch.manual_seed(0)
    return peft.get_peft_model(build(name), lora_config(name, **kw))


EMBED_HEAD = {"target_modules": [*LLAMA_TARGETS, "embed_tokens", "lm_head"]}


def _copy_adapters(src, dst) -> None:
    """Give ``dst`` (sharded) the adapter values of ``src`` (unsharded)."""
    ref = dict(src.named_parameters())
    with torch.no_grad():
        for n, p in dst.named_parameters():
            if "lora_" not in n:
                continue
            if isinstance(p, DTensor):
                local = distribute_tensor(
                    ref[n].detach(), p.device_mesh, p.placements, src_data_rank=None
                ).to_local()
                p.to_local().copy_(local)
            else:
                p.copy_(ref[n])


def make(name: str, order: str, lora: dict | None = None, **tp_kwargs):
    """(unsharded PEFT reference, the same adapters on a tpkit model) in the given order."""
    import tpkit
    from tpkit.integrations import peft as tp_peft
    from tpkit.parallel.fsdp import is_fsdp

    ref = reference(name, **(lora or {}))
    if order == "peft_first":
        model = tp_peft.tensor_parallel(copy.deepcopy(ref), **tp_kwargs)
    else:
        # with dp: FSDP2 must come after the adapters, which get_peft_model then applies
        sharded = {"sharded": False} if tp_kwargs.get("dp_size", 1) > 1 else {}
        base = tpkit.tensor_parallel(build(name), **tp_kwargs, **sharded)
        model = tp_peft.get_peft_model(base, lora_config(name, **(lora or {})))
        assert not sharded or is_fsdp(model)
        _copy_adapters(ref, model)
    return ref, model


def _dp(model) -> tuple[int, int]:
    from tpkit.parallel.mesh import get_mesh
    from tpkit.state import tp_state

    dp_mesh = get_mesh(tp_state(model).mesh, "dp")  # None at dp = 1
    return (0, 1) if dp_mesh is None else (dp_mesh.get_local_rank(), dp_mesh.size())


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters() if "lora_" in n}


def check_parity(
    name: str, order: str, lora: dict | None = None, save: str | None = None, **tp_kwargs
) -> dict:
    """Forward, LoRA gradients and 3 AdamW steps vs the unsharded PEFT model (then, with
    ``save``, the trained adapter saved from both and compared)."""
    ref, model = make(name, order, lora, **tp_kwargs)
    ref.train()
    model.train()
    dp_rank, dp = _dp(model)
    n_lora = sum("lora_" in n for n, _ in model.named_parameters())
    opt_r = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
    out = {"logits": 0.0, "grad": 0.0, "n_lora": n_lora}
    for step in range(STEPS):
        x = batch(101, shape=(4, 8), seed=step)
        mine = x.chunk(dp)[dp_rank]
        opt_r.zero_grad()
        out_r = ref(input_ids=x, labels=x)
        out_r.loss.backward()
        opt.zero_grad()
        o = model(input_ids=mine, labels=mine)
        o.loss.backward()
        if step == 0:
            logits_r = out_r.logits.chunk(dp)[dp_rank]
            out["logits"] = (o.logits - logits_r).abs().max().item()
            ref_grads = _lora_grads(ref)
            grads = _lora_grads(model)
            assert grads.keys() == ref_grads.keys() and grads, sorted(grads)[:3]
            out["grad"] = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
        opt_r.step()
        opt.step()
    ref_params = dict(ref.named_parameters())
    # relative norm per tensor, as in test_training: AdamW turns summation-order noise in tiny
    # gradient elements into update differences of the order of lr in any two runs
    out["params"] = max(
        ((full(p) - ref_params[n]).norm() / ref_params[n].norm()).item()
        for n, p in model.named_parameters()
        if "lora_" in n
    )
    if save:
        model.save_pretrained(os.path.join(save, "tp"))
        if dist.get_rank() == 0:
            ref.save_pretrained(os.path.join(save, "ref"))
        dist.barrier()
        a, b = _safetensors(os.path.join(save, "tp")), _safetensors(os.path.join(save, "ref"))
        assert sorted(a) == sorted(b), (sorted(a)[:3], sorted(b)[:3])
        out["saved"] = max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in a)
    out["base_frozen"] = all(
        not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n
    )
    return out


def _assert_parity(results):
    for r in results:
        assert r["logits"] <= TOL and r["grad"] <= TOL and r["params"] <= TOL, r
        assert r["base_frozen"], r


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("order", ["tpkit_first", "peft_first"])
def test_tp2_lora_matches_unsharded(ranks2, name, order):
    _assert_parity(ranks2.run(check_parity, name, order))


@pytest.mark.parametrize("order", ["tpkit_first", "peft_first"])
def test_tp2_lora_on_vocab_parallel_embedding_and_head(ranks2, order):
    _assert_parity(ranks2.run(check_parity, "llama", order, EMBED_HEAD))


#: the MLP as the gathered fallback lays it out (tpkit.settle.gathered): LoRA replicated there
GATHERED_MLP = {
    "model.layers.*.mlp.gate_proj": "colwise_gather_output",
    "model.layers.*.mlp.up_proj": "colwise_gather_output",
    "model.layers.*.mlp.down_proj": "rowwise_split_input",
}


@pytest.mark.parametrize("order", ["tpkit_first", "peft_first"])
def test_tp2_lora_on_a_gathered_pair(ranks2, order):
    _assert_parity(ranks2.run(check_parity, "llama", order, plan=GATHERED_MLP))


@pytest.mark.parametrize(
    "name, order", [("llama", "peft_first"), ("gpt2", "peft_first"), ("llama", "tpkit_first")]
)
def test_dp2_tp2_fsdp_lora_matches_unsharded(ranks4, name, order, tmp_path):
    results = ranks4.run(check_parity, name, order, save=str(tmp_path), tp_size=2, dp_size=2)
    _assert_parity(results)
    assert all(r["saved"] <= TOL for r in results), results


# ---- collectives -------------------------------------------------------------------------------
def _count_collectives(model, x) -> dict[str, int]:
    counts = {"all_reduce": 0, "all_gather": 0}
    originals = {k: getattr(dist, k) for k in counts}

    def counting(kind):
        def fn(*args, **kwargs):
            counts[kind] += 1
            return originals[kind](*args, **kwargs)

        return fn

    for k in counts:
        setattr(dist, k, counting(k))
    try:
        with torch.no_grad():
            model(input_ids=x)
        model(input_ids=x, labels=x)  # grad-mode forward (no backward)
    finally:
        for k, fn in originals.items():
            setattr(dist, k, fn)
    return counts


def check_collectives(name: str) -> dict:
    import tpkit
    from tpkit.integrations import peft as tp_peft

    x = batch(101, shape=(2, 8))
    plain = tpkit.tensor_parallel(build(name)).train()
    base = tpkit.tensor_parallel(build(name)).train()
    lora = tp_peft.get_peft_model(base, lora_config(name))
    return {"plain": _count_collectives(plain, x), "lora": _count_collectives(lora, x)}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_lora_adds_no_forward_collectives(ranks2, name):
    for r in ranks2.run(check_collectives, name):
        assert r["lora"] == r["plain"], r


def check_dropout_agrees() -> dict:
    """LoRA dropout on: every TP rank draws the same mask on replicated inputs (outputs and the
    replicated adapters' gradients stay equal) and the default RNG stream stays in sync."""
    from tpkit.integrations import peft as tp_peft

    torch.manual_seed(0)
    model = tp_peft.tensor_parallel(reference("llama", lora_dropout=0.3)).train()
    x = batch(101, shape=(2, 8))
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    with torch.no_grad():
        model.eval()
        no_drop = model(input_ids=x).logits
    checks = {
        "logits": out.logits.detach(),
        "rng": torch.get_rng_state().float(),
        "q_lora_A_grad": model.base_model.model.model.layers[0]
        .self_attn.q_proj.lora_A["default"]
        .weight.grad.to_local(),
    }
    result = {"dropout_active": not torch.allclose(out.logits, no_drop)}
    for k, t in checks.items():
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        result[k] = all(torch.equal(parts[0], p) for p in parts)
    return result


def test_lora_dropout_keeps_tp_ranks_in_step(ranks2):
    for r in ranks2.run(check_dropout_agrees):
        assert all(r.values()), r


# ---- save / load / merge -----------------------------------------------------------------------
def _safetensors(d: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(d, "adapter_model.safetensors"))


def check_save_load_merge(name: str, tmp: str, lora: dict | None = None) -> dict:
    import peft

    import tpkit
    from tpkit.integrations import peft as tp_peft

    ref, model = make(name, "tpkit_first", lora)
    x = batch(101, shape=(2, 8))
    with torch.no_grad():
        logits_ref = ref(input_ids=x).logits
        logits_tp = model(input_ids=x).logits
    tp_dir, ref_dir = os.path.join(tmp, f"{name}_tp"), os.path.join(tmp, f"{name}_ref")
    model.save_pretrained(tp_dir)
    if dist.get_rank() == 0:
        ref.save_pretrained(ref_dir)
    dist.barrier()
    out = {"forward": (logits_tp - logits_ref).abs().max().item()}
    a, b = _safetensors(tp_dir), _safetensors(ref_dir)
    out["same_keys"] = sorted(a) == sorted(b)
    out["same_shapes"] = all(a[k].shape == b[k].shape for k in a if k in b)
    # the tpkit-saved adapter in plain peft on an unsharded base
    plain = peft.PeftModel.from_pretrained(build(name), tp_dir)
    with torch.no_grad():
        out["tp_saved_in_plain"] = (plain(input_ids=x).logits - logits_ref).abs().max().item()
    # the plain-saved adapter into a tpkit base
    loaded = tp_peft.from_pretrained(tpkit.tensor_parallel(build(name)), ref_dir)
    with torch.no_grad():
        out["plain_saved_in_tp"] = (loaded(input_ids=x).logits - logits_ref).abs().max().item()
    gen = {"max_new_tokens": 4, "do_sample": False}
    out["generate_equal"] = torch.equal(loaded.generate(x, **gen), plain.generate(x, **gen))
    out["loaded_sharded"] = any(
        isinstance(p, DTensor) and p.to_local().shape != p.shape
        for n, p in loaded.named_parameters()
        if "lora_B" in n
    )
    # tpkit.from_pretrained (meta init, sharded load) + the plain-saved adapter
    base_dir = os.path.join(tmp, f"{name}_base")
    if dist.get_rank() == 0:
        build(name).save_pretrained(base_dir)
    dist.barrier()
    streamed = tp_peft.from_pretrained(tpkit.from_pretrained(base_dir, tp_size=2), ref_dir)
    with torch.no_grad():
        out["from_pretrained"] = (streamed(input_ids=x).logits - logits_ref).abs().max().item()
    # merge: the merged, still sharded model
    merged = model.merge_and_unload()
    with torch.no_grad():
        out["merged"] = (merged(input_ids=x).logits - logits_ref).abs().max().item()
    out["merged_sharded"] = all(isinstance(p, DTensor) for p in merged.parameters())
    out["merged_no_lora"] = not any("lora_" in n for n, _ in merged.named_parameters())
    return out


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_save_load_merge_round_trips(ranks2, name, tmp_path):
    lora = EMBED_HEAD if name == "llama" else None
    for r in ranks2.run(check_save_load_merge, name, str(tmp_path), lora):
        assert r["same_keys"] and r["same_shapes"] and r["loaded_sharded"], r
        assert r["generate_equal"], r
        assert r["merged_sharded"] and r["merged_no_lora"], r
        for k in ("forward", "tp_saved_in_plain", "plain_saved_in_tp", "from_pretrained", "merged"):
            assert r[k] <= TOL, r


# ---- Trainer -----------------------------------------------------------------------------------
def _trainer_losses(out: str, tp: int | None) -> dict:
    """3 Trainer steps of LoRA on the tiny Llama (tp=None: one process, plain peft), a
    checkpoint at step 3 and ``save_model``."""
    from accelerate import ParallelismConfig
    from transformers import Trainer

    from tests.test_trainer import ToyLM, losses, reset_accelerate, training_args
    from tpkit.integrations import peft as tp_peft
    from tpkit.integrations.trainer import patch_trainer, unpatch_trainer

    patch_trainer()
    reset_accelerate()
    try:
        model = reference("llama").train()
        if tp:
            model = tp_peft.tensor_parallel(model, tp_size=tp)
        config = ParallelismConfig(tp_size=tp) if tp else None
        args = training_args(out, 4, config, max_steps=STEPS, save_steps=STEPS, learning_rate=1e-3)
        trainer = Trainer(model=model, args=args, train_dataset=ToyLM())
        trainer.train()
        trainer.save_model(os.path.join(out, "final"))
        return losses(trainer)
    finally:
        unpatch_trainer()
        reset_accelerate()


def check_trainer(out: str) -> dict[int, float]:
    return _trainer_losses(out, 2)


def test_trainer_lora_tp2_matches_single_process(ranks2, tmp_path):
    from tests.test_trainer import single_process

    ref = single_process(_trainer_losses, str(tmp_path / "ref"), None)
    assert sorted(ref) == list(range(1, STEPS + 1)), ref
    for losses in ranks2.run(check_trainer, str(tmp_path / "tp2")):
        assert sorted(losses) == sorted(ref), losses
        for step, loss in ref.items():
            assert abs(losses[step] - loss) <= TOL * abs(loss), (step, losses, ref)
    # save_model wrote a normal adapter: same tensors as the single-process run's
    a, b = (
        _safetensors(str(tmp_path / "tp2" / "final")),
        _safetensors(str(tmp_path / "ref" / "final")),
    )
    assert sorted(a) == sorted(b), (sorted(a)[:3], sorted(b)[:3])
    for k in a:
        assert ((a[k] - b[k]).norm() / b[k].norm()).item() <= TOL, k


# ---- plain peft calls with patch_peft() ----------------------------------------------------------
def check_patched_plain_peft(name: str, tmp: str) -> dict:
    import peft

    import tpkit
    from tpkit.integrations.peft import patch_peft, unpatch_peft

    ref = reference(name)
    x = batch(101, shape=(2, 8))
    ref_dir, tp_dir = os.path.join(tmp, f"{name}_ref"), os.path.join(tmp, f"{name}_tp")
    if dist.get_rank() == 0:
        ref.save_pretrained(ref_dir)
    dist.barrier()
    out_r = ref(input_ids=x, labels=x)
    out_r.loss.backward()
    patch_peft()
    try:
        model = peft.get_peft_model(tpkit.tensor_parallel(build(name)), lora_config(name))
        _copy_adapters(ref, model)
        o = model(input_ids=x, labels=x)
        o.loss.backward()
        grads, ref_grads = _lora_grads(model), _lora_grads(ref)
        result = {
            "logits": (o.logits - out_r.logits).abs().max().item(),
            "grad": max((grads[n] - ref_grads[n]).abs().max().item() for n in grads),
        }
        model.save_pretrained(tp_dir)
        a, b = _safetensors(tp_dir), _safetensors(ref_dir)
        result["same_saved"] = sorted(a) == sorted(b) and all(
            (a[k] - b[k]).abs().max().item() <= TOL for k in a
        )
        loaded = peft.PeftModel.from_pretrained(tpkit.tensor_parallel(build(name)), ref_dir)
        with torch.no_grad():
            result["loaded"] = (loaded(input_ids=x).logits - out_r.logits).abs().max().item()
    finally:
        unpatch_peft()
    return result


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_patch_peft_makes_plain_peft_calls_work(ranks2, name, tmp_path):
    for r in ranks2.run(check_patched_plain_peft, name, str(tmp_path)):
        assert r["logits"] <= TOL and r["grad"] <= TOL and r["loaded"] <= TOL, r
        assert r["same_saved"], r
