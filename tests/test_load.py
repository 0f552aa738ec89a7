"""Loading straight into shards, saving whole, and reshardable DCP checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.models import batch, build, full

TOL = 1e-5


def _save_reference(name: str, path: str, **save_kwargs) -> None:
    if dist.get_rank() == 0:
        build(name).save_pretrained(path, **save_kwargs)
    dist.barrier()


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


# ---- checks -----------------------------------------------------------------------------------
def check_from_pretrained(name: str, path: str, tp_size: int | None = None, **save_kwargs) -> dict:
    import tpkit

    _save_reference(name, path, **save_kwargs)
    ref = build(name)
    model = tpkit.from_pretrained(path, tp_size=tp_size)
    x = batch(ref.config.vocab_size)
    with torch.no_grad():
        diff = _max_diff(model(input_ids=x, labels=x).logits, ref(input_ids=x, labels=x).logits)
    return {
        "diff": diff,
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "loaded_from": getattr(getattr(model, "_tpkit", None), "loaded_from", None),
        "local_numel": sum(p.to_local().numel() for p in model.parameters()),
        "total": sum(p.numel() for p in ref.parameters()),
        "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        "ref_tied": ref.get_output_embeddings().weight is ref.get_input_embeddings().weight,
    }


def check_save_pretrained_round_trip(name: str, path: str) -> dict:
    from transformers import AutoModelForCausalLM

    import tpkit

    ref = build(name)
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    with tpkit.save_tensor_parallel(model):
        sd = model.state_dict()
        model.save_pretrained(path)
    out = {"rank": dist.get_rank()}
    if dist.get_rank() == 0:
        ref_sd = ref.state_dict()
        out["keys_equal"] = list(sd) == list(ref_sd)
        out["shapes_equal"] = all(sd[k].shape == ref_sd[k].shape for k in ref_sd)
        out["values_equal"] = all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
        plain = AutoModelForCausalLM.from_pretrained(path).eval()
        x = batch(ref.config.vocab_size)
        with torch.no_grad():
            out["diff"] = _max_diff(plain(input_ids=x).logits, ref(input_ids=x).logits)
    else:
        out["empty_off_rank0"] = len(sd) == 0
    out["still_sharded"] = all(isinstance(p, DTensor) for p in model.state_dict().values())
    return out


def _train_step(model, opt, seed):
    x = batch(model.config.vocab_size, seed=seed)
    opt.zero_grad()
    model(input_ids=x, labels=x).loss.backward()
    opt.step()


def _fresh(name: str, tp: int | None, seed: int = 7):
    import tpkit

    model = build(name, seed=seed)
    if tp is not None:
        model = tpkit.tensor_parallel(model, tp_size=tp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def check_dcp_round_trip(name: str, path: str, save_tp: int, load_tp: int | None) -> dict:
    """Train a step at save_tp, save; load at load_tp (None = unsharded) into a differently
    initialised model; parameters and the next optimizer step must match."""
    import tpkit

    model, opt = _fresh(name, save_tp, seed=0)
    _train_step(model, opt, seed=1)
    tpkit.save_checkpoint(path, model, opt, step=1, note="x")
    _train_step(model, opt, seed=2)  # the continuation we must reproduce

    other, other_opt = _fresh(name, load_tp, seed=99)
    extra = tpkit.load_checkpoint(path, other, other_opt)
    _train_step(other, other_opt, seed=2)
    ref = {n: full(p) for n, p in model.named_parameters()}
    diff = max(_max_diff(full(p), ref[n]) for n, p in other.named_parameters())
    return {"diff": diff, "extra": extra}


def check_atomic_save(name: str, path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    import tpkit

    model, opt = _fresh(name, None)
    model = tpkit.tensor_parallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, seed=1)
    tpkit.save_checkpoint(path, model, opt, step=1)
    saved = {n: full(p).clone() for n, p in model.named_parameters()}
    _train_step(model, opt, seed=2)

    original = dcp.FileSystemWriter.write_data

    def crash_after_first_write(self, plan, planner):
        original(self, plan, planner).wait()
        raise RuntimeError("injected crash mid-save")

    dcp.FileSystemWriter.write_data = crash_after_first_write
    try:
        tpkit.save_checkpoint(path, model, opt, step=2)
        crashed = False
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        crashed = "injected crash" in str(exc)
    finally:
        dcp.FileSystemWriter.write_data = original
    dist.barrier()
    fresh, fresh_opt = _fresh(name, 2, seed=5)
    extra = tpkit.load_checkpoint(path, fresh, fresh_opt)
    diff = max(_max_diff(full(p), saved[n]) for n, p in fresh.named_parameters())
    return {"crashed": crashed, "step": extra.get("step"), "diff": diff}


# ---- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen3_moe", "gpt2", "t5"])
def test_from_pretrained_matches_unsharded(ranks2, tmp_path, name):
    for r in ranks2.run(check_from_pretrained, name, str(tmp_path / name)):
        assert r["diff"] <= TOL and r["all_dtensor"], r
        assert r["local_numel"] < 0.6 * r["total"], r
        # per-expert MoE checkpoints are fused by transformers' loader; the rest stream slices
        assert r["loaded_from"] == ("transformers" if name == "qwen3_moe" else "slices"), r
        assert r["tied"] == r["ref_tied"], r


def test_from_pretrained_on_dp2_tp2_applies_fsdp_after_loading(ranks4, tmp_path):
    for r in ranks4.run(check_from_pretrained, "llama", str(tmp_path / "fsdp"), 2):
        assert r["diff"] <= TOL and r["all_dtensor"] and r["loaded_from"] == "slices", r
        assert r["local_numel"] < 0.3 * r["total"], r  # 1/4 each: tp splits, FSDP shards the rest


def test_tensor_parallel_of_a_peft_model_in_one_process_keeps_it():
    import peft

    import tpkit

    model = peft.get_peft_model(build("llama"), peft.LoraConfig(target_modules=["q_proj"]))
    assert tpkit.tensor_parallel(model) is model  # world size 1: unchanged, adapters included
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_from_pretrained_sharded_multi_file_checkpoint(ranks2, tmp_path):
    path = str(tmp_path / "multi")
    for r in ranks2.run(check_from_pretrained, "llama", path, max_shard_size="40KB"):
        assert r["diff"] <= TOL, r
    assert len(list(tmp_path.glob("multi/*.safetensors"))) > 1
    assert (tmp_path / "multi" / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("name", ["llama", "llama_tied"])
def test_save_pretrained_gives_a_plain_checkpoint(ranks2, tmp_path, name):
    r0, r1 = ranks2.run(check_save_pretrained_round_trip, name, str(tmp_path / name))
    assert r0["keys_equal"] and r0["shapes_equal"] and r0["values_equal"], r0
    assert r0["diff"] <= TOL, r0
    assert r1["empty_off_rank0"], r1
    assert r0["still_sharded"] and r1["still_sharded"]


def test_dcp_round_trip_same_layout(ranks2, tmp_path):
    for r in ranks2.run(check_dcp_round_trip, "qwen3", str(tmp_path / "ck"), 2, 2):
        assert r["diff"] <= TOL and r["extra"] == {"step": 1, "note": "x"}, r


def test_dcp_reshard_tp2_to_unsharded(ranks2, tmp_path):
    for r in ranks2.run(check_dcp_round_trip, "llama_tied", str(tmp_path / "ck"), 2, None):
        assert r["diff"] <= TOL, r


def test_dcp_reshard_tp2_to_tp4(ranks4, tmp_path):
    for r in ranks4.run(check_dcp_round_trip, "llama", str(tmp_path / "ck"), 2, 4):
        assert r["diff"] <= TOL, r


def test_crash_mid_save_keeps_previous_checkpoint(ranks2, tmp_path):
    for r in ranks2.run(check_atomic_save, "llama", str(tmp_path / "ck")):
        assert r["crashed"] and r["step"] == 1 and r["diff"] == 0.0, r
    assert not (tmp_path / "ck.tmp" / ".metadata").exists()


def check_save_for_export(name: str, path: str) -> None:
    import tpkit

    tpkit.save_checkpoint(path, tpkit.tensor_parallel(build(name)))


def check_convert_and_load_recipe(name: str) -> dict:
    """The streaming recipe: empty model -> tensor_parallel on meta -> per-rank shards by part."""
    from accelerate import init_empty_weights

    import tpkit

    ref = build(name)
    with init_empty_weights(include_buffers=False):
        model = type(ref)(ref.config)
    model = tpkit.tensor_parallel(model, fill_later=True)
    full_sd = ref.state_dict()
    keys = list(full_sd)
    missing = None
    for part in (keys[: len(keys) // 2], keys[len(keys) // 2 :]):  # "load state dict part by part"
        shard = tpkit.convert_state_dict(
            {k: full_sd[k] for k in part}, model, dist.get_world_size(), dist.get_rank()
        )
        missing = tpkit.load_local_state_dict(model, shard)
    x = batch(ref.config.vocab_size)
    with torch.no_grad():
        diff = _max_diff(model(input_ids=x, labels=x).logits, ref(input_ids=x, labels=x).logits)
    device_map = tpkit.infer_sharded_device_map(model)
    return {
        "diff": diff,
        "missing": missing,
        "device_map_ok": set(device_map.values()) == {"cpu"},
    }


def test_export_dcp_to_hf_without_process_group(ranks2, tmp_path):
    from transformers import AutoModelForCausalLM

    import tpkit

    ranks2.run(check_save_for_export, "llama_tied", str(tmp_path / "ck"))
    out = tpkit.export_checkpoint(tmp_path / "ck", tmp_path / "hf")
    plain = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ref = build("llama_tied")
    x = batch(ref.config.vocab_size)
    with torch.no_grad():
        assert _max_diff(plain(input_ids=x).logits, ref(input_ids=x).logits) == 0.0
    assert plain.get_output_embeddings().weight is plain.get_input_embeddings().weight


def test_convert_state_dict_part_by_part(ranks2):
    for r in ranks2.run(check_convert_and_load_recipe, "llama_tied"):
        assert r["diff"] <= TOL and r["device_map_ok"], r


def test_convert_state_dict_all_ranks_covers_the_tensor():
    import tpkit

    model = build("qwen3_moe")
    shards = tpkit.convert_state_dict(model.state_dict(), model, world_size=2)
    key = "model.layers.0.mlp.experts.gate_up_proj"  # packed [gate; up]: strided halves
    full_t = model.state_dict()[key]
    inter = full_t.shape[1] // 2
    assert shards[0][key].shape[1] == inter
    torch.testing.assert_close(shards[0][key][:, : inter // 2], full_t[:, : inter // 2])
    torch.testing.assert_close(shards[1][key][:, inter // 2 :], full_t[:, inter + inter // 2 :])
    vocab = model.state_dict()["lm_head.weight"].shape[0]  # 101: uneven, torch.chunk split
    assert [s["lm_head.weight"].shape[0] for s in shards] == [51, vocab - 51]
