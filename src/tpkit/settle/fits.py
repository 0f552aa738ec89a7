"""What fits at one tp besides the groups settling rewrites: which source plan, which layers.

Settling's other decisions (`tpkit.settle.settle`), kept beside it so that everything that
decides what runs at a tp lives in settle/:

- `config_plan_at`: transformers' plan, or the inferred plan where transformers' splits heads
  tp does not divide or fails a dry run at tp (its entries are never rewritten: the inferred
  plan's groups are, by `tpkit.settle.settle.settle`);
- `too_small`, `experts_unfit`: a layer, or fused experts, too narrow to split at tp, or an
  interleaved gate/up tp does not divide; the per-layer fallback asks
  (`tpkit.sources.fallback`).

Pure: asks the dry run it is handed, like settling.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from tpkit.plan.spec import Plan, Source
from tpkit.settle.settle import DryRun, head_constraints, settle_heads

__all__ = ["MIN_PER_RANK", "config_plan_at", "experts_unfit", "too_small"]


def config_plan_at(
    model: nn.Module,
    plan: Plan,
    tp: int,
    dry_run: DryRun,
    inferred: Callable[[], Plan | None],
) -> Plan:
    """``plan`` (what "auto" chose), or the plan ``inferred()`` gives (the inferred plan,
    completed; None when there is none) when ``plan`` is transformers' and splits heads ``tp``
    does not divide (Qwen2.5-0.5B's 14 heads at tp=4), or its split fails a dry run at ``tp``
    that the unsplit model passes (CodeGen's ``mp_num``): transformers' entries are never
    rewritten, but the inferred plan's groups are, gathered where the heads do not divide
    (`settle_groups`), so "auto" still runs at that tp with the weights split; where the
    dataflow cannot be traced, ``inferred()`` gives the per-layer fallback. The heads are
    read as settling lays them out (KV heads fewer than tp kept whole need not divide)."""
    if tp <= 1:
        return plan
    laid = plan.copy()
    settle_heads(model, laid, tp)
    config_owners = {
        t.name.rsplit(".", 1)[0]
        for t in laid.resolve(model)
        if t.kind == "module" and t.source == Source.CONFIG and "." in t.name
    }
    bad = [
        f"tp does not divide {label} of {owner}"
        for owner, label, count in head_constraints(model, laid)
        if count % tp and owner in config_owners
    ]
    if not bad and config_owners and tp != 2:  # tp=2 was dry-run when the source was chosen
        error = dry_run(laid, tp)  # the code may not fit (CodeGen's mp_num)
        if error is not None and dry_run(Plan(), tp) is None:
            bad = [f"its split fails a dry run ({error})"]
    if not bad:
        return plan
    other = inferred()
    if other is None:
        return plan  # validation names the problem
    other = other.copy()
    other.notes[type(model).__name__] = (
        f"transformers' base_model_tp_plan is not used at tp_size={tp}: {bad[0]}; the "
        + (
            "per-layer fallback is (the dataflow could not be traced)"
            if not other.groups and all(other.source(p) == Source.FALLBACK for p in other)
            else "inferred plan is, its groups that cannot split at tp gathered or whole"
        )
        + " (pass plan='config' to force transformers' plan)"
    )
    return other


#: a layer with fewer output features (or table rows / columns, or an expert's intermediate
#: channels) than this per rank stays whole: not worth a collective
MIN_PER_RANK = 2


def too_small(width: int, tp: int) -> str | None:
    """Why a layer ``width`` wide (features, rows, an expert's intermediate channels) stays
    whole at ``tp`` (fewer than `MIN_PER_RANK` per rank), else None."""
    return f"too small to split at tp={tp}" if width // tp < MIN_PER_RANK else None


def experts_unfit(inter: int, interleaved: bool, tp: int) -> str | None:
    """Why fused experts of intermediate width ``inter`` stay whole at ``tp``, else None: too
    small (`too_small`), or an interleaved gate/up (``[g0, u0, g1, u1, ...]``) that tp does not
    divide, whose cut would split a gate from its up."""
    small = too_small(inter, tp)
    if small:
        return small
    if interleaved and inter % tp:
        return f"tp={tp} does not divide the intermediate width {inter} of interleaved gate/up"
    return None
