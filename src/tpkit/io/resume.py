"""Pick a training loop up where it stopped: ``step = tpkit.resume(dir, model, optimizer)``.

The one call a loop needs to survive a restart (``tpkit run --max-restarts N``)::

    step = tpkit.resume("ckpt", model, optimizer)          # 0 on a fresh start
    for step in range(step, total_steps):
        batch = batch_for(step)                            # the data order follows the step
        ...
        if (step + 1) % every == 0:
            tpkit.save_checkpoint("ckpt", model, optimizer, step=step + 1, async_save=True)
    tpkit.wait_for_checkpoint()

It loads the last *complete* checkpoint `tpkit.save_checkpoint` wrote to ``dir`` (a save cut
short is never read: `tpkit.io.atomic`), restores every rank's RNG states saved with it
(`tpkit.io.rng_state`), and returns the ``step`` saved with it. Deterministic data order is the
loop's part: draw step ``s``'s batch from ``s`` (a generator seeded with ``s``, a sampler's
``set_epoch(s // steps_per_epoch)`` and ``s % steps_per_epoch`` batches skipped) or from torch's
global RNG, which continues exactly where the saved run left it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tpkit import config
from tpkit.io import atomic
from tpkit.io.async_save import wait_for_checkpoint
from tpkit.io.checkpoint import EXTRA_FILE, load_checkpoint
from tpkit.io.dcp import METADATA_FILE
from tpkit.io.rng_state import restore_rng_state
from tpkit.log import get_logger

__all__ = ["resume"]

log = get_logger(__name__)


def _saved_step(directory: Path) -> tuple[str | None, int | None]:
    """(the complete copy this rank would read, the step saved with it) from the files alone."""
    source = atomic.find_complete(directory, legacy_file=METADATA_FILE)
    if source is None:
        return None, None
    try:
        extra = json.loads((source / EXTRA_FILE).read_text())
    except (OSError, ValueError):
        extra = {}
    step = extra.get("step") if isinstance(extra, dict) else None
    return str(source), step if isinstance(step, int) and not isinstance(step, bool) else None


def resume(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
) -> int:
    """Load the last complete checkpoint in ``directory`` into ``model`` (and ``optimizer``) and
    return the ``step`` it was saved with; return 0, changing nothing, when there is none yet.

    Every rank must call it. ``directory`` is what the loop passes to
    ``tpkit.save_checkpoint(directory, model, optimizer, step=...)``: a save interrupted at any
    point leaves the previous checkpoint the one read. With ``restore_rng`` (default) each
    rank's RNG states are set to what they were at that save, so a resumed run draws the same
    random numbers (and a data order taken from torch's RNG) as an uninterrupted one.

    Raises ValueError, on every rank before any collective, when the checkpoint was saved
    without ``step=`` or when the ranks do not see the same checkpoint (a directory that is not
    on a file system every rank shares).
    """
    wait_for_checkpoint()
    directory = Path(os.path.realpath(directory))
    mine = _saved_step(directory)
    seen = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, mine)
    if any(s != seen[0] for s in seen):
        raise ValueError(
            f"tpkit.resume({str(directory)!r}): the ranks see different checkpoints there "
            f"(per rank: {[s[0] for s in seen]}, steps {[s[1] for s in seen]}). Save to a "
            "directory every rank shares (the same path on a shared file system)."
        )
    source, step = mine
    restarts = config.restart_count()
    if source is None:
        log.info(
            "no complete checkpoint in %s: starting at step 0 (restart %d)", directory, restarts
        )
        return 0
    if step is None:
        raise ValueError(
            f"tpkit.resume: the checkpoint {source} was saved without a step; save it with "
            "tpkit.save_checkpoint(directory, model, optimizer, step=<steps done>), or load it "
            "with tpkit.load_checkpoint."
        )
    load_checkpoint(directory, model, optimizer)
    if restore_rng:
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        restore_rng_state(source, rank, world)
    log.info("resumed from %s at step %d (restart %d)", source, step, restarts)
    return step
