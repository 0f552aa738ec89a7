"""Megatron's communication primitives as tiny autograd functions on local tensors.

torch's DTensor styles issue the same collectives through per-op dispatch; these do it once per
layer on plain tensors (no DTensor dispatch per op) and keep a block at exactly two all-reduces
forward and two backward. That alone does not make CPU decode fast: a decode step is then bound by
gloo's ~1 ms per small collective, which the shared-memory path below removes.

- ``copy_to_tp`` (Megatron's *f*): identity forward, all-reduce backward. Put before a
  column-parallel layer: each rank's input gradient is a partial sum over its columns.
- ``reduce_from_tp`` (Megatron's *g*): all-reduce forward, identity backward. Put after a
  row-parallel layer: each rank's output is a partial sum over its rows.
- ``gather_from_tp``: all-gather along the last dim forward, keep own slice backward (gathered
  logits). Handles torch.chunk-style uneven splits (e.g. GPT-2's 50257-token vocabulary).

Every all-reduce and all-gather here (forward and backward, with or without grad) of a plain
contiguous CPU tensor on a one-host gloo group takes the shared-memory path (`tpkit.parallel.shm`: measured 2-15x
faster than gloo, from a decode step's KiB to tens of MiB) unless
``torch.distributed.all_reduce`` / ``all_gather`` has been replaced by a wrapper (a profiler, a
test's counter): then they go through the wrapper so it sees every collective. Wrap on every rank
alike, as with any collective. `all_reduce_` and `all_gather_parts` are the same choice for the
other collectives of tpkit's layers (the vocab-parallel loss, sequence parallelism).

Under torch.compile the graph calls the custom ops ``tpkit::all_reduce`` / ``tpkit::all_gather``
(opaque to the compiler, each deciding as an eager call when it runs) for groups that agreed on
shared memory, and torch's traced collectives otherwise: a compiled CPU model keeps the fast path,
with no graph break at a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tpkit.compat import resolve_process_group
from tpkit.parallel.shm import OP_NAMES, shm_all_gather, shm_all_reduce, shm_gather_last, shm_ready

__all__ = ["all_gather_parts", "all_reduce_", "copy_to_tp", "gather_from_tp", "reduce_from_tp"]


# torch's own functions: a different object there means someone wraps them to watch collectives
_TORCH_ALL_REDUCE, _TORCH_ALL_GATHER = dist.all_reduce, dist.all_gather


_OPS = {name: op for op, name in OP_NAMES.items()}  # a custom op's argument back to the ReduceOp


def all_reduce_(
    t: torch.Tensor, group: ProcessGroup, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> torch.Tensor:
    """All-reduce ``t`` over ``group`` and return the result: in place through shared memory
    where that applies (`tpkit.parallel.shm`: one host, gloo, a plain contiguous CPU tensor, SUM or MAX),
    else through the process group; always the process group while ``dist.all_reduce`` is
    wrapped. Use the returned tensor: while torch.compile traces, it is a new one (the graph calls
    the ``tpkit::all_reduce`` op, so a compiled model keeps the fast path)."""
    if torch.compiler.is_compiling():  # (no wrapper check: dynamo cannot trace `is` on them)
        if op in OP_NAMES and _compiled_fast(t, group):
            return torch.ops.tpkit.all_reduce(t, group.group_name, OP_NAMES[op])
    elif dist.all_reduce is _TORCH_ALL_REDUCE and shm_all_reduce(t, group, op) is not None:
        return t
    dist.all_reduce(t, op=op, group=group)
    return t


def all_gather_parts(x: torch.Tensor, group: ProcessGroup) -> list[torch.Tensor]:
    """Every rank's contiguous ``x`` (the same shape on every rank), in rank order: through
    shared memory where that applies, else the process group (as `all_reduce_`)."""
    if torch.compiler.is_compiling():
        if _compiled_fast(x, group):
            return list(torch.ops.tpkit.all_gather(x, group.group_name).unbind(0))
    elif dist.all_gather is _TORCH_ALL_GATHER:
        stacked = shm_all_gather(x, group)
        if stacked is not None:
            return list(stacked.unbind(0))
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return parts


def _compiled_fast(x: torch.Tensor, group: ProcessGroup) -> bool:
    """While torch.compile traces: put a ``tpkit::`` op in the graph (which takes the shared-memory
    path or the process group when it runs) instead of torch's traced collective?"""
    return x.device.type == "cpu" and shm_ready(group.group_name)


# The shared-memory collectives as custom ops, opaque to torch.compile: a traced graph cannot
# run tpkit.parallel.shm's pipes and buffers, but it can call these, and each call decides as an eager one.
@torch.library.custom_op("tpkit::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group_name: str, op: str) -> torch.Tensor:
    return all_reduce_(x.contiguous().clone(), resolve_process_group(group_name), _OPS[op])


@_all_reduce_op.register_fake
def _(x: torch.Tensor, group_name: str, op: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tpkit::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.stack(all_gather_parts(x.contiguous(), resolve_process_group(group_name)))


@_all_gather_op.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    t = dist.get_world_size(resolve_process_group(group_name))
    return x.new_empty((t, *x.shape))


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _gather_last(x: torch.Tensor, sizes: list[int], group: ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    if not torch.compiler.is_compiling() and dist.all_gather is _TORCH_ALL_GATHER:
        out = shm_gather_last(x, sizes, group)  # straight into the result: no pad, no cat
        if out is not None:
            return out
    width = max(sizes)
    if x.shape[-1] < width:
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    parts = all_gather_parts(x, group)
    return torch.cat([p[..., :s] for p, s in zip(parts, sizes)], dim=-1)


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], rank: int, group: ProcessGroup):
        ctx.start, ctx.size = sum(sizes[:rank]), sizes[rank]
        return _gather_last(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[..., ctx.start : ctx.start + ctx.size].contiguous(), None, None, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (Megatron's f)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _CopyToTP.apply(x, group)
    return x


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward (Megatron's g). In-place when no grad is needed."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _ReduceFromTP.apply(x, group)
    return all_reduce_(x if x.is_contiguous() else x.contiguous(), group)


def gather_from_tp(x: torch.Tensor, sizes: list[int], rank: int, group: ProcessGroup):
    """All-gather along the last dim (uneven ``sizes`` allowed); backward keeps this rank's slice."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _GatherFromTP.apply(x, sizes, rank, group)
    return _gather_last(x, sizes, group)
