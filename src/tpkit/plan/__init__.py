"""Plans: which module gets which tensor-parallel style. Pure analysis, no process group.

The stages, each a module, imports flowing one way (a module imports only those above it):

    catalogue  what each style is (data)
    spec       Plan: patterns -> styles, args, fix-ups, notes, groups
    layout     which dim of each parameter a style splits
    fixups     per-rank attributes and inputs a module's code reads
    trace      one forward on fake tensors, tagging the dataflow
    dryrun     one forward with rank 0's shard shapes: does the plan run?
    hf         transformers' own plans
    infer      a plan from the dataflow
    explain    a plan as a table
    validate   every check that can fail
    complete   what a derived plan leaves out
    derive     derive_plan: source, user entries, completion, groups settled for tp
"""

from tpkit.plan.catalogue import StyleSpec, all_specs, canonical_style, register_spec, style_spec
from tpkit.plan.derive import MODES, PlanLike, check_plan_arg, derive_plan
from tpkit.plan.explain import collectives_per_forward, explain
from tpkit.plan.hf import hf_plan
from tpkit.plan.infer import infer_plan
from tpkit.plan.layout import ParamLayout, local_shape, param_layout, param_layouts
from tpkit.plan.spec import Plan, Target, matches
from tpkit.plan.validate import problems, validate

__all__ = [
    "MODES",
    "ParamLayout",
    "Plan",
    "PlanLike",
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
