"""Plans: which module gets which tensor-parallel style, as data. Pure analysis, no process group.

The plan's data sits here at the floor of the analysis (catalogue, spec, layout, fixups); the
stages that make a plan stand on it in their own rooms, and the three that read a whole plan sit
back here on top:

    plan/      catalogue, spec, layout, fixups   what styles are, the Plan, which dims they split
    trace/     inputs, fake, shadow, reductions, trace   the model run on fake tensors
    settle/    gathered, kvheads, settle, dryrun, complete   what a plan becomes at one tp
    sources/   experts, ssm, attention, convs, hf, infer, fallback, untraced   where entries come from
    plan/      table, checks, derive             a plan as a table (explain), every check (validate), derive_plan

The data is imported here eagerly; the stages on top lazily (PEP 562), because they import the
rooms that import this package's data: ``from tpkit.plan import derive_plan`` works as before.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from tpkit.plan.catalogue import StyleSpec, all_specs, canonical_style, register_spec, style_spec
from tpkit.plan.layout import ParamLayout, local_shape, param_layout, param_layouts
from tpkit.plan.spec import Group, Plan, Source, Target, matches

if TYPE_CHECKING:  # the lazy names below, for type checkers and linters
    from tpkit.plan.checks import problems, validate
    from tpkit.plan.derive import MODES, PlanLike, check_plan_arg, derive_plan
    from tpkit.plan.table import collectives_per_forward, explain
    from tpkit.sources.hf import hf_plan
    from tpkit.sources.infer import infer_plan

#: name -> the module above the data that defines it (imported on first use)
_LAZY = {
    "MODES": "tpkit.plan.derive",
    "PlanLike": "tpkit.plan.derive",
    "check_plan_arg": "tpkit.plan.derive",
    "derive_plan": "tpkit.plan.derive",
    "collectives_per_forward": "tpkit.plan.table",
    "explain": "tpkit.plan.table",
    "hf_plan": "tpkit.sources.hf",
    "infer_plan": "tpkit.sources.infer",
    "problems": "tpkit.plan.checks",
    "validate": "tpkit.plan.checks",
}

__all__ = [
    "MODES",
    "Group",
    "ParamLayout",
    "Plan",
    "PlanLike",
    "Source",
    "StyleSpec",
    "Target",
    "all_specs",
    "canonical_style",
    "check_plan_arg",
    "collectives_per_forward",
    "derive_plan",
    "explain",
    "hf_plan",
    "infer_plan",
    "local_shape",
    "matches",
    "param_layout",
    "param_layouts",
    "problems",
    "register_spec",
    "style_spec",
    "validate",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tpkit.plan' has no attribute {name!r}")
