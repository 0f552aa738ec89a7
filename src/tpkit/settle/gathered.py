"""The gathered fallback: a column/row group the model's code cannot run split keeps its weights
split instead of staying whole.

Its column linears all-gather their outputs (``colwise_gather_output``), the code between them
and the row linears runs on whole activations exactly as in the unsharded model, and each row
linear takes its slice of that whole input, multiplies and all-reduces (``rowwise_split_input``).
transformers' plans do this by hand where a layer reads the full width (OLMo-2's ``colwise_rep``
/ ``rowwise_rep`` around a q_norm over all heads); here a group falls back to it whenever its
split cannot run or would not be exact: a norm over the split features (BitNet's
``ffn_sub_norm``), any reduction or selection over them (a mean and std, softmax, top-k, a
cumulative sum, a ``.tolist()``: `tpkit.trace.reductions.REDUCTIONS`; Gemma-3n's sparse MLP), an unequal packed
split (Mamba-2's ``in_proj`` -> z | x | B | C | dt), heads cut into groups (Falcon's multi-query
``query_key_value``), features indexed one by one (Moshi's ``fc1``), a global head count read where
no fix-up reaches (a dry run's error).

Exact: the gather concatenates X W_i in rank order (uneven chunks too) and the row layer sums
X_i W_i as rowwise does; gradients follow (the gather's backward keeps the rank's slice, the
slice's backward all-reduces). Cost: one all-gather per column output, and the work between
the layers done on every rank; the weights' memory and the matmuls stay split. A group with
packed parts, per-head tables or per-head parameters (split by heads, not gatherable), or a
linear whose weight is read outside its forward stays replicated, as before.

Inference removes a pair whose columns are reduced over their features before pairing
(`gathered_pairs`); `gather_reduced_pairs` does the same to a plan from elsewhere
(transformers' ``base_model_tp_plan`` splits Gemma-3n's MLP, whose code keeps the top of each
token's gate activations by a mean and a std over all the intermediate features).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

from torch import nn

from tpkit.plan.catalogue import style_spec
from tpkit.plan.layout import kind_of
from tpkit.plan.spec import Group, Plan, matches
from tpkit.trace.trace import STREAM, Node, generic

__all__ = [
    "GATHERED",
    "drop_fixups_of_gathered_owners",
    "gather_group",
    "gather_reduced_pairs",
    "gathered_pairs",
]

#: what a group's split styles become when it is gathered
GATHERED = MappingProxyType({"colwise": "colwise_gather_output", "rowwise": "rowwise_split_input"})
_KINDS = ("linear", "conv1d")


def gathered_pairs(
    model: nn.Module,
    nodes: Mapping[str, Node],
    candidates: Mapping[str, set[str]],
    styles: dict[str, str],
    why: dict[str, str],
) -> tuple[list[Group], dict[str, str]]:
    """Groups for the row linears (``candidates``: row -> its column sources, before pairing
    removed any) that pairing left whole: sources gathered, rows splitting their whole input.
    Styles are written into ``styles``; returns the groups and a note per module. A component
    qualifies when all its members are unstyled plain linears whose weights are read only by
    their own forward, its sources read nothing split (the stream, a whole or reduced output),
    and its rows feed no other row linear."""
    feeding = {s for srcs in candidates.values() for s in srcs}
    open_rows = {
        r: set(srcs)
        for r, srcs in candidates.items()
        if r not in styles and r not in feeding and _plain(model, nodes, r)
    }
    components: list[tuple[set[str], set[str]]] = []  # (rows, sources) sharing a source
    for r, srcs in open_rows.items():
        joined = [c for c in components if c[1] & srcs]
        rows, sources = {r}, set(srcs)
        for c in joined:
            rows |= c[0]
            sources |= c[1]
            components.remove(c)
        components.append((rows, sources))
    groups, notes = [], {}
    for rows, sources in components:
        if not all(s not in styles and _plain(model, nodes, s) for s in sources):
            continue
        if not all(_reads_whole(nodes[s], styles, sources) for s in sources):
            continue
        reason = next((why[s] for s in sorted(sources) if s in why), "")
        reason = re.sub(r"(?<=\.)\d+(?=\.)", "*", reason)  # one note for every layer
        for s in sorted(sources):
            styles[s] = GATHERED["colwise"]
        for r in sorted(rows):
            styles[r] = GATHERED["rowwise"]
        for m in sorted(sources | rows):
            why.pop(m, None)
            notes[m] = _note(m in rows, reason)
        groups.append(Group((*sorted(sources), *sorted(rows))))
    return groups, notes


def _note(row: bool, why: str) -> str:
    done = "split, its slice of the whole input" if row else "split, its output gathered"
    return f"{done}: {why}" if why else done


def _plain(model: nn.Module, nodes: Mapping[str, Node], name: str) -> bool:
    node = nodes.get(name)
    if node is None or node.read_outside or node.kind not in _KINDS:
        return False
    return kind_of(model.get_submodule(name)) in _KINDS


def _reads_whole(node: Node, styles: Mapping[str, str], sources: set[str]) -> bool:
    """Its input is whole on every rank: the stream, or outputs that are not split."""
    for s in node.src:
        if s == STREAM or s in sources or s not in styles:
            continue
        spec = style_spec(styles[s])
        if spec.splits_output or spec.role == "channel":
            return False
    return True


def gather_group(model: nn.Module, plan: Plan, group: Group, why: str) -> bool:
    """Turn one inferred group of ``plan`` (in place) into its gathered form: colwise ->
    ``colwise_gather_output``, rowwise -> ``rowwise_split_input``, a per-head norm between
    them and a depthwise conv replicated (they now see whole activations), the owners' head
    fix-ups dropped. False,
    and ``plan`` untouched, when a member is anything else (see the module docstring)."""
    modules = dict(model.named_modules())
    new: dict[str, str] = {}
    for pattern in group.modules:
        style = plan.get(pattern)
        if style == "colwise_replicated_heads":  # KV heads kept whole per rank: gathered whole
            style = "colwise"
        hits = [m for n, m in modules.items() if n and matches(pattern, n)]
        if style is None or not hits:
            return False  # a parameter entry (per-head sinks): split by heads, not gatherable
        if style in GATHERED and all(kind_of(m) in _KINDS for m in hits):
            new[pattern] = GATHERED[style]
        elif style in ("replicated_with_grad_allreduce", "replicate", "channelwise"):
            new[pattern] = "replicate"
        elif style not in GATHERED.values():
            return False
    for pattern, style in new.items():
        plan.set(pattern, style, plan.source(pattern))
        if style in GATHERED.values():
            plan.notes[pattern] = _note(style == GATHERED["rowwise"], why)
    for owner in group.owners:
        for key in plan.owner_fixups(owner):
            plan.fixups.pop(key)
    return True


def gather_reduced_pairs(model: nn.Module, plan: Plan, nodes: Mapping[str, Node] | None) -> Plan:
    """``plan`` with every column/row pair gathered whose column output the model's code
    reduces over its split features (``nodes``: the trace's, None where the model does not
    trace; `tpkit.trace.trace.Node.reduced`): on a rank's part a mean,
    a norm or a top-k is a wrong number with no error. Plain ``colwise`` / ``rowwise`` members
    become ``colwise_gather_output`` / ``rowwise_split_input`` (exact, weights still split);
    a pair with any other split style is replicated. Per layer: a model that reduces in some
    layers only (Gemma-3n's first 10 of 35) keeps the others split. The user's own entries are
    left as they are. Each module changed gets a note saying which op, where. A new plan.
    Inference needs none of this (its pairing already leaves such pairs out); this is for
    transformers' plans, which are written per layer kind, not per layer."""
    if nodes is None:
        return plan
    plan = plan.copy()
    targets = {t.name: t for t in plan.resolve(model) if t.kind == "module"}

    def split(name: str, role: str) -> bool:
        t = targets.get(name)
        return t is not None and style_spec(t.style).role == role

    done: set[str] = set()
    for name in sorted(nodes):
        if not nodes[name].reduced or name in done or not split(name, "column"):
            continue
        cols, rows = _component(nodes, name, split)
        members = cols | rows
        done |= members
        if any(targets[m].source == "user" for m in members):
            continue  # the user asked for this split: validation's concern, not ours
        reason = generic(nodes[name].reduced)
        plain = all(_plain(model, nodes, m) for m in members)
        gatherable = plain and all(targets[m].style in GATHERED for m in members)
        for m in sorted(members):
            style = GATHERED[targets[m].style] if gatherable else "replicate"
            plan.set(m, style, targets[m].source)
            plan.notes[m] = _note(m in rows, reason) if gatherable else f"replicated: {reason}"
        for c in sorted(cols):  # a per-head norm between them now sees whole activations
            for user in sorted(nodes[c].per_head_consumers):
                hit = plan.style_for(user)
                if hit is not None and hit[0] == "replicated_with_grad_allreduce":
                    plan.set(user, "replicate", plan.source(hit[1]))
        _drop_fixups(model, plan, {m.rsplit(".", 1)[0] for m in members if "." in m})
    return plan


def drop_fixups_of_gathered_owners(model: nn.Module, plan: Plan) -> Plan:
    """``plan`` without the fix-ups of every module whose code sees whole activations because
    the plan gathers the column outputs feeding it: some layer inside it gathers its output
    (``colwise_gather_output``) and none inside leaves an output split or expects a split input.
    A user's plan does this over the auto plan's fix-ups (BLOOM's ``query_key_value`` gathered:
    the attention reshapes 3 x all its heads, so dividing ``num_heads`` breaks the reshape and
    slicing ``alibi`` would pair heads with other heads' slopes). A new plan."""
    if not plan.fixups:
        return plan
    specs = {t.name: (t.kind, style_spec(t.style)) for t in plan.resolve(model)}
    names = [n for n, _ in model.named_modules()]
    owners: set[str] = set()
    for key in plan.fixups:
        for owner in (n for n in names if matches(key, n)):
            inside = [v for m, v in specs.items() if m.startswith(f"{owner}.") or not owner]
            gathered = any(k == "module" and s.collective == "all_gather" for k, s in inside)
            split = any(
                s.role in ("column", "row", "channel") or (k != "module" and s.shard is not None)
                for k, s in inside
            )
            if gathered and not split:
                owners.add(owner)
    if not owners:
        return plan
    plan = plan.copy()
    _drop_fixups(model, plan, owners)
    return plan


def _drop_fixups(model: nn.Module, plan: Plan, owners: set[str]) -> None:
    """No fix-ups for ``owners`` (their code sees whole activations now); a pattern that also
    covers other modules keeps them, as concrete entries."""
    names = [n for n, _ in model.named_modules()]
    for key in list(plan.fixups):
        hit = [n for n in names if matches(key, n)]
        if not owners.intersection(hit):
            continue
        fix = plan.fixups.pop(key)
        for n in hit:
            if n not in owners:
                plan.fixups.setdefault(n, dict(fix))


def _component(nodes: Mapping[str, Node], start: str, split) -> tuple[set[str], set[str]]:
    """The split columns and rows connected to column ``start``: the rows that read it, the
    other columns those rows read, and so on."""
    cols, rows, todo = {start}, set(), [start]
    while todo:
        for r in nodes[todo.pop()].consumers:
            if r in rows or not split(r, "row"):
                continue
            rows.add(r)
            for s in nodes[r].src:
                if s in nodes and s not in cols and split(s, "column"):
                    cols.add(s)
                    todo.append(s)
    return cols, rows
