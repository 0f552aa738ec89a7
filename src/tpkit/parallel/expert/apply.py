"""Expert parallelism applied: whole experts per rank of the EP mesh, tokens sent to them.

`split` calls, in mesh order after the tensor step, `apply_expert_parallel`: each module the
plan gives an EP style (``ep_experts`` / ``ep_grouped_experts``: `tpkit.sources.expert_placement`
found them, `tpkit.sources.expert_placement.check_expert_sizes` checked them before any
collective) gets its style on the EP dimension of the expert mesh
(`tpkit.parallel.mesh.build_expert_mesh`). ``batch_mesh`` is the group of ranks that hold the
same tokens (the TP group): its members send disjoint slices of the rows, and where it spans
the whole EP group (ep == tp) the all-reduce dispatch needs no token exchange.

Gradients: the expert weights a rank holds collect the pairs of every batch of its EP group
(ep / batch group of them); the style scales their gradient by batch group / ep, so it is those
batches' average, as a dense weight's is its one batch's. The expert weights are then ordinary
data-parallel replicas over the efsdp x dp_replicate ranks that hold the same experts
(`expert_data_parallel`): FSDP2 over them (averaging, as over dp for the dense weights:
torchtitan's and transformers' expert FSDP), or, without FSDP, a hook that averages the gradient
over them. Either way each equals the average over all dp batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from tpkit.parallel.fsdp import mixed_precision
from tpkit.plan.spec import Plan
from tpkit.sources.expert_placement import check_expert_sizes, expert_targets, place_experts
from tpkit.styles import make_style
from tpkit.styles.expert import IMPLEMENTATIONS, ExpertParallelStyle

__all__ = [
    "EXPERT_MARK",
    "apply_expert_parallel",
    "expert_data_parallel",
    "expert_parallel",
    "expert_styles",
]

#: set on each parameter an experts module holds under EP: the dense FSDP leaves it out and
#: the Trainer's dp sync too (`expert_data_parallel` averages it over its own replicas)
EXPERT_MARK = "_tpkit_expert"


def apply_expert_parallel(
    model: nn.Module,
    plan: Plan,
    ep_mesh: DeviceMesh,
    *,
    batch_mesh: DeviceMesh | None = None,
    implementation: str = "auto",
) -> dict[str, ExpertParallelStyle]:
    """Apply each EP style of ``plan`` on ``ep_mesh``; return module name -> its style.
    Parameters tied across experts modules (DiffusionGemma's encoder and decoder experts) stay
    one parameter. The sizes are checked first (`check_expert_sizes`)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"ep_implementation={implementation!r}: use one of {', '.join(IMPLEMENTATIONS)}."
        )
    targets = expert_targets(model, plan)
    check_expert_sizes(model, plan, ep_mesh.size())
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for name in targets:
        for owner in model.get_submodule(name).modules():
            for pname, p in owner._parameters.items():
                if p is not None:
                    holders.setdefault(id(p), []).append((owner, pname))
    batch = batch_mesh.size() if batch_mesh is not None else 1
    runtime = {
        "implementation": implementation,
        "batch_mesh": batch_mesh,
        "grad_scale": batch / ep_mesh.size(),  # the EP group's batches averaged
    }
    styles = {}
    for name, (style_name, args) in targets.items():
        style = make_style(style_name, **args, **runtime)
        style.module_name = name
        parallelize_module(model.get_submodule(name), ep_mesh, style)
        styles[name] = style
    for tied in holders.values():  # each module made its own DTensor: share the first again
        first = tied[0][0]._parameters[tied[0][1]]
        for owner, pname in tied[1:]:
            owner._parameters[pname] = first
    for name in targets:
        for p in model.get_submodule(name).parameters():
            setattr(p, EXPERT_MARK, True)
    return styles


def expert_parallel(
    model: nn.Module,
    ep_mesh: DeviceMesh,
    *,
    batch_mesh: DeviceMesh | None = None,
    implementation: str = "auto",
) -> dict[str, ExpertParallelStyle]:
    """Expert parallelism alone, on a mesh of the caller's: ``model``'s experts modules found
    (`tpkit.sources.expert_placement.place_experts`) and placed on ``ep_mesh``
    (`apply_expert_parallel`); the rest of the model is left as it is. A model with none is a
    ValueError naming what was found. `tpkit.tensor_parallel` with ``ep_size`` does this as
    one step of its split."""
    from tpkit.sources.expert_placement import expert_modules

    entries, notes = expert_modules(model)
    if not entries:
        said = "; ".join(f"{k}: {v}" for k, v in notes.items()) or "no module with an expert count"
        raise ValueError(f"{type(model).__name__} has no experts module EP can place ({said}).")
    plan = place_experts(model, Plan(), entries)
    return apply_expert_parallel(
        model, plan, ep_mesh, batch_mesh=batch_mesh, implementation=implementation
    )


def expert_styles(model: nn.Module) -> dict[str, ExpertParallelStyle]:
    """Module name -> EP style of every experts module of ``model`` under expert parallelism."""
    from tpkit.styles import style_of

    return {
        n: s for n, m in model.named_modules() if isinstance(s := style_of(m), ExpertParallelStyle)
    }


def expert_data_parallel(
    model: nn.Module,
    expert_mesh: DeviceMesh,
    *,
    fsdp: bool,
    param_dtype: torch.dtype | None = None,
) -> None:
    """The expert weights' data parallelism (module docstring) over their replicas, the
    ``("dp_replicate", "efsdp")`` dims of ``expert_mesh`` of size > 1: FSDP2 (HSDP over both)
    when ``fsdp``, else a hook on each expert parameter that averages its gradient over them
    (DDP's arithmetic). Nothing without replicas. Either way the parameters are marked
    ``_tpkit_dp_averaged``, so the dense FSDP (run after this) and the Trainer's dp sync leave
    them to it."""
    from torch.distributed.fsdp import fully_shard

    names = tuple(n for n in ("dp_replicate", "efsdp") if expert_mesh[n].size() > 1)
    styles = expert_styles(model)
    params = {id(p): p for n in styles for p in model.get_submodule(n).parameters()}
    for p in params.values():
        p._tpkit_dp_averaged = True
    if not names:
        return
    replicas = expert_mesh[names] if len(names) > 1 else expert_mesh[names[0]]
    if fsdp:
        policy = mixed_precision(param_dtype)
        for name in styles:
            fully_shard(model.get_submodule(name), mesh=replicas, mp_policy=policy)
        return
    flat = replicas._flatten() if replicas.ndim > 1 else replicas
    for p in params.values():
        if p.requires_grad:
            p.register_hook(_average_hook(flat.get_group(), flat.size()))


def _average_hook(group, size: int):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local = local.clone()
        dist.all_reduce(local, group=group)
        local.div_(size)
        if isinstance(grad, DTensor):
            return DTensor.from_local(
                local, grad.device_mesh, grad.placements, run_check=False,
                shape=grad.shape, stride=grad.stride(),
            )  # fmt: skip
        return local

    return hook
