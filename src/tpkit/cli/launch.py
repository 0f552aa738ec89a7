"""Start ranks for you: ``tpkit.launch(fn)`` from a notebook or script, ``tpkit run`` and
``ensure_ranks`` for commands. torchrun is the engine; nothing here invents its own launcher.

- ``launch(fn, *args, nproc=None, **kwargs)`` runs ``fn`` on ``nproc`` local ranks with torch's
  elastic launcher API (``elastic_launch`` / ``LaunchConfig``, what torchrun itself calls) and
  returns rank 0's result. An exception on any rank is raised in the caller with that rank's
  traceback; the launcher stops every other worker before returning.
- ``torchrun_command(...)`` builds the ``python -m torch.distributed.run`` command line with
  tpkit's defaults (OpenMP threads per rank, backend, a ``[rankN]:`` prefix on every output line);
  ``run_script`` replaces the current process with it (``tpkit run``).
- ``ensure_ranks(nproc, argv)`` re-executes the current command under torchrun when it is not
  already inside one: the first line of any CLI command that needs ranks.
- ``max_restarts`` (``tpkit run --max-restarts N``, ``launch(..., max_restarts=N)``): when a rank
  dies or fails, torch's agent stops the others and starts every rank again, up to N times; the
  script resumes itself (`tpkit.resume`, or the Trainer's ``resume_from_checkpoint=True``). A
  restart needs a fresh rendezvous store per attempt, which torch 2.13 does not give by default
  (see `RESTART_ENV`). Once the budget is spent, one clear error says so.

The core (mesh, parallelize, styles) never imports this module.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

from tpkit import config
from tpkit.log import get_logger

__all__ = [
    "RESTART_ENV",
    "LaunchError",
    "RemoteTraceback",
    "restart_budget_message",
    "default_nproc",
    "ensure_ranks",
    "inside_launched_rank",
    "launch",
    "run_script",
    "threads_per_rank",
    "torchrun_command",
    "torchrun_env",
]

log = get_logger(__name__)

#: Set (unless already set) for every job that may restart. torch >= 2.4 lets the ranks share the
#: elastic agent's rendezvous TCPStore, which outlives a failed attempt: the restarted ranks then
#: read the dead attempt's gloo addresses from it and fail at ``init_process_group`` (connection
#: refused) or hang, at random (pytorch issues 135712, 167288; a plain-torch control failed 2 and
#: hung 1 of 3 restarts here). With sharing off, each attempt's rank 0 hosts a fresh store on a
#: fresh port: every restart came up (6 of 6, tests/test_restart.py since).
RESTART_ENV = MappingProxyType({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


class LaunchError(RuntimeError):
    """A launched rank failed without a Python exception to re-raise (killed, crashed, or its
    exception could not be pickled). The message names the rank and carries its traceback."""


class RemoteTraceback(Exception):
    """The traceback of the rank that raised, chained as ``__cause__`` of the re-raised error
    (the same device as ``concurrent.futures.ProcessPoolExecutor``)."""

    def __str__(self) -> str:
        return self.args[0]


# ---- tpkit.launch ---------------------------------------------------------------------------
def default_nproc() -> int:
    """One rank per visible GPU; 2 on a machine without one."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def inside_launched_rank() -> bool:
    """True in a process started by torchrun / ``tpkit.launch`` (or with a live process group)."""
    import torch.distributed as dist

    if config.under_torchelastic():
        return True
    return dist.is_available() and dist.is_initialized()


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int | None = None,
    max_restarts: int = 0,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``nproc`` local ranks and return rank 0's result.

    Each rank is a fresh process with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT), so ``tpkit.tensor_parallel(model)`` inside ``fn`` just works. ``nproc``
    defaults to the number of GPUs, or 2 without one.

    How ``fn`` reaches the ranks:

    - an importable function (defined in a ``.py`` module, or at the top of a script guarded by
      ``if __name__ == "__main__":``) is sent by reference to *spawned* ranks, which import it:
      the safe default, and the only one that works after CUDA is initialised in the caller.
    - a function defined in a notebook cell, a lambda or a closure cannot be imported by a fresh
      process (and cloudpickle is not a dependency), so the ranks are *forked* instead and inherit
      it, as accelerate's ``notebook_launcher`` does. Forking after CUDA was initialised in the
      caller cannot work; that case raises a ``RuntimeError`` saying what to do.
      ``TPKIT_START_METHOD=spawn|fork|forkserver`` overrides the choice.

    ``args``, ``kwargs`` and rank 0's return value cross process boundaries, so they must pickle
    (return CPU tensors or plain values, not a sharded model). If a rank raises, the same exception
    is raised here with that rank's traceback as its ``__cause__``, after every rank has stopped;
    an interrupt (Ctrl-C, "interrupt kernel") stops every rank and raises ``KeyboardInterrupt``.
    Every line a rank prints appears in the caller's output (the notebook cell), prefixed
    ``[rankN]:``.

    ``max_restarts``: when a rank dies or raises, stop the others and run ``fn`` again on fresh
    ranks, up to this many times (``fn`` resumes itself, e.g. with `tpkit.resume`); the error is
    raised only once the budget is spent, with a note saying so.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    if inside_launched_rank():
        raise RuntimeError(
            "tpkit.launch was called inside a launched rank (torchrun or tpkit.launch); call the "
            "function directly there, every rank already runs it."
        )
    nproc = default_nproc() if nproc is None else int(nproc)
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}.")
    max_restarts = _check_restarts(max_restarts)
    method = _start_method(fn, args, kwargs)
    workdir = tempfile.mkdtemp(prefix="tpkit-launch-")
    config = _launch_config(nproc, method, workdir, max_restarts)
    log.info("launching %s on %d ranks (%s)", getattr(fn, "__qualname__", fn), nproc, method)
    errors = os.path.join(workdir, "errors")
    os.makedirs(errors)
    try:
        with (
            _default_threads(nproc),
            _restored_signal_handlers(),
            _quiet_elastic_logs(),
            _restart_env(max_restarts),
        ):
            results = elastic_launch(config, _run_rank)(fn, args, kwargs, errors)
    except ChildFailedError as failed:
        _raise_rank_error(errors, failed, max_restarts)
    except SignalException as sig:  # the agent stopped every worker before raising this
        if sig.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None  # what "interrupt kernel" should look like
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results[0]


def _check_restarts(max_restarts: int) -> int:
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a whole number >= 0, got {max_restarts!r}.")
    return max_restarts


@contextlib.contextmanager
def _restart_env(max_restarts: int):
    """`RESTART_ENV` in this process while the agent runs (it reads it here, at each rendezvous),
    values already set kept and everything put back after; nothing changes for a job that never
    restarts."""
    if not max_restarts:
        yield
        return
    saved = {key: os.environ.pop(key, None) for key in RESTART_ENV}
    for key, value in RESTART_ENV.items():
        os.environ[key] = saved[key] if saved[key] is not None else value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _launch_config(nproc: int, method: str, workdir: str, max_restarts: int = 0):
    """torch's ``LaunchConfig`` for one node, as ``torchrun --standalone`` would set it up."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"tpkit-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # what `torchrun --standalone` uses: a free local port
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method=method,
        # Tee each rank's output through this process's sys.stdout/sys.stderr, each line
        # prefixed [rankN]:, so it shows in the notebook cell, not in the kernel's terminal.
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(workdir, "logs"), tee=Std.ALL),
        log_line_prefix_template="[rank${rank}]:",
        shutdown_timeout=5,  # SIGTERM, then SIGKILL after 5 s: no worker outlives launch()
    )


def _run_rank(fn: Callable, args: tuple, kwargs: dict, error_dir: str) -> Any:
    """What each launched rank runs: ``fn``, then a clean process-group teardown. On an exception,
    write it (pickled, with its formatted traceback) for the caller, then re-raise so the launcher
    sees the rank fail and stops the others."""
    import torch
    import torch.distributed as dist

    from tpkit.io.async_save import wait_for_checkpoint

    rank = config.rank()
    threads = config.omp_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)  # forked ranks keep the caller's pool otherwise
    try:
        _bring_up_group()
        out = fn(*args, **kwargs)
        wait_for_checkpoint()  # a background save still writing needs the group it runs on
    except BaseException as exc:
        from tpkit.parallel.timeouts import timeout_report

        report = timeout_report(exc, exc.__traceback__)
        if report and hasattr(exc, "add_note"):
            exc.add_note(report)
        _write_error(error_dir, rank, exc)
        # Close this rank's connections now: peers blocked on it fail fast instead of waiting to
        # be killed, and gloo's threads are not torn down at interpreter exit (which aborts).
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()
        raise
    if dist.is_initialized():
        dist.destroy_process_group()
    return out if rank == 0 else None  # only rank 0's result travels back


def _bring_up_group() -> None:
    """The process group is up before ``fn`` runs, as users of launchers expect (``dist.get_rank()``
    works on the first line), with TPKIT_TIMEOUT; a group of one for ``nproc=1``.

    A ``dist.init_process_group()`` of the user's own inside ``fn`` (torchrun scripts have one)
    would then fail with "initialize the default process group twice": in these processes, which
    tpkit owns, that call becomes a no-op while the group is up."""
    import torch.distributed as dist

    from tpkit.parallel.mesh import default_backend, default_device_type, init_distributed

    init_distributed()
    if not dist.is_initialized():
        dist.init_process_group(backend=default_backend(default_device_type()))
    original = dist.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            log.debug("init_process_group: the group is already up (tpkit.launch brought it up)")
            return None
        return original(*args, **kwargs)

    dist.init_process_group = init_process_group
    dist.distributed_c10d.init_process_group = init_process_group


def _write_error(error_dir: str, rank: int, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        payload = pickle.dumps(exc)
        pickle.loads(payload)  # some exceptions pickle but cannot be rebuilt
    except Exception:  # noqa: BLE001 - any unpicklable exception falls back to its text
        payload = None
    attempt = config.restart_count()
    record = {
        "rank": rank,
        "attempt": attempt,
        "time": time.time(),
        "exc": payload,
        "traceback": text,
    }
    tmp = os.path.join(error_dir, f".rank{rank}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(record, f)
    os.replace(tmp, os.path.join(error_dir, f"rank{rank}-attempt{attempt}.pkl"))


def _raise_rank_error(error_dir: str, failed: Exception, max_restarts: int = 0) -> None:
    """Re-raise the first rank's exception of the last attempt (ranks the launcher killed
    afterwards wrote none), noting a spent restart budget."""
    records = []
    for name in os.listdir(error_dir):
        if name.endswith(".pkl"):
            with open(os.path.join(error_dir, name), "rb") as f:
                records.append(pickle.load(f))
    spent = (
        f"The job was restarted {max_restarts} time(s) (max_restarts={max_restarts}) and failed "
        "each time: the restart budget is spent."
        if max_restarts
        else None
    )
    last = max((r.get("attempt", 0) for r in records), default=0)
    records = [r for r in records if r.get("attempt", 0) == last]
    # an attempt after the last one that wrote an error died without one (killed): say that
    if not records or (max_restarts and last < max_restarts):
        raise LaunchError(
            "A launched rank died without a Python exception (killed or crashed):\n"
            f"{failed}" + (f"\n{spent}" if spent else "")
        ) from None
    first = min(records, key=lambda r: (r["time"], r["rank"]))
    where = f"rank {first['rank']}"
    remote = RemoteTraceback(f'\n"""\n[{where}]\n{first["traceback"]}"""')
    exc = pickle.loads(first["exc"]) if first["exc"] is not None else None
    if exc is None:
        raise LaunchError(
            f"{where} raised:\n{first['traceback']}" + (f"\n{spent}" if spent else "")
        ) from remote
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised on rank {first['rank']} of a tpkit.launch; its traceback is above)")
        if spent:
            exc.add_note(spent)
    raise exc from remote


def _start_method(fn: Callable, args: tuple, kwargs: dict) -> str:
    override = config.start_method()
    if override:
        return override
    if _importable(fn, args, kwargs):
        return "spawn"
    import torch

    if sys.platform == "win32" or not hasattr(os, "fork"):
        raise RuntimeError(
            f"{fn!r} cannot be imported by a new process and this platform cannot fork; move it "
            "into a .py module and import it from there."
        )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError(
            f"{getattr(fn, '__qualname__', fn)} is defined in a notebook or is a lambda/closure, so "
            "the ranks must be forked, but CUDA is already initialised in this process and a forked "
            "rank cannot use it. Either move the function into a .py file and import it (ranks "
            "are then spawned), or restart the kernel and call tpkit.launch before touching CUDA."
        )
    return "fork"


def _importable(fn: Callable, args: tuple, kwargs: dict) -> bool:
    """Can a spawned process rebuild ``(fn, args, kwargs)`` by importing?"""
    module = getattr(fn, "__module__", None)
    if module is None or "<" in getattr(fn, "__qualname__", "<"):
        return False  # lambdas, closures, functions defined inside functions
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if main_file is not None and not os.path.isfile(main_file):
        # `python - <<EOF` ("<stdin>"): a spawned process re-runs the parent's __main__ from its
        # file, which does not exist, whatever fn is
        return False
    if module == "__main__" and main_file is None:
        return False  # a notebook / REPL: spawned ranks have no such __main__ to import from
    try:
        pickle.dumps((fn, args, kwargs))
    except Exception:  # noqa: BLE001 - anything unpicklable needs fork
        return False
    return True


@contextlib.contextmanager
def _default_threads(nproc: int):
    """Spawned ranks inherit os.environ: give each its share of the cores, as ``tpkit run`` does
    (this sets the variable for the children; the caller's value, when set, is kept)."""
    if config.omp_num_threads() is not None:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(nproc))
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


@contextlib.contextmanager
def _restored_signal_handlers():
    """The elastic agent installs SIGINT/SIGTERM handlers that raise its SignalException and never
    puts the old ones back; in a notebook that would break "interrupt kernel" afterwards."""
    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    saved = {}
    with contextlib.suppress(ValueError):  # not the main thread: the agent installs none either
        for name in names:
            if hasattr(signal, name):
                saved[name] = signal.getsignal(getattr(signal, name))
    try:
        yield
    finally:
        for name, handler in saved.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(getattr(signal, name), handler)


@contextlib.contextmanager
def _quiet_elastic_logs():
    """The agent logs every worker it stops at WARNING/ERROR; a notebook user wants the result or
    the rank's error, which tpkit raises itself. TPKIT_LOG_ALL_RANKS=1 keeps the agent's logs."""
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [lg.level for lg in loggers]
    if not config.log_all_ranks():
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


# ---- torchrun fronts: tpkit run, ensure_ranks ------------------------------------------------
def threads_per_rank(nproc_per_node: int) -> int:
    """This node's usable cores split over its ranks (torchrun alone would give each rank 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, nproc_per_node))


def torchrun_command(
    target: Sequence[str],
    nproc: int | None = None,
    *,
    nnodes: str | int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    module: bool = False,
    max_restarts: int = 0,
) -> list[str]:
    """``python -m torch.distributed.run ...`` for ``target`` (``[script.py, *args]``, or
    ``[module, *args]`` with ``module=True``). One node uses ``--standalone``; several nodes use a
    c10d rendezvous at ``rdzv_endpoint`` (``host:port`` of any one node). ``--tee 3`` with a
    ``[rankN]:`` line prefix (see `torchrun_env`) keeps every rank's output readable.
    ``max_restarts`` > 0 adds ``--max-restarts`` (run it with `torchrun_env`'s `RESTART_ENV`)."""
    nproc = default_nproc() if nproc is None else int(nproc)
    max_restarts = _check_restarts(max_restarts)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if str(nnodes) == "1" and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError(
                f"nnodes={nnodes} needs rdzv_endpoint='host:port' of one node, the same on all."
            )
        cmd += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d"]
        cmd += ["--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id or "tpkit"]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    cmd += ["--tee", "3"]
    if module:
        cmd.append("-m")
    return cmd + list(target)


def torchrun_env(
    nproc_per_node: int,
    backend: str | None = None,
    threads: int | None = None,
    base: dict[str, str] | None = None,
    max_restarts: int = 0,
) -> dict[str, str]:
    """The environment torchrun runs under: OMP_NUM_THREADS (kept if set), TPKIT_BACKEND, the
    per-line ``[rankN]:`` prefix torchrun's agent applies to teed output, and for a job that may
    restart `RESTART_ENV` (a fresh rendezvous store per attempt; values already set are kept)."""
    env = dict(os.environ if base is None else base)
    if max_restarts:
        for key, value in RESTART_ENV.items():
            env.setdefault(key, value)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc_per_node)))
    if backend:
        env["TPKIT_BACKEND"] = backend
    env.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]:")
    return env


def run_script(
    target: Sequence[str],
    nproc: int | None = None,
    *,
    backend: str | None = None,
    threads: int | None = None,
    max_restarts: int = 0,
    **command: Any,
) -> int:
    """Replace this process with torchrun running ``target`` (what ``tpkit run`` does);
    ``command``: `torchrun_command`'s options (``nnodes``, ``rdzv_endpoint``, ``module``).

    With ``max_restarts`` > 0, torchrun runs in this process instead (the same
    ``torch.distributed.run`` code, no second interpreter), so that once the restart budget is
    spent one clear message (`restart_budget_message`) ends the output; the exit status is
    then 1. Otherwise returns only if torchrun could not be started (never, in practice)."""
    nproc = default_nproc() if nproc is None else int(nproc)
    cmd = torchrun_command(target, nproc, max_restarts=max_restarts, **command)
    env = torchrun_env(nproc, backend=backend, threads=threads, max_restarts=max_restarts)
    log.info("%s", " ".join(cmd))
    sys.stdout.flush()
    sys.stderr.flush()
    if max_restarts:
        return _supervise(cmd, env, max_restarts)
    os.execve(cmd[0], cmd, env)
    return 127  # pragma: no cover - execve does not return


def _supervise(cmd: list[str], env: dict[str, str], max_restarts: int) -> int:
    """torchrun's own ``run`` on ``cmd``'s arguments in this process, under ``env``; a spent
    restart budget becomes torchrun's failure table plus `restart_budget_message`, exit 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.clear()
    os.environ.update(env)
    args = parse_args(cmd[3:])  # after `python -m torch.distributed.run`
    try:
        run(args)
    except ChildFailedError as failed:
        print(str(failed), file=sys.stderr)
        print(restart_budget_message(failed, max_restarts), file=sys.stderr, flush=True)
        return 1
    return 0


def restart_budget_message(failed: Exception, max_restarts: int) -> str:
    """The last line of a job whose restarts are spent: how often it ran, how the last attempt's
    first rank failed, and what to do next."""
    how = "failed"
    failures = getattr(failed, "failures", None) or {}
    # the agent SIGTERMs the survivors once one rank fails: the cause is a failure other than that
    causes = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    if causes:
        rank, failure = min(causes.items(), key=lambda item: (item[1].timestamp, item[0]))
        exitcode = failure.exitcode
        if exitcode is not None and exitcode < 0:
            how = f"rank {rank} was killed by {failure.signal_name()}"
        else:
            how = f"rank {rank} exited with status {exitcode}"
    return (
        f"tpkit run: giving up: the job failed {max_restarts + 1} times (the first run and "
        f"{max_restarts} restart(s), --max-restarts {max_restarts}); the last time {how}. "
        "Fix the cause (the output above), then run the same command again: a script that "
        "resumes itself picks up from its last complete checkpoint."
    )


def ensure_ranks(nproc: int | None = None, argv: Sequence[str] | None = None) -> None:
    """Make sure the current command runs on ``nproc`` ranks; call it first in a CLI command.

    Inside torchrun (or when ``nproc`` is 1) this returns at once and the command carries on as a
    rank. Otherwise it replaces the current process with ``torchrun --nproc-per-node nproc``
    running the same command line (``argv``, default ``sys.argv``), so ``tpkit generate ...`` typed
    in a shell behaves exactly like ``tpkit run --nproc N $(which tpkit) generate ...``::

        def cmd_generate(args):
            ensure_ranks(args.nproc)        # re-executes under torchrun, or returns in a rank
            model = tpkit.tensor_parallel(...)
    """
    nproc = default_nproc() if nproc is None else int(nproc)
    if nproc <= 1 or inside_launched_rank():
        return
    argv = list(sys.argv if argv is None else argv)
    if not argv or not os.path.exists(argv[0]):
        raise RuntimeError(
            f"Cannot re-launch {argv!r} under torchrun: argv[0] is not a file. Run it with "
            f"`tpkit run --nproc {nproc} <script> [args]` instead."
        )
    run_script(argv, nproc)
