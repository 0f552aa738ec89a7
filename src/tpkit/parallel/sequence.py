"""Sequence parallelism (Megatron-SP) on top of tensor parallelism, for decoder-only models.

Outside the tensor-parallel regions of a block (norms, residual adds, dropout) activations are
replicated across the TP group: t copies of the same work and memory. SP splits them along the
sequence instead. The all-reduce that closes a region becomes a reduce-scatter (each rank keeps
its sequence chunk) and the region opens with an all-gather: the same bytes, activations / t.

Where the collectives go, and why there:
- The first block scatters its input (no communication: every rank has the whole sequence and
  keeps its chunk); the last block all-gathers its output, so the embedding, the final norm and
  the head run exactly as without SP.
- A region (the module whose children are the column-parallel layers, e.g. ``self_attn``,
  ``mlp``) all-gathers its hidden-states input *at its own entry*, not at each column layer:
  transformers' attention reads the sequence length from the tensor it is given, so it must see
  the whole sequence. The gather's backward is a reduce-scatter, which also sums the column
  layers' partial input gradients, so those layers skip their own all-reduce (f).
- Row-parallel layers reduce-scatter their output along the sequence.
- Replicated parameters that now see only a chunk of the sequence (block norms, row-parallel
  biases) get their gradients all-reduced over the TP group.
- Only while training with grad enabled: in eval and ``generate`` (one token per step) the model
  runs exactly as without SP.

What SP cannot run (encoder-decoders, MoE experts, post-norm blocks, gathered pairs) is refused by
`tpkit.plan.validate` before anything is split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from tpkit.parallel.comm import all_gather_parts, all_reduce_
from tpkit.plan import Plan, style_spec
from tpkit.plan.layout import tp_regions
from tpkit.styles.base import map_output
from tpkit.trace.trace import repeated_blocks

__all__ = ["SPState", "SequenceParallel"]

SEQ_DIM = 1


# ---- collectives along the sequence dimension ------------------------------------------------
def _all_gather(x: torch.Tensor, group: ProcessGroup, rank: int, tp: int) -> torch.Tensor:
    return torch.cat(all_gather_parts(x.contiguous(), group), dim=SEQ_DIM)


def _chunk(x: torch.Tensor, group: ProcessGroup, rank: int, tp: int) -> torch.Tensor:
    n = x.shape[SEQ_DIM] // tp
    return x.narrow(SEQ_DIM, rank * n, n).contiguous()


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup, rank: int, tp: int) -> torch.Tensor:
    if dist.get_backend(group) == "nccl":
        moved = x.movedim(SEQ_DIM, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // tp, *moved.shape[1:]))
        dist.reduce_scatter_tensor(out, moved, group=group)
        return out.movedim(0, SEQ_DIM)
    x = x.contiguous().clone()  # gloo has no reduce-scatter: all-reduce, keep our chunk
    return _chunk(all_reduce_(x, group), group, rank, tp)


class _SequenceOp(torch.autograd.Function):
    """``forward_op`` on the way in, ``backward_op`` on the gradient: the four pairings SP uses
    are chunk/gather (enter the first block), gather/chunk (leave the last: the gradient is
    whole everywhere), gather/reduce-scatter (enter a region: the column layers' input
    gradients are partial) and reduce-scatter/gather (a row layer's output)."""

    @staticmethod
    def forward(ctx, x, forward_op, backward_op, group, rank, tp):
        ctx.backward_op, ctx.args = backward_op, (group, rank, tp)
        return forward_op(x, group, rank, tp)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, *ctx.args), None, None, None, None, None


def _scatter(x: torch.Tensor, state: SPState) -> torch.Tensor:
    return _SequenceOp.apply(x, _chunk, _all_gather, state.group, state.rank, state.tp)


def _gather(x: torch.Tensor, state: SPState) -> torch.Tensor:
    return _SequenceOp.apply(x, _all_gather, _chunk, state.group, state.rank, state.tp)


def _gather_reduce_scatter_grad(x: torch.Tensor, state: SPState) -> torch.Tensor:
    return _SequenceOp.apply(x, _all_gather, _reduce_scatter, state.group, state.rank, state.tp)


# ---- runtime state shared by the hooks ------------------------------------------------------
@dataclass
class SPState:
    """Whether SP is active for the current forward, and each open region's gathered input."""

    group: ProcessGroup
    rank: int
    tp: int
    active: bool = False
    gathered: list[torch.Tensor] = field(default_factory=list)

    def reduce_scatter(self, y: torch.Tensor) -> torch.Tensor:
        return _SequenceOp.apply(y, _reduce_scatter, _all_gather, self.group, self.rank, self.tp)


def _hidden_key(args: tuple, kwargs: dict) -> tuple[str, Any] | None:
    """Where a block's hidden states are: the first positional tensor, ``hidden_states``, or the
    first float keyword tensor."""
    if args and isinstance(args[0], torch.Tensor):
        return ("arg", 0)
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return ("kw", "hidden_states")
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return ("kw", k)
    return None


def _replace(args: tuple, kwargs: dict, key, fn):
    if key[0] == "arg":
        return (fn(args[0]), *args[1:]), kwargs
    return args, {**kwargs, key[1]: fn(kwargs[key[1]])}


class SequenceParallel:
    """Where SP acts in one model, decided from the plan before any style exists.

    ``state`` is shared by every hook and style of the model; `style_sp` maps module names to it
    for the styles that change under SP (column and row layers inside regions, replicated layers
    outside them that see a sequence chunk); `install` adds the block and region hooks."""

    def __init__(self, model: nn.Module, plan: Plan, tp_mesh: DeviceMesh):
        self.state = SPState(tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size())
        self.blocks = repeated_blocks(model)
        names = {id(m): n for n, m in model.named_modules()}
        block_names = [names[id(b)] for b in self.blocks]

        def in_block(name: str) -> bool:
            return any(name == b or name.startswith(b + ".") for b in block_names)

        self.regions = [r for r in tp_regions(model, plan) if in_block(r)]
        styles = {t.name: t.style for t in plan.resolve(model) if t.kind == "module"}
        self.style_sp: dict[str, SPState] = {}
        for name, module in model.named_modules():
            if not any(name.startswith(b + ".") for b in block_names):
                continue
            in_region = any(name.startswith(r + ".") for r in self.regions)
            style = styles.get(name)
            if style is not None and style_spec(style).shard in ("out", "in") and in_region:
                if style_spec(style).role in ("column", "row"):
                    self.style_sp[name] = self.state
            elif (
                style in (None, "replicate")
                and not in_region
                and any(p is not None for p in module._parameters.values())
            ):
                self.style_sp[name] = self.state  # norms on a sequence chunk: partial grads

    def install(self, model: nn.Module) -> SPState:
        """Block and region hooks (see the module docstring)."""
        modules = dict(model.named_modules())
        state = self.state
        for name in self.regions:
            modules[name].register_forward_pre_hook(_region_enter(state), with_kwargs=True)
            modules[name].register_forward_hook(_region_exit(state), always_call=True)
        self.blocks[0].register_forward_pre_hook(_first_block(model, state), with_kwargs=True)
        self.blocks[-1].register_forward_hook(_last_block(state), always_call=True)
        return state


def _first_block(model: nn.Module, state: SPState):
    def hook(module, args, kwargs):
        state.active = torch.is_grad_enabled() and model.training
        key = _hidden_key(args, kwargs) if state.active else None
        if key is None:
            state.active = False
            return None
        x = args[0] if key[0] == "arg" else kwargs[key[1]]
        if x.shape[SEQ_DIM] % state.tp:
            raise ValueError(
                f"sequence_parallel needs the sequence length ({x.shape[SEQ_DIM]}) to be a multiple "
                f"of tp_size={state.tp}; pad the batch (e.g. pad_to_multiple_of={state.tp} in the "
                "tokenizer or data collator)."
            )
        return _replace(args, kwargs, key, lambda t: _scatter(t, state))

    return hook


def _last_block(state: SPState):
    def hook(module, args, output):
        if not state.active:
            return output
        state.active = False
        return map_output(output, lambda y: _gather(y, state))

    return hook


def _region_enter(state: SPState):
    def hook(module, args, kwargs):
        if not state.active:
            return None
        key = _hidden_key(args, kwargs)

        def gather(x):
            full = _gather_reduce_scatter_grad(x, state)
            state.gathered.append(full)
            return full

        return _replace(args, kwargs, key, gather)

    return hook


def _region_exit(state: SPState):
    def hook(module, args, output):
        if state.active and state.gathered:
            state.gathered.pop()
        return output

    return hook
