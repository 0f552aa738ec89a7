"""The private torch pieces tpkit needs, imported in this one place (each says why).

torch has no public name for these yet; keeping every such import here means a torch release
that moves one breaks one file, and the rest of tpkit imports only public names (ruff PLC2701).
"""

from __future__ import annotations

import sys
import traceback

# Every __torch_function__ (subclasses and modes) off: a fold reads a shadow value's bytes in
# the middle of a traced forward without the trace seeing that read (`tpkit.trace.fold`).
from torch._C import DisableTorchFunction

# Fake tensors: shapes and dtypes without memory, what torch.compile traces with.
from torch._subclasses import fake_tensor as _fake_tensor
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    unset_fake_temporarily,
)

# DCP's own key flattening and nested-dict writer: the only way to compare keys exactly as DCP
# will and to put loaded non-tensor items back where DCP's planner would.
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo

# The DTensor placement "each of k parts split separately" (packed q|k|v, fused gate|up, and
# FSDP2 over a TP-split dim): torch builds it internally, and has no public class for it.
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

# Flatten / map nested Python containers of tensors (what torch.compile uses).
from torch.utils._pytree import tree_flatten, tree_map


def as_parameter(t, requires_grad: bool):
    """``nn.Parameter(t, requires_grad)`` for a fresh leaf tensor subclass (a DTensor just made
    from its local tensor), without the ``detach`` that Parameter runs first: on a DTensor each
    new layout's detach costs ~2 ms of sharding propagation (13 ms of a 57M Llama's
    ``from_pretrained``, on the critical path). After that detach Parameter only sets this
    flag, which ``isinstance(t, nn.Parameter)`` reads; torch has no public way to set it.
    Anything else (not a DTensor, one with history or already needing grad) takes
    ``nn.Parameter`` itself."""
    import torch
    from torch.distributed.tensor import DTensor

    if type(t) is not DTensor or t.grad_fn is not None or t.requires_grad:
        return torch.nn.Parameter(t, requires_grad)
    t.requires_grad_(requires_grad)
    t._is_param = True
    return t


def fake_mode() -> FakeTensorMode:
    """A fresh ``FakeTensorMode(allow_non_fake_inputs=True)``, every analysis forward's.

    Its constructor keeps the stack it was made on (``traceback.extract_stack()``, shown only
    when debugging a fake-tensor error), and extracting a stack reads the source of every file
    on it through ``linecache``: the first analysis in a process read 8 files, the
    transformers modeling code among them (~0.08 s of a 300M Llama's 0.7 s
    ``tensor_parallel(plan="infer")`` under cProfile). Here the stack is extracted with its
    lines looked up lazily (``lookup_lines=False``): the same frames, whose ``line`` is read
    from the file only if someone asks for it."""
    real = _fake_tensor.traceback
    _fake_tensor.traceback = _LAZY_LINES
    try:
        return FakeTensorMode(allow_non_fake_inputs=True)
    finally:
        _fake_tensor.traceback = real


class _LazyLines:
    """The ``traceback`` module as `fake_mode` hands it to torch's fake-tensor module: its
    ``extract_stack`` leaves the source lines to be read on demand; anything else is the
    module's own."""

    @staticmethod
    def extract_stack(f=None, limit=None):
        frame = sys._getframe(1) if f is None else f
        stack = traceback.StackSummary.extract(
            traceback.walk_stack(frame), limit=limit, lookup_lines=False
        )
        stack.reverse()
        return stack

    def __getattr__(self, name: str):
        return getattr(traceback, name)


_LAZY_LINES = _LazyLines()


def group_timeout(group) -> float | None:
    """``group``'s collective timeout in seconds, or None where torch does not say: a wait of
    tpkit's own on the group (the shared-memory all-reduce) then lasts as long as gloo's would.
    torch keeps it on the backend's private options and has no public getter."""
    import torch

    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError, TypeError):
        return None


def dtensor_op_handlers() -> dict:
    """The DTensor dispatcher's table of per-op handlers (``aten op -> fn(op, args, kwargs)``),
    consulted before sharding propagation: torch has no public way to give an op on DTensors
    other semantics (its own loss and context parallelism write to the same table). Used by
    `tpkit.training.init`."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher._custom_op_handlers


def root_mesh(mesh):
    """The mesh ``mesh`` was sliced or flattened from (itself for a root mesh): sub-meshes and
    the meshes FSDP2 derives share it. torch keeps it behind a private method."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    return get_root() if get_root is not None else mesh


def default_store():
    """The default process group's key-value store (torchrun's rendezvous store): where ranks
    wait for one another longer than a collective's timeout allows (rank 0's planning), and
    where a timeout's roll call is taken. torch exposes it under a private name only."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def resolve_process_group(group_name: str):
    """The live process group named ``group_name`` (``ProcessGroup.group_name``): what a custom op
    receives in place of a group, which torch.library cannot pass. torch's functional collectives
    use the same lookup."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


__all__ = [
    "DataDependentOutputException",
    "DisableTorchFunction",
    "DynamicOutputShapeException",
    "FakeTensorMode",
    "StorageInfo",
    "StridedShard",
    "as_parameter",
    "default_store",
    "dtensor_op_handlers",
    "fake_mode",
    "flatten_state_dict",
    "group_timeout",
    "resolve_process_group",
    "root_mesh",
    "set_element",
    "tree_flatten",
    "tree_map",
    "unset_fake_temporarily",
]


def storage_holders(t) -> int:
    """How many tensors (and storage objects) hold ``t``'s storage: 1 when ``t`` is its only
    holder. torch counts them (``StorageImpl``'s use count) but names the binding privately;
    a torch without it answers "more than one" (nothing is then taken as held alone)."""
    import torch

    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return sys.maxsize
    storage = t.untyped_storage()  # one more holder while it lives
    return int(count(storage._cdata)) - 1
