"""Process group and DeviceMesh from torchrun's environment.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; everything here reads them (through `tpkit.config`),
so the same script runs under `torchrun --nproc-per-node N`, `tpkit run`, `tpkit.launch` or plain
`python` (world size 1).

The world mesh has one named dimension per axis that is on, in the order of `AXES`
(``dp_replicate``, ``dp_shard``, ``cp``, ``tp``; tp always, innermost: ranks of one TP group are
contiguous, which is what accelerate's data loader and NVLink topology both assume), plus the
flattened data dimensions of `FLATTENED` (``dp``: every data-parallel rank). `get_mesh` is how
every other module asks for a dimension: an axis of size 1 is simply absent (None), but for
dp_shard beside dp_replicate (HSDP's 2-D data mesh, `build_mesh`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tpkit import config
from tpkit.log import get_logger
from tpkit.parallel.gloo_exit import install_exit_fence
from tpkit.parallel.timeouts import install_timeout_report, tpkit_timeout

__all__ = [
    "AXES",
    "EXPERT_AXES",
    "FLATTENED",
    "DistEnv",
    "barrier",
    "build_expert_mesh",
    "build_mesh",
    "default_backend",
    "default_device_type",
    "dist_env",
    "get_mesh",
    "init_distributed",
    "mesh_sizes",
    "rank",
    "sync_rng",
    "tp_submesh",
]

log = get_logger(__name__)
#: the world mesh's axes, outermost first (`tpkit.parallel.dims`); ep is carved out of
#: dp_shard x tp by the expert mesh, pp is reserved
AXES = ("dp_replicate", "dp_shard", "cp", "tp")
#: flattened dimensions the world mesh carries, each over the axes of its tuple that are on
FLATTENED = MappingProxyType(
    {
        "dp": ("dp_replicate", "dp_shard"),
        "dp_shard_cp": ("dp_shard", "cp"),
        "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    }
)
#: what a user's mesh may call its dimensions: the axes, and "dp" (dp_shard, or dp_replicate
#: with ``sharded=False``), the name tpkit's 2-D meshes had
_USER_NAMES = (*AXES, "dp")
#: (device type, sizes) -> the mesh built for it: every `tensor_parallel` call with the same sizes
#: shares one mesh, so repeated calls create no new process groups (each holds threads and fds).
#: Module-wide because what it caches is: torch keeps process groups per process, and its
#: ProcessGroup objects take no attributes; `_mesh_alive` drops a mesh whose group was destroyed.
_MESHES: dict[tuple, DeviceMesh] = {}


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
    init_method: str | None = None,
) -> DistEnv:
    """Initialise the default process group from torchrun's env if it is not up yet.

    Returns the environment. With world size 1 and no group, nothing is initialised: single-process
    use needs no process group at all. ``init_method`` (e.g. ``file:///tmp/x/store``): where the
    ranks meet instead of ``MASTER_ADDR:MASTER_PORT`` (rank and world size still from the env).
    """
    env = dist_env()
    if not env.is_distributed:
        return env
    install_exit_fence()  # whoever made the group: gloo's threads must settle before exit
    if dist.is_initialized():
        return env
    device_type = device_type or default_device_type()
    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank % max(torch.cuda.device_count(), 1))
    backend = backend or default_backend(device_type)
    seconds = timeout_s if timeout_s is not None else tpkit_timeout()
    meet = {}
    if init_method is not None:
        meet = {"init_method": init_method, "rank": env.rank, "world_size": env.world_size}
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=seconds), **meet)
    install_timeout_report()
    log.info("process group up: %s, %d ranks, timeout %g s", backend, env.world_size, seconds)
    return dist_env()


def build_mesh(
    tp_size: int,
    dp_size: int = 1,
    device_type: str | None = None,
    *,
    dp_replicate_size: int = 1,
    cp_size: int = 1,
) -> DeviceMesh:
    """The world DeviceMesh: one dimension per axis of size > 1 in `AXES` order and always
    "tp" (innermost, contiguous ranks), plus the `FLATTENED` ones (``mesh["dp"]``: every
    data-parallel rank). ``dp_size`` is the FSDP axis (dp_shard); with ``dp_replicate_size`` > 1
    it is a dimension even at size 1 (HSDP's data mesh is (dp_replicate, dp_shard)).

    Built once per (device type, sizes) and process group: later calls return the same mesh,
    so a loop of ``tensor_parallel`` calls creates no new process groups. Every group of the mesh
    gets TPKIT_TIMEOUT (torch gives sub-groups its 30-minute default, not the default group's
    timeout) and a collective timeout in any of them prints tpkit's report.
    """
    device_type = device_type or default_device_type()
    sizes = {"dp_replicate": dp_replicate_size, "dp_shard": dp_size, "cp": cp_size, "tp": tp_size}
    key = (device_type, *sizes.values())
    mesh = _MESHES.get(key)
    if mesh is not None and _mesh_alive(mesh):
        return mesh
    # dp_shard stays (size 1) beside dp_replicate: HSDP's data mesh is 2-D, and FSDP2 over an
    # (R, 1) mesh keeps whole replicas whose gradients it all-reduces
    keep = {"tp", "dp_shard"} if dp_replicate_size > 1 else {"tp"}
    names = tuple(n for n in AXES if sizes[n] > 1 or n in keep)
    mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
    for flat, parts in FLATTENED.items():
        present = tuple(p for p in parts if p in names)
        # "dp" also as an alias of dp_shard or dp_replicate alone (the name users and the
        # Trainer integration index); the others only where they join two axes or more
        if len(present) > 1 or (present and flat == "dp"):
            mesh[present]._flatten(flat)
    timeout = datetime.timedelta(seconds=tpkit_timeout())
    default = dist.distributed_c10d._get_default_group()
    for group in _groups(mesh):
        if group is not default:  # the default group keeps what its creator chose
            # private but stable since torch 2.2; the only way to set a live group's timeout
            dist.distributed_c10d._set_pg_timeout(timeout, group)
    install_timeout_report()
    install_exit_fence()
    _MESHES[key] = mesh
    return mesh


#: the expert mesh's dimensions, outermost first (`build_expert_mesh`)
EXPERT_AXES = ("dp_replicate", "efsdp", "ep")


def build_expert_mesh(
    dp_replicate: int, efsdp: int, ep: int, device_type: str | None = None
) -> DeviceMesh:
    """The expert mesh: ``("dp_replicate", "efsdp", "ep")`` over the world in rank order, every
    dimension present (size 1 allowed). ep is innermost: an EP group is ep contiguous ranks, a
    TP group and the dp_shard ranks beside it (transformers' convention: ep a multiple of tp
    dividing dp_shard x tp); efsdp = dp_shard x tp / ep ranks hold the same experts (FSDP2
    shards them there), dp_replicate as on the world mesh. Cached and timed out as
    `build_mesh`'s."""
    device_type = device_type or default_device_type()
    key = ("expert", device_type, dp_replicate, efsdp, ep)
    mesh = _MESHES.get(key)
    if mesh is not None and _mesh_alive(mesh):
        return mesh
    mesh = init_device_mesh(device_type, (dp_replicate, efsdp, ep), mesh_dim_names=EXPERT_AXES)
    timeout = datetime.timedelta(seconds=tpkit_timeout())
    default = dist.distributed_c10d._get_default_group()
    for group in (mesh.get_group(d) for d in range(mesh.ndim)):
        if group is not default:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
    install_timeout_report()
    install_exit_fence()
    _MESHES[key] = mesh
    return mesh


def _groups(mesh: DeviceMesh) -> list:
    """This rank's process group of every dimension of ``mesh``, flattened ones included."""
    groups = [mesh.get_group(d) for d in range(mesh.ndim)]
    for flat in FLATTENED:
        sub = get_mesh(mesh, flat)
        if sub is not None:
            groups.append(sub.get_group())
    return groups


def get_mesh(mesh: DeviceMesh, *names: str) -> DeviceMesh | None:
    """The sub-mesh of ``mesh`` over the named axes that are on (a flattened name such as
    ``"dp"`` as one dimension), or None when none of them is (every one of size 1).

    A mesh tpkit built has every axis of size > 1; a user's mesh may leave any out, and may call
    dp_shard "dp" (`mesh_sizes`); a flattened name whose axes it has apart is flattened here (a
    collective: every rank asks in the same order). Unknown names are a ValueError."""
    have = tuple(mesh.mesh_dim_names or ("tp",))
    for n in names:
        if n not in AXES and n not in FLATTENED:
            raise ValueError(f"unknown mesh axis {n!r}; tpkit's axes are {AXES + tuple(FLATTENED)}")
    user_dp = "dp" in have and "dp_replicate" not in have  # a user's ("dp", "tp") mesh

    def present(axis: str) -> list[str]:
        if axis in have:
            return [axis]
        return ["dp"] if axis == "dp_shard" and user_dp else []

    picked: list[str] = []
    for n in names:
        if n in have or (n in FLATTENED and _has(mesh, n)):
            picked.append(n)
        elif n in FLATTENED:  # a user's mesh, not flattened: its axes that are on, if any
            axes = [q for p in FLATTENED[n] for q in present(p) if q not in picked]
            if len(axes) > 1:  # one FSDP/CP dimension, as build_mesh makes it (every rank)
                mesh[tuple(axes)]._flatten(n)
                axes = [n]
            picked += axes
        else:
            picked += present(n)
    if not picked:
        return None
    if mesh.ndim == 1 and mesh.mesh_dim_names is None:
        return mesh
    return mesh[picked[0]] if len(picked) == 1 else mesh[tuple(picked)]


def _has(mesh: DeviceMesh, name: str) -> bool:
    """Whether ``mesh[name]`` names a dimension (a flattened one included)."""
    try:
        mesh[name]
    except (KeyError, RuntimeError, ValueError):
        return False
    return True


def mesh_sizes(mesh: DeviceMesh, sharded: bool | None = None) -> dict[str, int]:
    """Each axis's size in a user's mesh: its dimensions must be named among `AXES` (or "dp",
    the FSDP axis; with ``sharded=False`` the replicas), else a ValueError names them. A 1-D
    mesh without names is the TP group."""
    names = mesh.mesh_dim_names
    if names is None:
        if mesh.ndim == 1:
            return {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": mesh.size()}
        raise ValueError(
            f"a {mesh.ndim}-D mesh without dimension names: name its dimensions among "
            f"{_USER_NAMES} (tp innermost), e.g. init_device_mesh(..., mesh_dim_names=('dp', 'tp'))."
        )
    unknown = [n for n in names if n not in _USER_NAMES]
    if unknown or len(set(names)) != len(names) or ("dp" in names and "dp_shard" in names):
        raise ValueError(
            f"the mesh's dimensions {tuple(names)} are not tpkit's: name them among "
            f"{_USER_NAMES} (each once; 'dp' is dp_shard), tp innermost, e.g. "
            "mesh_dim_names=('dp_replicate', 'dp_shard', 'tp'); or build it with tpkit.build_mesh."
        )
    if "tp" in names and names[-1] != "tp":
        raise ValueError(f"the mesh's 'tp' dimension must be the innermost; got {tuple(names)}.")
    sizes = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}
    for i, n in enumerate(names):
        axis = ("dp_replicate" if sharded is False else "dp_shard") if n == "dp" else n
        sizes[axis] = mesh.size(i)
    return sizes


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
    """The TP dimension of a mesh: ``mesh["tp"]``, or the mesh itself when it is 1-D (unnamed,
    or named "tp"). A mesh without a "tp" dimension has tp=1: its TP group is each rank alone,
    so a 1-D mesh of size 1 stands for it."""
    if mesh.ndim == 1 and (mesh.mesh_dim_names is None or mesh.mesh_dim_names == ("tp",)):
        return mesh
    mesh_sizes(mesh)  # unknown names: the error that names tpkit's
    if "tp" in (mesh.mesh_dim_names or ()):
        return mesh["tp"]
    raise ValueError(
        f"the mesh {tuple(mesh.mesh_dim_names or ())} has no 'tp' dimension; add one (size 1 "
        "for data parallelism alone), innermost, e.g. mesh_dim_names=('dp_shard', 'tp')."
    )


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
