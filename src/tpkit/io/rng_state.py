"""Every rank's random-number state, saved with a checkpoint so a resumed run draws what the
uninterrupted run would have drawn (dropout masks, random crops, a sampler seeded from torch).

One small JSON file per rank, ``tpkit_rng/rank<N>.json``: torch's CPU generator, the current CUDA
device's when CUDA is initialised, Python's ``random`` and NumPy's global generator. JSON, not a
pickle: reading it back runs no code (the rest of a checkpoint is held to the same rule,
`tpkit.io.dcp`). Transformers' Trainer saves the same states in its own ``rng_state_N.pth``.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import torch

from tpkit.log import get_logger

__all__ = ["RNG_DIR", "restore_rng_state", "rng_file", "save_rng_state"]

log = get_logger(__name__)

#: Subdirectory of a tpkit/DCP checkpoint with one ``rank<N>.json`` per rank.
RNG_DIR = "tpkit_rng"


def rng_file(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / RNG_DIR / f"rank{rank}.json"


def _state(world_size: int) -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {
        "world_size": world_size,
        "torch": torch.get_rng_state().tolist(),
        "python": [version, list(internal), gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state().tolist()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        return out
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return out


def save_rng_state(directory: str | os.PathLike, rank: int, world_size: int) -> None:
    """Write this rank's RNG states into ``directory`` (a checkpoint being written; fsynced with
    it when it is marked complete)."""
    path = rng_file(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_state(world_size)))


def restore_rng_state(directory: str | os.PathLike, rank: int, world_size: int) -> bool:
    """Set this rank's RNG states from ``directory``; False (nothing changed, a log line) when the
    checkpoint holds none for this rank or was saved by another number of ranks (whose streams
    cannot be mapped onto these)."""
    path = rng_file(directory, rank)
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        log.info("%s holds no RNG state for rank %d; RNG streams start from here.", directory, rank)
        return False
    if state.get("world_size") != world_size:
        log.info(
            "%s was saved by %s ranks, this job has %d: RNG streams are not restored.",
            directory,
            state.get("world_size"),
            world_size,
        )
        return False
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    return True
