"""A rank killed mid-job: the job restarts by itself and finishes as if nothing happened.

Real faults: ``tpkit run --max-restarts N tests/fault_job.py`` trains the tiny Llama at tp=2 (12
AdamW steps, a save every 3) while ranks SIGKILL themselves at chosen points (`tests.fault_job`);
the same loop run uninterrupted in the shared rank group is the reference. Each job checks: it
exits 0, every attempt resumed from the last complete checkpoint (never a half-written one), at
most one save interval was redone, and every loss of every attempt and the final weights equal
the uninterrupted run's (rel 1e-5). Every subprocess has a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from tests.fault_job import EVERY, STEPS, run_loop, run_trainer

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "tests" / "fault_job.py")
REL = 1e-5


def _tpkit_run(out: Path, kind: str, *options: str, restarts: int, timeout: float = 600):
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1"}
    env.pop("TPKIT_DEBUG", None)
    cmd = [sys.executable, "-m", "tpkit.cli", "run", "--nproc", "2"]
    cmd += ["--max-restarts", str(restarts), JOB, kind, str(out), *options]
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)  # torchrun starts each rank in its own session: kill them by pid
        stdout, stderr = proc.communicate()
        pytest.fail(f"the job did not finish in {timeout} s:\n{stdout[-3000:]}{stderr[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _kill_tree(pid: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        parent = psutil.Process(pid)
        for child in parent.children(recursive=True) + [parent]:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def _attempts(out: Path) -> list[dict]:
    """Rank 0's log, one entry per attempt: its start step and the loss of each step it ran."""
    attempts: list[dict] = []
    for line in (out / "log.jsonl").read_text().splitlines():
        event = json.loads(line)
        if "start" in event:
            attempts.append({"start": event["start"], "losses": {}})
        else:
            attempts[-1]["losses"][event["step"]] = event["loss"]
    return attempts


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _check_job(proc, out: Path, reference: dict, starts: list[int], redo: int = EVERY) -> None:
    from safetensors.torch import load_file

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    attempts = _attempts(out)
    assert [a["start"] for a in attempts] == starts, attempts
    for before, after in zip(attempts, attempts[1:]):
        reached = max(before["losses"], default=before["start"])
        assert reached - after["start"] <= redo, (before, after)  # one save interval at most
    ref = {int(k): v for k, v in reference["losses"].items()}
    assert sorted(attempts[-1]["losses"]) == list(range(starts[-1] + 1, STEPS + 1))
    for attempt in attempts:  # the killed attempts' steps too: the same data, the same numbers
        for step, loss in attempt["losses"].items():
            assert _rel(loss, ref[step]) <= REL, (step, loss, ref[step])
    final = json.loads((out / "result.json").read_text())["losses"]
    assert all(_rel(v, ref[int(k)]) <= REL for k, v in final.items()), final
    weights = load_file(str(out / "weights.safetensors"))
    assert weights.keys() == reference["weights"].keys()
    for name, expected in reference["weights"].items():
        diff = (weights[name] - expected).abs().max().item()
        assert diff <= REL * max(expected.abs().max().item(), 1.0), (name, diff)


@pytest.fixture(scope="module")
def loop_reference(ranks2, tmp_path_factory) -> dict:
    return ranks2.run(run_loop, str(tmp_path_factory.mktemp("loop-ref") / "ckpt"))[0]


def test_loop_killed_at_a_step_inside_a_save_and_hung_finishes_as_uninterrupted(
    tmp_path, loop_reference
):
    """Rank 1 killed in the forward of step 7, then inside the DCP write of the step-9 save, then
    hung in step 11 (its partner's TPKIT_TIMEOUT turns that into a failure): three restarts."""
    kills = ["--kill", "forward@7@1", "--kill", "save@9@1", "--kill", "hang@11@1"]
    proc = _tpkit_run(tmp_path, "loop", *kills, restarts=3)
    # the half-written step-9 save is never read: the second restart starts at 6 again
    _check_job(proc, tmp_path, loop_reference, starts=[0, 6, 6, 9])
    assert "timed out" in proc.stdout + proc.stderr  # the hang became a failure, not a wait


def test_async_loop_killed_in_backward_optimizer_background_write_and_swap(
    tmp_path, loop_reference
):
    """Saves in the background: rank 1 killed in a backward, inside the background write of the
    step-6 save (steps 7 to 9 may run meanwhile, until the step-9 save waits for it: that save
    is lost, so up to two intervals are redone), in an optimizer step; rank 0 killed between the two renames of the step-9 swap
    (the complete new copy is the one read)."""
    kills = ["backward@2@1", "save@6@1", "swap@9@0", "optimizer@11@1"]
    options = ["--async"] + [arg for k in kills for arg in ("--kill", k)]
    proc = _tpkit_run(tmp_path, "loop", *options, restarts=4)
    _check_job(proc, tmp_path, loop_reference, starts=[0, 0, 3, 9, 9], redo=2 * EVERY)
    assert not (tmp_path / "ckpt.tmp").exists() and not (tmp_path / "ckpt.old").exists()


def test_trainer_killed_at_a_step_and_inside_its_save_resumes_from_the_last_whole_one(
    ranks2, tmp_path
):
    """The issue's case: killed during the step-9 save, checkpoint-9 must never be picked; then
    rank 0 killed once the staged checkpoint-12 is complete but before its rename: 9 is read."""
    reference = ranks2.run(run_trainer, str(tmp_path / "ref"))[0]
    out = tmp_path / "job"
    kills = ["--kill", "forward@7@1", "--kill", "save@9@1", "--kill", "swap@12@0"]
    proc = _tpkit_run(out, "trainer", *kills, restarts=3)
    _check_job(proc, out, reference, starts=[0, 6, 6, 9])
    held = sorted(p.name for p in (out / "trainer").iterdir())  # the staging folder cleared too
    assert held == ["checkpoint-12", "checkpoint-3", "checkpoint-6", "checkpoint-9"], held


def _checkpoint(path: Path, files: dict[str, str], marked: bool = False) -> Path:
    from tpkit.io import atomic

    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    if marked:
        atomic.mark_complete(path)
    return path


def test_an_incomplete_trainer_checkpoint_is_never_the_last(tmp_path):
    import transformers.trainer
    from transformers import trainer_utils

    from tpkit.integrations.trainer import is_patched, patch_trainer, unpatch_trainer

    was_patched = is_patched()  # an earlier tensor_parallel in this worker patches it for us
    unpatch_trainer()
    whole = {"model.safetensors": "w", "trainer_state.json": "{}", "tpkit_dcp/.metadata": "m"}
    _checkpoint(tmp_path / "checkpoint-3", whole)  # plain Trainer's or an older tpkit's: unmarked
    _checkpoint(tmp_path / "checkpoint-6", whole, marked=True)
    # the checkpoint-9: weights written, the DCP copy cut short, no trainer state
    _checkpoint(tmp_path / "checkpoint-9", {"model.safetensors": "w", "tpkit_dcp.tmp/x": "p"})
    # marked, then a rotation (rmtree) cut short
    (_checkpoint(tmp_path / "checkpoint-12", whole, marked=True) / "model.safetensors").unlink()
    # trainer state there, the DCP copy only partial
    _checkpoint(tmp_path / "checkpoint-15", {"trainer_state.json": "{}", "tpkit_dcp.tmp/x": "p"})
    (tmp_path / "checkpoint-18").write_text("a file, not a checkpoint")
    assert trainer_utils.get_last_checkpoint(str(tmp_path)).endswith("checkpoint-15")  # unpatched
    patch_trainer()
    try:
        for module in (trainer_utils, transformers.trainer):  # the one train() calls too
            assert module.get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-6")
        assert trainer_utils.get_last_checkpoint(str(tmp_path / "none")) is None
    finally:
        if not was_patched:
            unpatch_trainer()


def test_a_spent_restart_budget_is_one_clear_error(tmp_path):
    proc = _tpkit_run(tmp_path, "die", restarts=1, timeout=300)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tpkit run: giving up: the job failed 2 times"), last
    assert "--max-restarts 1" in last and "rank 1 was killed by SIGKILL" in last, last


# ---- tpkit.launch ----------------------------------------------------------------------------
def rank_die_once(marker: str) -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1 and not os.path.exists(marker):
        Path(marker).write_text("killed")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def test_launch_restarts_a_killed_rank(tmp_path):
    import tpkit

    assert tpkit.launch(rank_die_once, str(tmp_path / "marker"), nproc=2, max_restarts=1) == 1


def rank_fail_always() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(f"rank 1 fails, attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}")
    dist.barrier()


def test_launch_with_a_spent_budget_raises_the_last_error_and_says_so():
    import tpkit

    with pytest.raises(ValueError, match="rank 1 fails, attempt 1") as info:
        tpkit.launch(rank_fail_always, nproc=2, max_restarts=1)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "restarted 1 time(s) (max_restarts=1)" in notes and "budget is spent" in notes, notes


def test_launch_refuses_a_bad_restart_budget():
    import tpkit

    with pytest.raises(ValueError, match="max_restarts must be a whole number >= 0"):
        tpkit.launch(rank_die_once, "x", nproc=2, max_restarts=-1)


def test_run_passes_max_restarts_and_a_fresh_store_per_attempt(monkeypatch):
    from tpkit.cli import launch, main

    seen = {}

    def supervise(cmd, env, max_restarts):
        seen.update(cmd=cmd, env=env, max_restarts=max_restarts)
        return 0

    monkeypatch.setattr(launch, "_supervise", supervise)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    assert main.main(["run", "--nproc", "2", "--max-restarts", "3", "s.py", "--x"]) == 0
    assert seen["max_restarts"] == 3
    joined = " ".join(seen["cmd"])
    assert "--standalone --max-restarts 3 --tee 3 s.py --x" in joined
    assert seen["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    with pytest.raises(SystemExit):
        main.main(["run", "--max-restarts", "-1", "s.py"])


# ---- resume and background saves, in the shared rank group --------------------------------------
def check_resume_fresh_then_saved(path: str) -> dict:
    import tpkit
    from tests.fault_job import tiny_tp_model

    model = tiny_tp_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh = tpkit.resume(path, model, optimizer)
    tpkit.save_checkpoint(path, model, optimizer, step=5)
    drawn = torch.rand(3)  # what a resumed run must draw next
    torch.manual_seed(7)  # another stream ...
    again = tpkit.resume(path, model, optimizer)  # ... until resume puts the saved one back
    redrawn = torch.rand(3)
    tpkit.save_checkpoint(path + "-nostep", model, optimizer)
    try:
        tpkit.resume(path + "-nostep", model, optimizer)
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"fresh": fresh, "again": again, "rng": torch.equal(drawn, redrawn), "error": error}


def test_resume_starts_at_0_then_at_the_saved_step_with_its_rng(ranks2, tmp_path):
    results = ranks2.run(check_resume_fresh_then_saved, str(tmp_path / "ck"))
    for r in results:
        assert (r["fresh"], r["again"]) == (0, 5)
        assert r["rng"] is True
        assert "saved without a step" in r["error"]


def check_background_save_is_invisible_until_complete(path: str) -> dict:
    import threading

    from torch.distributed.checkpoint import FileSystemWriter

    import tpkit
    from tests.fault_job import gathered, tiny_tp_model

    def saved_step() -> int:
        return json.loads((Path(path) / "tpkit_extra.json").read_text())["step"]

    model = tiny_tp_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tpkit.save_checkpoint(path, model, optimizer, step=1)
    release = threading.Event()
    write = FileSystemWriter.write_data

    def slow_write(self, plan, planner):
        release.wait(60)
        return write(self, plan, planner)

    FileSystemWriter.write_data = slow_write
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        saved = gathered(model)
        pending = tpkit.save_checkpoint(path, model, optimizer, step=2, async_save=True)
        with torch.no_grad():  # training goes on: the save wrote its own copy
            for p in model.parameters():
                p.mul_(3.0)
        during = saved_step()  # the previous save is still the one in place
        release.set()
        pending.wait()
    finally:
        FileSystemWriter.write_data = write
        release.set()
    after = saved_step()
    step = tpkit.resume(path, model, optimizer)
    loaded = gathered(model)
    diff = max((loaded[k] - saved[k]).abs().max().item() for k in saved)
    return {"during": during, "after": after, "step": step, "diff": diff}


def test_a_background_save_writes_its_copy_and_appears_only_complete(ranks2, tmp_path):
    for r in ranks2.run(check_background_save_is_invisible_until_complete, str(tmp_path / "ck")):
        assert (r["during"], r["after"], r["step"]) == (1, 2, 2)
        assert r["diff"] == 0.0
