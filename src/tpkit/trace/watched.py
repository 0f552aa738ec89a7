"""A folded layer's index, watched while it runs: what its forward may ask of it, answered alike.

Layers alike but for an integer that numbers them (``layer_idx``, a cycle's offset handed in:
`tpkit.trace.fold`) fold only while their forward never needs that number's value. A `Watched`
stands for it while the layer runs:

- a comparison or a truth test (RWKV's ``if self.layer_id == 0``, ``idx % 6 == 5``) is answered
  with the running layer's own value and recorded on its call as a *guard*: the expression of
  the indices it tested and the outcome;
- arithmetic (``idx + 1``, ``2 * idx``) gives another `Watched`: an expression of the indices,
  its value the running layer's; so does a function of `math` (Beam's residual scale
  ``math.sqrt(residual_add_idx)``: `math_watched` hands a `Watched` argument on to `Watched`);
- arithmetic with a float tensor (``hidden_states * scale``) gives that tensor computed with the
  running layer's value: float values steer no shape and no path of a fold's forward (a fold
  compares float tensors by shape and dtype only), so this is what a layer alike but for its
  weights does already;
- any other use (an index into a list, a float, a hash, a string, an attribute, a torch call)
  raises `FoldBroken` naming the index: from then on it tells layers apart (compared, not
  watched), as every use did before guards.

A twin stands on a recorded call only where each of its guards, evaluated with the twin's own
indices, gives the recorded outcome (`holds`). The forward saw nothing of the index but those
outcomes, so with the same outcomes it takes the same path for the twin as it did for the
layer that ran: exact. Pure: no process group.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch

__all__ = ["FoldBroken", "Guards", "Watched", "holds", "math_watched"]


class FoldBroken(BaseException):
    """A folded forward met what folding cannot stand for; ``index``: the index the
    representative read, named for its kind of layer (``<kind>:<place>`` for an attribute,
    ``<representative>(<name>)`` for an argument: it tells layers of that kind apart from now
    on, other kinds keep folding), else empty."""

    def __init__(self, why: str, index: str = ""):
        super().__init__(why)
        self.index = index


#: an expression of watched indices: ("var", key), ("const", value), (op, expr[, expr])
Expr = tuple

_BINARY: Mapping[str, Callable[[Any, Any], Any]] = MappingProxyType(
    {
        "add": operator.add,
        "sub": operator.sub,
        "mul": operator.mul,
        "truediv": operator.truediv,
        "floordiv": operator.floordiv,
        "mod": operator.mod,
        "pow": operator.pow,
        "eq": operator.eq,
        "ne": operator.ne,
        "lt": operator.lt,
        "le": operator.le,
        "gt": operator.gt,
        "ge": operator.ge,
    }
)
_UNARY: Mapping[str, Callable[[Any], Any]] = MappingProxyType(
    {
        "neg": operator.neg,
        "pos": operator.pos,
        "abs": operator.abs,
        "truth": bool,
    }
)
#: functions of `math` a watched index may be handed (`math_watched`): the originals
_MATH: Mapping[str, Callable[..., Any]] = MappingProxyType(
    {
        name: getattr(math, name)
        for name in (
            *("sqrt", "exp", "log", "log2", "log10", "pow", "floor", "ceil", "trunc"),
            *("isqrt", "sin", "cos", "tan", "tanh", "atan", "fabs"),
        )
    }
)
#: plain values a watched index may meet in arithmetic and in comparisons
_NUMBERS = (int, float)
_COMPARABLE = (int, float, str, type(None))


#: arithmetic a watched index may take part in with a float tensor (`Watched._derive`)
_FLOAT_OPS = frozenset({"add", "sub", "mul", "truediv"})


@contextlib.contextmanager
def math_watched() -> Iterator[None]:
    """Inside the block, each function of `_MATH` handed a `Watched` gives a `Watched` (an
    expression of the indices, its value the running layer's) instead of reading the value
    (which ``float()`` would: a break); anything else as `math` does. Put back on exit; a
    block inside another (or beside it, in another thread) changes nothing, and once the
    outer one has put `math` back a watched argument is read, which breaks the fold: safe."""
    if getattr(math.sqrt, "_tpkit_watching", False):
        yield
        return
    saved = {name: getattr(math, name) for name in _MATH}

    def watching(name: str) -> Callable[..., Any]:
        plain = _MATH[name]

        def call(*args: Any) -> Any:
            first = next((a for a in args if isinstance(a, Watched)), None)
            return plain(*args) if first is None else first._math(name, args)

        call._tpkit_watching = True  # type: ignore[attr-defined]
        return call

    try:
        for name in _MATH:
            setattr(math, name, watching(name))
        yield
    finally:
        for name, plain in saved.items():
            setattr(math, name, plain)


class Guards:
    """Which layer is running and the guards its call has recorded so far: (expression,
    outcome). One per folded forward; a layer's calls are never nested in another's."""

    def __init__(self) -> None:
        self.layer: str | None = None
        self.recorded: list[tuple[Expr, Any]] = []

    def begin(self, layer: str) -> None:
        self.layer, self.recorded = layer, []

    def end(self) -> tuple[tuple[Expr, Any], ...]:
        found = tuple(self.recorded)
        self.layer, self.recorded = None, []
        return found


def holds(guards: tuple[tuple[Expr, Any], ...], env: Mapping[Any, int]) -> bool:
    """Whether every guard gives its recorded outcome with the indices ``env`` (key -> value:
    the layer about to stand on the call)."""
    for expr, outcome in guards:
        try:
            value = _evaluate(expr, env)
        except Exception:  # noqa: BLE001 - a twin whose index would raise (1 / 0): not alike
            return False
        if type(value) is not type(outcome) or value != outcome:
            return False
    return True


def _evaluate(expr: Expr, env: Mapping[Any, int]) -> Any:
    head = expr[0]
    if head == "var":
        return env[expr[1]]
    if head == "const":
        return expr[1]
    if head in _UNARY:
        return _UNARY[head](_evaluate(expr[1], env))
    if head == "math":
        return _MATH[expr[1]](*(_evaluate(e, env) for e in expr[2:]))
    return _BINARY[head](_evaluate(expr[1], env), _evaluate(expr[2], env))


class Watched:
    """An index (``key`` in the running layer's environment: ``("attr", submodule, name)``
    or ``("arg", name)``) of layer ``owner``, or an expression of such indices, while a folded
    forward runs: see the module docstring. ``token`` is what a use that needs its value
    names in `FoldBroken` (what tells layers of its kind apart from then on); a value derived
    by arithmetic keeps its token."""

    def __init__(
        self,
        name: str,
        value: Any,
        token: str,
        owner: str,
        guards: Guards,
        expr: Expr | None = None,
        key: Any = None,
    ):
        self._name, self._value, self._token = name, value, token
        self._owner, self._guards = owner, guards
        self._expr = expr if expr is not None else ("var", key if key is not None else name)

    def _used(self, *_: Any, **__: Any) -> Any:
        raise FoldBroken(f"the layer reads its index {self._name}", self._token)

    def _mine(self) -> None:
        """A break unless the layer that holds this index is the one running."""
        if self._guards.layer != self._owner:
            self._used()  # read outside its own layer's forward: its value would leak

    def _operand(self, other: Any, allowed: tuple[type, ...]) -> tuple[Expr, Any]:
        """``other``'s (expression, running value), or a break where the fold cannot follow
        the operation (an operand that is no plain number or string)."""
        self._mine()
        if isinstance(other, Watched):
            if other._guards is not self._guards or other._owner != self._owner:
                self._used()
            return other._expr, other._value
        if not isinstance(other, allowed):
            self._used()
        return ("const", other), other

    def _derive(self, op: str, other: Any, reflected: bool = False) -> Any:
        if isinstance(other, torch.Tensor) and op in _FLOAT_OPS:
            self._mine()
            if not (other.is_floating_point() or other.is_complex()):
                self._used()  # integer values steer shapes and paths: the index tells apart
            pair = (other, self._value) if reflected else (self._value, other)
            return _BINARY[op](*pair)  # float values only: see the module docstring
        expr, theirs = self._operand(other, _NUMBERS)
        if reflected:
            value, new = _BINARY[op](theirs, self._value), (op, expr, self._expr)
        else:
            value, new = _BINARY[op](self._value, theirs), (op, self._expr, expr)
        return Watched(self._name, value, self._token, self._owner, self._guards, new)

    def _math(self, name: str, args: tuple) -> Watched:
        """``math.<name>(*args)`` with this index among ``args`` (`math_watched`)."""
        exprs, values = [], []
        for a in args:
            expr, value = self._operand(a, _NUMBERS)
            exprs.append(expr)
            values.append(value)
        value = _MATH[name](*values)
        return Watched(
            self._name, value, self._token, self._owner, self._guards, ("math", name, *exprs)
        )

    def _compare(self, op: str, other: Any) -> bool:
        expr, theirs = self._operand(other, _COMPARABLE)
        outcome = _BINARY[op](self._value, theirs)
        if not isinstance(outcome, bool):
            self._used()
        self._guards.recorded.append(((op, self._expr, expr), outcome))
        return outcome

    def _unary(self, op: str) -> Any:
        self._mine()
        value = _UNARY[op](self._value)
        if op == "truth":
            self._guards.recorded.append((("truth", self._expr), value))
            return value
        return Watched(self._name, value, self._token, self._owner, self._guards, (op, self._expr))

    def __add__(self, o: Any) -> Watched:
        return self._derive("add", o)

    def __radd__(self, o: Any) -> Watched:
        return self._derive("add", o, True)

    def __sub__(self, o: Any) -> Watched:
        return self._derive("sub", o)

    def __rsub__(self, o: Any) -> Watched:
        return self._derive("sub", o, True)

    def __mul__(self, o: Any) -> Watched:
        return self._derive("mul", o)

    def __rmul__(self, o: Any) -> Watched:
        return self._derive("mul", o, True)

    def __truediv__(self, o: Any) -> Watched:
        return self._derive("truediv", o)

    def __rtruediv__(self, o: Any) -> Watched:
        return self._derive("truediv", o, True)

    def __floordiv__(self, o: Any) -> Watched:
        return self._derive("floordiv", o)

    def __rfloordiv__(self, o: Any) -> Watched:
        return self._derive("floordiv", o, True)

    def __mod__(self, o: Any) -> Watched:
        return self._derive("mod", o)

    def __rmod__(self, o: Any) -> Watched:
        return self._derive("mod", o, True)

    def __pow__(self, o: Any) -> Watched:
        return self._derive("pow", o)

    def __rpow__(self, o: Any) -> Watched:
        return self._derive("pow", o, True)

    def __neg__(self) -> Watched:
        return self._unary("neg")

    def __pos__(self) -> Watched:
        return self._unary("pos")

    def __abs__(self) -> Watched:
        return self._unary("abs")

    def __bool__(self) -> bool:
        return self._unary("truth")

    def __eq__(self, o: Any) -> bool:  # type: ignore[override]
        return self._compare("eq", o)

    def __ne__(self, o: Any) -> bool:  # type: ignore[override]
        return self._compare("ne", o)

    def __lt__(self, o: Any) -> bool:
        return self._compare("lt", o)

    def __le__(self, o: Any) -> bool:
        return self._compare("le", o)

    def __gt__(self, o: Any) -> bool:
        return self._compare("gt", o)

    def __ge__(self, o: Any) -> bool:
        return self._compare("ge", o)

    # every use that needs the value itself: the index tells layers apart from then on
    __index__ = __int__ = __float__ = __complex__ = __hash__ = __str__ = __repr__ = _used
    __format__ = __round__ = __trunc__ = __floor__ = __ceil__ = __invert__ = _used
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = _used
    __lshift__ = __rlshift__ = __rshift__ = __rrshift__ = __divmod__ = __rdivmod__ = _used
    __iter__ = __len__ = __contains__ = __getitem__ = __call__ = _used

    def __getattr__(self, name: str) -> Any:
        raise FoldBroken(f"the layer reads its index {self._name}", self._token)
