"""Settling: what a plan becomes so that it runs at one tp size. Every such decision is here.

A derived plan splits what the dataflow allows; at a given tp some of it cannot run split:

- an attention with fewer KV heads than tp (2 at tp=4, MQA's 1 at tp=2): each KV head is kept
  whole on the tp / kv ranks whose queries read it (`settle_heads`; the rewrite is
  `tpkit.settle.kvheads`), when tp is a multiple of the KV heads and divides the query heads;
- an inferred group whose counts tp does not divide (3 heads at tp=2, 12 at tp=8): gathered
  (`tpkit.settle.gathered`: weights still split, column outputs all-gathered, the code between
  on whole activations, so no count needs to divide) where a dry run at tp says the model runs
  so, else kept whole with a note (`settle_groups`);
- a group the model's code cannot run split at all (a global head count read where no fix-up
  reaches, a split output fed to a layer that needs it whole): the heads merged to the rank's
  width in the reshape that does not fit (``merge_heads``), else the fewest groups kept whole,
  each gathered instead where that runs (`fewest_replicated`, inference's last step, at tp=2).

User and transformers entries are never changed: what they ask and tp does not divide is an
error for validation to report. Only inferred groups are settled.

Settling asks, it does not simulate: every "does this run?" goes to the ``dry_run`` callable
it is given (``(plan, tp) -> None`` when the model runs, else the error in brief;
`tpkit.settle.dryrun.dry_run` bound to the model and its inputs). The dry run in turn lays a
plan out as settling would before any trial (`lay_out`), so both agree. Pure: no process group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import nn

from tpkit.plan.catalogue import style_spec
from tpkit.plan.fixups import HEAD_ATTRS, WIDTH_ATTRS
from tpkit.plan.layout import in_width, kind_of, param_layouts
from tpkit.plan.spec import Group, Plan, Source, matches
from tpkit.settle.gathered import gather_group
from tpkit.settle.kvheads import KV_ATTRS, replicate_kv_heads

__all__ = [
    "WHOLE_STYLES",
    "Constraint",
    "DryRun",
    "constraints",
    "group_instances",
    "fewest_replicated",
    "head_constraints",
    "keep_whole",
    "lay_out",
    "merged_heads",
    "settle",
    "settle_groups",
    "settle_heads",
    "undivided_groups",
]

#: ``(plan, tp) -> None`` when the model runs with ``plan`` at ``tp``, else the error in brief
DryRun = Callable[[Plan, int], str | None]

#: members of a group that no count needs to divide: replicated, or the gathered pair's styles
WHOLE_STYLES = frozenset({"replicate", "colwise_gather_output", "rowwise_split_input"})

_RESHAPE = "is invalid for input of size"  # torch's error for a view that does not fit


def settle(model: nn.Module, plan: Plan, tp: int, dry_run: DryRun) -> None:
    """``plan`` (in place) made to run at ``tp``: KV heads fewer than tp kept whole per rank
    (`settle_heads`), then each inferred group that cannot split at tp gathered or kept whole
    (`settle_groups`), then, at a tp other than the 2 inference dry-ran, each inferred group
    whose split the model's code cannot run at tp (`settle_dataflow`). A plan tpkit derived
    is never refused for tp: only the user's and transformers' entries can be."""
    if tp <= 1:
        return
    settle_heads(model, plan, tp)
    settle_groups(model, plan, tp, dry_run)
    if tp != 2:
        settle_dataflow(model, plan, tp, dry_run)


def settle_heads(model: nn.Module, plan: Plan, tp: int) -> list[str]:
    """Attentions with fewer KV heads than ``tp``, where tp is a multiple of them and divides
    the query heads: their K/V projections become ``colwise_replicated_heads`` (one whole KV
    head per rank, `tpkit.settle.kvheads`) instead of a refusal; returns the attentions changed.
    Where the condition fails the KV counts stay in their group's counts, and `settle_groups`
    settles the group."""
    return replicate_kv_heads(model, plan, tp)


def settle_groups(model: nn.Module, plan: Plan, tp: int, dry_run: DryRun) -> None:
    """Each inferred group that cannot split at ``tp`` (`unfit_groups`: a count of
    `Group.counts`, or any number validation would check for its modules, owners and their
    head counts: packed parts, head counts, fix-up attributes) keeps its weights split in the
    gathered form when a dry run at ``tp`` says the model runs so; else it is kept whole
    (replicated) with a note saying which count tp does not divide."""
    for group, why in unfit_groups(model, plan, tp):
        trial = plan.copy()
        if gather_instance(model, trial, group, why) and dry_run(trial, tp) is None:
            gather_instance(model, plan, group, why)
    for group, why in unfit_groups(model, plan, tp):  # not gathered: whole
        keep_whole(plan, group, why, model)


def settle_dataflow(model: nn.Module, plan: Plan, tp: int, dry_run: DryRun) -> None:
    """``plan`` (in place) when a dry run at ``tp`` fails although every count divides (a
    reshape to a fixed head size on an uneven width, CodeGen's 4 fixed qkv groups at tp=3):
    the fewest inferred groups, per layer, kept whole, each gathered instead where that runs
    (`fewest_replicated`'s search at this tp). Nothing when the plan runs, or when the model
    does not run on the made-up inputs even unsplit (the dry run cannot tell)."""
    error = dry_run(plan, tp)
    if error is None or dry_run(Plan(), tp) is not None:
        return
    groups = [g for g in group_instances(model, plan) if _live(plan, g)]
    why = f"a dry run at tp_size={tp} failed: {error}"
    settled = _fewest(model, plan, groups, dry_run, tp, why)
    vars(plan).update(vars(settled))  # in place, as every settling step: settled is a copy


def lay_out(model: nn.Module, plan: Plan, tp: int) -> None:
    """``plan`` (in place) as settling lays it out before anything is tried, with no dry run:
    KV heads settled, every inferred group a count of its own ``tp`` does not divide kept
    whole. What the dry run simulates, so that a trial of one group is not failed by another that settling
    would have kept whole anyway."""
    if tp > 1:
        settle_heads(model, plan, tp)
    # counts only: a head count read off the model is what inference's tp=2 dry run must see
    for group, why in undivided_groups(plan, tp):
        keep_whole(plan, group, why, model)  # a layer's group: its fix-ups only


def keep_whole(plan: Plan, group: Group, why: str, model: nn.Module | None = None) -> None:
    """Leave one inferred group replicated (its modules, and its owners' fix-ups dropped), each
    module noted with why. With ``model``, a group named per layer whose entries the plan
    holds as ``*`` patterns is first written out per layer (`materialise`), so only this
    layer changes."""
    if model is not None:
        materialise(model, plan, group)
    for pattern in group.modules:
        plan.set(pattern, "replicate", plan.source(pattern) if pattern in plan else Source.INFERRED)
        plan.notes[pattern] = f"replicated: {why}"
    for owner in group.owners:
        for key in plan.owner_fixups(owner):
            plan.fixups.pop(key)


def gather_instance(
    model: nn.Module, plan: Plan, group: Group, why: str, packed: bool = True
) -> bool:
    """`tpkit.settle.gathered.gather_group` for one group, written out per layer first
    (`materialise`); a packed column layer counts as a plain one here, since its output is
    gathered whole (any cut of the fused rows is exact then, whatever its parts; not with
    ``packed=False``: inference's tp=2 search keeps such groups whole, as it always has).
    False, and ``plan`` untouched, where a member cannot be gathered."""
    trial = plan.copy()
    materialise(model, trial, group)
    for pattern in group.modules:
        if packed and trial.get(pattern) == "packed_colwise":
            trial.set(pattern, "colwise", trial.source(pattern))
    if not gather_group(model, trial, group, why):
        return False
    vars(plan).update(vars(trial))
    return True


def materialise(model: nn.Module, plan: Plan, group: Group) -> None:
    """Write a per-layer group's entries (`group_instances`) into ``plan`` as concrete entries,
    each with the style, source and arguments of the pattern that covers it now (a later entry
    wins, so nothing resolves differently), and its owners' fix-ups likewise, other layers
    keeping theirs: then a rewrite of this group changes this layer only."""
    for name in group.modules:
        if name in plan:
            continue
        hit = plan.style_for(name)
        if hit is not None:
            plan.set(name, hit[0], plan.source(hit[1]), plan.args_for(hit[1]) or None)
    names = [n for n, _ in model.named_modules()]
    for owner in group.owners:
        for key in list(plan.fixups):
            if key == owner or not matches(key, owner):
                continue
            fix = plan.fixups.pop(key)
            for n in names:
                if matches(key, n):
                    plan.fixups.setdefault(n, dict(fix))


def group_instances(model: nn.Module, plan: Plan) -> list[Group]:
    """The plan's groups as its entries name them: a group whose ``*`` patterns are entries of
    the plan as it is; else one group per layer (inference collapses a group to ``*`` patterns
    but writes its entries per layer where the layers differ: ``body.5.gate_up`` under the
    group ``body.*.gate_up``), its counts left to `constraints` (the collapsed group's counts
    are its first layer's)."""
    out: list[Group] = []
    names: list[str] = []
    for group in plan.groups:
        if all(p in plan for p in group.modules):
            out.append(group)
            continue
        if not names:
            names = [n for n, _ in model.named_modules() if n]
            names += [n for n, _ in model.named_parameters(remove_duplicate=False)]
        out.extend(_per_layer(group, names))
    return out


def _stars(pattern: str, name: str) -> tuple[str, ...]:
    return tuple(n for p, n in zip(pattern.split("."), name.split("."), strict=True) if p == "*")


def _fill(pattern: str, key: tuple[str, ...]) -> str:
    parts, values = pattern.split("."), iter(key)
    return ".".join(next(values, p) if p == "*" else p for p in parts)


def _per_layer(group: Group, names: list[str]) -> list[Group]:
    """``group`` once per binding of its ``*`` s to the model's names."""
    hits = {p: [(n, _stars(p, n)) for n in names if matches(p, n)] for p in group.modules}
    width = max(p.split(".").count("*") for p in group.modules)
    keys = list(dict.fromkeys(k for p in group.modules for _, k in hits[p] if len(k) == width)) or [
        ()
    ]
    out = []
    for key in keys:
        modules = tuple(n for p in group.modules for n, k in hits[p] if k == key[: len(k)])
        if modules:
            out.append(Group(modules, tuple(_fill(o, key) for o in group.owners)))
    return out


def unfit_groups(model: nn.Module, plan: Plan, tp: int) -> list[tuple[Group, str]]:
    """(group, why) for each inferred, still split group (`group_instances`) that cannot split
    at ``tp``: a count of its own tp does not divide (`undivided_groups`), or a number
    validation checks (`constraints`: a parameter's packed parts or heads, an owner's head
    count or fix-up attribute) that belongs to one of its modules or owners."""
    failing = [c for c in constraints(model, plan, per_owner=True) if c.count % tp]
    counted = {id(g): why for g, why in undivided_groups(plan, tp)}
    out = []
    for group in group_instances(model, plan):
        if not _live(plan, group):
            continue
        why = counted.get(id(group))
        if why is None:
            hit = next((c for c in failing if _covers(group, c.module)), None)
            if hit is not None:
                why = f"tp_size={tp} does not divide {hit.label} of {hit.owner}"
        if why is not None:
            out.append((group, why))
    return out


def _covers(group: Group, module: str) -> bool:
    """``module`` is a member of ``group``, one of its owners, or a member's parent (whose head
    counts the members split)."""
    parents = [p.rsplit(".", 1)[0] for p in group.modules if "." in p]
    return any(matches(p, module) for p in (*group.modules, *group.owners, *parents))


class Constraint(NamedTuple):
    """A number tp must divide for a plan's split: ``module`` needs it, ``owner`` is how
    validation names it (a parameter with its style, or the module), ``label`` what it is."""

    module: str
    owner: str
    label: str
    count: int


def constraints(model: nn.Module, plan: Plan, per_owner: bool = False) -> list[Constraint]:
    """Every number that must be a multiple of tp for ``plan``: each sharded parameter's split
    dim (per packed part) whose style cannot split unevenly, the head counts of every module
    whose projections are split by output (`head_constraints`; each value once unless
    ``per_owner``), and the attributes fix-ups divide. Validation refuses what does not
    divide; settling first keeps inferred groups gathered or whole instead."""
    out: list[Constraint] = []
    params = dict(model.named_parameters(remove_duplicate=False))
    for full, (style, layout, _module) in param_layouts(model, plan).items():
        if not layout.sharded or style_spec(style).uneven_ok:
            continue
        size = params[full].shape[layout.dim]
        what = "input features" if style_spec(style).shard == "in" else "output features"
        if layout.split_factor > 1:
            what = f"{what} per packed part ({layout.split_factor} parts)"
            size //= layout.split_factor
        out.append(
            Constraint(full.rpartition(".")[0], f"{full} ({style})", f"the {what} ({size})", size)
        )
    for owner, label, count in _head_constraints(model, plan, per_owner):
        out.append(Constraint(owner, owner, label, count))
    for t in plan.resolve(model):  # an attention split by heads: whole heads per rank
        if t.kind == "module" and style_spec(t.style).self_contained:
            heads = getattr(model.get_submodule(t.name), "num_heads", None)
            if isinstance(heads, int):
                out.append(Constraint(t.name, t.name, f"num_heads={heads}", heads))
    for name, module in model.named_modules() if plan.fixups else ():
        for attr in plan.fixups_for(name).get("divide", []):
            value = getattr(module, attr, None)
            if not isinstance(value, int):
                out.append(Constraint(name, name, f"attribute {attr} (missing)", 0))
            else:
                out.append(Constraint(name, name, f"{attr}={value}", value))
    return out


def _live(plan: Plan, group: Group) -> bool:
    """The group is still inferred (no user or transformers entry overrode a member) and split
    (not every member whole already)."""
    styles = []
    for p in group.modules:
        hit = (plan[p], p) if p in plan else plan.style_for(p)
        if hit is None or plan.source(hit[1]) != Source.INFERRED:
            return False
        styles.append(hit[0])
    return bool(styles) and not all(s in WHOLE_STYLES for s in styles)


def undivided_groups(plan: Plan, tp: int) -> list[tuple[Group, str]]:
    """(group, why) for each inferred group still split by a count ``tp`` does not divide;
    groups a user or transformers overrode, and whole ones (replicated or gathered), are not."""
    out = []
    for group in plan.groups:
        if not _live(plan, group):
            continue
        bad = [
            f"{label} = {n}"
            for label, n in group.counts.items()
            if n % tp and not _uneven_width_ok(plan, label)
        ]
        if bad:
            out.append((group, f"tp_size={tp} does not divide " + ", ".join(bad)))
    return out


def _uneven_width_ok(plan: Plan, label: str) -> bool:
    """A group's width count (``output features of up_proj``) need not divide tp when its
    module's style splits exactly into torch.chunk sizes (plain colwise / rowwise); head counts
    and packed parts always must."""
    for prefix in ("output features of ", "input features of "):
        if label.startswith(prefix) and label[len(prefix) :] in plan:
            return style_spec(plan[label[len(prefix) :]]).uneven_ok
    return False


def head_constraints(model: nn.Module, plan: Plan) -> list[tuple[str, str, int]]:
    """(owner, label, count): the head counts of every module whose projections the plan splits
    by output, each of which tp must divide (KV heads kept whole per rank excepted); each
    (attribute, value) once, at its first owner."""
    return _head_constraints(model, plan, per_owner=False)


def _head_constraints(model: nn.Module, plan: Plan, per_owner: bool) -> list[tuple[str, str, int]]:
    modules = dict(model.named_modules())
    owners: dict[str, nn.Module] = {}
    kv_whole: set[str] = set()  # attentions whose KV heads are replicated (plan.kvheads)
    for t in plan.resolve(model):
        if t.kind == "module" and style_spec(t.style).splits_output and "." in t.name:
            parent = t.name.rsplit(".", 1)[0]
            owners.setdefault(parent, modules[parent])
            if t.style == "colwise_replicated_heads":
                kv_whole.add(parent)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    out, seen = [], set()
    for name, module in owners.items():
        sources = [module]
        if any(k in name.rsplit(".", 1)[-1].lower() for k in ("attn", "attention")):
            # configs hold the model's head counts for every module that keeps a reference
            # to them (an MLP's config has num_attention_heads too): attention modules only
            sources += [getattr(module, "config", None), config]
        for src in sources:
            for attr in HEAD_ATTRS:
                value = _read(src, attr)
                if name in kv_whole and attr in KV_ATTRS:
                    continue  # whole KV heads, each on tp / kv ranks: replicated_heads_problems
                key = (name, attr, value) if per_owner else (attr, value)
                if isinstance(value, int) and value > 0 and key not in seen:
                    seen.add(key)
                    out.append((name, f"{attr}={value}", value))
    return out


def _read(obj: object, attr: str) -> object:
    """``getattr(obj, attr, None)``, also None where a heterogeneous transformers config refuses
    a global read of a per-layer attribute (it raises a RuntimeError)."""
    if obj is None:
        return None
    try:
        return getattr(obj, attr, None)
    except RuntimeError:
        return None


def fewest_replicated(model: nn.Module, plan: Plan, dry_run: DryRun, tp: int = 2) -> Plan:
    """``plan`` when it passes a tp dry run; else the plan with the fewest of its inferred groups
    left replicated that makes the model's code run (a global head count read where no fix-up
    reaches, a split output fed to a layer that needs it whole, like LFM2's short convolution),
    each noted with the error. A reshape that does not fit is first tried with the heads
    merged to the rank's width (`merge_heads`). Groups are replicated one more at a time
    (attention groups first) until the dry run passes, then each is given back its split if it
    still passes; last, each one left whole is gathered instead (`tpkit.settle.gathered`) where
    that runs."""
    error = dry_run(plan, tp)
    if error is None:
        return plan
    if _RESHAPE in error or "AssertionError" in error:
        # the code merges heads to a width read off its input (merge_heads), or also checks
        # that input against a width attribute (FSMT: ``assert embed_dim == self.embed_dim``)
        further = None
        for repaired in (merged_heads(model, plan), merged_heads(model, plan, True)):
            if repaired is None:
                continue
            repaired_error = dry_run(repaired, tp)
            if repaired_error is None:
                return repaired
            if repaired_error != error and further is None:
                further = (repaired, repaired_error)
        if further is not None:  # it got further: keep it, replicate what still fails
            plan, error = further
    why = f"a dry run of the split forward failed: {error}"
    return _fewest(model, plan, plan.groups, dry_run, tp, why, packed=False)


def _fewest(
    model: nn.Module,
    plan: Plan,
    groups: list[Group],
    dry_run: DryRun,
    tp: int,
    why: str,
    packed: bool = True,
) -> Plan:
    """A copy of ``plan`` with the fewest of ``groups`` kept whole that passes a dry run at
    ``tp``, each of those gathered instead where that still runs (`fewest_replicated`)."""

    def trial(whole: list[int], gathered: tuple[int, ...] = ()) -> Plan:
        out = plan.copy()
        for i in whole:
            if i not in gathered or not gather_instance(model, out, groups[i], why, packed):
                keep_whole(out, groups[i], why, model)
        return out

    order = sorted(range(len(groups)), key=lambda i: not groups[i].owners)
    chosen: list[int] = []
    for i in order:
        chosen.append(i)
        if dry_run(trial(chosen), tp) is None:
            break
    else:
        return trial(chosen)  # nothing split runs: everything stays replicated, noted
    for i in list(chosen[:-1]):
        rest = [j for j in chosen if j != i]
        if dry_run(trial(rest), tp) is None:
            chosen = rest
    gathered: tuple[int, ...] = ()  # then each kept whole keeps its weights split if it runs
    for i in chosen:
        gatherable = gather_instance(model, plan.copy(), groups[i], why, packed)
        if gatherable and dry_run(trial(chosen, (*gathered, i)), tp) is None:
            gathered = (*gathered, i)
    return trial(chosen, gathered)


def merged_heads(model: nn.Module, plan: Plan, keep_widths: bool = False) -> Plan | None:
    """``plan`` with a ``merge_heads`` fix-up on every inferred group's owner: the widths its
    row-parallel modules read (see `tpkit.plan.fixups`); None when no group has one. With
    ``keep_widths`` the owners' width attributes are no longer divided (head counts still
    are): the code reads them only to check its input."""
    out, added = plan.copy(), False
    for group in plan.groups:
        widths = set()
        for name, mod in model.named_modules():
            hit = plan.style_for(name)
            kind = kind_of(mod)
            if hit and kind and style_spec(hit[0]).shard == "in" and hit[1] in group.modules:
                widths.add(in_width(mod, kind))
        for owner in group.owners:
            for key in out.owner_fixups(owner) if widths else []:
                fix = {**out.fixups[key], "merge_heads": sorted(widths)}
                if keep_widths:
                    fix["divide"] = [a for a in fix.get("divide", []) if a not in WIDTH_ATTRS]
                out.fixups[key] = fix
                added = True
    return out if added else None
