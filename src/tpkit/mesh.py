"""Process group and DeviceMesh from torchrun's environment.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; everything here reads them, so the same script runs
under `torchrun --nproc-per-node N`, `tpkit run`, `tpkit.launch` or plain `python` (world size 1).
The mesh is always 2D and named ``("dp", "tp")`` with tp innermost: ranks of one TP group are
contiguous, which is what accelerate's data loader and NVLink topology both assume.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tpkit.log import get_logger, log_every_rank

log = get_logger(__name__)

#: Default process-group timeout. Short enough that a rank that never arrives at a collective
#: fails loudly within minutes instead of hanging a job for torch's default 10 to 30 minutes.
DEFAULT_TIMEOUT_S = 300.0
_pg_timeout_s: float | None = None  # what init_distributed gave the process group
#: (device type, dp, tp) -> the mesh built for it: every `tensor_parallel` call with the same sizes
#: shares one mesh, so repeated calls create no new process groups (each holds threads and fds).
_MESHES: dict[tuple[str, int, int], DeviceMesh] = {}


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


@dataclass(frozen=True)
class DistEnv:
    """What torchrun told this process. World size 1 when not launched by torchrun."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def dist_env() -> DistEnv:
    """Read RANK / WORLD_SIZE / LOCAL_RANK (or the live process group, if one exists)."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        return DistEnv(rank, world, int(os.environ.get("LOCAL_RANK", rank)))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return DistEnv(rank, world, int(os.environ.get("LOCAL_RANK", rank)))


def default_device_type() -> str:
    """cuda when this process can see a GPU, else cpu. Nothing in tpkit assumes CUDA."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_backend(device_type: str) -> str:
    """nccl for CUDA, gloo otherwise; TPKIT_BACKEND overrides."""
    override = os.environ.get("TPKIT_BACKEND")
    if override:
        return override
    return "nccl" if device_type == "cuda" else "gloo"


def init_distributed(
    backend: str | None = None,
    device_type: str | None = None,
    timeout_s: float | None = None,
) -> DistEnv:
    """Initialise the default process group from torchrun's env if it is not up yet.

    Returns the environment. With world size 1 and no group, nothing is initialised: single-process
    use needs no process group at all.
    """
    env = dist_env()
    if not env.is_distributed or dist.is_initialized():
        return env
    device_type = device_type or default_device_type()
    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank % max(torch.cuda.device_count(), 1))
    backend = backend or default_backend(device_type)
    seconds = timeout_s if timeout_s is not None else tpkit_timeout()
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=seconds))
    global _pg_timeout_s
    _pg_timeout_s = seconds
    _install_timeout_report()
    log.info("process group up: %s, %d ranks, timeout %g s", backend, env.world_size, seconds)
    return dist_env()


def resolve_sizes(tp_size: int | None, dp_size: int | None, world_size: int) -> tuple[int, int]:
    """Fill in tp/dp from the world size; raise a ValueError naming the numbers when they clash.

    Pure arithmetic: it runs before any collective so every rank raises the same error.
    """
    if tp_size is not None and tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}.")
    if dp_size is not None and dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}.")
    if tp_size is None:
        tp_size = world_size // (dp_size or 1)
    if world_size % tp_size != 0:
        raise ValueError(
            f"tp_size={tp_size} does not divide the world size {world_size}; use a tp_size among "
            f"{_divisors(world_size)} or launch {tp_size * max(1, world_size // tp_size)} ranks."
        )
    if dp_size is None:
        dp_size = world_size // tp_size
    if dp_size * tp_size != world_size:
        raise ValueError(
            f"dp_size={dp_size} x tp_size={tp_size} = {dp_size * tp_size} ranks, but the world size "
            f"is {world_size}; launch {dp_size * tp_size} ranks or set dp_size={world_size // tp_size}."
        )
    return tp_size, dp_size


def build_mesh(
    tp_size: int,
    dp_size: int = 1,
    device_type: str | None = None,
) -> DeviceMesh:
    """A ``("dp", "tp")`` DeviceMesh over the default group, tp innermost (contiguous ranks).

    Built once per (device type, dp, tp) and process group: later calls return the same mesh,
    so a loop of ``tensor_parallel`` calls creates no new process groups. Every group of the mesh
    gets TPKIT_TIMEOUT (torch gives sub-groups its 30-minute default, not the default group's
    timeout) and a collective timeout in any of them prints tpkit's report.
    """
    device_type = device_type or default_device_type()
    key = (device_type, dp_size, tp_size)
    mesh = _MESHES.get(key)
    if mesh is not None and _mesh_alive(mesh):
        return mesh
    mesh = init_device_mesh(device_type, (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    timeout = datetime.timedelta(seconds=tpkit_timeout())
    default = dist.distributed_c10d._get_default_group()
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        if group is not default:  # the default group keeps what its creator chose
            # private but stable since torch 2.2; the only way to set a live group's timeout
            dist.distributed_c10d._set_pg_timeout(timeout, group)
    _install_timeout_report()
    _MESHES[key] = mesh
    return mesh


def _mesh_alive(mesh: DeviceMesh) -> bool:
    """False once the process group the mesh was built on was destroyed (and maybe re-made)."""
    try:
        return all(
            dist.distributed_c10d._rank_not_in_group(mesh.get_group(d)) is False
            for d in range(mesh.ndim)
        )
    except (RuntimeError, ValueError, KeyError):
        return False


def tp_submesh(mesh: DeviceMesh) -> DeviceMesh:
    """The TP dimension of a mesh: ``mesh["tp"]`` for a named 2D mesh, the mesh itself if 1D."""
    if mesh.ndim == 1:
        return mesh
    if mesh.mesh_dim_names is None or "tp" not in mesh.mesh_dim_names:
        raise ValueError(
            f"A {mesh.ndim}D mesh needs a dimension named 'tp' (got names {mesh.mesh_dim_names}); "
            "build it with tpkit.build_mesh(tp_size, dp_size) or init_device_mesh(..., "
            "mesh_dim_names=('dp', 'tp'))."
        )
    return mesh["tp"]


def sync_rng(tp_mesh: DeviceMesh) -> None:
    """Make every rank of the TP group share the RNG state of its TP-rank 0.

    Replicated activations (dropout after a row-parallel layer, sampling in generate) must draw the
    same random numbers on every TP rank. Broadcasting rank 0's *state* (not a fresh seed) leaves
    rank 0's stream untouched, so a seeded TP run draws exactly what the unsharded run draws.
    """
    if tp_mesh.size() == 1:
        return
    group = tp_mesh.get_group()
    src = dist.get_global_rank(group, 0)
    device = torch.device(tp_mesh.device_type, _current_index(tp_mesh.device_type))
    cpu_state = torch.get_rng_state().to(device)
    dist.broadcast(cpu_state, src=src, group=group)
    torch.set_rng_state(cpu_state.cpu())
    if tp_mesh.device_type == "cuda":
        cuda_state = torch.cuda.get_rng_state().to(device)
        dist.broadcast(cuda_state, src=src, group=group)
        torch.cuda.set_rng_state(cuda_state.cpu())


def _current_index(device_type: str) -> int:
    return torch.cuda.current_device() if device_type == "cuda" else 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---- timeouts: name the collective and the rank that did not arrive ---------------------------
# gloo says only "Timed out waiting 300000ms for recv operation to complete"; NCCL's watchdog names
# the op but not the missing rank. On a timeout tpkit adds the collective, where it was called, and
# a roll call over the process group's store: every rank that timed out writes where it waited,
# and the ranks that write nothing within the grace period are the ones that never arrived.
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
    timeout_s = _pg_timeout_s or tpkit_timeout()
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
    user's ``model(x)`` or ``save_checkpoint(...)`` line), not tpkit's own comm.py frame."""
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


def _install_timeout_report() -> None:
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
