"""Identical layers run once: a layer's twins stand on its forward instead of running theirs.

A 32-layer Llama is one layer 32 times over, and every fake forward of the analysis (the trace,
each dry run) paid for all 32. `find_twins` reads which layers of the model's blocks
(`tpkit.trace.trace.blocks`) are alike: the same classes in the same places, the same
parameter and buffer shapes, the same attribute values in every submodule. Its *twins* are
the later layers alike to an earlier one, their *representative*. Inside `folded`, a twin's
forward is a stub: the model's own code still runs around every layer (its loop, masks,
positions, per-layer inputs), but a twin hands on what its representative gave, with none of
its own compute.

That is exact for what the analysis asks (does this run? what flows where?) only when the
representative's forward would have done the same as the twin's, and each condition is
checked, not assumed:

- alike by construction: every attribute equal but integers named as a layer's index
  (``layer_idx``, ``layer_id``, a cycle's offset, ...), which differ by design; each layer's
  are watched while it runs (`tpkit.trace.watched.Watched`): a comparison or truth test of one
  (RWKV's ``if self.layer_id == 0``) is answered with the layer's own value and recorded as a
  guard of its call, and a twin stands on that call only where its own indices answer every
  guard alike; arithmetic gives a watched value in turn (Inkling-2's ``self.layer_idx +
  cache_offset``); any other use (``config.layer_types[self.layer_idx]``, a float made of it)
  breaks the fold: that index becomes part of what tells layers of that kind apart
  (`FoldBroken.index`, named ``<kind>:<place>``; other kinds keep folding) and the forward
  runs again; an integer equal to such an index (Kolibri-1.1's ``kv_source_layer``, a layer's
  own where it reads no other's) is an index under another name there (`_aliases`); an
  integer handed to a layer under such a name (Zamba's loop calls ``layer(hidden, original,
  layer_idx, ...)``, HRM's stacks hand each layer its cycle's ``cycle_offset``) is the same:
  left out of what is compared, handed watched, and where read compared from then on for
  that kind of layer only (``<representative>(<name>)``: Zamba2's hybrid layers pick their
  adapter by it, its Mamba layers, handed it too, never read it);
- alike in what they are given: each twin's call must match its representative's (tensor
  shapes and dtypes, the same objects for every input but the stream, equal plain values);
- no effect besides the output: the representative must not change its inputs in place (their
  version counters), its modules' attributes, or the containers it was handed (a dict of
  shared key/value states), and must return one tensor shaped as its input; the one effect
  repeated is a plain value (a dtype, a number) written into an attribute (Switch
  Transformers' router keeps ``self.input_dtype``): a twin whose attributes were as the
  layer's before its call gets the same writes;
- run once per way it is called, stood on after: a layer the model calls again (HRM runs its
  stacks in cycles) stands on its own last real call where called alike, and runs its forward
  again where called otherwise (Inkling-2-Loop's later passes hand its loop layers messages
  and another cache offset); a call stands only on the last real call of a layer, and all of
  a layer's calls on calls of one layer: itself, or another whose real calls it stood on every
  one of (what a trace copies from that layer, its records added up over its real calls, is
  then what its own calls would have recorded); the grad mode a layer is called in is
  compared too;
- alike under the plan tried: the dry run folds only twins the plan lays out alike
  (`plan_twins`).

Anything else raises `FoldBroken` (a ``BaseException``, so model code that catches ``Exception``
cannot swallow it), and the caller runs the forward again unfolded. Pure: no process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tpkit.compat import DisableTorchFunction, tree_flatten, tree_map, unset_fake_temporarily
from tpkit.plan.spec import Plan
from tpkit.trace.shadow import ShadowValues, tensors_in
from tpkit.trace.watched import FoldBroken, Guards, Watched, holds, math_watched

__all__ = [
    "Describe",
    "FoldBroken",
    "Relative",
    "Twins",
    "find_twins",
    "folded",
    "known_values",
    "plan_twins",
]

#: integer attributes that number a layer (`find_twins`): different in every layer by design
INDEX_ATTRS = re.compile(
    r"^(layer|block|cycle)_?(idx|id|index|number|num|no|offset)$|^(idx|index)$"
    r"|^[a-z]\w*_(idx|index)$"  # a layer's own count of something (Beam's residual_add_idx)
)
#: a module's own bookkeeping, never compared (hooks, its registries, training mode)
_INTERNAL = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"}
)


@dataclass(frozen=True)
class Twins:
    """``rep``: each twin layer's name -> its representative's (an earlier layer alike);
    ``watched``: each representative -> the (submodule, attribute) index integers its twins
    differ in, watched while it runs; ``tally``: how many folded layer calls ran their own
    forward ("run") and how many stood on another's ("stood"), over every forward folded
    with these twins (and those `plan_twins` makes of them)."""

    rep: Mapping[str, str] = field(default_factory=dict)
    watched: Mapping[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    tally: dict[str, int] = field(default_factory=dict, compare=False)
    #: the name (``<list>.<index>``) of every block of a kind with twins: what names are read
    #: relative to (`Relative`); a name in any other block is read as it is
    layers: frozenset[str] = frozenset()
    #: index names that tell layers apart (`find_twins`'s ``distinguishing``): an argument so
    #: named is compared by its value, not watched
    distinguishing: frozenset[str] = frozenset()
    #: the names of parameters tied across blocks, the same object at each place it is held in
    #: any block (Zamba's shared transformer): read by every layer under one name (`Relative`)
    fixed: frozenset[str] = frozenset()
    #: each watching representative -> the kind it was split from, which names the index
    #: attributes its layers read in ``distinguishing`` (`find_twins`)
    base: Mapping[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.rep)


def find_twins(
    layers: list[tuple[str, nn.Module]], distinguishing: frozenset[str] = frozenset()
) -> Twins:
    """The twins among ``layers`` (name, module: the model's blocks, in order): each layer
    alike to an earlier one (see the module docstring). Index attributes (`INDEX_ATTRS`, and
    their aliases: `_aliases`) are left out of the comparison unless named in
    ``distinguishing``, by name (every layer) or as ``<kind>:<place>`` (`_token`: the layers
    of that kind only); the representative watches those its twins differ in."""
    aliases = _aliases(layers)
    base: dict[tuple, str] = {}  # what layers compare, the per-kind indices aside -> first
    first: dict[tuple, tuple[str, dict]] = {}
    rep: dict[str, str] = {}
    bases: dict[str, str] = {}
    watched: dict[str, set[tuple[str, str]]] = {}
    seen: set[int] = set()
    configs: dict[int, tuple] = {}  # id -> a config's values, once per config (`_signature`)
    for name, module in layers:
        if id(module) in seen or not any(True for _ in module.parameters()):
            continue  # a layer run twice (shared) or holding nothing: not folded
        seen.add(id(module))
        key, indices = _signature(module, distinguishing, aliases, configs)
        kind = base.setdefault(key, name)
        own = sorted(k for k in indices if _token(kind, k) in distinguishing)
        key = (key, tuple((k, indices.pop(k)) for k in own))  # read by this kind: compared
        if key not in first:
            first[key] = (name, indices)
            bases[name] = kind
            continue
        rep_name, rep_indices = first[key]
        rep[name] = rep_name
        differ = {k for k, v in indices.items() if rep_indices.get(k) != v}
        watched.setdefault(rep_name, set()).update(differ)
    # names inside a layer of no kind with twins are read as they are, not relative to the
    # reader (T5's position bias, made in its first layer and handed to every later one)
    members = set(rep) | set(rep.values())
    names = frozenset(n for n, _ in layers if n in members)
    watch = {r: tuple(sorted(w)) for r, w in watched.items()}
    fixed = _tied(layers)
    base_of = {r: bases[r] for r in watch}
    return Twins(rep, watch, layers=names, distinguishing=distinguishing, fixed=fixed, base=base_of)


def _token(kind: str, place: tuple[str, str]) -> str:
    """How an index attribute that a layer of ``kind`` read is named in ``distinguishing``:
    ``<kind>:<submodule>.<attribute>``, for that kind of layer only (Kolibri-1.1's KV-storing
    layers read their ``layer_idx``; its other layers never do, and keep folding)."""
    rel, attr = place
    return f"{kind}:{rel}.{attr}" if rel else f"{kind}:{attr}"


def _aliases(layers: list[tuple[str, nn.Module]]) -> frozenset[tuple[str, str]]:
    """(submodule, attribute) places of integers that are an index under another name: equal
    to an index attribute of the same submodule (`INDEX_ATTRS`) in at least two layers
    (Kolibri-1.1's ``kv_source_layer``: a layer's own index where it reads no other's
    keys). Where so, such an integer differs per layer as the index does, and is watched as
    one; elsewhere (another layer's number) it is compared. Two layers at least, so that a
    count equal to one layer's index by chance (8 heads in layer 8) changes nothing."""
    count: dict[tuple[str, str], int] = {}
    for _, module in layers:
        for rel, sub in module.named_modules():
            own = _own_indices(sub)
            if not own:
                continue
            for k, v in vars(sub).items():
                if _is_int(v) and not INDEX_ATTRS.match(k) and v in own:
                    count[(rel, k)] = count.get((rel, k), 0) + 1
    return frozenset(place for place, n in count.items() if n >= 2)


def _own_indices(sub: nn.Module) -> set[int]:
    return {v for k, v in vars(sub).items() if _is_index(k, v)}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tied(layers: list[tuple[str, nn.Module]]) -> frozenset[str]:
    """Every name (as held in a block) of each parameter that blocks share, where every block
    holding one of its places holds it there: a layer reads it under the same name as its
    twins do, wherever the trace names it."""
    at: dict[str, set[int]] = {}  # place in a block -> the parameters held there
    where: dict[int, set[str]] = {}  # parameter -> its places
    blocks: dict[int, set[str]] = {}  # parameter -> the blocks holding it
    names: dict[int, set[str]] = {}
    for name, module in layers:
        for rel, p in module.named_parameters(remove_duplicate=False):
            at.setdefault(rel, set()).add(id(p))
            where.setdefault(id(p), set()).add(rel)
            blocks.setdefault(id(p), set()).add(name)
            names.setdefault(id(p), set()).add(f"{name}.{rel}")
    fixed = set()
    for p, places in where.items():
        if len(blocks[p]) > 1 and all(at[rel] == {p} for rel in places):
            fixed |= names[p]
    return frozenset(fixed)


def _signature(
    module: nn.Module,
    distinguishing: frozenset[str],
    aliases: frozenset[tuple[str, str]] = frozenset(),
    configs: dict[int, tuple] | None = None,
) -> tuple[tuple, dict]:
    """(what must be equal for two layers to be alike, their index attributes' values). A
    model config a submodule holds is compared by its values (`_is_model_config`), each
    config's worked out once per ``configs`` (NLLB-MoE's 24 layers hold one, in many
    submodules each: 0.14 -> 0.48 s a `find_twins` before)."""
    configs = {} if configs is None else configs
    parts, indices = [], {}
    for rel, sub in module.named_modules():
        params = tuple(
            (n, None if p is None else (tuple(p.shape), p.dtype, p.requires_grad))
            for n, p in sub._parameters.items()
        )
        buffers = tuple(
            (n, None if b is None else (tuple(b.shape), b.dtype)) for n, b in sub._buffers.items()
        )
        own = _own_indices(sub) if any(rel == r for r, _ in aliases) else set()
        attrs = []
        for k, v in vars(sub).items():
            if k in _INTERNAL or k.endswith("hooks") or k.startswith("_tpkit"):
                continue
            if k not in distinguishing and (
                _is_index(k, v) or ((rel, k) in aliases and _is_int(v) and v in own)
            ):
                indices[(rel, k)] = v
                attrs.append((k, "index"))  # an index here: the other layer's must be one too
                continue
            if _is_model_config(v):
                if id(v) not in configs:
                    configs[id(v)] = (type(v), _value(vars(v), 1))
                attrs.append((k, configs[id(v)]))
                continue
            attrs.append((k, _value(v)))
        parts.append((rel, type(sub), params, buffers, tuple(attrs)))
    return tuple(parts), indices


def _is_index(name: str, value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and bool(INDEX_ATTRS.match(name))


def _value(v: Any, depth: int = 0) -> Any:
    """An attribute's value as compared: plain values by equality, containers by their items,
    a module held outside the module tree (a kernel's function wrapper kept in a dict) by its
    class and own attributes, a ``functools.partial`` by its function and arguments, anything
    else by identity (a shared config is the same object
    in every layer)."""
    if v is None or isinstance(v, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return (type(v), v)
    if depth > 4:  # deep enough for xLSTM's partial of partials (its kernels, made per layer)
        return ("id", id(v))
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_value(x, depth + 1) for x in v))
    if isinstance(v, (set, frozenset)):
        return (type(v), frozenset(_value(x, depth + 1) for x in v))
    if isinstance(v, dict):
        return (type(v), tuple((_value(k, depth + 1), _value(x, depth + 1)) for k, x in v.items()))
    if isinstance(v, functools.partial):  # made per instance (GELUTanh's ``act``): by content
        return (
            functools.partial,
            _value(v.func, depth + 1),
            _value(v.args, depth + 1),
            _value(v.keywords, depth + 1),
        )
    if isinstance(v, nn.Module) and not any(True for _ in v.parameters()):
        own = ((k, _value(x, depth + 1)) for k, x in vars(v).items() if k not in _INTERNAL)
        return (type(v), tuple(x for x in own if not x[0].endswith("hooks")))
    return ("id", id(v))


def _is_model_config(v: Any) -> bool:
    """Whether ``v`` is a transformers model config: plain data, read by a layer's code but
    never written in a forward. A heterogeneous model's layers each hold their own copy of it
    (``config.per_layer_config[i]``: the model's config copied, the layer's overrides set), so
    compared by identity no two such layers were alike (Dots3-Note's 13 indexed-attention
    layers ran 13 times in every fake forward); compared by their values, layers whose configs
    say the same fold, and a layer whose overrides differ stays its own kind. Known by its
    class's lineage, as the analysis imports no transformers."""
    return any(c.__name__ == "PreTrainedConfig" for c in type(v).__mro__)


def plan_twins(twins: Twins, plan: Plan, model: nn.Module) -> Twins:
    """``twins`` restricted to the layers ``plan`` lays out alike: the same style and arguments
    for every module and parameter at the same place, the same fix-ups on every submodule
    (a settled plan writes some layers out alone: those run as themselves)."""
    if not twins:
        return twins
    layers = set(twins.rep) | set(twins.rep.values())
    views: dict[str, list] = {n: [] for n in layers}
    for t in plan.resolve(model):
        layer = _layer_of(t.name, layers)
        if layer is not None:
            rel = t.name[len(layer) :]
            views[layer].append((rel, t.style, t.kind, repr(plan.args.get(t.pattern))))
    if plan.fixups:
        counts = {k.count(".") for k in plan.fixups}
        for layer in layers:
            for rel, _ in model.get_submodule(layer).named_modules():
                name = f"{layer}.{rel}" if rel else layer
                if name.count(".") in counts and (fix := plan.fixups_for(name)):
                    views[layer].append((rel, "fixups", repr(fix)))
    rep = {m: r for m, r in twins.rep.items() if views[m] == views[r]}
    reps = set(rep.values())
    watched = {r: w for r, w in twins.watched.items() if r in reps}
    return dataclasses.replace(twins, rep=rep, watched=watched)


def _layer_of(name: str, layers: set[str]) -> str | None:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        if ".".join(parts[:i]) in layers:
            return ".".join(parts[:i])
    return None


@dataclass
class _Call:
    """One layer's real call: what it was given (its signature and tensors) and gave; a twin
    called alike stands on it."""

    layer: str
    signature: tuple
    inputs: list[torch.Tensor]
    output: Any
    #: the plain values its forward wrote into its modules' attributes, (submodule, name,
    #: value before or `_MISSING`, value after): a twin stands on the call only where its
    #: own attributes are as the layer's were, and takes the same writes (`_written`)
    writes: tuple = ()
    #: what its forward asked of its indices, and the answers (`tpkit.trace.watched`)
    guards: tuple = ()
    #: its signature as a fold comparing less compares it (`_Coarser`)
    coarse: tuple | None = None


#: what a fold compares of each tensor a layer is given, besides its shape and dtype: the
#: trace's tags, a shadow run's integer values (`folded`'s ``describe``); called with the
#: tensor and the layer being called
Describe = Callable[[torch.Tensor, str], Any]


class Relative:
    """Module names as seen from one layer: a name inside a block of the same list as
    ``<list>.<offset>`` from the layer's index (its own modules at 0, the layer before at -1),
    any other name as it is, as is a parameter the blocks tie (``fixed``: `Twins.fixed`).
    Twins called with alike relative names do alike things to alike relative names; a twin's
    records are the source's with every offset taken from the twin (`rename`)."""

    def __init__(self, layers: frozenset[str], fixed: frozenset[str] = frozenset()):
        self.layers, self.fixed = layers, fixed

    @staticmethod
    def position(layer: str) -> tuple[str, int]:
        head, _, index = layer.rpartition(".")
        return head, int(index)

    def split(self, name: str) -> tuple[str, str] | None:
        """(the block ``name`` is in, the rest of it), None outside every block (or a
        parameter the blocks tie)."""
        if name in self.fixed:
            return None
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            head = ".".join(parts[:i])
            if head in self.layers:
                return head, name[len(head) :]
        return None

    def seen_from(self, value: Any, layer: str) -> Any:
        """``value`` (names, or containers of them) with every block name relative to
        ``layer``."""
        if isinstance(value, str):
            hit = self.split(value)
            if hit is None:
                return value
            (head, index), (own, mine) = self.position(hit[0]), self.position(layer)
            return ("@", index - mine, hit[1]) if head == own else value
        if isinstance(value, (tuple, list)):
            return tuple(self.seen_from(v, layer) for v in value)
        if isinstance(value, (set, frozenset)):
            return frozenset(self.seen_from(v, layer) for v in value)
        return value

    def rename(self, source: str, twin: str) -> Callable[[str], str]:
        """Names as ``source`` saw them, as ``twin`` sees them: every block of their list
        moved by the twin's offset from the source (its own modules to the twin's)."""
        (s_list, s_index), (t_list, t_index) = self.position(source), self.position(twin)

        def rename(name: str) -> str:
            hit = self.split(name)
            if hit is None:
                return name
            head, index = self.position(hit[0])
            if head != s_list:
                return name  # another list (a decoder reading the encoder): as it is
            if t_list != s_list and hit[0] != source:
                raise FoldBroken(f"{twin} would read {name} across lists")
            moved = f"{t_list}.{index + t_index - s_index}" if t_list == s_list else twin
            if moved not in self.layers:
                raise FoldBroken(f"{twin} would read {moved}, which does not exist")
            return moved + hit[1]

        return rename


def known_values(shadow: ShadowValues) -> Describe:
    """What a shadow run's fold compares of a non-float tensor besides its shape: its values
    (`tpkit.trace.shadow.ShadowValues.known`: indices, masks, positions are what steer
    routing and shapes); floats steer no shape, as the shadow run's docstring says."""

    def describe(t: torch.Tensor, layer: str = "") -> Any:
        if t.is_floating_point() or t.is_complex():
            return None
        value = shadow.known(t)
        if value is None:
            return None
        with DisableTorchFunction(), unset_fake_temporarily():
            return value.numpy().tobytes()

    return describe


def _signature_of(args: tuple, kwargs: dict, describe: Describe | None, layer: str) -> tuple:
    """A call as compared: tensors by shape, dtype and what ``describe`` says of them (a fake
    tensor has no values: nothing else of it can steer a forward), plain values by equality,
    anything else by identity (a shared config, a cache)."""
    leaves, spec = tree_flatten((args, kwargs))
    out = []
    for v in leaves:
        if isinstance(v, Watched):  # an index argument: watched (its guards), never compared
            out.append(("index", v._name))
        elif isinstance(v, torch.Tensor):
            more = describe(v, layer) if describe is not None else None
            out.append((tuple(v.shape), v.dtype, v.requires_grad, more))
        else:
            out.append(_value(v))
    return (str(spec), tuple(out), torch.is_grad_enabled())


_tensors = tensors_in


def _held(args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """(container, its shallow state) for each mutable container a call is handed."""
    out = []
    for v in tree_flatten((args, kwargs))[0]:
        if isinstance(v, (torch.Tensor, nn.Module, Watched)) or v is None:
            continue
        if isinstance(v, (dict, list, set)) or hasattr(v, "__dict__"):
            out.append((v, _shallow(v)))
    return out


def _shallow(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple((k, id(x)) for k, x in v.items())
    if isinstance(v, (list, set)):
        return tuple(id(x) for x in v)
    return tuple((k, id(x)) for k, x in vars(v).items())


#: an attribute a module did not have (`_Call.writes`)
_MISSING = object()


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, bytes, torch.dtype, torch.device))


def _written(module: nn.Module, before: list[tuple], values: dict) -> tuple | None:
    """What a forward wrote into ``module``'s attributes since ``before`` (`_attributes`;
    ``values``: each (submodule, name)'s value then) as `_Call.writes`: only plain values
    added or replaced (Switch Transformers' router keeps ``self.input_dtype``), else None
    (an attribute dropped, a tensor, module or container written: what folding cannot
    repeat for a twin)."""
    after = _attributes(module)
    if after == before:
        return ()
    if [r for r, _ in after] != [r for r, _ in before]:
        return None
    subs, out = dict(module.named_modules()), []
    for (rel, now), (_, was) in zip(after, before, strict=True):
        if now == was:
            continue
        now_ids, was_ids = dict(now), dict(was)
        if was_ids.keys() - now_ids.keys():
            return None
        for k, i in now_ids.items():
            if was_ids.get(k) != i:
                v = vars(subs[rel])[k]
                if not _plain(v):
                    return None
                out.append((rel, k, values.get((rel, k), _MISSING), v))
    return tuple(out)


def _values(module: nn.Module) -> dict:
    """Every submodule's plain attribute values (what `_written` reports as "before")."""
    return {
        (rel, k): v
        for rel, sub in module.named_modules()
        for k, v in vars(sub).items()
        if _plain(v)
    }


def _as_before(module: nn.Module, writes: tuple) -> bool:
    """Whether ``module``'s attributes that a call's forward wrote are as they were before
    it (a twin's own state is the layer's: the same writes follow)."""
    for rel, k, was, _ in writes:
        sub = module.get_submodule(rel) if rel else module
        now = vars(sub).get(k, _MISSING)
        if now is not was and not (
            _plain(now) and _plain(was) and type(now) is type(was) and now == was
        ):
            return False
    return True


def _attributes(module: nn.Module) -> list[tuple]:
    """Every submodule's attributes, shallow: what a forward that writes one changes."""
    return [
        (rel, tuple((k, id(v)) for k, v in vars(sub).items() if not k.endswith("hooks")))
        for rel, sub in module.named_modules()
    ]


def _alike(
    calls: list[_Call], latest: dict, field: str, signature: tuple, module: nn.Module, indices
) -> _Call | None:
    """The first of ``calls`` a call given ``signature`` (as ``field`` holds it) stands on:
    its layer's latest real call, given alike, its guards holding, the attributes as they
    were; None where there is none (the call runs)."""
    return next(
        (
            c
            for c in calls
            if c is latest[c.layer]
            and getattr(c, field) == signature
            and holds(c.guards, indices)
            and _as_before(module, c.writes)
        ),
        None,
    )


def _inconsistent(
    used: dict[str, list[_Call]], calls: dict[str, list[_Call]], kind: dict[str, str]
) -> str | None:
    """Why a fold's stands cannot stand for the unfolded forward (`_Fold.check`), or None."""
    for name, stood in used.items():
        layers = {c.layer for c in stood}
        if len(layers) > 1:
            return f"{name} stands on the calls of {len(layers)} layers"
        (layer,) = layers
        ran = {id(c) for c in calls[kind[layer]] if c.layer == layer}
        if layer != name and {id(c) for c in stood} != ran:
            return f"{name} stands on some of the calls {layer} ran, not all"
    return None


class _Coarser:
    """The fold a forward that compares less of each call would make (a dry run's beside the
    trace's: shapes, and a shadow run's integer values, not the tags), followed alongside a
    fold's calls without running anything. It stands wherever the fold stands (maybe on an
    earlier call) and may stand where the fold runs (a call whose tags alone differ: tiny
    GPT-2's second layer; NLLB-MoE's, which run two calls of each kind): those calls' tokens are
    ``stood``, and what they recorded left out is what that fold's forward records
    (`tpkit.trace.trace.Trace.reshapes`). ``valid`` turns False where it cannot be followed:
    it would run a call the fold stood (nothing of that call is known), it would break where
    the fold does not, or it would stand on a call that wrote other attributes."""

    def __init__(self, describe: Describe, kind: dict[str, str]) -> None:
        self.describe, self.kind = describe, kind
        self.calls: dict[str, list[_Call]] = {}  # kind -> the calls it runs, in order
        self.latest: dict[str, _Call] = {}
        self.used: dict[str, list[_Call]] = {}
        self.stood: set[int] = set()
        self.valid = True

    def choice(self, name: str, signature: tuple, module: nn.Module, indices: dict) -> Any:
        """The call it would stand ``name``'s call on (its ``signature`` as it compares it),
        asked as `_Fold.forward` asks it; None: it would run it."""
        calls = self.calls.get(self.kind[name], [])
        return _alike(calls, self.latest, "coarse", signature, module, indices)

    def stands(self, name: str, rough: _Call | None, call: _Call) -> None:
        """The fold stood ``name``'s call on ``call``; this one would on ``rough``."""
        if rough is None or rough.writes != call.writes:
            self.valid = False
        else:
            self.used.setdefault(name, []).append(rough)

    def ran(self, name: str, rough: _Call | None, call: _Call, token: int) -> None:
        """The fold ran ``call`` (``token``); this one would stand it on ``rough`` or run it."""
        used = self.used.setdefault(name, [])
        if rough is None:
            if any(c.layer != name for c in used):  # it would break here
                self.valid = False
            self.calls.setdefault(self.kind[name], []).append(call)
            self.latest[name] = call
            used.append(call)
        elif rough.writes != call.writes:
            self.valid = False
        else:
            used.append(rough)
            self.stood.add(token)

    def finish(self) -> None:
        """After the forward: invalid where its stands would break (`_Fold.check`)."""
        self.valid = self.valid and _inconsistent(self.used, self.calls, self.kind) is None


class _Fold:
    """The calls of one folded forward: each layer of a kind with twins runs for real on its
    first call unless an earlier call of its kind was given alike and answers its guards alike
    (then its stub stands on that call); a later call of a layer (a model that runs its layers
    in cycles: HRM) must stand on one."""

    def __init__(
        self, twins: Twins, describe: Describe | None, on_twin, coarse: Describe | None = None
    ) -> None:
        self.kind = {**{r: r for r in twins.rep.values()}, **twins.rep}
        self.describe, self.on_twin = describe, on_twin
        #: the fold a forward comparing less would make, followed alongside (`_Coarser`)
        self.coarser = _Coarser(coarse, self.kind) if coarse is not None else None
        #: the tokens of the calls running now, outermost first (`_Coarser.stood`)
        self.running: list[int] = []
        self._tokens = itertools.count()
        self.calls: dict[str, list[_Call]] = {}  # kind -> its layers' real calls, in order
        self.latest: dict[str, _Call] = {}  # layer -> its last real call: the one stood on
        self.used: dict[str, list[_Call]] = {}  # layer -> the call each of its calls was
        self.tally = twins.tally
        self.distinguishing = twins.distinguishing
        self.params: dict[str, list[str] | None] = {}  # layer -> its forward's parameter names
        self.guards = Guards()
        #: layer -> its watched index attributes' values (``("attr", submodule, name)``)
        self.indices: dict[str, dict[tuple, int]] = {}

    def _watch_indices(self, name: str, forward: Callable, args: tuple, kwargs: dict) -> tuple:
        """``(args, kwargs, indices)`` with every integer handed under an index name
        (`INDEX_ATTRS`, not one that tells this kind of layer apart) watched
        (`tpkit.trace.watched.Watched`): left out of the comparison, its value in ``indices``
        (``("arg", name)``) for the guards; any use of it in the forward but a comparison or
        arithmetic breaks the fold as an index attribute's does, naming it for this kind only
        (``<representative>(<name>)``)."""
        if name not in self.params:
            try:
                params = list(inspect.signature(forward).parameters.values())
                positional = (
                    inspect.Parameter.POSITIONAL_ONLY,
                    inspect.Parameter.POSITIONAL_OR_KEYWORD,
                )
                self.params[name] = [p.name if p.kind in positional else "" for p in params]
            except (TypeError, ValueError):  # no signature to read: positions unnamed
                self.params[name] = None
        names = self.params[name] or []

        kind = self.kind[name]
        indices = dict(self.indices.get(name, {}))

        def watch(key: str, v: Any) -> Any:
            token = f"{kind}({key})"
            if not _is_index(key, v) or {key, token} & self.distinguishing:
                return v
            indices[("arg", key)] = v
            return Watched(key, v, token, name, self.guards, key=("arg", key))

        args = tuple(watch(names[i] if i < len(names) else "", v) for i, v in enumerate(args))
        return args, {k: watch(k, v) for k, v in kwargs.items()}, indices

    def forward(self, name: str, module: nn.Module, forward: Callable) -> Callable:
        def forward_folded(*args: Any, **kwargs: Any) -> Any:
            args, kwargs, indices = self._watch_indices(name, forward, args, kwargs)
            signature = _signature_of(args, kwargs, self.describe, name)
            kind = self.calls.setdefault(self.kind[name], [])
            call = _alike(kind, self.latest, "signature", signature, module, indices)
            coarser = self.coarser if self.coarser is not None and self.coarser.valid else None
            coarse = _signature_of(args, kwargs, coarser.describe, name) if coarser else None
            rough = coarser.choice(name, coarse, module, indices) if coarser else None
            used = self.used.setdefault(name, [])
            if call is not None:
                if coarser:
                    coarser.stands(name, rough, call)
                used.append(call)
                self.tally["stood"] = self.tally.get("stood", 0) + 1
                for rel, k, _, value in call.writes:  # what its own forward would have written
                    setattr(module.get_submodule(rel) if rel else module, k, value)
                return self._stand_in(name, call, args, kwargs)
            if any(c.layer != name for c in used):  # it stood on another's call before
                raise FoldBroken(f"{name} runs more than once and stood on {used[0].layer}")
            inputs = _tensors((args, kwargs))
            versions = [t._version for t in inputs]
            held, attrs, values = _held(args, kwargs), _attributes(module), _values(module)
            self.guards.begin(name)
            token = next(self._tokens)
            self.running.append(token)
            try:
                output = forward(*args, **kwargs)
            except TypeError as exc:  # torch's or a C function's: a watched index handed on
                if "Watched" in str(exc):
                    raise FoldBroken(f"{name} hands a watched index on: {exc}") from exc
                raise
            finally:
                guards = self.guards.end()
                self.running.pop()
            if [t._version for t in inputs] != versions or any(_shallow(v) != s for v, s in held):
                raise FoldBroken(f"{name} changes what it is given")
            writes = _written(module, attrs, values)
            if writes is None:
                raise FoldBroken(f"{name} changes its own attributes")
            if any(isinstance(v, Watched) for v in tree_flatten(output)[0]):
                raise FoldBroken(f"{name} returns its index")
            call = _Call(name, signature, inputs, output, writes, guards, coarse)
            if coarser:
                coarser.ran(name, rough, call, token)
            kind.append(call)
            used.append(call)
            self.latest[name] = call
            self.tally["run"] = self.tally.get("run", 0) + 1
            return output

        return forward_folded

    def check(self) -> None:
        """After the forward: every call of a layer stood on calls of one layer: itself, or
        another whose real calls it stood on every one of. A layer runs again for real only
        where no call of its own answers for it (Inkling-2-Loop's later passes hand its
        layers messages), so that layer's records add up its real calls as an unfolded run's
        add up all of them, and what a trace copies from them is what each of this layer's
        calls would have recorded."""
        if self.coarser is not None:
            self.coarser.finish()
        why = _inconsistent(self.used, self.calls, self.kind)
        if why:
            raise FoldBroken(why)

    def _stand_in(self, name: str, call: _Call, args: tuple, kwargs: dict) -> Any:
        """``name``'s output, as ``call``'s layer gave it: an input handed back is this call's
        own input; the stream (a float output shaped as the first float input) a copy of this
        call's, so the stream flows from it; anything else made inside is the one ``call``
        made (alike inputs, alike values: routing is made up the same way)."""
        mine = _tensors((args, kwargs))
        given = {id(t): i for i, t in enumerate(call.inputs)}
        first = next((t for t in mine if t.is_floating_point() or t.is_complex()), None)
        stream = None
        for t in _tensors(call.output):
            if id(t) not in given and first is not None and t.shape == first.shape:
                stream = t
                break
        if self.on_twin is not None:
            self.on_twin(name, call.layer)
        out = first.clone() if stream is not None else None  # flows from its input

        def swap(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            if id(v) in given:
                return mine[given[id(v)]]
            return out if v is stream else v

        return tree_map(swap, call.output)


@contextlib.contextmanager
def folded(
    model: nn.Module,
    twins: Twins,
    on_twin: Callable[[str, str], None] | None = None,
    describe: Describe | None = None,
    coarse: Describe | None = None,
) -> Iterator[_Fold | None]:
    """Inside the block, each layer of a kind with twins stands on an earlier call of its kind
    that was given alike (see the module docstring), else runs and is recorded; ``describe``
    adds to what is compared of each tensor given (the trace's tags, a shadow run's integer
    values); ``on_twin(twin, layer)`` is told each time a twin stands on ``layer``'s call (the
    trace copies what that run recorded). ``coarse``: what another fold describes, one that
    compares less (a dry run's, beside the trace's), followed alongside: the fold's
    ``coarser`` (`_Coarser`) says which of the calls it ran that one would stand. Raises
    `FoldBroken` where the fold cannot stand for the unfolded forward; everything is put back
    on exit. Yields the fold's calls (None where there are no twins: nothing folds)."""
    if not twins:
        yield None
        return
    modules = dict(model.named_modules())
    fold = _Fold(twins, describe, on_twin, coarse)
    saved: list[tuple[Any, str, Any, bool]] = []

    def put(obj: Any, attr: str, value: Any) -> None:
        saved.append((obj, attr, obj.__dict__.get(attr), attr in obj.__dict__))
        obj.__dict__[attr] = value

    try:
        for name, kind in fold.kind.items():
            module = modules[name]
            put(module, "forward", fold.forward(name, module, module.forward))
            for rel, attr in twins.watched.get(kind, ()):
                sub = module.get_submodule(rel) if rel else module
                value, key = sub.__dict__[attr], ("attr", rel, attr)
                fold.indices.setdefault(name, {})[key] = value
                token = _token(twins.base.get(kind, kind), (rel, attr))
                put(sub, attr, Watched(attr, value, token, name, fold.guards, key=key))
        with math_watched():
            yield fold
        fold.check()
    finally:
        for obj, attr, value, had in reversed(saved):
            if had:
                obj.__dict__[attr] = value
            else:
                obj.__dict__.pop(attr, None)
