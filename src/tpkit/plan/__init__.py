"""Plans: which module gets which tensor-parallel style. Pure analysis, no process group."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from torch import nn

from tpkit.plan.hf import hf_plan
from tpkit.plan.spec import STYLES, ParamLayout, Plan, Target, param_layout
from tpkit.plan.validate import validate

PlanLike = str | Path | Mapping[str, str] | Plan | None

__all__ = [
    "STYLES",
    "ParamLayout",
    "Plan",
    "PlanLike",
    "Target",
    "derive_plan",
    "hf_plan",
    "param_layout",
    "validate",
]


def _auto_plan(model: nn.Module, mode: str) -> Plan:
    if mode in ("auto", "config"):
        plan = hf_plan(model)
        if plan is not None:
            return plan
        if mode == "config":
            raise ValueError(
                f"{type(model).__name__} ships no base_model_tp_plan; use plan='auto' or 'infer'."
            )
    from tpkit.plan.infer import infer_plan

    return infer_plan(model)


def derive_plan(model: nn.Module, plan: PlanLike = "auto") -> Plan:
    """Turn what the user passed into a `Plan` for ``model``.

    - ``"auto"``: the model's transformers plan if it ships one, else a plan inferred from the
      model's dataflow; ``"config"`` / ``"infer"`` force one of the two.
    - a mapping, a `Plan`, or a YAML file path: user entries merged over the ``"auto"`` plan,
      entry by entry (a user entry wins where both name the same module).
    """
    if plan is None:
        plan = "auto"
    if isinstance(plan, str) and plan in ("auto", "config", "infer"):
        return _auto_plan(model, plan)
    if isinstance(plan, (str, Path)):
        user = Plan.from_yaml(plan)
    elif isinstance(plan, Plan):
        user = plan
    elif isinstance(plan, Mapping):
        user = Plan.from_dict(plan)
    else:
        raise TypeError(
            f"plan must be 'auto', 'config', 'infer', a dict, a Plan or a YAML path, got {type(plan)}"
        )
    try:
        base = _auto_plan(model, "auto")
    except ValueError:
        base = Plan()  # nothing to derive: the user's plan is the whole plan
    return base.merged(user)
