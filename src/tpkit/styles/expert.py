"""Expert parallelism on a routed experts module: whole experts per rank, tokens sent to them.

`ExpertParallelStyle` (``ep_experts``) is applied on the expert-parallel (EP) mesh, not the TP
mesh. Every parameter under the module whose first dim counts experts (``[E, ...]``, or DBRX's
``[E * F, H]``) is split along it, ``Shard(0)``: rank r holds whole experts, torch.chunk sizes of
E (`tpkit.parallel.expert.comm.ExpertPlacement`). Any other parameter under it stays replicated,
its gradient summed over the EP group (each rank backpropagates its own pairs only).

The module keeps its class and ``forward``. Its call ``(hidden [.., H], index [T, K], weights
[T, K])`` is rewritten by the forward pre-hook into this rank's pairs: their tokens, their local
expert ids (``[R, 1]``) and routing weights, with the module's expert count attributes set to
its local count and its parameters swapped for the local experts; the forward hook sends the
weighted pair outputs back and sums them per token (`tpkit.parallel.expert.comm`). The model's
own code computes every pair, with its own weights, exactly as it does unsharded.

A rank that receives no pair runs its experts on one dummy row built from the (empty) received
tokens and drops its output: its expert parameters get zero gradients (not None, which FSDP
would reduce differently) and the backward collectives run on every rank alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tpkit.parallel.expert.comm import (
    AllReduceDispatch,
    AllToAllDispatch,
    Dispatched,
    ExpertPlacement,
    GroupedAllGather,
    GroupedAllToAll,
)
from tpkit.plan.layout import REPLICATED, ParamLayout
from tpkit.styles.base import RECORD, TPStyle, distribute_param, implements, map_output

__all__ = ["IMPLEMENTATIONS", "ExpertParallelStyle", "GroupedExpertsStyle", "routed_call"]

#: ``ep_implementation`` values (transformers' spelling): how pairs reach their experts.
IMPLEMENTATIONS = ("auto", "all_to_all", "all_reduce")


def routed_call(args: tuple, kwargs: dict) -> tuple[tuple[str, Any], ...] | None:
    """Where a routed experts call keeps its hidden states, expert ids and routing weights:
    the first floating tensor, the first integer tensor, and the floating tensor shaped like the
    ids (``("arg", i)`` or ``("kw", name)`` each); None when the call is not of that form."""
    found = [(("arg", i), v) for i, v in enumerate(args)]
    found += [(("kw", k), v) for k, v in kwargs.items()]
    tensors = [(key, v) for key, v in found if isinstance(v, torch.Tensor)]
    hidden = next((k for k, v in tensors if v.is_floating_point()), None)
    index = next(((k, v) for k, v in tensors if not v.is_floating_point() and v.ndim == 2), None)
    if hidden is None or index is None:
        return None
    weights = next(
        (
            k
            for k, v in tensors
            if k != hidden and v.is_floating_point() and v.shape == index[1].shape
        ),
        None,
    )
    return None if weights is None else (hidden, index[0], weights)


def _get(args: tuple, kwargs: dict, key: tuple[str, Any]) -> Any:
    return args[key[1]] if key[0] == "arg" else kwargs[key[1]]


def _put(args: tuple, kwargs: dict, values: dict) -> tuple[tuple, dict]:
    args = list(args)
    kwargs = dict(kwargs)
    for (kind, k), v in values.items():
        if kind == "arg":
            args[k] = v
        else:
            kwargs[k] = v
    return tuple(args), kwargs


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``scale`` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad * ctx.scale, None


@implements
class ExpertParallelStyle(TPStyle):
    """Whole experts per EP rank, each pair computed where its expert lives (module docstring).

    Options: ``num_experts`` (E), ``params`` (the dotted names under the module whose first
    dim counts experts; the others stay replicated), ``count_attrs`` (dotted ``sub.attr`` names under the module
    holding E, set to the local count while it runs: a forward that sizes by them),
    ``implementation`` (`IMPLEMENTATIONS`; ``auto``: all-reduce where the EP group holds one
    batch, all-to-all otherwise), ``batch_mesh`` (the ranks that hold the same tokens as this
    one: the TP group; None or size 1 for none)."""

    name = "ep_experts"

    def __init__(
        self,
        *,
        num_experts: int,
        params: tuple[str, ...] = (),
        count_attrs: tuple[str, ...] = (),
        implementation: str = "auto",
        batch_mesh: DeviceMesh | None = None,
        grad_scale: float = 1.0,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.grad_scale = float(grad_scale)
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"ep_implementation={implementation!r}: use one of {', '.join(IMPLEMENTATIONS)}."
            )
        self.num_experts = int(num_experts)
        self.count_attrs = tuple(count_attrs)
        self.expert_params = frozenset(params)
        self.implementation = implementation
        self.batch_mesh = batch_mesh if batch_mesh is not None and batch_mesh.size() > 1 else None
        self._calls: list[tuple[Dispatched, Any, torch.Size, bool]] = []
        self._attrs_saved: list[dict] = []

    # -- layout -----------------------------------------------------------------------------
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.mesh, self.group = device_mesh, device_mesh.get_group()
        self.tp, self.rank = device_mesh.size(), device_mesh.get_local_rank()
        self.placement = ExpertPlacement(self.num_experts, self.tp)
        self.local_count = self.placement.sizes[self.rank]
        self._holders: list[tuple[nn.Module, str, str]] = []
        for name in [n for n, _ in module.named_parameters()]:  # names: no weight held here
            owner_name, _, pname = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            layout = ParamLayout(0) if name in self.expert_params else REPLICATED
            if not layout.sharded:
                self.allreduce_params |= {name}
            distribute_param(owner, pname, layout, device_mesh, self.src_data_rank)
            self._holders.append((owner, pname, name))
        self.dispatchers = self._dispatchers()
        module.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        module.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True)
        module.__dict__[RECORD] = self
        return module

    def _dispatchers(self) -> dict[str, Any]:
        """The dispatch each implementation uses on this rank (all-reduce only where the EP
        group holds one batch: its members' tokens must be the same)."""
        shared = self.batch_mesh is not None and self.batch_mesh.size() == self.tp
        batch = None
        if self.batch_mesh is not None:
            batch = (
                self.batch_mesh.get_group(),
                self.batch_mesh.size(),
                self.batch_mesh.get_local_rank(),
            )
        out: dict[str, Any] = {
            "all_to_all": AllToAllDispatch(self.placement, self.group, self.rank, batch)
        }
        if shared:
            out["all_reduce"] = AllReduceDispatch(self.placement, self.group, self.rank)
        if self.implementation == "all_reduce" and not shared:
            raise ValueError(
                f"ep_implementation='all_reduce' needs every rank of the expert-parallel group "
                f"(ep={self.tp}) to hold the same tokens (ep_size == tp_size); use "
                "'all_to_all' or 'auto'."
            )
        return out

    def dispatcher(self) -> Any:
        """The dispatch this call uses: the one asked for, or for ``auto`` all-reduce where the
        EP group holds one batch (each rank computes only its own pairs either way, so it moves
        no tokens and reads no count back), all-to-all otherwise."""
        if self.implementation == "auto":
            return self.dispatchers.get("all_reduce") or self.dispatchers["all_to_all"]
        return self.dispatchers[self.implementation]

    def extra_repr(self) -> str:
        r = self.placement.local(self.rank)
        parts = [
            f"ep={self.name}",
            f"experts {r.start}-{r.stop - 1} of {self.num_experts} on rank {self.rank}/{self.tp}",
            self.implementation,
        ]
        return ", ".join(parts)

    # -- hooks ------------------------------------------------------------------------------
    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        keys = routed_call(args, kwargs)
        if keys is None:
            raise TypeError(
                f"{type(module).__name__} under expert parallelism expects (hidden_states, "
                "expert ids [T, K], routing weights [T, K]); got "
                f"{[type(a).__name__ for a in args]} and {sorted(kwargs)}."
            )
        hidden, index, weights = (_get(args, kwargs, k) for k in keys)
        if isinstance(hidden, DTensor):
            hidden = hidden.to_local()
        shape = hidden.shape
        flat = hidden.reshape(-1, shape[-1])
        if flat.shape[0] != index.shape[0]:
            raise ValueError(
                f"{type(module).__name__}: {flat.shape[0]} token rows but expert ids for "
                f"{index.shape[0]}."
            )
        dispatch = self.dispatcher()
        d = dispatch.dispatch(flat, index, weights)
        tokens, ids, w = d.tokens.contiguous(), d.index.to(index.dtype), d.weights
        dummy = tokens.shape[0] == 0  # stay in the graph: one row, expert 0, dropped after
        if dummy:
            tokens, w = tokens.sum(0, keepdim=True), w.sum(0, keepdim=True)
            ids = ids.new_zeros((1, 1))
        self._calls.append((d, dispatch, shape, dummy))
        self._swap_local(module)
        return _put(args, kwargs, dict(zip(keys, (tokens, ids, w.contiguous()))))

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        self._swap_back(module)
        if not self._calls:
            return output
        d, dispatch, shape, dummy = self._calls.pop()
        if output is None:  # the forward raised: no collective on this rank alone
            return output

        def combine(y: torch.Tensor) -> torch.Tensor:
            y = y.reshape(-1, shape[-1])
            return dispatch.combine(y[:0] if dummy else y, d).reshape(shape)

        return map_output(output, combine)

    def _swap_local(self, module: nn.Module) -> None:
        grad = torch.is_grad_enabled()
        saved = {}
        for owner, pname, name in self._holders:
            p = owner._parameters[pname]
            if isinstance(p, DTensor):
                saved[(id(owner), pname)] = (owner, pname, p)
                local = self._local(p, grad, name)
                if grad and p.requires_grad and self.grad_scale != 1.0:
                    local = _ScaleGrad.apply(local, self.grad_scale)
                owner._parameters[pname] = local
        attrs = {}
        for dotted in self.count_attrs:
            owner_name, _, attr = dotted.rpartition(".")
            owner = module.get_submodule(owner_name)
            attrs[dotted] = (owner, attr, owner.__dict__[attr])
            owner.__dict__[attr] = self.local_count
        self._saved.append(saved)
        self._attrs_saved.append(attrs)

    def _swap_back(self, module: nn.Module) -> None:
        if self._saved:
            for owner, pname, p in self._saved.pop().values():
                owner._parameters[pname] = p
        if self._attrs_saved:
            for owner, attr, value in self._attrs_saved.pop().values():
                owner.__dict__[attr] = value


@implements
class GroupedExpertsStyle(ExpertParallelStyle):
    """Experts that take their rows already grouped by expert: ``experts(x [N, in], sizes)``
    with ``sizes[e]`` rows of expert e in expert order (JetMoE's grouped linears), or, with
    ``blocks=True``, ``experts(x [E * T, in])`` running expert e on the e-th of E equal blocks
    (Llama-4's experts, which see every token). Each expert's rows go to its rank and back
    (`GroupedAllToAll`), or, where the EP group holds one batch, each rank runs its experts'
    rows and one all-gather joins them (`GroupedAllGather`, whichever ``implementation``:
    every rank holds every expert's rows already, so there is nothing to send)."""

    name = "ep_grouped_experts"

    def __init__(self, *, blocks: bool = False, **options: Any) -> None:
        super().__init__(**options)
        self.blocks = blocks
        self._grouped: list[tuple[Any, Any]] = []

    def _dispatchers(self) -> dict[str, Any]:
        shared = self.batch_mesh is not None and self.batch_mesh.size() == self.tp
        if self.batch_mesh is not None and not shared:
            raise ValueError(
                f"{self.module_name or type(self).__name__}: experts that take rows grouped by "
                f"expert run with ep_size == tp_size (one batch per EP group) or tp_size=1; "
                f"got ep={self.tp} over batch groups of {self.batch_mesh.size()}."
            )
        if shared:  # every rank holds every expert's rows already: nothing to send
            gather = GroupedAllGather(self.placement, self.group, self.rank)
            return {"all_to_all": gather, "all_reduce": gather}
        if self.implementation == "all_reduce":
            raise ValueError("ep_implementation='all_reduce' needs ep_size == tp_size.")
        return {"all_to_all": GroupedAllToAll(self.placement, self.group, self.rank)}

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        key = next((("arg", i) for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
        key = key or next(
            (("kw", k) for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None
        )
        if key is None:
            raise TypeError(f"{type(module).__name__} under expert parallelism got no tensor.")
        x = _get(args, kwargs, key)
        values = {key: None}
        if self.blocks:
            sizes = [x.shape[0] // self.num_experts] * self.num_experts
        else:
            found = [(("arg", i), a) for i, a in enumerate(args) if isinstance(a, (list, tuple))]
            found += [(("kw", k), v) for k, v in kwargs.items() if isinstance(v, (list, tuple))]
            if not found:
                raise TypeError(f"{type(module).__name__}: no per-expert row counts in its call.")
            size_key, sizes = found[0]
            sizes = [int(s) for s in sizes]
        dispatch = self.dispatcher()
        local_x, local_sizes, state = dispatch.dispatch(x, sizes)
        values[key] = local_x.contiguous()
        if not self.blocks:
            values[size_key] = local_sizes
        self._grouped.append((dispatch, state))
        self._swap_local(module)
        return _put(args, kwargs, values)

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        self._swap_back(module)
        if not self._grouped:
            return output
        dispatch, state = self._grouped.pop()
        if output is None:
            return output
        return map_output(output, lambda y: dispatch.combine(y, state))
