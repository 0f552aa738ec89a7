"""Convolutions split by output channels, their output gathered on the channel dim.

``conv_colwise_gather``: an ``nn.Conv1d`` / ``Conv2d`` / ``Conv3d`` with ``groups=1`` keeps its
weight ``[out, in, *kernel]`` split on dim 0 (the bias with it), so each rank computes its own
output channels from the whole input; the channels are then all-gathered (uneven counts
allowed). Exact like ``colwise_gather_output`` for a linear, whatever code follows: each output
channel is one rank's whole sum, and the input gradient (a sum over output channels) is
all-reduced by f. ``groups > 1`` would map a rank's channels to the wrong input groups, so the
fallback (`tpkit.plan.fallback`) leaves those whole. torch's DTensor convolution gathers or
redistributes per op; this keeps one gather per layer on local tensors, like the other styles.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpkit.dist.comm import gather_from_tp
from tpkit.plan.layout import chunk_sizes
from tpkit.styles.base import map_output
from tpkit.styles.linear import ColwiseStyle

__all__ = ["ConvGatherStyle"]


class ConvGatherStyle(ColwiseStyle):
    """Y = [conv(X, W_0), ..., conv(X, W_t-1)] along the channel dim (see the module doc)."""

    name = "conv_colwise_gather"

    def _setup(self, module: nn.Module) -> None:
        if not isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) or module.groups != 1:
            raise ValueError(
                f"{self.module_name or type(module).__name__}: conv_colwise_gather needs an "
                f"nn.Conv1d/2d/3d with groups=1, got {type(module).__name__}"
                f"{f' with groups={module.groups}' if hasattr(module, 'groups') else ''}; "
                "leave it whole (replicate)."
            )
        self.sizes = chunk_sizes(module.weight.shape[0], self.tp)
        self.kernel_dims = module.weight.ndim - 2

    def _prepare_output(self, module: nn.Module, output: Any) -> Any:
        return map_output(output, self._gather)

    def _gather(self, y: torch.Tensor) -> torch.Tensor:
        channel = y.ndim - self.kernel_dims - 1  # 1 for a batch, 0 for an unbatched input
        last = y.movedim(channel, -1).contiguous()
        return gather_from_tp(last, self.sizes, self.rank, self.group).movedim(-1, channel)
