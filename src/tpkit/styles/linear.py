"""Column and row styles: Megatron's split of a linear (or GPT-2 Conv1D, or 3-D experts).

X is the input, W the weight split over ranks i, t the tp size:

- `ColwiseStyle`:           Y_i = X W_i, output features split; f on X (its gradient is summed)
- `PackedColwiseStyle`:     the same for a fused [gate; up] (each part split separately)
- `PackedQKVColwiseStyle`:  the same for a fused [q; k; v] (GPT-2 ``c_attn``)
- `ReplicatedHeadsColwiseStyle`: KV heads fewer than tp: the whole weight, this rank's head
- `GatherOutputStyle`:      Y = [X W_0, ..., X W_t-1], all-gathered (the lm_head); uneven ok
- `RowwiseStyle`:           Y = sum_i X_i W_i + b, one all-reduce (g), the bias added once after
- `PackedRowwiseStyle`:     the same with the input features split per packed part
- `RowwiseSplitInputStyle`: rowwise on a replicated input: f, then this rank's slice of X
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from tpkit.parallel.comm import copy_to_tp, gather_from_tp, reduce_from_tp
from tpkit.plan.layout import chunk_offset, chunk_sizes, param_layout
from tpkit.styles.base import TPStyle, first_tensor, implements, map_output, replace_first_tensor

__all__ = [
    "ColwiseStyle",
    "GatherOutputStyle",
    "PackedColwiseStyle",
    "PackedQKVColwiseStyle",
    "PackedRowwiseStyle",
    "ChannelwiseStyle",
    "RowwiseFeedsSplitStyle",
    "RowwiseSplitInputStyle",
    "ReplicatedHeadsColwiseStyle",
    "RowwiseStyle",
]


@implements
class ColwiseStyle(TPStyle):
    """Y_i = X W_i: this rank's output features; f on X (identity forward, gradient all-reduced:
    each rank's input gradient is a partial sum over its columns). Under sequence parallelism
    X is the region's all-gathered input, whose backward reduce-scatters instead."""

    name = "colwise"
    nograd_identity = True  # f is the identity without autograd

    def _prepare_input(self, module: nn.Module, args: tuple, kwargs: dict):
        sp = self.sp if self.sp is not None and self.sp.active else None
        if sp is None and not torch.is_grad_enabled():
            return args, kwargs  # f is the identity without autograd
        key = first_tensor(args, kwargs)
        if key is None:
            return args, kwargs
        if sp is not None:
            x = args[0] if key[0] == "arg" else kwargs[key[1]]
            if sp.gathered and x is sp.gathered[-1]:
                return args, kwargs  # the region's gather reduce-scatters our partial grads
            raise ValueError(
                f"sequence_parallel: {type(module).__name__} ({self.name}) received a tensor its "
                "region did not gather (the region transforms its input before this layer); "
                "this architecture does not support sequence_parallel=True."
            )
        return replace_first_tensor(args, kwargs, lambda x: copy_to_tp(x, self.group))


@implements
class PackedColwiseStyle(ColwiseStyle):
    """Colwise on a fused [gate; up]: each of the 2 parts split separately (strided), so the
    code's ``chunk(2)`` still pairs this rank's gate rows with its up rows."""

    name = "packed_colwise"
    nograd_identity = True


@implements
class PackedQKVColwiseStyle(ColwiseStyle):
    """Colwise on a fused [q; k; v] (GPT-2's ``c_attn``): each of the 3 parts split separately."""

    name = "packed_qkv_colwise"
    nograd_identity = True


@implements
class ReplicatedHeadsColwiseStyle(ColwiseStyle):
    """KV heads fewer than tp (`tpkit.settle.kvheads`): the weight stays whole on every rank and
    this rank computes only KV head ``rank * heads // tp``, the one its query heads read. f on
    X as in colwise; the weight's gradient is all-reduced, since the tp / heads ranks sharing
    a head each add their own queries' share (the others add zeros to its rows)."""

    name = "colwise_replicated_heads"
    nograd_identity = True
    grad_allreduce = True

    def __init__(self, *, heads: int = 1, **options: Any) -> None:
        super().__init__(**options)
        self.heads = int(heads)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", heads={self.heads}"

    def _setup(self, module: nn.Module) -> None:
        w = module._parameters["weight"]
        self.dim = param_layout("colwise", "weight", w.ndim, module).dim
        width = w.shape[self.dim] // self.heads
        self.start = (self.rank * self.heads // self.tp) * width
        self.width = width

    def _swap_in(self, module: nn.Module) -> None:
        super()._swap_in(module)
        params = module._parameters
        params["weight"] = params["weight"].narrow(self.dim, self.start, self.width)
        if params.get("bias") is not None:
            params["bias"] = params["bias"].narrow(0, self.start, self.width)


@implements
class GatherOutputStyle(ColwiseStyle):
    """Y = [X W_0, ..., X W_t-1]: output features split, then all-gathered along the last dim
    (uneven splits exact: GPT-2's 50257-token vocabulary). With ``loss_parallel`` (training
    only) the logits are handed on vocab-sharded as a ``Shard(-1)`` DTensor instead, for the
    vocab-parallel cross-entropy (`tpkit.training.loss`)."""

    name = "colwise_gather_output"

    def __init__(self, *, loss_parallel: bool = False, **options: Any) -> None:
        super().__init__(**options)
        self.loss_parallel = loss_parallel

    def _setup(self, module: nn.Module) -> None:
        w = module._parameters["weight"]
        layout = param_layout(self.name, "weight", w.ndim, module)
        self.sizes = chunk_sizes(w.shape[layout.dim], self.tp)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", loss_parallel" if self.loss_parallel else "")

    def _prepare_output(self, module: nn.Module, output: Any) -> Any:
        if self.loss_parallel and torch.is_grad_enabled():
            return map_output(output, self._as_vocab_shard)
        return map_output(output, lambda y: gather_from_tp(y, self.sizes, self.rank, self.group))

    def _as_vocab_shard(self, y: torch.Tensor) -> DTensor:
        shape = (*y.shape[:-1], sum(self.sizes))
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            y, self.mesh, [Shard(y.ndim - 1)], run_check=False, shape=shape, stride=stride
        )


@implements
class RowwiseStyle(TPStyle):
    """Y = sum_i X_i W_i + b: this rank's input features, partial sums all-reduced (g), the bias
    added once after the reduction (not on every rank before it). Under sequence parallelism the
    reduction is a reduce-scatter along the sequence.

    `defer` holds the next reduction back for a wrapper that adds its own partial sums first
    (LoRA on a row-parallel base, `tpkit.integrations.lora`): the output comes back unreduced
    and the wrapper finishes it with `finish_deferred` (g, then the bias): one all-reduce.
    """

    name = "rowwise"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._bias: list[torch.Tensor | None] = []
        self._deferred_bias: list[torch.Tensor | None] = []
        self._defer = False

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        self._swap_in(module)
        bias = module._parameters.get("bias")
        self._bias.append(bias)
        if bias is not None:
            module._parameters["bias"] = None if isinstance(module, nn.Linear) else bias * 0
        return args, kwargs

    def _prepare_output(self, module: nn.Module, output: Any) -> Any:
        bias = self._bias.pop() if self._bias else None
        if self._defer:
            self._deferred_bias.append(bias)
            return output
        return self._reduce_output(output, bias)

    def defer(self) -> None:
        """The next call returns its partial sums unreduced (see the class doc)."""
        self._defer = True

    def finish_deferred(self, output: Any) -> Any:
        """g and the bias for the output `defer` left unreduced."""
        self._defer = False
        return self._reduce_output(output, self._deferred_bias.pop())

    def drop_deferred(self) -> None:
        """Forget a deferred call whose forward raised."""
        self._defer = False
        if self._deferred_bias:
            self._deferred_bias.pop()

    def _reduce_output(self, output: Any, bias: torch.Tensor | None) -> Any:
        sp = self.sp if self.sp is not None and self.sp.active else None

        def reduce(y: torch.Tensor) -> torch.Tensor:
            if sp is None:
                y = reduce_from_tp(y, self.group)
                return y + bias if bias is not None else y
            y = sp.reduce_scatter(y)  # each rank keeps its sequence chunk
            return y + copy_to_tp(bias, self.group) if bias is not None else y

        return map_output(output, reduce)


@implements
class PackedRowwiseStyle(RowwiseStyle):
    """Rowwise with the input features split per packed part (2, strided): transposed fused
    experts' ``gate_up_proj``, named by raw dims as in transformers' plans."""

    name = "packed_rowwise"


@implements
class RowwiseFeedsSplitStyle(RowwiseStyle):
    """Rowwise whose reduced output is then read by every rank's own channels (Mamba's
    ``x_proj`` -> dt, B, C): each rank's gradient for it is partial, so f follows g."""

    name = "rowwise_feeds_split"

    def _reduce_output(self, output: Any, bias: torch.Tensor | None) -> Any:
        reduced = super()._reduce_output(output, bias)
        return map_output(reduced, lambda y: copy_to_tp(y, self.group))


@implements
class ChannelwiseStyle(TPStyle):
    """This rank's channels in and out, no collective (a depthwise conv, a per-channel
    projection on split activations): parameters split by output channel, and its parent may
    read them directly (Mamba's ``F.conv1d(x, self.conv1d.weight)``, ``dt_proj.weight @ t``)."""

    name = "channelwise"
    read_by_parent = True
    nograd_identity = True


@implements
class RowwiseSplitInputStyle(RowwiseStyle):
    """Rowwise on a replicated input (transformers' ``rowwise_split_input``): f, then this
    rank's slice of the input's last dim, then the rowwise product and g."""

    name = "rowwise_split_input"

    def _setup(self, module: nn.Module) -> None:
        w = module._parameters["weight"]
        width = w.shape[param_layout(self.name, "weight", w.ndim, module).dim]
        self.start = chunk_offset(width, self.tp, self.rank)
        self.size = chunk_sizes(width, self.tp)[self.rank]

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        args, kwargs = super()._pre_hook(module, args, kwargs)

        def mine(x: torch.Tensor) -> torch.Tensor:
            return copy_to_tp(x, self.group)[..., self.start : self.start + self.size]

        return replace_first_tensor(args, kwargs, mine)
