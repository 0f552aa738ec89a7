"""A finished gloo job exits 0: gloo's worker threads settle before the interpreter finalizes.

Works around a torch bug (pytorch/pytorch#190489). A gloo collective runs on one of the group's
worker threads, which wakes the caller and only then drops its reference to the finished work.
Where that reference is the last one to the work's tensors, the worker takes the GIL to release
their Python objects (torch's PyInterpreter decref checks ``Py_IsInitialized``, not
finalization). If the main thread has begun finalizing meanwhile (a script whose last
collective, ``all_gather_object`` say, is followed by ``destroy_process_group`` and exit), CPython
ends the worker with ``pthread_exit`` as it takes the GIL, the unwind meets the work's
``noexcept`` destructor, and the rank dies of SIGABRT ("terminate called without an active
exception") after all its work: torchrun reports the job failed. Rare (the worker must be
starved of CPU all the way to exit: a loaded machine), and ``destroy_process_group`` does not
prevent it: gloo's backend has no shutdown, its threads live until its C++ destructor, which
runs only when the last DeviceMesh naming the group is gone.

`install_exit_fence` registers `settle_gloo_workers` with ``atexit`` (which runs before
finalization begins): it sleeps, the GIL free, until every gloo worker thread is asleep and
stays asleep across a sleep of its own. A worker waiting for the GIL would have taken it then,
so none is left to take it during finalization. Linux only (it reads ``/proc``); elsewhere, and
where no gloo worker runs, it returns at once. Bounded by `SETTLE_TIMEOUT_S`.
"""

from __future__ import annotations

import atexit
import functools
import os
import time

from tpkit.log import get_logger

__all__ = ["SETTLE_TIMEOUT_S", "WORKER_THREAD_NAME", "install_exit_fence", "settle_gloo_workers"]

log = get_logger(__name__)

#: the name torch gives ProcessGroupGloo's worker threads (``c10::setThreadName``)
WORKER_THREAD_NAME = "pt_gloo_runloop"
#: the longest `settle_gloo_workers` waits at exit (a worker still busy then is left as it is)
SETTLE_TIMEOUT_S = 10.0
#: one sleep between two looks at the workers: the GIL is free for it
_POLL_S = 0.01
_TASKS = "/proc/self/task"


def _gloo_workers() -> dict[str, tuple[str, str]]:
    """Every gloo worker thread of this process: thread id -> (scheduler state, context switch
    counts). Empty where ``/proc`` is missing or no gloo group was made."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return {}
    found = {}
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() != WORKER_THREAD_NAME:
                    continue
            with open(f"{_TASKS}/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
            with open(f"{_TASKS}/{tid}/status") as f:
                switches = "".join(line for line in f if "ctxt_switches" in line)
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
        found[tid] = (state, switches)
    return found


def settle_gloo_workers(timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """Sleep until no gloo worker thread is running or waiting for the GIL; True once settled
    (at once without gloo workers), False after ``timeout_s``.

    Settled: between two looks, ``_POLL_S`` apart with the GIL free, every worker stayed
    asleep ("S") and its context switch counts did not move. A worker waiting for the GIL
    wakes within that sleep (the GIL is free, and CPython's waiters wake every switch interval
    anyway); one that is runnable shows "R". What is left sleeps on gloo's empty queue (or on a
    peer, in a collective nobody waited for)."""
    seen = _gloo_workers()
    if not seen:
        return True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(_POLL_S)
        now = _gloo_workers()
        if now == seen and all(state == "S" for state, _ in now.values()):
            return True
        seen = now
    log.debug("gloo worker threads still busy after %.0f s at exit", timeout_s)
    return False


@functools.cache
def install_exit_fence() -> None:
    """Run `settle_gloo_workers` at interpreter exit, before finalization; once per process."""
    atexit.register(settle_gloo_workers)
