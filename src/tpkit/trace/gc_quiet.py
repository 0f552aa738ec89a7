"""Planning without re-scanning the whole heap: the garbage collector skips what came before.

Planning makes a few hundred thousand short-lived objects (fake tensors, trace nodes, plans), so
CPython's collector runs its full (oldest-generation) collection several times during one
derivation. Each full collection walks every container object in the process, and after
``import torch, transformers, tpkit`` there are millions of them (torch's dynamo, sympy and
every transformers module imported): about 0.2 s per collection on the 2-core CI host, 0.4 s of
a 0.7 s Llama derivation. `frozen_heap` moves what existed before planning into the collector's
permanent generation (`gc.freeze`) for the call and back (`gc.unfreeze`) after it: both are
list splices, so the young objects planning makes are still collected as usual, and nothing
that existed before is leaked, only skipped until the call returns.

The same cost is paid once more when a process exits: the interpreter's final collections walk
the same heap (1.2 s after those imports). `freeze_before_exit` spares a command that is about
to end it (``tpkit plan``): its memory goes back to the OS whole.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

__all__ = ["freeze_before_exit", "frozen_heap", "with_frozen_heap"]

_F = TypeVar("_F", bound=Callable)
_lock = threading.Lock()
_depth = 0  # nested planning calls (derive_plan inside tensor_parallel) freeze once


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Within the block, full collections skip every object that existed when it began.

    A no-op where the collector is off, where someone else already froze objects (their freeze is
    theirs to undo: ``gc.unfreeze`` here would undo it), and inside another `frozen_heap`.
    """
    global _depth
    with _lock:
        mine = _depth == 0 and gc.isenabled() and gc.get_freeze_count() == 0
        _depth += 1
        if mine:
            gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if mine:
                gc.unfreeze()


def with_frozen_heap(fn: _F) -> _F:
    """``fn`` run inside `frozen_heap` (the planning entry points: derive, validate)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with frozen_heap():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def freeze_before_exit() -> None:
    """For a process that ends right after: its final collections then skip the whole heap."""
    gc.freeze()
