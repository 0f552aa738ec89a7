"""FSDP2 / HSDP over the data axes, after tensor parallelism over "tp" (torchtitan's order).

``fully_shard`` is applied to each unit of the FSDP plan (`tpkit.parallel.fsdp_plan`: the
model's own ``fsdp_plan`` where it has one, one unit per repeated block otherwise), innermost
first, then to the root, so each unit's parameters are gathered just before it runs and freed
after. The data mesh is dp_shard alone (FSDP) or (dp_replicate, dp_shard) (HSDP: each
parameter sharded within a replica and replicated across replicas; gradients reduce-scattered
within a replica and all-reduced across them; an (R, 1) mesh is plain replication, DDP's
numbers). Parameters that are already DTensors on the TP mesh become 2-D or 3-D DTensors
(``(Shard(0), <tp>)``, ``(Replicate(), Shard(0), <tp>)``); FSDP2 unshards them back to TP
DTensors for forward, which the styles' local compute then uses as usual. FSDP2's own settings
(`tpkit.state.FSDPOptions`) pass through: ``MixedPrecisionPolicy``, ``CPUOffloadPolicy``
(unpinned on a CPU mesh: pinning needs an accelerator), ``reshard_after_forward``.

With dp=1 there is no dimension to shard over and FSDP is not applied: what TP leaves replicated
(norm weights, row-parallel biases, routers) is a few thousandths of a transformer's parameters
(Llama-7B: 0.003%), not worth a ZeRO pass of its own.

One thing FSDP2 cannot take: a 1-D parameter TP already split in strided parts (a packed q|k|v
or gate|up bias). A second strided split on the same dim comes back scrambled (measured on
GPT-2's ``c_attn.bias``), so those stay out of FSDP, replicated over dp, their gradient averaged
over dp as it is produced (`average_over_dp`), and, with mixed precision, their modules compute
with a cast copy: a style option chosen before the styles are built (`strided_owners`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, Shard

from tpkit.compat import StridedShard
from tpkit.parallel.fsdp_plan import fsdp_units
from tpkit.plan import Plan, param_layouts
from tpkit.state import FSDPOptions

__all__ = [
    "apply_fsdp",
    "average_grads_over_dp",
    "average_over_dp",
    "is_fsdp",
    "mixed_precision",
    "offload_policy",
    "strided_1d",
    "strided_owners",
]


def is_fsdp(model: nn.Module) -> bool:
    """Whether FSDP2 manages any module of ``model``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def mixed_precision(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """bf16 (or fp16) parameters and compute, float32 gradient reductions."""
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def strided_1d(p: torch.Tensor) -> bool:
    """A 1-D parameter TP split in strided parts on its only dim (see the module docstring)."""
    return (
        isinstance(p, DTensor)
        and p.ndim == 1
        and any(isinstance(pl, StridedShard) for pl in p.placements)
    )


def strided_owners(model: nn.Module, plan: Plan) -> set[str]:
    """Names of the modules the plan gives a strided 1-D parameter (FSDP leaves those out)."""
    return {
        full.rpartition(".")[0]
        for full, (_, layout, module) in param_layouts(model, plan).items()
        if layout.split_factor > 1 and module._parameters[full.rpartition(".")[2]].ndim == 1
    }


def _shard_dim(p: nn.Parameter) -> Shard:
    """FSDP's dim: 0, unless TP already splits dim 0 in strided parts (then the next dim)."""
    if isinstance(p, DTensor):
        for pl in p.placements:
            if isinstance(pl, StridedShard) and pl.dim == 0 and p.ndim > 1:
                return Shard(1)
    return Shard(0)


def average_over_dp(grad: torch.Tensor, dp_mesh: DeviceMesh) -> torch.Tensor:
    """``grad`` (DTensor or plain) averaged over the dp ranks, in place on its local tensor
    (gloo has no AVG: a sum, then a division). ``dp_mesh`` may be HSDP's 2-D data mesh: a sum
    over each of its dimensions in turn is the sum over all its ranks. Returns ``grad``."""
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    for dim in range(dp_mesh.ndim):
        if dp_mesh.size(dim) > 1:
            dist.all_reduce(local, group=dp_mesh.get_group(dim))
    local.div_(dp_mesh.size())
    return grad


def _average_hook(dp_mesh: DeviceMesh):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        # a fresh tensor: autograd may still hold the one it passed to this hook
        grad = grad.clone() if not isinstance(grad, DTensor) else _clone_dtensor(grad)
        return average_over_dp(grad, dp_mesh)

    return hook


def average_grads_over_dp(params, dp_mesh: DeviceMesh) -> None:
    """Average the gradients of trainable ``params`` that FSDP2 does not manage over the dp
    group as they are produced (replicated over dp, like DDP): strided 1-D TP parameters, and
    adapters added after FSDP2 was applied. Registered once per parameter."""
    for p in params:
        # marked on the parameter itself: an id() could be reused by a later model's parameter
        if p.requires_grad and not getattr(p, "_tpkit_dp_averaged", False):
            p.register_hook(_average_hook(dp_mesh))
            p._tpkit_dp_averaged = True


def _clone_dtensor(grad: DTensor) -> DTensor:
    return DTensor.from_local(
        grad.to_local().contiguous().clone(),
        grad.device_mesh,
        grad.placements,
        run_check=False,
        shape=grad.shape,
        stride=grad.stride(),
    )


def offload_policy(cpu_offload: bool, device_type: str) -> OffloadPolicy:
    """torch's ``CPUOffloadPolicy`` when asked (parameters, gradients and the optimizer step on
    the CPU), pinned only where there is an accelerator to copy to; else no offload."""
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type != "cpu")


def apply_fsdp(
    model: nn.Module, dp_mesh: DeviceMesh, options: FSDPOptions | None = None
) -> nn.Module:
    """``fully_shard`` each unit of the FSDP plan (innermost first), then the root, over
    ``dp_mesh`` (1-D: FSDP; 2-D (dp_replicate, dp_shard): HSDP), with ``options``' policies.

    The strided 1-D TP parameters stay out of FSDP (module docstring); a trainable one gets its
    gradient averaged over dp by a hook as it is produced.
    """
    options = options or FSDPOptions()
    # and parameters whose dp averaging another step installed (expert weights under expert
    # parallelism: `tpkit.parallel.expert.apply.expert_data_parallel`)
    ignored = {
        p for p in model.parameters() if strided_1d(p) or getattr(p, "_tpkit_dp_averaged", False)
    }
    average_grads_over_dp(ignored, dp_mesh)  # a frozen base (PEFT) has nothing to average
    kwargs = dict(
        mesh=dp_mesh,
        mp_policy=options.mixed_precision or MixedPrecisionPolicy(),
        offload_policy=offload_policy(options.cpu_offload, dp_mesh.device_type),
        shard_placement_fn=_shard_dim,
        ignored_params=ignored or None,
    )
    every = options.reshard_after_forward
    for unit in fsdp_units(model, options.plan, ignored):
        fully_shard(unit.module, reshard_after_forward=False if unit.keep else every, **kwargs)
    fully_shard(model, reshard_after_forward=every, **kwargs)
    if callable(getattr(model, "generate", None)):
        # generate() calls submodules (an encoder) outside the root's forward: unshard for it too
        register_fsdp_forward_method(model, "generate")
    return model
