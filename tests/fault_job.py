"""A tiny training job that kills its own ranks on cue, for tests/test_restart.py.

``tpkit run --nproc 2 --max-restarts N tests/fault_job.py loop|trainer|die OUT [--async]
[--kill POINT@STEP@RANK ...]`` trains the tiny Llama of `tests.models` at tp=2 for `STEPS` AdamW
steps, saving every `EVERY` steps (a plain loop with `tpkit.resume` / `tpkit.save_checkpoint`, or
the HF Trainer with ``resume_from_checkpoint=True``). Each ``--kill`` fires once per job (a marker
file under OUT), on its rank, during step STEP (counted from 1) at POINT:

- ``forward``, ``backward``, ``optimizer``: SIGKILL in that part of the step;
- ``save``: SIGKILL inside the DCP write of the checkpoint saved after STEP (some files written);
- ``swap``: SIGKILL between the two renames that put that checkpoint in place (rank 0's job;
  the Trainer's: once its staged ``checkpoint-N`` is marked complete, before it is renamed);
- ``hang``: sleep in the forward instead of dying; the other rank's collective times out after
  ``HANG_TIMEOUT_S`` (the group timeout during that step) and the job restarts.

A step with a kill due first waits for a background save in flight, so which checkpoint is the
last complete one at the kill does not depend on timing.

``die``: rank 1 kills itself at once, every attempt (a job that spends its restart budget).

Rank 0 appends one JSON line per event to ``OUT/log.jsonl`` (an attempt's start step, each step's
loss, each with its wall-clock time) and the final attempt writes ``OUT/result.json`` (losses and
the gathered weights). The same `run_loop` / `run_trainer` run uninterrupted in the shared rank
group give the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def _die() -> None:
    """``die``: rank 1 dies at once, every attempt; rank 0 waits to be stopped (no torch import:
    a job that spends its restart budget in seconds)."""
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


if __name__ == "__main__" and sys.argv[1:2] == ["die"]:
    _die()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STEPS, EVERY, BATCH, SEQ, VOCAB, SEED = 12, 3, 4, 9, 101, 1234
HANG_TIMEOUT_S = "3"

#: the step being run and the step of the last save started (a background save may still be
#: writing while the next steps run), for the kill hooks
_current = {"step": 0, "saving": 0}
_AT_SAVE = ("save", "swap")


# ---- kills ---------------------------------------------------------------------------------------
class Kills:
    """The ``--kill`` specs of a job; each fires at most once per job (a marker file)."""

    def __init__(self, specs: list[str], markers: Path | None):
        self.specs = [tuple(s.split("@")) for s in specs]
        self.markers = markers

    def fire(self, point: str) -> None:
        rank = dist.get_rank()
        for i, (where, step, who) in enumerate(self.specs):
            now = _current["saving" if point in _AT_SAVE else "step"]
            if where != point or int(step) != now or int(who) != rank:
                continue
            marker = self.markers / f"kill{i}"
            if marker.exists():
                continue
            marker.write_text(point)
            print(f"FAULT {point} at step {step} on rank {rank}", flush=True)
            if point == "hang":
                time.sleep(3600)  # never returns: the launcher stops this rank
            os.kill(os.getpid(), signal.SIGKILL)


def install_kills(kills: Kills, model: torch.nn.Module) -> None:
    """Hooks that call ``kills.fire`` at each point (the optimizer's is added by the caller)."""
    from torch.distributed.checkpoint import FileSystemWriter

    import tpkit.io.atomic as atomic
    from tpkit.integrations.trainer_resume import STAGING_DIR

    model.register_forward_pre_hook(lambda *_: kills.fire("forward") or kills.fire("hang"))
    first = next(model.parameters())
    first.register_post_accumulate_grad_hook(lambda _: kills.fire("backward"))

    write = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        out = write(self, plan, planner)  # this rank's files are on disk, the checkpoint is not
        kills.fire("save")
        return out

    FileSystemWriter.write_data = write_data
    replace = os.replace

    def replace_then_maybe_die(src, dst):
        src = os.fspath(src)
        if src.endswith(".tmp") and os.path.exists(str(dst) + ".old"):
            kills.fire("swap")  # dst moved to .old, the new copy not yet in its place
        return replace(src, dst)

    atomic.os.replace = replace_then_maybe_die  # the module's os is os: every rename is watched
    mark = atomic.mark_complete

    def mark_then_maybe_die(directory):
        mark(directory)
        if Path(directory).parent.name == STAGING_DIR:
            kills.fire("swap")  # a Trainer checkpoint marked complete, not yet renamed into place

    atomic.mark_complete = mark_then_maybe_die  # trainer_resume calls atomic.mark_complete


# ---- the model and what to compare ---------------------------------------------------------------
def tiny_tp_model() -> torch.nn.Module:
    import tpkit
    from tests.models import build

    return tpkit.tensor_parallel(build("llama").train())


def short_timeout_during(kills: list[str], step: int) -> None:
    """Give every collective of ``step`` a ``HANG_TIMEOUT_S`` timeout if a hang is due then
    (the setting TPKIT_TIMEOUT gives a whole job; short here only where the test needs it, so
    that a loaded machine cannot time out the rest), the normal one otherwise."""
    import datetime

    from tpkit.parallel.shm import set_shm_enabled
    from tpkit.parallel.timeouts import tpkit_timeout

    hang = any(k.startswith("hang@") and int(k.split("@")[1]) == step for k in kills)
    if hang:
        os.environ["TPKIT_TIMEOUT"] = HANG_TIMEOUT_S
    else:
        os.environ.pop("TPKIT_TIMEOUT", None)
    seconds = datetime.timedelta(seconds=tpkit_timeout())
    dist.distributed_c10d._set_pg_timeout(seconds, dist.group.WORLD)  # as build_mesh does
    # the shared-memory all-reduce took the group's timeout when it was set up: gloo this step
    set_shm_enabled(not hang)


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, value in model.state_dict().items():
        out[name] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
    return out


def _log(out: Path | None, **event) -> None:
    if out is not None and dist.get_rank() == 0:
        with open(out / "log.jsonl", "a") as f:  # the time: how long a restart took
            f.write(json.dumps({**event, "time": time.time()}) + "\n")


# ---- the plain loop ------------------------------------------------------------------------------
def run_loop(ckpt: str, out: str | None = None, kills: list[str] = (), async_save=False) -> dict:
    """Train STEPS steps, resuming from ``ckpt``; the batches come from torch's global RNG, so
    the data order is right only if `tpkit.resume` restored it."""
    import tpkit

    out_dir = Path(out) if out else None
    hooks = Kills(list(kills), out_dir)
    model = tiny_tp_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kills:
        install_kills(hooks, model)
        optimizer.register_step_pre_hook(lambda *_: hooks.fire("optimizer"))
    torch.manual_seed(SEED)
    start = tpkit.resume(ckpt, model, optimizer)
    _log(out_dir, attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), start=start)
    losses = {}
    for step in range(start + 1, STEPS + 1):
        _current["step"] = step
        if kills:
            short_timeout_during(list(kills), step)
            if any(k.split("@")[0] not in _AT_SAVE and int(k.split("@")[1]) == step for k in kills):
                # a kill in this step must not race a background save still in flight: the test
                # could not say which checkpoint is then the last complete one
                tpkit.wait_for_checkpoint()
        x = torch.randint(0, VOCAB, (BATCH, SEQ))  # the global RNG: restored by resume
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
        _log(out_dir, step=step, loss=losses[step])
        if step % EVERY == 0:
            tpkit.wait_for_checkpoint()  # (save_checkpoint's first act) the previous one is ...
            _current["saving"] = step  # ... swapped in before the kill hooks see the next step
            tpkit.save_checkpoint(ckpt, model, optimizer, step=step, async_save=async_save)
    tpkit.wait_for_checkpoint()
    return {"losses": losses, "weights": gathered(model)}


# ---- the Trainer ---------------------------------------------------------------------------------
def run_trainer(output_dir: str, out: str | None = None, kills: list[str] = ()) -> dict:
    """Train STEPS steps with the HF Trainer, ``resume_from_checkpoint=True`` on every start."""
    from accelerate import ParallelismConfig
    from transformers import Trainer, TrainerCallback

    from tests.test_trainer import ToyLM, reset_accelerate, training_args
    from tpkit.integrations.trainer import patch_trainer, unpatch_trainer

    out_dir = Path(out) if out else None
    hooks = Kills(list(kills), out_dir)

    class Track(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
            _log(out_dir, attempt=attempt, start=state.global_step)

        def on_step_begin(self, args, state, control, **kw):
            _current["step"] = state.global_step + 1

        def on_step_end(self, args, state, control, **kw):
            _current["saving"] = state.global_step  # a save after this step is of this step

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                _log(out_dir, step=state.global_step, loss=logs["loss"])

    patch_trainer()
    reset_accelerate()
    try:
        model = tiny_tp_model()
        if kills:
            install_kills(hooks, model)
        args = training_args(
            output_dir, BATCH, ParallelismConfig(tp_size=2), max_steps=STEPS, save_steps=EVERY
        )
        trainer = Trainer(model=model, args=args, train_dataset=ToyLM(), callbacks=[Track()])
        trainer.train(resume_from_checkpoint=True)
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        return {"losses": losses, "weights": gathered(model)}
    finally:
        unpatch_trainer()
        reset_accelerate()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["loop", "trainer", "die"])
    parser.add_argument("out")
    parser.add_argument("--async", dest="async_save", action="store_true")
    parser.add_argument("--kill", action="append", default=[])
    args = parser.parse_args()
    out = Path(args.out)
    if args.kind == "die":
        _die()
        return
    if args.kind == "loop":
        result = run_loop(str(out / "ckpt"), str(out), args.kill, args.async_save)
    else:
        result = run_trainer(str(out / "trainer"), str(out), args.kill)
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        save_file(result["weights"], str(out / "weights.safetensors"))
        (out / "result.json").write_text(json.dumps({"losses": result["losses"]}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
