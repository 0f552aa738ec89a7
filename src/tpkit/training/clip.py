"""Gradient clipping with one global norm over any mix of DTensor and plain parameters.

``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms as DTensors, which fails as soon as
parameters live on different meshes (FSDP2's ("dp", "tp") parameters beside TP-only ones it
ignores: ``All operands in aten.stack.default must have the same mesh``) or mix plain tensors with
DTensors, and issues its reductions per mesh dimension. Here every rank sums ``|g|^p`` over its
local shards, divides each by how many ranks hold an identical copy of that shard, and one
all-reduce over the default group gives the global norm, the same on every rank. The signature and
the numbers are torch's, ``norm_type=0`` included (torch counts the gradients that have a nonzero
entry: here each parameter's nonzero count is summed over its shards first).
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


def _local_norms(grads: list[torch.Tensor], p: float, foreach: bool | None) -> list[torch.Tensor]:
    """Each local shard's ``p``-norm, through torch's fused kernel when ``foreach`` allows."""
    if not grads:
        return []
    if foreach is False or p == 0:
        return [torch.linalg.vector_norm(g, p) for g in grads]
    try:
        return list(torch._foreach_norm(grads, p))
    except RuntimeError:
        if foreach:  # asked for explicitly: say why it cannot be had, as torch does
            raise
        return [torch.linalg.vector_norm(g, p) for g in grads]


def _total_norm(
    grads: list[torch.Tensor], p: float, world: int, device, foreach: bool | None
) -> torch.Tensor:
    """The global ``p``-norm over every rank's shards: one all-reduce."""
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    norms = _local_norms([g.detach() for g in locals_], p, foreach)
    if p == float("inf"):
        total = torch.stack([n.float() for n in norms]).max() if norms else torch.zeros(())
        total = total.to(device)
        if world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return total
    copies = torch.tensor([_copies(g, world) for g in grads], dtype=torch.float64)
    if p == 0:  # per parameter: nonzero entries over all shards, then count the nonzero ones
        counts = torch.stack([n.double() for n in norms]).cpu() if norms else copies
        per_param = (counts / copies).to(device)
        if world > 1:
            dist.all_reduce(per_param)
        return (per_param > 0.5).sum().float()
    parts = [n.double() ** p for n in norms]
    total = (
        (torch.stack(parts).cpu() / copies).sum() if parts else torch.zeros((), dtype=torch.float64)
    )
    total = total.to(device)
    if world > 1:
        dist.all_reduce(total)
    return (total ** (1.0 / p)).float()


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their global ``norm_type``-norm is at most ``max_norm``;
    return the global norm (a plain tensor, equal on every rank), as torch's does.

    Takes torch's arguments: ``foreach`` picks its fused per-tensor kernels (None: where the
    device has them), ``error_if_nonfinite`` raises on a nan/inf norm, on every rank alike.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    world = dist.get_world_size() if dist.is_initialized() else 1
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = locals_[0].device if locals_ else torch.device("cpu")
    total = _total_norm(grads, float(norm_type), world, device, foreach)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
            "by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in locals_:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (dev, dtype), group in groups.items():
        scale = coef.to(dev, dtype)
        if foreach is not False:
            try:
                torch._foreach_mul_(group, scale)
                continue
            except RuntimeError:
                if foreach:  # asked for explicitly: say why it cannot be had, as torch does
                    raise
        for g in group:
            g.mul_(scale)
    return total
