"""Trust under bad inputs and faults: every case is one clear error on every rank, never a hang,
a silent wrong result or a lost checkpoint. (Checkpoint-file cases: test_checkpoint.py.)"""

from __future__ import annotations

import copy
import json
import os
import struct
import threading
import time

import pytest
import torch
import torch.distributed as dist
import transformers as tf
from safetensors.torch import save_file

from tests.harness import RankError, RankGroup
from tests.models import ATTN, batch, build


def _error(fn, *args, **kwargs) -> str:
    """The error ``fn`` raises, as 'Type: message', or 'no error'."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the message is what the tests compare
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# ---- safetensors headers, checked before anything is trusted (single process) ------------------
def _write_raw(path, header: dict, data: bytes) -> str:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def _index_error(path) -> str:
    from tpkit.io.safetensors import CheckpointIndex

    return _error(CheckpointIndex, path)


def test_truncated_safetensors_is_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(4, 4), "b": torch.zeros(8)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-5])
    msg = _index_error(path)
    assert "CheckpointError" in msg and str(path) in msg and "'b'" in msg and "past the end" in msg


def test_huge_header_length_is_refused_without_allocating(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    msg = _index_error(path)
    assert "CheckpointError" in msg and "header length 1099511627776" in msg


def test_overlapping_and_aliased_offsets_are_refused(tmp_path):
    f32 = {"dtype": "F32", "shape": [2]}
    aliased = {"a": {**f32, "data_offsets": [0, 8]}, "b": {**f32, "data_offsets": [0, 8]}}
    msg = _index_error(_write_raw(tmp_path / "alias.safetensors", aliased, bytes(8)))
    assert "overlaps" in msg and "'b'" in msg or "'a'" in msg
    overlap = {"a": {**f32, "data_offsets": [0, 8]}, "b": {**f32, "data_offsets": [4, 12]}}
    msg = _index_error(_write_raw(tmp_path / "overlap.safetensors", overlap, bytes(12)))
    assert "overlaps" in msg and "'b'" in msg


def test_offsets_that_do_not_match_the_shape_are_refused(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}
    msg = _index_error(_write_raw(tmp_path / "m.safetensors", header, bytes(8)))
    assert "needs 16 bytes" in msg and "'a'" in msg


def test_malformed_header_json_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", 5) + b"{oops")
    msg = _index_error(path)
    assert "not valid JSON" in msg and str(path) in msg


def _tiny_llama(vocab: int) -> tf.LlamaForCausalLM:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**{**ATTN, "vocab_size": vocab}))


def test_checkpoint_of_another_size_is_refused_before_loading(tmp_path):
    import tpkit

    _tiny_llama(512).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["vocab_size"] = 256
    (tmp_path / "config.json").write_text(json.dumps(config))
    msg = _error(tpkit.from_pretrained, tmp_path)
    assert "ValueError" in msg and "model.embed_tokens.weight" in msg
    assert "(256, 64)" in msg and "(512, 64)" in msg


# ---- arguments refused even in one process -----------------------------------------------------
@pytest.mark.parametrize("tp_size", ["2", 2.0, True])
def test_tp_size_must_be_an_int(tp_size):
    import tpkit

    msg = _error(tpkit.tensor_parallel, build("llama"), tp_size=tp_size)
    assert msg.startswith("TypeError: tp_size must be an int"), msg


def test_plan_mode_typo_names_the_fix():
    import tpkit

    msg = _error(tpkit.tensor_parallel, build("llama"), plan="infered")
    assert "ValueError" in msg and "did you mean 'infer'" in msg


def test_missing_and_malformed_yaml_plans_name_the_file(tmp_path):
    from tpkit.plan import Plan, check_plan_arg

    missing = tmp_path / "nope.yaml"
    assert "FileNotFoundError" in _error(check_plan_arg, missing)
    assert "no such YAML file" in _error(check_plan_arg, str(missing))
    bad = tmp_path / "bad.yaml"
    bad.write_text("plan:\n  a: colwise\n b: [\n")
    msg = _error(Plan.from_yaml, str(bad))
    assert str(bad) in msg and "not valid YAML at line" in msg


# ---- multi-rank: one clear error on every rank, before any collective --------------------------
def check_error(case: str) -> str:
    """Run one bad-input case on every rank; return the error each rank got."""
    import tpkit

    if case == "tp_twice_other_size":
        model = tpkit.tensor_parallel(build("llama"))
        return _error(tpkit.tensor_parallel, model, tp_size=1)
    if case == "foreign_dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        model = build("llama")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        parallelize_module(model.model.layers[0].mlp.up_proj, mesh, ColwiseParallel())
        return _error(tpkit.tensor_parallel, model)
    if case == "device_ids_short":
        return _error(tpkit.tensor_parallel, build("llama"), ["cpu"])
    if case == "tp_size_str":
        return _error(tpkit.tensor_parallel, build("llama"), tp_size="2")
    if case == "meta_never_loaded":
        with torch.device("meta"):
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**ATTN))
        return _error(tpkit.tensor_parallel, model)  # refused before the split (issue 46)
    if case == "int8_weights":
        model = build("llama")
        proj = model.model.layers[0].mlp.up_proj
        proj.weight = torch.nn.Parameter(proj.weight.data.to(torch.int8), requires_grad=False)
        return _error(tpkit.tensor_parallel, model)
    if case == "conflicting_pair":
        plan = {"model.layers.*.mlp.down_proj": "colwise"}
        return _error(tpkit.tensor_parallel, build("llama"), plan=plan)
    if case in ("sp_encoder", "loss_parallel_encoder"):
        torch.manual_seed(0)
        bert = tf.BertForMaskedLM(
            tf.BertConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                vocab_size=101,
            )
        )
        option = "sequence_parallel" if case == "sp_encoder" else "loss_parallel"
        return _error(tpkit.tensor_parallel, bert, **{option: True})
    if case == "lora_variant":  # DoRA is exact now; the variants tpkit cannot split are refused
        from peft import LoraConfig, get_peft_model

        from tpkit.integrations import peft as tp_peft

        cfg = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], alora_invocation_tokens=[1])
        return _error(tp_peft.tensor_parallel, get_peft_model(build("llama"), cfg))
    if case == "different_lengths":
        model = tpkit.tensor_parallel(build("llama"))
        x = batch(101, shape=(2, 9 + dist.get_rank()))  # rank 1 gets a longer sequence
        return _error(model, input_ids=x)
    if case == "different_seeds":
        model = tpkit.tensor_parallel(build("llama"))
        x = batch(101, seed=dist.get_rank())  # torch's default seed differs per process
        return _error(model, input_ids=x)
    raise KeyError(case)


CASES = {
    "tp_twice_other_size": "is already tensor-parallel (tp_size=2",
    "foreign_dtensor": "already has DTensor parameters (e.g. model.layers.0.mlp.up_proj.weight)",
    "device_ids_short": "device_ids has 1 entries but this node runs 2 ranks",
    "tp_size_str": "TypeError: tp_size must be an int",
    "meta_never_loaded": "on the meta device (e.g.",
    "int8_weights": "model.layers.0.mlp.up_proj.weight (colwise) holds torch.int8",
    "conflicting_pair": "down_proj is colwise but its input comes from model.layers.0.mlp.gate_",
    "sp_encoder": "sequence_parallel needs every row-parallel layer in the same module",
    "loss_parallel_encoder": "loss_parallel needs a causal LM",
    "lora_variant": "a LoRA variant tpkit does not split",
    "different_lengths": "'input_ids' differs across the TP group",
    "different_seeds": "'input_ids' differs across the TP group",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_clear_error_on_every_rank(ranks2, case):
    messages = ranks2.run(check_error, case, timeout=120)
    for msg in messages:
        assert CASES[case] in msg, msg


def check_tp_twice_is_idempotent() -> dict:
    import tpkit

    ref = build("llama")
    once = tpkit.tensor_parallel(copy.deepcopy(ref))
    twice = tpkit.tensor_parallel(once)
    x = batch(101)
    diff = (twice(input_ids=x).logits - ref(input_ids=x).logits).abs().max().item()
    return {"same_object": twice is once, "diff": diff}


def test_tensor_parallel_twice_returns_the_model_unchanged(ranks2):
    for r in ranks2.run(check_tp_twice_is_idempotent):
        assert r["same_object"] and r["diff"] <= 1e-5, r


def _fds_and_threads() -> tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), threading.active_count()


def check_no_leak_per_call(calls: int) -> dict:
    import tpkit

    tpkit.tensor_parallel(build("llama"), tp_size=2)  # first call builds the mesh
    before = _fds_and_threads()
    for _ in range(calls):
        tpkit.tensor_parallel(build("llama"), tp_size=2)
    after = _fds_and_threads()
    return {"fds": after[0] - before[0], "threads": after[1] - before[1]}


def test_repeated_tensor_parallel_calls_leak_no_groups(ranks2):
    for r in ranks2.run(check_no_leak_per_call, 10):
        assert r["fds"] <= 0 and r["threads"] <= 0, r


def check_shm_dead_peer(timeout_s: str) -> str:
    """Rank 1 never enters the shared-memory all-reduce: rank 0 must fail within the group's
    timeout, as a gloo collective on that group would (tpkit's own groups carry TPKIT_TIMEOUT:
    `test_dp_sub_groups_get_tpkit_timeout`)."""
    import datetime

    from tpkit.parallel.shm import ShmChannel

    group = dist.new_group(timeout=datetime.timedelta(seconds=float(timeout_s)))
    channel = ShmChannel(group)
    if dist.get_rank() == 1:
        return "skipped"
    start = time.monotonic()
    msg = _error(channel.all_reduce, torch.ones(4))
    return f"{msg} after {time.monotonic() - start:.1f}"


def test_shm_all_reduce_gives_up_on_a_dead_peer_after_the_group_timeout(ranks2):
    msg = ranks2.run(check_shm_dead_peer, "2", timeout=60)[0]
    assert "timed out after 2 s waiting for group rank(s) [1]" in msg, msg
    assert float(msg.rsplit(" ", 1)[1]) < 10, msg


def check_sub_group_timeout() -> str:
    """dp x tp: rank 3 skips an all-reduce on its dp group; rank 1 must time out in
    TPKIT_TIMEOUT (set for this group), not torch's 30 minutes."""
    import tpkit

    mesh = tpkit.build_mesh(2, 2)
    rank = dist.get_rank()
    if rank in (0, 2):
        return "other dp group"
    if rank == 3:
        return "skipped"
    start = time.monotonic()
    msg = _error(dist.all_reduce, torch.ones(1), group=mesh["dp"].get_group())
    return f"{msg} after {time.monotonic() - start:.1f}"


def test_dp_sub_groups_get_tpkit_timeout():
    group = RankGroup(4, env={"TPKIT_TIMEOUT": "3"})
    try:
        results = group.run(check_sub_group_timeout, timeout=90)
    except RankError as exc:  # a hang past 90 s means the sub-group kept torch's default
        pytest.fail(f"the dp sub-group did not time out: {exc}")
    finally:
        group.close()
    msg = results[1]
    assert "timed out" in msg.lower() or "Timeout" in msg, msg
    assert float(msg.rsplit(" ", 1)[1]) < 30, msg


def test_timeout_report_names_the_users_line():
    from tpkit.parallel.timeouts import collective_frame

    def user_code():
        from tpkit.parallel import comm

        comm.reduce_from_tp(torch.ones(2), group=object())  # fails inside torch.distributed

    try:
        user_code()
    except Exception as exc:  # noqa: BLE001
        tb = exc.__traceback__
    collective, where = collective_frame(tb)
    assert collective is not None
    assert __file__ in where and "user_code" in where, where
