"""Trainer checkpoints that appear whole or not at all, and a resume that starts fresh.

Transformers' ``Trainer`` writes ``checkpoint-N/`` in place, file after file (weights, tpkit's
DCP copy, scheduler, RNG, ``trainer_state.json`` last), and ``get_last_checkpoint`` takes the
highest ``checkpoint-N`` folder, whole or not: a rank killed during the step-9 save left
``checkpoint-9/`` with ``model.safetensors`` and a half-written DCP copy, and the restarted job
failed on it although ``checkpoint-6`` was complete. For tpkit models:

- ``_save_checkpoint`` (`patched_save_checkpoint`) runs the Trainer's own code with its output
  directory pointed at ``<output_dir>/.tpkit-partial/``, a name neither ``get_last_checkpoint``
  nor checkpoint rotation looks at. Once every rank has written its files, rank 0 fsyncs the
  folder, writes tpkit's completion marker (`tpkit.io.atomic.mark_complete`) and renames it to
  ``<output_dir>/checkpoint-N`` in one step (an existing one is exchanged atomically), then
  rotates old checkpoints as the Trainer would. A kill at any moment leaves every
  ``checkpoint-N`` whole; what the killed save wrote is cleared by the next save.
- ``get_last_checkpoint`` (`last_complete_checkpoint`) skips a ``checkpoint-N`` that is not
  complete: marked but missing a file (a rotation cut short), or unmarked (written before this
  module, or by plain Trainer) without ``trainer_state.json`` or with a DCP copy cut short.
- ``train(resume_from_checkpoint=True)`` (`patched_train`) resumes from that checkpoint and,
  where none exists yet, starts fresh instead of raising "No valid checkpoint found": the same
  line of a script then serves the first run and every restart.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from typing import Any

import torch.distributed as dist

from tpkit.integrations.trainer_checkpoints import DCP_DIR
from tpkit.io import atomic
from tpkit.io.checkpoint import run_on_rank0
from tpkit.io.dcp import METADATA_FILE
from tpkit.log import get_logger
from tpkit.parallel.mesh import barrier
from tpkit.state import tp_state

__all__ = [
    "STAGING_DIR",
    "TRAINER_STATE",
    "is_complete_checkpoint",
    "last_complete_checkpoint",
    "patched_get_last_checkpoint",
    "patched_save_checkpoint",
    "patched_train",
]

log = get_logger(__name__)

#: Where checkpoints are written before they are renamed into place (inside ``output_dir``).
STAGING_DIR = ".tpkit-partial"
#: The Trainer's state file, written last by its ``_save_checkpoint``.
TRAINER_STATE = "trainer_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


# ---- which checkpoint-N is complete ------------------------------------------------------------
def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """Whether a Trainer ``checkpoint-N`` folder is whole: marked complete by tpkit with every
    listed file present, or (unmarked: plain Trainer, earlier tpkit) holding ``trainer_state.json``
    and, if it has a tpkit DCP copy at all, a complete one."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, atomic.COMPLETE_MARKER)):
        return atomic.is_complete(path)
    if not os.path.isfile(os.path.join(path, TRAINER_STATE)):
        return False
    dcp = os.path.join(path, DCP_DIR)
    has_dcp = any(
        os.path.lexists(p) for p in (dcp, atomic.tmp_sibling(dcp), atomic.old_sibling(dcp))
    )
    return not has_dcp or atomic.find_complete(dcp, legacy_file=METADATA_FILE) is not None


def last_complete_checkpoint(folder: str | os.PathLike) -> str | None:
    """The complete ``checkpoint-N`` in ``folder`` with the highest N (`is_complete_checkpoint`),
    or None: what ``get_last_checkpoint`` answers while tpkit's Trainer patches are applied."""
    folder = os.fspath(folder)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return None
    steps = sorted(
        ((int(m.group(1)), name) for name in names if (m := _CHECKPOINT.match(name))),
        reverse=True,
    )
    for _, name in steps:
        path = os.path.join(folder, name)
        if not os.path.isdir(path):
            continue
        if is_complete_checkpoint(path):
            return path
        log.warning("%s is incomplete (a save was cut short); skipping it.", path)
    return None


def patched_get_last_checkpoint(original):
    def get_last_checkpoint(folder):
        return last_complete_checkpoint(folder)

    return get_last_checkpoint


# ---- writing: staged, then renamed into place --------------------------------------------------
def _clear_staging(root: str) -> None:
    """Remove what earlier, interrupted saves left in the staging folder (tpkit's own folder:
    nothing in it is complete or anyone else's)."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def _publish(staged: str, final: str, root: str) -> None:
    """Mark ``staged`` complete and make it ``final`` in one rename (one atomic exchange when
    ``final`` exists, where the OS has it; else ``final`` is moved aside first); then remove
    the staging folder ``root`` if nothing else is in it."""
    atomic.mark_complete(staged)
    parent = os.path.dirname(final)
    if not os.path.lexists(final):
        os.replace(staged, final)
    elif atomic.exchange(staged, final):
        shutil.rmtree(staged)  # the previous checkpoint-N, now at the staged name
    else:
        aside = staged + ".replaced"
        os.replace(final, aside)
        os.replace(staged, final)
        shutil.rmtree(aside)
    atomic.fsync_dir(parent)
    with contextlib.suppress(OSError):  # not empty: a leftover the next save clears
        os.rmdir(root)


def _rotate(trainer: Any, run_dir: str) -> None:
    try:
        from transformers.trainer_utils import rotate_checkpoints
    except ImportError:  # transformers before rotate_checkpoints became a function
        trainer._rotate_checkpoints(use_mtime=True, output_dir=run_dir)
        return
    rotate_checkpoints(
        output_dir=run_dir,
        save_total_limit=trainer.args.save_total_limit,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
        use_mtime=True,
    )


def _is_tpkit(trainer: Any) -> bool:
    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    return tp_state(model) is not None


def patched_save_checkpoint(original):
    def _save_checkpoint(self, model, trial):
        if not _is_tpkit(self) or self.args.save_on_each_node:
            return original(self, model, trial)
        run_dir = self._get_output_dir(trial=trial)
        root = os.path.join(run_dir, STAGING_DIR)
        name = f"checkpoint-{self.state.global_step}"
        staged, final = os.path.join(root, name), os.path.join(run_dir, name)
        barrier()  # nobody may still be reading what is about to be cleared
        run_on_rank0(lambda: _clear_staging(root), f"clearing {root}")
        pushes: list[str] = []
        self._get_output_dir = lambda trial=None: root  # the Trainer's code, writing to staged
        self._push_from_checkpoint = pushes.append  # pushed once it has its real name
        try:
            original(self, model, trial)
        finally:
            for attr in ("_get_output_dir", "_push_from_checkpoint"):
                with contextlib.suppress(AttributeError):
                    delattr(self, attr)
        best = self.state.best_model_checkpoint
        if best and os.path.dirname(os.path.abspath(best)) == os.path.abspath(root):
            self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
            if self.args.should_save:  # the copy written inside names the staged path
                self.state.save_to_json(os.path.join(staged, TRAINER_STATE))
        barrier()  # every rank's files (its RNG state comes last) are written
        run_on_rank0(lambda: _publish(staged, final, root), f"publishing {final}")
        if self.args.should_save:
            _rotate(self, run_dir)
        for _ in pushes:
            self._push_from_checkpoint(final)
        return None

    return _save_checkpoint


# ---- resuming ----------------------------------------------------------------------------------
def _agreed_checkpoint(output_dir: str) -> str | None:
    """`last_complete_checkpoint` as every rank sees it; a ValueError on every rank if they
    differ (an output directory that is not shared)."""
    mine = last_complete_checkpoint(output_dir)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return mine
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    if any(s != seen[0] for s in seen):
        raise ValueError(
            f"resume_from_checkpoint=True: the ranks see different last checkpoints in "
            f"{output_dir} (per rank: {seen}); give every rank the same shared output_dir."
        )
    return mine


def patched_train(original):
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True and self.model is not None and _is_tpkit(self):
            found = _agreed_checkpoint(self.args.output_dir)
            if found is None:
                log.info(
                    "resume_from_checkpoint=True: no complete checkpoint in %s yet; starting "
                    "fresh.",
                    self.args.output_dir,
                )
            else:
                log.info("resume_from_checkpoint=True: resuming from %s", found)
            resume_from_checkpoint = found
        return original(self, resume_from_checkpoint, *args, **kwargs)

    return train
