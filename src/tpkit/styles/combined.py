"""Styles for modules whose parameters are split by their own entries, and partial gradients.

- `AllReduceStyle`: parameters as their own entries say (Inkling's shared experts: gate/up
  colwise, down rowwise) on replicated inputs: f on every float input (their gradients are
  partial per rank), g on the output.
- `MoeExpertsStyle`: the same for fused MoE experts: every expert runs its own shards, the
  summed outputs are all-reduced once; a replicated ``down_proj_bias`` enters as bias / tp.
- `MoeReducedInputStyle`: a module with parameters inside those experts that reads their summed
  output (Ergo's per-expert RMSNorm): its input is all-reduced before it runs, so the experts'
  output is whole and only rank 0 hands its gradient back (see `MoeExpertsStyle`).
- `MoeIdentityExpertStyle`: a parameter-free expert inside those experts: input / tp, since the
  experts' all-reduce adds tp copies of it.
- `TailGradAllReduceStyle`: replicated, with the gradient of the last ``tail`` output features
  all-reduced (MLA's rope key, which goes straight into the rank's heads).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tpkit.parallel.comm import copy_to_tp, reduce_from_tp
from tpkit.styles.base import (
    ReplicateGradAllReduceStyle,
    TPStyle,
    implements,
    map_output,
    replace_first_tensor,
    style_of,
)

__all__ = [
    "AllReduceStyle",
    "MoeExpertsStyle",
    "MoeIdentityExpertStyle",
    "MoeReducedInputStyle",
    "TailGradAllReduceStyle",
]


@implements
class AllReduceStyle(TPStyle):
    """Y = g(f_inputs -> module): see the module docstring. transformers' ``all_reduce`` style
    has only the g, which leaves the inputs' gradients (the residual stream's, a router's
    gammas') partial."""

    name = "all_reduce"

    def _prepare_input(self, module: nn.Module, args: tuple, kwargs: dict):
        def f(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return copy_to_tp(v, self.group)
            return v

        return tuple(f(a) for a in args), {k: f(v) for k, v in kwargs.items()}

    def _prepare_output(self, module: nn.Module, output: Any) -> Any:
        return map_output(output, lambda y: reduce_from_tp(y, self.group))


@implements
class MoeExpertsStyle(AllReduceStyle):
    """Experts whose weights are split by their own parameter entries (gate_up packed_colwise,
    down rowwise): every float input gets f, the summed output g. A replicated
    ``down_proj_bias`` (GPT-OSS) is added inside every rank's partial sum, so it enters as
    bias / tp (exact for power-of-two tp) with its gradient summed over the group."""

    name = "moe_tp_experts"

    def _setup(self, module: nn.Module) -> None:
        w, b = module._parameters.get("down_proj"), module._parameters.get("down_proj_bias")
        sharded = isinstance(w, DTensor) and any(p.is_shard() for p in w.placements)
        self.scale_down_bias = sharded and isinstance(b, DTensor)
        self._reduced_inside: bool | None = None  # read at the first forward: children's styles

    def reduced_inside(self, module: nn.Module) -> bool:
        """A module inside reads the summed output (`MoeReducedInputStyle`): its input was
        all-reduced there, so the output is whole already. It is then identical on every rank,
        and so is every gradient computed from it (the norm's, a routing weight applied after
        it); the input f would sum tp copies of those. Only rank 0 hands the output's gradient
        back (the others give zeros, summed exactly): the reduced input's backward all-reduces
        it for every rank's share of the experts, f sums the inputs' shares, the norm's weight
        gradient all-reduce sums rank 0's with zeros. Exact for any tp, whatever mix of the
        inputs is used before and after the reduction."""
        if self._reduced_inside is None:
            self._reduced_inside = any(
                isinstance(style_of(m), MoeReducedInputStyle) for m in module.modules()
            )
        return self._reduced_inside

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        out = super()._pre_hook(module, args, kwargs)
        if self.scale_down_bias:
            b = module._parameters["down_proj_bias"]  # the local tensor, swapped in
            if torch.is_grad_enabled() and b.requires_grad:
                b = copy_to_tp(b, self.group)
            module._parameters["down_proj_bias"] = b / self.tp
        return out

    def _prepare_output(self, module: nn.Module, output: Any) -> Any:
        if not self.reduced_inside(module):
            return super()._prepare_output(module, output)
        if not torch.is_grad_enabled() or self.rank == 0:
            return output
        return map_output(output, _NoGrad.apply)


class _NoGrad(torch.autograd.Function):
    """Identity forward; a zero gradient backward (rank > 0's share of a whole output whose
    gradient rank 0 hands back alone)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(grad)


@implements
class MoeReducedInputStyle(ReplicateGradAllReduceStyle):
    """A module with parameters inside ``moe_tp_experts`` that runs on the experts' summed
    output (Ergo's per-expert RMSNorm after each route's down projection): a norm of a partial
    sum is not the norm of the sum, so its input is all-reduced first, forward and backward
    (the experts' module hands the output's gradient back on rank 0 alone, see
    `MoeExpertsStyle.reduced_inside`, so the backward sum gives every rank the whole gradient
    for its slice of the experts). Its parameters are replicated, their gradient all-reduced.
    The alternative, the statistics all-reduced over split features, does not apply: each rank
    holds every feature, partially summed."""

    name = "moe_reduced_input"
    local_in_model = True
    nograd_identity = False  # its input's all-reduce runs without grad too

    def _prepare_input(self, module: nn.Module, args: tuple, kwargs: dict):
        def reduce(x: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled():
                x = copy_to_tp(x, self.group)  # backward: the all-reduce of rank 0's gradient
            return reduce_from_tp(x, self.group)

        return replace_first_tensor(args, kwargs, reduce)


@implements
class MoeIdentityExpertStyle(TPStyle):
    """A parameter-free expert (LongCat-Flash's zero-computation ``identity_expert``) inside
    ``moe_tp_experts``: every rank computes the same output and the experts' g sums tp copies,
    so the input is divided by tp here (exact for power-of-two tp), as transformers does."""

    name = "moe_identity_expert"

    def _prepare_input(self, module: nn.Module, args: tuple, kwargs: dict):
        return replace_first_tensor(args, kwargs, lambda x: x / self.tp)


@implements
class TailGradAllReduceStyle(TPStyle):
    """Replicated; output [head part | tail] with the tail's gradient all-reduced (f). MLA's
    ``kv_a_proj_with_mqa`` outputs [kv latent | rope key]: the latent feeds a column-parallel
    ``kv_b_proj`` (whose f sums its gradient), the rope key goes straight into this rank's
    heads, so each rank's gradient for it is partial. ``tail``: its width (transformers'
    ``mla_kv_a_proj`` reads ``qk_rope_head_dim``; inference reads the traced cut)."""

    name = "tail_grad_allreduce"

    def __init__(self, *, tail: int = 0, **options: Any) -> None:
        super().__init__(**options)
        self.tail = int(tail)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", tail={self.tail}"

    def _prepare_output(self, module: nn.Module, output: Any) -> Any:
        if not self.tail:
            return output

        def fix(y: torch.Tensor) -> torch.Tensor:
            head, tail = y.split([y.shape[-1] - self.tail, self.tail], dim=-1)
            return torch.cat([head, copy_to_tp(tail, self.group)], dim=-1)

        return map_output(output, fix)
