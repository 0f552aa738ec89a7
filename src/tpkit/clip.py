"""Gradient clipping with one global norm over any mix of DTensor and plain parameters.

``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms as DTensors, which fails as soon as
parameters live on different meshes (FSDP2's ("dp", "tp") parameters beside TP-only ones it
ignores: ``All operands in aten.stack.default must have the same mesh``) or mix plain tensors with
DTensors, and issues its reductions per mesh dimension. Here every rank sums ``|g|^p`` over its
local shards, divides each by how many ranks hold an identical copy of that shard, and one
all-reduce over the default group gives the global norm, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from tpkit.compat import StridedShard

__all__ = ["clip_grad_norm_"]


def _copies(grad: torch.Tensor, world: int) -> int:
    """Ranks holding an identical copy of this rank's shard of ``grad``."""
    if not isinstance(grad, DTensor):
        return world
    mesh = grad.device_mesh
    distinct = 1
    for size, placement in zip(mesh.shape, grad.placements):
        if isinstance(placement, (Shard, StridedShard)):
            distinct *= size
    return world // distinct


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale gradients in place so their global ``norm_type``-norm is at most ``max_norm``;
    return the global norm (a plain tensor, equal on every rank), as torch's does."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    world = dist.get_world_size() if dist.is_initialized() else 1
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = locals_[0].device if locals_ else torch.device("cpu")
    norm_type = float(norm_type)
    if norm_type == float("inf"):
        total = torch.zeros((), device=device)
        for g in locals_:
            if g.numel():
                total = torch.maximum(total, g.detach().abs().max().float())
        if world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
    else:
        total = torch.zeros((), device=device, dtype=torch.float64)
        for g, full in zip(locals_, grads):
            if g.numel():
                part = torch.linalg.vector_norm(g.detach().double(), norm_type) ** norm_type
                total += part / _copies(full, world)
        if world > 1:
            dist.all_reduce(total)
        total = (total ** (1.0 / norm_type)).float()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} of the gradients is {total}.")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in locals_:
        g.mul_(coef.to(g.device, g.dtype))
    return total
