"""Completing a plan: what a derived plan leaves out that the model's dataflow needs.

- `complete_with_inferred`: transformers' plans skip groups the inferred plan splits (MLA's down
  projections, shared experts, hybrid layers); each is added when a dry run still passes.
- `complete_grad_allreduce`: modules with their own parameters acting on a column-parallel
  output that no entry names get ``replicated_with_grad_allreduce`` (their gradient on each
  rank covers only its shard), and such an entry whose columns a user replicated is dropped.
- `complete_param_grads`: likewise for bare parameters read outside any such module (MLCD's
  ``class_pos_emb`` in the rotary cos/sin every head's queries are multiplied by), per parameter.
- `complete_tied_layers`: a linear or embedding that computes with a weight tied to a split
  table takes the table's split in its compute (ShieldGemma-2's inner ``lm_head``); a module
  whose weights are all tied to a split twin's takes the twin's entry (DiffusionGemma).
- `note_whole_params`: why each bare parameter of a module tpkit has no style for stays whole.
- `agree_tied`: the last resort, after settling: tied parameters a derived plan still splits
  differently are kept whole under every name, with a note, never refused.

Parameters inside a vocab-parallel embedding (Inkling's ``embed_norm``) need nothing: the style
looks the rows up whole before the embedding's own code runs (`tpkit.styles.embedding`).
"""

from __future__ import annotations

from torch import nn

from tpkit.plan.catalogue import style_spec
from tpkit.plan.layout import kind_of, param_layout, param_layouts, param_styles
from tpkit.plan.spec import Group, Plan, Source, matches
from tpkit.settle.dryrun import dry_run
from tpkit.settle.settle import group_instances, keep_whole
from tpkit.trace.trace import trace

__all__ = [
    "agree_tied",
    "complete_grad_allreduce",
    "complete_param_grads",
    "complete_tied_layers",
    "complete_with_inferred",
    "note_whole_params",
]


def complete_with_inferred(
    model: nn.Module, plan: Plan, inferred: Plan, example=None, tp: int = 2
) -> list[Group]:
    """Add to ``plan`` (in place) every group of ``inferred`` that ``plan`` leaves whole: none of
    its modules or their ancestors named by ``plan``, and a tp dry run still passing with it
    (transformers' plans skip MLA's down projections, routers' shared MLPs, hybrid layers...).
    Returns the groups added."""
    names = list(dict(model.named_modules())) + [n for n, _ in model.named_parameters()]

    def named_above(name: str) -> bool:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            hit = plan.style_for(".".join(parts[:i]))
            if hit and (i == len(parts) or hit[0] != "replicate"):
                return True
        return False

    def add(target: Plan, group: Group) -> None:
        for pattern in group.modules:
            target.set(pattern, inferred[pattern], "inferred", inferred.args.get(pattern))
        for owner in group.owners:
            for key in inferred.owner_fixups(owner):
                target.fixups[key] = inferred.fixups[key]
        target.groups.append(group)

    added = []
    for group in inferred.groups:
        patterns = group.modules
        if not all(p in inferred for p in patterns) or all(
            inferred[p] == "replicate" for p in patterns
        ):
            continue  # left whole by inference too, or not one entry per layer kind
        concrete = [n for p in patterns for n in names if matches(p, n)]
        if not concrete or any(named_above(n) for n in concrete):
            continue
        trial = plan.copy()
        add(trial, group)
        if dry_run(model, trial, example, tp) is None:
            add(plan, group)
            added.append(group)
    return added


def complete_grad_allreduce(model: nn.Module, plan: Plan, example=None) -> Plan:
    """Add ``replicated_with_grad_allreduce`` for the modules with their own parameters that act
    on a column-parallel output which ``plan`` (typically transformers') leaves unnamed:
    Apertus's xIELU activation (scalar ``alpha_p``/``alpha_n`` between up_proj and down_proj)
    or a per-head norm. Each rank's gradient for them covers only its shard of the activation,
    so without the all-reduce they drift apart across ranks. Conversely an inferred or
    transformers entry of that style whose columns a user entry replicated becomes ``replicate``. Traced on fake tensors; a model that does not trace gets the plan
    unchanged."""
    try:
        nodes = trace(model, example)["nodes"]
    except Exception:  # noqa: BLE001 - model code may do anything on meta
        return plan
    split: set[str] = set()  # consumers of some column-parallel output
    modules = dict(model.named_modules())
    for t in plan.resolve(model):
        if t.kind != "module" or not style_spec(t.style).splits_output or t.name not in nodes:
            continue
        split |= nodes[t.name].per_head_consumers
        for user in sorted(nodes[t.name].per_head_consumers):
            # parameters split with the heads (one value per head) have entries of their own:
            # their gradients are the rank's heads' already, and summing them would mix heads
            own = [f"{user}.{n}" for n, _ in modules[user].named_parameters(recurse=False)]
            split_own = [h for n in own if (h := plan.style_for(n)) and h[0] != "replicate"]
            if plan.style_for(user) is None and not split_own:
                plan.set(user, "replicated_with_grad_allreduce", t.source)
    # a derived per-head norm whose columns user entries have all replicated acts on whole
    # activations now: its gradient is whole on every rank, and summing it would multiply it
    # (other producers, like MLA's replicated kv_a_proj feeding split heads, keep it)
    for t in plan.resolve(model):
        if (
            t.kind != "module"
            or t.style != "replicated_with_grad_allreduce"
            or t.source not in ("inferred", "config")
            or t.name in split
        ):
            continue
        producers = [n for n, v in nodes.items() if t.name in v.per_head_consumers]
        user_replicated = [
            n
            for n in producers
            if (hit := plan.style_for(n))
            and hit[0] == "replicate"
            and plan.source(hit[1]) == "user"
        ]
        if producers and len(user_replicated) == len(producers):
            plan.set(t.name, "replicate", t.source)
    return plan


def complete_param_grads(model: nn.Module, plan: Plan, example=None) -> Plan:
    """Add a parameter entry ``replicated_with_grad_allreduce`` for each bare parameter whose
    values meet the split output of a column layer of the final ``plan`` with no linear in
    between, broadcast over the split (`tpkit.trace.trace.Node.partial_params`): MLCD's
    ``class_pos_emb`` becomes part of the rotary cos/sin that multiply each head's queries, so
    each rank's gradient for it covers that rank's heads only. Without the all-reduce the
    output is exact but the gradient is not, with no error (0.72 off at tp=2), and the
    replicas drift apart after one optimizer step. Per parameter, not per module: the module
    holding it (here the whole model) has other parameters whose gradient is whole. A
    parameter whose module or own entry the plan names is left to that entry (a per-head
    norm's module entry, `complete_grad_allreduce`), and so is one that reaches the heads
    through a module input a fix-up slices per head (CPM-Ant's position bias: the slice sums
    its gradient already). Run on the settled plan, since settling
    may gather a column layer whose output then is whole. Not handled: one parameter read
    both with split features and with whole ones (each rank's gradient would need only part
    of it summed); no architecture swept does that."""
    try:
        info = trace(model, example)
    except Exception:  # noqa: BLE001 - model code may do anything on meta
        return plan
    nodes, params = info["nodes"], dict(model.named_parameters(remove_duplicate=False))
    # what reaches the heads through a per-head input the fix-ups slice (CPM-Ant's position
    # bias) is summed by the slice's own all-reduce (`tpkit.parallel.tensor.apply_plan`): not again
    sliced: set[str] = set()
    for module, keys in info.get("input_params", {}).items():
        for key in plan.fixups_for(module).get("head_inputs", {}):
            sliced |= keys.get(key, frozenset())
    for t in plan.resolve(model):
        if t.kind != "module" or not style_spec(t.style).splits_output or t.name not in nodes:
            continue
        for name in sorted(nodes[t.name].partial_params):
            owner = name.rpartition(".")[0]
            p = params.get(name)
            if p is None or not p.requires_grad or name in sliced or plan.style_for(name):
                continue
            if owner and plan.style_for(owner) is not None:
                continue
            plan.set(name, "replicated_with_grad_allreduce", Source.INFERRED)
            plan.notes[name] = f"gradient all-reduced: it meets the split output of {t.pattern}"
    return plan


#: the styles a whole (unnamed or replicated) module may take to compute with a split tied
#: weight, by module kind; the one whose layout is the split weight's is used. Each is exact
#: whatever the module's (whole) input, and gathers or reduces its output: a linear tied to a
#: row-parallel weight (DiffusionGemma's decoder ``o_proj``, tied to its encoder's) slices its
#: whole input itself (``rowwise_split_input``) and all-reduces
TIED_STYLES = {
    "linear": ("colwise_gather_output", "rowwise_split_input"),
    "embedding": ("vocab_parallel",),
}


def complete_tied_layers(model: nn.Module, plan: Plan, example=None) -> Plan:
    """Make every name of a tied parameter that the plan splits compute with the same split.

    First, twins (`_mirror_tied_twins`): a module left whole all of whose parameters are tied
    to those of a module the plan names takes that module's entry, when a tp=2 dry run passes
    with every twin so: DiffusionGemma's decoder layers share every weight of its encoder's,
    and appends its keys and values to the encoder's cache, so its attention must split its
    heads as the encoder's does. Then each linear or embedding still whole whose weight is tied
    to a parameter the plan splits takes the style that computes with that split whatever its
    (whole) input (`TIED_STYLES`), when its layout of the weight is the same. Applying a plan
    re-ties the weights to the split one, so such a module would otherwise compute with this
    rank's shard as if it were the whole weight: ShieldGemma-2 wraps Gemma-3, its
    ``get_output_embeddings`` names no head, and its ``lm_head`` tied to the vocab-parallel
    embedding returned each rank a different half of the vocabulary's logits (rank 0 right,
    rank 1 wrong, no error). User entries are left as they are."""
    modules = dict(model.named_modules())
    owners: dict[int, list[tuple[str, str]]] = {}
    for name, module in modules.items():
        for pname, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((name, pname))
    if any(len(t) > 1 for t in owners.values()):
        _mirror_tied_twins(model, plan, owners, example)
    styles = param_styles(model, plan)
    for tied in owners.values():
        if len(tied) < 2:
            continue
        split = None  # (full name, layout, source) of the first owner that splits the weight
        for name, pname in tied:
            full = f"{name}.{pname}" if name else pname
            style, source = styles[full]
            p = modules[name]._parameters[pname]
            layout = param_layout(style, pname, p.ndim, modules[name])
            if layout.sharded:
                split = (full, layout, source)
                break
        if split is None:
            continue
        for name, pname in tied:
            module, hit = modules[name], plan.style_for(name) if name else None
            if hit is not None and (hit[0] != "replicate" or plan.source(hit[1]) == "user"):
                continue  # computes with the split itself, or a user's choice
            p = module._parameters[pname]
            if pname != "weight":
                continue
            fits = [
                s
                for s in TIED_STYLES.get(kind_of(module) or "", ())
                if param_layout(s, pname, p.ndim, module) == split[1]
            ]
            if not fits:
                continue
            style = fits[0]
            plan.set(name, style, split[2] if split[2] != "-" else "inferred")
            plan.notes[name] = f"{style}: its weight is tied to {split[0]}, which is split"
    _tied_names_alike(model, plan, owners)
    return plan


def _whole_here(plan: Plan, name: str) -> bool:
    """No entry names module ``name``, or a derived one leaves it whole."""
    hit = plan.style_for(name) if name else None
    return hit is None or (hit[0] == "replicate" and plan.source(hit[1]) != Source.USER)


def _mirror_tied_twins(
    model: nn.Module, plan: Plan, owners: dict[int, list[tuple[str, str]]], example
) -> bool:
    """Give each module left whole (`_whole_here`) whose parameters are all tied, name for
    name, to those of a module with an entry that splits one of them (its twin) the twin's
    entry, its parent the twin parent's fix-ups (head counts), all twins at once, in place,
    when a tp=2 dry run passes with them; else change nothing. Exact as the twin is: the same
    weights, the same kind of module in the same place of a block that shares all of them (an
    encoder's and a decoder's shared layers), and where the dataflow differs the dry run fails
    (a column twin whose row partner is not mirrored hands a split output to whole code).
    Returns whether the twins were mirrored."""
    modules = dict(model.named_modules())
    trial, mirrored = plan.copy(), []
    for name, module in modules.items():
        own = {k: p for k, p in module._parameters.items() if p is not None}
        if not name or not own or not _whole_here(plan, name):
            continue
        candidates = None
        for pname, p in own.items():
            here = {m for m, k in owners[id(p)] if k == pname and m != name}
            candidates = here if candidates is None else candidates & here
        for twin in sorted(candidates or ()):
            hit = plan.style_for(twin)
            if (
                type(modules[twin]) is not type(module)
                or hit is None
                or hit[0] == "replicate"
                or plan.source(hit[1]) == Source.USER
            ):
                continue
            if not any(param_layout(hit[0], k, q.ndim, module).sharded for k, q in own.items()):
                continue  # the twin's entry splits none of them: nothing to agree on
            trial.set(name, hit[0], plan.source(hit[1]), plan.args_for(hit[1]) or None)
            trial.notes[name] = f"{hit[0]}: its weights are tied to {twin}'s, split so"
            parent, twin_parent = name.rpartition(".")[0], twin.rpartition(".")[0]
            fix = plan.fixups_for(twin_parent)
            if fix and parent and not plan.fixups_for(parent):
                trial.fixups[parent] = dict(fix)
            mirrored.append(name)
            break
    if not mirrored or dry_run(model, trial, example, 2) is not None:
        return False
    vars(plan).update(vars(trial))
    return True


def _tied_names_alike(
    model: nn.Module, plan: Plan, owners: dict[int, list[tuple[str, str]]]
) -> None:
    """Every other name of a tied parameter one name of which the plan now splits gets that
    layout by its own entry, as inference does for the head's bias (BERT's
    ``cls.predictions.bias`` tied to ``cls.predictions.decoder.bias``): BLIP's text decoder,
    whose head `complete_tied_layers` splits above, else held its bias split under one name
    and whole under the other, and the plan was refused. Only a holder that does not compute
    with it (a parent holding an alias, with no entry of its own): a linear or embedding that
    does is styled by `complete_tied_layers`, and a name with an entry is left to that entry
    (a user's ``lm_head: replicate`` against a split embedding is refused by validation)."""
    styles, modules = param_styles(model, plan), dict(model.named_modules())
    for tied in owners.values():
        laid = []
        for name, pname in tied:
            full = f"{name}.{pname}" if name else pname
            p = modules[name]._parameters[pname]
            style = styles[full][0]
            laid.append((full, style, param_layout(style, pname, p.ndim, modules[name])))
        split = next((x for x in laid if x[2].sharded), None)
        if split is None:
            continue
        for (name, _), (full, _, layout) in zip(tied, laid):
            if layout == split[2] or plan.style_for(full) is not None:
                continue
            if kind_of(modules[name]) or (name and plan.style_for(name) is not None):
                continue  # a module computing with it: its style decides (above, or the user)
            plan.set(full, split[1], "inferred")
            plan.notes[full] = f"{split[1]}: it is tied to {split[0]}, which is split"


def agree_tied(model: nn.Module, plan: Plan) -> Plan:
    """Keep whole (in place) every name of a tied parameter that ``plan`` still lays out two
    ways after completion and settling, when no user entry is involved: tpkit never refuses
    a plan it derived for a tie (validation would, "tied parameters would be split
    differently") when the slower exact split exists. `complete_tied_layers` makes most ties
    agree by splitting both names; what is left (a holder with no whole style of that layout,
    a group settling kept whole at this tp beside a twin it did not) is replicated: an entry
    of a whole style (``colwise_gather_output``, ``vocab_parallel``...) or a parameter entry
    directly, a column or row layer with its inferred group (`tpkit.settle.settle.keep_whole`),
    each with a note. A transformers entry in no inferred group cannot be replicated alone
    (its partner would get a split input) and is left to validation, as a user's is."""
    owners: dict[int, list[str]] = {}
    for full, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(full)
    tied = [names for names in owners.values() if len(names) > 1]
    for _ in range(3):  # keeping a group whole may leave another tie split two ways
        layouts, changed = param_layouts(model, plan) if tied else {}, False
        for names in tied:
            if len({layouts[n][1] for n in names}) < 2:
                continue
            hits = [plan.style_for(x) for n in names for x in (n, n.rpartition(".")[0]) if x]
            if any(h is not None and plan.source(h[1]) == Source.USER for h in hits):
                continue  # a user's choice: validation names it
            why = f"tied parameters {', '.join(names)} would otherwise be split differently"
            for name in names:
                if layouts[name][1].sharded:
                    changed |= _keep_name_whole(model, plan, name, why)
        if not changed:
            break
    return plan


def _keep_name_whole(model: nn.Module, plan: Plan, name: str, why: str) -> bool:
    """Replicate what splits parameter ``name``: its own entry, its module's entry of a whole
    style, or its module's inferred group; False when none of them can be."""
    if plan.style_for(name) is not None:
        plan.set(name, "replicate", plan.source(plan.style_for(name)[1]))
        plan.notes[name] = f"replicated: {why}"
        return True
    module = name.rpartition(".")[0]
    hit = plan.style_for(module) if module else None
    if hit is None:
        return False
    if style_spec(hit[0]).role == "whole":
        plan.set(module, "replicate", plan.source(hit[1]))
        plan.notes[module] = f"replicated: {why}"
        return True
    for group in group_instances(model, plan):
        if any(matches(p, module) for p in group.modules):
            keep_whole(plan, group, why, model)
            return True
    return False


def note_whole_params(model: nn.Module, plan: Plan) -> Plan:
    """Note (in place) why each module's own bare >=2-D parameters that ``plan`` leaves whole
    stay so, where nothing names the module: a module that is no layer tpkit splits (not a
    linear, table, convolution or other ``torch.nn`` layer) runs its own code on its
    parameters, and no style runs that code on a shard, so no split of them is proven exact.
    YOLOS's mid-layer position table (15% of the model) is interpolated over the patch grid
    and added to the whole hidden states in every layer: split along the features it would
    have to be gathered back on every forward. Without the note `tpkit plan` and the
    full-size report said only "no plan entry splits it". Changes no layout."""
    layouts = param_layouts(model, plan)
    for name, module in model.named_modules():
        if kind_of(module) or type(module).__module__.startswith("torch.nn"):
            continue
        own = [
            (pname, p) for pname, p in module._parameters.items() if p is not None and p.ndim >= 2
        ]
        full = [(f"{name}.{k}" if name else k, p) for k, p in own]
        whole = [(n, p) for n, p in full if n in layouts and not layouts[n][1].sharded]
        if not whole or name in plan.notes or plan.style_for(name) is not None:
            continue
        if any(plan.style_for(n) is not None for n, _ in whole):
            continue  # an entry of its own decided (and noted) it
        what = ", ".join(f"{n.rpartition('.')[2]} {list(p.shape)}" for n, p in whole)
        plan.notes[name or type(module).__name__] = (
            f"replicated: bare parameter {what} of {type(module).__name__}, read by its own "
            "code, which no style runs on a shard: no split of it is proven exact, so it "
            "stays whole"
        )
    return plan
