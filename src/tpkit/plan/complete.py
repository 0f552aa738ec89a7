"""Completing a plan: what a derived plan leaves out that the model's dataflow needs.

- `complete_with_inferred`: transformers' plans skip groups the inferred plan splits (MLA's down
  projections, shared experts, hybrid layers); each is added when a dry run still passes.
- `complete_grad_allreduce`: modules with their own parameters acting on a column-parallel
  output that no entry names get ``replicated_with_grad_allreduce`` (their gradient on each
  rank covers only its shard), and such an entry whose columns a user replicated is dropped.
- `complete_param_grads`: likewise for bare parameters read outside any such module (MLCD's
  ``class_pos_emb`` in the rotary cos/sin every head's queries are multiplied by), per parameter.
- `complete_tied_layers`: a linear or embedding that computes with a weight tied to a split
  table takes the table's split in its compute (ShieldGemma-2's inner ``lm_head``).

Parameters inside a vocab-parallel embedding (Inkling's ``embed_norm``) need nothing: the style
looks the rows up whole before the embedding's own code runs (`tpkit.styles.embedding`).
"""

from __future__ import annotations

from torch import nn

from tpkit.plan.catalogue import style_spec
from tpkit.plan.dryrun import dry_run
from tpkit.plan.layout import kind_of, param_layout, param_styles
from tpkit.plan.spec import Group, Plan, Source, matches
from tpkit.plan.trace import trace

__all__ = [
    "complete_grad_allreduce",
    "complete_param_grads",
    "complete_tied_layers",
    "complete_with_inferred",
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
    for t in plan.resolve(model):
        if t.kind != "module" or not style_spec(t.style).splits_output or t.name not in nodes:
            continue
        split |= nodes[t.name].per_head_consumers
        for user in sorted(nodes[t.name].per_head_consumers):
            if plan.style_for(user) is None:
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
    between, broadcast over the split (`tpkit.plan.trace.Node.partial_params`): MLCD's
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
    # bias) is summed by the slice's own all-reduce (`tpkit.apply.apply_plan`): not again
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


#: the style a whole (unnamed or replicated) module takes to compute with a split tied weight,
#: by module kind: each is exact whatever the module's inputs, and gathers or reduces its output
TIED_STYLES = {"linear": "colwise_gather_output", "embedding": "vocab_parallel"}


def complete_tied_layers(model: nn.Module, plan: Plan) -> Plan:
    """Give each linear or embedding left whole whose weight is tied to a parameter the plan
    splits the style that computes with that split (`TIED_STYLES`), when its layout of the
    weight is the same. Applying a plan re-ties the weights to the split one, so such a module
    would otherwise compute with this rank's shard as if it were the whole weight: ShieldGemma-2
    wraps Gemma-3, its ``get_output_embeddings`` names no head, and its ``lm_head`` tied to the
    vocab-parallel embedding returned each rank a different half of the vocabulary's logits
    (rank 0 right, rank 1 wrong, no error). User entries are left as they are."""
    styles = param_styles(model, plan)
    modules = dict(model.named_modules())
    owners: dict[int, list[tuple[str, str]]] = {}
    for name, module in modules.items():
        for pname, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((name, pname))
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
            style = TIED_STYLES.get(kind_of(module) or "")
            p = module._parameters[pname]
            if style is None or pname != "weight":
                continue
            if param_layout(style, pname, p.ndim, module) != split[1]:
                continue
            plan.set(name, style, split[2] if split[2] != "-" else "inferred")
            plan.notes[name] = f"{style}: its weight is tied to {split[0]}, which is split"
    _tied_names_alike(model, plan, owners)
    return plan


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
