"""The caller's side of the pool: start one worker process per device, send each request to all
of them, and bring back rank 0's answer, or the first rank's error.

Why these choices:

- Workers are fresh interpreters (``python -m tpkit.pool.worker``), not ``multiprocessing``
  children: a spawned child re-runs the caller's ``__main__`` (a script without an
  ``if __name__ == "__main__"`` guard would start pools recursively), and a forked one cannot
  use CUDA. A fresh interpreter imports only tpkit, from a notebook, a REPL or a script alike.
- One socket per worker (``multiprocessing.connection`` with a random key) carries pickled
  requests; a pipe on each worker's stdin is its lifeline: when the caller dies, however it
  dies (kernel restart, ``kill -9``), the pipe reaches EOF and the worker exits. No orphans.
- A worker's output is printed in the caller (a notebook cell), each line prefixed ``[rankN]:``
  as torchrun does; the last lines are kept to explain a worker that dies.
- An error on some ranks while others wait in a collective cannot be recovered from: those
  ranks are stopped and the pool must be restarted. An error every rank raised alike (a bad
  input caught before any collective) leaves the pool usable. Ctrl-C stops every worker
  (SIGINT, then kill): a call cut short on some ranks would leave the collectives out of step,
  and the next one would pair wrong halves, which is a wrong number with no error.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

__all__ = ["Pool", "PoolError", "WorkerTraceback", "raise_worker_error"]

#: seconds to wait for the other ranks once one has raised (they may be stuck in a collective)
GRACE_S = 20.0
#: seconds a worker gets to start, load and split its model
START_S = 900.0
#: what a worker runs (``-c``, not ``-m``: the package imports the module before runpy would)
_WORKER_MAIN = "from tpkit.pool.worker import main; main()"


class PoolError(RuntimeError):
    """The pool cannot answer: a worker died, failed to start, or the pool was stopped. The
    message names the rank, what it printed last, and what to do (``model.restart()``)."""


class WorkerTraceback(Exception):
    """A worker's traceback, chained as ``__cause__`` of the error re-raised in the caller
    (the device ``concurrent.futures.ProcessPoolExecutor`` uses)."""

    def __str__(self) -> str:
        return self.args[0]


def raise_worker_error(record: dict) -> None:
    """Re-raise the exception a worker reported, with its rank and traceback attached."""
    where = f"rank {record['rank']} of the tpkit pool"
    remote = WorkerTraceback(f'\n"""\n[{where}]\n{record["traceback"]}"""')
    exc = None
    if record.get("exc") is not None:
        with contextlib.suppress(Exception):
            exc = pickle.loads(record["exc"])
    if exc is None:
        raise PoolError(f"{where} raised:\n{record['traceback']}") from remote
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised on {where}; its traceback is above)")
    raise exc from remote


class Pool:
    """``world`` worker processes joined by torch.distributed, each holding its shards of one
    model built from ``spec`` (see `tpkit.pool.worker.build`). ``env``: extra environment for
    every worker (device visibility, threads)."""

    def __init__(self, world: int, spec: tuple, env: dict[str, str]) -> None:
        self.world, self.spec, self.env = world, spec, env
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.stopped: str | None = "not started"
        self.generation = 0
        self.info: Any = None
        self.freed: list[int] = []
        self._lock = threading.Lock()
        self._tails: list[collections.deque] = []
        self._threads: list[threading.Thread] = []
        self._dir: str | None = None

    # ---- life -------------------------------------------------------------------------------
    def start(self) -> Any:
        """Start the workers and wait until each has built and split its model; return what
        rank 0 reported (the model's config, device, dtype)."""
        self._dir = tempfile.mkdtemp(prefix="tpkit-pool-")
        key = secrets.token_bytes(32)
        address = os.path.join(self._dir, "socket")
        listener = Listener(address, family="AF_UNIX", authkey=key)
        env = {
            **os.environ,
            **self.env,
            "WORLD_SIZE": str(self.world),
            "LOCAL_WORLD_SIZE": str(self.world),
            "PYTHONUNBUFFERED": "1",
        }
        self.generation += 1
        self.freed = []
        self.stopped = None
        self._tails = [collections.deque(maxlen=40) for _ in range(self.world)]
        try:
            for rank in range(self.world):
                proc = subprocess.Popen(
                    [sys.executable, "-c", _WORKER_MAIN, address],
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # Ctrl-C in a terminal reaches the caller only
                )
                proc.stdin.write(key.hex().encode() + b"\n")  # the lifeline stays open
                proc.stdin.flush()
                self.procs.append(proc)
                self._forward_output(rank, proc)
            self.conns = self._accept(listener)
            self._send(("start", self.spec))
            return self._gather("start", timeout=START_S)
        except BaseException:
            self.stop("it failed to start")
            raise
        finally:
            listener.close()

    def _accept(self, listener: Listener) -> list[Connection]:
        """Each worker's connection, by rank (it says its rank first). Accepting runs in a
        thread so a worker that dies before connecting is an error, not a hang."""
        conns: dict[int, Connection] = {}

        def accept() -> None:
            with contextlib.suppress(OSError):
                while len(conns) < self.world:
                    conn = listener.accept()
                    conns[conn.recv()] = conn

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        deadline = time.monotonic() + START_S
        while thread.is_alive():
            thread.join(0.1)
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                listener.close()
                raise PoolError(self._death_message(dead[0] if dead else 0, "while starting"))
        return [conns[r] for r in range(self.world)]

    def _forward_output(self, rank: int, proc: subprocess.Popen) -> None:
        tail = self._tails[rank]

        def pump() -> None:
            for raw in iter(proc.stdout.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                tail.append(line)
                with contextlib.suppress(Exception):  # a closed notebook stream
                    sys.stdout.write(f"[rank{rank}]:{line}\n")
                    sys.stdout.flush()

        thread = threading.Thread(target=pump, daemon=True, name=f"tpkit-pool-out{rank}")
        thread.start()
        self._threads.append(thread)

    def stop(self, why: str) -> None:
        """End every worker (asked first, then killed) and remember why, for the next call."""
        with contextlib.suppress(Exception):
            self._send(("close", None))
        deadline = time.monotonic() + 5
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            with contextlib.suppress(Exception):
                proc.stdin.close()
        for conn in self.conns:
            conn.close()
        for thread in self._threads:
            thread.join(2)
        self.procs, self.conns, self._threads = [], [], []
        self.stopped = why
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ---- requests ---------------------------------------------------------------------------
    def request(self, op: str, payload: Any) -> Any:
        """Send one request to every worker, wait for all, return rank 0's answer."""
        with self._lock:
            if self.stopped is not None:
                raise PoolError(
                    f"the tpkit pool is stopped ({self.stopped}); model.restart() starts it "
                    "again from the weights the model was made from."
                )
            freed, self.freed = self.freed, []
            self._send((op, payload, freed))
            return self._gather(op)

    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(data)

    def _gather(self, op: str, timeout: float | None = None) -> Any:
        replies: dict[int, tuple[bool, Any]] = {}
        waiting = dict(zip(self.conns, range(self.world)))
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while waiting:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                for conn in wait(list(waiting), timeout=left):
                    rank = waiting.pop(conn)
                    try:
                        replies[rank] = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        self._died(rank, op)
                    if not replies[rank][0] and deadline is None:
                        deadline = time.monotonic() + GRACE_S  # the others may never answer
        except KeyboardInterrupt:
            self._interrupt()
            raise
        errors = {r: v for r, (ok, v) in replies.items() if not ok}
        if waiting or errors:
            missing = sorted(waiting.values())
            if missing:
                self.stop(f"ranks {missing} did not finish {op!r} after rank(s) {sorted(errors)}")
            if not errors:
                raise PoolError(f"ranks {missing} did not finish {op!r} in {timeout:.0f} s.")
            first = min(errors.values(), key=lambda e: (e["time"], e["rank"]))
            if missing:
                first["traceback"] += (
                    f"\n(ranks {missing} were still waiting, likely in a collective rank "
                    f"{first['rank']} never reached; the pool was stopped: model.restart())"
                )
            raise_worker_error(first)
        return replies[0][1]

    def _died(self, rank: int, op: str) -> None:
        proc = self.procs[rank]
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(2)
        message = self._death_message(rank, f"during {op!r}")
        self.stop(f"rank {rank} died")
        raise PoolError(message + "\nThe pool was stopped; model.restart() starts it again.")

    def _death_message(self, rank: int, when: str) -> str:
        code = self.procs[rank].poll() if rank < len(self.procs) else None
        how = "is still running" if code is None else f"exited with code {code}"
        if code is not None and code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        tail = "\n".join(self._tails[rank]) if rank < len(self._tails) else ""
        return f"tpkit pool: rank {rank} {how} {when}. Its last output:\n{tail}"

    def _interrupt(self) -> None:
        """Ctrl-C while waiting: interrupt every worker, then stop them all (see the module
        docstring for why the pool is not kept)."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        self.stop(
            "interrupted (Ctrl-C) during a call; a call cut short on some ranks leaves "
            "their collectives out of step"
        )
