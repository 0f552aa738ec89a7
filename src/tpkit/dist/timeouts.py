"""Collective timeouts: one setting (TPKIT_TIMEOUT) and a report that names who is missing.

gloo says only "Timed out waiting 300000ms for recv operation to complete"; NCCL's watchdog names
the op but not the missing rank. On a timeout tpkit adds the collective, the user's line that led
there, and a roll call over the process group's store: every rank that timed out writes where it
waited, and the ranks that write nothing within the grace period are the ones that never arrived.
Every process group tpkit creates uses `tpkit_timeout`, and so do tpkit's own waits.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import traceback

import torch
import torch.distributed as dist

from tpkit.log import get_logger, log_every_rank

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "collective_frame",
    "install_timeout_report",
    "is_collective_timeout",
    "record_timeout",
    "timeout_report",
    "tpkit_timeout",
]

log = get_logger(__name__)

#: Default collective timeout. Short enough that a rank that never arrives at a collective fails
#: loudly within minutes instead of hanging a job for torch's default 10 to 30 minutes.
DEFAULT_TIMEOUT_S = 300.0
_recorded: list[float] = []  # the timeout init_distributed gave the default group


def tpkit_timeout() -> float:
    """TPKIT_TIMEOUT (seconds, default 300), read at call time: the timeout of every process group
    tpkit creates and of tpkit's own waits (the shared-memory all-reduce)."""
    raw = os.environ.get("TPKIT_TIMEOUT")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"TPKIT_TIMEOUT={raw!r} is not a number of seconds.") from None
    if value <= 0:
        raise ValueError(f"TPKIT_TIMEOUT={raw!r} must be > 0 seconds.")
    return value


def record_timeout(seconds: float) -> None:
    """Remember the default group's timeout, for the report."""
    _recorded[:] = [seconds]


_TIMEOUT_RE = re.compile(r"timed?[ -]?out|timeout", re.IGNORECASE)


def is_collective_timeout(exc: BaseException | None) -> bool:
    """A torch.distributed timeout (gloo "Timed out waiting", NCCL watchdog, store wait)."""
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, (RuntimeError, TimeoutError)) and _TIMEOUT_RE.search(str(exc)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def timeout_report(exc: BaseException, tb=None, grace_s: float | None = None) -> str | None:
    """One paragraph for a collective timeout on this rank, or None for any other error.

    Waits up to ``grace_s`` (default ``min(TPKIT_TIMEOUT, 30)`` s) for the other ranks to report
    their own timeouts through the default store, then names the ranks that never did.
    """
    if not is_collective_timeout(exc) or not dist.is_initialized():
        return None
    collective, where = collective_frame(tb if tb is not None else exc.__traceback__)
    if collective is None:
        return None  # a timeout outside torch.distributed (a user's own) is not ours to explain
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout_s = _recorded[0] if _recorded else tpkit_timeout()
    grace_s = min(timeout_s, 30.0) if grace_s is None else grace_s
    others: dict[int, str] = {}
    try:
        store = dist.distributed_c10d._get_default_store()
        prefix = f"tpkit/timeout/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        store.set(f"{prefix}{rank}", f"{collective} ({where})")
        deadline = time.monotonic() + grace_s
        while len(others) < world - 1 and time.monotonic() < deadline:
            for r in range(world):
                if r != rank and r not in others and store.check([f"{prefix}{r}"]):
                    others[r] = store.get(f"{prefix}{r}").decode()
            time.sleep(0.2)
    except Exception as store_exc:  # noqa: BLE001 - the report must never hide the real error
        return (
            f"tpkit: rank {rank}/{world} timed out after {timeout_s:g} s in {collective} "
            f"({where}); the store roll call failed too ({store_exc}), so the missing rank is unknown."
        )
    missing = [r for r in range(world) if r != rank and r not in others]
    lines = [
        f"tpkit: rank {rank} of {world} timed out after {timeout_s:g} s in {collective} ({where})."
    ]
    if missing:
        lines.append(
            f"Rank(s) {missing} did not arrive: they reported no collective of their own within "
            f"{grace_s:g} s after this one gave up, so they are still computing, hung, or skipped "
            f"this {collective} (a collective called on some ranks only, e.g. under `if rank == 0`)."
        )
    for r, what in sorted(others.items()):
        lines.append(f"Rank {r} was waiting in {what}.")
    lines.append(
        "Every rank of a group must call the same collectives in the same order. "
        f"TPKIT_TIMEOUT={timeout_s:g} sets the timeout in seconds."
    )
    return "\n".join(lines)


def collective_frame(tb) -> tuple[str | None, str]:
    """(torch.distributed function that waited, 'called at file:line in fn' of the user's code
    that led there); (None, "") when the traceback never entered torch.distributed.

    The caller named is the last frame outside torch and tpkit before the collective (the
    user's ``model(x)`` or ``save_checkpoint(...)`` line), not tpkit's own dist/comm.py frame."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    torch_dir = os.path.join("torch", "distributed", "")
    first = next((i for i, f in enumerate(frames) if torch_dir in f.filename), None)
    if first is None:
        return None, ""
    named = [
        f
        for f in frames[first:]
        if torch_dir in f.filename and not f.filename.endswith("c10d_logger.py")
    ]
    collective = named[0].name if named else frames[first].name
    library = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
    outside = [f for f in frames[:first] if not f.filename.startswith(library)]
    caller = outside[-1] if outside else frames[first - 1] if first > 0 else frames[first]
    return collective, f"called at {caller.filename}:{caller.lineno} in {caller.name}"


def install_timeout_report() -> None:
    """Chain a ``sys.excepthook`` that, after the usual traceback, prints `timeout_report` for an
    uncaught collective timeout (torchrun scripts). ``tpkit.launch`` adds the report itself."""
    previous = sys.excepthook
    if getattr(previous, "_tpkit_timeout_report", False):
        return

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        try:
            report = timeout_report(exc, tb)
        except Exception:  # noqa: BLE001 - never fail inside the excepthook
            report = None
        if report:
            log_every_rank(log, logging.ERROR, report)

    hook._tpkit_timeout_report = True
    sys.excepthook = hook
