"""A reusable multi-rank harness for pytest: start N gloo ranks once, run many checks in them.

Starting a process that imports torch and transformers costs seconds, so a group of ranks is
started once per world size and kept for the session. ``group.run(fn, *args)`` sends ``fn`` (a
module-level function, found again by module and name in each rank) to every rank, waits for all
of them, and returns the per-rank results. Each check has a timeout: a rank that never answers
(a collective called on some ranks only) kills the group and fails the test loudly, naming the
ranks that did not finish and the tracebacks of those that raised; the next check starts a fresh
group.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any

DEFAULT_TIMEOUT = float(os.environ.get("TPKIT_TEST_TIMEOUT", "240"))


class RankError(AssertionError):
    """A check raised on one or more ranks; carries each rank's traceback."""


def _worker(
    rank: int, world: int, ports: mp.Queue, tasks: mp.Queue, results: mp.Queue, env: dict
) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            **env,
        }
    )
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Rank 0's store listens on a port the kernel picks as it binds, and tells the others: a
    # port picked free by the parent could be taken by another process in the seconds before
    # rank 0 listened on it (EADDRINUSE, seen under two pytest workers).
    timeout = datetime.timedelta(seconds=DEFAULT_TIMEOUT)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout, wait_for_workers=False)
        for _ in range(world - 1):
            ports.put(store.port)
    else:
        port = ports.get(timeout=DEFAULT_TIMEOUT)
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout)
    os.environ["MASTER_PORT"] = str(store.port)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    while True:
        task = tasks.get()
        if task is None:
            break
        module_name, qualname, args, kwargs = task
        try:
            obj: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            results.put((rank, True, obj(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class RankGroup:
    """``world`` persistent ranks on localhost with a gloo process group."""

    def __init__(self, world: int, env: dict[str, str] | None = None):
        self.world = world
        self.env = dict(env or {})
        self.procs: list[mp.Process] = []

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.ports = ctx.Queue()  # kept: a spawned rank unpickles it after start() returns
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world, self.ports, self.tasks[r], self.results, self.env),
                daemon=True,
            )
            for r in range(self.world)
        ]
        for p in self.procs:
            p.start()

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def run(self, fn, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return results ordered by rank."""
        if not self.alive:
            self.close()
            self.start()
        module = fn.__module__
        if module == "__main__":
            raise ValueError("checks must live in an importable module, not __main__")
        for q in self.tasks:
            q.put((module, fn.__qualname__, args, kwargs))
        done: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(done) + len(errors) < self.world:
            left = deadline - time.monotonic()
            if left <= 0 or (errors and not self.alive):
                break
            try:
                rank, ok, payload = self.results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if not self.alive:
                    break
                continue
            (done if ok else errors)[rank] = payload
            if errors and len(done) + len(errors) < self.world:
                # Other ranks may be stuck in a collective the failed rank never reached.
                deadline = min(deadline, time.monotonic() + 20)
        missing = [r for r in range(self.world) if r not in done and r not in errors]
        if missing:
            self.close()
        if errors or missing:
            parts = [f"rank {r} raised:\n{tb}" for r, tb in sorted(errors.items())]
            if missing:
                parts.append(
                    f"ranks {missing} did not finish {fn.__qualname__} within {timeout:.0f}s "
                    "(a collective reached by only some ranks?); the group was killed."
                )
            raise RankError("\n".join(parts))
        return [done[r] for r in range(self.world)]

    def threads(self) -> int:
        """The most threads any of its rank processes runs (0 where that cannot be read)."""
        counts = [0]
        for p in self.procs:
            with contextlib.suppress(OSError):
                counts.append(len(os.listdir(f"/proc/{p.pid}/task")))
        return max(counts)

    def close(self) -> None:
        for q in getattr(self, "tasks", []):
            with contextlib.suppress(Exception):  # the queue may already be broken
                q.put(None)
        # one deadline for all ranks, not 3 s each in turn: 8 ranks that linger in their exit
        # cost the HSDP module's teardown 28 s (8 x 3 s, then kills)
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=3)
        self.procs = []
