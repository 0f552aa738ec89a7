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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from tpkit.fsdp import repeated_blocks
from tpkit.plan.spec import Plan

COLUMN_STYLES = ("colwise", "packed_colwise", "packed_qkv_colwise")
ROW_STYLES = ("rowwise", "packed_rowwise")
SEQ_DIM = 1


# ---- collectives along the sequence dimension ------------------------------------------------
def _all_gather(x: torch.Tensor, group: ProcessGroup, tp: int) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=SEQ_DIM)


def _chunk(x: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = x.shape[SEQ_DIM] // tp
    return x.narrow(SEQ_DIM, rank * n, n).contiguous()


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup, rank: int, tp: int) -> torch.Tensor:
    if dist.get_backend(group) == "nccl":
        moved = x.movedim(SEQ_DIM, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // tp, *moved.shape[1:]))
        dist.reduce_scatter_tensor(out, moved, group=group)
        return out.movedim(0, SEQ_DIM)
    x = x.contiguous().clone()  # gloo has no reduce-scatter: all-reduce, keep our chunk
    dist.all_reduce(x, group=group)
    return _chunk(x, rank, tp)


class _Scatter(torch.autograd.Function):
    """Keep this rank's chunk; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group, rank, tp):
        ctx.args = (group, tp)
        return _chunk(x, rank, tp)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, *ctx.args), None, None, None


class _Gather(torch.autograd.Function):
    """All-gather; backward keeps this rank's chunk (the gradient is already whole everywhere)."""

    @staticmethod
    def forward(ctx, x, group, rank, tp):
        ctx.args = (rank, tp)
        return _all_gather(x, group, tp)

    @staticmethod
    def backward(ctx, grad):
        return _chunk(grad, *ctx.args), None, None, None


class _GatherReduceScatterGrad(torch.autograd.Function):
    """All-gather; backward reduce-scatters (the column layers' input gradients are partial)."""

    @staticmethod
    def forward(ctx, x, group, rank, tp):
        ctx.args = (group, rank, tp)
        return _all_gather(x, group, tp)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, *ctx.args), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Reduce-scatter; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group, rank, tp):
        ctx.args = (group, tp)
        return _reduce_scatter(x, group, rank, tp)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, *ctx.args), None, None, None


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
        return _ReduceScatter.apply(y, self.group, self.rank, self.tp)


def _hidden_key(args: tuple, kwargs: dict) -> tuple[str, Any] | None:
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


def _map_first(output: Any, fn) -> Any:
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (fn(output[0]), *output[1:])
    return output


# ---- checks (pure, before any collective) ---------------------------------------------------
def sequence_parallel_problems(model: nn.Module, plan: Plan) -> list[str]:
    """Why SP cannot apply to this model, if it cannot (empty list when it can)."""
    problems = []
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        problems.append(
            f"sequence_parallel supports decoder-only models; {type(model).__name__} is an "
            "encoder-decoder (its cross-attention reads the encoder's whole sequence). Use "
            "sequence_parallel=False."
        )
    moe = [t.name for t in plan.resolve(model) if t.style == "moe_tp_experts"]
    if moe:
        problems.append(
            f"sequence_parallel does not support tensor-parallel MoE experts ({moe[0]}); use "
            "sequence_parallel=False."
        )
    if not repeated_blocks(model):
        problems.append(
            f"sequence_parallel needs repeated blocks (an nn.ModuleList) in {type(model).__name__}."
        )
    styles = {t.name: t.style for t in plan.resolve(model) if t.kind == "module"}
    regions = {n.rsplit(".", 1)[0] for n, s in styles.items() if s in COLUMN_STYLES and "." in n}
    apart = [
        n
        for n, s in styles.items()
        if s in ROW_STYLES and (n.rsplit(".", 1)[0] if "." in n else "") not in regions
    ]
    if apart:
        problems.append(
            f"sequence_parallel needs every row-parallel layer in the same module as the column "
            f"layers feeding it (Llama's self_attn, mlp), so that the module's output is the "
            f"sequence chunk; {type(model).__name__}'s {apart[0]} is not (a post-norm block whose "
            "residual add sits in a module of its own). Use sequence_parallel=False."
        )
    return problems


# ---- installation ---------------------------------------------------------------------------
def install_sequence_parallel(model: nn.Module, plan: Plan, tp_mesh: DeviceMesh) -> SPState:
    """Turn the applied TP styles of every block into their SP variants (see module docstring)."""
    state = SPState(tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size())
    blocks = repeated_blocks(model)
    modules = dict(model.named_modules())
    names = {id(m): n for n, m in modules.items()}
    block_names = [names[id(b)] for b in blocks]
    styles = {t.name: t.style for t in plan.resolve(model) if t.kind == "module"}
    regions = {}
    for name, style in styles.items():
        if style in COLUMN_STYLES and "." in name:
            parent = name.rsplit(".", 1)[0]
            if any(parent == b or parent.startswith(b + ".") for b in block_names):
                regions.setdefault(parent, modules[parent])
    for name, module in modules.items():
        obj = module.__dict__.get("_tpkit_style_obj")
        in_block = any(name.startswith(b + ".") for b in block_names)
        if obj is None or not in_block:
            continue
        in_region = any(name.startswith(r + ".") for r in regions)
        if obj.name in (*COLUMN_STYLES, *ROW_STYLES) and in_region:
            obj.sp = state
        elif obj.name == "replicate" and not in_region:
            obj.sp_grad_allreduce = state  # norms on a sequence chunk: partial gradients
    for region in regions.values():
        region.register_forward_pre_hook(_region_enter(state), with_kwargs=True)
        region.register_forward_hook(_region_exit(state), always_call=True)
    blocks[0].register_forward_pre_hook(_first_block(model, state), with_kwargs=True)
    blocks[-1].register_forward_hook(_last_block(state), always_call=True)
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
        return _replace(
            args, kwargs, key, lambda t: _Scatter.apply(t, state.group, state.rank, state.tp)
        )

    return hook


def _last_block(state: SPState):
    def hook(module, args, output):
        if not state.active:
            return output
        state.active = False
        return _map_first(output, lambda y: _Gather.apply(y, state.group, state.rank, state.tp))

    return hook


def _region_enter(state: SPState):
    def hook(module, args, kwargs):
        if not state.active:
            return None
        key = _hidden_key(args, kwargs)

        def gather(x):
            full = _GatherReduceScatterGrad.apply(x, state.group, state.rank, state.tp)
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
