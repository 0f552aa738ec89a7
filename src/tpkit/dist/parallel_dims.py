"""`ParallelDims`: the sizes of one tensor-parallel run, checked when they are made.

Like torchtitan's ``ParallelDims``: tp, dp, the world and this rank's device in one small frozen
dataclass that validates itself on construction, so every size problem is one clear error on
every rank, before any process group exists. `ParallelDims.resolve` fills what the caller left
out (tp from the world size, dp from tp, the device from ``device_ids`` or the local rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from tpkit import config
from tpkit.dist.mesh import DistEnv, default_device_type, dist_env, tp_submesh

__all__ = ["ParallelDims", "launch_hint"]


def launch_hint(n: int) -> str:
    return (
        f"Tensor parallelism runs one process per rank. Launch {n} ranks with\n"
        f"    torchrun --nproc-per-node {n} your_script.py\n"
        f"or from Python / a notebook: tpkit.launch(fn, nproc={n}), or\n"
        f"tensor_parallel(model, tp_size={n}) for a live model on worker processes."
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_int(name: str, value: object) -> None:
    """``tp_size="2"`` or ``2.0`` would fail deep inside mesh arithmetic: refuse it here."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        try:
            whole = float(value) == int(float(value))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            whole = False
        fix = f"pass {name}={int(float(value))}" if whole else "pass a whole number"  # type: ignore[arg-type]
        raise TypeError(
            f"{name} must be an int or None, got {value!r} ({type(value).__name__}); {fix}."
        )
    if value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}.")


@dataclass(frozen=True)
class ParallelDims:
    """tp x dp = world ranks; ``device``: this rank's device; ``env``: what torchrun said."""

    tp: int
    dp: int
    world: int
    device_type: str
    device: torch.device
    env: DistEnv

    def __post_init__(self) -> None:
        if self.world % self.tp:
            raise ValueError(
                f"tp_size={self.tp} does not divide the world size {self.world}; use a tp_size "
                f"among {_divisors(self.world)} or launch {self.tp * max(1, self.world // self.tp)} "
                "ranks."
            )
        if self.tp * self.dp != self.world:
            raise ValueError(
                f"dp_size={self.dp} x tp_size={self.tp} = {self.tp * self.dp} ranks, but the world "
                f"size is {self.world}; launch {self.tp * self.dp} ranks or set "
                f"dp_size={self.world // self.tp}."
            )

    @property
    def single_process(self) -> bool:
        return self.world == 1

    @classmethod
    def resolve(
        cls,
        tp_size: int | None = None,
        dp_size: int | None = None,
        *,
        mesh: DeviceMesh | None = None,
        device_ids: Sequence[str | int | torch.device] | None = None,
        env: DistEnv | None = None,
    ) -> ParallelDims:
        """The run's sizes from the arguments, the mesh (when given) and torchrun's environment.

        One process (no torchrun) asking for more than one rank is an error that shows the
        torchrun command; so is a ``device_ids`` list shorter than the ranks on this node.
        """
        _check_int("tp_size", tp_size)
        _check_int("dp_size", dp_size)
        env = env or dist_env()
        if mesh is not None:
            tp = tp_submesh(mesh).size()
            dp = mesh.size() // tp
            if tp_size not in (None, tp) or dp_size not in (None, dp):
                raise ValueError(
                    f"tp_size={tp_size}, dp_size={dp_size} disagree with the mesh (tp={tp}, dp={dp})."
                )
            device_type, world = mesh.device_type, mesh.size()
        elif not env.is_distributed:
            distinct = {str(d) for d in device_ids or ()}
            if len(distinct) > 1:
                raise RuntimeError(
                    f"device_ids={list(device_ids or ())} asks for {len(distinct)} devices, but "
                    "this is a single process. " + launch_hint(len(distinct))
                )
            n = (tp_size or 1) * (dp_size or 1)
            if n > 1:
                raise ValueError(
                    f"tp_size={tp_size or 1} x dp_size={dp_size or 1} needs {n} processes. "
                    + launch_hint(n)
                )
            device = torch.device(device_ids[0]) if device_ids else torch.device("cpu")
            return cls(1, 1, 1, device.type, device, env)
        else:
            world, device_type = env.world_size, default_device_type()
            tp = tp_size if tp_size is not None else world // (dp_size or 1)
            if tp < 1 or world % tp:
                tp = tp_size or world  # let __post_init__ name the numbers
            dp = dp_size if dp_size is not None else max(1, world // tp)
        device = _pick_device(device_ids, env.local_rank, device_type)
        return cls(tp, dp, world, device_type, device, env)


def _pick_device(device_ids: Sequence | None, local_rank: int, device_type: str) -> torch.device:
    if device_ids:
        # every rank of the node checks against the node's rank count, so all raise alike
        local_world = config.local_world_size(default=local_rank + 1)
        if max(local_rank + 1, local_world) > len(device_ids):
            raise ValueError(
                f"device_ids has {len(device_ids)} entries but this node runs {local_world} "
                "ranks; give one device per rank on this node, or leave device_ids unset."
            )
        return torch.device(device_ids[local_rank])
    if device_type == "cuda":
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device(device_type)
