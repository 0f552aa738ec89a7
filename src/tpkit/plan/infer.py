"""Infer a `Plan` for a model that ships none, from its dataflow.

One forward runs on the meta device (parameters and buffers swapped for meta tensors, nothing is
computed or allocated) while a ``TorchFunctionMode`` tags every tensor with the *linear-like*
modules (``nn.Linear``, GPT-2's ``Conv1D``, ``nn.Embedding``) whose outputs reach it without
passing through another one. The hidden states entering each repeated block (the elements of the
outermost ``nn.ModuleList`` s) are the *residual stream*. From the tags:

- a linear whose input comes only from other linears (never straight from the stream) and whose
  output is added back into the stream is **row-parallel**; the linears feeding it are
  **column-parallel** (Megatron's pairing: q/k/v -> o, up/gate -> down, c_fc -> c_proj, ...);
- a column candidate whose output is also needed whole (a LayerNorm over its full width, a
  non-row consumer, the stream) or is sliced unevenly along its features (Falcon's multi-query
  ``query_key_value``) stays replicated, and so does its row partner; the plan notes why;
- the output of a column linear split into k equal parts along its features (GPT-2 ``c_attn`` ->
  q|k|v, fused gate_up -> gate|up) gets a *packed* style that splits each part; a split *after*
  a per-head reshape (BLOOM / GPT-NeoX ``query_key_value``, Falcon GQA) is per-head interleaved
  and plain colwise is right;
- an ``nn.Embedding`` inside a block whose output reaches a row linear (T5's relative attention
  bias ``[buckets, heads]``) is split by heads (``colwise_embedding``);
- a module with 1-D parameters acting per head on a column output (Qwen3 ``q_norm``) gets
  ``replicated_with_grad_allreduce``;
- the input embedding is vocab-parallel, the output head ``colwise_gather_output``;
- head-count attributes (``num_heads``, ``n_head``, ``embed_dim``, ``split_size``, ...) on the
  modules that own a column/row pair are listed as plan *fix-ups*, divided by tp when applied,
  and untagged per-head inputs of those modules (BLOOM's ``alibi``) are sliced to the rank's heads.

Each column/row pair is a *group* with the counts that must divide tp (features, heads);
`validate` turns an inferred group that does not divide into replicated entries with a note.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from tpkit.plan.spec import HEAD_ATTRS, Plan

STREAM = "<stream>"
#: Attributes that hold a width; divided only when they equal a split width of the pair.
WIDTH_ATTRS = (
    "embed_dim",
    "hidden_size",
    "hidden_size_per_partition",
    "inner_dim",
    "split_size",
    "all_head_size",
)
_TRACE_BATCH, _TRACE_SEQ = 3, 7
#: Largest model traced on its real weights when the fake-tensor trace fails.
REAL_TRACE_MAX_PARAMS = 50_000_000  # odd sizes, unlikely to coincide with a width or head count


@dataclass
class _Node:
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


def _kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return "conv1d"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return None


def _out_width(module: nn.Module, kind: str) -> int:
    w = module.weight
    return int(w.shape[1] if kind in ("conv1d", "embedding") else w.shape[0])


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


# ops that cut a tensor along a dim -> position of that dim among their arguments
_DIM_ARG = {
    "split": 2,
    "chunk": 2,
    "tensor_split": 2,
    "split_with_sizes": 2,
    "unbind": 1,
    "narrow": 1,
}


class _Tracer(TorchFunctionMode):
    """Propagates provenance tags through every torch function call."""

    def __init__(self, nodes: dict[str, _Node]):
        super().__init__()
        self.nodes = nodes
        self.tags: dict[int, frozenset[str]] = {}
        # tensor -> (linear, dim of its features' outermost factor, whether a reshape has split
        # the features into heads x per-head so that dim counts heads)
        self.origin: dict[int, tuple[str, int, bool]] = {}
        self.keep: list[torch.Tensor] = []  # ids stay unique while the trace runs
        self.active: list[str] = []  # linear-like modules whose forward is running
        self.weights: dict[int, str] = {}  # id of a linear-like module's parameter -> module

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
        out = func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        for t in inputs:
            owner = self.weights.get(id(t))
            if owner is not None and owner not in self.active:
                # another module computes with this weight (Mamba's dt_proj.weight): its
                # layout must stay whole
                self.nodes[owner].needs_whole = "its weight is read outside its own forward"
        tags: frozenset[str] = frozenset().union(*(self.tag(t) for t in inputs))
        if STREAM in tags and len(tags) > 1:
            tags = self.into_stream(tags)
        name = getattr(func, "__name__", "")
        in_place = name.endswith("_") or name in ("__setitem__", "__iadd__", "__imul__")
        if in_place and args and isinstance(args[0], torch.Tensor):
            self.set_tag(args[0], tags)
        outs = _tensors(out)
        for t in outs:
            self.set_tag(t, tags)
        if args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.origin:
            self._follow_features(name, args, kwargs, out, outs)
        return out

    # -- where the features of a linear's output go: reshapes, splits, slices ----------------
    def _follow_features(self, name, args, kwargs, out, outs) -> None:
        src = args[0]
        lin, j, heads = self.origin[id(src)]
        node = self.nodes[lin]
        if name in _DIM_ARG:
            pos = _DIM_ARG[name]
            dim = kwargs.get("dim", args[pos] if len(args) > pos else 0)
            if _norm_dim(int(dim), src.ndim) != j:
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
            return
        if name == "__getitem__":
            if self._index_touches(args[1], src.ndim, j):
                node.uneven = node.uneven or "its output is indexed along its features"
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
        if j_new is not None:
            self.origin[id(new)] = (lin, j_new, heads)

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


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The elements of the outermost ModuleLists of same-typed, linear-holding modules."""
    lists = []
    for name, mod in model.named_modules():
        same_type = isinstance(mod, nn.ModuleList) and len({type(m) for m in mod}) == 1
        nested = any(name.startswith(p + ".") for p, _ in lists)
        if same_type and not nested and any(_kind(m) for m in mod[0].modules()):
            lists.append((name, mod))
    return [(f"{p}.{i}" if p else str(i), m) for p, lst in lists for i, m in enumerate(lst)]


def _example_inputs(model: nn.Module) -> tuple[tuple, dict]:
    shape = (_TRACE_BATCH, _TRACE_SEQ)
    config = getattr(model, "config", None)
    codebooks = getattr(config, "num_codebooks", None)  # MusicGen: codebooks stacked in batch
    rows = _TRACE_BATCH * (codebooks if isinstance(codebooks, int) and codebooks > 0 else 1)
    ids = torch.zeros((rows, _TRACE_SEQ), dtype=torch.long, device="meta")
    if config is not None and hasattr(model, "get_input_embeddings"):
        kwargs: dict[str, Any] = {"input_ids": ids}
        if getattr(config, "is_encoder_decoder", False):
            kwargs["decoder_input_ids"] = ids
        if "use_cache" in getattr(model.forward, "__code__", type("", (), {})).co_varnames or (
            getattr(config, "use_cache", None) is not None
        ):
            kwargs["use_cache"] = False
        return (), kwargs
    for mod in model.modules():
        kind = _kind(mod)
        if kind == "embedding":
            return (ids,), {}
        if kind:
            width = mod.weight.shape[0] if kind == "conv1d" else mod.weight.shape[1]
            dtype = mod.weight.dtype if mod.weight.is_floating_point() else torch.float32
            return (torch.zeros((*shape, width), dtype=dtype, device="meta"),), {}
    raise ValueError(f"{type(model).__name__} has no Linear, Conv1D or Embedding to trace.")


@contextlib.contextmanager
def _meta_state(model: nn.Module, fake, shapes: Mapping[int, tuple] | None = None):
    """Temporarily swap every parameter and buffer for a fake meta tensor of the same shape.

    Fake tensors (torch's ``FakeTensorMode``) rather than bare meta ones: transformers' code asks
    ``is_tracing(tensor)`` before data-dependent checks (packed sequences, all-ones masks) and
    skips them for fake tensors, as it does under torch.compile.
    """
    saved = []
    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for k, v in list(store.items()):
                if v is not None and (v.device.type != "meta" or id(v) in (shapes or {})):
                    saved.append((store, k, v))
    memo: dict[int, torch.Tensor] = {}
    try:
        for store, k, v in saved:
            if id(v) not in memo:
                shape = (shapes or {}).get(id(v), tuple(v.shape))
                meta = fake.from_tensor(torch.empty(shape, dtype=v.dtype, device="meta"))
                memo[id(v)] = (
                    nn.Parameter(meta, v.requires_grad) if isinstance(v, nn.Parameter) else meta
                )
            store[k] = memo[id(v)]
        yield
    finally:
        for store, k, v in saved:
            store[k] = v


@contextlib.contextmanager
def _fake_friendly_experts(model: nn.Module):
    """Temporarily run transformers' fused MoE experts as ``batched_mm`` instead of
    ``grouped_mm``, whose meta kernel accepts only bfloat16 (a float32 model would not trace).
    Both compute the same thing with the same weights, so the dataflow is the same. The raw
    value of every config reachable from a module (sub-configs too: transformers' setter
    copies a value into them) is saved and put back as it was."""
    key = "_experts_implementation_internal"
    configs: dict[int, Any] = {}
    todo = [getattr(m, "config", None) for m in model.modules()]
    while todo:
        c = todo.pop()
        if c is None or id(c) in configs or not hasattr(c, "__dict__"):
            continue
        configs[id(c)] = c
        for sub in getattr(c, "sub_configs", None) or {}:
            todo.append(c.__dict__.get(sub))
    saved = [(c, c.__dict__[key]) for c in configs.values() if key in c.__dict__]
    try:
        for c, value in saved:
            if value == "grouped_mm":
                c.__dict__[key] = "batched_mm"
        yield
    finally:
        for c, value in saved:
            c.__dict__[key] = value


@contextlib.contextmanager
def _real_state(model: nn.Module, shapes: Mapping[int, tuple]):
    """Temporarily give each sharded parameter a zero tensor of its shard's shape."""
    saved = []
    for mod in model.modules():
        for k, v in list(mod._parameters.items()):
            if v is not None and id(v) in shapes:
                saved.append((mod, k, v))
    try:
        memo: dict[int, nn.Parameter] = {}
        for mod, k, v in saved:
            if id(v) not in memo:
                memo[id(v)] = nn.Parameter(v.new_zeros(shapes[id(v)]), v.requires_grad)
            mod._parameters[k] = memo[id(v)]
        yield
    finally:
        for mod, k, v in saved:
            mod._parameters[k] = v


#: model id -> its default fake trace, while `reuse_traces` is active
_TRACES: ContextVar[dict[int, dict] | None] = ContextVar("tpkit_traces", default=None)


@contextlib.contextmanager
def reuse_traces():
    """Trace each model once inside the block (one `derive_plan`): the fake-tensor forward is
    the costly step (0.9 s for a 32-layer Llama), and inference and the grad all-reduce
    completion both read it while the model does not change."""
    token = _TRACES.set({})
    try:
        yield
    finally:
        _TRACES.reset(token)


def trace(
    model: nn.Module, example_inputs: tuple | dict | None = None, real: bool = False
) -> dict[str, Any]:
    """Run one forward of ``model`` on fake meta tensors (``real=True``: on its own weights, for
    code that needs values) and return what the tags say (nodes, modules' inputs)."""
    cache = _TRACES.get() if example_inputs is None and not real else None
    if cache is not None and id(model) in cache:
        return cache[id(model)]
    info = _trace(model, example_inputs, real)
    if cache is not None:
        cache[id(model)] = info
    return info


def _trace(model: nn.Module, example_inputs, real: bool) -> dict[str, Any]:
    names = {id(m): n for n, m in model.named_modules()}
    modules = dict(model.named_modules())
    nodes = {n: _Node(k, _out_width(m, k)) for n, m in model.named_modules() if (k := _kind(m))}
    tracer = _Tracer(nodes)
    blocks = _blocks(model)
    block_ids = {id(m) for _, m in blocks}
    module_inputs: dict[str, list[tuple[str, tuple, frozenset]]] = {}
    per_head_users: dict[str, set[str]] = {}  # 1-D-param module -> linears it acts on
    hooks = []

    def reset_stream(values: list[torch.Tensor], width: int | None = None) -> None:
        for t in values:
            if t.is_floating_point() and (width is None or (t.ndim and t.shape[-1] == width)):
                tracer.into_stream(tracer.tag(t))
                tracer.set_tag(t, frozenset({STREAM}))

    def pre(mod, args, kwargs):
        name = names[id(mod)]
        if mod is model:  # parameters are (fake) tensors of the trace by now
            tracer.weights = {id(p): n for n in nodes for p in modules[n].parameters(recurse=False)}
        if name in nodes:
            tracer.active.append(name)
        if id(mod) in block_ids or mod is model and not blocks:
            floats = [t for t in _tensors((args, kwargs)) if t.is_floating_point()]
            if floats:
                reset_stream(floats, floats[0].shape[-1] if mod is not model else None)
        ins = [(f"arg:{i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ins += [(f"kw:{k}", v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        module_inputs[name] = [
            (key, tuple(t.shape), tracer.tag(t)) for key, t in ins if t.is_floating_point()
        ]
        tags = frozenset().union(*(tracer.tag(t) for _, t in ins))
        if name in nodes:
            node = nodes[name]
            node.src |= tags
            for src in tags:
                if src in nodes:
                    nodes[src].consumers.add(name)
        elif any(True for _ in mod.parameters(recurse=False)):
            params = [p for p in mod.parameters(recurse=False)]
            one_d = all(p.ndim == 1 for p in params)
            width = max(p.shape[0] for p in params) if one_d else None
            for src in tags & nodes.keys():
                node = nodes[src]
                whole = node.out // max(1, node.split)
                if not one_d or width in (node.out, whole):
                    node.needs_whole = node.needs_whole or f"{name} needs its whole output"
                else:
                    node.per_head_consumers.add(name)
                    per_head_users.setdefault(name, set()).add(src)

    def post(mod, args, kwargs, output):
        name = names[id(mod)]
        if name in nodes:
            tracer.active.pop()
            for t in _tensors(output)[:1]:
                tracer.set_tag(t, frozenset({name}))
                tracer.origin[id(t)] = (name, t.ndim - 1, False)
        elif id(mod) in block_ids or mod is model and not blocks:
            # what a block returns in the stream's shape is the stream (not its attention
            # weights or key/value cache, which a sharded attention keeps per rank)
            outs = [t for t in _tensors(output) if t.is_floating_point()]
            for t in outs:
                if tuple(t.shape) == tuple(outs[0].shape) and tracer.tag(t) & nodes.keys():
                    tracer.into_stream(tracer.tag(t))
                    tracer.set_tag(t, frozenset({STREAM}))

    for mod in model.modules():
        hooks.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(mod.register_forward_hook(post, with_kwargs=True))
    if example_inputs is None:
        args, kwargs = _example_inputs(model)
    elif isinstance(example_inputs, Mapping):
        args, kwargs = (), dict(example_inputs)
    else:
        args, kwargs = tuple(example_inputs), {}
    from torch._subclasses.fake_tensor import FakeTensorMode

    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level, quiet.level = quiet.level, logging.CRITICAL  # a failed trace is reported by the caller
    try:
        if real:
            device = next(model.parameters()).device
            args, kwargs = tree_map(
                lambda t: torch.zeros_like(t, device=device) if isinstance(t, torch.Tensor) else t,
                (args, kwargs),
            )
            with torch.no_grad(), tracer:
                model(*args, **kwargs)
        else:
            fake = FakeTensorMode(allow_non_fake_inputs=True)
            args, kwargs = tree_map(
                lambda t: fake.from_tensor(t.to("meta")) if isinstance(t, torch.Tensor) else t,
                (args, kwargs),
            )
            state = _meta_state(model, fake)
            with state, _fake_friendly_experts(model), torch.no_grad(), fake, tracer:
                model(*args, **kwargs)
    finally:
        quiet.setLevel(level)
        for h in hooks:
            h.remove()
    return {
        "nodes": nodes,
        "blocks": [n for n, _ in blocks],
        "module_inputs": module_inputs,
        "per_head_users": per_head_users,
        "batch": _TRACE_BATCH,
    }


def _pairs(nodes: dict[str, _Node], exclude: set[str]) -> tuple[dict[str, set[str]], dict]:
    """Row linear -> its column sources, after removing every pair that cannot be split."""
    why: dict[str, str] = {}
    rows = {
        n: {s for s in v.src}
        for n, v in nodes.items()
        if v.kind != "embedding"
        and n not in exclude
        and v.writer
        and v.src
        and all(s in nodes and s not in exclude for s in v.src)
    }
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


def _generic(name: str) -> str:
    return ".".join("*" if p.isdigit() else p for p in name.split("."))


def _collapse(entries: dict[str, Any], all_names: list[str]) -> dict[str, Any]:
    """Replace per-layer names by ``*`` patterns where every layer agrees."""
    groups: dict[str, list[str]] = {}
    for n in entries:
        groups.setdefault(_generic(n), []).append(n)
    out: dict[str, Any] = {}
    for pattern, members in groups.items():
        values = [entries[m] for m in members]
        everyone = [n for n in all_names if _generic(n) == pattern]
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


def infer_plan(model: nn.Module, example_inputs: tuple | dict | None = None) -> Plan:
    """A `Plan` for ``model`` from its dataflow (see the module docstring); source "inferred".

    ``example_inputs`` (positional tuple or kwargs dict, any device) replaces the default trace
    inputs: ``input_ids`` of shape [3, 7] for transformers models, else a float tensor shaped for
    the first linear. Raises ValueError when the model cannot be traced on meta.
    """
    try:
        try:
            info = trace(model, example_inputs)
        except Exception:  # noqa: BLE001 - model code may do anything on meta
            # code that needs values (a data-dependent branch): one real forward, when the
            # weights are real and small enough for that to be cheap
            params = list(model.parameters())
            small = sum(p.numel() for p in params) <= REAL_TRACE_MAX_PARAMS
            if not params or params[0].device.type == "meta" or not small:
                raise
            info = trace(model, example_inputs, real=True)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(
            f"Could not trace {type(model).__name__} on the meta device to infer a plan "
            f"({type(exc).__name__}: {exc}); pass plan={{'module.pattern': 'colwise' | "
            "'rowwise' | ...}} or a YAML plan from configs/."
        ) from exc
    nodes: dict[str, _Node] = info["nodes"]
    modules = dict(model.named_modules())
    styles: dict[str, str] = {}
    notes: dict[str, str] = {}

    # vocabulary: input embedding (and every module sharing its weight), output head
    exclude: set[str] = set()
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    embed_weight = getattr(embed, "weight", None)
    for name, mod in modules.items():
        if (
            isinstance(mod, nn.Embedding)
            and embed_weight is not None
            and mod.weight is embed_weight
        ):
            styles[name] = "vocab_parallel"
            exclude.add(name)
        elif head is not None and mod is head and _kind(mod) == "linear":
            styles[name] = "colwise_gather_output"
            exclude.add(name)

    # a parameter tied to a vocabulary one elsewhere (BERT's cls.predictions.bias) is laid out
    # the same way, by a parameter entry
    owners_of: dict[int, list[tuple[str, str]]] = {}
    for name, mod in modules.items():
        for pname, p in mod.named_parameters(recurse=False):
            owners_of.setdefault(id(p), []).append((name, pname))
    for tied in owners_of.values():
        vocab = [styles[n] for n, _ in tied if n in exclude]
        for name, pname in tied:
            if vocab and name not in exclude:
                styles[f"{name}.{pname}"] = vocab[0]

    rows, why = _pairs(nodes, exclude)
    groups = []
    fixups: dict[str, dict] = {}
    for r, cols in rows.items():
        pair = sorted(cols) + [r]
        counts = {}
        for c in sorted(cols):
            v = nodes[c]
            if v.kind == "embedding":
                styles[c] = "colwise_embedding"
            elif v.split == 2:
                styles[c] = "packed_colwise"
            elif v.split == 3:
                styles[c] = "packed_qkv_colwise"
            else:
                styles[c] = "colwise"
            counts[f"output features of {c}"] = v.out // max(1, v.split)
            for user in sorted(v.per_head_consumers - set(pair)):
                styles[user] = "replicated_with_grad_allreduce"
                pair.append(user)  # replicated with the group: then its gradient is whole
        styles[r] = "rowwise"
        counts[f"input features of {r}"] = _in_width(modules[r], nodes[r].kind)
        owners = {n.rsplit(".", 1)[0] for n in pair if "." in n}
        owners.add(_common_parent(pair))
        widths = set(counts.values())
        for owner in sorted(o for o in owners if o in modules):
            fix = _fixups(modules[owner], widths, info, owner)
            if fix:
                fixups[owner] = {**fixups.get(owner, {}), **fix}
                for attr in fix.get("divide", []):
                    counts[f"{owner}.{attr}"] = getattr(modules[owner], attr)
            for pname in _per_head_params(modules[owner], widths):
                styles[f"{owner}.{pname}"] = "colwise"  # split by heads, like the heads
                pair.append(f"{owner}.{pname}")
        groups.append({"modules": pair, "owners": sorted(owners & set(fixups)), "counts": counts})

    # A replicated linear whose output is cut unevenly, one part into column linears and the
    # rest elsewhere (MLA's kv_a_proj_with_mqa: [kv latent | rope key], the rope key broadcast
    # straight to the rank's heads): that rest gets a partial gradient on each rank. With a
    # known rope width, mla_kv_a_proj all-reduces it; otherwise its groups stay whole.
    columns = {c for cols in rows.values() for c in cols}
    for name, v in nodes.items():
        if name in styles or not v.uneven or not v.consumers or not v.consumers <= columns:
            continue
        parent = modules.get(name.rsplit(".", 1)[0] if "." in name else "")
        if isinstance(getattr(parent, "qk_rope_head_dim", None), int):
            styles[name] = "mla_kv_a_proj"
            for g in groups:
                if v.consumers & set(g["modules"]):
                    g["modules"].append(name)
        else:
            for g in groups:
                if v.consumers & set(g["modules"]):
                    for m in g["modules"]:
                        styles[m] = "replicate"
                        why[m] = f"{name} also feeds the split heads directly, not through them"

    for name, mod in modules.items():
        entries = _fused_experts(mod)
        if entries and name not in exclude:
            styles[name] = "moe_tp_experts"
            styles.update({f"{name}.{p}": style for p, style in entries.items()})
            inter = _experts_inter(mod)
            groups.append(
                {
                    "modules": [name, *(f"{name}.{p}" for p in entries)],
                    "owners": [],
                    "counts": {f"intermediate size of {name}": inter},
                }
            )

    for name, reason in why.items():
        if name not in styles or styles[name] == "replicate":
            notes[name] = f"replicated: {reason}"

    all_names = list(modules) + [n for n, _ in model.named_parameters(remove_duplicate=False)]
    plan = Plan()
    for pattern, style in _collapse(styles, all_names).items():
        plan.set(pattern, style, "inferred")
    plan.fixups.update(_collapse(_common_head_inputs(fixups), all_names))
    plan.notes.update(_collapse(notes, all_names))
    plan.groups.extend(_collapse_groups(groups))
    return _checked(model, plan, example_inputs)


def complete_with_inferred(model: nn.Module, plan: Plan, inferred: Plan, tp: int = 2) -> list:
    """Add to ``plan`` (in place) every group of ``inferred`` that ``plan`` leaves whole: none of
    its modules or their ancestors named by ``plan``, and a tp dry run still passing with it
    (transformers' plans skip MLA's down projections, routers' shared MLPs, hybrid layers...).
    Returns the groups added."""
    from tpkit.plan.spec import matches

    names = list(dict(model.named_modules())) + [n for n, _ in model.named_parameters()]

    def named_above(name: str) -> bool:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            hit = plan.style_for(".".join(parts[:i]))
            if hit and (i == len(parts) or hit[0] != "replicate"):
                return True
        return False

    def add(target: Plan, group: dict) -> None:
        for pattern in group["modules"]:
            target.set(pattern, inferred[pattern], "inferred")
        for owner in group["owners"]:
            if owner in inferred.fixups:
                target.fixups[owner] = inferred.fixups[owner]
        target.groups.append(group)

    added = []
    for group in inferred.groups:
        patterns = group["modules"]
        if not all(p in inferred and inferred[p] != "replicate" for p in patterns):
            continue  # left whole by inference too, or not one entry per layer kind
        concrete = [n for p in patterns for n in names if matches(p, n)]
        if not concrete or any(named_above(n) for n in concrete):
            continue
        trial = Plan().merged(plan)
        trial.fixups.update(plan.fixups)
        trial.groups.extend(plan.groups)
        add(trial, group)
        if dry_run(model, trial, None, tp) is None:
            add(plan, group)
            added.append(group)
    return added


_COLUMN_STYLES = ("colwise", "packed_colwise", "packed_qkv_colwise", "colwise_embedding")


def complete_grad_allreduce(model: nn.Module, plan: Plan) -> Plan:
    """Add ``replicated_with_grad_allreduce`` for the modules with their own parameters that act
    on a column-parallel output which ``plan`` (typically transformers') leaves unnamed:
    Apertus's xIELU activation (scalar ``alpha_p``/``alpha_n`` between up_proj and down_proj)
    or a per-head norm. Each rank's gradient for them covers only its shard of the activation,
    so without the all-reduce they drift apart across ranks. Conversely an inferred or
    transformers entry of that style whose columns are no longer split (a user entry replicated them) becomes
    ``replicate``. Traced on fake tensors; a model that does not trace gets the plan
    unchanged."""
    try:
        nodes = trace(model)["nodes"]
    except Exception:  # noqa: BLE001 - model code may do anything on meta
        return plan
    split: set[str] = set()  # consumers of some column-parallel output
    for t in plan.resolve(model):
        if t.kind != "module" or t.style not in _COLUMN_STYLES or t.name not in nodes:
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


def _checked(model: nn.Module, plan: Plan, example_inputs, tp: int = 2) -> Plan:
    """Dry-run the plan at tp=2 on fake tensors with rank 0's shard shapes and fix-ups; when the
    model's code still fails (it reads a global head count somewhere the plan cannot fix, or
    feeds a split output to a layer that needs it whole, like LFM2's short convolution), leave
    the fewest groups replicated that make it run, each noted with the error: groups are
    replicated one more at a time (attention groups first) until the dry run passes, then
    each is given back its split if the dry run still passes without it."""
    error = dry_run(model, plan, example_inputs, tp)
    if error is None:
        return plan
    why = f"a dry run of the split forward failed: {error}"

    def trial(replicated: list[int]) -> Plan:
        out = Plan().merged(plan)
        for i in replicated:
            out.replicate_group(plan.groups[i], why)
        return out

    order = sorted(range(len(plan.groups)), key=lambda i: not plan.groups[i]["owners"])
    chosen: list[int] = []
    for i in order:
        chosen.append(i)
        if dry_run(model, trial(chosen), example_inputs, tp) is None:
            break
    else:
        return trial(chosen)  # nothing split runs: everything stays replicated, noted
    for i in list(chosen[:-1]):
        rest = [j for j in chosen if j != i]
        if dry_run(model, trial(rest), example_inputs, tp) is None:
            chosen = rest
    return trial(chosen)


def dry_run(model: nn.Module, plan: Plan, example_inputs, tp: int) -> str | None:
    """None when ``model`` runs with ``plan`` at ``tp`` on fake tensors (rank 0's shard shapes,
    fix-ups applied), else the error in brief. Nothing is allocated or computed."""
    error = _dry_run_once(model, plan, example_inputs, tp, real=False)
    if error == _NOTHING_LEARNED:
        params = list(model.parameters())
        real = params and params[0].device.type != "meta"
        small = sum(p.numel() for p in params) <= REAL_TRACE_MAX_PARAMS
        error = (
            _dry_run_once(model, plan, example_inputs, tp, real=True) if real and small else None
        )
    return None if error == _NOTHING_LEARNED else error


_NOTHING_LEARNED = "<nothing learned>"


def _dry_run_once(model: nn.Module, plan: Plan, example_inputs, tp: int, real: bool) -> str | None:
    """None when a forward with rank 0's shapes runs on fake tensors, else the error in brief."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tpkit.plan.spec import local_shape
    from tpkit.plan.validate import param_layouts, settle_inferred_groups

    plan = Plan().merged(plan)
    settle_inferred_groups(plan, tp)  # what tp does not divide is validation's to report
    layouts = param_layouts(model, plan)
    shapes = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        layout = layouts[name][1]
        shapes[id(p)] = local_shape(tuple(p.shape), layout, tp) if layout.sharded else None
    shapes = {k: v for k, v in shapes.items() if v is not None}
    modules = dict(model.named_modules())
    restore: list = []  # (module, attribute, value) to put back
    hooks: list = []
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level, quiet.level = quiet.level, logging.CRITICAL
    try:  # every temporary change is made inside, so the finally undoes all of them
        for name, mod in modules.items():
            fix = plan.fixups_for(name) if plan.fixups else {}
            heads = None
            for attr in fix.get("divide", []):
                value = getattr(mod, attr, None)
                if isinstance(value, int):
                    restore.append((mod, attr, value))
                    setattr(mod, attr, value // tp)
                    heads = heads or (value if attr in HEAD_ATTRS else None)
            if fix.get("head_inputs") and heads:
                hooks.append(
                    mod.register_forward_pre_hook(
                        _head_slicer(fix["head_inputs"], heads, tp), with_kwargs=True
                    )
                )
            if (
                isinstance(getattr(mod, "nf", None), int)
                and id(getattr(mod, "weight", None)) in shapes
            ):
                restore.append((mod, "nf", mod.nf))
                mod.nf = shapes[id(mod.weight)][-1]
        for t in plan.resolve(model):
            if t.kind == "module" and t.style == "colwise_gather_output":
                full = _out_width(modules[t.name], _kind(modules[t.name]) or "linear")
                hooks.append(modules[t.name].register_forward_hook(_widen(full)))
            elif t.kind == "module" and t.style == "rowwise_split_input":
                kind = _kind(modules[t.name]) or "linear"
                local = _in_width(modules[t.name], kind)
                if id(modules[t.name].weight) in shapes:
                    local = shapes[id(modules[t.name].weight)][0 if kind == "conv1d" else -1]
                hooks.append(modules[t.name].register_forward_pre_hook(_narrow(local)))
        args, kwargs = _example_inputs(model) if example_inputs is None else ((), {})
        if example_inputs is not None:
            if isinstance(example_inputs, Mapping):
                kwargs = dict(example_inputs)
            else:
                args = tuple(example_inputs)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        if real:
            device = next(model.parameters()).device
            args, kwargs = tree_map(
                lambda t: torch.zeros_like(t, device=device) if isinstance(t, torch.Tensor) else t,
                (args, kwargs),
            )
        else:
            args, kwargs = tree_map(
                lambda t: fake.from_tensor(t.to("meta")) if isinstance(t, torch.Tensor) else t,
                (args, kwargs),
            )
        if real:
            with _real_state(model, shapes), torch.no_grad():
                model(*args, **kwargs)
        else:
            state = _meta_state(model, fake, shapes)
            with state, _fake_friendly_experts(model), torch.no_grad(), fake:
                model(*args, **kwargs)
        return None
    except Exception as exc:  # noqa: BLE001 - whatever the model's code raises
        first = (str(exc).strip().splitlines() or [""])[0]
        if (
            "Tensor.item()" in first
            or "data-dependent" in first.lower()
            or "DataDependent" in type(exc).__name__
        ):
            return _NOTHING_LEARNED  # the fake forward cannot run this model at all
        return f"{type(exc).__name__}: {first[:160]}"
    finally:
        quiet.setLevel(level)
        for h in hooks:
            h.remove()
        for mod, attr, value in restore:
            setattr(mod, attr, value)


def _head_slicer(head_inputs: Mapping[str, int], heads: int, tp: int):
    per = heads // tp

    def hook(mod, args, kwargs):
        for key, dim in head_inputs.items():
            kind, k = key.split(":", 1)
            if kind == "kw" and isinstance(kwargs.get(k), torch.Tensor):
                t = kwargs[k]
                t = t.unflatten(0, (-1, heads))[:, :per].flatten(0, 1) if dim == 0 else t[:, :per]
                kwargs = {**kwargs, k: t}
        return args, kwargs

    return hook


def _narrow(local: int):
    """rowwise_split_input takes this rank's slice of a replicated input first."""

    def hook(mod, args):
        if args and isinstance(args[0], torch.Tensor):
            return (args[0][..., :local], *args[1:])
        return args

    return hook


def _widen(full: int):
    def hook(mod, args, output):
        if isinstance(output, torch.Tensor):
            return output.new_empty((*output.shape[:-1], full))
        return output

    return hook


def _in_width(module: nn.Module, kind: str) -> int:
    w = module.weight
    return int(w.shape[0] if kind == "conv1d" else w.shape[1])


def _fixups(owner: nn.Module, widths: set[int], info: dict, owner_name: str) -> dict:
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
        h, b = heads[0], info["batch"]
        for key, shape, tags in info["module_inputs"].get(owner_name, []):
            if tags or len(shape) < 2:
                continue  # tagged inputs are already sharded (T5's position_bias) or the stream
            if shape[0] == b * h and shape[0] != b:
                head_inputs[key] = 0
            elif len(shape) == 4 and shape[1] == h and shape[0] in (1, b):
                head_inputs[key] = 1
    out: dict[str, Any] = {"divide": divide}
    if head_inputs:
        out["head_inputs"] = head_inputs
    return out


def _fused_experts(mod: nn.Module) -> dict[str, str]:
    """Styles for the 3-D weights of a transformers fused-experts module, read from what the
    module declares about itself (``use_experts_implementation``: ``has_gate``,
    ``is_concatenated`` [gate; up] or interleaved, ``is_transposed``, ``has_bias``): each
    expert's up (and gate) projection column-parallel, its down projection row-parallel,
    the module ``moe_tp_experts`` (f in, one all-reduce out). {} for any other module."""
    d = mod.__dict__
    if not all(isinstance(d.get(k), bool) for k in ("has_gate", "is_concatenated")):
        return {}
    up = "gate_up_proj" if d["has_gate"] else "up_proj"
    params = dict(mod.named_parameters(recurse=False))
    if params.get(up) is None or params[up].ndim != 3 or params.get("down_proj") is None:
        return {}
    # styles name raw dims, as in transformers' plans (see spec.param_layout): the output dim
    # of gate_up is -2 ("colwise") or, transposed, -1 ("rowwise"); its 2-D bias [E, out] -1
    packed = "packed_" if d["has_gate"] and d["is_concatenated"] else ""
    transposed = d.get("is_transposed") is True
    out = {
        up: f"{packed}{'rowwise' if transposed else 'colwise'}",
        "down_proj": "colwise" if transposed else "rowwise",
    }
    if f"{up}_bias" in params:
        out[f"{up}_bias"] = f"{packed}rowwise"
    return out


def _experts_inter(mod: nn.Module) -> int:
    """Each expert's intermediate width, from its down projection."""
    w = mod.down_proj
    return int(w.shape[1] if mod.__dict__.get("is_transposed") else w.shape[2])


def _per_head_params(owner: nn.Module, widths: set[int]) -> list[str]:
    """The owner's own 1-D parameters with one value per head (GPT-OSS's attention ``sinks``),
    read by its code next to the rank's heads: they are split as the heads are. Head counts
    come from the owner's head attributes, or its split widths over its ``head_dim``."""
    heads = {v for a in HEAD_ATTRS if isinstance(v := owner.__dict__.get(a), int)}
    head_dim = owner.__dict__.get("head_dim")
    if isinstance(head_dim, int) and head_dim > 0:
        heads |= {w // head_dim for w in widths if w % head_dim == 0}
    heads.discard(head_dim)  # a [head_dim] parameter (DiffLlama's lambdas) acts within a head
    return [
        n
        for n, p in owner.named_parameters(recurse=False)
        if p.ndim == 1 and p.shape[0] in heads and p.shape[0] > 1
    ]


def _common_head_inputs(fixups: dict[str, dict]) -> dict[str, dict]:
    """Keep a per-head input only where every layer of the same kind receives it: an input that
    only some layers get was made by an earlier layer (T5 passes its bias on), already per rank."""
    by_kind: dict[str, list[dict]] = {}
    for name, fix in fixups.items():
        by_kind.setdefault(_generic(name), []).append(fix)
    out = {}
    for name, fix in fixups.items():
        fix = dict(fix)
        shared = [f.get("head_inputs", {}) for f in by_kind[_generic(name)]]
        common = {
            k: v for k, v in fix.pop("head_inputs", {}).items() if all(k in h for h in shared)
        }
        out[name] = {**fix, "head_inputs": common} if common else fix
    return out


def _collapse_groups(groups: list[dict]) -> list[dict]:
    seen: dict[tuple, dict] = {}
    for g in groups:
        key = tuple(_generic(m) for m in g["modules"])
        if key not in seen:
            counts = {re.sub(r"\.\d+\.", ".*.", k + ".")[:-1]: v for k, v in g["counts"].items()}
            seen[key] = {
                "modules": list(key),
                "owners": [_generic(o) for o in g["owners"]],
                "counts": counts,
            }
    return list(seen.values())
