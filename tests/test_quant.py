"""Quantized bases on TP shards (tpkit.quant): QLoRA at tp=2 with bitsandbytes nf4 and int8.

Written as the user's own calls (``tpkit.from_pretrained(..., quantization_config=...)``, plain
``peft.get_peft_model``, ``tpkit.tensor_parallel`` of a model transformers quantized) and compared
with the single-process bitsandbytes model of the same checkpoint. Tiny Llamas from configs
(hidden 128, so 4-bit blocks of 64 align), saved to a temporary directory; nothing is downloaded.
Every multi-rank check runs in the session's two-rank group, each with a timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch

pytest.importorskip(
    "bitsandbytes", reason="bitsandbytes is not installed (pip install tpkit[quant])"
)

TIMEOUT = 150
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MEMORY_GOAL = 0.14  # per-rank weight bytes at tp=2, nf4, over the fp32 model's


def _config(intermediate: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    """Llama "aligned" (every split is whole 64-blocks at tp=2) and "misaligned" (down_proj's
    192 input features give each rank 96, not whole blocks); Qwen3 with a tied head."""
    from transformers import LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    paths = {}
    for name, intermediate in (("aligned", 256), ("misaligned", 192)):
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(name)
        LlamaForCausalLM(_config(intermediate)).save_pretrained(path)
        paths[name] = str(path)
    torch.manual_seed(0)
    qwen3 = Qwen3Config(  # tied head (left float), per-head q/k norms
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
    )
    paths["qwen3"] = str(tmp_path_factory.mktemp("qwen3"))
    Qwen3ForCausalLM(qwen3).save_pretrained(paths["qwen3"])
    return paths


# ---- helpers (run inside the ranks) -------------------------------------------------------------
def nf4(compute=torch.float32, **kw):
    from transformers import BitsAndBytesConfig

    kw = {"bnb_4bit_quant_type": "nf4", **kw}
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute, **kw)


def int8():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=True)


def single(path: str, config, dtype=torch.float32):
    """The single-process bitsandbytes model (AVX512-BF16 repacking off: after one eval forward
    it would otherwise repack the 4-bit weights in place and training would go wrong)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, dtype=dtype, device_map="cpu"
    )
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model


def inputs(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(seed))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def expected_shard(module, full: torch.Tensor, per_row: int, rank: int) -> torch.Tensor:
    """``full`` (one row of ``per_row`` values per output feature) cut as ``module`` was."""
    (n, k), (ln, lk) = module.quant.global_shape, module.quant.local_shape
    rows = full.reshape(n, -1)
    if ln != n:
        return rows[rank * ln : (rank + 1) * ln].reshape(-1)
    if lk != k:
        width = rows.shape[1] * lk // k
        return rows[:, rank * width : (rank + 1) * width].reshape(-1)
    return rows.reshape(-1)


def same_bytes(model, ref) -> tuple[int, int]:
    """(quantized linears whose shard is exactly the single-process bytes cut, all of them)."""
    from tpkit.quant import Linear4bitShard, QuantizedLinear
    from tpkit.quant.pack import float_absmax

    rank = int(os.environ["RANK"])
    refs = dict(ref.named_modules())
    same = total = 0
    for name, m in model.named_modules():
        if not isinstance(m, QuantizedLinear):
            continue
        total += 1
        r = refs[name]
        if isinstance(m, Linear4bitShard):
            ok = torch.equal(m.weight.reshape(-1), expected_shard(m, r.weight.data, 0, rank))
            absmax = float_absmax(r.weight.quant_state)
            ok = ok and torch.equal(m.absmax, expected_shard(m, absmax, 0, rank))
        else:
            scb = r.weight.SCB if r.weight.SCB is not None else r.state.SCB
            ok = torch.equal(m.weight.reshape(-1), expected_shard(m, r.weight.data, 0, rank))
            ln, n = m.quant.local_shape[0], m.quant.global_shape[0]
            want = scb[rank * ln : (rank + 1) * ln] if ln != n else scb
            ok = ok and torch.equal(m.scb, want.float())
        same += int(ok)
    return same, total


def fp32_bytes(path: str) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() * 4 for p in model.parameters())


# ---- checks (run on every rank) -----------------------------------------------------------------
def check_nf4_load(path: str) -> dict:
    """from_pretrained quantizing per rank: bytes, memory, logits and greedy tokens."""
    import tpkit
    from tpkit.quant import quantized_weight_bytes

    ref = single(path, nf4())
    model = tpkit.from_pretrained(path, tp_size=2, quantization_config=nf4())
    x = inputs()
    with torch.no_grad():
        logits = rel(model(x).logits, ref(x).logits)
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    tokens = model.generate(x, **kw).tolist() == ref.generate(x, **kw).tolist()
    out = {
        "same_bytes": same_bytes(model, ref),
        "ratio": quantized_weight_bytes(model) / fp32_bytes(path),
        "logits": logits,
        "tokens": tokens,
    }
    # the README's call: bf16 compute (row-parallel partial sums rounded to bf16 per rank)
    bf16 = tpkit.from_pretrained(path, tp_size=2, quantization_config=nf4(torch.bfloat16))
    with torch.no_grad():
        out["bf16_compute"] = rel(bf16(x).logits, single(path, nf4(torch.bfloat16))(x).logits)
    model.to(torch.bfloat16)  # a cast moves the scales, never rounds them
    scales = [m.absmax for m in model.modules() if hasattr(m, "absmax")]
    out["scales_fp32"] = bool(scales) and all(t.dtype == torch.float32 for t in scales)
    return out


def check_qlora(path: str, adapter_dir: str) -> dict:
    """Plain peft on the tp=2 nf4 model; its saved adapter loaded by plain peft on the
    single-process quantized base; gradients and 5 AdamW steps side by side."""
    import peft
    import torch.distributed as dist
    from peft import LoraConfig
    from torch.distributed.tensor import DTensor

    import tpkit

    model = tpkit.from_pretrained(path, tp_size=2, quantization_config=nf4())
    torch.manual_seed(0)
    config = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False
    )
    model = peft.get_peft_model(model, config)
    model.save_pretrained(adapter_dir)  # every rank: gathered, rank 0 writes
    dist.barrier()
    ref = peft.PeftModel.from_pretrained(single(path, nf4()), adapter_dir, is_trainable=True)
    model.train()
    ref.train()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ref_params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(params.values(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_params.values(), lr=1e-2)
    losses, ref_losses, grads = [], [], 0.0
    x = inputs(10)
    for step in range(5):
        for m, o, out in ((model, opt, losses), (ref, ref_opt, ref_losses)):
            o.zero_grad()
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            out.append(loss.item())
        if step == 0:
            for n, p in params.items():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads = max(grads, rel(g, ref_params[n].grad))
        opt.step()
        ref_opt.step()
    losses_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    # resume: a DCP checkpoint (adapters and optimizer; the base re-made from the checkpoint)
    tpkit.save_checkpoint(os.path.join(adapter_dir, "dcp"), model, opt)
    again = peft.get_peft_model(
        tpkit.from_pretrained(path, tp_size=2, quantization_config=nf4()), config
    )
    again_opt = torch.optim.AdamW([p for p in again.parameters() if p.requires_grad], lr=1e-2)
    tpkit.load_checkpoint(os.path.join(adapter_dir, "dcp"), again, again_opt)
    with torch.no_grad():
        resumed = rel(again(input_ids=x).logits, model(input_ids=x).logits)
    return {
        "resumed": resumed,
        "grads": grads,
        "n_params": len(params),
        "same_names": set(params) == set(ref_params),
        "losses": losses_rel,
        "trained": losses[-1] < losses[0],
    }


def check_qwen3_tied(path: str, adapter_dir: str) -> dict:
    """Qwen3 (tied embeddings, per-head norms): logits and "all-linear" LoRA gradients."""
    import peft
    import torch.distributed as dist
    from peft import LoraConfig
    from torch.distributed.tensor import DTensor

    import tpkit

    model = tpkit.from_pretrained(path, tp_size=2, quantization_config=nf4())
    ref = single(path, nf4())
    x = inputs()
    with torch.no_grad():
        logits = rel(model(x).logits, ref(x).logits)
    torch.manual_seed(0)
    config = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(model, config)
    model.save_pretrained(adapter_dir)
    dist.barrier()
    ref = peft.PeftModel.from_pretrained(ref, adapter_dir, is_trainable=True)
    for m in (model, ref):
        m.train()
        m(input_ids=x, labels=x).loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    grads = [
        rel(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad, ref_grads[n])
        for n, p in model.named_parameters()
        if p.requires_grad
    ]
    return {"logits": logits, "grads": max(grads), "n": len(grads)}


def check_tensor_parallel_of_bnb(path: str) -> dict:
    """tensor_parallel of models transformers quantized: the packed bytes sliced, double
    quantization included; plain peft on top."""
    import peft
    from peft import LoraConfig

    import tpkit

    out = {}
    x = inputs()
    configs = {
        "nf4": nf4(),
        "nf4_double": nf4(bnb_4bit_use_double_quant=True),
        "fp4": nf4(bnb_4bit_quant_type="fp4"),
    }
    for label, config in configs.items():
        ref = single(path, config)
        model = tpkit.tensor_parallel(single(path, config))
        with torch.no_grad():
            out[label] = rel(model(x).logits, ref(x).logits)
    lora = LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False)
    adapted = peft.get_peft_model(model, lora)
    adapted(input_ids=x, labels=x).loss.backward()
    out["lora_backward"] = all(p.grad is not None for p in adapted.parameters() if p.requires_grad)
    return out


def check_int8(path: str) -> dict:
    """8-bit: from_pretrained quantizing per rank (the row-parallel scales all-reduced) and
    tensor_parallel of a transformers int8 model, against bitsandbytes' own forward."""
    import tpkit

    ref = single(path, int8())
    ref.train()  # bitsandbytes' CPU path that dequantizes the int8 weight (what tpkit computes)
    x = inputs()
    loaded = tpkit.from_pretrained(path, tp_size=2, dtype=torch.float32, quantization_config=int8())
    sliced = tpkit.tensor_parallel(single(path, int8()))
    with torch.no_grad():
        want = ref(x).logits
        out = {"load": rel(loaded(x).logits, want), "sliced": rel(sliced(x).logits, want)}
        ref.eval()  # bitsandbytes' inference path quantizes activations too: for the record
        out["vs_int8_activations"] = rel(loaded(x).logits, ref(x).logits)
    out["same_bytes"] = same_bytes(loaded, ref)
    return out


def check_refusals(aligned: str, misaligned: str) -> dict:
    """What cannot be sharded is refused: a ValueError on every rank, before any collective."""
    import peft
    import torch.distributed as dist
    from peft import LoraConfig

    import tpkit

    quantized = tpkit.from_pretrained(aligned, tp_size=2, quantization_config=nf4())
    calls = []
    names = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "barrier")
    saved = {n: getattr(dist, n) for n in names}
    for n in names:
        setattr(dist, n, lambda *a, _n=n, **k: calls.append(_n) or saved[_n](*a, **k))
    messages = {}
    cases = {
        "double_quant": lambda: tpkit.from_pretrained(
            aligned, tp_size=2, quantization_config=nf4(bnb_4bit_use_double_quant=True)
        ),
        "misaligned": lambda: tpkit.from_pretrained(
            misaligned, tp_size=2, quantization_config=nf4()
        ),
        "scheme": lambda: tpkit.from_pretrained(
            aligned, tp_size=2, quantization_config={"quant_method": "gptq", "bits": 4}
        ),
    }
    bnb_model = single(misaligned, nf4())
    cases["misaligned_tp"] = lambda: tpkit.tensor_parallel(bnb_model)
    adapted = peft.get_peft_model(single(aligned, nf4()), LoraConfig(r=4, target_modules=TARGETS))
    cases["peft_first"] = lambda: tpkit.tensor_parallel(adapted)
    cases["save_base"] = lambda: quantized.save_pretrained(tempfile.mkdtemp())
    try:
        for name, call in cases.items():
            try:
                call()
                messages[name] = None
            except ValueError as exc:
                messages[name] = str(exc)
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    with torch.no_grad():  # the refused model is left as it was, and still runs
        ref = single(misaligned, nf4())
        messages["restored"] = rel(bnb_model(inputs()).logits, ref(inputs()).logits) == 0.0
    messages["collectives"] = calls
    # the fixes the message names work: the layer kept in float, or its group left whole
    skip = nf4(llm_int8_skip_modules=["down_proj", "lm_head"])
    fixes = [
        tpkit.from_pretrained(misaligned, tp_size=2, quantization_config=skip),
        tpkit.from_pretrained(
            misaligned,
            tp_size=2,
            quantization_config=nf4(),
            plan={"model.layers.*.mlp.*": "replicate"},
        ),
    ]
    with torch.no_grad():
        want = [single(misaligned, skip)(inputs()).logits, ref(inputs()).logits]
        messages["fixes"] = [rel(m(inputs()).logits, w) for m, w in zip(fixes, want)]
    return messages


# ---- tests --------------------------------------------------------------------------------------
def test_import_tpkit_does_not_import_bitsandbytes():
    code = "import sys, tpkit; assert 'bitsandbytes' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_nf4_from_pretrained_tp2(ranks2, tiny):
    for r in ranks2.run(check_nf4_load, tiny["aligned"], timeout=TIMEOUT):
        same, total = r["same_bytes"]
        assert total == 14 and same == total, r  # 7 linears x 2 layers, each bit-identical
        assert r["ratio"] <= MEMORY_GOAL, r
        assert r["logits"] <= 1e-5, r
        assert r["tokens"], r
        assert r["bf16_compute"] <= 1e-2 and r["scales_fp32"], r


def test_qlora_tp2_matches_single_process(ranks2, tiny, tmp_path):
    for r in ranks2.run(check_qlora, tiny["aligned"], str(tmp_path), timeout=TIMEOUT):
        assert r["same_names"] and r["n_params"] == 28, r
        assert r["grads"] <= 1e-5, r
        assert r["losses"] <= 1e-5, r
        assert r["trained"], r
        assert r["resumed"] == 0.0, r


def test_qwen3_tied_head_and_head_norms(ranks2, tiny, tmp_path):
    for r in ranks2.run(check_qwen3_tied, tiny["qwen3"], str(tmp_path), timeout=TIMEOUT):
        assert r["logits"] <= 1e-5 and r["grads"] <= 1e-5 and r["n"] == 28, r


def test_tensor_parallel_slices_transformers_quantized_model(ranks2, tiny):
    for r in ranks2.run(check_tensor_parallel_of_bnb, tiny["aligned"], timeout=TIMEOUT):
        assert max(r["nf4"], r["nf4_double"], r["fp4"]) <= 1e-5, r
        assert r["lora_backward"], r


def test_int8_forward_parity(ranks2, tiny):
    for r in ranks2.run(check_int8, tiny["aligned"], timeout=TIMEOUT):
        assert r["load"] <= 1e-5 and r["sliced"] <= 1e-5, r
        same, total = r["same_bytes"]
        assert total == 14 and same == total, r


def test_refusals(ranks2, tiny):
    for r in ranks2.run(check_refusals, tiny["aligned"], tiny["misaligned"], timeout=TIMEOUT):
        assert "bnb_4bit_use_double_quant" in r["double_quant"], r
        for key in ("misaligned", "misaligned_tp"):
            msg = r[key]
            assert "down_proj" in msg and "96" in msg and "64" in msg, msg
            assert "llm_int8_skip_modules=['down_proj', 'lm_head']" in msg, msg
            assert "plan={'model.layers.*.mlp.*': 'replicate'}" in msg, msg
        assert "gptq" in r["scheme"], r
        assert "peft.get_peft_model(tpkit.tensor_parallel(base), config)" in r["peft_first"], r
        assert "q_proj" in r["save_base"] and "tpkit.save_checkpoint" in r["save_base"], r
        assert r["restored"], r
        assert r["collectives"] == [], r
        assert max(r["fixes"]) <= 1e-5, r


def test_single_process_load_of_unaligned_widths(tmp_path):
    """One process (no torchrun): every linear is whole, so widths that are not whole blocks
    (here 160 = 2.5 blocks of 64) quantize as bitsandbytes pads them, bit for bit."""
    from transformers import LlamaForCausalLM

    import tpkit

    torch.manual_seed(0)
    LlamaForCausalLM(_config(160)).save_pretrained(tmp_path)
    model = tpkit.from_pretrained(tmp_path, quantization_config=nf4())
    ref = single(str(tmp_path), nf4())
    down, want = model.model.layers[0].mlp.down_proj, ref.model.layers[0].mlp.down_proj
    assert torch.equal(down.weight, want.weight.data), "packed bytes differ"
    with torch.no_grad():
        assert rel(model(inputs()).logits, ref(inputs()).logits) == 0.0
