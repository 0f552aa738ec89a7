"""`derive_plan`: from what the user passed to the plan that will be applied.

The steps, in order: pick the source (transformers' plan when it names a layer and a tp=2 dry
run passes with it, else the inferred plan, or what ``"config"`` / ``"infer"`` force), merge the
user's entries over it, complete it (`tpkit.settle.complete`), and, given a tp size, settle it for
that tp (`tpkit.settle.settle`: KV heads fewer than tp kept whole per rank, inferred groups tp does
not divide gathered where a dry run at tp runs them, else kept whole, with a note). Under
"auto", transformers' plan is swapped for the inferred one at a tp that does not divide its
heads. Pure: no process group, meta is fine.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from pathlib import Path

from torch import nn

from tpkit.plan.catalogue import style_spec
from tpkit.plan.layout import kind_of
from tpkit.plan.spec import Plan, Source, matches
from tpkit.settle.complete import (
    agree_tied,
    complete_grad_allreduce,
    complete_param_grads,
    complete_tied_layers,
    complete_with_inferred,
    note_whole_params,
)
from tpkit.settle.dryrun import dry_run
from tpkit.settle.fits import config_plan_at
from tpkit.settle.gathered import drop_fixups_of_gathered_owners, gather_reduced_pairs
from tpkit.settle.settle import DryRun, settle
from tpkit.sources.fallback import fallback_plan, splits_anything
from tpkit.sources.hf import hf_plan
from tpkit.sources.infer import infer
from tpkit.sources.untraced import complete_towers, complete_untraced_layers
from tpkit.trace.analysis import Analysis
from tpkit.trace.gc_quiet import with_frozen_heap
from tpkit.trace.inputs import input_embeddings, output_embeddings
from tpkit.trace.trace import Node

__all__ = ["MODES", "PlanLike", "check_plan_arg", "derive_plan"]

PlanLike = str | Path | Mapping[str, str] | Plan | None
MODES = ("auto", "config", "infer")


def check_plan_arg(plan: PlanLike) -> None:
    """Refuse a ``plan`` argument that names nothing (a mode typo such as ``"infered"``, a YAML
    path that does not exist) with the fix, before anything else runs; cheap and pure, so
    ``tensor_parallel`` checks it even in a single process, where it would otherwise be
    ignored until the script first runs under torchrun."""
    if plan is None or isinstance(plan, (Plan, Mapping)):
        return
    if isinstance(plan, str) and plan in MODES:
        return
    if isinstance(plan, (str, Path)) and Path(plan).exists():
        return
    if isinstance(plan, str) and (":" in plan or "\n" in plan):
        return  # YAML text
    if isinstance(plan, str):
        close = difflib.get_close_matches(plan, MODES, n=1)
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


@with_frozen_heap  # planning's full collections skip the imported world (trace/gc_quiet.py)
def derive_plan(
    model: nn.Module,
    plan: PlanLike = "auto",
    tp_size: int | None = None,
    example_inputs: tuple | Mapping | None = None,
    *,
    analysis: Analysis | None = None,
) -> Plan:
    """Turn what the user passed into the `Plan` for ``model``.

    - ``"auto"``: the model's transformers plan when it ships one that names a layer and runs
      (a tp=2 dry run on fake tensors), completed by the inferred plan's groups it leaves
      whole; else the inferred plan, from the model's dataflow, when that one runs; else
      transformers' plan as it is. ``"config"`` / ``"infer"`` force one of the two, unchecked.
    - a mapping, a `Plan`, or a YAML file path: user entries merged over the ``"auto"`` plan,
      entry by entry (a user entry wins where both name the same module).

    Whatever the source, modules with their own parameters that act on a column-parallel
    output and that no entry names (Apertus's xIELU activation) get
    ``replicated_with_grad_allreduce``, and a linear or embedding left whole whose weight is
    tied to a split one computes with the split (`complete_tied_layers`). With ``tp_size``,
    the plan is settled for it (`tpkit.settle.settle`): inferred groups it does not divide are
    gathered where a dry run at that tp runs them, else left replicated, with a note; KV heads
    fewer than tp are kept whole per rank. ``example_inputs`` (a
    positional tuple or a kwargs dict) replaces the trace inputs made up from the model
    (`tpkit.trace.inputs`). Under "auto", a model whose dataflow cannot be traced, or whose
    inferred plan splits nothing, is split per layer (`tpkit.sources.fallback`), never refused.

    ``analysis`` (`tpkit.trace.analysis.Analysis` of this model and these inputs) is the value
    every stage reads and fills: pass the same one to `validate` and its dry runs are
    answered already. One is built here when none is given. Each step below takes a plan and
    returns one, never changing the one it was given.
    """
    check_plan_arg(plan)
    plan = "auto" if plan is None else plan
    analysis = Analysis(model, example_inputs) if analysis is None else analysis
    model, tp = analysis.model, tp_size
    runs = _dry_runs(analysis)
    if isinstance(plan, str) and plan in MODES:
        out = _source_plan(analysis, plan, tp)
    else:
        out = _base_plan(analysis).merged(_user_plan(plan))
        out = drop_fixups_of_gathered_owners(model, out)  # the user gathered what feeds them
    out = gather_reduced_pairs(model, out, _nodes(analysis))  # reductions over split features
    out = complete_tied_layers(analysis, out)
    out = complete_grad_allreduce(analysis, out)
    if tp is not None and tp > 1 and plan == "auto":
        out = config_plan_at(model, out, tp, runs, lambda: _inferred_at(analysis, tp))
    if not (isinstance(plan, str) and plan in ("config", "infer")):
        out = _untraced(analysis, out, tp)
    if tp is not None and tp > 1:
        out = settle(model, out, tp, runs)
    out = agree_tied(model, out)  # a tie still split two ways: whole, never refused
    # last: settling may gather a column layer, whose output is then whole
    out = complete_param_grads(analysis, out)
    return note_whole_params(model, out)


def _dry_runs(analysis: Analysis) -> DryRun:
    """The dry run settling asks (`tpkit.settle.settle.DryRun`), bound to ``analysis``."""
    return lambda plan, tp: dry_run(analysis, plan, tp)


def _nodes(analysis: Analysis) -> dict[str, Node] | None:
    """The trace's nodes, or None where the model does not trace."""
    traced = analysis.traced()
    return traced.nodes if traced is not None else None


def _untraced(analysis: Analysis, plan: Plan, tp: int | None) -> Plan:
    """What the model's trace never ran (`tpkit.sources.untraced`): each tower planned as the
    model it is and joined under its path, then each other layer no entry names split per
    layer; nothing when the model cannot be traced (the per-layer fallback covers it all)."""
    model, traced = analysis.model, analysis.traced()
    if traced is None:
        return plan
    called = set(traced.module_inputs)
    plan = complete_towers(model, plan, called, lambda sub: derive_plan(sub, "auto", tp))
    convs = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    ran = called | _tied_to_ran(model, called)
    layers = (n for n, m in model.named_modules() if kind_of(m) or isinstance(m, convs))
    if all(n in ran or plan.style_for(n) for n in layers):
        return plan  # every layer ran (or is named): nothing for the fallback to add
    why = "the model's trace never ran it"
    fallback = fallback_plan(model, why, tp, _read_outside(analysis), analysis=analysis)
    return complete_untraced_layers(model, plan, ran, fallback)


def _tied_to_ran(model: nn.Module, called: set[str]) -> set[str]:
    """Modules the trace never ran holding a parameter that a module it ran holds too: their
    weights are computed with there, so that module's entry lays them out (and
    `complete_tied_layers` gives its twins the same split). Zamba2 ties each hybrid layer's
    shared block to an earlier layer's, and each layer calls one adapter of its block: the
    fallback gathered the adapters each layer leaves uncalled, split weights an earlier layer
    computes with whole, and the dry run failed (0.8 s), then validation ran again."""
    held = {
        id(p)
        for name, m in model.named_modules()
        if name in called
        for p in m._parameters.values()
        if p is not None
    }
    return {
        name
        for name, m in model.named_modules()
        if name not in called and any(id(p) in held for p in m._parameters.values())
    }


def _completed_inferred(analysis: Analysis) -> Plan | None:
    """The inferred plan, completed as a source plan is (`complete_tied_layers`,
    `complete_grad_allreduce`): what "auto" swaps in where transformers' plan cannot run at a
    tp (`tpkit.settle.fits.config_plan_at`); None where inference finds no plan."""
    try:
        inferred = infer(analysis)
    except ValueError:
        return None
    return complete_grad_allreduce(analysis, complete_tied_layers(analysis, inferred))


def _inferred_at(analysis: Analysis, tp: int) -> Plan:
    """What "auto" swaps in where transformers' plan cannot run at ``tp``
    (`tpkit.settle.fits.config_plan_at`): the inferred plan, completed; where the dataflow
    cannot be traced, the per-layer fallback (`tpkit.sources.fallback`: each layer split on its
    own, its output gathered, exact whatever the heads), never a refusal (Gemma-4's assistant,
    whose attention reads K/V handed in by its caller: 4 KV heads at tp=8)."""
    inferred = _completed_inferred(analysis)
    if inferred is not None:
        return inferred
    why = "the dataflow could not be traced and transformers' base_model_tp_plan cannot run"
    return fallback_plan(analysis.model, why, tp, analysis=analysis)


def _user_plan(plan: PlanLike) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Mapping):
        return Plan.from_dict(plan)
    return Plan.from_yaml(plan)


def _base_plan(analysis: Analysis) -> Plan:
    """What user entries merge over: the "auto" plan, or nothing when none can be derived."""
    try:
        return _source_plan(analysis, "auto")
    except ValueError:
        return Plan()  # nothing to derive: the user's plan is the whole plan


def _source_plan(analysis: Analysis, mode: str, tp: int | None = None) -> Plan:
    """The plan ``mode`` names. Under "auto", a model whose dataflow cannot be traced, or whose
    inferred plan splits nothing, gets the per-layer fallback (`tpkit.sources.fallback`: each
    layer split on its own, its output gathered) instead of a refusal; "infer" still raises."""
    model = analysis.model
    if mode in ("auto", "config"):
        plan = hf_plan(model)
        if plan is not None:
            if mode == "config":
                return plan
            return _whole_read_outside(analysis, _checked_config_plan(analysis, plan, tp))
        if mode == "config":
            raise ValueError(
                f"{type(model).__name__} ships no base_model_tp_plan; use plan='auto' or 'infer'."
            )
    if mode != "auto":
        return infer(analysis)
    try:
        inferred = infer(analysis)
    except ValueError as exc:
        cause = exc.__cause__ or exc
        brief = f"{type(cause).__name__}: {cause}".splitlines()[0][:200]
        why = f"the dataflow could not be traced ({brief})"
        return fallback_plan(model, why, tp, analysis=analysis)
    if splits_anything(model, inferred):
        return inferred
    why = "the traced dataflow has no column/row pair to split"
    fallback = fallback_plan(model, why, tp, _read_outside(analysis), analysis=analysis)
    return fallback if splits_anything(model, fallback) else inferred


def _whole_read_outside(analysis: Analysis, plan: Plan) -> Plan:
    """``plan`` with every table whose weight the trace saw read outside its own forward kept
    whole, and every layer tied to one (a new plan): a split table read by other code reaches
    it as a shard (Gemma-4's pad row read off its text embedding: "mixed torch.Tensor and
    DTensor" once transformers' text plan, joined under ``model.language_model``, was used and
    the embedding made vocab-parallel beside it). Inference already keeps them whole; this
    does it for transformers' plan too. User entries are left to the user. The only exact
    split would hand that code the whole table, gathered on every forward: as much traffic
    and transient memory as the table, so whole it stays, and its note says why (Gemma-4's
    table, 12% of the full-size model)."""
    model = analysis.model
    modules = dict(model.named_modules())
    # tables only: a linear read outside is the SSM planner's (Mamba's ``dt_proj.weight``, whose
    # channels the mixer splits with it) or a dry run's concern
    names = [n for n in _read_outside(analysis) if kind_of(modules[n]) == "embedding"]
    if not names:
        return plan
    plan = plan.copy()
    weights = {id(p) for n in names for p in modules[n].parameters(recurse=False)}
    tied = [n for n, m in modules.items() if any(id(p) in weights for p in m.parameters(False))]
    for name in dict.fromkeys(names + tied):
        hit = plan.style_for(name)
        if hit is None or hit[0] == "replicate" or plan.source(hit[1]) == Source.USER:
            continue
        plan.set(name, "replicate", plan.source(hit[1]))
        why = "is" if name in names else "is tied to one"
        plan.notes[name] = (
            f"replicated: its weight {why} read outside its own forward, by code that would "
            "get this rank's shard where it reads the whole table; the exact alternative, the "
            "table gathered for that code on every forward, moves and holds all of it each step"
        )
    return plan


def _read_outside(analysis: Analysis) -> list[str]:
    """Layers whose weight the trace saw computed with outside their own forward (the trace
    inference just ran: on fake tensors, or the real one it fell back to)."""
    for real in (False, True):
        traced = analysis.traced(real=real)
        if traced is not None:
            return [name for name, node in traced.nodes.items() if node.read_outside]
    return []


def _checked_config_plan(analysis: Analysis, plan: Plan, tp: int | None = None) -> Plan:
    """transformers' plan, unless the model's own code cannot run with it.

    Some shipped plans name only the embedding (DiffLlama, LFM2, HunYuan dense: every layer stays
    whole). A few shard a layer whose output the code then reads whole (Doge's ``dt_proj`` is
    row-parallel, so the per-head mask is computed for all heads while each rank holds half of
    them); transformers only finds out when forward crashes. One forward on fake tensors with
    rank 0's tp=2 shapes (no memory, no collectives) checks the plan first. In either case, when
    the inferred plan passes the same check it is used instead, and its notes say why. A plan
    that passes is completed by the inferred plan's groups it leaves whole.
    """
    model = analysis.model
    try:  # first: its trace settles the made-up inputs (a VLM's tower inputs that fail: text)
        inferred = infer(analysis)
    except ValueError:
        inferred = None
    if not _names_a_layer(model, plan):
        error = "it names only the vocabulary embedding, no layer"
    else:
        error = dry_run(analysis, plan, 2)
        error = error and f"it fails a tp=2 dry run ({error})"
    if error is None:
        added = []
        if inferred is not None:
            plan, added = complete_with_inferred(analysis, plan, _groups_as_entries(inferred))
        if added:
            plan.notes[type(model).__name__] = (
                "transformers' base_model_tp_plan leaves whole what the inferred plan splits: "
                + ", ".join(g.modules[-1] for g in added)
                + " (pass plan='config' for transformers' plan alone)"
            )
        elif inferred is None:
            plan = _complete_with_fallback(analysis, plan, tp)
        return plan
    if inferred is None or dry_run(analysis, inferred, 2) is not None:
        if not _names_a_layer(model, plan):
            return _vocab_only_fallback(analysis, plan, inferred is None, tp)
        if inferred is None and dry_run(analysis, Plan(), 2) is not None:
            plan = _complete_with_fallback(analysis, plan, tp, checked=False)  # nothing to check
        return plan  # nothing better to offer: validation or forward will name the problem
    inferred.notes[type(model).__name__] = (
        f"transformers' base_model_tp_plan is not used: {error}; the inferred plan is (pass "
        "plan='config' to force transformers' plan)"
    )
    return inferred


def _groups_as_entries(plan: Plan) -> Plan:
    """``plan`` with each group named by its entries (a new plan): a pair in an
    ``nn.Sequential`` has entries ``merger.mlp.0`` / ``merger.mlp.2`` but its group says
    ``merger.mlp.*``, which `complete_with_inferred` reads as not one entry per layer kind and
    skips (EXAONE-4.5's projector, 30% of its tiny model, left whole beside transformers'
    plan)."""
    plan = plan.copy()
    for i, group in enumerate(plan.groups):
        if all(p in plan for p in group.modules):
            continue
        modules: list[str] = []
        for pattern in group.modules:
            hits = [pattern] if pattern in plan else [k for k in plan if matches(pattern, k)]
            modules += [h for h in hits if h not in modules]
        if modules:
            plan.groups[i] = dataclasses.replace(group, modules=tuple(modules))
    return plan


def _complete_with_fallback(
    analysis: Analysis, plan: Plan, tp: int | None, checked: bool = True
) -> Plan:
    """Transformers' ``plan`` with the per-layer fallback's entries added for the layers it
    leaves whole (a new plan), when the dataflow cannot be traced (so no inferred group can
    complete it,
    `complete_with_inferred`): ERNIE-4.5-VL's text plan names no expert and its tower's plan
    no attention, 8% of the tiny model split against 99% by the fallback alone. A fallback
    layer takes its input whole and gathers its output: exact wherever its input is whole.
    transformers' plan leaves an activation split only after one of its column layers, until
    its row partner, so a layer beside a column layer (a child of the same module: a norm-like
    linear next to ``q_proj``) stays whole; one inside a module transformers' plan names too.
    A split input left over would fail on shapes, never compute wrong numbers; and when
    ``checked`` (transformers' plan passed a tp=2 dry run) they are added only if the dry run
    still passes with them, else none is."""
    model = analysis.model
    why = "the dataflow could not be traced and transformers' base_model_tp_plan leaves it whole"
    fallback = fallback_plan(model, why, tp, analysis=analysis)
    resolved = plan.resolve(model)
    named = [t.name for t in resolved]
    beside_columns = {  # modules holding a column layer of transformers' plan
        t.name.rsplit(".", 1)[0] if "." in t.name else ""
        for t in resolved
        if t.kind == "module" and style_spec(t.style).role in ("column", "channel")
    }
    modules = {n for n, _ in model.named_modules()}
    trial, added = plan.copy(), []
    for pattern in fallback:
        parts = pattern.split(".")
        if any(plan.style_for(".".join(parts[:i])) for i in range(1, len(parts) + 1)):
            continue  # named, or inside a module named, by transformers' plan
        if any(n.startswith(pattern + ".") for n in named):
            continue  # transformers' plan names something inside it (an expert's parameter)
        module = pattern if pattern in modules else ".".join(parts[:-1])
        if (module.rsplit(".", 1)[0] if "." in module else "") in beside_columns:
            continue  # its input may be a column layer's split output
        trial.set(pattern, fallback[pattern], fallback.source(pattern), fallback.args.get(pattern))
        added.append(pattern)
    if not added or (checked and dry_run(analysis, trial, 2) is not None):
        return plan
    plan = plan.copy()
    for pattern in added:
        plan.set(pattern, fallback[pattern], fallback.source(pattern), fallback.args.get(pattern))
        if pattern in fallback.fixups:
            plan.fixups[pattern] = fallback.fixups[pattern]
        if pattern in fallback.notes:
            plan.notes[pattern] = fallback.notes[pattern]
    plan.notes[type(model).__name__] = (
        f"transformers' base_model_tp_plan completed by the per-layer fallback ({len(added)} "
        "layers it leaves whole; the dataflow could not be traced)"
    )
    return plan


def _vocab_only_fallback(analysis: Analysis, plan: Plan, untraced: bool, tp: int | None) -> Plan:
    """The per-layer fallback (`tpkit.sources.fallback`) in place of a transformers plan that
    splits only the vocabulary when no inferred plan runs either: the model's layers would
    otherwise all stay whole (a default GLM-4V config, whose forward fails in its rotary,
    kept 88% of its weights whole). Each layer split on its own and gathered is exact whatever
    code runs between layers, as when no transformers plan exists (`_source_plan`);
    transformers' plan is kept when the fallback splits nothing."""
    model = analysis.model
    why = "transformers' base_model_tp_plan names only the vocabulary embedding, no layer, and " + (
        "the dataflow could not be traced" if untraced else "the inferred plan fails a dry run"
    )
    read_outside = [] if untraced else _read_outside(analysis)
    fallback = fallback_plan(model, why, tp, read_outside, analysis=analysis)
    if not splits_anything(model, fallback):
        return plan
    fallback.notes[type(model).__name__] = f"per-layer fallback: {why}"
    return fallback


def _names_a_layer(model: nn.Module, plan: Plan) -> bool:
    """True when a transformers entry of ``plan`` names something besides the vocabulary
    embedding and output head (which tpkit adds to every plan)."""
    vocab = {id(input_embeddings(model)), id(output_embeddings(model))}
    modules = dict(model.named_modules())
    for t in plan.resolve(model):
        owner = t.name.rsplit(".", 1)[0] if t.kind == "param" else t.name
        if t.source == Source.CONFIG and id(modules.get(owner)) not in vocab:
            return True
    return False
