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
process inside its all-reduce) at no cost to a training or decode loop.

A model built on meta and never loaded (``tensor_parallel`` refuses a meta model unless told its
weights come after the split, ``fill_later=True``: then ``to_empty`` and an init, or a load, fill
it; `tpkit.parallelize.split`) is refused where a meta tensor would reach
a forward, before any collective of that forward, on every rank alike (each rank built the same
model): the first forward's hook (registered first among the model's pre-hooks), every forward
under TPKIT_DEBUG, and `check_inputs` itself, which ``generate``'s guard calls after moving the
inputs to the parameters' device (meta for such a model) and which otherwise would all-gather
before failing on a meta tensor with torch's "Cannot copy out of meta tensor".
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from tpkit import config
from tpkit.log import get_logger

__all__ = [
    "FIRST_FORWARDS",
    "check_inputs",
    "check_outputs",
    "check_replicated_params",
    "debug_enabled",
    "install_debug_checks",
    "install_first_forward_checks",
    "install_input_checks",
    "install_output_checks",
    "refuse_meta",
]

log = get_logger(__name__)

_MAX_DIMS = 6  # shape entries compared per tensor; more dims are folded into the checksums


def debug_enabled() -> bool:
    """TPKIT_DEBUG, at call time (`tpkit.config.debug`)."""
    return config.debug()


#: Forwards whose inputs are checked across the TP group by default (TPKIT_DEBUG: all of them).
FIRST_FORWARDS = 2


def install_input_checks(model: nn.Module, tp_mesh: DeviceMesh):
    """The checks tensor_parallel installs: every forward under TPKIT_DEBUG=1 (inputs,
    replicated parameters and outputs), else the inputs and outputs of the first
    `FIRST_FORWARDS` forwards."""
    install_output_checks(model, tp_mesh, None if debug_enabled() else FIRST_FORWARDS)
    if debug_enabled():
        return install_debug_checks(model, tp_mesh)
    return install_first_forward_checks(model, tp_mesh)


def install_first_forward_checks(
    model: nn.Module, tp_mesh: DeviceMesh, count: int = FIRST_FORWARDS
):
    """Check the inputs of the first ``count`` forwards of ``model`` across the TP group, and at
    the first one that no parameter is left on the meta device; then remove the hook. The hook
    goes first among the model's pre-hooks, so the meta check precedes every collective."""
    calls = [0]

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if calls[0] == 0:
            refuse_meta(module)
        calls[0] += 1
        if calls[0] >= count:
            handle.remove()
        check_inputs(args, kwargs, tp_mesh)

    handle = model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    return handle


def refuse_meta(model: nn.Module) -> None:
    """Raise if a parameter of ``model`` is still on the meta device (built empty and never
    loaded or materialised). Local: every rank of a model built alike raises the same."""
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise RuntimeError(
            f"{type(model).__name__} still has {len(meta)} parameter(s) on the meta "
            f"device (e.g. {', '.join(meta[:3])}): it was built empty and never loaded. Load "
            "weights with tpkit.from_pretrained(path) or tpkit.load_local_state_dict(model, "
            "shards), or materialise it for training from scratch with model.to_empty(device=...) "
            "and then its init (model.init_weights())."
        )


def install_debug_checks(model: nn.Module, tp_mesh: DeviceMesh):
    """Register a forward pre-hook on ``model`` that runs `check_inputs` and
    `check_replicated_params` over ``tp_mesh`` before every forward. Returns the hook handle."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        refuse_meta(module)
        check_inputs(args, kwargs, tp_mesh)
        check_replicated_params(module, tp_mesh)

    log.info("TPKIT_DEBUG: checking inputs and replicated parameters at every forward")
    return model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)


@torch.compiler.disable  # collectives and a data-dependent branch: run eagerly, before the graph
def check_inputs(args: tuple, kwargs: dict, tp_mesh: DeviceMesh) -> None:
    """Raise on every rank if the tensor inputs of a forward differ across the TP group (or,
    before any collective, if one is on the meta device)."""
    named = list(_tensors("args", args)) + list(_tensors("", kwargs))
    names = [n for n, _ in named]
    meta = [n for n, t in named if t.device.type == "meta"]
    if meta:  # _signature cannot read them: refuse here, on every rank, not after a gather
        raise RuntimeError(
            f"tpkit: input(s) {meta[:3]} are on the meta device. generate() moves its inputs to "
            "the model's device, so this is a model built on meta and never loaded: load "
            "weights with tpkit.from_pretrained(path) or tpkit.load_local_state_dict(model, "
            "shards), or call model.to_empty(device=...) and its init first."
        )
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


def install_output_checks(model: nn.Module, tp_mesh: DeviceMesh, count: int | None = None):
    """Check the outputs of ``model`` across the TP group after each of its first ``count``
    forwards (None: every forward), then remove the hook. The inputs of those forwards are
    checked before them, so outputs that differ mean the split itself computes something
    different per rank: the silent kind of bug (an output head whose weight is split but whose
    output is never gathered gave rank 0 the right logits and rank 1 others). Forwards that
    torch.compile traces skip it (a second graph break, besides the input check's)."""
    calls = [0]
    name = type(model).__name__

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        if torch.compiler.is_compiling():
            return  # eager forwards only: in a graph it would add a break of its own
        calls[0] += 1
        if count is not None and calls[0] >= count:
            handle.remove()
        check_outputs(output, tp_mesh, name)

    handle = model.register_forward_hook(hook)
    return handle


#: output entries whose values legitimately differ per rank (per-head attention weights, KV
#: caches of the rank's heads, intermediate hidden states that sequence parallelism chunks)
_PER_RANK_OUTPUTS = ("attentions", "hidden_states", "past_key_values", "cache")
#: at most this many output tensors are compared (one collective of a fixed size)
_MAX_OUTPUTS = 8
#: relative tolerance of the output checksums (of the sum of absolute values): exact kernels
#: give equal outputs on every rank, nondeterministic GPU ones (atomics) differ by rounding
OUTPUT_RTOL = 1e-3


@torch.compiler.disable
def check_outputs(output: Any, tp_mesh: DeviceMesh, model_name: str = "the model") -> None:
    """Raise on every rank if a forward's outputs differ across the TP group: the loss, the
    logits and the other whole outputs (plain tensors; DTensors such as loss-parallel logits and
    per-rank entries, `_PER_RANK_OUTPUTS`, are skipped). One all-gather of a few float64
    numbers per output (count, shape, and `_output_sums`)."""
    named = list(_outputs(output))[:_MAX_OUTPUTS]
    width = 1 + _MAX_DIMS + 4  # ndim, shape, then `_output_sums`
    table = torch.zeros(1 + _MAX_OUTPUTS, width, dtype=torch.float64)
    table[0, 0] = len(named)
    table[0, 1] = zlib.crc32("\0".join(n for n, _ in named).encode())
    for i, (_, t) in enumerate(named):
        table[1 + i, : 1 + _MAX_DIMS] = _signature(t)[: 1 + _MAX_DIMS]
        table[1 + i, 1 + _MAX_DIMS :] = _output_sums(t)
    tables = _gather(table, tp_mesh)
    ranks = dist.get_process_group_ranks(tp_mesh.get_group())
    if any(not torch.equal(t[0], tables[0][0]) for t in tables):
        raise RuntimeError(
            f"tpkit: {model_name} returned different outputs across the TP group although their "
            f"inputs agree: output counts per rank {ranks}: {[int(t[0, 0]) for t in tables]} "
            f"(this rank: {[n for n, _ in named]}). {_OUTPUT_FIX}"
        )
    for i, (out_name, _) in enumerate(named):
        rows = [t[1 + i] for t in tables]
        if _outputs_agree(rows):
            continue
        per_rank = "; ".join(f"rank {r}: {_describe(row[:-2])}" for r, row in zip(ranks, rows))
        raise RuntimeError(
            f"tpkit: {model_name}'s output '{out_name}' differs across the TP group although "
            f"the inputs agree ({per_rank}). {_OUTPUT_FIX}"
        )


_OUTPUT_FIX = (
    "The split computes something different on each rank: a module whose weight is split "
    "but whose output is not gathered or reduced, or code that reads a rank's shard as if it "
    "were whole. Print the plan (tpkit plan MODEL, or model._tpkit.plan), keep the suspect "
    "module whole with plan={'<module>': 'replicate'}, and please report it."
)


def _outputs(output: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for the whole outputs of a forward: a tensor; a mapping's (a ModelOutput's)
    plain tensors other than `_PER_RANK_OUTPUTS`; a tuple's first tensor (``return_dict=False``:
    what follows may be a cache)."""
    if isinstance(output, DTensor):
        return
    if isinstance(output, torch.Tensor):
        yield "output", output
    elif isinstance(output, Mapping):
        for k, v in output.items():
            per_rank = any(p in str(k) for p in _PER_RANK_OUTPUTS)
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and not per_rank:
                yield str(k), v
    elif isinstance(output, (tuple, list)) and output:
        first = output[0]
        if isinstance(first, torch.Tensor) and not isinstance(first, DTensor):
            yield "output[0]", first


def _output_sums(t: torch.Tensor) -> torch.Tensor:
    """[sum, position-weighted sum, sum of |x|, position-weighted sum of |x|] in float64: the
    sums of |x| catch differences whose signs cancel in the plain sums, the weighted ones
    values moved to other positions."""
    flat = t.detach().reshape(-1).to(torch.float64)
    weights = 1.0 + torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) % 1021
    a = flat.abs()
    return torch.stack([flat.sum(), (flat * weights).sum(), a.sum(), (a * weights).sum()]).cpu()


def _outputs_agree(rows: list[torch.Tensor]) -> bool:
    """Same shape on every rank, and each sum equal or within `OUTPUT_RTOL` of the largest sum
    of |x| (weighted alike)."""
    head = slice(0, 1 + _MAX_DIMS)
    if any(not torch.equal(r[head], rows[0][head]) for r in rows):
        return False
    sums = torch.stack([r[1 + _MAX_DIMS :] for r in rows])  # [ranks, 4]
    scale = sums[:, 2:].abs().amax(dim=0).repeat(2) * OUTPUT_RTOL  # |x| sums for both kinds
    close = (sums - sums[0]).abs() <= scale
    return bool((_same(sums, sums[0]) | close).all())


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
