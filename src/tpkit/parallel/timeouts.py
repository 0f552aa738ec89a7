"""Collective timeouts: one setting (TPKIT_TIMEOUT) and a report that names who is missing.

gloo says only "Timed out waiting 300000ms for recv operation to complete"; NCCL's watchdog names
the op but not the missing rank. On a timeout tpkit adds the collective, the user's line that led
there, and a roll call over the process group's store: every rank that timed out writes where it
waited, and the ranks that write nothing within the grace period are the ones that never arrived.
Every process group tpkit creates uses `tpkit_timeout`, and so do tpkit's own waits.

A torchrun script's uncaught timeout gets the report from a ``sys.excepthook`` that
`install_timeout_report` chains when tpkit brings up a group (that is where it is needed: before
any tpkit collective can time out) and `uninstall_timeout_report` puts the previous hook back.
The previous hook is kept on the hook object, not in this module: the hook is process-wide
state, and a library that replaces it must be able to give it back (a notebook's, a test's).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from tpkit import config
from tpkit.compat import group_timeout
from tpkit.config import DEFAULT_TIMEOUT_S
from tpkit.log import get_logger, log_every_rank

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "collective_frame",
    "install_timeout_report",
    "is_collective_timeout",
    "timeout_report",
    "tpkit_timeout",
    "uninstall_timeout_report",
]

log = get_logger(__name__)


def tpkit_timeout() -> float:
    """TPKIT_TIMEOUT (seconds, default `DEFAULT_TIMEOUT_S`), read at call time through
    `tpkit.config.timeout_seconds`: the timeout of every process group tpkit creates and of
    tpkit's own waits (the shared-memory all-reduce)."""
    return config.timeout_seconds()


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
    # the default group's own timeout (what init_distributed gave it, or the user's group's)
    timeout_s = group_timeout(dist.group.WORLD) or tpkit_timeout()
    grace_s = min(timeout_s, 30.0) if grace_s is None else grace_s
    others: dict[int, str] = {}
    try:
        store = dist.distributed_c10d._get_default_store()
        prefix = f"tpkit/timeout/{config.restart_count()}/"
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
    user's ``model(x)`` or ``save_checkpoint(...)`` line), not tpkit's own parallel/comm.py frame."""
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


class _ReportHook:
    """The chained ``sys.excepthook``: the previous hook's output, then the timeout report. It
    holds the hook it replaced, so `uninstall_timeout_report` can put that one back."""

    _tpkit_timeout_report = True

    def __init__(self, previous: Callable) -> None:
        self.previous = previous

    def __call__(self, exc_type, exc, tb) -> None:
        self.previous(exc_type, exc, tb)
        try:
            report = timeout_report(exc, tb)
        except Exception:  # noqa: BLE001 - never fail inside the excepthook
            report = None
        if report:
            log_every_rank(log, logging.ERROR, report)


def install_timeout_report() -> None:
    """Chain a ``sys.excepthook`` that, after the usual traceback, prints `timeout_report` for an
    uncaught collective timeout (torchrun scripts). Idempotent; called where tpkit brings up a
    group (`tpkit.parallel.mesh.init_distributed`, `tpkit.parallel.mesh.build_mesh`). ``tpkit.launch``
    and the worker pool catch a rank's exception and add the report themselves."""
    if not getattr(sys.excepthook, "_tpkit_timeout_report", False):
        sys.excepthook = _ReportHook(sys.excepthook)


def uninstall_timeout_report() -> bool:
    """Put back the ``sys.excepthook`` that `install_timeout_report` replaced. True when it did;
    False when tpkit's hook is not the current one (never installed, or another hook was chained
    on top of it since: removing it from under that one would break its chain)."""
    hook = sys.excepthook
    if not isinstance(hook, _ReportHook):
        return False
    sys.excepthook = hook.previous
    return True
