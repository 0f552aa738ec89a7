"""generate() on tensor-parallel models: the same tokens as the unsharded model, on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.models import batch, build

MODES = {
    "greedy": dict(do_sample=False),
    "beam": dict(do_sample=False, num_beams=5),
    "sample": dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9),
}


def _generate(model, prompt, mode, seed=3, **extra):
    torch.manual_seed(seed)
    return model.generate(
        prompt, max_new_tokens=6, min_new_tokens=6, pad_token_id=0, **MODES[mode], **extra
    )


def _gathered_equal(t: torch.Tensor) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return all(torch.equal(parts[0], p) for p in parts)


def check_generate(name: str) -> dict:
    import tpkit

    ref = build(name)
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    prompt = batch(ref.config.vocab_size, shape=(2, 5))
    out = {}
    for mode in MODES:
        with torch.no_grad():
            tokens = _generate(model, prompt, mode)
            expected = _generate(ref, prompt, mode)
        out[mode] = {
            "equal": torch.equal(tokens, expected),
            "same_on_ranks": _gathered_equal(tokens),
        }
    return out


def check_kv_cache(name: str, mode: str) -> dict:
    """After the prompt, each decode step feeds one token per sequence; the cache holds 1/tp."""
    import tpkit

    ref = build(name)
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    lengths = []

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids")
        lengths.append(ids.shape[1] if ids is not None else kwargs["inputs_embeds"].shape[1])

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    prompt = batch(ref.config.vocab_size, shape=(2, 5))
    with torch.no_grad():
        out = _generate(model, prompt, mode, return_dict_in_generate=True)
        ref_out = _generate(ref, prompt, mode, return_dict_in_generate=True)
    handle.remove()

    def cache_bytes(o):
        return sum(
            t.numel() * t.element_size()
            for layer in o.past_key_values.layers
            for t in (layer.keys, layer.values)
        )

    return {"lengths": lengths, "bytes": cache_bytes(out), "ref_bytes": cache_bytes(ref_out)}


def check_different_prompts_rejected(name: str) -> str:
    import tpkit

    model = tpkit.tensor_parallel(build(name))
    prompt = batch(101, shape=(1, 5), seed=dist.get_rank())  # each rank a different prompt
    try:
        model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def check_check_can_be_switched_off(name: str) -> int:
    import tpkit

    model = tpkit.tensor_parallel(build(name))
    prompt = batch(101, shape=(1, 5))
    with torch.no_grad():
        return model.generate(
            prompt, max_new_tokens=2, pad_token_id=0, tp_check_inputs=False
        ).shape[1]


@pytest.mark.parametrize("name", ["llama", "qwen3", "llama_tied", "gpt2", "opt", "t5"])
def test_generate_same_tokens_tp2(ranks2, name):
    for r in ranks2.run(check_generate, name):
        for mode, res in r.items():
            assert res["equal"] and res["same_on_ranks"], (mode, r)


@pytest.mark.parametrize("name", ["llama", "gpt2", "opt", "t5"])
def test_generate_same_tokens_tp4(ranks4, name):
    for r in ranks4.run(check_generate, name):
        for mode, res in r.items():
            assert res["equal"] and res["same_on_ranks"], (mode, r)


@pytest.mark.parametrize("mode", ["greedy", "beam"])
def test_kv_cache_is_used_and_sharded(ranks2, mode):
    for r in ranks2.run(check_kv_cache, "llama", mode):
        assert r["lengths"][0] == 5 and set(r["lengths"][1:]) == {1}, r
        assert r["bytes"] * 2 == r["ref_bytes"], r


def test_ranks_with_different_prompts_are_caught(ranks2):
    for msg in ranks2.run(check_different_prompts_rejected, "llama"):
        assert "input" in msg and "differ" in msg, msg


def test_input_check_can_be_switched_off(ranks2):
    assert ranks2.run(check_check_can_be_switched_off, "llama") == [7, 7]
