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
from typing import Any

from tpkit import config
from tpkit.log import get_logger

__all__ = [
    "LaunchError",
    "RemoteTraceback",
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


def launch(fn: Callable[..., Any], *args: Any, nproc: int | None = None, **kwargs: Any) -> Any:
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
    method = _start_method(fn, args, kwargs)
    workdir = tempfile.mkdtemp(prefix="tpkit-launch-")
    config = _launch_config(nproc, method, workdir)
    log.info("launching %s on %d ranks (%s)", getattr(fn, "__qualname__", fn), nproc, method)
    errors = os.path.join(workdir, "errors")
    os.makedirs(errors)
    try:
        with _default_threads(nproc), _restored_signal_handlers(), _quiet_elastic_logs():
            results = elastic_launch(config, _run_rank)(fn, args, kwargs, errors)
    except ChildFailedError as failed:
        _raise_rank_error(errors, failed)
    except SignalException as sig:  # the agent stopped every worker before raising this
        if sig.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None  # what "interrupt kernel" should look like
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results[0]


def _launch_config(nproc: int, method: str, workdir: str):
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
        max_restarts=0,
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

    rank = config.rank()
    threads = config.omp_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)  # forked ranks keep the caller's pool otherwise
    try:
        _bring_up_group()
        out = fn(*args, **kwargs)
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
    record = {"rank": rank, "time": time.time(), "exc": payload, "traceback": text}
    tmp = os.path.join(error_dir, f".rank{rank}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(record, f)
    os.replace(tmp, os.path.join(error_dir, f"rank{rank}.pkl"))


def _raise_rank_error(error_dir: str, failed: Exception) -> None:
    """Re-raise the first rank's exception (ranks the launcher killed afterwards wrote none)."""
    records = []
    for name in os.listdir(error_dir):
        if name.endswith(".pkl"):
            with open(os.path.join(error_dir, name), "rb") as f:
                records.append(pickle.load(f))
    if not records:
        raise LaunchError(
            f"A launched rank died without a Python exception (killed or crashed):\n{failed}"
        ) from None
    first = min(records, key=lambda r: (r["time"], r["rank"]))
    where = f"rank {first['rank']}"
    remote = RemoteTraceback(f'\n"""\n[{where}]\n{first["traceback"]}"""')
    exc = pickle.loads(first["exc"]) if first["exc"] is not None else None
    if exc is None:
        raise LaunchError(f"{where} raised:\n{first['traceback']}") from remote
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised on rank {first['rank']} of a tpkit.launch; its traceback is above)")
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
) -> list[str]:
    """``python -m torch.distributed.run ...`` for ``target`` (``[script.py, *args]``, or
    ``[module, *args]`` with ``module=True``). One node uses ``--standalone``; several nodes use a
    c10d rendezvous at ``rdzv_endpoint`` (``host:port`` of any one node). ``--tee 3`` with a
    ``[rankN]:`` line prefix (see `torchrun_env`) keeps every rank's output readable."""
    nproc = default_nproc() if nproc is None else int(nproc)
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
    cmd += ["--tee", "3"]
    if module:
        cmd.append("-m")
    return cmd + list(target)


def torchrun_env(
    nproc_per_node: int,
    backend: str | None = None,
    threads: int | None = None,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment torchrun runs under: OMP_NUM_THREADS (kept if set), TPKIT_BACKEND, and the
    per-line ``[rankN]:`` prefix torchrun's agent applies to teed output."""
    env = dict(os.environ if base is None else base)
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
    **command: Any,
) -> int:
    """Replace this process with torchrun running ``target`` (what ``tpkit run`` does);
    ``command``: `torchrun_command`'s options (``nnodes``, ``rdzv_endpoint``, ``module``).

    Returns only if torchrun could not be started (never, in practice)."""
    nproc = default_nproc() if nproc is None else int(nproc)
    cmd = torchrun_command(target, nproc, **command)
    env = torchrun_env(nproc, backend=backend, threads=threads)
    log.info("%s", " ".join(cmd))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)
    return 127  # pragma: no cover - execve does not return


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
