"""The gathered fallback: a column/row group the model's code cannot run split keeps its weights
split instead of staying whole.

Its column linears all-gather their outputs (``colwise_gather_output``), the code between them
and the row linears runs on whole activations exactly as in the unsharded model, and each row
linear takes its slice of that whole input, multiplies and all-reduces (``rowwise_split_input``).
transformers' plans do this by hand where a layer reads the full width (OLMo-2's ``colwise_rep``
/ ``rowwise_rep`` around a q_norm over all heads); here a group falls back to it whenever its
split cannot run: a norm over the split features (BitNet's ``ffn_sub_norm``), an unequal packed
split (Mamba-2's ``in_proj`` -> z | x | B | C | dt), heads cut into groups (Falcon's multi-query
``query_key_value``), features indexed one by one (Moshi's ``fc1``), a global head count read where
no fix-up reaches (a dry run's error).

Exact: the gather concatenates X W_i in rank order (uneven chunks too) and the row layer sums
X_i W_i as rowwise does; gradients follow (the gather's backward keeps the rank's slice, the
slice's backward all-reduces). Cost: one all-gather per column output, and the work between
the layers done on every rank; the weights' memory and the matmuls stay split. A group with
packed parts, per-head tables or per-head parameters (split by heads, not gatherable), or a
linear whose weight is read outside its forward stays replicated, as before.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import nn

from tpkit.plan.catalogue import style_spec
from tpkit.plan.layout import kind_of
from tpkit.plan.spec import Plan, matches
from tpkit.plan.trace import STREAM, Node

__all__ = ["GATHERED", "gather_group", "gathered_pairs"]

#: what a group's split styles become when it is gathered
GATHERED = {"colwise": "colwise_gather_output", "rowwise": "rowwise_split_input"}
_KINDS = ("linear", "conv1d")


def gathered_pairs(
    model: nn.Module,
    nodes: Mapping[str, Node],
    candidates: Mapping[str, set[str]],
    styles: dict[str, str],
    why: dict[str, str],
) -> tuple[list[dict[str, Any]], dict[str, str]]:
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
        groups.append({"modules": sorted(sources) + sorted(rows), "owners": [], "counts": {}})
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


def gather_group(model: nn.Module, plan: Plan, group: Mapping[str, Any], why: str) -> bool:
    """Turn one inferred group of ``plan`` (in place) into its gathered form: colwise ->
    ``colwise_gather_output``, rowwise -> ``rowwise_split_input``, a per-head norm between
    them and a depthwise conv replicated (they now see whole activations), the owners' head
    fix-ups dropped. False,
    and ``plan`` untouched, when a member is anything else (see the module docstring)."""
    modules = dict(model.named_modules())
    new: dict[str, str] = {}
    for pattern in group["modules"]:
        style = plan.get(pattern)
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
    for owner in group.get("owners", []):
        for key in plan.owner_fixups(owner):
            plan.fixups.pop(key)
    return True
