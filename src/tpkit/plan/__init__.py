"""Plans: which module gets which tensor-parallel style. Pure analysis, no process group."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from torch import nn

from tpkit.plan.hf import hf_plan
from tpkit.plan.spec import STYLES, ParamLayout, Plan, Target, canonical_style, param_layout
from tpkit.plan.validate import validate

PlanLike = str | Path | Mapping[str, str] | Plan | None

__all__ = [
    "STYLES",
    "ParamLayout",
    "Plan",
    "PlanLike",
    "Target",
    "check_plan_arg",
    "derive_plan",
    "hf_plan",
    "param_layout",
    "validate",
]


def _auto_plan(model: nn.Module, mode: str) -> Plan:
    if mode in ("auto", "config"):
        plan = hf_plan(model)
        if plan is not None:
            return plan if mode == "config" else _checked_config_plan(model, plan)
        if mode == "config":
            raise ValueError(
                f"{type(model).__name__} ships no base_model_tp_plan; use plan='auto' or 'infer'."
            )
    from tpkit.plan.infer import infer_plan

    return infer_plan(model)


def _checked_config_plan(model: nn.Module, plan: Plan) -> Plan:
    """transformers' plan, unless the model's own code cannot run with it.

    Some shipped plans name only the embedding (DiffLlama, LFM2, HunYuan dense: every layer stays
    whole). A few shard a layer whose output the code then reads whole (Doge's ``dt_proj`` is
    row-parallel, so the per-head mask is computed for all heads while each rank holds half of
    them); transformers only finds out when forward crashes. One forward on fake tensors with
    rank 0's tp=2 shapes (no memory, no collectives) checks the plan first. In either case, when
    the inferred plan passes the same check it is used instead, and its notes say why. A plan
    that passes is completed by the inferred plan's groups it leaves whole (attention with
    MLA or q/k norms, shared experts, hybrid layers; `infer.complete_with_inferred`).
    """
    from tpkit.plan.infer import complete_with_inferred, dry_run, infer_plan

    if not _names_a_layer(model, plan):
        error = "it names only the vocabulary embedding, no layer"
    else:
        error = dry_run(model, plan, None, 2)
        error = error and f"it fails a tp=2 dry run ({error})"
    try:
        inferred = infer_plan(model)
    except ValueError:
        inferred = None
    if error is None:
        added = complete_with_inferred(model, plan, inferred) if inferred is not None else []
        if added:
            plan.notes[type(model).__name__] = (
                "transformers' base_model_tp_plan leaves whole what the inferred plan splits: "
                + ", ".join(g["modules"][-1] for g in added)
                + " (pass plan='config' for transformers' plan alone)"
            )
        return plan
    if inferred is None or dry_run(model, inferred, None, 2) is not None:
        return plan  # nothing better to offer: validation or forward will name the problem
    inferred.notes[type(model).__name__] = (
        f"transformers' base_model_tp_plan is not used: {error}; the inferred plan is (pass "
        "plan='config' to force transformers' plan)"
    )
    return inferred


def _names_a_layer(model: nn.Module, plan: Plan) -> bool:
    """True when a transformers entry of ``plan`` names something besides the vocabulary
    embedding and output head (which tpkit adds to every plan)."""
    get = lambda attr: getattr(model, attr, lambda: None)()  # noqa: E731
    vocab = {id(get("get_input_embeddings")), id(get("get_output_embeddings"))}
    modules = dict(model.named_modules())
    for t in plan.resolve(model):
        owner = t.name.rsplit(".", 1)[0] if t.kind == "param" else t.name
        if t.source == "config" and id(modules.get(owner)) not in vocab:
            return True
    return False


def _vocab_children(model: nn.Module, plan: Plan) -> Plan:
    """Give submodules of a vocab-parallel embedding (Inkling's ``embed_norm``, applied to the
    lookup inside the embedding's forward) their gradient all-reduce: the style masks the
    tokens this rank does not own after the whole forward, so each rank's gradient for those
    replicated parameters covers only its own tokens, and their sum is the true one."""
    modules = dict(model.named_modules())
    for t in plan.resolve(model):
        if t.kind != "module" or canonical_style(t.style) != "vocab_parallel":
            continue
        for name, child in modules[t.name].named_modules(prefix=t.name):
            own = any(True for _ in child.parameters(recurse=False))
            if name != t.name and own and plan.style_for(name) is None:
                plan.set(name, "replicated_with_grad_allreduce", t.source)
    return plan


def _completed(model: nn.Module, plan: Plan) -> Plan:
    from tpkit.plan.infer import complete_grad_allreduce

    return complete_grad_allreduce(model, _vocab_children(model, plan))


def derive_plan(model: nn.Module, plan: PlanLike = "auto") -> Plan:
    """Turn what the user passed into a `Plan` for ``model``.

    - ``"auto"``: the model's transformers plan when it ships one that names a layer and runs
      (a tp=2 dry run on fake tensors), completed by the inferred plan's groups it leaves
      whole; else the inferred plan, from the model's dataflow, when that one runs; else
      transformers' plan as it is. ``"config"`` / ``"infer"`` force one of the two, unchecked.
    - a mapping, a `Plan`, or a YAML file path: user entries merged over the ``"auto"`` plan,
      entry by entry (a user entry wins where both name the same module).

    Whatever the source, modules with their own parameters that act on a column-parallel
    output and that no entry names (Apertus's xIELU activation, a vocab-parallel embedding's
    inner norm) get ``replicated_with_grad_allreduce``: each rank's gradient for them covers
    only its shard, so the true one is their sum.
    """
    from tpkit.plan.infer import reuse_traces

    with reuse_traces():
        return _derive(model, "auto" if plan is None else plan)


def check_plan_arg(plan: PlanLike) -> None:
    """Refuse a ``plan`` argument that names nothing (a mode typo such as ``"infered"``, a YAML
    path that does not exist) with the fix, before anything else runs; cheap and pure, so
    ``tensor_parallel`` checks it even in a single process, where it would otherwise be
    ignored until the script first runs under torchrun."""
    if plan is None or isinstance(plan, (Plan, Mapping)):
        return
    if isinstance(plan, str) and plan in ("auto", "config", "infer"):
        return
    if isinstance(plan, (str, Path)) and Path(plan).exists():
        return
    if isinstance(plan, str) and (":" in plan or "\n" in plan):
        return  # YAML text
    if isinstance(plan, str):
        import difflib

        close = difflib.get_close_matches(plan, ["auto", "config", "infer"], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"plan={plan!r} is not a plan mode and no such YAML file exists; {hint}use 'auto', "
            "'config', 'infer', a {pattern: style} dict, a tpkit.Plan or the path of a YAML plan."
        )
    if isinstance(plan, Path):
        raise FileNotFoundError(f"plan file {plan} does not exist.")
    raise TypeError(
        f"plan must be 'auto', 'config', 'infer', a dict, a Plan or a YAML path, got {type(plan)}"
    )


def _derive(model: nn.Module, plan: PlanLike) -> Plan:
    if isinstance(plan, str) and plan in ("auto", "config", "infer"):
        return _completed(model, _auto_plan(model, plan))
    check_plan_arg(plan)
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
    return _completed(model, base.merged(user))
