"""The dataflow trace that plan inference reads: one forward on fake meta tensors.

Parameters and buffers are swapped for fake meta tensors (nothing is computed or allocated) while
a ``TorchFunctionMode`` tags every tensor with the *linear-like* modules (``nn.Linear``, GPT-2's
``Conv1D``, ``nn.Embedding``) whose outputs reach it without passing through another one. The
hidden states entering each repeated block (the elements of the outermost ``nn.ModuleList``) are
the *residual stream*. Per linear-like module the trace records (`Node`): which linears or the
stream feed it, who consumes its output, whether it writes into the stream, whether its whole
output is needed somewhere, and how its features are split or sliced afterwards (packed parts,
uneven cuts, per-head reshapes). `tpkit.sources.infer` turns that into column/row pairs.

A module of the model's own with a 2-D ``weight`` that its forward hands to ``F.linear`` /
``F.embedding`` (I-BERT's ``QuantLinear``) is a linear-like module from that call on
(`_Tracer._functional_layer`). What each tensor was computed from is kept too, so that a
linear none of whose output reaches the model's output is marked (`Node.dead`).

It runs the model as the dry run does (`tpkit.trace.fake`), with tags added.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tpkit.compat import fake_mode
from tpkit.plan.layout import kind_of, out_width
from tpkit.trace.fake import (
    example_inputs,
    fake_friendly_experts,
    fake_inputs,
    meta_state,
    quiet_fake_tensors,
    trace_batch,
    trace_one_row,
)
from tpkit.trace.fold import Describe, Relative, Twins, folded, known_values
from tpkit.trace.inputs import InputRecipe, text_only, unflattened_patches
from tpkit.trace.reductions import reduced_dims
from tpkit.trace.shadow import (
    GivenValues,
    ShadowValues,
    metadata_only,
    needs_values,
    tensors_in,
)
from tpkit.trace.twins import TwinRecords

__all__ = [
    "STREAM",
    "Node",
    "Trace",
    "blocks",
    "generic",
    "has_mixed_blocks",
    "record_reshape",
    "repeated_blocks",
    "trace",
]

STREAM = "<stream>"


@dataclass
class Node:
    """What the trace learned about one linear-like module."""

    kind: str  # "linear", "conv1d" or "embedding"
    out: int
    src: set[str] = field(default_factory=set)
    consumers: set[str] = field(default_factory=set)
    per_head_consumers: set[str] = field(default_factory=set)
    writer: bool = False
    needs_whole: str = ""  # why its whole output is needed somewhere ("" = never)
    split: int = 1
    uneven: str = ""
    cuts: list[int] = field(default_factory=list)  # sizes of the first uneven cut of its features
    ids_first: bool = False  # an embedding that looks up exactly its first input (its ids)
    read_outside: bool = False  # its weight is computed with outside its own forward
    # per part of its first uneven cut (`cuts`), the linear-like modules that part's values reach
    # before another linear: which consumer reads which part (`tpkit.sources.infer`'s tails)
    cut_reach: list[set[str]] = field(default_factory=list)
    reduced: str = ""  # an op that reads across its split features ("" = none; see `tpkit.trace.reductions.REDUCTIONS`)
    # bare parameters (held by modules that are not linear-like) whose values meet its output
    # broadcast over the split features with no linear in between (MLCD's ``class_pos_emb``
    # in the rotary cos/sin that multiply each head's queries): a rank's gradient for them
    # covers its heads only (`tpkit.settle.complete.complete_param_grads`)
    partial_params: set[str] = field(default_factory=set)
    # no value of its output reaches the model's output (MRA's key and value on a machine
    # without its attention kernel, which returns zeros): `tpkit.sources.infer` splits it with
    # its siblings, exact whatever its shards hold
    dead: bool = False


_tensors = tensors_in


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


# elementwise ops whose operands broadcast against each other
_ELEMENTWISE = frozenset(
    {"mul", "__mul__", "__rmul__", "add", "__add__", "__radd__", "sub", "__sub__", "__rsub__"}
    | {"div", "__truediv__", "__rtruediv__", "__iadd__", "__imul__", "addcmul"}
)

# ops that contract a head-split tensor with another one per head (a table read by each head)
_PER_HEAD_PRODUCTS = frozenset({"matmul", "__matmul__", "bmm", "einsum", "baddbmm"})
#: torch's ``multi_head_attention_forward``'s positional arguments, in order
_MHA_ARGS = (
    "query",
    "key",
    "value",
    "embed_dim_to_check",
    "num_heads",
    "in_proj_weight",
    "in_proj_bias",
    "bias_k",
    "bias_v",
    "add_zero_attn",
    "dropout_p",
    "out_proj_weight",
    "out_proj_bias",
    "training",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "use_separate_proj_weight",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
)


def _einsum_lacks(args: tuple, a: torch.Tensor, b: torch.Tensor, j: int) -> bool:
    """In ``torch.einsum(equation, *operands)``, operand ``a`` has no subscript for dim ``j``
    of operand ``b`` (``b``'s heads): every head reads all of ``a``. False where the equation
    cannot be read (an ellipsis, operands not found)."""
    if not args or not isinstance(args[0], str) or "..." in args[0] or b.shape[j] <= 1:
        return False
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    subs = args[0].replace(" ", "").split("->")[0].split(",")
    ia = next((i for i, t in enumerate(ops) if t is a), None)
    ib = next((i for i, t in enumerate(ops) if t is b), None)
    if ia is None or ib is None or len(subs) != len(ops) or len(subs[ib]) != b.ndim:
        return False
    return subs[ib][j] not in subs[ia]


#: operators that write into their first argument (``__get__`` of an attribute does not)
_IN_PLACE_DUNDERS = frozenset(
    {"__setitem__", "__set__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ior__"}
    | {"__iand__"}
)
# calls that read a tensor's metadata, not its values (`_Tracer._record_made_from`)
_METADATA = frozenset(
    {"size", "dim", "numel", "stride", "__get__", "is_floating_point", "is_complex"}
    | {"element_size", "is_contiguous", "storage_offset", "__len__", "ndimension", "nelement"}
)

# ``tensor.new_*(size)``: a new tensor with the given tensor's dtype and device, none of its
# values (Funnel's ``inputs_embeds.new_ones(...)`` for its <cls> mask: no embedding's output)
_NEW_FROM = frozenset({"new_ones", "new_zeros", "new_empty", "new_full", "new_tensor"})

# ``a.type_as(b)``, ``a.expand_as(b)``...: ``a``'s values in ``b``'s dtype or shape, none of
# ``b``'s values (Funnel's attention mask made ``type_as`` its embeddings: no embedding's output)
_LIKE = frozenset({"type_as", "expand_as", "view_as", "reshape_as"})

# ops that join tensors along a dim (`_Tracer._join`)
_JOINS = frozenset({"cat", "concat", "concatenate", "stack", "hstack"})
#: the calls whose output shape says how a feature dim is cut into blocks (`Trace.reshapes`)
_RESHAPES = frozenset({"view", "reshape", "unflatten", "flatten"})


def record_reshape(out: dict[str, list], where: str, name: str, args: tuple, result: Any) -> bool:
    """Add a call to ``out`` (module -> [(input shape, output shape)]) if it is a reshape of a
    tensor: what the dry run compares. One function for the trace and the dry run's reference
    run, so that the trace's record stands for the reference's (`Trace.reshapes`)."""
    tensors = args and isinstance(args[0], torch.Tensor) and isinstance(result, torch.Tensor)
    if name in _RESHAPES and tensors:
        out.setdefault(where, []).append((tuple(args[0].shape), tuple(result.shape)))
        return True
    return False


# ops that cut a tensor along a dim -> position of that dim among their arguments
_DIM_ARG = MappingProxyType(
    {
        "split": 2,
        "chunk": 2,
        "tensor_split": 2,
        "split_with_sizes": 2,
        "unbind": 1,
        "narrow": 1,
    }
)


class _Tracer(TorchFunctionMode):
    """Propagates provenance tags through every torch function call."""

    def __init__(self, nodes: dict[str, Node]):
        super().__init__()
        self.nodes = nodes
        self.tags: dict[int, frozenset[str]] = {}
        # tensor -> (linear, dim of its features' outermost factor, whether a reshape has split
        # the features into heads x per-head so that dim counts heads)
        self.origin: dict[int, tuple[str, int, bool]] = {}
        self.keep: list[torch.Tensor] = []  # ids stay unique while the trace runs
        self.active: list[str] = []  # linear-like modules whose forward is running
        # id of a linear-like module's parameter -> every module holding it (tied weights: a
        # tied head's weight read by its embedding's lookup is read inside its own forward)
        self.weights: dict[int, set[str]] = {}
        # a transposed linear weight (``weight.T``) -> the linears holding it (`_table_lookup`)
        self.transposed: dict[int, set[str]] = {}
        # tensor -> (linear, part) of the first uneven cut of its features its values come from
        self.parts: dict[int, frozenset[tuple[str, int]]] = {}
        self.first_input: dict[str, torch.Tensor] = {}  # module -> the first tensor it was given
        self.head_tables: set[str] = set()  # embeddings broadcast over a linear's heads
        self.where: list[str] = []  # the modules whose forward is running, innermost last
        # each view / reshape as (input shape, output shape), per innermost running module
        self.reshapes: dict[str, list[tuple[tuple, tuple]]] = {}
        # per reshape recorded, the tokens of the fold's calls running (`in_fold`)
        self.reshape_calls: dict[str, list[tuple[int, ...]]] = {}
        self.fold_calls: list[int] = []
        # module -> {"q", "k", "v", "out": linear, "heads": n}: its forward calls torch's
        # multi_head_attention_forward on its child linears' weights (WavLM's attention)
        self.functional_mha: dict[str, dict[str, Any]] = {}
        # tensor -> as `origin`, for pieces of a linear's output cut along other dims (one
        # token's row): followed only to find reductions over the features (`_reduction`)
        self.seen: dict[int, tuple[str, int, bool]] = {}
        # tensors whose features dim is one head's (a [.., 1, head_dim] view of a single KV
        # head): reductions over it stay within the head, which settle/kvheads.py keeps whole
        self.one_head: set[int] = set()
        # tensor -> the bare parameters whose values reach it with no linear-like module in
        # between (`Node.partial_params`)
        self.params: dict[int, frozenset[str]] = {}
        # functional layers (`_functional_layer`): id of a candidate's weight -> its name; the
        # candidates whose first forward is running, innermost last, with what `pre` saw
        self.candidate_weights: dict[int, str] = {}
        self.spoiled: set[str] = set()  # candidates whose forward read their weight otherwise
        # liveness (`dead_nodes`): tensor -> the tensors it was computed from; tensors whose
        # values left the trace (the model's output, a Python number); each node's outputs
        self.made_from: dict[int, set[int]] = {}
        self.escaped: set[int] = set()
        # the model's parameters, buffers and input tensors: what a forward writes into them
        # outlives the call (`_record_made_from`)
        self.state: set[int] = set()
        self.node_outputs: dict[str, list[int]] = {}
        self.pending: list[tuple[str, nn.Module, list, frozenset[str]]] = []

    @contextlib.contextmanager
    def in_fold(self, running: list[int]):
        """Each reshape recorded inside the block is told which of a fold's calls were running
        (``running``: the fold's tokens of them, kept up to date by the fold; `coarse_reshapes`)."""
        self.fold_calls = running
        try:
            yield
        finally:
            self.fold_calls = []

    def coarse_reshapes(self, stood: set[int]) -> dict[str, list[tuple[tuple, tuple]]]:
        """The reshapes recorded (`Trace.reshapes`), less those of the calls (their tokens,
        ``stood``) a dry run's fold would stand where the trace's fold ran them
        (`tpkit.trace.fold`'s ``coarse``): what the dry run's unsplit reference run records."""
        if not stood:
            return self.reshapes
        out: dict[str, list[tuple[tuple, tuple]]] = {}
        for where, calls in self.reshapes.items():
            running = self.reshape_calls[where]
            kept = [c for c, tokens in zip(calls, running, strict=True) if stood.isdisjoint(tokens)]
            if kept:
                out[where] = kept
        return out

    @contextlib.contextmanager
    def under(self, shadow: ShadowValues | None):
        """``shadow`` (when there is one), then this tracer, as modes: the tracer sees calls
        first and the shadow run computes their values inside."""
        with shadow if shadow is not None else contextlib.nullcontext(), self:
            yield

    def tag(self, t: torch.Tensor) -> frozenset[str]:
        return self.tags.get(id(t), frozenset())

    def set_tag(self, t: torch.Tensor, tags: frozenset[str]) -> None:
        self.keep.append(t)
        self.tags[id(t)] = tags

    def into_stream(self, tags: frozenset[str]) -> frozenset[str]:
        for name in tags:
            if name in self.nodes:
                self.nodes[name].writer = True
        return frozenset({STREAM})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if metadata_only(func):  # nothing to tag, no value escapes (`_record_made_from`)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        name = getattr(func, "__name__", "")
        where = self.where[-1] if self.where else ""
        if record_reshape(self.reshapes, where, name, args, out):
            self.reshape_calls.setdefault(where, []).append(tuple(self.fold_calls))
        # a call that returns no tensor read metadata only (LongT5 asks its bias table's
        # ``weight.device``), not the values
        reads_values = bool(_tensors(out))
        if self.candidate_weights and reads_values:
            self._candidate_reads(name, args, kwargs, inputs, out)
        if self.pending and name in ("linear", "embedding"):
            self._functional_layer(name, args, kwargs)
        for t in inputs:
            owners = self.weights.get(id(t), set())
            if owners and not owners.intersection(self.active) and reads_values:
                if _scaled_in_place(name, inputs, t):
                    continue  # RWKV's rescale, ``weight.div_(2 ** k)``: each shard alike
                # another module computes with this weight (Mamba's dt_proj.weight, a parent's
                # ``proj.weight.abs().mean()``): its layout must stay whole
                for owner in owners:
                    self.nodes[owner].needs_whole = "its weight is read outside its own forward"
                    self.nodes[owner].read_outside = True
        self._table_lookup(func, args, out)
        if func is torch.nn.functional.multi_head_attention_forward:
            self._functional_mha(args, kwargs)
        # features flow through float tensors; an index or a mask (a router's top-k choice)
        # says where rows go, not what they hold
        feats = [t for t in inputs if t.is_floating_point() or t.is_complex()]
        if (name in _ELEMENTWISE or name in _PER_HEAD_PRODUCTS) and len(feats) > 1:
            self._per_head_tables(feats, name, args)
        params = frozenset().union(*(self.params.get(id(t), frozenset()) for t in feats))
        if params and len(feats) > 1 and (name in _ELEMENTWISE or name in _PER_HEAD_PRODUCTS):
            self._partial_params(name, feats)
        tags: frozenset[str] = frozenset().union(*(self.tag(t) for t in feats))
        tags -= self.head_tables
        if name in _NEW_FROM:
            tags = frozenset()  # a new tensor of its own shape: only the dtype and device read
        elif name in _LIKE and args and isinstance(args[0], torch.Tensor):
            tags = self.tag(args[0]) - self.head_tables  # the other: its dtype or shape only
        if STREAM in tags and len(tags) > 1:
            tags = self.into_stream(tags)
        if name == "embedding" and self.active and args:
            node = self.active[-1]
            if self.first_input.get(node) is args[0] and self.nodes[node].kind == "embedding":
                self.nodes[node].ids_first = True
        in_place = (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS
        written = in_place and args and isinstance(args[0], torch.Tensor)
        target = args[0] if written else None
        if target is None and isinstance(kwargs.get("out"), torch.Tensor):
            target = kwargs["out"]  # torch.add(a, b, out=self.cache): written too
        if target is not None:
            self.set_tag(target, tags)
        outs = _tensors(out)
        for t in outs:
            self.set_tag(t, tags)
        self._record_made_from(name, inputs, outs, target)
        if params:
            for t in outs + ([target] if target is not None else []):
                self.params[id(t)] = params
        parts = frozenset().union(*(self.parts.get(id(t), frozenset()) for t in feats))
        if parts:
            for t in outs:
                self.parts[id(t)] = parts
        if name in _JOINS and args:
            self._join(name, args, kwargs)
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        followed = src is not None and (id(src) in self.origin or id(src) in self.seen)
        if followed and not self._reduction(name, args, kwargs, outs):
            self._follow_features(name, args, kwargs, out, outs)
        return out

    def _record_made_from(
        self, name: str, inputs: list, outs: list, written: torch.Tensor | None = None
    ) -> None:
        """What each output was computed from (`dead_nodes`); a call that hands values back as
        Python numbers (``.item()``, ``.tolist()``, a branch on a tensor) lets them escape, and
        so does one that writes into the model's state or inputs (``written``, or the tensor it
        views: a buffer, a static cache), whose values outlive the call for the next to read."""
        if written is not None:
            base = getattr(written, "_base", None)
            if id(written) in self.state or (base is not None and id(base) in self.state):
                self.escaped.update(id(t) for t in inputs)
            outs = [t for t in outs if t is not written] + [written]
        if not outs:
            if name not in _METADATA:
                self.escaped.update(id(t) for t in inputs)
            return
        ids = {id(t) for t in inputs}
        for t in outs:
            self.made_from.setdefault(id(t), set()).update(ids - {id(t)})
            base = getattr(t, "_base", None)  # written through a view: its base holds it too
            if base is not None:
                self.made_from.setdefault(id(base), set()).update(ids | {id(t)})

    def dead_nodes(self, roots: list[torch.Tensor]) -> None:
        """Mark `Node.dead` every node no output of which the values reaching ``roots`` (the
        model's output) or a Python number were computed from."""
        if not roots:  # an output no flattening sees into: nothing is proven dead
            return
        live: set[int] = set()
        todo = [id(t) for t in roots] + list(self.escaped)
        while todo:
            i = todo.pop()
            if i not in live:
                live.add(i)
                todo.extend(self.made_from.get(i, ()))
        for name, outs in self.node_outputs.items():
            self.nodes[name].dead = not any(i in live for i in outs)

    def _functional_layer(self, name: str, args: tuple, kwargs: Mapping) -> None:
        """A module that is no ``nn.Linear`` / ``nn.Embedding`` but whose forward applies
        ``F.linear`` / ``F.embedding`` to its own 2-D ``weight`` (I-BERT's ``QuantLinear`` and
        ``QuantEmbedding`` outside quant mode, which return ``(output, None)``) computes what
        they compute: from this call on it is a linear-like module of the trace (`Node`), its
        inputs its sources and its first output its features, so inference splits it as one
        (the styles keep its forward and swap in the rank's shards). A weight changed first
        (``F.linear(x, w * scale)``, quant mode's integer weight) is no match."""
        cand, mod, ins, tags = self.pending[-1]
        w = kwargs.get("weight", args[1] if len(args) > 1 else None)
        if cand in self.nodes or w is None or self.candidate_weights.get(id(w)) != cand:
            return
        if cand in self.spoiled:
            return
        kind = "linear" if name == "linear" else "embedding"
        node = self.nodes[cand] = Node(kind, out_width(mod, kind))
        for p in mod.parameters(recurse=False):
            self.weights.setdefault(id(p), set()).add(cand)
            self.params.pop(id(p), None)  # a layer's weight, no bare parameter
        self.active.append(cand)
        node.src |= tags
        for src in tags & self.nodes.keys():
            self.nodes[src].consumers.add(cand)
        for _, t in ins:
            for lin, i in self.parts.get(id(t), ()):
                self.nodes[lin].cut_reach[i].add(cand)

    def _candidate_reads(
        self, name: str, args: tuple, kwargs: Mapping, inputs: list, out: Any
    ) -> None:
        """A functional layer's weight read by anything but its ``F.linear`` / ``F.embedding``
        call (``F.linear(x, w) / w.norm(dim=1)``, ``w.abs().max()`` for a scale) computes
        something from the weight that a style would run on the rank's shard, and nothing here
        says it would be exact there: a candidate that reads it so before the call is no layer,
        one that does after it stays whole, as a layer whose weight is read outside its forward
        (`Node.read_outside`: no column or row style, no table split). A conversion that hands
        back the weight itself (a router's ``self.weight.float()`` on a float32 weight) reads
        nothing; an in-place change (``w.mul_``) does."""
        w = kwargs.get("weight", args[1] if len(args) > 1 else None)
        running = self.where[-1] if self.where else None
        in_place = name.endswith("_") and not name.endswith("__")
        for t in inputs:
            cand = self.candidate_weights.get(id(t))
            if cand is None or cand != running:
                continue  # read outside its forward: the owners' check marks a layer
            if name in ("linear", "embedding") and t is w:
                continue  # the call that makes it a layer
            if out is t and not in_place:
                continue  # the weight itself handed back (a dtype it already has)
            if cand in self.nodes:
                node = self.nodes[cand]
                node.needs_whole = (
                    "its forward reads its weight besides F.linear / F.embedding: what that "
                    "computes from a shard is unknown"
                )
                node.read_outside = True
            else:
                self.spoiled.add(cand)

    def _table_lookup(self, func: Any, args: tuple, out: Any) -> None:
        """A linear whose weight its own forward also looks rows up in, transposed (Ovis2.5's
        ``visual_embeddings_table``: ``F.embedding(ids, self.weight.T)`` for its indicator
        tokens) reads it by input features, which a row split cuts: each rank would look up
        ids in its own rows only (an IndexError, or another id's row with no error). It is
        marked read outside its forward, so it stays whole (`tpkit.sources.infer`)."""
        name = getattr(func, "__name__", "")
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        views = ("__get__", "t", "transpose")
        if name in views and first is not None and id(first) in self.weights:
            if isinstance(out, torch.Tensor):
                self.keep.append(out)
                self.transposed[id(out)] = self.weights[id(first)]
        elif name == "embedding" and len(args) > 1 and id(args[1]) in self.transposed:
            for owner in self.transposed[id(args[1])]:
                if self.nodes[owner].kind == "linear":
                    self.nodes[owner].needs_whole = "its weight is looked up as a table"
                    self.nodes[owner].read_outside = True

    def _join(self, name: str, args: tuple, kwargs: Mapping) -> None:
        """``cat`` / ``stack`` of tensors along (or next to) a linear's features: each rank
        would hold its slice of every piece side by side ([a_r | b_r]), not the slice of the
        joined features a row linear's rows are cut by ([a | b] in halves), a wrong number with
        no error. The linear's output is marked cut (`Node.uneven`), so its pair is gathered.
        Joins along other dims (the sequence, a stack of experts summed over) change nothing."""
        pieces = args[0] if isinstance(args[0], (list, tuple)) else ()
        pieces = [t for t in pieces if isinstance(t, torch.Tensor)]
        if len(pieces) < 2:
            return
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if name == "hstack":
            dim = 1 if pieces[0].ndim > 1 else 0
        stack = name == "stack"
        for t in pieces:
            if id(t) not in self.origin:
                continue
            lin, j, _ = self.origin[id(t)]
            d = _norm_dim(int(dim), t.ndim + 1 if stack else t.ndim)
            # a stack right before or after the features puts the pieces next to them, where a
            # flatten lays them side by side or interleaves them
            if d == j or (stack and d == j + 1):
                node = self.nodes[lin]
                node.uneven = node.uneven or f"its output is joined with others by {name}()"

    def _features(self, t: torch.Tensor) -> tuple[tuple[str, int, bool], dict]:
        """Where ``t``'s features are, and the table that says so (`origin` or `seen`)."""
        if id(t) in self.origin:
            return self.origin[id(t)], self.origin
        return self.seen[id(t)], self.seen

    def _see(self, t: torch.Tensor, where: tuple[str, int, bool]) -> None:
        if id(t) not in self.origin:
            self.keep.append(t)
            self.seen[id(t)] = where

    def _reads_across(self, lin: str, what: str) -> None:
        """``lin``'s output is read across its features (a reduction, a selection): the whole
        output is needed, and `Node.reduced` says which op, where."""
        node = self.nodes[lin]
        where = f" in {generic(self.where[-1])}" if self.where and self.where[-1] else ""
        node.reduced = node.reduced or f"{what}{where}"
        node.needs_whole = node.needs_whole or node.reduced

    def _reduction(self, name: str, args: tuple, kwargs: Mapping, outs: list) -> bool:
        """A reduction or selection (`tpkit.trace.reductions.REDUCTIONS`) of a linear's output: over its features it
        reads across ranks once they are split, so the linear's output is needed whole (the
        pair is gathered: `tpkit.settle.gathered`); over other dims (a mean over the sequence)
        the features' dim is followed into the result. Within a head (a softmax over keys, a
        per-head norm over ``head_dim`` after the reshape to heads) it is exact when whole heads
        live on one rank: only the dim holding the heads counts as the features' then. True
        when ``name`` is such an op. The stream (an embedding's output once a block reads it)
        is whole on every rank: its norms are not counted."""
        src = args[0]
        dims = reduced_dims(name, args, kwargs, src.ndim)
        if dims is None:
            return False
        (lin, j, heads), table = self._features(src)
        first = next((t for t in outs if t.is_floating_point()), None)
        whole = id(src) in self.one_head or STREAM in self.tag(src)  # the stream is never split
        if j in dims and not whole:
            self._reads_across(lin, f"{name}() reads across its split features")
            same = first is not None and tuple(first.shape) == tuple(src.shape)
            if same and table is self.origin:
                self.origin[id(first)] = (lin, j, heads)  # followed on, as before
            return True
        if first is None:
            return True
        if id(src) in self.one_head:
            self.one_head.add(id(first))
        j_new = j if first.ndim == src.ndim else j - sum(1 for d in dims if d < j)
        if 0 <= j_new < first.ndim and first.shape[j_new] == src.shape[j]:
            if tuple(first.shape) == tuple(src.shape) and table is self.origin:
                self.origin[id(first)] = (lin, j_new, heads)  # as any elementwise op
            else:
                self._see(first, (lin, j_new, heads))
        return True

    def _functional_mha(self, args: tuple, kwargs: dict) -> None:
        """Which child linears a module hands torch's ``multi_head_attention_forward`` as its
        separate q / k / v and output weights (WavLM's attention reads them there, never calling
        them): `tpkit.sources.attention` splits such a call by heads."""
        call = dict(zip(_MHA_ARGS, args, strict=False)) | kwargs
        if not call.get("use_separate_proj_weight"):  # in_proj_weight is ignored then
            return
        if call.get("static_k") is not None or call.get("static_v") is not None:
            return
        found: dict[str, Any] = {"heads": call.get("num_heads")}
        for role, key in (
            ("q", "q_proj_weight"),
            ("k", "k_proj_weight"),
            ("v", "v_proj_weight"),
            ("out", "out_proj_weight"),
        ):
            owners = self.weights.get(id(call.get(key)), set())
            if len(owners) != 1 or self.nodes[next(iter(owners))].kind != "linear":
                return
            found[role] = next(iter(owners))
        if self.where and isinstance(found["heads"], int):
            self.functional_mha[self.where[-1]] = found

    def _per_head_tables(self, feats: list[torch.Tensor], name: str = "", args=()) -> None:
        """An embedding's output broadcast over the heads of a split linear's output (RoFormer's
        sinusoidal table times each head's queries; Wav2Vec2-BERT's relative-distance table in
        ``einsum("bhld,lrd->bhlr", query, table)``) is one table every head reads: a rank
        keeps it whole for its heads (its gradient all-reduced), like Qwen3's ``q_norm``. Its
        tag stops here, so the attention's output linear does not count it as a column."""
        for b in feats:
            if id(b) not in self.origin or not self.origin[id(b)][2]:
                continue
            lin, j, _ = self.origin[id(b)]
            # heads in the rows of a product's first operand (SpeechT5's queries, heads merged
            # into the batch, times its relative position table): every row reads all of the
            # other operand; heads in another matrix dim of a product: not a broadcast
            rows = name in ("matmul", "__matmul__", "bmm") and b is args[0] and j == b.ndim - 2
            if name in _PER_HEAD_PRODUCTS and name != "einsum" and j >= b.ndim - 2 and not rows:
                continue
            for a in feats:
                tags = self.tag(a)
                if a is b or not tags or any(self.nodes.get(t) is None for t in tags):
                    continue
                if any(self.nodes[t].kind != "embedding" for t in tags):
                    continue
                k = j - (b.ndim - a.ndim)  # a's dim under b's heads, broadcasting from the right
                if name == "einsum":
                    broadcast = _einsum_lacks(args, a, b, j)
                elif rows:
                    broadcast = b.shape[j] > 1 and a is args[1]
                else:
                    broadcast = b.shape[j] > 1 and (k < 0 or a.shape[k] == 1)
                if broadcast:
                    self.head_tables |= tags
                    self.nodes[lin].per_head_consumers |= tags

    def _partial_params(self, name: str, feats: list[torch.Tensor]) -> None:
        """Bare parameters meeting a linear's output that a column split would leave split:
        broadcast over its split dim (elementwise), or per head (a product with the heads). The
        linear's `Node.partial_params` records them; whether it is split is the plan's say."""
        for b in feats:
            if id(b) not in self.origin:
                continue
            lin, j, heads = self.origin[id(b)]
            if name in _PER_HEAD_PRODUCTS and not heads:
                continue  # a contraction over the features: the reduction's concern
            for a in feats:
                params = self.params.get(id(a))
                if a is b or not params:
                    continue
                k = j - (b.ndim - a.ndim)  # a's dim under b's split one, from the right
                if name in _PER_HEAD_PRODUCTS or (b.shape[j] > 1 and (k < 0 or a.shape[k] == 1)):
                    self.nodes[lin].partial_params |= params

    # -- where the features of a linear's output go: reshapes, splits, slices ----------------
    def _follow_features(self, name, args, kwargs, out, outs) -> None:
        """Where the features of a linear's output go. `origin` follows them through reshapes,
        transposes and elementwise ops, and records how they are cut (packed parts, uneven
        slices, heads); `seen` follows them, for `_reduction` only, also into the pieces of
        other dims (a token's row, a batch's slice: ``tolist`` on fake tensors unbinds row by
        row), where a cut of the features is a read of them one by one."""
        src = args[0]
        (lin, j, heads), table = self._features(src)
        node = self.nodes[lin]
        main = table is self.origin
        if name in _DIM_ARG:
            pos = _DIM_ARG[name]
            dim = kwargs.get("dim", args[pos] if len(args) > pos else 0)
            d = _norm_dim(int(dim), src.ndim)
            if d != j:
                shift = 1 if name == "unbind" and d < j else 0
                for t in outs:
                    self._see(t, (lin, j - shift, heads))
                return
            if not main:
                self._reads_across(lin, f"{name}() reads its split features one by one")
                return
            sizes = {t.shape[j] for t in outs} if name != "narrow" else {-1}
            if heads and name != "unbind":
                # heads cut into groups (DiffLlama pairs head i with head i + H/2): contiguous
                # head shards would pair other heads, and the pairing is read where the trace
                # no longer follows these features
                node.uneven = node.uneven or f"its heads are {name}-cut into groups"
            elif len(sizes) == 1 and len(outs) > 1 and name != "unbind":
                node.split = max(node.split, len(outs)) if node.split in (1, len(outs)) else -1
            else:
                node.uneven = node.uneven or f"its output is {name}-sliced unevenly by features"
                if name != "narrow" and not node.cuts:
                    node.cuts = [int(t.shape[j]) for t in outs]
                    node.cut_reach = [set() for _ in outs]
                    for i, t in enumerate(outs):
                        self.parts[id(t)] = frozenset({(lin, i)})
            return
        if name == "__getitem__":
            if not self._index_touches(args[1], src.ndim, j):
                j_new = _dim_after_index(args[1], src.ndim, j)
                if j_new is not None and len(outs) == 1:
                    self._see(outs[0], (lin, j_new, heads))
            elif main:
                node.uneven = node.uneven or "its output is indexed along its features"
            else:
                self._reads_across(lin, "an index reads its split features one by one")
            return
        if len(outs) != 1:
            return
        new = outs[0]
        if name in ("view", "reshape", "unflatten", "contiguous", "float", "to", "type_as"):
            j_new = _feature_dim_after_reshape(tuple(src.shape), j, tuple(new.shape))
            if j_new is not None and new.shape[j_new] < src.shape[j]:
                heads = True
            elif j_new is not None and new.shape[j_new] > src.shape[j]:
                heads = False  # heads merged back into one feature dim
            elif j_new is None and heads:
                # heads merged into the batch ([B, H, T, d] -> [B * H, T, d]: SpeechT5's
                # attention): that dim still counts heads, a rank holds its heads of each row
                j_new = _heads_into_outer(tuple(src.shape), j, tuple(new.shape))
        elif name == "transpose":
            a, b = (_norm_dim(int(d), src.ndim) for d in args[1:3])
            j_new = b if j == a else a if j == b else j
        elif name == "permute":
            dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
            dims = [_norm_dim(int(d), src.ndim) for d in dims]
            j_new = dims.index(j) if j in dims else None
        elif tuple(new.shape) == tuple(src.shape):
            j_new = j  # elementwise
        else:
            j_new = None
        if j_new is not None and main:
            self.origin[id(new)] = (lin, j_new, heads)
        elif j_new is not None:
            self._see(new, (lin, j_new, heads))
        one = name in ("view", "reshape", "unflatten") and _one_head(src.shape, j, new.shape)
        if j_new is not None and (id(src) in self.one_head or one):
            self.one_head.add(id(new))

    @staticmethod
    def _index_touches(index: Any, ndim: int, j: int) -> bool:
        """True when ``tensor[index]`` selects part of dim ``j`` (``None`` adds an axis and
        consumes no dim; an Ellipsis stands for the dims no other item consumes)."""
        items = index if isinstance(index, tuple) else (index,)
        consuming = sum(1 for i in items if i is not None and i is not Ellipsis)
        dim = 0
        for item in items:
            if item is Ellipsis:
                dim += ndim - consuming
                continue
            if item is None:
                continue
            if dim == j:
                return not (isinstance(item, slice) and item == slice(None))
            dim += 1
        return False


def _heads_into_outer(old: tuple, j: int, new: tuple) -> int | None:
    """Where the heads dim ``j`` of ``old`` lands when a reshape merges it, whole, with the dims
    before it into one (``[B, H, T, d] -> [B * H, T, d]``), the dims after it kept as they
    are; None for any other reshape."""
    for k in range(j + 1):
        prefix, merged = math.prod(old[:k]), math.prod(old[k : j + 1])
        acc = 1
        for i, size in enumerate(new):
            if acc == prefix and size == merged and tuple(new[i + 1 :]) == tuple(old[j + 1 :]):
                return i
            acc *= size
            if acc > prefix:
                break
    return None


def _maybe_layer(module: nn.Module) -> bool:
    """A leaf module of a model's own class with a 2-D ``weight``: it may apply ``F.linear`` or
    ``F.embedding`` to it (`_Tracer._functional_layer` decides, on its first call)."""
    w = module._parameters.get("weight")
    own = not type(module).__module__.startswith("torch.nn")
    return own and w is not None and w.ndim == 2 and not module._modules


def _one_head(old: tuple, j: int, new: tuple) -> bool:
    """``new`` views the features dim ``j`` of ``old`` as [1, ..., features]: one head."""
    prefix, acc = math.prod(old[:j]), 1
    for i, size in enumerate(new):
        if acc == prefix and size == 1:
            rest = new[i:]
            k = next((n for n, x in enumerate(rest) if x != 1), None)
            return (
                k is not None
                and rest[k] == old[j]
                and math.prod(rest) == old[j] * (math.prod(old[j + 1 :]))
            )
        acc *= size
        if acc > prefix:
            return False
    return False


#: in-place elementwise ops that, given only numbers besides the tensor, act on every element
#: alone: on a split weight, each rank's shard does its part of the same change
_SCALAR_IN_PLACE = frozenset(
    ["div_", "mul_", "add_", "sub_", "fill_", "zero_", "neg_", "clamp_", "clamp_min_"]
    + ["clamp_max_", "__itruediv__", "__imul__", "__iadd__", "__isub__"]
)


def _scaled_in_place(name: str, inputs: list, t: torch.Tensor) -> bool:
    """True for ``t.div_(2)`` and its kind (`_SCALAR_IN_PLACE`, ``t`` the only tensor): a
    weight changed that way outside its forward is not read whole, so it may stay split."""
    return name in _SCALAR_IN_PLACE and len(inputs) == 1 and inputs[0] is t


def _dim_after_index(index: Any, ndim: int, j: int) -> int | None:
    """Where dim ``j`` lands in ``tensor[index]`` when ``index`` keeps it whole (ints drop a
    dim, ``None`` adds one); None for advanced indexing (tensors, lists)."""
    items = index if isinstance(index, tuple) else (index,)
    consuming = sum(1 for i in items if i is not None and i is not Ellipsis)
    dim = out = 0
    for item in items:
        if item is Ellipsis:
            n = ndim - consuming
            if dim <= j < dim + n:
                return out + j - dim
            dim, out = dim + n, out + n
        elif item is None:
            out += 1
        elif isinstance(item, slice):
            if dim == j:
                return out
            dim, out = dim + 1, out + 1
        elif isinstance(item, int) and not isinstance(item, bool):
            dim += 1
        else:
            return None
    return out + j - dim if j >= dim else None


def generic(name: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp``: one reason for every layer."""
    return ".".join("*" if p.isdigit() else p for p in name.split("."))


def _same_stream(t: torch.Tensor, like: torch.Tensor) -> bool:
    """``t`` is shaped as the stream ``like``: same rank, same batch, same width."""
    if not t.ndim or t.ndim != like.ndim or t.shape[-1] != like.shape[-1]:
        return False
    return t.ndim == 1 or t.shape[0] == like.shape[0]


def _feature_dim_after_reshape(old: tuple, j: int, new: tuple) -> int | None:
    """Where the outermost factor of a feature dimension lands after a view/reshape."""
    prefix = math.prod(old[:j])
    acc = 1
    for i, s in enumerate(new):
        if acc == prefix and s > 1:
            return i if old[j] % s == 0 or s % old[j] == 0 else None
        acc *= s
        if acc > prefix:
            return None
    return None


def blocks(model: nn.Module, mixed: bool = True) -> list[tuple[str, nn.Module]]:
    """The elements of the outermost ModuleLists of same-typed, linear-holding modules; or, with
    ``mixed``, of mixed types (a hybrid's attention and Mamba layers) when every element holds
    a linear and each takes and returns the stream (blocks of the same width: their names say
    layers). Without ``mixed``: the other reading of a hybrid model's stream (Zamba2's hybrid
    layers hold a shared transformer whose output is projected, not added), which inference
    tries too and keeps when it splits more."""
    lists = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or not len(mod):
            continue
        if all(isinstance(m, nn.ModuleList) for m in mod):
            continue  # a list of lists (Funnel's blocks of layers): the layers are the blocks
        types = {type(m) for m in mod}
        # a functional layer (`_maybe_layer`: I-BERT's QuantLinear) counts as a linear here
        holds = [any(kind_of(m) or _maybe_layer(m) for m in block.modules()) for block in mod]
        mixes = mixed and len(types) > 1 and len(mod) > 1 and all(holds) and _layers(name)
        nested = any(name.startswith(p + ".") for p, _ in lists)
        if (len(types) == 1 or mixes) and not nested and holds[0]:
            lists.append((name, mod))
    return [(f"{p}.{i}" if p else str(i), m) for p, lst in lists for i, m in enumerate(lst)]


def has_mixed_blocks(model: nn.Module) -> bool:
    """True when `blocks` reads the model differently with and without mixed layer lists."""
    return [n for n, _ in blocks(model)] != [n for n, _ in blocks(model, mixed=False)]


def _layers(name: str) -> bool:
    """A module list named as a model's layers (``model.layers``, ``h``, ``blocks``)."""
    last = name.rsplit(".", 1)[-1].lower()
    return last in ("layers", "layer", "h", "blocks", "block", "decoder_layers")


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The elements of every largest ``nn.ModuleList`` (an encoder-decoder has two), of any
    types: the units FSDP2 wraps and sequence parallelism enters and leaves. Unlike `blocks`
    (the residual stream's boundaries, same-typed lists only) a hybrid model's mixed layer list
    counts here."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    longest = max(len(m) for m in lists)
    found: list[nn.Module] = []
    for m in lists:
        if len(m) == longest or len(m) >= max(2, longest // 2):
            found.extend(m)
    # a ModuleList nested in a block is not a block of its own
    inside = {id(sub) for b in found for sub in b.modules() if sub is not b}
    return [b for b in found if id(b) not in inside]


@dataclass
class Trace:
    """What one traced forward learned (`trace`).

    - ``nodes``: linear-like module name -> its `Node`;
    - ``blocks``: the blocks whose entries and exits are the residual stream (`blocks`);
    - ``module_inputs``: module -> its float inputs as [(key, shape, tags)], in call order;
    - ``input_params``: module -> input key -> the bare parameters that input carries;
    - ``functional_mha``: module -> the child linears it hands torch's attention function;
    - ``batch``: the batch size the forward ran with;
    - ``fed_floats``: whether the model itself was handed a float tensor (a stream to read in);
    - ``returns``: the tags of what the model returns in its first output's shape (the
      linears, and `STREAM`, whose values reach it with no other linear in between).

    The last two say what a reading with no blocks would see at the model's own boundary,
    its only one (`tpkit.sources.infer` skips that reading where it can find no pair).

    ``reshapes``: each view / reshape the forward ran, as (input shape, output shape), per
    innermost running module, in call order: what the dry run's unsplit reference run would
    record (`tpkit.settle.dryrun`). The dry run's fold compares less of each layer's call
    (shapes, and a shadow run's integer values, not the tags), so it may stand calls this
    fold ran (tiny GPT-2's second layer): followed alongside (`tpkit.trace.fold.folded`'s
    ``coarse``), what those calls recorded is left out. None where that fold cannot be
    followed, or where a shadow run came near its budget (`ShadowValues.far_from_budget`:
    the dry run's values might then differ).

    ``values``: the forward ran with shadow values (`tpkit.trace.shadow`): its plain fake run
    met a data-dependent branch, as every dry run's will."""

    nodes: dict[str, Node]
    blocks: list[str]
    module_inputs: dict[str, list[tuple[str, tuple, frozenset]]]
    input_params: dict[str, dict[str, frozenset[str]]]
    functional_mha: dict[str, dict[str, Any]]
    batch: int
    fed_floats: bool = False
    returns: frozenset[str] = frozenset()
    reshapes: dict[str, list[tuple[tuple, tuple]]] | None = None
    values: bool = False


def _nothing(t: torch.Tensor, layer: str) -> None:
    """What a plain dry run's fold compares of a tensor besides its shape: nothing."""
    return None


def trace(
    model: nn.Module,
    example: tuple | Mapping | None = None,
    real: bool = False,
    *,
    mixed: bool = True,
    recipe: InputRecipe | None = None,
    twins: Twins | None = None,
) -> Trace:
    """Run one forward of ``model`` on fake meta tensors (``real=True``: on its own weights, for
    code that needs values) and return what the tags say (`Trace`). ``mixed``: whether a
    hybrid's mixed layer list counts as blocks (`blocks`). Without ``example`` the inputs are
    made up as ``recipe`` says, and a forward that refuses them is retried (one row, the text
    alone, a grid VLM's patches unflattened): ``recipe`` keeps what worked, so the analysis
    that owns it makes every later input so (`tpkit.trace.analysis.Analysis` caches the
    trace). ``twins`` (`tpkit.trace.fold`): layers a fake run folds onto their
    representatives; `tpkit.trace.fold.FoldBroken` where that cannot stand for the unfolded
    run. Raises what the model's forward raised when nothing runs."""
    recipe = InputRecipe() if recipe is None else recipe
    twins = Twins() if twins is None or real else twins
    if real:
        return _TraceHooks(model, mixed).run(example, real, recipe=recipe)
    if example is not None:
        return _fake_trace(model, example, mixed, recipe, twins)
    try:
        return _fake_trace(model, None, mixed, recipe, twins)
    except Exception as exc:  # noqa: BLE001 - model code may do anything on meta
        return _text_only(model, exc, mixed, recipe, twins)


def _batch(example: tuple | Mapping | None, recipe: InputRecipe) -> int:
    """The trace's batch size: the made-up inputs', or the first given tensor's first dim
    (per-head inputs are recognised as [batch * heads, ...], BLOOM's alibi)."""
    given = _tensors(example) if example is not None else []
    return int(given[0].shape[0]) if given and given[0].ndim else trace_batch(recipe)


def _fake_trace(
    model: nn.Module,
    example: tuple | Mapping | None,
    mixed: bool,
    recipe: InputRecipe,
    twins: Twins,
) -> Trace:
    """The fake trace: plainly; again with made-up values (`ShadowValues`) where the code read
    one; with one row where the forward refused the made-up batch."""
    try:
        return _TraceHooks(model, mixed, twins).run(example, False, recipe=recipe)
    except Exception as exc:
        if needs_values(exc):  # data-dependent code
            hooks = _TraceHooks(model, mixed, twins)
            return hooks.run(example, False, values=True, recipe=recipe)
        if example is None and trace_batch(recipe) > 1:
            return _one_row(model, exc, mixed, recipe, twins)
        raise


def _text_only(
    model: nn.Module, first: Exception, mixed: bool, recipe: InputRecipe, twins: Twins
) -> Trace:
    """Trace again on the ids alone where the made-up inputs fed a multimodal model's towers
    (`tpkit.trace.inputs.text_only`: images or audio its code does not take as made up): the
    towers stay whole, the language model is still split, as before towers were traced. From
    then on the model's made-up inputs (the dry run's too) keep to the text. The first error
    is what a user sees if the text alone fails too, or if there were no tower inputs. A grid
    VLM's patches are tried unflattened first (`tpkit.trace.inputs.unflattened_patches`)."""
    with contextlib.suppress(Exception), unflattened_patches(model, recipe) as grid:
        if grid:
            return _fake_trace(model, None, mixed, recipe, twins)
    towers = set(example_inputs(model, recipe)[1])
    try:
        with text_only(recipe):
            if set(example_inputs(model, recipe)[1]) == towers:
                raise first
            return _fake_trace(model, None, mixed, recipe, twins)
    except Exception:
        raise first from None


def _one_row(
    model: nn.Module, first: Exception, mixed: bool, recipe: InputRecipe, twins: Twins
) -> Trace:
    """Trace again with a one-row batch, for a forward that refuses more rows (GPT-2's
    classifiers without a pad token); the first error is what a user sees if that fails too."""
    try:
        with trace_one_row(recipe):
            return _TraceHooks(model, mixed, twins).run(None, False, recipe=recipe)
    except Exception:
        raise first from None


class _TraceHooks:
    """Forward hooks on every module that feed the tracer what happens at module boundaries:
    inputs of linear-like modules (their sources), block entries and exits (the stream), and
    modules with their own parameters acting on a linear's output (whole or per head)."""

    def __init__(self, model: nn.Module, mixed: bool = True, twins: Twins | None = None):
        self.model = model
        self.twins = Twins() if twins is None else twins
        self.names = {id(m): n for n, m in model.named_modules()}
        self.modules = dict(model.named_modules())
        self.nodes = {
            n: Node(k, out_width(m, k)) for n, m in model.named_modules() if (k := kind_of(m))
        }
        self.tracer = _Tracer(self.nodes)
        # modules that may be functional layers (`_Tracer._functional_layer`)
        self.candidates = {
            n for n, m in model.named_modules() if n not in self.nodes and _maybe_layer(m)
        }
        self.blocks = blocks(model, mixed)
        self.block_ids = {id(m) for _, m in self.blocks}
        self.fed_floats, self.returns = False, frozenset()  # the model's boundary (`Trace`)
        self.module_inputs: dict[str, list[tuple[str, tuple, frozenset]]] = {}
        # module -> input key -> the bare parameters whose values that input carries
        self.input_params: dict[str, dict[str, frozenset[str]]] = {}
        self.records = TwinRecords(
            self.twins,
            self.nodes,
            self.module_inputs,
            self.input_params,
            self.tracer.functional_mha,
        )

    def run(
        self, example, real: bool, values: bool = False, recipe: InputRecipe | None = None
    ) -> Trace:
        """One forward with the hooks; ``values``: with `ShadowValues` (data-dependent code)."""
        recipe = InputRecipe() if recipe is None else recipe
        model = self.model
        # the inputs before the hooks: making an audio-LLM's runs its audio tower once
        # (`tpkit.trace.inputs`), which the trace must not record (nor keep its tensors alive)
        fake = None if real else fake_mode()
        given = GivenValues()
        with quiet_fake_tensors():
            args, kwargs = fake_inputs(model, example, fake, real, recipe, given)
        hooks, reshapes = [], None
        for mod in model.modules():
            hooks.append(mod.register_forward_pre_hook(self.pre, with_kwargs=True))
            hooks.append(mod.register_forward_hook(self.post, with_kwargs=True))
        try:
            with quiet_fake_tensors():
                if real:
                    with torch.no_grad(), self.tracer:
                        model(*args, **kwargs)
                else:
                    state, experts = meta_state(model, fake), fake_friendly_experts(model)
                    shadow = ShadowValues(fake, given) if values else None
                    # what a dry run's fold compares (`Trace.reshapes`)
                    coarse = known_values(shadow) if shadow is not None else _nothing
                    describe = self._describe(shadow)
                    twins = folded(model, self.twins, self.records.stand_in, describe, coarse)
                    with (
                        twins as fold,
                        self.tracer.in_fold(fold.running if fold is not None else []),
                        state,
                        experts,
                        torch.no_grad(),
                        fake,
                        self.tracer.under(shadow),
                    ):
                        model(*args, **kwargs)
                    # the dry run's unsplit reference run, where this run can stand for it
                    same_values = shadow is None or shadow.far_from_budget()
                    if same_values and (fold is None or fold.coarser.valid):
                        stood = fold.coarser.stood if fold is not None else set()
                        reshapes = self.tracer.coarse_reshapes(stood)
                    self.records.finish()
                    partial = [node.partial_params for node in self.nodes.values()]
                    self.records.resolve(partial, self.input_params)
        finally:
            for h in hooks:
                h.remove()
        return Trace(
            nodes=self.nodes,
            blocks=[n for n, _ in self.blocks],
            module_inputs=self.module_inputs,
            input_params=self.input_params,
            functional_mha=self.tracer.functional_mha,
            batch=_batch(example, recipe),
            fed_floats=self.fed_floats,
            returns=self.returns,
            reshapes=reshapes,
            values=values,
        )

    def _describe(self, shadow: ShadowValues | None) -> Describe:
        """What a fold compares of a tensor a layer is given, besides its shape (`folded`):
        everything the tracer knows of it (tags, where its features are, cut parts, bare
        parameters), and in a shadow run its values if it is no float."""
        tracer, values = self.tracer, known_values(shadow) if shadow is not None else None
        relative = Relative(self.twins.layers, self.twins.fixed)

        def describe(t: torch.Tensor, layer: str) -> tuple:
            i = id(t)
            known = (tracer.tag(t), tracer.origin.get(i), tracer.seen.get(i), tracer.parts.get(i))
            more = (tracer.params.get(i), i in tracer.one_head)
            value = values(t, layer) if values is not None else None
            return (relative.seen_from((known, more), layer), value)

        return describe

    def _reset_stream(self, values: list[torch.Tensor], like: torch.Tensor | None = None) -> None:
        """Tag as the stream what looks like ``like`` (same rank, batch and width): not a
        per-head table that happens to be as wide (MPT's ALiBi [heads, 1, max_seq_len])."""
        tracer = self.tracer
        for t in values:
            if t.is_floating_point() and (like is None or _same_stream(t, like)):
                tracer.into_stream(tracer.tag(t))
                tracer.set_tag(t, frozenset({STREAM}))

    def _is_stream_boundary(self, mod: nn.Module) -> bool:
        return id(mod) in self.block_ids or (mod is self.model and not self.blocks)

    def pre(self, mod, args, kwargs):
        tracer, nodes, name = self.tracer, self.nodes, self.names[id(mod)]
        tracer.where.append(name)
        if mod is self.model:  # parameters are (fake) tensors of the trace by now
            self.fed_floats = any(t.is_floating_point() for t in _tensors((args, kwargs)))
            own = [*mod.parameters(), *mod.buffers(), *_tensors((args, kwargs))]
            tracer.state = {id(t) for t in own}
            tracer.weights = {}
            for n in nodes:
                for p in self.modules[n].parameters(recurse=False):
                    tracer.weights.setdefault(id(p), set()).add(n)
            tracer.params = {}
            tracer.candidate_weights = {
                id(self.modules[n]._parameters["weight"]): n for n in self.candidates
            }
            for owner, module in self.modules.items():
                for pname, p in module.named_parameters(recurse=False):
                    if owner not in nodes and id(p) not in tracer.weights:
                        tracer.keep.append(p)
                        tracer.params[id(p)] = frozenset({f"{owner}.{pname}".lstrip(".")})
        if name in nodes:
            tracer.active.append(name)
        if self._is_stream_boundary(mod):
            # the stream is what has the first float input's width: not a block's other float
            # inputs (BLOOM's alibi, T5's position bias), given or made inside the model
            floats = [t for t in _tensors((args, kwargs)) if t.is_floating_point()]
            if floats:
                self._reset_stream(floats, floats[0])
                # every float input, the stream's and the rest (Inkling-2's block states, the
                # same tensor for the layers of a block): each carries under the layer's name
                self.records.carry_in(name, floats, tracer.params)
        ins = [(f"arg:{i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ins += [(f"kw:{k}", v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        self.module_inputs[name] = [
            (key, tuple(t.shape), tracer.tag(t)) for key, t in ins if t.is_floating_point()
        ]
        for key, t in ins:  # bare parameters a module is handed (a fix-up may slice them)
            if id(t) in tracer.params:
                entry = self.input_params.setdefault(name, {})
                entry[key] = entry.get(key, frozenset()) | tracer.params[id(t)]
        tags = frozenset().union(*(tracer.tag(t) for _, t in ins))
        if name in self.candidates and name not in nodes:
            if ins:
                tracer.first_input[name] = ins[0][1]
            tracer.pending.append((name, mod, ins, tags))  # a node once it calls F.linear
        elif name in nodes:
            if ins:  # BART's position table looks up arange(seq) + 2, not its input_ids
                tracer.first_input[name] = ins[0][1]
            nodes[name].src |= tags
            for src in tags & nodes.keys():
                nodes[src].consumers.add(name)
            for _, t in ins:
                for lin, i in tracer.parts.get(id(t), ()):
                    nodes[lin].cut_reach[i].add(name)
        elif any(True for _ in mod.parameters(recurse=False)):
            self._parameter_consumer(name, mod, tags)
        self.records.started(name)  # a folded run's representative: what its run records

    def _parameter_consumer(self, name: str, mod: nn.Module, tags: frozenset[str]) -> None:
        """A module with its own parameters fed by linears: a per-head one (1-D parameters as
        wide as a head, Qwen3's q_norm) acts on split features; any other needs them whole."""
        params = list(mod.parameters(recurse=False))
        one_d = all(p.ndim == 1 for p in params)
        width = max(p.shape[0] for p in params) if one_d else None
        for src in tags & self.nodes.keys():
            node = self.nodes[src]
            whole = node.out // max(1, node.split)
            if not one_d or width in (node.out, whole):
                node.needs_whole = node.needs_whole or f"{name} needs its whole output"
            else:
                node.per_head_consumers.add(name)

    def post(self, mod, args, kwargs, output):
        tracer, name = self.tracer, self.names[id(mod)]
        if tracer.where:
            tracer.where.pop()
        if mod is self.model:
            tracer.dead_nodes(_tensors(output))
            # what a reading with no blocks marks as written into the stream here (`Trace`)
            outs = [t for t in _tensors(output) if t.is_floating_point()]
            shaped = [tracer.tag(t) for t in outs if tuple(t.shape) == tuple(outs[0].shape)]
            self.returns = frozenset().union(*shaped)
        if tracer.pending and tracer.pending[-1][0] == name:
            _, _, _, tags = tracer.pending.pop()
            if name not in self.nodes:  # not a functional layer: a module with parameters
                self._parameter_consumer(name, mod, tags)
        if name in self.nodes:
            tracer.active.pop()
            for t in _tensors(output):
                tracer.params.pop(id(t), None)  # a linear's input gradient is whole again
            for t in _tensors(output)[:1]:
                tracer.node_outputs.setdefault(name, []).append(id(t))
                tracer.parts.pop(id(t), None)  # a cut's parts are followed to the next linear
                tracer.set_tag(t, frozenset({name}))
                tracer.origin[id(t)] = (name, t.ndim - 1, False)
        elif self._is_stream_boundary(mod):
            # what a block returns in the stream's shape is the stream (not its attention
            # weights or key/value cache, which a sharded attention keeps per rank)
            outs = [t for t in _tensors(output) if t.is_floating_point()]
            for t in outs:
                if tuple(t.shape) == tuple(outs[0].shape) and tracer.tag(t) & self.nodes.keys():
                    tracer.into_stream(tracer.tag(t))
                    tracer.set_tag(t, frozenset({STREAM}))
        self.records.finished(name, output, tracer.params)
