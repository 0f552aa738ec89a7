"""Infer a `Plan` for a model that ships none (placeholder until dataflow inference lands)."""

from __future__ import annotations

from torch import nn

from tpkit.plan.spec import Plan


def infer_plan(model: nn.Module) -> Plan:
    raise ValueError(
        f"{type(model).__name__} ships no base_model_tp_plan and plan inference is not available "
        "yet; pass plan={'module.pattern': 'colwise' | 'rowwise' | ...}."
    )
