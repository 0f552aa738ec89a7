"""Expert parallelism applied: whole experts per rank of the EP mesh, tokens sent to them.

`expert_parallel` finds the routed experts modules (`tpkit.plan.expert_placement`), checks the
sizes (one `ValueError` on every rank, before any collective: `check_expert_sizes`) and applies
`tpkit.styles.expert.ExpertParallelStyle` to each on the EP mesh. ``batch_mesh`` is the group of
ranks that hold the same tokens (the TP group): its members send disjoint slices of the rows,
and where it spans the whole EP group (ep == tp) the all-reduce dispatch needs no token exchange.

Gradients: the expert weights a rank holds collect the pairs of every batch in its EP group
(ep / tp batches). Averaged over data-parallel replicas like every other weight, that is ep / tp
times the dense weights' share: `expert_grad_divisor` is the count to divide their summed
gradient by instead (FSDP2's gradient divide factor over the expert replicas).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from tpkit.parallel.expert_comm import ExpertPlacement
from tpkit.plan.expert_placement import ExpertEntry, expert_modules
from tpkit.styles.expert import IMPLEMENTATIONS, ExpertParallelStyle, GroupedExpertsStyle

__all__ = ["apply_expert_parallel", "check_expert_sizes", "expert_grad_divisor", "expert_parallel"]


def check_expert_sizes(
    model: nn.Module, entries: dict[str, ExpertEntry], ep: int, implementation: str = "auto"
) -> None:
    """Every size problem of an EP split as one ValueError: an expert count a rank would get
    none of (torch.chunk of E over ep leaves the last ranks empty), and experts stored as blocks
    of rows (``[E * F, H]``) that ep does not divide (a chunk would cut an expert)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"ep_implementation={implementation!r}: use one of {', '.join(IMPLEMENTATIONS)}."
        )
    problems = []
    for name, entry in entries.items():
        e = entry.num_experts
        sizes = ExpertPlacement(e, ep).sizes
        if min(sizes) == 0:
            fits = [d for d in range(1, e + 1) if min(ExpertPlacement(e, d).sizes) > 0]
            problems.append(
                f"{name}: {e} experts over ep={ep} gives ranks {sizes} experts (torch.chunk), "
                f"so a rank would hold none; use an ep_size among {fits}"
            )
            continue
        params = dict(model.get_submodule(name).named_parameters())
        blocks = [n for n in entry.params if params[n].shape[0] > e]
        if blocks and e % ep:
            problems.append(
                f"{name}: {blocks[0]} stores its {e} experts as blocks of rows; ep={ep} does not "
                f"divide {e}, so a rank's chunk would cut an expert; use an ep_size dividing {e}"
            )
    if problems:
        raise ValueError(
            "expert parallelism cannot place these experts:\n  " + "\n  ".join(problems)
        )


def expert_grad_divisor(dp: int, ep: int, tp: int) -> int:
    """What the expert weights' gradient, summed over their data-parallel replicas, is divided
    by so it equals the dense weights' average over dp: the number of distinct batches, dp
    (each expert replica already summed ep / tp of them through the dispatch)."""
    del ep, tp  # the replicas number dp * tp / ep; each holds ep / tp batches: dp in all
    return dp


def apply_expert_parallel(
    model: nn.Module,
    entries: dict[str, ExpertEntry],
    ep_mesh: DeviceMesh,
    *,
    batch_mesh: DeviceMesh | None = None,
    implementation: str = "auto",
) -> dict[str, ExpertParallelStyle]:
    """Apply `ExpertParallelStyle` on ``ep_mesh`` to each module of ``entries``; return module
    name -> its style. Checks the sizes first (`check_expert_sizes`)."""
    check_expert_sizes(model, entries, ep_mesh.size(), implementation)
    holders: dict[int, list[tuple[nn.Module, str]]] = {}  # parameters tied across modules
    for name in entries:
        for owner in model.get_submodule(name).modules():
            for pname, p in owner._parameters.items():
                if p is not None:
                    holders.setdefault(id(p), []).append((owner, pname))
    styles = {}
    for name, entry in entries.items():
        cls = ExpertParallelStyle if entry.kind == "routed" else GroupedExpertsStyle
        extra = {} if entry.kind == "routed" else {"blocks": entry.kind == "blocks"}
        style = cls(
            **extra,
            num_experts=entry.num_experts,
            params=entry.params,
            count_attrs=entry.count_attrs,
            implementation=implementation,
            batch_mesh=batch_mesh,
        )
        style.module_name = name
        parallelize_module(model.get_submodule(name), ep_mesh, style)
        styles[name] = style
    for tied in holders.values():  # each module made its own DTensor: share the first again
        first = tied[0][0]._parameters[tied[0][1]]
        for owner, pname in tied[1:]:
            owner._parameters[pname] = first
    return styles


def expert_parallel(
    model: nn.Module,
    ep_mesh: DeviceMesh,
    *,
    batch_mesh: DeviceMesh | None = None,
    implementation: str = "auto",
) -> dict[str, ExpertParallelStyle]:
    """Find ``model``'s routed experts modules and place them on ``ep_mesh``
    (`apply_expert_parallel`). A model with none is a ValueError naming what was found."""
    entries, notes = expert_modules(model)
    if not entries:
        said = "; ".join(f"{k}: {v}" for k, v in notes.items()) or "no module with an expert count"
        raise ValueError(f"{type(model).__name__} has no experts module EP can place ({said}).")
    return apply_expert_parallel(
        model, entries, ep_mesh, batch_mesh=batch_mesh, implementation=implementation
    )
