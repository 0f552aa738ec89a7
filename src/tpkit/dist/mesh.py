"""Process group and DeviceMesh from torchrun's environment.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; everything here reads them (through `tpkit.config`),
so the same script runs under `torchrun --nproc-per-node N`, `tpkit run`, `tpkit.launch` or plain
`python` (world size 1).
The mesh is always 2D and named ``("dp", "tp")`` with tp innermost: ranks of one TP group are
contiguous, which is what accelerate's data loader and NVLink topology both assume.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tpkit import config
from tpkit.dist.timeouts import install_timeout_report, tpkit_timeout
from tpkit.log import get_logger

__all__ = [
    "DistEnv",
    "barrier",
    "build_mesh",
    "default_backend",
    "default_device_type",
    "dist_env",
    "init_distributed",
    "rank",
    "sync_rng",
    "tp_submesh",
]

log = get_logger(__name__)
#: (device type, dp, tp) -> the mesh built for it: every `tensor_parallel` call with the same sizes
#: shares one mesh, so repeated calls create no new process groups (each holds threads and fds).
#: Module-wide because what it caches is: torch keeps process groups per process, and its
#: ProcessGroup objects take no attributes; `_mesh_alive` drops a mesh whose group was destroyed.
_MESHES: dict[tuple[str, int, int], DeviceMesh] = {}


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
    else:
        rank, world = config.rank(), config.world_size()
    return DistEnv(rank, world, config.local_rank(default=rank))


def default_device_type() -> str:
    """cuda when this process can see a GPU, else cpu. Nothing in tpkit assumes CUDA."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_backend(device_type: str) -> str:
    """nccl for CUDA, gloo otherwise; TPKIT_BACKEND overrides."""
    override = config.backend()
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
    install_timeout_report()
    log.info("process group up: %s, %d ranks, timeout %g s", backend, env.world_size, seconds)
    return dist_env()


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
    install_timeout_report()
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


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
