"""What crosses between the caller and the pool's workers, and how values are made to cross.

Messages are pickled with plain `pickle` (never ``ForkingPickler``: torch registers reductions
there that would try to share CPU storages by file descriptor, which needs a common parent).
A tensor therefore travels as its bytes, once per call, and arrives as a tensor.

Outputs are made safe to send by `to_caller`, run alike on every worker so that any collective
it needs (a DTensor's ``full_tensor``) is reached by all of them:

- tensors become detached CPU copies; those that require grad are kept on the worker as one
  *graph* per call and replaced by a `GradSlot`, so the caller can run their backward remotely;
- containers (dicts, ``ModelOutput``, lists, tuples, named tuples) are rebuilt around their
  converted items; plain values (numbers, strings, dtypes, devices, None) pass as they are;
- anything else (a KV cache holding this rank's heads, an optimizer) stays on the worker under
  an id and crosses as a `RemoteRef`: sending a rank-0 copy would give the other ranks rank 0's
  shards.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

__all__ = ["MODEL", "GradSlot", "RemoteRef", "Table", "from_caller", "plain", "to_caller"]

#: the id of the model itself in every worker's table
MODEL = 0

_PLAIN = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, slice)


@dataclasses.dataclass(frozen=True)
class RemoteRef:
    """An object that lives on every worker under ``id`` (each its own rank's version)."""

    id: int
    kind: str = ""


@dataclasses.dataclass(frozen=True)
class GradSlot:
    """Where the ``index``-th tensor of a call's graph sits in its output."""

    index: int


class Table:
    """A worker's objects by id. Every worker handles the same requests in the same order, so
    the counter hands out the same ids on every rank and one `RemoteRef` names them all."""

    def __init__(self, model: Any) -> None:
        self.objects: dict[int, Any] = {MODEL: model}
        self.graphs: dict[int, list[torch.Tensor]] = {}
        self._ids = itertools.count(1)

    def new_id(self) -> int:
        return next(self._ids)

    def keep(self, obj: Any) -> RemoteRef:
        ref = RemoteRef(self.new_id(), type(obj).__name__)
        self.objects[ref.id] = obj
        return ref

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i != MODEL:
                self.objects.pop(i, None)
                self.graphs.pop(i, None)


def _rebuild(obj: Any, items: Any) -> Any:
    if isinstance(obj, dict):
        kind = type(obj)
        try:
            return kind(**dict(items)) if kind is not dict else dict(items)
        except TypeError:  # a dict subclass with another constructor
            return dict(items)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*items)
    return type(obj)(items)


def to_caller(obj: Any, table: Table, grads: list[torch.Tensor]) -> Any:
    """``obj`` as it can cross to the caller (see the module docstring); tensors that require
    grad are appended to ``grads``. Same structure on every rank, same collectives."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, torch.Tensor):
        if isinstance(obj, DTensor):
            obj = obj.full_tensor()
        if obj.requires_grad:
            grads.append(obj)
            return GradSlot(len(grads) - 1)  # its value crosses with the graph
        return obj.detach().cpu()
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, dict):
        return _rebuild(obj, [(k, to_caller(v, table, grads)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return _rebuild(obj, [to_caller(v, table, grads) for v in obj])
    return table.keep(obj)


def plain(obj: Any) -> Any:
    """What ``model.run``'s function returned, sent without collectives (ranks may return
    different things): tensors as detached CPU copies, a DTensor refused with the fix."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        raise TypeError(
            "model.run: the function returned a DTensor, which only means something on its rank; "
            "return t.full_tensor() (every rank must call it) or t.to_local()."
        )
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: plain(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(plain(v) for v in obj)
    return obj


def from_caller(obj: Any, table: Table, device: torch.device) -> Any:
    """An argument from the caller as this worker uses it: a `RemoteRef` becomes this rank's
    object, a tensor moves to this rank's device."""
    if isinstance(obj, RemoteRef):
        if obj.id not in table.objects:
            raise ValueError(
                f"remote object #{obj.id} ({obj.kind}) is gone from the workers: it was freed, "
                "or the pool was restarted since it was made."
            )
        return table.objects[obj.id]
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return _rebuild(obj, [(k, from_caller(v, table, device)) for k, v in obj.items()])
    if type(obj) in (list, tuple) or (isinstance(obj, tuple) and hasattr(obj, "_fields")):
        return _rebuild(obj, [from_caller(v, table, device) for v in obj])
    return obj
