"""Convolutions split by channels: gathered per layer, or paired like Megatron's linears.

- ``conv_colwise_gather`` (`ConvGatherStyle`): an ``nn.Conv1d`` / ``Conv2d`` / ``Conv3d`` keeps
  its weight ``[out, in / groups, *kernel]`` split on dim 0 (the bias with it), so
  each rank computes its own output channels from the whole input; the channels are then
  all-gathered (uneven counts allowed) into the unsharded output's memory layout. A grouped
  convolution too: its rows padded to whole groups, its input narrowed to them
  (`tpkit.plan.layout.GroupedRows`). Exact like ``colwise_gather_output`` for a linear,
  whatever code follows: each output channel is one rank's whole sum, and the input gradient (a
  sum over output channels) is all-reduced by f. The per-layer fallback's conv style.
- ``conv_colwise`` (`ConvColwiseStyle`): the same split, the output left split on the channel
  dim for the convolution it pairs with (`tpkit.sources.convs`). A transposed convolution's
  weight is ``[in, out / groups, *kernel]``: its output channels are dim 1
  (`tpkit.plan.layout.param_layout`).
- ``conv_packed_colwise`` (`ConvPackedColwiseStyle`): ``conv_colwise`` on output channels
  that a GLU over the channels reads as two halves ``a | b``: each half split separately
  (strided, like ``packed_colwise`` for a fused gate|up linear), so rank r computes ``a_r | b_r``
  and its GLU gives channels r of the result (a conformer's ``pointwise_conv1``).
- ``conv_rowwise`` (`ConvRowwiseStyle`): input channels split (the rank's channels of its
  partner's output, through per-channel ops), a local convolution, the partial sums
  all-reduced (g), the bias added once after, broadcast over the kernel dims. A transposed
  convolution splits dim 0.
- ``norm_channelwise`` (`NormChannelStyle`): BatchNorm / GroupNorm between a pair, on the
  rank's channels: weight and bias split, and BatchNorm's running statistics too (DTensor
  buffers, swapped for their local shards while it runs, so a training step updates the
  rank's part in place and a gathered state dict holds the whole statistics).

Grouped and depthwise convolutions inside a pair take ``channelwise`` with their ``groups``
divided by a fix-up (tp divides the groups, so each rank holds whole groups). Padding of any
``padding_mode`` is per channel, so every split is exact for it. torch's DTensor convolution
gathers or redistributes per op; these keep at most one collective per layer on local tensors,
like the other styles.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tpkit.parallel.comm import gather_from_tp
from tpkit.plan.layout import GroupedRows, chunk_sizes
from tpkit.styles.base import TPStyle, implements, map_output, replace_first_tensor
from tpkit.styles.linear import ColwiseStyle, RowwiseStyle

__all__ = [
    "CONVS",
    "TRANSPOSED_CONVS",
    "ConvColwiseStyle",
    "ConvGatherStyle",
    "ConvPackedColwiseStyle",
    "ConvRowwiseStyle",
    "NormChannelStyle",
]

#: the convolutions these styles run (a subclass keeping ``forward`` is fine)
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED_CONVS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
#: BatchNorm's per-channel buffers (num_batches_tracked is one count, the same on every rank)
_STAT_BUFFERS = ("running_mean", "running_var")


def _check_conv(style: TPStyle, module: nn.Module, transposed_ok: bool) -> None:
    kinds = CONVS + TRANSPOSED_CONVS if transposed_ok else CONVS
    if not isinstance(module, kinds) or module.groups != 1:
        what = "nn.Conv1d/2d/3d" + (" or nn.ConvTranspose1d/2d/3d" if transposed_ok else "")
        groups = f" with groups={module.groups}" if hasattr(module, "groups") else ""
        raise ValueError(
            f"{style.module_name or type(module).__name__}: {style.name} needs an {what} with "
            f"groups=1, got {type(module).__name__}{groups}; leave it whole (replicate), or "
            "use channelwise for a grouped convolution whose input channels are split."
        )


def _channel_dim(y: torch.Tensor, kernel_dims: int) -> int:
    return y.ndim - kernel_dims - 1  # 1 for a batch, 0 for an unbatched input


@implements
class ConvGatherStyle(ColwiseStyle):
    """Y = [conv(X, W_0), ..., conv(X, W_t-1)] along the channel dim (see the module doc).

    A grouped convolution (``groups > 1``) takes the same torch.chunk of its output channels,
    which need not fall on whole groups (17 groups at tp=2): its rows padded with zero rows to
    the whole groups they touch, the input narrowed to those groups' channels (after f, so its
    gradient is whole), and the padded channels dropped before the gather
    (`tpkit.plan.layout.GroupedRows`, which the dry run runs too). The style runs a depthwise
    convolution the same way when a plan names it, but tpkit's own plans leave one read whole
    whole (`tpkit.sources.convs.not_gathered`: a kernel per channel is not worth an all-gather).
    A forward that raises puts the weight shard and ``groups`` back all the same: the output
    hook is always called."""

    name = "conv_colwise_gather"

    def _setup(self, module: nn.Module) -> None:
        if not isinstance(module, CONVS):
            _check_conv(self, module, transposed_ok=False)
        self.sizes = chunk_sizes(module.weight.shape[0], self.tp)
        self.kernel_dims = module.weight.ndim - 2
        self.rows = GroupedRows.of(module, self.tp, self.rank) if module.groups > 1 else None
        self._entered: list[Any] = []

    def _prepare_input(self, module: nn.Module, args: tuple, kwargs: dict):
        args, kwargs = super()._prepare_input(module, args, kwargs)  # f: the input's gradient
        if self.rows is None:
            return args, kwargs
        self._entered.append(self.rows.enter(module))  # the local shards, swapped in already
        kernel = self.kernel_dims
        return replace_first_tensor(args, kwargs, lambda x: self.rows.narrow_input(x, kernel))

    def _prepare_output(self, module: nn.Module, output: Any) -> Any:
        if self.rows is not None and self._entered:
            GroupedRows.leave(module, self._entered.pop())
            kernel = self.kernel_dims
            output = map_output(output, lambda y: self.rows.narrow_output(y, kernel))
        return map_output(output, self._gather)

    def _gather(self, y: torch.Tensor) -> torch.Tensor:
        channel = _channel_dim(y, self.kernel_dims)
        last = y.movedim(channel, -1).contiguous()
        whole = gather_from_tp(last, self.sizes, self.rank, self.group).movedim(-1, channel)
        # the unsharded convolution's memory layout: code after it (GroupNorm, the next
        # convolution) then sums in the same order, so its numbers match bit for bit. Channels
        # last only where this rank's output is (a channels-last input's); a grouped one's
        # rows narrowed out of their padding are neither, and unsharded they are contiguous
        fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(y.ndim)
        last_layout = (
            fmt is not None and not y.is_contiguous() and y.is_contiguous(memory_format=fmt)
        )
        return whole if last_layout else whole.contiguous()


@implements
class ConvColwiseStyle(ColwiseStyle):
    """Y_i = conv(X, W_i) + b_i: this rank's output channels, left split for the paired
    ``conv_rowwise``; f on X (each rank's input gradient is a partial sum over its channels)."""

    name = "conv_colwise"

    def _setup(self, module: nn.Module) -> None:
        _check_conv(self, module, transposed_ok=True)


@implements
class ConvPackedColwiseStyle(ConvColwiseStyle):
    """``conv_colwise`` with the output channels split per packed half (the catalogue's
    ``packed_parts=2`` lays the weight and bias out as two strided parts): this rank's
    ``a_r | b_r``, so a GLU over the channels pairs them as the unsplit one does."""

    name = "conv_packed_colwise"


@implements
class ConvRowwiseStyle(RowwiseStyle):
    """Y = sum_i conv(X_i, W_i) + b: the rank's input channels, partial sums all-reduced, the
    bias added once after the reduction, on the channel dim (see the module doc)."""

    name = "conv_rowwise"

    def _setup(self, module: nn.Module) -> None:
        _check_conv(self, module, transposed_ok=True)
        self.kernel_dims = module.weight.ndim - 2

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        self._swap_in(module)
        self._bias.append(module._parameters.get("bias"))
        module._parameters["bias"] = None  # F.conv*d take None: added once, after g
        return args, kwargs

    def _reduce_output(self, output: Any, bias: torch.Tensor | None) -> Any:
        if bias is not None:
            bias = bias.reshape(-1, *[1] * self.kernel_dims)  # broadcast over the kernel dims
        return super()._reduce_output(output, bias)


@implements
class NormChannelStyle(TPStyle):
    """BatchNorm / GroupNorm on the rank's channels (see the module doc). GroupNorm's
    ``num_groups`` is divided by the plan's fix-up; BatchNorm's statistics are per channel, so
    training mode is exact too (each rank sees every sample of its channels)."""

    name = "norm_channelwise"

    def _setup(self, module: nn.Module) -> None:
        if not isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm)):
            raise ValueError(
                f"{self.module_name or type(module).__name__}: norm_channelwise needs an "
                f"nn.BatchNorm1d/2d/3d or nn.GroupNorm, got {type(module).__name__}; leave it "
                "whole (replicate)."
            )
        self._saved_buffers: list[dict[str, DTensor]] = []
        for bname in _STAT_BUFFERS:
            buf = module._buffers.get(bname)
            if buf is not None and not isinstance(buf, DTensor):
                module._buffers[bname] = _shard_buffer(buf, self.mesh)

    def _swap_in(self, module: nn.Module) -> None:
        super()._swap_in(module)
        buffers = module._buffers
        saved = {n: b for n, b in buffers.items() if isinstance(b, DTensor)}
        for n, b in saved.items():
            buffers[n] = b._local_tensor  # updated in place by a training step: the shard
        self._saved_buffers.append(saved)

    def _swap_out(self, module: nn.Module) -> None:
        super()._swap_out(module)
        if self._saved_buffers:
            module._buffers.update(self._saved_buffers.pop())


def _shard_buffer(buf: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """``buf`` split on dim 0 (torch.chunk sizes, like the weight), each rank slicing its own
    copy (no communication; tpkit requires the same weights and buffers on every rank)."""
    dt = distribute_tensor(buf.detach(), mesh, [Shard(0)], src_data_rank=None)
    local = dt.to_local().clone()  # own memory: a chunk is a view of the whole buffer
    return DTensor.from_local(
        local, mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride()
    )
