"""`ParallelDims`: the sizes of one run, on named axes, checked once when they are made.

Like torchtitan's ``ParallelDims``: one small frozen dataclass of sizes that validates itself on
construction, so every size problem is one clear error on every rank, before any process group
exists, and the one place that multiplies sizes. The axes, outermost first (tp innermost, so a
TP group is contiguous ranks on one node; dp_replicate outermost, so it is the one to span nodes):

    dp_replicate   data-parallel replicas (HSDP: parameters replicated, gradients all-reduced)
    dp_shard       data parallelism with FSDP2 (parameters and gradients sharded)
    cp             context parallelism (the sequence split; parameters as dp_shard sees them)
    tp             tensor parallelism (weights split)
    ep             expert parallelism: not an axis of its own but carved out of dp_shard x tp
                   (transformers' convention: a multiple of tp dividing dp_shard x tp)
    pp             reserved: refused by name

dp_replicate x dp_shard x cp x tp = the world. Every spelling a user may bring is read here
(`ParallelDims.resolve`): tpkit's keywords (``tp_size``, ``dp_size``, ``dp_replicate_size``,
``dp_shard_size``, ``cp_size``, ``ep_size``), a transformers ``DistributedConfig`` or an
accelerate ``ParallelismConfig`` (`sizes_of`), a user's named ``DeviceMesh``, and the pool's
worker count (`ParallelDims.sizes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from tpkit import config
from tpkit.parallel.mesh import AXES, DistEnv, default_device_type, dist_env, mesh_sizes

__all__ = ["SIZE_KEYWORDS", "ParallelDims", "launch_hint", "sizes_of"]

#: tpkit's size keywords, as transformers and accelerate spell them (``dp_size`` kept: the
#: data-parallel ranks, FSDP-sharded unless ``sharded=False``)
SIZE_KEYWORDS = ("tp_size", "dp_size", "dp_replicate_size", "dp_shard_size", "cp_size", "ep_size")


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


def sizes_of(parallel_config: Any) -> dict[str, int]:
    """The size keywords a transformers ``DistributedConfig`` or an accelerate
    ``ParallelismConfig`` stands for (the fields it sets, as tpkit spells them), so either can
    be passed as it is. ``pp_size`` > 1 is refused by name: tpkit has no pipeline stages."""
    get = lambda name: getattr(parallel_config, name, None)  # noqa: E731
    pp = get("pp_size")
    if pp not in (None, 1):
        raise ValueError(
            f"{type(parallel_config).__name__}(pp_size={pp}): tpkit has no pipeline "
            "parallelism; use tp_size, dp_replicate_size, dp_shard_size (fsdp_size), cp_size and "
            "ep_size, whose product is the world size."
        )
    if get("sp_size") not in (None, 1):
        raise ValueError(
            f"{type(parallel_config).__name__}(sp_size={get('sp_size')}): tpkit runs Ulysses "
            "sequence parallelism as a kind of context parallelism; pass cp_size (with "
            "cp_attention='ulysses') instead."
        )
    names = {
        "tp_size": "tp_size",
        "dp_replicate_size": "dp_replicate_size",
        "dp_shard_size": "dp_shard_size",
        "fsdp_size": "dp_shard_size",  # transformers' DistributedConfig
        "cp_size": "cp_size",
        "ep_size": "ep_size",
    }
    out: dict[str, int] = {}
    for field, keyword in names.items():
        value = get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            out[keyword] = value
    if get("enable_expert_parallel") and "ep_size" not in out and "tp_size" in out:
        out["ep_size"] = out["tp_size"]  # transformers' side effect of tp_size with EP on
    return out


@dataclass(frozen=True)
class ParallelDims:
    """dp_replicate x dp_shard x cp x tp = world ranks (``ep`` carved out of dp_shard x tp);
    ``device``: this rank's device; ``env``: what torchrun said."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    world: int
    device_type: str
    device: torch.device
    env: DistEnv

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "ep"):
            _check_int(f"{name}_size", getattr(self, name))
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp
        if self.world % self.tp:
            raise ValueError(
                f"tp_size={self.tp} does not divide the world size {self.world}; use a tp_size "
                f"among {_divisors(self.world)} or launch {self.tp * max(1, self.world // self.tp)} "
                "ranks."
            )
        if product != self.world:
            raise ValueError(
                f"{self._spelled()} = {product} ranks, but the world size is {self.world}; "
                f"launch {product} ranks, or choose sizes whose product is {self.world} "
                f"(e.g. dp_shard_size={self._fill()})."
            )
        if self.ep > 1 and (self.ep % self.tp or (self.dp_shard * self.tp) % self.ep):
            raise ValueError(
                f"ep_size={self.ep} must be a multiple of tp_size={self.tp} and divide "
                f"dp_shard_size x tp_size = {self.dp_shard * self.tp} (experts are placed over "
                "ranks that split the data or the weights, as transformers' DistributedConfig "
                f"requires); use an ep_size among "
                f"{[d for d in _divisors(self.dp_shard * self.tp) if d % self.tp == 0]}."
            )

    def _spelled(self) -> str:
        parts = [
            f"{name}_size={getattr(self, name)}"
            for name in AXES
            if getattr(self, name) > 1 or name == "tp"
        ]
        return " x ".join(parts)

    def _fill(self) -> int:
        rest = self.dp_replicate * self.cp * self.tp
        return max(1, self.world // rest) if self.world % rest == 0 else 1

    # -- what is on ---------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel ranks: each sees its own batch (replicas x shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def single_process(self) -> bool:
        return self.world == 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def shape(self) -> dict[str, int]:
        """Every axis's size, outermost first (the world mesh's layout)."""
        return {name: getattr(self, name) for name in AXES}

    # -- resolution ---------------------------------------------------------------------------
    @staticmethod
    def sizes(
        world: int,
        *,
        tp_size: int | None = None,
        dp_size: int | None = None,
        dp_replicate_size: int | None = None,
        dp_shard_size: int | None = None,
        cp_size: int | None = None,
        ep_size: int | None = None,
        sharded: bool | None = None,
    ) -> dict[str, int]:
        """Every axis's size for ``world`` ranks from the sizes given, the rest filled in: tp
        takes what the others leave (the whole world by default), dp_shard what tp and the
        others leave. ``dp_size`` is dp_replicate x dp_shard; alone it means dp_shard (FSDP2),
        or dp_replicate with ``sharded=False`` (plain replicas). Pure: the pool uses it too.
        Sizes that cannot make ``world`` are left for the caller's checks to name."""
        for name, value in (
            ("tp_size", tp_size),
            ("dp_size", dp_size),
            ("dp_replicate_size", dp_replicate_size),
            ("dp_shard_size", dp_shard_size),
            ("cp_size", cp_size),
            ("ep_size", ep_size),
        ):
            _check_int(name, value)
        rep, shard = dp_replicate_size, dp_shard_size
        if dp_size is not None:
            if rep is None and shard is None:
                rep, shard = (dp_size, 1) if sharded is False else (1, dp_size)
            elif (rep or 1) * (shard or 1) != dp_size and rep is not None and shard is not None:
                raise ValueError(
                    f"dp_size={dp_size} is dp_replicate_size x dp_shard_size, but those are "
                    f"{rep} x {shard} = {rep * shard}; pass one spelling or make them agree."
                )
            elif rep is None:
                rep = dp_size // shard if dp_size % shard == 0 else dp_size
            elif shard is None:
                shard = dp_size // rep if dp_size % rep == 0 else dp_size
        cp = cp_size or 1
        if tp_size is None:  # what the others leave; 1 where they cannot make the world (the
            known = (rep or 1) * (shard or 1) * cp  # error then names the sizes given, not a tp)
            tp = world // known if world % known == 0 else 1
        else:
            tp = tp_size
        if shard is None:
            rest = (rep or 1) * cp * tp
            shard = world // rest if rest and world % rest == 0 else 1
        return {
            "dp_replicate": rep or 1,
            "dp_shard": shard,
            "cp": cp,
            "tp": tp,
            "ep": ep_size or 1,
        }

    @classmethod
    def resolve(
        cls,
        tp_size: int | None = None,
        dp_size: int | None = None,
        *,
        dp_replicate_size: int | None = None,
        dp_shard_size: int | None = None,
        cp_size: int | None = None,
        ep_size: int | None = None,
        sharded: bool | None = None,
        distributed_config: Any = None,
        mesh: DeviceMesh | None = None,
        device_ids: Sequence[str | int | torch.device] | None = None,
        env: DistEnv | None = None,
    ) -> ParallelDims:
        """The run's sizes from the arguments, a ``DistributedConfig`` / ``ParallelismConfig``,
        the mesh (when given) and torchrun's environment.

        One process (no torchrun) asking for more than one rank is an error that shows the
        torchrun command; so is a ``device_ids`` list shorter than the ranks on this node.
        """
        given = dict(
            tp_size=tp_size,
            dp_size=dp_size,
            dp_replicate_size=dp_replicate_size,
            dp_shard_size=dp_shard_size,
            cp_size=cp_size,
            ep_size=ep_size,
        )
        for name, value in given.items():
            _check_int(name, value)
        if distributed_config is not None:
            given = _merge_config(given, sizes_of(distributed_config), distributed_config)
        env = env or dist_env()
        if mesh is not None:
            sizes = _mesh_sizes(mesh, given, sharded)
            device = _pick_device(device_ids, env.local_rank, mesh.device_type)
            return cls(**sizes, world=mesh.size(), device_type=mesh.device_type, device=device,
                       env=env)  # fmt: skip
        if not env.is_distributed:
            distinct = {str(d) for d in device_ids or ()}
            if len(distinct) > 1:
                raise RuntimeError(
                    f"device_ids={list(device_ids or ())} asks for {len(distinct)} devices, but "
                    "this is a single process. " + launch_hint(len(distinct))
                )
            n = 1
            for key in ("tp_size", "dp_replicate_size", "dp_shard_size", "cp_size"):
                n *= given[key] or 1
            if given["dp_replicate_size"] is None and given["dp_shard_size"] is None:
                n *= given["dp_size"] or 1
            n = max(n, given["ep_size"] or 1)  # ep ranks at least (carved out of dp_shard x tp)
            if n > 1:
                asked = " x ".join(f"{k}={v}" for k, v in given.items() if v and k != "ep_size")
                raise ValueError(f"{asked} needs {n} processes. " + launch_hint(n))
            device = torch.device(device_ids[0]) if device_ids else torch.device("cpu")
            return cls(1, 1, 1, 1, given["ep_size"] or 1, 1, device.type, device, env)
        device_type = default_device_type()
        sizes = cls.sizes(env.world_size, sharded=sharded, **given)
        device = _pick_device(device_ids, env.local_rank, device_type)
        return cls(**sizes, world=env.world_size, device_type=device_type, device=device, env=env)


def _merge_config(given: dict, from_config: Mapping[str, int], cfg: Any) -> dict:
    """The keywords with the config's sizes added; a keyword that says otherwise is an error."""
    out = dict(given)
    for key, value in from_config.items():
        if out.get(key) not in (None, value):
            raise ValueError(
                f"{key}={out[key]} disagrees with {type(cfg).__name__}'s {key}={value}; pass the "
                "sizes once, in the keywords or in the config."
            )
        out[key] = value
    return out


def _mesh_sizes(mesh: DeviceMesh, given: dict, sharded: bool | None) -> dict[str, int]:
    """Each axis's size from a user's mesh (`tpkit.parallel.mesh.mesh_sizes` names what it
    accepts); the size keywords, when given too, must agree with it."""
    sizes = mesh_sizes(mesh, sharded)
    sizes["ep"] = given["ep_size"] or 1
    dp = sizes["dp_replicate"] * sizes["dp_shard"]
    asked = {
        "tp_size": sizes["tp"],
        "dp_size": dp,
        "dp_replicate_size": sizes["dp_replicate"],
        "dp_shard_size": sizes["dp_shard"],
        "cp_size": sizes["cp"],
    }
    wrong = {k: v for k, v in asked.items() if given[k] not in (None, v)}
    if wrong:
        said = ", ".join(f"{k}={given[k]}" for k in wrong)
        has = ", ".join(f"{k}={v}" for k, v in asked.items() if v > 1 or k == "tp_size")
        raise ValueError(f"{said} disagree with the mesh ({has}); pass the mesh alone.")
    return sizes


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
