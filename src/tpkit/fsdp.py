"""FSDP2 over the "dp" mesh dimension, after tensor parallelism over "tp" (torchtitan's order).

``fully_shard`` is applied to every repeated block (the elements of the model's largest
``nn.ModuleList``) and then to the root, so each block's parameters are gathered just before it
runs and freed after. Parameters that are already DTensors on the TP mesh become 2D DTensors
(``(Shard(0), <tp placement>)``); FSDP2 unshards them back to TP DTensors for forward, which the
styles' local-compute hooks then use as usual.

With dp=1 there is no dimension to shard over and FSDP is not applied: what TP leaves replicated
(norm weights, row-parallel biases, routers) is a few thousandths of a transformer's parameters
(Llama-7B: 0.003%), not worth a ZeRO pass of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The elements of every largest ``nn.ModuleList`` (an encoder-decoder has two)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    longest = max(len(m) for m in lists)
    blocks: list[nn.Module] = []
    for m in lists:
        if len(m) == longest or len(m) >= max(2, longest // 2):
            blocks.extend(m)
    # a ModuleList nested in a block is not a block of its own
    inside = {id(sub) for b in blocks for sub in b.modules() if sub is not b}
    return [b for b in blocks if id(b) not in inside]


def mixed_precision(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """bf16 (or fp16) parameters and compute, float32 gradient reductions."""
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def _strided_1d(p: nn.Parameter) -> bool:
    """A 1-D parameter already split in strided parts on its only dim by TP (a packed q|k|v or
    gate|up bias). FSDP2 would have to stack a second strided split on the same dim, which
    DTensor gets wrong (gradients come back scrambled: measured on GPT-2's c_attn.bias)."""
    return (
        isinstance(p, DTensor)
        and p.ndim == 1
        and any(isinstance(pl, _StridedShard) for pl in p.placements)
    )


def _shard_dim(p: nn.Parameter) -> Shard:
    """FSDP's dim: 0, unless TP already splits dim 0 in strided parts (then the next dim)."""
    if isinstance(p, DTensor):
        for pl in p.placements:
            if isinstance(pl, _StridedShard) and pl.dim == 0 and p.ndim > 1:
                return Shard(1)
    return Shard(0)


def _average_over_dp(dp_mesh: DeviceMesh):
    group, size = dp_mesh.get_group(), dp_mesh.size()

    def hook(grad: torch.Tensor) -> torch.Tensor:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local = local.contiguous().clone()
        dist.all_reduce(local, group=group)  # gloo has no AVG
        local.div_(size)
        if not isinstance(grad, DTensor):
            return local
        return DTensor.from_local(
            local,
            grad.device_mesh,
            grad.placements,
            run_check=False,
            shape=grad.shape,
            stride=grad.stride(),
        )

    return hook


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """``fully_shard`` every repeated block, then the root, over ``dp_mesh``.

    The few 1-D strided TP parameters (packed biases) stay out of FSDP: they are replicated over
    dp, their gradient is averaged over dp by a hook as it is produced, and with ``param_dtype``
    their owner computes with a cast copy.
    """
    mp = mixed_precision(param_dtype)
    ignored = {p for p in model.parameters() if _strided_1d(p)}
    for p in ignored:
        if p.requires_grad:  # a frozen base (PEFT) has nothing to average
            p.register_hook(_average_over_dp(dp_mesh))
    if param_dtype is not None:
        for module in model.modules():
            style = module.__dict__.get("_tpkit_style_obj")
            if style is not None and any(p in ignored for p in module._parameters.values()):
                style.compute_dtype = param_dtype
    kwargs = dict(
        mesh=dp_mesh,
        mp_policy=mp,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=_shard_dim,
        ignored_params=ignored or None,
    )
    for block in repeated_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if callable(getattr(model, "generate", None)):
        # generate() calls submodules (an encoder) outside the root's forward: unshard for it too
        register_fsdp_forward_method(model, "generate")
    return model
