"""Values for data-dependent routing on fake tensors: what lets a full-size MoE be planned.

Fake tensors carry shapes, not values, so model code that reads a value (JetMoE's
``expert_size.tolist()``, Switch Transformers' ``mask.nonzero()`` and ``f"expert_{idx}"``) stops
a fake forward, and a model on the meta device (or too big to run) could not be traced or
dry-run at all. `ShadowValues` gives such code values that are cheap and consistent:

- routing decisions (``topk``, ``argmax``, ``sort`` ... indices) get a round-robin *shadow*:
  row r picks experts ``(r * k + j) % n``, so every expert receives tokens and is traced;
- any op with a shadowed input is also computed for real on small CPU tensors (shadows, and
  zeros -- or all-True masks -- for the other inputs), which gives its outputs shadows too;
  a weight too large for that (``LIMIT``) stops the shadow there, so a full-size model's
  dense layers stay fake;
- memory stays small whatever the model's size (planning must run on a laptop): an op whose
  output would store more than ``LIMIT`` elements is not computed (a view costs its base; a
  broadcast of two small shadows, such as a chunked linear attention's ``[batch, heads,
  chunks, 64, 64, head_dim]`` decay, 400 MB per op for GLM-5-next, stays fake); a shadow lives
  only as long as its fake tensor; and the float shadows alive at once are held to ``BUDGET``
  elements (the trace keeps every tensor it tags alive to the end of its forward): past it a
  new float value is not made, its tensor stays fake and reads as zeros, as any unshadowed one
  does. Integer and boolean shadows -- the indices, counts, positions and masks that
  data-dependent code reads -- are always kept;
- an op whose output shape or Python result depends on values gets its answer from that real
  computation, and its fake output is built from it.

The dataflow the trace sees is the model's own; only which tokens go to which expert is made
up, and no value reaches a plan. Used only after a plain fake forward failed on values.
"""

from __future__ import annotations

import weakref
from types import MappingProxyType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from tpkit.compat import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    tree_flatten,
    tree_map,
    unset_fake_temporarily,
)

__all__ = [
    "BUDGET",
    "LIMIT",
    "GivenValues",
    "ShadowValues",
    "metadata_only",
    "needs_values",
    "tensors_in",
]

#: Largest tensor (elements) substituted by zeros in a real shadow computation, or computed.
LIMIT = 1 << 20
#: Most float shadow elements alive at once (32 x `LIMIT`: 128 MiB of float32).
BUDGET = 32 * LIMIT
_RANDOM = frozenset({"rand", "randn", "rand_like", "randn_like", "randint", "normal", "bernoulli"})
#: routing ops -> (position of their ``dim`` argument, whether the index output keeps that dim)
_ROUTING = MappingProxyType(
    {
        "topk": (2, True),
        "sort": (1, True),
        "argsort": (1, True),
        "argmax": (1, False),
        "argmin": (1, False),
        "max": (1, False),
        "min": (1, False),
    }
)


#: routing ops that, over a mask, find a position (Kolibri-1.1's first visible key of each
#: query: ``visible.int().argmax(-1)``): computed on its value where it has one
_POSITIONS = frozenset({"argmax", "argmin"})


def _known_positions(t: torch.Tensor, shadow: ShadowValues) -> bool:
    """Whether ``t`` is a mask (bool or integer) with a value: what ``argmax`` finds in it is
    a position, not a routing choice, and made-up round-robin positions would only make the
    model's per-position loops run once per made-up position (21 groups of one query each for
    Kolibri-1.1's indexers instead of 3). Float scores keep their round-robin routing."""
    if t.is_floating_point() or t.is_complex() or not shadow._shadowed(t):
        return False
    with unset_fake_temporarily():
        value = shadow.shadow[t]
        return bool(((value == 0) | (value == 1)).all())


class GivenValues:
    """The values of one forward's integer inputs, by the fake tensor the forward gets in
    each one's place (`keep`): token ids, an image grid, an audio's feature mask. Code that
    reads them (Qwen2-VL's rotary positions per image, a placeholder count, GLM-ASR's valid
    frames) then reads these values under `ShadowValues` instead of zeros, which would not
    match the shapes of the other inputs. Made per forward and handed to its `ShadowValues`;
    weak, so a value goes with its fake tensor. Here, not in `tpkit.trace.inputs`, so that the
    made-up inputs can count an audio's placeholders under `ShadowValues`."""

    def __init__(self) -> None:
        self.values: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def keep(self, fake: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
        """Record ``given``'s values for ``fake`` when ``given`` is an integer or boolean
        tensor that has values (not meta); returns ``fake``. Float inputs are never kept: their
        values steer no shape, and a large one would hold memory for nothing."""
        floating = given.is_floating_point() or given.is_complex()
        if not floating and given.device.type != "meta":
            self.values[fake] = given.detach().cpu()
        return fake

    def get(self, fake: torch.Tensor) -> torch.Tensor | None:
        """The values `keep` recorded for ``fake``, else None."""
        return self.values.get(fake)


#: tensor methods that read metadata only: never a value, never a tensor returned
_METADATA_METHODS = frozenset(
    {"size", "dim", "numel", "stride", "is_floating_point", "is_complex", "is_signed"}
    | {"element_size", "is_contiguous", "storage_offset", "__len__", "ndimension", "nelement"}
)
#: tensor attributes read the same way (``x.T`` or ``x.data`` are tensors: not here)
_METADATA_ATTRS = frozenset(
    {"shape", "dtype", "device", "requires_grad", "ndim", "is_leaf", "layout", "itemsize"}
    | {"is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "nbytes"}
)


def metadata_only(func: Any) -> bool:
    """Whether a torch function call reads a tensor's metadata only (its shape, dtype,
    device, a flag) and returns no tensor. Torch hands every such read to each active
    ``TorchFunctionMode``, the model's ``x.shape`` and the analysis's own alike: in a shadow
    dry run two thirds of the calls its modes saw were these (Kolibri-1.1: 38k of 56k), and
    the modes (`ShadowValues`, the tracer, the dry run's reshape record) learn nothing from
    them, so they hand them straight on."""
    name = getattr(func, "__name__", "")
    if name == "__get__":  # an attribute: its descriptor's name
        return getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA_ATTRS
    return name in _METADATA_METHODS


def needs_values(exc: BaseException) -> bool:
    """True when ``exc`` says a fake forward needed a value (the case `ShadowValues` fixes)."""
    text = f"{type(exc).__name__} {str(exc)[:400]}"
    keys = ("DataDependent", "DynamicOutputShape", "data-dependent", "Tensor.item()")
    return isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException)) or any(
        k in text for k in keys
    )


#: values no pytree looks into (`tensors_in`'s fast path)
_LEAVES = (
    int, float, bool, str, bytes, complex, slice, type(None), type(Ellipsis), torch.dtype,
    torch.device, torch.Size, torch.layout, torch.memory_format,
)  # fmt: skip


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj`` (a call's arguments, its output), in ``tree_flatten``'s order:
    plain lists, tuples and dicts walked here, anything else handed to ``tree_flatten`` (a
    named tuple, a model output). Every op of a traced or shadow run asks this several times:
    ``tree_flatten`` alone was a quarter of GLM-5-next's shadow run."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        v = stack.pop()
        kind = type(v)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif kind is tuple or kind is list:
            stack.extend(reversed(v))
        elif kind is dict:
            stack.extend(reversed(list(v.values())))
        elif not isinstance(v, _LEAVES):
            out.extend(t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor))
    return out


_tensors = tensors_in


def _slice_tensors(s: slice) -> bool:
    """Whether a slice has a tensor for a bound (a value tree_flatten does not look into)."""
    return any(isinstance(b, torch.Tensor) for b in (s.start, s.stop, s.step))


def _size(obj: Any) -> int:
    """Elements of all the tensors in ``obj``."""
    return sum(t.numel() for t in _tensors(obj))


def _stored(obj: Any) -> int:
    """Elements the storages of the tensors in ``obj`` hold: a view (``expand``, a slice, a
    transpose) costs its base's, not its own size."""
    total = 0
    for t in _tensors(obj):
        try:
            total += t.untyped_storage().nbytes() // max(1, t.element_size())
        except Exception:  # noqa: BLE001 - no plain storage (sparse, nested): its size
            total += t.numel()
    return total


def _aliases(out: Any, inputs: Any) -> bool:
    """Whether ``out`` holds tensors and each is a view or one of the op's ``inputs``: the op
    computed nothing (``expand_as``, ``view_as``, ``.to`` its own device), so an input it did
    not alias gave it only a shape. A large input the output aliases keeps it fake (its
    storage is over `LIMIT`, checked before)."""
    ins = _tensors(inputs)
    given = {id(t) for t in ins}
    bases = given | {id(t._base) for t in ins if t._base is not None}
    # a view of something the op made is not an alias: ``linear`` on a 3-D input returns a
    # view of its own matmul's output, and its weight gave it more than a shape
    return bool(outs := _tensors(out)) and all(
        id(t) in given or (t._base is not None and id(t._base) in bases) for t in outs
    )


def _counted(value: torch.Tensor) -> bool:
    """Whether ``value`` counts against `BUDGET` (floats; indices and masks do not)."""
    return value.is_floating_point() or value.is_complex()


def _true_count(mask: torch.Tensor) -> int:
    """How many entries of ``mask`` are true, counted once per dimension it was expanded along
    (stride 0: each slice repeats the first) and multiplied: an audio-LLM's placeholder mask
    ``expand_as`` its embeddings is [batch, seq, hidden] of one [batch, seq] row, and summing
    all of it took 20 ms per forward at full size."""
    repeats, index = 1, []
    for size, stride in zip(mask.shape, mask.stride()):
        expanded = stride == 0 and size > 1
        repeats *= size if expanded else 1
        index.append(slice(0, 1) if expanded else slice(None))
    return int(mask[tuple(index)].sum()) * repeats


class ShadowValues(TorchFunctionMode):
    """See the module docstring. Enter inside the fake mode, before a tracer."""

    def __init__(self, fake: Any, given: GivenValues | None = None):
        super().__init__()
        self.fake = fake
        self.given = given if given is not None else GivenValues()
        # fake tensor -> its value, dropped with the tensor (a long forward's intermediates
        # would otherwise all stay alive to its end)
        self.shadow: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.live = 0  # float shadow elements alive (`BUDGET`)
        self.peak = 0  # the most ``live`` ever was
        self.refused = False  # whether the budget ever left a float tensor without a value

    def _set(self, t: torch.Tensor, value: torch.Tensor) -> None:
        size = min(value.numel(), _stored(value))  # a slice its own size, an expand its base's
        if tuple(value.shape) != tuple(t.shape) or size > LIMIT:
            return
        if self.shadow.get(t) is value:
            return
        if _counted(value):
            if self.live + size > BUDGET:
                self.refused = True
                return  # over the budget: this float tensor stays fake (reads as zeros)
            self.live += size
            self.peak = max(self.peak, self.live)
            # the count goes down when the value is freed (with its tensor, or replaced)
            weakref.finalize(value, self._freed, size)
        self.shadow[t] = value

    def far_from_budget(self) -> bool:
        """Whether every float value this run made was kept, and at most half the budget
        was ever alive at once: then a run that keeps fewer tensors alive (a dry run beside
        the trace, which keeps every tensor it tags) makes the same values, whatever the
        garbage collector frees when."""
        return not self.refused and self.peak <= BUDGET // 2

    def _shadowed(self, t: torch.Tensor) -> bool:
        """Whether ``t`` has a value; an input whose values the forward was given
        (`GivenValues`: ids, an image grid) gets them on first sight."""
        value = self.given.get(t)
        if value is not None and t not in self.shadow:
            self._set(t, value)
        return t in self.shadow

    def known(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s value, made up or given, read without the run seeing it; else None."""
        value = self.shadow.get(t)
        return value if value is not None else self.given.get(t)

    def _freed(self, n: int) -> None:
        self.live -= n

    def _value(self, t: torch.Tensor, shape_only: bool = False) -> torch.Tensor | None:
        """``t``'s shadow, else a stand-in: zeros (an all-True mask), or None where ``t`` is
        too large for that, unless the op reads only its shape (``shape_only``): then one zero
        expanded to it, which stores a single element whatever the shape."""
        if self._shadowed(t):
            return self.shadow[t]
        if t.numel() > LIMIT:
            if not shape_only:
                return None
            with unset_fake_temporarily():
                return torch.zeros((), dtype=t.dtype).expand(t.shape)
        with unset_fake_temporarily():
            if t.dtype == torch.bool:  # a mask: everything routes everywhere
                return torch.ones(t.shape, dtype=t.dtype)
            return torch.zeros(t.shape, dtype=t.dtype)

    def _real(
        self, func, args: tuple, kwargs: dict, shape_only: bool = False
    ) -> tuple[bool, Any, list]:
        """(ok, result, substituted inputs) of ``func`` on shadows and stand-ins;
        ``shape_only``: the op's output aliases its inputs (`_aliases`), so a large input
        it reads only the shape of stands in at no cost."""
        inputs: dict[int, torch.Tensor] = {}
        for t in _tensors((args, kwargs)):
            value = self._value(t, shape_only)
            if value is None:
                return False, None, []
            inputs[id(t)] = value

        def swap(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                return inputs[id(v)]
            if isinstance(v, slice):
                return self._slice(v)
            return "cpu" if isinstance(v, torch.device) and v.type == "meta" else v

        kwargs = {k: "cpu" if k == "device" and str(v) == "meta" else v for k, v in kwargs.items()}
        try:
            with unset_fake_temporarily(), torch.no_grad():
                real_args, real_kwargs = tree_map(swap, (args, kwargs))
                return True, func(*real_args, **real_kwargs), [real_args, real_kwargs]
        except Exception:  # noqa: BLE001 - a stand-in the op cannot take: no shadow then
            return False, None, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if metadata_only(func):  # no value read, none made
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        shadowed = any(self._shadowed(t) for t in _tensors((args, kwargs)))
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            if not needs_values(exc):
                raise
            ok, real, _ = self._real(func, args, kwargs)
            if ok:
                return self._fake_of(real)
            picked = self._selected(func, args)
            if picked is not None:
                return picked
            scalars = self._scalars(args, kwargs)
            if scalars is None:
                raise
            # a large weight indexed by a routed scalar (DBRX's ``w1.view(E, F, H)[expert]``):
            # too big to compute for real, so the fake op gets the scalar's value instead
            return func(*scalars[0], **scalars[1])
        if name in _ROUTING and isinstance(args[0] if args else None, torch.Tensor):
            if name in _POSITIONS and _known_positions(args[0], self):  # as computed, below
                ok, real, _ = self._real(func, args, kwargs)
                if ok:
                    self._attach(out, real)
                    return out
            self._route(name, out, args, kwargs)
        elif not _tensors((args, kwargs)) and _tensors(out):
            self._made(name, func, out, args, kwargs)
        elif shadowed and _stored(out) <= LIMIT:  # a larger output stays fake
            # a view's other inputs give it a shape only (a placeholder mask ``expand_as`` the
            # full-size embeddings, AudioFlamingo3 and GLM-ASR): stand-ins that cost nothing
            ok, real, used = self._real(func, args, kwargs, _aliases(out, (args, kwargs)))
            if ok and real is not None and not _tensors(out) and not _tensors(real):
                return real  # a Python value read off a tensor (format, tolist, bool)
            if ok:
                self._attach(out, real)
                if (name.endswith("_") or name == "__setitem__") and args:
                    self._set(args[0], _tensors(used)[0])
        return out

    def _selected(self, func: Any, args: tuple) -> torch.Tensor | None:
        """``x[mask]`` of an ``x`` too large to compute for real, by a mask with a value (an
        audio-LLM's valid frames): a fake tensor of the shape the mask's true entries give."""
        index = args[1] if func is torch.Tensor.__getitem__ and len(args) == 2 else None
        if not isinstance(index, torch.Tensor) or index.dtype != torch.bool:
            return None
        if not self._shadowed(index):
            return None
        with unset_fake_temporarily():
            count = _true_count(self.shadow[index])
        return args[0].new_empty((count, *args[0].shape[index.ndim :]))

    def _scalars(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """``(args, kwargs)`` with every shadowed one-element integer tensor replaced by its
        Python value; None when there is none."""
        found = False

        def swap(v: Any) -> Any:
            nonlocal found
            if isinstance(v, slice) and _slice_tensors(v):
                found = True
                return self._slice(v)
            integer = isinstance(v, torch.Tensor) and not (
                v.is_floating_point() or v.is_complex() or v.dtype == torch.bool
            )
            if integer and v.numel() == 1 and v in self.shadow:
                found = True
                with unset_fake_temporarily():
                    return int(self.shadow[v].item())
            return v

        swapped = tree_map(swap, (args, kwargs))
        return swapped if found else None

    def _slice(self, s: slice) -> slice:
        """A slice whose bounds are tensors (BLT's patcher: ``starts[:, : mask.sum(1).max()]``)
        with each bound's value: its shadow's, or, with none, no bound at all (the whole
        extent, as an unknown mask stands in as all-True)."""

        def bound(b: Any) -> Any:
            if not isinstance(b, torch.Tensor):
                return b
            value = self.shadow.get(b) if b.numel() == 1 else None
            if value is None:
                return None
            with unset_fake_temporarily():
                return int(value.item())

        return slice(bound(s.start), bound(s.stop), bound(s.step))

    def _made(self, name: str, func, out: Any, args: tuple, kwargs: dict) -> None:
        """A tensor made from nothing (``torch.zeros``, ``arange``) gets its real value as its
        shadow; a random one (layer drop's ``torch.rand([]) < p``) a fixed 0.5, so the same
        plan comes out every time and a layer is never dropped from the trace."""
        outs = _tensors(out)
        if _size(out) > LIMIT:
            return
        if name in _RANDOM:
            with unset_fake_temporarily():
                for t in outs:
                    self._set(t, torch.full(t.shape, 0.5, dtype=t.dtype))
            return
        ok, real, _ = self._real(func, args, kwargs)
        if ok:
            self._attach(out, real)

    def _attach(self, out: Any, real: Any) -> None:
        for t, r in zip(_tensors(out), _tensors(real), strict=False):
            self._set(t, r)

    def _fake_of(self, real: Any) -> Any:
        def convert(r: Any) -> Any:
            if not isinstance(r, torch.Tensor):
                return r
            with unset_fake_temporarily():
                meta = r.to("meta")  # where every other fake tensor of the run lives
            f = self.fake.from_tensor(meta)
            self._set(f, r)
            return f

        return tree_map(convert, real)

    def _route(self, name: str, out: Any, args: tuple, kwargs: dict) -> None:
        """Round-robin indices for a routing op's index output (see the module docstring)."""
        pos, keeps = _ROUTING[name]
        dim = kwargs.get("dim", args[pos] if len(args) > pos else None)
        outs = _tensors(out)
        indices = outs[-1] if name in ("argmax", "argmin", "argsort") else None
        indices = outs[1] if indices is None and len(outs) > 1 else indices
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if not isinstance(indices, torch.Tensor) or src is None or indices.numel() > LIMIT:
            return
        with unset_fake_temporarily():
            if dim is None or not isinstance(dim, int):  # over the flattened input
                picks = torch.arange(indices.numel()) % max(1, src.numel())
            else:
                dim %= max(1, src.ndim)
                n = src.shape[dim] if src.ndim else 1
                kept = keeps or kwargs.get("keepdim") or (len(args) > pos + 1 and args[pos + 1])
                if not kept or indices.ndim == 0:
                    picks = torch.arange(indices.numel()) % n
                else:
                    moved = indices.movedim(dim, -1).shape
                    rows, k = indices.numel() // max(1, moved[-1]), moved[-1]
                    picks = (torch.arange(rows)[:, None] * k + torch.arange(k)[None, :]) % n
                    picks = picks.reshape(moved).movedim(-1, dim)
            self._set(indices, picks.reshape(indices.shape).to(indices.dtype))
