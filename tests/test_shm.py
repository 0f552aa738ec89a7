"""The same-host shared-memory collectives (`tpkit.shm`), on by default for no-grad CPU work.

Behaviour only, never timing: the same tokens with the fast path on and off, every fast-path
collective counted, a clean fallback where it does not apply, and the sums exact and in rank order.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from tests.harness import RankGroup
from tests.models import batch, build


def _greedy(model, prompt):
    with torch.no_grad():
        return model.generate(
            prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0
        )


def check_same_tokens_on_and_off(name: str) -> dict:
    import tpkit
    from tpkit import shm

    ref = build(name)
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    group = model._tpkit.tp_mesh.get_group()
    prompt = batch(ref.config.vocab_size, shape=(2, 5))
    before = shm.shm_counts()
    on = _greedy(model, prompt)
    after_on = shm.shm_counts()
    previous = shm.set_shm_enabled(False)
    try:
        off = _greedy(model, prompt)
    finally:
        shm.set_shm_enabled(previous)
    after_off = shm.shm_counts()
    with torch.no_grad():
        logits = model(input_ids=prompt).logits
    with torch.inference_mode():
        inference = model(input_ids=prompt).logits
    return {
        "inference_mode": torch.equal(logits, inference),
        "fast": shm.prepare_shm(group),
        "equal_on_off": torch.equal(on, off),
        "equal_ref": torch.equal(on, _greedy(ref, prompt)),
        "on_calls": after_on["all_reduce"] - before["all_reduce"],
        "on_gathers": after_on["all_gather"] - before["all_gather"],
        "off_calls": after_off["all_reduce"] - after_on["all_reduce"],
    }


def test_greedy_tokens_are_the_same_with_shared_memory_on_and_off(ranks2):
    for name in ("llama", "gpt2"):
        for r in ranks2.run(check_same_tokens_on_and_off, name):
            assert r["fast"], r  # one host, gloo: the default takes the fast path
            assert r["equal_on_off"] and r["equal_ref"] and r["inference_mode"], (name, r)
            assert r["on_calls"] > 0 and r["off_calls"] == 0, (name, r)


def check_sums_and_gathers() -> dict:
    from tpkit import shm

    group = dist.new_group(list(range(dist.get_world_size())))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"fast": shm.prepare_shm(group)}
    seen = []
    with shm.observe_shm(lambda kind, n: seen.append((kind, n))):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            x = torch.arange(6, dtype=dtype).reshape(2, 3) * (rank + 1)
            want = torch.arange(6, dtype=dtype).reshape(2, 3) * sum(range(1, world + 1))
            got = shm.shm_all_reduce(x.clone(), group)
            out[f"sum {dtype}"] = got is not None and torch.equal(got, want)
        g = shm.shm_all_gather(torch.full((3,), float(rank)), group)
        out["gather"] = g is not None and g.tolist() == [[float(r)] * 3 for r in range(world)]
        big = torch.zeros(shm.ShmChannel.SLOT // 4 + 1)
        out["too large"] = shm.shm_all_reduce(big, group)
        out["meta"] = shm.shm_all_reduce(torch.zeros(4, device="meta"), group)
    out["seen"] = seen
    for _ in range(50):  # alternating buffers: many calls back to back stay exact
        x = torch.full((8,), float(rank))
        shm.shm_all_reduce(x, group)
        out.setdefault("repeated", True)
        out["repeated"] &= torch.equal(x, torch.full((8,), float(sum(range(world)))))
    dist.destroy_process_group(group)
    return out


def test_sums_are_exact_counted_and_fall_back_when_not_eligible(ranks2):
    for r in ranks2.run(check_sums_and_gathers):
        assert r["fast"], r
        assert all(v for k, v in r.items() if k.startswith("sum")), r
        assert r["gather"] and r["repeated"], r
        assert r["too large"] is None and r["meta"] is None, r
        kinds = [k for k, _ in r["seen"]]
        assert kinds == ["all_reduce"] * 3 + ["all_gather"], r["seen"]
        assert r["seen"][0][1] == 6 * 4 and r["seen"][3][1] == 3 * 4, r["seen"]


def check_wrapped_all_reduce_sees_every_call() -> dict:
    """A counter that wraps torch.distributed.all_reduce (as some tests do) sees every call: the
    fast path steps aside while torch's function is replaced."""
    import tpkit
    from tpkit import shm

    model = tpkit.tensor_parallel(build("llama"))
    x = batch(model.config.vocab_size, shape=(1, 4))
    real, calls = dist.all_reduce, []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    before = shm.shm_counts()["all_reduce"]
    dist.all_reduce = counting
    try:
        with torch.no_grad():
            model(input_ids=x)
    finally:
        dist.all_reduce = real
    return {"wrapped": len(calls), "shm": shm.shm_counts()["all_reduce"] - before}


def test_a_wrapped_all_reduce_sees_the_no_grad_collectives(ranks2):
    for r in ranks2.run(check_wrapped_all_reduce_sees_every_call):
        assert r["wrapped"] >= 4 and r["shm"] == 0, r  # 2 per block x 2 blocks, + embedding


def check_env_off() -> dict:
    from tpkit import shm

    return {
        "enabled": shm.shm_enabled(),
        "fast": shm.prepare_shm(None),
        "sum": shm.shm_all_reduce(torch.ones(2), None),
    }


def test_env_zero_turns_it_off_on_every_rank():
    group = RankGroup(2, env={"TPKIT_CPU_SHM_ALLREDUCE": "0"})
    try:
        for r in group.run(check_env_off, timeout=120):
            assert r == {"enabled": False, "fast": False, "sum": None}, r
    finally:
        group.close()


def check_one_rank_off() -> dict:
    """Rank 1 started with the variable at 0: the group's vote says gloo on every rank."""
    from tpkit import shm

    return {"fast": shm.prepare_shm(None), "sum": shm.shm_all_reduce(torch.ones(2), None)}


def test_a_rank_with_it_off_makes_the_whole_group_fall_back():
    env = {"TPKIT_SHM_TEST_OFF_RANK": "1"}
    group = RankGroup(2, env=env)
    try:
        results = group.run(_vote_with_rank_off, timeout=120)
    finally:
        group.close()
    assert results == [{"fast": False, "sum": None}] * 2, results


def _vote_with_rank_off() -> dict:
    """Re-import tpkit.shm with the variable at 0 on the rank named by the test's env."""
    import importlib

    from tpkit import shm

    if str(dist.get_rank()) == os.environ["TPKIT_SHM_TEST_OFF_RANK"]:
        os.environ["TPKIT_CPU_SHM_ALLREDUCE"] = "0"
    shm = importlib.reload(shm)
    return check_one_rank_off()


def test_shm_module_imports_without_a_process_group():
    code = "import tpkit.shm as s; print(s.shm_enabled(), s.shm_counts())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split()[0] == "True", out.stdout
