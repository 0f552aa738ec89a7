"""The caller's side of a live model: `ModelHandle` (what ``tensor_parallel`` returns outside
torchrun), `RemoteObject` (anything that stays on the workers) and `RemoteOptimizer`.

A call on the handle runs on every worker at once (SPMD) and returns rank 0's outputs as
detached CPU tensors. Outputs that need a backward are made, in the caller, by one autograd
function per call (`_RemoteBackward`): ``loss.backward()`` in a cell reaches its ``backward``,
which sends the incoming gradients to the workers, where each runs the backward of the graph it
kept for that call. So the ordinary ways of using a loss work unchanged: ``loss.item()``,
``(loss / accumulation).backward()``, the sum of two outputs' backwards.

Objects that only mean something on their rank (a KV cache of this rank's heads, an optimizer
of its shards) stay there; the caller holds a `RemoteObject` that names them, and passing it
back as an argument hands each worker its own. When the proxy is garbage-collected, the workers
drop the object with the next request.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import torch

from tpkit.pool.protocol import MODEL, GradSlot, RemoteRef
from tpkit.pool.worker import optimizer_for
from tpkit.pool.workers import Pool

__all__ = ["ModelHandle", "RemoteObject", "RemoteOptimizer", "explain_split", "optim"]


class _Graph:
    """One call's graph on the workers; freed there when the caller's outputs are gone."""

    def __init__(self, pool: Pool, graph_id: int) -> None:
        self.pool, self.id, self.generation = pool, graph_id, pool.generation
        weakref.finalize(self, _forget, pool, graph_id, pool.generation)

    def backward(self, grads: tuple) -> None:
        if self.pool.generation != self.generation:
            raise RuntimeError("backward of an output made before the pool was restarted.")
        sent = [None if g is None else g.detach().cpu() for g in grads]
        if any(g is not None for g in sent):
            self.pool.request("backward", (self.id, sent))


def _forget(pool: Pool, ref_id: int, generation: int) -> None:
    if pool.generation == generation and pool.stopped is None:
        pool.freed.append(ref_id)


class _RemoteBackward(torch.autograd.Function):
    """Outputs ``values`` (copies of a call's outputs that require grad on the workers) whose
    backward runs on the workers. ``anchor`` is a leaf that makes them require grad here."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, graph: _Graph, values: list) -> tuple:
        ctx.graph = graph
        ctx.set_materialize_grads(False)
        return tuple(values)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple:
        ctx.graph.backward(grads)
        return None, None, None


def _place(obj: Any, values: list, owner: ModelHandle) -> Any:
    """The worker's answer as the caller uses it: grad slots filled, refs made proxies."""
    if isinstance(obj, GradSlot):
        return values[obj.index]
    if isinstance(obj, RemoteRef):
        return owner if obj.id == MODEL else RemoteObject(owner, obj)
    if isinstance(obj, dict):
        items = {k: _place(v, values, owner) for k, v in obj.items()}
        for k, v in items.items():
            obj[k] = v
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_place(v, values, owner) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_place(v, values, owner) for v in obj)
    return obj


def _to_workers(obj: Any, pool: Pool) -> Any:
    """An argument as it is sent: proxies as their refs, tensors on the CPU."""
    if isinstance(obj, RemoteObject):
        if obj._generation != pool.generation:
            raise ValueError(
                f"{obj!r} was made before the pool was restarted; its workers are gone."
            )
        return obj._ref
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return type(obj)((k, _to_workers(v, pool)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_workers(v, pool) for v in obj))
    if type(obj) in (list, tuple):
        return type(obj)(_to_workers(v, pool) for v in obj)
    return obj


def _check_picklable_by_reference(fn: Callable, what: str) -> None:
    """A worker finds ``fn`` by importing its module: refuse what it cannot import, here."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "<")
    if module == "__main__" or "<" in name:
        raise TypeError(
            f"{what}: {getattr(fn, '__qualname__', fn)!r} is defined in {module or 'no module'}"
            ", which the workers cannot import (they are separate processes). Put it in a .py "
            "file next to the notebook and import it from there."
        )


class RemoteObject:
    """Something that lives on every worker (each its own rank's version). Calling it, or a
    method of it, runs on every worker; reading an attribute brings rank 0's value."""

    def __init__(self, owner: ModelHandle | None, ref: RemoteRef, pool: Pool | None = None):
        pool = pool if pool is not None else owner._pool
        object.__setattr__(self, "_owner", owner if owner is not None else self)
        object.__setattr__(self, "_pool", pool)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_generation", pool.generation)
        if ref.id != MODEL:
            weakref.finalize(self, _forget, pool, ref.id, pool.generation)

    def _request(self, op: str, payload: Any) -> Any:
        value, graph_id, values = self._pool.request(op, payload)
        if graph_id is not None and values:
            graph = _Graph(self._pool, graph_id)
            anchor = torch.zeros((), requires_grad=True)
            values = list(_RemoteBackward.apply(anchor, graph, values))
        return _place(value, values, self._owner)

    def _call(self, attr: str | None, args: tuple, kwargs: dict) -> Any:
        pool = self._pool
        sent = (_to_workers(args, pool), _to_workers(kwargs, pool))
        return self._request("call", (self._ref, attr, *sent, torch.is_grad_enabled()))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(None, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # probes (IPython's _repr_*_, hasattr(m, "_x")) stay local
            raise AttributeError(name)
        return self._request("getattr", (self._ref, name))

    def __repr__(self) -> str:
        return f"<remote {self._ref.kind} #{self._ref.id} on {self._pool.world} tpkit workers>"


class RemoteOptimizer(RemoteObject):
    """An optimizer of every worker's shards (`ModelHandle.optimizer`)."""

    def step(self) -> None:
        """One step on every worker (a ``closure`` is not supported: it could not run there)."""
        self._call("step", (), {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._call("zero_grad", (), {"set_to_none": set_to_none})


class ModelHandle(RemoteObject):
    """A model split over a pool of worker processes, used as the model itself.

    ``model(**inputs)``, ``model.generate(...)``, ``model.save_pretrained(dir)``, ``print(model)``
    run on every worker and answer here; ``model.config``, ``model.generation_config``,
    ``model.device`` and ``model.dtype`` are rank 0's, read once at start (changing them here
    does not change the workers: pass generation options to ``generate``). ``loss.backward()``
    on a returned loss runs the backward on the workers; `optimizer` makes an optimizer of the
    shards; `run` runs your own function on every worker with the live model.

    The workers end with `close` (or ``with``, or when the handle is garbage-collected, or at
    exit, or with the caller's process). After a worker dies or a call is interrupted, the next
    call says so and `restart` starts the pool again from the weights the model was made from
    (training since then is lost: ``save_pretrained`` first).
    """

    def __init__(self, pool: Pool, info: dict, cleanup: Callable[[], None] | None = None):
        super().__init__(None, RemoteRef(MODEL, "model"), pool)
        object.__setattr__(self, "_finalizer", weakref.finalize(self, _close, pool, cleanup))
        self._started(info)

    def _started(self, info: dict) -> None:
        for name in ("config", "generation_config", "device", "dtype", "training"):
            object.__setattr__(self, name, info[name])
        object.__setattr__(self, "_generation", self._pool.generation)
        object.__setattr__(self, "loading_info", info["info"])
        object.__setattr__(self, "_type", info["type"])

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"cannot set {name!r} on a tpkit ModelHandle: the model lives in its workers. Use "
            "model.run(fn) with a function that changes the model on every worker."
        )

    # ---- the model's own calls -----------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("forward", args, kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``generate`` on every worker (same tokens on each); the output comes back here."""
        return self._call("generate", args, kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """The whole model saved by rank 0 (tpkit's gathering ``save_pretrained``), in a
        directory the workers can reach (they run on this machine)."""
        self._call("save_pretrained", (os.path.abspath(save_directory),), kwargs)

    def train(self, mode: bool = True) -> ModelHandle:
        self._call("train", (mode,), {})
        object.__setattr__(self, "training", mode)
        return self

    def eval(self) -> ModelHandle:
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._call("zero_grad", (), {"set_to_none": set_to_none})

    def __repr__(self) -> str:
        if self._pool.stopped is not None:
            return f"<tpkit ModelHandle of {self._type}: pool stopped ({self._pool.stopped})>"
        text = self._pool.request("run", (repr, (), {}))
        return f"{text}\n(tpkit ModelHandle: split over {self._pool.world} worker processes)"

    # ---- what only a handle has ---------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(model, *args, **kwargs)`` on every worker with its live split model; returns
        rank 0's result (tensors as CPU copies). ``fn`` must be importable by the workers (a
        function in a .py module, not one defined in the notebook): a custom training loop, a
        PEFT wrap, a Trainer run. Every worker must reach the same collectives."""
        _check_picklable_by_reference(fn, "model.run")
        value = self._pool.request("run", (fn, _to_workers(args, self._pool), kwargs))
        return value

    def optimizer(self, cls: type, *args: Any, **kwargs: Any) -> RemoteOptimizer:
        """``cls(model.parameters(), *args, **kwargs)`` on every worker, over its shards:
        ``opt = model.optimizer(torch.optim.AdamW, lr=1e-4)``, then ``opt.step()`` and
        ``opt.zero_grad()`` after ``loss.backward()``."""
        _check_picklable_by_reference(cls, "model.optimizer")
        ref = self._pool.request("make", (optimizer_for, (cls, *args), kwargs))
        return RemoteOptimizer(self, ref)

    def explain(self) -> str:
        """The plan the workers applied, as ``tpkit plan`` prints it (rank 0's)."""
        return self._pool.request("run", (explain_split, (), {}))

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (empty when the pool is stopped)."""
        return self._pool.pids

    @property
    def world_size(self) -> int:
        return self._pool.world

    def restart(self) -> ModelHandle:
        """Stop the workers if any are left and start them again from the weights this model
        was made from; every `RemoteObject` made before (optimizers, caches) is invalid."""
        if not self._finalizer.alive:
            raise RuntimeError("this tpkit ModelHandle was closed; make a new one.")
        self._pool.stop("restarting")
        self._started(self._pool.start())
        return self

    def close(self) -> None:
        """End the workers and remove the pool's temporary files (idempotent)."""
        self._finalizer()

    def __enter__(self) -> ModelHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _close(pool: Pool, cleanup: Callable[[], None] | None) -> None:
    pool.stop("closed")
    if cleanup is not None:
        cleanup()


def optim(model: ModelHandle, cls: type, *args: Any, **kwargs: Any) -> RemoteOptimizer:
    """``tpkit.optim(model, torch.optim.AdamW, lr=...)``: `ModelHandle.optimizer`."""
    return model.optimizer(cls, *args, **kwargs)


def explain_split(model: torch.nn.Module) -> str:
    """The plan applied to ``model`` as `tpkit.explain` prints it (run on every worker)."""
    from tpkit.plan.table import explain
    from tpkit.state import tp_state

    state = tp_state(model)
    if state is None:
        return f"{type(model).__name__} was not split by tpkit."
    return explain(state.plan, model, tp_size=state.tp_size)
