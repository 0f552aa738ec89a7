"""Plans: which module gets which tensor-parallel style. Pure analysis, no process group.

The stages, each a module, imports flowing one way (a module imports only those above it; the
full ordered list, one line each, is the plan/ table of `docs/architecture.md`, which
tests/test_docs.py holds to the imports):

    catalogue, spec, layout, fixups   what styles are, the Plan, which dims they split, fix-ups
    inputs, fake, shadow              made-up inputs, fake-tensor forwards, made-up routing values
    reductions, trace                 the dataflow between linear-like modules, reads across features
    gathered, kvheads                 the gathered form, KV replication
    settle, dryrun                    what a plan becomes at one tp; does a plan run at tp?
    experts, ssm, hf, infer           plan sources: experts, Mamba mixers, transformers', inferred
    fallback                          the per-layer fallback when nothing can be traced or paired
    explain, validate, complete       a plan as a table, every check, what a derived plan leaves out
    derive                            derive_plan: source, user entries, completion, then settle
"""

from tpkit.plan.catalogue import StyleSpec, all_specs, canonical_style, register_spec, style_spec
from tpkit.plan.derive import MODES, PlanLike, check_plan_arg, derive_plan
from tpkit.plan.explain import collectives_per_forward, explain
from tpkit.plan.hf import hf_plan
from tpkit.plan.infer import infer_plan
from tpkit.plan.layout import ParamLayout, local_shape, param_layout, param_layouts
from tpkit.plan.spec import Group, Plan, Source, Target, matches
from tpkit.plan.validate import problems, validate

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
