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
  (``layer_idx``, ``layer_id``, ...), which differ by design; the representative's are
  watched during the run (`_Watched`) and any use of one (a comparison, ``config.layer_types
  [self.layer_idx]``, arithmetic) breaks the fold: that index becomes part of what tells
  layers apart (`FoldBroken.index`) and the forward runs again;
- alike in what they are given: each twin's call must match its representative's (tensor
  shapes and dtypes, the same objects for every input but the stream, equal plain values);
- no effect besides the output: the representative must not change its inputs in place (their
  version counters), its modules' attributes, or the containers it was handed (a dict of
  shared key/value states), and must return one tensor shaped as its input;
- alike under the plan tried: the dry run folds only twins the plan lays out alike
  (`plan_twins`).

Anything else raises `FoldBroken` (a ``BaseException``, so model code that catches ``Exception``
cannot swallow it), and the caller runs the forward again unfolded. Pure: no process group.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tpkit.compat import tree_flatten, tree_map
from tpkit.plan.spec import Plan

__all__ = ["FoldBroken", "Twins", "find_twins", "folded", "plan_twins"]

#: integer attributes that number a layer (`find_twins`): different in every layer by design
INDEX_ATTRS = re.compile(r"^(layer|block)_?(idx|id|index|number|num|no)$|^(idx|index)$")
#: a module's own bookkeeping, never compared (hooks, its registries, training mode)
_INTERNAL = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"}
)


class FoldBroken(BaseException):
    """A folded forward met what folding cannot stand for; ``index``: the index attribute
    the representative read (it tells layers apart from now on), else empty."""

    def __init__(self, why: str, index: str = ""):
        super().__init__(why)
        self.index = index


@dataclass(frozen=True)
class Twins:
    """``rep``: each twin layer's name -> its representative's (an earlier layer alike);
    ``watched``: each representative -> the (submodule, attribute) index integers its twins
    differ in, watched while it runs."""

    rep: Mapping[str, str] = field(default_factory=dict)
    watched: Mapping[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.rep)


def find_twins(
    layers: list[tuple[str, nn.Module]], distinguishing: frozenset[str] = frozenset()
) -> Twins:
    """The twins among ``layers`` (name, module: the model's blocks, in order): each layer
    alike to an earlier one (see the module docstring). Index attributes (`INDEX_ATTRS`) are
    left out of the comparison unless named in ``distinguishing``; the representative watches
    those its twins differ in."""
    first: dict[tuple, tuple[str, dict]] = {}
    rep: dict[str, str] = {}
    watched: dict[str, set[tuple[str, str]]] = {}
    seen: set[int] = set()
    for name, module in layers:
        if id(module) in seen or not any(True for _ in module.parameters()):
            continue  # a layer run twice (shared) or holding nothing: not folded
        seen.add(id(module))
        key, indices = _signature(module, distinguishing)
        if key not in first:
            first[key] = (name, indices)
            continue
        rep_name, rep_indices = first[key]
        rep[name] = rep_name
        differ = {k for k, v in indices.items() if rep_indices.get(k) != v}
        watched.setdefault(rep_name, set()).update(differ)
    return Twins(rep, {r: tuple(sorted(w)) for r, w in watched.items()})


def _signature(module: nn.Module, distinguishing: frozenset[str]) -> tuple[tuple, dict]:
    """(what must be equal for two layers to be alike, their index attributes' values)."""
    parts, indices = [], {}
    for rel, sub in module.named_modules():
        params = tuple(
            (n, None if p is None else (tuple(p.shape), p.dtype, p.requires_grad))
            for n, p in sub._parameters.items()
        )
        buffers = tuple(
            (n, None if b is None else (tuple(b.shape), b.dtype)) for n, b in sub._buffers.items()
        )
        attrs = []
        for k, v in vars(sub).items():
            if k in _INTERNAL or k.endswith("hooks") or k.startswith("_tpkit"):
                continue
            if _is_index(k, v) and k not in distinguishing:
                indices[(rel, k)] = v
                continue
            attrs.append((k, _value(v)))
        parts.append((rel, type(sub), params, buffers, tuple(attrs)))
    return tuple(parts), indices


def _is_index(name: str, value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and bool(INDEX_ATTRS.match(name))


def _value(v: Any, depth: int = 0) -> Any:
    """An attribute's value as compared: plain values by equality, containers by their items,
    a module held outside the module tree (a kernel's function wrapper kept in a dict) by its
    class and own attributes, anything else by identity (a shared config is the same object
    in every layer)."""
    if v is None or isinstance(v, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return (type(v), v)
    if depth > 2:
        return ("id", id(v))
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_value(x, depth + 1) for x in v))
    if isinstance(v, (set, frozenset)):
        return (type(v), frozenset(_value(x, depth + 1) for x in v))
    if isinstance(v, dict):
        return (type(v), tuple((_value(k, depth + 1), _value(x, depth + 1)) for k, x in v.items()))
    if isinstance(v, nn.Module) and not any(True for _ in v.parameters()):
        own = ((k, _value(x, depth + 1)) for k, x in vars(v).items() if k not in _INTERNAL)
        return (type(v), tuple(x for x in own if not x[0].endswith("hooks")))
    return ("id", id(v))


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
    return Twins(rep, {r: w for r, w in twins.watched.items() if r in reps})


def _layer_of(name: str, layers: set[str]) -> str | None:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        if ".".join(parts[:i]) in layers:
            return ".".join(parts[:i])
    return None


@dataclass
class _Call:
    """What a representative's call was given and gave: the stub of each twin checks its own
    call against it and hands on an output of the same structure."""

    signature: tuple
    output: Any
    result: torch.Tensor


class _Watched:
    """A representative's index attribute while it runs: any use of it breaks the fold."""

    def __init__(self, name: str, value: int):
        self._name, self._value = name, value

    def _used(self, *_: Any, **__: Any) -> Any:
        raise FoldBroken(f"the layer reads its index {self._name}", self._name)

    __index__ = __int__ = __float__ = __bool__ = __hash__ = __str__ = __repr__ = _used
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __format__ = _used  # type: ignore[assignment]
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _used
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _used
    __pow__ = __rpow__ = __neg__ = __pos__ = __abs__ = __and__ = __or__ = __xor__ = _used
    __lshift__ = __rshift__ = __round__ = __trunc__ = __floor__ = __ceil__ = _used
    __divmod__ = __rdivmod__ = __invert__ = __iter__ = __len__ = __contains__ = _used

    def __getattr__(self, name: str) -> Any:
        raise FoldBroken(f"the layer reads its index {self._name}", self._name)


def _signature_of(args: tuple, kwargs: dict) -> tuple:
    """A call as compared: tensors by shape and dtype (the first float one, the stream, by
    no more; the others by identity too), plain values by equality, anything else by
    identity."""
    leaves, spec = tree_flatten((args, kwargs))
    out, stream = [], True
    for v in leaves:
        if isinstance(v, torch.Tensor):
            first = stream and (v.is_floating_point() or v.is_complex())
            stream = stream and not first
            out.append((tuple(v.shape), v.dtype, None if first else id(v)))
        else:
            out.append(_value(v))
    return (str(spec), tuple(out))


def _stream(args: tuple, kwargs: dict) -> torch.Tensor | None:
    return next(
        (
            v
            for v in tree_flatten((args, kwargs))[0]
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
        ),
        None,
    )


def _held(args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """(container, its shallow state) for each mutable container a call is handed."""
    out = []
    for v in tree_flatten((args, kwargs))[0]:
        if isinstance(v, (torch.Tensor, nn.Module)) or v is None:
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


def _attributes(module: nn.Module) -> list[tuple]:
    """Every submodule's attributes, shallow: what a forward that writes one changes."""
    return [
        (rel, tuple((k, id(v)) for k, v in vars(sub).items() if not k.endswith("hooks")))
        for rel, sub in module.named_modules()
    ]


@contextlib.contextmanager
def folded(
    model: nn.Module,
    twins: Twins,
    on_twin: Callable[[str, str], None] | None = None,
) -> Iterator[None]:
    """Inside the block, each twin's forward is a stub standing on its representative's call
    (see the module docstring); ``on_twin(twin, rep)`` is told each time a stub stands in
    (the trace copies what the representative's run recorded). Raises `FoldBroken` where the
    fold cannot stand for the unfolded forward; everything is put back on exit."""
    if not twins:
        yield
        return
    modules = dict(model.named_modules())
    calls: dict[str, _Call] = {}
    ran: set[str] = set()
    saved: list[tuple[Any, str, Any, bool]] = []

    def put(obj: Any, attr: str, value: Any) -> None:
        saved.append((obj, attr, obj.__dict__.get(attr), attr in obj.__dict__))
        obj.__dict__[attr] = value

    def recorder(name: str, module: nn.Module, forward: Callable) -> Callable:
        def forward_recorded(*args: Any, **kwargs: Any) -> Any:
            if name in ran:
                raise FoldBroken(f"{name} runs more than once")
            ran.add(name)
            stream = _stream(args, kwargs)
            versions = [t._version for t in tree_flatten((args, kwargs))[0] if _tensor(t)]
            held, attrs = _held(args, kwargs), _attributes(module)
            output = forward(*args, **kwargs)
            after = [t._version for t in tree_flatten((args, kwargs))[0] if _tensor(t)]
            if after != versions or any(_shallow(v) != s for v, s in held):
                raise FoldBroken(f"{name} changes what it is given")
            if _attributes(module) != attrs:
                raise FoldBroken(f"{name} changes its own attributes")
            results = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
            if stream is None or len(results) != 1 or results[0].shape != stream.shape:
                raise FoldBroken(f"{name} does not return one tensor shaped as its input")
            calls[name] = _Call(_signature_of(args, kwargs), output, results[0])
            return output

        return forward_recorded

    def stub(name: str, rep: str) -> Callable:
        def forward_stub(*args: Any, **kwargs: Any) -> Any:
            call = calls.get(rep)
            if name in ran or call is None or _signature_of(args, kwargs) != call.signature:
                raise FoldBroken(f"{name} is not called as {rep} was")
            ran.add(name)
            if on_twin is not None:
                on_twin(name, rep)
            stream = _stream(args, kwargs)
            out = stream.clone()  # flows from its input, as the twin's output would
            return tree_map(lambda v: out if v is call.result else v, call.output)

        return forward_stub

    try:
        for rep in set(twins.rep.values()):
            module = modules[rep]
            put(module, "forward", recorder(rep, module, module.forward))
            for rel, attr in twins.watched.get(rep, ()):
                sub = module.get_submodule(rel) if rel else module
                put(sub, attr, _Watched(attr, sub.__dict__[attr]))
        for twin, rep in twins.rep.items():
            put(modules[twin], "forward", stub(twin, rep))
        yield
    finally:
        for obj, attr, value, had in reversed(saved):
            if had:
                obj.__dict__[attr] = value
            else:
                obj.__dict__.pop(attr, None)


def _tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor)
