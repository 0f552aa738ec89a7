"""The same-host shared-memory collectives (`tpkit.parallel.shm`), on by default for tpkit's CPU layers.

Behaviour only, never timing: the same tokens with the fast path on and off, the same training
step (loss and every gradient, bit for bit), every fast-path collective counted, a clean fallback
where it does not apply, and the sums exact and in rank order, tensors larger than a slot too.
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
    from tpkit.parallel import shm

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
    from tpkit.parallel import shm

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
        out["meta"] = shm.shm_all_reduce(torch.zeros(4, device="meta"), group)
        out["bool"] = shm.shm_all_reduce(torch.ones(4, dtype=torch.bool), group)
        out["product"] = shm.shm_all_reduce(torch.ones(4), group, dist.ReduceOp.PRODUCT)
    out["seen"] = seen
    # larger than a slot: 2.5 slots of float32 go through in 3 pieces, the sum still exact
    n = shm.ShmChannel.SLOT * 5 // 8
    gen = torch.Generator().manual_seed(rank)
    big = torch.randn(n, generator=gen)
    want = big.clone()
    dist.all_reduce(want, group=group)
    got = shm.shm_all_reduce(big.clone(), group)
    out["big sum"] = got is not None and torch.equal(got, want)
    want = big.clone()
    dist.all_reduce(want, op=dist.ReduceOp.MAX, group=group)
    got = shm.shm_all_reduce(big.clone(), group, dist.ReduceOp.MAX)
    out["big max"] = got is not None and torch.equal(got, want)
    parts = [torch.empty_like(big) for _ in range(world)]
    dist.all_gather(parts, big, group=group)
    got = shm.shm_all_gather(big, group)
    out["big gather"] = got is not None and torch.equal(got, torch.stack(parts))
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
        assert r["big sum"] and r["big max"] and r["big gather"], r
        assert r["meta"] is None and r["bool"] is None and r["product"] is None, r
        kinds = [k for k, _ in r["seen"]]
        assert kinds == ["all_reduce"] * 3 + ["all_gather"], r["seen"]
        assert r["seen"][0][1] == 6 * 4 and r["seen"][3][1] == 3 * 4, r["seen"]


def _train_step(model, x) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    grads = {
        n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return loss.item(), grads


def check_training_is_the_same_with_shared_memory_on_and_off(name: str, **options) -> dict:
    """One training step of the same model twice, the fast path on then off: a training step's
    collectives (forward all-reduces, backward gradient all-reduces, the vocab-parallel loss's
    max and sums) take shared memory, and the loss and every gradient are the same bits."""
    import tpkit
    from tpkit.parallel import shm

    ref = build(name)
    model = tpkit.tensor_parallel(copy.deepcopy(ref), **options)
    x = batch(ref.config.vocab_size, shape=(2, 8))
    model(input_ids=x, labels=x).loss.backward()  # the group's one-time vote stays out
    before = shm.shm_counts()["all_reduce"]
    loss_on, grads_on = _train_step(model, x)
    calls = shm.shm_counts()["all_reduce"] - before
    previous = shm.set_shm_enabled(False)
    try:
        loss_off, grads_off = _train_step(model, x)
    finally:
        shm.set_shm_enabled(previous)
    ref.zero_grad()
    ref_loss = ref(input_ids=x, labels=x).loss
    ref_loss.backward()
    ref_grads = dict(ref.named_parameters())
    return {
        "calls": calls,
        "loss equal": loss_on == loss_off,
        "grads equal": sorted(n for n in grads_on if not torch.equal(grads_on[n], grads_off[n])),
        "same names": sorted(grads_on) == sorted(grads_off),
        "loss vs ref": abs(loss_on - ref_loss.item()),
        "grad vs ref": max((g - ref_grads[n].grad).abs().max().item() for n, g in grads_on.items()),
    }


def test_a_training_step_is_the_same_with_shared_memory_on_and_off(ranks2):
    for name, options in (("llama", {}), ("llama", {"loss_parallel": True}), ("gpt2", {})):
        for r in ranks2.run(
            check_training_is_the_same_with_shared_memory_on_and_off, name, **options
        ):
            assert r["calls"] >= 8, (name, options, r)  # 2 blocks x (2 forward + 2 backward)
            assert r["loss equal"] and r["grads equal"] == [] and r["same names"], (name, r)
            assert r["loss vs ref"] <= 1e-5 and r["grad vs ref"] <= 1e-5, (name, options, r)


def check_compiled_model_keeps_the_fast_path() -> dict:
    """torch.compile of a tp=2 model: no graph break at tpkit's collectives (only the skipped input
    check of the first forwards), its collectives the ``tpkit::`` shared-memory ops, logits and
    gradients as the unsharded model's."""
    import torch._dynamo

    import tpkit
    from tpkit.parallel import shm

    ref = build("llama")
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    x = batch(ref.config.vocab_size, shape=(2, 8))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model)
    with torch.no_grad():
        compiled(input_ids=x, use_cache=False)  # compiles (and takes the input check's calls)
        before = shm.shm_counts()
        logits = compiled(input_ids=x, use_cache=False).logits
        after = shm.shm_counts()
        want = ref(input_ids=x, use_cache=False).logits
    loss = compiled(input_ids=x, labels=x).loss
    loss.backward()
    ref_loss = ref(input_ids=x, labels=x).loss
    ref_loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    grad_diff = max(
        ((g.full_tensor() if hasattr(g, "full_tensor") else g) - q.grad).abs().max().item()
        for (n, g), q in zip(grads.items(), ref.parameters())
    )
    return {
        "graph breaks": dict(torch._dynamo.utils.counters["graph_break"]),
        "all_reduce": after["all_reduce"] - before["all_reduce"],
        "all_gather": after["all_gather"] - before["all_gather"],
        "logits": (logits - want).abs().max().item(),
        "loss": abs(loss.item() - ref_loss.item()),
        "grads": grad_diff,
    }


def test_a_compiled_model_keeps_the_fast_path(ranks2):
    for r in ranks2.run(check_compiled_model_keeps_the_fast_path, timeout=300):
        # the one break: the first forwards' cross-rank input check, run eagerly on purpose
        assert all("torch.compiler.disable" in k for k in r["graph breaks"]), r
        assert sum(r["graph breaks"].values()) <= 1, r
        assert r["all_reduce"] == 5 and r["all_gather"] == 1, r  # 2 blocks x 2 + embedding; logits
        assert r["logits"] <= 1e-5 and r["loss"] <= 1e-5 and r["grads"] <= 1e-5, r


def check_wrapped_all_reduce_sees_every_call() -> dict:
    """A counter that wraps torch.distributed.all_reduce (as some tests do) sees every call: the
    fast path steps aside while torch's function is replaced."""
    import tpkit
    from tpkit.parallel import shm

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
        no_grad = len(calls)
        model(input_ids=x, labels=x).loss.backward()
    finally:
        dist.all_reduce = real
    return {
        "no grad": no_grad,
        "step": len(calls) - no_grad,
        "shm": shm.shm_counts()["all_reduce"] - before,
    }


def test_a_wrapped_all_reduce_sees_every_collective(ranks2):
    for r in ranks2.run(check_wrapped_all_reduce_sees_every_call):
        assert r["no grad"] >= 4 and r["shm"] == 0, r  # 2 per block x 2 blocks, + embedding
        assert r["step"] >= 2 * r["no grad"], r  # forward and backward


def check_full_dev_shm_falls_back() -> dict:
    """Rank 0 cannot reserve the buffer (a full /dev/shm: ENOSPC): the whole group uses gloo,
    and nothing is left in /dev/shm. The refused file is named by its descriptor, not by a
    listing of /dev/shm before and after: other processes' groups (a parallel test worker,
    another test run on the host) come and go there meanwhile."""
    import errno
    import glob

    from tpkit.parallel import shm

    refused: list[str] = []

    def full(fd, *args):
        refused.append(os.readlink(f"/proc/self/fd/{fd}"))
        raise OSError(errno.ENOSPC, "No space left on device")

    real = shm.os.posix_fallocate
    group = dist.new_group(list(range(dist.get_world_size())))
    if dist.get_rank() == 0:
        shm.os.posix_fallocate = full
    try:
        fast = shm.prepare_shm(group)
    finally:
        shm.os.posix_fallocate = real
    x = torch.ones(4)
    out = {"fast": fast, "sum": shm.shm_all_reduce(x.clone(), group), "refused": len(refused)}
    dist.barrier()
    out["left"] = sorted(p for base in refused for p in glob.glob(glob.escape(base) + "*"))
    dist.destroy_process_group(group)
    return out


def test_a_full_dev_shm_makes_the_group_fall_back(ranks2):
    for rank, r in enumerate(ranks2.run(check_full_dev_shm_falls_back)):
        # rank 0's file was refused (and is gone with its pipes); rank 1 never makes one
        assert r == {"fast": False, "sum": None, "refused": int(rank == 0), "left": []}, r


def check_env_off() -> dict:
    from tpkit.parallel import shm

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
    from tpkit.parallel import shm

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
    """Re-import tpkit.parallel.shm with the variable at 0 on the rank named by the test's env."""
    import importlib

    from tpkit.parallel import shm

    if str(dist.get_rank()) == os.environ["TPKIT_SHM_TEST_OFF_RANK"]:
        os.environ["TPKIT_CPU_SHM_ALLREDUCE"] = "0"
    shm = importlib.reload(shm)
    return check_one_rank_off()


def test_shm_module_imports_without_a_process_group():
    code = "import tpkit.parallel.shm as s; print(s.shm_enabled(), s.shm_counts())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split()[0] == "True", out.stdout
