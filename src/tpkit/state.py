"""What a split carries: the options it was asked for (`TPOptions`) and what it left on the
model (`TPState`, ``model._tpkit``), and the one walk through wrappers that finds it.

Its own module so that every room that needs these (the split, `from_pretrained`, the
extensions, the integrations, the pool) imports them from below, and nothing imports the
split itself to read a model's state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from tpkit.parallel.dims import ParallelDims
from tpkit.plan.spec import Plan

__all__ = ["FSDPOptions", "TPOptions", "TPState", "tp_state", "wrapper_chain"]

#: a plan argument: a mode ("auto", "config", "infer"), a YAML path, a mapping or a Plan
PlanArg = Any


@dataclass(frozen=True)
class FSDPOptions:
    """FSDP2's own settings for the data axes, as `tpkit.parallel.fsdp.apply_fsdp` takes them:
    torch's ``MixedPrecisionPolicy``, CPU offload (torch's ``CPUOffloadPolicy``),
    ``reshard_after_forward`` and a per-module plan (transformers' ``fsdp_plan``: module
    pattern -> ``"free_full_weight"`` / ``"keep_full_weight"``; None: the model's own plan where
    it has one, else one unit per repeated block)."""

    mixed_precision: MixedPrecisionPolicy | None = None
    cpu_offload: bool = False
    reshard_after_forward: bool | int = True
    plan: Mapping[str, str] | None = None

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype parameters are gathered and computed in (None: their own)."""
        return self.mixed_precision.param_dtype if self.mixed_precision is not None else None

    @property
    def asked(self) -> list[str]:
        """The settings that differ from FSDP2's defaults, spelled as keywords (for errors)."""
        out = []
        if self.mixed_precision is not None:
            out.append(f"mixed_precision={self.mixed_precision}")
        if self.cpu_offload:
            out.append("cpu_offload=True")
        if self.reshard_after_forward is not True:
            out.append(f"reshard_after_forward={self.reshard_after_forward!r}")
        if self.plan is not None:
            out.append(f"fsdp_plan={dict(self.plan)!r}")
        return out


@dataclass(frozen=True)
class TPOptions:
    """`tensor_parallel`'s keyword arguments as one value, for the callers that pass them on
    (`tpkit.parallelize.split`, `tpkit.from_pretrained`, the PEFT integration, the pool); the
    meaning of each is in `tpkit.tensor_parallel`'s docstring."""

    tp_size: int | None = None
    dp_size: int | None = None
    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    cp_size: int | None = None
    #: context parallelism's attention: "auto", "allgather", "ring" or "ulysses"
    cp_attention: str = "auto"
    ep_size: int | None = None
    #: how routed pairs reach their experts under expert parallelism (transformers' spelling):
    #: "auto", "all_to_all" or "all_reduce" (`tpkit.styles.expert.IMPLEMENTATIONS`)
    ep_implementation: str | None = None
    #: experts modules named for expert parallelism beside those the model's own
    #: ``base_model_ep_plan`` names, in transformers' format (``{"layers.*.mlp.experts":
    #: "ep_dispatch_experts", ...}``; parameter entries are implied by the module's)
    ep_plan: Mapping[str, str] | None = None
    distributed_config: Any = None
    plan: PlanArg = "auto"
    mesh: DeviceMesh | None = None
    sharded: bool | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False
    param_dtype: torch.dtype | None = None
    mixed_precision: MixedPrecisionPolicy | None = None
    cpu_offload: bool = False
    reshard_after_forward: bool | int = True
    fsdp_plan: Mapping[str, str] | None = None
    example_inputs: tuple | Mapping | None = None
    fill_later: bool = False

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> TPOptions:
        """From keyword arguments, naming the valid ones for a typo."""
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            valid = ", ".join(f.name for f in fields(cls))
            raise TypeError(f"unknown tensor_parallel option(s) {unknown}; valid: {valid}.")
        return cls(**options)

    def dims(self, device_ids=None) -> ParallelDims:
        """The run's sizes these options ask for, resolved against the world (checked)."""
        return ParallelDims.resolve(
            self.tp_size,
            self.dp_size,
            dp_replicate_size=self.dp_replicate_size,
            dp_shard_size=self.dp_shard_size,
            cp_size=self.cp_size,
            ep_size=self.ep_size,
            sharded=self.sharded,
            distributed_config=self.distributed_config,
            mesh=self.mesh,
            device_ids=device_ids,
        )

    def fsdp(self) -> FSDPOptions:
        """FSDP2's settings these options ask for: the keywords, and a transformers
        ``DistributedConfig``'s ``fsdp_plan`` / ``fsdp_cpu_offload`` / ``fsdp_mixed_precision``
        (bf16 parameters, float32 reductions, as transformers builds it). ``param_dtype`` is
        ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)``; a setting given twice
        with different values is a ValueError."""
        cfg = self.distributed_config
        get = lambda name, default: getattr(cfg, name, default)  # noqa: E731
        policies = []
        if self.param_dtype is not None:
            policies.append(("param_dtype", _policy(self.param_dtype)))
        if self.mixed_precision is not None:
            policies.append(("mixed_precision", self.mixed_precision))
        if get("fsdp_mixed_precision", False):
            policies.append(("distributed_config.fsdp_mixed_precision", _policy(torch.bfloat16)))
        if len({p for _, p in policies}) > 1:
            said = ", ".join(f"{name} ({p})" for name, p in policies)
            raise ValueError(f"{said} disagree; give FSDP2's mixed precision once.")
        plan, cfg_plan = self.fsdp_plan, get("fsdp_plan", None)
        if plan is not None and cfg_plan is not None and dict(plan) != dict(cfg_plan):
            raise ValueError(
                f"fsdp_plan={dict(plan)!r} disagrees with the distributed_config's "
                f"fsdp_plan={dict(cfg_plan)!r}; give it once."
            )
        return FSDPOptions(
            mixed_precision=policies[0][1] if policies else None,
            cpu_offload=bool(self.cpu_offload or get("fsdp_cpu_offload", False)),
            reshard_after_forward=self.reshard_after_forward,
            plan=plan if plan is not None else cfg_plan,
        )


def _policy(param_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """``param_dtype``'s policy: parameters and compute in it, gradient reductions in float32."""
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


@dataclass
class TPState:
    """What tpkit attached to a parallelized model (``model._tpkit``)."""

    #: the world mesh (`tpkit.parallel.mesh.get_mesh` reads its axes) and its TP dimension
    mesh: DeviceMesh
    tp_mesh: DeviceMesh
    plan: Plan
    dims: ParallelDims
    #: FSDP2 / HSDP still to apply, with its settings, when `split` left it for later
    pending_fsdp: FSDPOptions | None = None
    #: how the weights arrived: "" (the model's own), "slices" or "transformers" (from_pretrained)
    loaded_from: str = ""
    #: the expert mesh ``("dp_replicate", "efsdp", "ep")`` when experts are placed by expert
    #: parallelism (`tpkit.parallel.mesh.build_expert_mesh`), else None
    expert_mesh: DeviceMesh | None = None

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (dp_replicate x dp_shard): each sees its own batch."""
        return self.dims.dp


def wrapper_chain(model: object, depth: int = 6) -> list:
    """``model`` and each wrapper inside it, outermost first, down to the module tpkit split (the
    one holding a `TPState`) or the innermost wrapper: accelerate's / DDP's ``module``,
    torch.compile's ``_orig_mod``, a PEFT model's base. The one walk through wrappers: `tp_state`
    reads the last link, the Trainer integration marks every link."""
    chain = []
    for _ in range(depth):
        if model is None:
            break
        chain.append(model)
        if isinstance(getattr(model, "_tpkit", None), TPState):
            break
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None and hasattr(model, "get_base_model"):
            try:
                inner = model.get_base_model()
            except Exception:  # noqa: BLE001 - a wrapper mid-construction
                inner = None
        if inner is model:
            break
        model = inner
    return chain


def tp_state(model: object) -> TPState | None:
    """The `TPState` tpkit attached to ``model``, looking through wrappers (`wrapper_chain`),
    or None for any other."""
    chain = wrapper_chain(model)
    state = getattr(chain[-1], "_tpkit", None) if chain else None
    return state if isinstance(state, TPState) else None
