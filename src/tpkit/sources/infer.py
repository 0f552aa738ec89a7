"""Infer a `Plan` for a model that ships none, from its dataflow (`tpkit.trace.trace`).

From the trace's tags:

- a linear whose input comes only from other linears (never straight from the stream) and whose
  output is added back into the stream is **row-parallel**; the linears feeding it are
  **column-parallel** (Megatron's pairing: q/k/v -> o, up/gate -> down, c_fc -> c_proj, ...);
- a column candidate whose output is also needed whole (a LayerNorm over its full width, a
  non-row consumer, the stream) or is sliced unevenly along its features (Falcon's multi-query
  ``query_key_value``) is not split that way, nor is its row partner: when both are plain
  linears the pair is *gathered* (the column's output all-gathered, the row splitting its whole
  input: `tpkit.settle.gathered`), else it stays replicated; the plan notes why;
- the output of a column linear split into k equal parts along its features (GPT-2 ``c_attn`` ->
  q|k|v, fused gate_up -> gate|up) gets a *packed* style that splits each part; a split *after*
  a per-head reshape (BLOOM / GPT-NeoX ``query_key_value``, Falcon GQA) is per-head interleaved
  and plain colwise is right;
- an ``nn.Embedding`` inside a block whose output reaches a row linear (T5's relative attention
  bias ``[buckets, heads]``) is split by heads (``colwise_embedding``);
- a module whose 1-D parameters hold one value per head of a column output (NeoMME's
  exclusive self-attention ``alpha``) has them split with the heads (``colwise``);
- a linear beside a pair's columns whose output reaches nothing the model returns
  (`Node.dead`: MRA's key and value without its attention kernel) is split with them;
- a module with 1-D parameters acting per head on a column output (Qwen3 ``q_norm``), or an
  ``nn.Embedding`` whose output is broadcast over a column output's heads (RoFormer's
  sinusoidal table), gets ``replicated_with_grad_allreduce``;
- a depthwise ``nn.Conv1d`` child of a pair's owner, as wide as a split part (LFM2's gated short
  convolution, its weight read by ``causal_conv1d_fn``), is ``channelwise``;
- the input embedding is vocab-parallel, the output head ``colwise_gather_output``; other large
  id-fed tables are vocab-parallel when they look up their input, else split by columns and
  gathered (LED's position table looks up ``arange``);
- an ``nn.EmbeddingBag`` is split by columns and gathered (``colwise_embedding_gather``);
- head-count attributes (``num_heads``, ``n_head``, ``embed_dim``, ``split_size``, ...) on the
  modules that own a column/row pair are listed as plan *fix-ups*, divided by tp when applied,
  and untagged per-head inputs of those modules (BLOOM's ``alibi``) are sliced to the rank's heads.

- a replicated linear whose output is cut unevenly, the first part into a column linear and the
  rest straight into the rank's heads (MLA's ``kv_a_proj_with_mqa``: [kv latent | rope key]) gets
  ``tail_grad_allreduce`` with the rest's width: each rank's gradient for it is partial.

Each column/row pair is a *group* (`tpkit.plan.spec.Group`) with the counts that must divide
tp (features, heads); settling (`tpkit.settle.settle`) gathers an inferred group that does not
divide, or keeps it whole with a note, and a group whose split the model's code cannot run (a
dry run on fake tensors) likewise (`tpkit.settle.settle.fewest_replicated`).

The passes share one `Draft`: what the trace says (nodes, pairs) and what the passes decide so
far (styles, style arguments, fix-ups, notes, groups); each pass takes it and fills it in.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from tpkit.plan.fixups import HEAD_ATTRS, WIDTH_ATTRS
from tpkit.plan.layout import in_width, kind_of, param_layouts
from tpkit.plan.spec import Group, Plan, Source
from tpkit.settle.dryrun import dry_run
from tpkit.settle.gathered import gathered_pairs
from tpkit.settle.settle import fewest_replicated
from tpkit.sources.attention import functional_splits, mha_splits
from tpkit.sources.convs import conv_pairs, exact_row_convs, shared_params, splittable_conv
from tpkit.sources.experts import expert_groups
from tpkit.sources.ssm import ssm_groups
from tpkit.trace.analysis import Analysis
from tpkit.trace.fake import REAL_TRACE_MAX_PARAMS
from tpkit.trace.inputs import input_embeddings, output_embeddings
from tpkit.trace.trace import STREAM, Node, Trace, blocks, has_mixed_blocks

__all__ = ["Draft", "generic_name", "infer", "infer_plan"]


@dataclass
class Draft:
    """Inference in progress, per concrete module name: the trace it reads and what its passes
    have decided so far. Each pass takes the draft and fills it in; `Draft.plan` turns it into
    the `Plan` (names collapsed to ``*`` patterns where every layer agrees).

    Styles set by one pass are not overwritten by a later one (``name in styles`` means taken),
    and ``why`` holds why a module stays whole until it is styled after all (then its reason
    is dropped)."""

    info: Trace  # the trace (`tpkit.trace.trace.trace`)
    styles: dict[str, str] = field(default_factory=dict)  # module or parameter -> style
    args: dict[str, dict] = field(default_factory=dict)  # module -> style arguments
    fixups: dict[str, dict] = field(default_factory=dict)  # owner -> per-rank fix-ups
    why: dict[str, str] = field(default_factory=dict)  # module -> why it stays whole
    notes: dict[str, str] = field(default_factory=dict)  # module -> note (gathered pairs)
    groups: list[Group] = field(default_factory=list)
    exclude: set[str] = field(default_factory=set)  # kept out of pairing (vocabulary)
    candidates: dict[str, set[str]] = field(default_factory=dict)  # row -> column sources
    rows: dict[str, set[str]] = field(default_factory=dict)  # the pairs kept, row -> columns

    @property
    def nodes(self) -> dict[str, Node]:
        return self.info.nodes

    def add_groups(self, groups: list[Group] | list[dict[str, Any]]) -> None:
        """Append groups, plain ``{modules, owners, counts}`` dicts (experts, SSM) typed."""
        self.groups.extend(Group.from_dict(g) for g in groups)

    def extend_group(self, i: int, module: str, owner: str | None = None) -> None:
        """Group ``i`` with ``module`` (and ``owner``, when it is new) added."""
        g = self.groups[i]
        owners = g.owners if owner is None or owner in g.owners else (*g.owners, owner)
        self.groups[i] = replace(g, modules=(*g.modules, module), owners=owners)

    def plan(self, model: nn.Module) -> Plan:
        """The inferred `Plan` (source "inferred"), before settling."""
        all_names = [n for n, _ in model.named_modules()]
        all_names += [n for n, _ in model.named_parameters(remove_duplicate=False)]
        notes = dict(self.notes)
        notes.update(
            (name, f"replicated: {reason}")
            for name, reason in self.why.items()
            if name not in self.styles or self.styles[name] == "replicate"
        )
        plan = Plan()
        collapsed_args = _collapse(self.args, all_names)
        for pattern, style in _collapse(self.styles, all_names).items():
            plan.set(pattern, style, Source.INFERRED, collapsed_args.get(pattern))
        plan.fixups.update(_collapse(_common_head_inputs(self.fixups), all_names))
        plan.notes.update(_collapse(notes, all_names))
        plan.groups.extend(_collapse_groups(self.groups))
        return plan


def _row_candidates(nodes: dict[str, Node], exclude: set[str]) -> dict[str, set[str]]:
    """Row linear -> its column sources: every linear that writes the stream and reads only
    other linears, before any pair is removed."""
    return {
        n: {s for s in v.src}
        for n, v in nodes.items()
        if v.kind != "embedding"
        and n not in exclude
        and v.writer
        and v.src
        and all(s in nodes and s not in exclude for s in v.src)
    }


def _pairs(
    nodes: dict[str, Node], exclude: set[str], candidates: dict[str, set[str]]
) -> tuple[dict[str, set[str]], dict]:
    """Row linear -> its column sources, after removing every pair of ``candidates`` (see
    `_row_candidates`) that cannot be split."""
    why: dict[str, str] = {}
    rows = {r: set(srcs) for r, srcs in candidates.items()}
    for r in [r for r in rows if nodes[r].read_outside]:
        # code outside its forward computes with its weight (a parent's
        # ``proj.weight.abs().mean()``): a shard there is a mixed-tensor error or a wrong number
        why[r] = "its weight is read outside its own forward"
        for c in sorted(rows.pop(r)):
            why.setdefault(c, f"its output goes to {r}, whose weight is read outside its forward")
    for n, v in nodes.items():
        if n not in rows and n not in exclude and v.kind != "embedding":
            if STREAM in v.src and v.writer:
                why[n] = "reads and writes the residual stream: no column partner"
            elif not v.writer and not v.consumers:
                why.setdefault(n, "its output reaches no row-parallel partner")
    changed = True
    while changed:
        changed = False
        cols = set().union(*rows.values()) if rows else set()
        for c in sorted(cols):
            v = nodes[c]
            reason = (
                (v.writer and "its output also goes to the residual stream")
                or v.needs_whole
                or (v.uneven and v.uneven)
                or (v.split < 0 and "its output is split in inconsistent ways")
                or (v.kind == "embedding" and v.src and "it is an embedding fed by activations")
                or next(
                    (f"{k} also needs its whole output" for k in v.consumers if k not in rows), ""
                )
                or next(
                    (f"its input comes from column-parallel {s}" for s in v.src if s in cols), ""
                )
            )
            if reason:
                why[c] = reason
                for r in [r for r, s in rows.items() if c in s]:
                    why[r] = f"its input comes from {c}, which cannot be split: {reason}"
                    del rows[r]
                    changed = True
        for r in list(rows):
            if r in cols:
                why[r] = "it is fed by column linears but also feeds row linears"
                del rows[r]
                changed = True
    return rows, why


def generic_name(name: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp``."""
    return ".".join("*" if p.isdigit() else p for p in name.split("."))


def _collapse(entries: dict[str, Any], all_names: list[str]) -> dict[str, Any]:
    """Replace per-layer names by ``*`` patterns where every layer agrees."""
    groups: dict[str, list[str]] = {}
    for n in entries:
        groups.setdefault(generic_name(n), []).append(n)
    by_pattern: dict[str, list[str]] = {}  # every name per pattern, computed once
    for n in all_names:
        by_pattern.setdefault(generic_name(n), []).append(n)
    out: dict[str, Any] = {}
    for pattern, members in groups.items():
        values = [entries[m] for m in members]
        everyone = by_pattern.get(pattern, [])
        if (
            pattern != members[0]
            and all(v == values[0] for v in values)
            and set(everyone) == set(members)
        ):
            out[pattern] = values[0]
        else:
            out.update({m: entries[m] for m in members})
    return out


def _common_parent(names: list[str]) -> str:
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for comps in zip(*parts):
        if len(set(comps)) != 1:
            break
        common.append(comps[0])
    return ".".join(common)


def _trace_for_inference(analysis: Analysis, mixed: bool) -> Trace:
    model = analysis.model
    try:
        try:
            return analysis.trace(mixed=mixed)
        except Exception:  # noqa: BLE001 - model code may do anything on meta
            # code that needs values (a data-dependent branch): one real forward, when the
            # weights are real and small enough for that to be cheap
            params = list(model.parameters())
            small = sum(p.numel() for p in params) <= REAL_TRACE_MAX_PARAMS
            if not params or params[0].device.type == "meta" or not small:
                raise
            return analysis.trace(real=True, mixed=mixed)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(
            f"Could not trace {type(model).__name__} on the meta device to infer a plan "
            f"({type(exc).__name__}: {exc}); pass plan={{'module.pattern': 'colwise' | "
            "'rowwise' | ...}} or a YAML plan from configs/, or example_inputs= that its "
            "forward accepts."
        ) from exc


def _vocabulary(model: nn.Module, draft: Draft) -> None:
    """Input embedding (and every module sharing its weight) vocab-parallel, the output head
    gathered; a parameter tied to one of them elsewhere (BERT's ``cls.predictions.bias``) laid
    out the same way by its own entry. The modules styled are excluded from pairing."""
    styles, exclude = draft.styles, draft.exclude
    modules = dict(model.named_modules())
    embed, head = input_embeddings(model), output_embeddings(model)
    embed_weight = getattr(embed, "weight", None)
    nodes = draft.nodes
    for name, mod in modules.items():
        if name in nodes and nodes[name].read_outside:
            # a table read outside its forward (Gemma-4's pad row, Perceiver's decoder reading
            # the input embedding, MobileBERT's head reading the tied decoder) stays whole: a
            # split one reaches that code as a shard
            draft.why[name] = "its weight is read outside its own forward"
            exclude.add(name)
            continue
        lookup = isinstance(mod, nn.Embedding) or (
            name in nodes and nodes[name].kind == "embedding"
        )
        if lookup and embed_weight is not None and mod.weight is embed_weight:
            styles[name] = "vocab_parallel"
            exclude.add(name)
        elif head is not None and mod is head and kind_of(mod) == "linear":
            styles[name] = "colwise_gather_output"
            exclude.add(name)
    owners_of: dict[int, list[tuple[str, str]]] = {}
    for name, mod in modules.items():
        for pname, p in mod.named_parameters(recurse=False):
            owners_of.setdefault(id(p), []).append((name, pname))
    for tied in owners_of.values():  # first seen first: a head's weight before its bias
        vocab = [styles[n] for n, _ in tied if n in exclude and n in styles]
        for name, pname in tied:
            if not vocab or name in exclude:
                continue
            if (
                vocab[0] == "vocab_parallel"
                and pname == "weight"
                and kind_of(modules[name]) == "linear"
            ):
                # a head no `output_embeddings` names (BLIP's text decoder): it computes with
                # the split table, gathered, not with a rank's shard as if it were whole
                styles[name] = "colwise_gather_output"
                exclude.add(name)
            else:
                styles[f"{name}.{pname}"] = vocab[0]


def _bags(model: nn.Module, draft: Draft) -> None:
    """Every ``nn.EmbeddingBag`` (a recommender's tables) split by columns, its output gathered
    (``colwise_embedding_gather``: exact for every bag mode). One with ``max_norm`` stays whole:
    its in-place renormalisation reads each row's norm over all the columns."""
    styles = draft.styles
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.EmbeddingBag) or name in styles:
            continue
        if mod.max_norm is not None:
            draft.why[name] = f"max_norm={mod.max_norm} renormalises each row over all its columns"
        else:
            styles[name] = "colwise_embedding_gather"


#: a table worth splitting: at least this share of the model's >= 2-D parameter elements
TABLE_SHARE = 0.01


def _tables(model: nn.Module, draft: Draft) -> None:
    """Every other large id-fed ``nn.Embedding`` split too. One that looks up its own first
    input (a seq2seq decoder's vocabulary in FSMT, Gemma-3n's per-layer tables, a third of the
    model) is vocab-parallel, exact like the input embedding (masked lookup, all-reduced). One
    whose forward makes its own ids (LED's 16384-row position table looks up ``arange``, so
    masking its input would mask the wrong tensor) is split by columns and gathered
    (``colwise_embedding_gather``): exact for any lookup. One collective per lookup, so a table
    under `TABLE_SHARE` of the parameters stays whole; so do tied weights, a weight read
    outside the table's forward, a table the trace never ran (a tower's position table whose
    weight its code interpolates: how it is read is unknown), ``max_norm`` (rows renormalised over all their columns) and
    sparse gradients."""
    styles = draft.styles
    total = sum(p.numel() for p in model.parameters() if p.ndim >= 2)
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    for name, node in draft.nodes.items():
        mod = model.get_submodule(name)
        if node.kind != "embedding" or name in styles or node.src or node.read_outside:
            continue
        if name not in draft.info.module_inputs:
            continue  # never run by the trace: how its weight is read is unknown
        # a functional table (`tpkit.trace.trace`: F.embedding on its own weight) says the same
        if getattr(mod, "max_norm", None) is not None or getattr(mod, "sparse", False):
            continue
        if counts.get(id(mod.weight), 0) > 1 or mod.weight.numel() < TABLE_SHARE * total:
            continue
        styles[name] = "vocab_parallel" if node.ids_first else "colwise_embedding_gather"
        draft.why.pop(name, None)
        draft.groups.append(Group((name,)))  # for shipped plans


def _column_style(node: Node) -> str:
    if node.kind == "embedding":
        return "colwise_embedding"
    return {2: "packed_colwise", 3: "packed_qkv_colwise"}.get(node.split, "colwise")


def _group(modules: dict[str, nn.Module], draft: Draft, r: str, cols: set[str]) -> Group:
    """Styles, fix-ups and counts for one row linear ``r`` and its column sources (``modules``:
    the model's, by name, walked once for every group)."""
    info, styles, fixups = draft.info, draft.styles, draft.fixups
    nodes = info.nodes
    pair = sorted(cols) + [r]
    counts = {}
    for c in sorted(cols):
        v = nodes[c]
        styles[c] = _column_style(v)
        counts[f"output features of {c}"] = v.out // max(1, v.split)
    styles[r] = "rowwise"
    counts[f"input features of {r}"] = in_width(modules[r], nodes[r].kind)
    parents = {n.rsplit(".", 1)[0] for n in pair if "." in n} | {_common_parent(pair)}
    for name in _dead_siblings(nodes, styles, parents, pair):
        styles[name] = "colwise"
        counts[f"output features of {name}"] = nodes[name].out
        pair.append(name)
    heads = _head_counts([modules[o] for o in sorted(parents) if o in modules], counts)
    for c in sorted(cols):
        for user in sorted(nodes[c].per_head_consumers - set(pair)):
            split = _one_per_head(modules.get(user), heads)
            for pname in split:
                styles[f"{user}.{pname}"] = "colwise"  # one value per head: split as the heads
                pair.append(f"{user}.{pname}")
            if not split:
                styles[user] = "replicated_with_grad_allreduce"
                pair.append(user)  # replicated with the group: then its gradient is whole
    owners = {n.rsplit(".", 1)[0] for n in pair if "." in n}
    owners.add(_common_parent(pair))
    widths = set(counts.values())
    for owner in sorted(o for o in owners if o in modules):
        fix = _owner_fixups(modules[owner], widths, info, owner)
        if fix:
            fixups[owner] = {**fixups.get(owner, {}), **fix}
            for attr in fix.get("divide", []):
                counts[f"{owner}.{attr}"] = getattr(modules[owner], attr)
        for pname in _per_head_params(modules[owner], widths):
            styles[f"{owner}.{pname}"] = "colwise"  # split by heads, like the heads
            pair.append(f"{owner}.{pname}")
        for conv in _channel_convs(modules[owner], owner, widths, info, styles):
            styles[conv] = "channelwise"
            pair.append(conv)
    return Group(tuple(pair), tuple(sorted(owners & set(fixups))), counts)


def _dead_siblings(nodes: dict[str, Node], styles: dict, parents: set[str], pair: list[str]):
    """Linears beside a pair's columns (the same parent) whose output reaches nothing the
    model returns (`Node.dead`: MRA's key and value where its attention kernel is missing and
    the attention is zeros made like the queries): split by columns with them, so the code
    that shapes their output per head (``view(b, -1, heads, d)``) sees the rank's heads as it
    does for the queries; exact, since no value of theirs reaches the output or a gradient."""
    widths = {nodes[c].out for c in pair if c in nodes}
    for name, v in nodes.items():
        if not v.dead or name in styles or name in pair or v.kind != "linear":
            continue
        if name.rpartition(".")[0] in parents and v.out in widths and not v.consumers:
            yield name


def _channel_convs(owner: nn.Module, name: str, widths: set[int], info: Trace, styles: dict):
    """The owner's depthwise ``nn.Conv1d`` children as wide as a split part: a gated short
    convolution (LFM2's ``B, C, x = in_proj(h).chunk(3)``, ``conv(B * x)``, ``out_proj(C * y)``)
    convolves each channel on its own, so the rank's channels are exact; the code reads the
    conv's weight directly (``causal_conv1d_fn``) where the trace cannot see it. One fed the
    stream is not on the split path and stays whole."""
    for child, mod in owner.named_children():
        full = f"{name}.{child}" if name else child
        if not isinstance(mod, nn.Conv1d) or full in styles:
            continue
        c = mod.out_channels
        if mod.groups != c or mod.in_channels != c or c not in widths:
            continue
        if any(STREAM in tags for _, _, tags in info.module_inputs.get(full, [])):
            continue
        yield full


def _tails(model: nn.Module, draft: Draft) -> None:
    """A replicated linear whose output is cut unevenly, its first part into a column linear and
    the rest elsewhere (MLA's kv_a_proj_with_mqa: [kv latent | rope key], the rope key broadcast
    straight to the rank's heads): that rest gets a partial gradient on each rank, so its
    gradient is all-reduced (``tail_grad_allreduce``). The trace says which linears each part
    reaches (`Node.cut_reach`): when every part reaches column linears only (a fused gate_up cut
    [12 | 14], both parts into ``down``), their f already makes the gradient whole and the linear
    stays plainly replicated; a tail that reaches a column linear too would be summed twice, so
    then, or when the cut does not show which part feeds the column linear, its groups stay
    whole."""
    nodes, styles, groups = draft.nodes, draft.styles, draft.groups
    modules = dict(model.named_modules())
    columns = {c for cols in draft.rows.values() for c in cols}
    for name, v in nodes.items():
        if name in styles or not v.uneven or not v.consumers or not v.consumers <= columns:
            continue
        if len(v.cut_reach) == len(v.cuts) and all(r and r <= columns for r in v.cut_reach):
            continue  # every part reaches column linears only: their f makes its gradient whole
        feeds = [in_width(modules[c], nodes[c].kind) for c in v.consumers]
        # the tail must reach no column linear: through one, its gradient is already whole
        # after the column's f, and all-reducing it again counts it tp times
        tail_free = len(v.cut_reach) == len(v.cuts) and not any(
            reach & columns for reach in v.cut_reach[1:]
        )
        if len(v.cuts) >= 2 and len(feeds) == 1 and feeds[0] == v.cuts[0] and tail_free:
            styles[name] = "tail_grad_allreduce"
            draft.args[name] = {"tail": v.out - v.cuts[0]}
            for i, g in enumerate(groups):
                if v.consumers & set(g.modules):
                    draft.extend_group(i, name)
            continue
        for g in groups:
            if v.consumers & set(g.modules):
                for m in g.modules:
                    styles[m] = "replicate"
                    draft.why[m] = f"{name} also feeds the split heads directly, not through them"


def _role(modules: dict[str, nn.Module], name: str) -> tuple:
    """(grandparent, parent's class, child name): a decoder-only model's cross-attention
    ``encoder_attn.k_proj`` plays the role its ``self_attn.k_proj`` plays (the same class)."""
    parent, _, child = name.rpartition(".")
    grand = parent.rpartition(".")[0]
    return (grand, type(modules.get(parent)).__name__, child)


def _unreached_like_siblings(model: nn.Module, draft: Draft) -> None:
    """Modules the trace never ran are split like a sibling that did: experts (128 of
    NLLB-MoE's, with 21 trace tokens routed round-robin) by name up to their numbers, a
    decoder-only model's unused cross-attention like its self-attention (`_role`); same class
    and weight shape. They join that sibling's group, so what settles it settles them."""
    key = lambda n: re.sub(r"(?<=[._])\d+(?=\.|$)", "#", n)  # noqa: E731 - expert_2, not fc2
    nodes, styles, fixups = draft.nodes, draft.styles, draft.fixups
    modules = dict(model.named_modules())
    reached = [n for n in styles if n in nodes and (nodes[n].src or nodes[n].consumers)]
    ran = {key(n): n for n in reached}
    by_role = {_role(modules, n): n for n in reached}
    for name, node in nodes.items():
        twin = ran.get(key(name)) or by_role.get(_role(modules, name))
        if name in styles or node.src or node.consumers or node.writer or twin is None:
            continue
        if node.read_outside:  # never ran its forward, yet its weight was read: whole
            continue
        a, b = modules[name], modules[twin]
        if type(a) is not type(b) or getattr(a, "weight", None) is None:
            continue
        if tuple(a.weight.shape) != tuple(b.weight.shape):
            continue
        styles[name] = styles[twin]
        draft.why.pop(name, None)
        owner, twin_owner = name.rpartition(".")[0], twin.rpartition(".")[0]
        if twin_owner in fixups and owner not in fixups:
            fixups[owner] = dict(fixups[twin_owner])  # the heads it divides, as its twin's
        for i, g in enumerate(draft.groups):
            if twin in g.modules:
                joins = owner in fixups and twin_owner in g.owners
                draft.extend_group(i, name, owner if joins else None)


def infer_plan(model: nn.Module, example_inputs: tuple | dict | None = None) -> Plan:
    """A `Plan` for ``model`` from its dataflow (see the module docstring); source "inferred".

    ``example_inputs`` (positional tuple or kwargs dict, any device) replaces the default trace
    inputs: ``input_ids`` of shape [3, 7] for transformers models, else a float tensor shaped for
    the first linear. Raises ValueError when the model cannot be traced on meta. A hybrid whose
    layer list mixes types is read both ways (`tpkit.trace.trace.blocks`' ``mixed``); the plan
    that splits more of its weights is kept (the unmixed reading is skipped where it has no
    blocks and can find no pair).
    """
    return infer(Analysis(model, example_inputs))


def infer(analysis: Analysis) -> Plan:
    """`infer_plan` on an analysis: its trace and dry runs are the ones every stage shares.
    Derived once per analysis (``analysis.inferred``: the plan, or the ValueError raised, is
    the same each time, as every forward it reads is); each caller gets its own copy."""
    if analysis.inferred is None:
        try:
            analysis.inferred = _infer(analysis)
        except ValueError as exc:
            analysis.inferred = exc
    if isinstance(analysis.inferred, ValueError):
        raise analysis.inferred
    return copy.deepcopy(analysis.inferred)


def _infer(analysis: Analysis) -> Plan:
    model = analysis.model
    plan = _infer_once(analysis, mixed=True)
    if has_mixed_blocks(model) and not _unmixed_finds_no_pair(analysis):
        other = _infer_once(analysis, mixed=False)
        if _sharded(model, other) > _sharded(model, plan):
            plan = other
    return plan


def _unmixed_finds_no_pair(analysis: Analysis) -> bool:
    """Whether the unmixed reading of a hybrid (`blocks` with ``mixed=False``) can find no
    column/row pair, read off the mixed reading's trace: then it cannot split more than the
    mixed reading, and is not run (a whole trace of the model, unfolded: no blocks, no twins).

    Where it has blocks and the forward runs none (Inkling-2's vision tower, fed the text
    alone), no module is a stream boundary: no linear writes a stream. Where it has none
    (the only layer list mixes types: Inkling-2's sliding and full layers), its one stream
    boundary is the model itself. Fed no float tensor, nothing is the
    stream on the way in, and no tag ever holds `STREAM` inside: the only linears it marks as
    writing the stream are those in the tags of what the model returns in its first output's
    shape (`Trace.returns`). Tags differ between readings only where they crossed a block
    boundary, which makes them `STREAM` in the mixed trace; so where the mixed trace's
    ``returns`` holds no `STREAM`, the unmixed reading's writers are among its linears. When they are all
    kept out of pairing (the vocabulary head), no linear it sees is row-parallel: no pair, no
    gathered pair, no tail, no per-head or channel split beside one; the splits it is run for
    (Zamba2's shared transformer read inside its hybrid layers) cannot come from it. Its
    other passes (vocabulary, experts, Mamba mixers, attention modules, tables, bags,
    convolutions) read the modules, not the stream: the mixed reading runs them alike, on
    every module its pairs left (measured: on every hybrid of the sweeps whose unmixed
    reading has no blocks, that reading split fewer weights: Inkling-2, Inkling-2-Loop,
    Zamba, Jamba, OLMo-Hybrid, Mllama's text model)."""
    model = analysis.model
    # the trace the mixed reading read: fake, or real where the fake one failed
    info = analysis.traced() or analysis.traced(real=True)
    if info is None:
        return False
    unmixed = blocks(model, mixed=False)
    if unmixed:
        # blocks the forward never enters (a VLM's vision tower, fed the text alone: no
        # trace records their inputs) are no boundary, and with blocks the model is none
        # either: no tag is ever `STREAM`, no linear writes a stream, no pair
        return not any(name in info.module_inputs for name, _ in unmixed)
    if info.fed_floats or STREAM in info.returns:
        return False
    draft = Draft(info)
    _vocabulary(model, draft)
    return info.returns <= draft.exclude


def _sharded(model: nn.Module, plan: Plan) -> int:
    """Elements of >=2-D parameters ``plan`` splits; -1 when it lays one tied parameter out
    two ways (validation would refuse it)."""
    layouts = param_layouts(model, plan)
    seen: dict[int, object] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if seen.setdefault(id(p), layouts[name][1]) != layouts[name][1]:
            return -1
    params = dict(model.named_parameters())
    return sum(params[n].numel() for n in params if params[n].ndim >= 2 and layouts[n][1].sharded)


def _infer_once(analysis: Analysis, mixed: bool) -> Plan:
    """`infer_plan` for one reading of the stream: the passes over one `Draft`, then settled at
    tp=2 where the model's code cannot run the split (`tpkit.settle.settle.fewest_replicated`)."""
    model = analysis.model
    draft = Draft(_trace_for_inference(analysis, mixed))
    _vocabulary(model, draft)
    draft.candidates = _row_candidates(draft.nodes, draft.exclude)
    draft.rows, draft.why = _pairs(draft.nodes, draft.exclude, draft.candidates)
    _bags(model, draft)
    modules = dict(model.named_modules())
    for r, cols in draft.rows.items():
        draft.groups.append(_group(modules, draft, r, cols))
    _tails(model, draft)
    draft.add_groups(
        expert_groups(model, draft.info, draft.exclude, draft.styles, draft.why, draft.fixups)
    )
    _unreached_like_siblings(model, draft)
    mixers, mixer_groups = ssm_groups(model)  # Mamba-1 mixers: split by channels
    for name, style in mixers.items():
        draft.styles[name] = style
        draft.why.pop(name, None)
    draft.add_groups(mixer_groups)
    _attention(model, draft)
    _tables(model, draft)
    gathered, draft.notes = gathered_pairs(
        model, draft.nodes, draft.candidates, draft.styles, draft.why
    )
    draft.groups.extend(gathered)
    _conv_pairs(analysis, draft)  # last: beside the gathered pairs too
    runs = lambda plan, tp: dry_run(analysis, plan, tp)  # noqa: E731
    return fewest_replicated(model, draft.plan(model), runs)


#: fewer output channels per rank than this at tp=2 (inference plans at tp=2: a convolution
#: must have twice this many in all) and a convolution nothing pairs is not worth a gather
_MIN_CONV_CHANNELS = 64


def _conv_pairs(analysis: Analysis, draft: Draft) -> None:
    """Convolution pairs (`tpkit.sources.convs`: a conformer's pointwise -> GLU -> depthwise ->
    BatchNorm -> pointwise) among the convolutions no other pass claimed, one group each.
    Only next to other splits: a model with nothing else to split takes the per-layer
    fallback, which pairs the same convolutions and gathers the rest."""
    if all(style == "replicate" for style in draft.styles.values()):
        return
    model = analysis.model
    shared, exact = shared_params(model), exact_row_convs(model)
    free = lambda name, mod: name not in draft.styles and splittable_conv(mod, shared, exact)  # noqa: E731
    analysis.settle_inputs()
    pairs = conv_pairs(model, 2, free, analysis.example, analysis.recipe, analysis)
    for name, style in pairs.styles.items():
        draft.styles[name] = style
        draft.why.pop(name, None)
        draft.notes[name] = pairs.notes[name]
    draft.fixups.update(pairs.fixups)
    draft.add_groups(pairs.groups)
    modules = dict(model.named_modules())
    for name, broke in pairs.broken.items():
        # a convolution whose channels are then read across (a conformer's LayerNorm over the
        # channels after its depthwise conv): split by output channels and gathered, as the
        # per-layer fallback does; exact whatever reads it
        mod = modules.get(name)
        if name in draft.styles or mod is None or not free(name, mod):
            continue
        if getattr(mod, "groups", 0) == 1 and mod.out_channels >= 2 * _MIN_CONV_CHANNELS:
            draft.styles[name] = "conv_colwise_gather"
            draft.why.pop(name, None)
            draft.notes[name] = f"not paired ({broke}): output channels gathered"
            draft.groups.append(Group((name,)))


def _attention(model: nn.Module, draft: Draft) -> None:
    """``nn.MultiheadAttention`` split by heads (`tpkit.sources.attention`): its projections are
    bare parameters the trace does not see as layers; then modules calling torch's
    ``multi_head_attention_forward`` on their child linears (WavLM); one group each."""
    styles, groups, why = mha_splits(model, shared_params(model), set(draft.styles))
    for name, style in styles.items():
        draft.styles[name] = style
        draft.why.pop(name, None)
    draft.why.update(why)
    draft.groups.extend(groups)
    calls = draft.info.functional_mha
    taken = {n for n, s in draft.styles.items() if s != "replicate"}
    styles, args, groups = functional_splits(model, calls, taken)
    for name, style in styles.items():
        draft.styles[name] = style
        draft.why.pop(name, None)
    draft.args.update(args)
    draft.groups.extend(groups)


def _owner_fixups(owner: nn.Module, widths: set[int], info: Trace, owner_name: str) -> dict:
    divide = []
    for attr in HEAD_ATTRS + WIDTH_ATTRS:
        value = owner.__dict__.get(attr)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            continue
        if attr in HEAD_ATTRS or value in widths:
            divide.append(attr)
    if not divide:
        return {}
    heads = [owner.__dict__[a] for a in divide if a in HEAD_ATTRS]
    head_inputs = {}
    if heads:
        h, b = heads[0], info.batch
        for key, shape, tags in info.module_inputs.get(owner_name, []):
            if tags or len(shape) < 2:
                continue  # tagged inputs are already sharded (T5's position_bias) or the stream
            if shape[0] == b * h and shape[0] != b:
                head_inputs[key] = 0
            elif len(shape) == 3 and shape[0] == h and h != b:
                head_inputs[key] = 0  # [heads, 1, keys], shared by the batch (MPT's ALiBi)
            elif len(shape) == 4 and shape[1] == h and shape[0] in (1, b):
                head_inputs[key] = 1
    out: dict[str, Any] = {"divide": divide}
    if head_inputs:
        out["head_inputs"] = head_inputs
    if heads and (buffers := _head_buffers(owner, heads[0])):
        out["head_buffers"] = buffers
    return out


def _head_buffers(owner: nn.Module, heads: int) -> dict[str, int]:
    """The owner's own buffers laid out per head, computed at init for every head (MiniMax's
    lightning-attention ``slope_rate`` [heads, 1, 1], ``diagonal_decay`` [1, heads, n, n]):
    name -> the heads dim, so each rank keeps its heads' values. Values only: an integer
    buffer is an index (Donut-Swin's ``relative_position_index`` [window area, window area],
    whose 4 x 4 at a 2-patch window equals 4 heads by chance: cut per head, it scrambled the
    position bias of every rank, with no error)."""
    out = {}
    for name, buf in owner.named_buffers(recurse=False):
        if buf is None or buf.ndim < 2 or not (buf.is_floating_point() or buf.is_complex()):
            continue
        if buf.shape[0] == heads:
            out[name] = 0
        elif buf.ndim == 4 and buf.shape[0] == 1 and buf.shape[1] == heads:
            out[name] = 1
    return out


def _head_counts(owners: list[nn.Module], counts: dict[str, int]) -> tuple[set[int], set[int]]:
    """A group's head counts and head widths, from its owners: their head attributes
    (``num_heads``, ...) and ``head_dim``, their split widths over ``head_dim``. Without a
    ``head_dim`` every split width over every head count may be a head's width."""
    widths = set(counts.values())
    heads: set[int] = set()
    dims: set[int] = set()
    for owner in owners:
        heads |= {v for a in HEAD_ATTRS if isinstance(v := owner.__dict__.get(a), int) and v > 1}
        head_dim = owner.__dict__.get("head_dim")
        if isinstance(head_dim, int) and head_dim > 0:
            dims.add(head_dim)
            heads |= {w // head_dim for w in widths if w % head_dim == 0 and w > head_dim}
    if not dims:
        dims = {w // h for w in widths for h in heads if w % h == 0}
    return heads, dims


def _one_per_head(module: nn.Module | None, heads: tuple[set[int], set[int]]) -> list[str]:
    """The parameters of a per-head consumer (`Node.per_head_consumers`) that hold one value
    per head (NeoMME's exclusive self-attention ``alpha`` [heads], scaling each head's output):
    split with the heads, not replicated (a rank's heads read their own values; whole, the
    split forward broadcasts all heads' values against the rank's). All of its parameters, or
    none: 1-D, as long as a head count of the group and not as a head's width (a per-head norm
    [head_dim] acts within each head, the same on every rank)."""
    if module is None or any(True for _ in module.children()):
        return []
    params = list(module.named_parameters(recurse=False))
    if not params:
        return []
    counts, dims = heads
    ok = all(p.ndim == 1 and p.shape[0] in counts and p.shape[0] not in dims for _, p in params)
    return [n for n, _ in params] if ok else []


def _per_head_params(owner: nn.Module, widths: set[int]) -> list[str]:
    """The owner's own parameters with one value per head (GPT-OSS's attention ``sinks``,
    Swin-v2's ``logit_scale`` of shape [heads, 1, 1]),
    read by its code next to the rank's heads: they are split as the heads are. Head counts
    come from the owner's head attributes, or its split widths over its ``head_dim``."""
    heads = {v for a in HEAD_ATTRS if isinstance(v := owner.__dict__.get(a), int)}
    head_dim = owner.__dict__.get("head_dim")
    if isinstance(head_dim, int) and head_dim > 0:
        heads |= {w // head_dim for w in widths if w % head_dim == 0}
    heads.discard(head_dim)  # a [head_dim] parameter (DiffLlama's lambdas) acts within a head
    return [  # [heads] or [heads, 1, 1] (Swin-v2's logit_scale)
        n
        for n, p in owner.named_parameters(recurse=False)
        if p.ndim >= 1 and p.shape[0] in heads and p.shape[0] > 1 and math.prod(p.shape[1:]) == 1
    ]


def _common_head_inputs(fixups: dict[str, dict]) -> dict[str, dict]:
    """Keep a per-head input only where every layer of the same kind receives it: an input that
    only some layers get was made by an earlier layer (T5 passes its bias on), already per rank."""
    by_kind: dict[str, list[dict]] = {}
    for name, fix in fixups.items():
        by_kind.setdefault(generic_name(name), []).append(fix)
    out = {}
    for name, fix in fixups.items():
        fix = dict(fix)
        shared = [f.get("head_inputs", {}) for f in by_kind[generic_name(name)]]
        common = {
            k: v for k, v in fix.pop("head_inputs", {}).items() if all(k in h for h in shared)
        }
        out[name] = {**fix, "head_inputs": common} if common else fix
    return out


def _collapse_groups(groups: list[Group]) -> list[Group]:
    """One group per layer kind: names to ``*`` patterns, with the counts every layer of that
    kind shares. Where the layers' counts differ (Swin-v2's heads per stage: 3, 6, 12, 24),
    that kind's groups stay per layer, so that settling keeps whole only the layers tp does
    not divide (the first layer's counts stood for all: every stage whole at tp=2)."""
    kinds: dict[tuple, list[Group]] = {}
    for g in groups:
        kinds.setdefault(tuple(generic_name(m) for m in g.modules), []).append(g)
    out = []
    for key, same in kinds.items():
        counts = [
            {re.sub(r"(?<=\.)\d+(?=\.|$)", "*", k): v for k, v in g.counts.items()} for g in same
        ]
        if all(c == counts[0] for c in counts):
            out.append(Group(key, tuple(generic_name(o) for o in same[0].owners), counts[0]))
        else:
            out.extend(same)
    return out
