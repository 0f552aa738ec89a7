"""Launching ranks: tpkit.launch, tpkit run, two torchrun "nodes", timeouts, TPKIT_DEBUG.

Functions named ``rank_*`` run inside launched ranks; ``main_*`` functions are this file run as a
script by torchrun (``python tests/test_launch.py <name>``). Every subprocess has a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from tests.models import batch, build

ROOT = Path(__file__).resolve().parents[1]
THIS = str(Path(__file__).resolve())
TOL = 1e-5


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}
    env.pop("TPKIT_DEBUG", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _workers() -> set[int]:
    """Child processes of this test process, minus Python's one shared resource tracker."""
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(p.cmdline())
    }


def _reference_logits() -> torch.Tensor:
    model = build("llama")
    with torch.no_grad():
        return model(input_ids=batch(model.config.vocab_size)).logits


# ---- run inside launched ranks -----------------------------------------------------------------
def rank_tp_logits() -> torch.Tensor:
    import tpkit

    model = tpkit.tensor_parallel(build("llama"))
    assert model._tpkit.tp_size == 2
    with torch.no_grad():
        return model(input_ids=batch(model.config.vocab_size)).logits


def rank_fail_on_rank_1() -> None:
    import tpkit

    tpkit.init_distributed()
    if dist.get_rank() == 1:
        raise ValueError("rank 1 cannot go on")
    dist.barrier()  # rank 0 waits here for a rank that never comes; launch must stop it


def main_two_nodes() -> None:
    logits = rank_tp_logits()
    if dist.get_rank() == 0:
        diff = (logits - _reference_logits()).abs().max().item()
        print("RESULT " + json.dumps({"diff": diff, "world": dist.get_world_size()}), flush=True)


def main_skip_collective() -> None:
    import tpkit

    tpkit.init_distributed()
    if dist.get_rank() == 1:
        time.sleep(60)  # skips the all_reduce; torchrun stops it once rank 0 fails
        return
    dist.all_reduce(torch.ones(4))


def main_whoami() -> None:
    from tpkit.launch import ensure_ranks

    ensure_ranks(2)
    print(f"WHOAMI {os.environ['RANK']}/{os.environ['WORLD_SIZE']}", flush=True)


# ---- checks run in the shared 2-rank harness ---------------------------------------------------
def check_debug_inputs_differ() -> str:
    import tpkit

    os.environ["TPKIT_DEBUG"] = "1"
    try:
        model = tpkit.tensor_parallel(build("llama"))
    finally:
        del os.environ["TPKIT_DEBUG"]
    x = batch(model.config.vocab_size, seed=1 + dist.get_rank())  # a different batch per rank
    try:
        model(input_ids=x)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def check_debug_replicated_param_drift() -> dict:
    import tpkit

    os.environ["TPKIT_DEBUG"] = "1"
    try:
        model = tpkit.tensor_parallel(build("llama"))
    finally:
        del os.environ["TPKIT_DEBUG"]
    x = batch(model.config.vocab_size)
    model(input_ids=x)  # identical inputs and weights: passes
    with torch.no_grad():
        if dist.get_rank() == 1:
            model.model.layers[1].post_attention_layernorm.weight.to_local().add_(1e-3)
    try:
        model(input_ids=x)
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"error": None}


# ---- tests -------------------------------------------------------------------------------------
def test_launch_returns_rank0_tp_logits_and_leaves_no_worker():
    before = _workers()
    logits = __import__("tpkit").launch(rank_tp_logits, nproc=2)
    assert (logits - _reference_logits()).abs().max().item() <= TOL
    assert _workers() - before == set()


def test_launch_reraises_rank1_error_with_its_traceback_and_stops_rank0():
    import tpkit
    from tpkit.launch import RemoteTraceback

    before, start = _workers(), time.monotonic()
    with pytest.raises(ValueError, match="rank 1 cannot go on") as info:
        tpkit.launch(rank_fail_on_rank_1, nproc=2)
    assert time.monotonic() - start < 90  # rank 0 was stopped, not left waiting in barrier()
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "[rank 1]" in str(cause) and "rank_fail_on_rank_1" in str(cause)
    assert _workers() - before == set()


def test_two_torchrun_nodes_on_localhost_tp_forward_parity():
    """launch/multinode.sh run twice, as two "nodes" of one rank each (c10d rendezvous)."""
    port = _free_port()
    cmd = ["bash", str(ROOT / "launch" / "multinode.sh"), "--nnodes", "2", "--nproc", "1"]
    cmd += ["--endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"tpkit-test-{port}"]
    cmd += [THIS, "two_nodes"]
    env = _env(PYTHON=sys.executable)
    nodes = [
        subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outs = []
    try:
        for node in nodes:
            outs.append(node.communicate(timeout=150)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(outs)
    results = [
        json.loads(line.split("RESULT ", 1)[1])
        for o in outs
        for line in o.splitlines()
        if "RESULT " in line
    ]
    assert len(results) == 1, "\n".join(outs)  # rank 0 lives on exactly one node
    assert results[0]["world"] == 2
    assert results[0]["diff"] <= TOL


def test_skipped_collective_times_out_naming_collective_and_missing_rank():
    """Via `tpkit run`: rank 1 skips an all_reduce; rank 0 fails after TPKIT_TIMEOUT, not never."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tpkit.cli", "run", "--nproc", "2", THIS, "skip_collective"],
        env=_env(TPKIT_TIMEOUT="5"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert time.monotonic() - start < 100, out
    assert "[rank0]:" in out  # tpkit run prefixes every line with its rank
    assert "timed out after 5 s in all_reduce" in out, out
    assert "Rank(s) [1] did not arrive" in out, out
    assert "test_launch.py" in out  # where the collective was called


def test_ensure_ranks_relaunches_a_plain_python_command_under_torchrun():
    proc = subprocess.run(
        [sys.executable, THIS, "whoami"],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "WHOAMI 0/2" in out and "WHOAMI 1/2" in out, out


def test_debug_mode_names_the_input_that_differs(ranks2):
    errors = ranks2.run(check_debug_inputs_differ)
    for err in errors:
        assert "input 'input_ids' differs across the TP group" in err, err
        assert "rank 0:" in err and "rank 1:" in err


def test_debug_mode_names_the_replicated_parameter_that_drifted(ranks2):
    results = ranks2.run(check_debug_replicated_param_drift)
    for r in results:
        assert r["error"] is not None
        assert "model.layers.1.post_attention_layernorm.weight" in r["error"], r["error"]


if __name__ == "__main__":
    globals()["main_" + sys.argv[1]]()
