"""Expert parallelism (EP, issue 42): whole experts of every MoE layer placed on the ranks of an
expert-parallel group, each routed (token, expert) pair computed where its expert lives. One
folder, one concern per file:

    apply.py   the model's side: each experts module the plan places gets its EP style on the
               EP mesh (`apply_expert_parallel`); expert weights averaged over the ranks that
               hold the same experts, by FSDP2 or a hook (`expert_data_parallel`)
    comm.py    the collectives, autograd-exact: pairs to their experts' ranks and back
               (all-to-all), or each rank its own experts' pairs and one all-reduce where the
               EP group holds one batch; rows grouped by expert in blocks. Part of the parallel
               runtime (it knows nothing of plans or models): `tpkit.styles.expert` imports it

The rest of EP lives in the rooms its layer puts it in: which experts modules EP places, found
by a probe (`tpkit.sources.expert_placement`, the analysis); the ``ep_experts`` style that
rewrites a call into this rank's pairs (`tpkit.styles.expert`); the expert mesh
(`tpkit.parallel.mesh.build_expert_mesh`); a rank's own experts read from a checkpoint
(`tpkit.io.expert_stream`).

The names are re-exported lazily: `comm.py` sits under `tpkit.styles`, and `apply.py` above it,
so importing ``apply`` here eagerly would make ``tpkit.styles.expert -> tpkit.parallel.expert
-> apply -> tpkit.styles.expert`` a circle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names, for readers and type checkers; loaded on first use below
    from tpkit.parallel.expert.apply import (
        EXPERT_MARK,
        apply_expert_parallel,
        expert_data_parallel,
        expert_parallel,
        expert_styles,
    )
    from tpkit.parallel.expert.comm import (
        AllReduceDispatch,
        AllToAllDispatch,
        ExpertPlacement,
        GroupedAllGather,
        GroupedAllToAll,
    )

__all__ = [
    "AllReduceDispatch",
    "AllToAllDispatch",
    "EXPERT_MARK",
    "ExpertPlacement",
    "GroupedAllGather",
    "GroupedAllToAll",
    "apply_expert_parallel",
    "expert_data_parallel",
    "expert_parallel",
    "expert_styles",
]

_WHERE = {
    "AllReduceDispatch": "comm",
    "AllToAllDispatch": "comm",
    "ExpertPlacement": "comm",
    "GroupedAllGather": "comm",
    "GroupedAllToAll": "comm",
    "EXPERT_MARK": "apply",
    "apply_expert_parallel": "apply",
    "expert_data_parallel": "apply",
    "expert_parallel": "apply",
    "expert_styles": "apply",
}


def __getattr__(name: str) -> Any:
    """``from tpkit.parallel.expert import X``: X from its module, imported now."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
