"""Check what tensor parallelism silently assumes: by default at the first forwards, with
``TPKIT_DEBUG=1`` at every forward.

1. Inputs agree across the TP group. Every rank of a group must get the same batch; if not, each
   computes a different half of a different sum and the result is quietly wrong.
2. Replicated parameters are still equal across the group. A replicated weight that acts on
   sharded activations without a gradient all-reduce (or an optimizer step run on one rank only)
   drifts apart, one ulp at a time.

Both are cheap: each rank all-gathers a few float64 numbers per tensor (shape and two checksums),
never the tensors. torch lacks such a check (``TORCH_DISTRIBUTED_DEBUG=DETAIL`` compares the
shapes of collectives, not the values of inputs or parameters). On a mismatch every rank raises
the same ``RuntimeError`` naming the first input or parameter that differs, so nothing hangs.

Without TPKIT_DEBUG the inputs of the first `FIRST_FORWARDS` forwards are checked (one small
all-gather each, then the hook removes itself), which catches the common mistakes (ranks seeded
differently, each loading its own batch, sequence lengths that differ: gloo would abort the
process inside its all-reduce) at no cost to a training or decode loop. The first forward also
refuses parameters still on the meta device (a model built empty and never loaded).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from tpkit.log import get_logger

__all__ = [
    "FIRST_FORWARDS",
    "check_inputs",
    "check_replicated_params",
    "debug_enabled",
    "install_debug_checks",
    "install_first_forward_checks",
    "install_input_checks",
]

log = get_logger(__name__)

_MAX_DIMS = 6  # shape entries compared per tensor; more dims are folded into the checksums


def debug_enabled() -> bool:
    return os.environ.get("TPKIT_DEBUG", "").lower() not in ("", "0", "false", "no")


#: Forwards whose inputs are checked across the TP group by default (TPKIT_DEBUG: all of them).
FIRST_FORWARDS = 2


def install_input_checks(model: nn.Module, tp_mesh: DeviceMesh):
    """The checks tensor_parallel installs: every forward under TPKIT_DEBUG=1 (inputs and
    replicated parameters), else the inputs of the first `FIRST_FORWARDS` forwards."""
    if debug_enabled():
        return install_debug_checks(model, tp_mesh)
    return install_first_forward_checks(model, tp_mesh)


def install_first_forward_checks(
    model: nn.Module, tp_mesh: DeviceMesh, count: int = FIRST_FORWARDS
):
    """Check the inputs of the first ``count`` forwards of ``model`` across the TP group, and at
    the first one that no parameter is left on the meta device; then remove the hook."""
    calls = [0]

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if calls[0] == 0:
            meta = next((n for n, p in module.named_parameters() if p.device.type == "meta"), None)
            if meta is not None:  # local: every rank of a model built alike sees the same
                raise RuntimeError(
                    f"{type(module).__name__} still has parameters on the meta device (e.g. "
                    f"{meta}): it was built empty and never loaded. Load weights with "
                    "tpkit.from_pretrained(path) or tpkit.load_local_state_dict(model, shards)."
                )
        calls[0] += 1
        if calls[0] >= count:
            handle.remove()
        check_inputs(args, kwargs, tp_mesh)

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    return handle


def install_debug_checks(model: nn.Module, tp_mesh: DeviceMesh):
    """Register a forward pre-hook on ``model`` that runs `check_inputs` and
    `check_replicated_params` over ``tp_mesh`` before every forward. Returns the hook handle."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        check_inputs(args, kwargs, tp_mesh)
        check_replicated_params(module, tp_mesh)

    log.info("TPKIT_DEBUG: checking inputs and replicated parameters at every forward")
    return model.register_forward_pre_hook(hook, with_kwargs=True)


@torch.compiler.disable  # collectives and a data-dependent branch: run eagerly, before the graph
def check_inputs(args: tuple, kwargs: dict, tp_mesh: DeviceMesh) -> None:
    """Raise on every rank if the tensor inputs of a forward differ across the TP group."""
    named = list(_tensors("args", args)) + list(_tensors("", kwargs))
    names = [n for n, _ in named]
    header = torch.tensor([len(named), zlib.crc32("\0".join(names).encode())], dtype=torch.float64)
    headers = _gather(header, tp_mesh)
    if any(not torch.equal(h, headers[0]) for h in headers):
        ranks = dist.get_process_group_ranks(tp_mesh.get_group())
        raise RuntimeError(
            "tpkit: the ranks of a TP group passed different sets of tensor inputs to "
            f"forward (this rank: {names}; tensor counts per rank {ranks}: "
            f"{[int(h[0]) for h in headers]}). Every rank of a TP group must call the model with "
            "the same arguments."
        )
    if not named:
        return
    sigs = _gather(torch.stack([_signature(t) for _, t in named]), tp_mesh)
    _raise_first_difference("input", names, sigs, tp_mesh, _INPUT_FIX)


@torch.compiler.disable
def check_replicated_params(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Raise on every rank if a ``Replicate()`` DTensor parameter differs across the TP group."""
    named = [
        (n, p.to_local())
        for n, p in model.named_parameters()
        if isinstance(p, DTensor) and all(isinstance(pl, Replicate) for pl in p.placements)
    ]
    if not named:
        return
    sigs = _gather(torch.stack([_signature(t.detach()) for _, t in named]), tp_mesh)
    _raise_first_difference(
        "replicated parameter", [n for n, _ in named], sigs, tp_mesh, _PARAM_FIX
    )


_INPUT_FIX = (
    "Every rank of a TP group must get identical inputs: same batch, same seed, same "
    "preprocessing; split data over the 'dp' mesh dimension only, never over 'tp'."
)
_PARAM_FIX = (
    "Replicated parameters drifted apart: a replicated weight that sees sharded activations "
    "needs the 'replicated_with_grad_allreduce' style, and every rank must run the same "
    "optimizer steps."
)


def _tensors(prefix: str, obj: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for plain tensors in args/kwargs, nested lists/tuples/dicts included.
    DTensors are skipped: their local shards legitimately differ."""
    if isinstance(obj, DTensor):
        return
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(f"{prefix}.{k}" if prefix else str(k), v)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(f"{prefix}[{i}]", v)


def _signature(t: torch.Tensor) -> torch.Tensor:
    """[ndim, shape padded to _MAX_DIMS, sum, position-weighted sum] in float64 on CPU."""
    flat = t.detach().reshape(-1).to(torch.float64)
    weights = 1.0 + torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) % 1021
    shape = list(t.shape)[:_MAX_DIMS] + [-1] * max(0, _MAX_DIMS - t.dim())
    sums = torch.stack([flat.sum(), (flat * weights).sum()]).cpu()
    return torch.cat([torch.tensor([float(t.dim()), *shape], dtype=torch.float64), sums])


def _gather(t: torch.Tensor, tp_mesh: DeviceMesh) -> list[torch.Tensor]:
    if tp_mesh.device_type == "cuda":  # NCCL gathers CUDA tensors only
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    out = [torch.empty_like(t) for _ in range(tp_mesh.size())]
    dist.all_gather(out, t, group=tp_mesh.get_group())
    return [o.cpu() for o in out]


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a == b) | (a.isnan() & b.isnan())


def _raise_first_difference(
    kind: str, names: list[str], sigs: list[torch.Tensor], tp_mesh: DeviceMesh, fix: str
) -> None:
    agree = torch.stack([_same(s, sigs[0]).all(dim=-1) for s in sigs]).all(dim=0)
    if bool(agree.all()):
        return
    i = int((~agree).nonzero()[0])
    ranks = dist.get_process_group_ranks(tp_mesh.get_group())
    per_rank = "; ".join(f"rank {r}: {_describe(s[i])}" for r, s in zip(ranks, sigs))
    raise RuntimeError(
        f"tpkit: {kind} '{names[i]}' differs across the TP group ({per_rank}). {fix}"
    )


def _describe(sig: torch.Tensor) -> str:
    ndim = int(sig[0])
    shape = tuple(int(x) for x in sig[1 : 1 + min(ndim, _MAX_DIMS)])
    return f"shape {shape}, sum {float(sig[-2]):.6g}, checksum {float(sig[-1]):.6g}"
