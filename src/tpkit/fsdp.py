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
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


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


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """``fully_shard`` every repeated block, then the root, over ``dp_mesh``."""
    mp = mixed_precision(param_dtype)
    for block in repeated_blocks(model):
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model
