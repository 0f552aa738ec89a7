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


def _every_rank_started(world: int) -> None:
    """Wait (up to 120 s, on torchrun's own store) until all ``world`` ranks have started: the
    short TPKIT_TIMEOUT a test sets then times the collective it is about, not the process
    group's rendezvous, which a rank still importing torch on a loaded host misses (that
    failed the timeout test under two pytest workers)."""
    import datetime

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return  # rank 0 hosts the store in init_process_group: nothing to wait on before it
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=120),
    )
    store.add("tests/started", 1)
    deadline = time.monotonic() + 120
    while store.add("tests/started", 0) < world and time.monotonic() < deadline:
        time.sleep(0.05)


def main_skip_collective() -> None:
    import tpkit
    from tpkit.cli.launch import ensure_ranks

    ensure_ranks(2)  # started as plain `python`: re-executes itself under torchrun
    _every_rank_started(2)
    tpkit.init_distributed()
    if dist.get_rank() == 1:
        print("skipping the all_reduce", flush=True)
        time.sleep(60)  # skips the all_reduce; torchrun stops it once rank 0 fails
        return
    dist.all_reduce(torch.ones(4))


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
    from tpkit.cli.launch import RemoteTraceback

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
    """Plain `python script.py` that calls ensure_ranks(2): it re-executes under torchrun (via
    tpkit run's command line); rank 1 then skips an all_reduce and rank 0 fails after
    TPKIT_TIMEOUT seconds, naming the collective and rank 1, instead of hanging."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, THIS, "skip_collective"],
        env=_env(TPKIT_TIMEOUT="5"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert time.monotonic() - start < 120, out
    # (rank 1's own line is not asserted: torchrun's --tee tailer may not flush it before the
    # failing group is torn down, which made this check flaky under load)
    assert "timed out after 5 s in all_reduce" in out, out
    assert "Rank(s) [1] did not arrive" in out, out
    assert "test_launch.py" in out  # where the collective was called


class _Exec(Exception):
    pass


def _captured_exec(argv: list[str], monkeypatch) -> tuple[list[str], dict[str, str]]:
    from tpkit.cli import main as cli

    def fake_execve(path, args, env):
        raise _Exec(args, env)

    monkeypatch.setattr(os, "execve", fake_execve)
    with pytest.raises(_Exec) as info:
        cli.main(argv)
    return info.value.args


def test_tpkit_run_is_torchrun_with_tpkit_defaults(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cmd, env = _captured_exec(
        ["run", "--nproc", "2", "--backend", "gloo", "s.py", "--x", "1"], monkeypatch
    )
    assert cmd[1:] == [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        "--tee",
        "3",
        "s.py",
        "--x",
        "1",
    ]
    assert env["TPKIT_BACKEND"] == "gloo"
    assert int(env["OMP_NUM_THREADS"]) >= 1
    assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[rank${rank}]:"


def test_tpkit_run_several_nodes_uses_c10d_rendezvous(monkeypatch):
    argv = ["run", "--nproc", "8", "--nnodes", "2", "--rdzv-endpoint", "node0:29500", "-m", "pkg"]
    cmd, env = _captured_exec(argv, monkeypatch)
    joined = " ".join(cmd)
    assert "--nnodes 2 --rdzv-backend c10d --rdzv-endpoint node0:29500" in joined
    assert "--standalone" not in joined
    assert joined.endswith("--tee 3 -m pkg")


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
