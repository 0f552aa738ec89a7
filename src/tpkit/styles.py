"""Tensor-parallel styles: DTensor parameters, local compute, one collective per layer.

Every style keeps the module's class and ``forward``. It turns the module's parameters into
DTensors on the TP mesh (sharded as `plan.spec.param_layout` says, or ``Replicate()``), then adds a
forward pre-hook that hands ``forward`` the *local* shards (``DTensor.to_local``, so gradients flow
back to the DTensor parameters) and Megatron's f/g collectives from `tpkit.comm` around it.

Why not torch's ``ColwiseParallel``/``RowwiseParallel`` as they are: they produce the same
parameter layouts (``Shard(0)``/``Shard(1)``) but run every op of the module through DTensor
dispatch. That costs tens of microseconds per linear in a decode step, and they have no Conv1D
(GPT-2), no packed [gate; up], no vocab-parallel output gather with uneven vocab, and no
replicated-with-grad-all-reduce. These styles subclass ``ParallelStyle`` so ``parallelize_module``
accepts them, and the DTensor parameters still give ``clip_grad_norm_``, FSDP2, DCP and optimizers
their full global view.

The math, per style (X input, W weight split over ranks i):
- colwise:               Y_i = X W_i           (input grad all-reduced: f)
- rowwise:               Y = sum_i X_i W_i + b (output all-reduced: g; bias added once, after)
- colwise_gather_output: Y = [X W_0, ..., X W_{t-1}] (all-gather of the last dim)
- vocab_parallel:        E[x] = sum_i E_i[x - off_i] masked to rank i's rows (g)
- packed_colwise:        like colwise, each of the packed parts split separately ([gate; up])
- packed_qkv_colwise:    the same with 3 parts (GPT-2's c_attn = [q; k; v])
- colwise_embedding:     E_i = E[:, cols_i] (a per-head bias table such as T5's [buckets, heads])
- moe_tp_experts:        every expert runs its own shard; outputs summed (f on inputs, g on output)
- replicate:             local compute on replicated parameters
- replicated_with_grad_allreduce: replicate, but the parameter gradient is all-reduced (it acts on
                         this rank's heads only, e.g. Qwen3 q_norm/k_norm)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from tpkit.comm import chunk_offset, chunk_sizes, copy_to_tp, gather_from_tp, reduce_from_tp
from tpkit.plan.spec import ParamLayout, canonical_style, param_layout

_SAVED = "_tpkit_saved_params"


def placement_for(layout: ParamLayout) -> Placement:
    if not layout.sharded:
        return Replicate()
    if layout.split_factor > 1:
        return _StridedShard(layout.dim, split_factor=layout.split_factor)
    return Shard(layout.dim)


def distribute_param(
    module: nn.Module, name: str, layout: ParamLayout, mesh: DeviceMesh
) -> nn.Parameter:
    """Replace ``module.<name>`` by a DTensor parameter with ``layout``.

    ``src_data_rank=None``: each rank slices its shard from its own copy, with no communication.
    tpkit requires identical weights on every rank (same seed or same checkpoint), and on the meta
    device there is nothing to send anyway.
    """
    param = module._parameters[name]
    if isinstance(param, DTensor):
        return param
    dt = distribute_tensor(param.detach(), mesh, [placement_for(layout)], src_data_rank=None)
    new = nn.Parameter(dt, requires_grad=param.requires_grad)
    module.register_parameter(name, new)
    return new


def _first_tensor_key(args: tuple, kwargs: dict) -> tuple[str, Any] | None:
    if args and isinstance(args[0], torch.Tensor):
        return ("arg", 0)
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            return ("kw", k)
    return None


def _get(args: tuple, kwargs: dict, key: tuple[str, Any]) -> torch.Tensor:
    return args[key[1]] if key[0] == "arg" else kwargs[key[1]]


def _put(args: tuple, kwargs: dict, key: tuple[str, Any], value: torch.Tensor):
    if key[0] == "arg":
        args = (*args[: key[1]], value, *args[key[1] + 1 :])
    else:
        kwargs = {**kwargs, key[1]: value}
    return args, kwargs


def _map_output(output: Any, fn) -> Any:
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (fn(output[0]), *output[1:])
    return output


class TPStyle(ParallelStyle):
    """Base: distribute the module's own parameters, run ``forward`` on their local shards."""

    name = "replicate"
    grad_allreduce = False
    sp = None  # sequence_parallel.SPState when this layer sits in an SP region
    sp_grad_allreduce = None  # SPState: all-reduce the gradient while SP is active
    compute_dtype = None  # cast local parameters (FSDP mixed precision for params it ignores)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.mesh = device_mesh
        self.group = device_mesh.get_group()
        self.tp = device_mesh.size()
        self.rank = device_mesh.get_local_rank()
        for pname, p in list(module._parameters.items()):
            if p is not None:
                layout = param_layout(self.name, pname, p.ndim, module)
                distribute_param(module, pname, layout, device_mesh)
        if isinstance(getattr(module, "nf", None), int) and isinstance(module.weight, DTensor):
            # GPT-2's Conv1D shapes its output from ``nf``: make it this rank's width
            module.nf = module.weight.to_local().shape[-1]
        self._setup(module)
        module.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        module.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True)
        module._tpkit_style = self.name
        module.__dict__["_tpkit_style_obj"] = self  # sequence/loss parallel adjust it later
        return module

    # -- hooks -------------------------------------------------------------------------------
    def _setup(self, module: nn.Module) -> None:
        """Per-module one-time fix-ups after the parameters are distributed."""

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        self._swap_in(module)
        return self._prepare_input(module, args, kwargs)

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        try:
            return self._prepare_output(module, output)
        finally:
            self._swap_out(module)

    def _prepare_input(self, module, args, kwargs):
        return args, kwargs

    def _prepare_output(self, module, output):
        return output

    # -- local parameters --------------------------------------------------------------------
    @staticmethod
    def _nested_replicated(module: nn.Module) -> list[tuple[nn.Module, str]]:
        """Replicated parameters of descendants: some modules read a child's weight directly
        (Mamba's ``self.conv1d.weight`` in a functional conv), bypassing the child's hooks."""
        found = module.__dict__.get("_tpkit_nested")
        if found is None:
            # direct children only: a deeper module is swapped by its own parent, and sweeping a
            # whole subtree would bypass descendants' own hooks (sequence-parallel gradient
            # all-reduce) and FSDP's per-block unsharding
            found = [
                (m, n)
                for m in module.children()
                if _read_directly(m)
                for n, p in m._parameters.items()
                if isinstance(p, DTensor)
            ]
            module.__dict__["_tpkit_nested"] = found
        return found

    def _swap_in(self, module: nn.Module) -> None:
        d = module.__dict__
        grad = torch.is_grad_enabled()
        nested_spec = d.get("_tpkit_nested")
        if nested_spec is None:
            nested_spec = self._nested_replicated(module)
        if nested_spec:  # pushed only for modules that have one, popped likewise
            nested = []
            for child, name in nested_spec:
                p = child._parameters.get(name)
                if isinstance(p, DTensor):
                    nested.append((child, name, p))
                    child._parameters[name] = (
                        p.to_local() if grad and p.requires_grad else p._local_tensor
                    )
            d.setdefault("_tpkit_nested_saved", []).append(nested)
        params = module._parameters
        saved = {}
        if grad or self.compute_dtype is not None:
            for name, p in params.items():
                if not isinstance(p, DTensor):
                    continue
                if grad and p.requires_grad:
                    local = p.to_local()
                    sp = self.sp_grad_allreduce
                    if self.grad_allreduce or (sp is not None and sp.active):
                        local = copy_to_tp(local, self.group)
                else:
                    local = p._local_tensor
                if self.compute_dtype is not None and local.is_floating_point():
                    local = local.to(self.compute_dtype)
                saved[name] = p
                params[name] = local
        else:
            # no-grad fast path (decode): the local shards as they are, no autograd, no cast
            for name, p in params.items():
                if isinstance(p, DTensor):
                    saved[name] = p
            for name, p in saved.items():
                params[name] = p._local_tensor
        stack = d.get(_SAVED)
        if stack is None:
            d[_SAVED] = [saved]
        else:
            stack.append(saved)

    @staticmethod
    def _swap_out(module: nn.Module) -> None:
        d = module.__dict__
        stack = d.get(_SAVED)
        if stack:
            module._parameters.update(stack.pop())
        nested = d.get("_tpkit_nested_saved")
        if nested:
            for child, name, p in nested.pop():
                child._parameters[name] = p


class ReplicateStyle(TPStyle):
    name = "replicate"


class ReplicateGradAllReduceStyle(TPStyle):
    name = "replicated_with_grad_allreduce"
    grad_allreduce = True


class ColwiseStyle(TPStyle):
    name = "colwise"

    def _prepare_input(self, module, args, kwargs):
        sp = self.sp
        if (sp is None or not sp.active) and not torch.is_grad_enabled():
            return args, kwargs  # f is the identity without autograd
        key = _first_tensor_key(args, kwargs)
        if key is None:
            return args, kwargs
        x = _get(args, kwargs, key)
        if sp is not None and sp.active:
            if sp.gathered and x is sp.gathered[-1]:
                return args, kwargs  # the region's gather reduce-scatters our partial grads
            raise ValueError(
                f"sequence_parallel: {type(module).__name__} ({self.name}) received a tensor its "
                "region did not gather (the region transforms its input before this layer); "
                "this architecture does not support sequence_parallel=True."
            )
        return _put(args, kwargs, key, copy_to_tp(x, self.group))


class PackedColwiseStyle(ColwiseStyle):
    name = "packed_colwise"


class PackedQKVColwiseStyle(ColwiseStyle):
    name = "packed_qkv_colwise"


class ColwiseEmbeddingStyle(ColwiseStyle):
    """Embedding whose columns are split (T5's relative attention bias: one column per head);
    its integer input needs no f, its output stays sharded like a column linear's."""

    name = "colwise_embedding"


class GatherOutputStyle(ColwiseStyle):
    name = "colwise_gather_output"

    def _setup(self, module):
        w = module._parameters["weight"]
        layout = param_layout(self.name, "weight", w.ndim, module)
        self.sizes = chunk_sizes(w.shape[layout.dim], self.tp)

    loss_parallel = False  # training: hand the loss vocab-sharded logits (tpkit.loss)

    def _prepare_output(self, module, output):
        if self.loss_parallel and torch.is_grad_enabled():
            return _map_output(output, self._as_vocab_shard)
        return _map_output(output, lambda y: gather_from_tp(y, self.sizes, self.rank, self.group))

    def _as_vocab_shard(self, y: torch.Tensor) -> DTensor:
        shape = (*y.shape[:-1], sum(self.sizes))
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            y, self.mesh, [Shard(y.ndim - 1)], run_check=False, shape=shape, stride=stride
        )


class RowwiseStyle(TPStyle):
    name = "rowwise"

    def _pre_hook(self, module, args, kwargs):
        self._swap_in(module)
        bias = module._parameters.get("bias")
        if bias is not None:
            # Added once after the reduction, not on every rank before it.
            module.__dict__.setdefault("_tpkit_bias", []).append(bias)
            module._parameters["bias"] = None if isinstance(module, nn.Linear) else bias * 0
        return args, kwargs

    # Set by a wrapper around the call that adds its own partial sums before the reduction (LoRA
    # on a row-parallel base, tpkit.integrations.peft): the output is returned unreduced and the
    # wrapper finishes it with `finish_deferred` (g, then the bias), one all-reduce in all.
    defer_reduction = False

    def _prepare_output(self, module, output):
        stack = module.__dict__.get("_tpkit_bias")
        bias = stack.pop() if stack else None
        if self.defer_reduction:
            module.__dict__.setdefault("_tpkit_deferred_bias", []).append(bias)
            return output
        return self._reduce_output(output, bias)

    def finish_deferred(self, module, output):
        """g and the bias for an output that ``defer_reduction`` left unreduced."""
        return self._reduce_output(output, module.__dict__["_tpkit_deferred_bias"].pop())

    def _reduce_output(self, output, bias):
        sp = self.sp if self.sp is not None and self.sp.active else None

        def reduce(y):
            if sp is None:
                y = reduce_from_tp(y, self.group)
                return y + bias if bias is not None else y
            y = sp.reduce_scatter(y)  # each rank keeps its sequence chunk
            return y + copy_to_tp(bias, self.group) if bias is not None else y

        return _map_output(output, reduce)


class RowwiseSplitInputStyle(RowwiseStyle):
    """Rowwise on a replicated input (transformers' ``rowwise_split_input``): f, then this
    rank's slice of the input's last dim, then the rowwise product and g."""

    name = "rowwise_split_input"

    def _setup(self, module):
        w = module._parameters["weight"]
        width = w.shape[param_layout(self.name, "weight", w.ndim, module).dim]
        self.start = chunk_offset(width, self.tp, self.rank)
        self.size = chunk_sizes(width, self.tp)[self.rank]

    def _pre_hook(self, module, args, kwargs):
        args, kwargs = super()._pre_hook(module, args, kwargs)
        key = _first_tensor_key(args, kwargs)
        x = copy_to_tp(_get(args, kwargs, key), self.group)
        return _put(args, kwargs, key, x[..., self.start : self.start + self.size])


class PackedRowwiseStyle(RowwiseStyle):
    name = "packed_rowwise"


class AllReduceStyle(TPStyle):
    """A module whose parameters are split by their own entries (Inkling's shared experts:
    ``gate_proj``/``up_proj`` colwise, ``down_proj`` rowwise) computing on replicated inputs:
    every float input gets f, so its gradient, partial on each rank, is summed in backward;
    the output g. transformers' ``all_reduce`` style has only the g, which leaves the inputs'
    gradients (the residual stream's, the router's gammas') partial."""

    name = "all_reduce"

    def _prepare_input(self, module, args, kwargs):
        def f(v):
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return copy_to_tp(v, self.group)
            return v

        return tuple(f(a) for a in args), {k: f(v) for k, v in kwargs.items()}

    def _prepare_output(self, module, output):
        return _map_output(output, lambda y: reduce_from_tp(y, self.group))


class MlaKvAProjStyle(TPStyle):
    """DeepSeek-style MLA ``kv_a_proj_with_mqa``, replicated. Its output is [kv part | rope
    part]; the kv part feeds a column-parallel ``kv_b_proj`` (whose f all-reduces its gradient),
    the rope part goes straight into this rank's heads, so its gradient is all-reduced here (f).
    The rope width is set on the module by `parallelize.apply_plan` (``_tpkit_rope_dim``)."""

    name = "mla_kv_a_proj"

    def _prepare_output(self, module, output):
        rope = int(getattr(module, "_tpkit_rope_dim", 0))

        def fix(y):
            if not rope:
                return y
            kv, pe = y.split([y.shape[-1] - rope, rope], dim=-1)
            return torch.cat([kv, copy_to_tp(pe, self.group)], dim=-1)

        return _map_output(output, fix)


class VocabParallelStyle(TPStyle):
    name = "vocab_parallel"

    def _setup(self, module):
        w = module._parameters["weight"]
        vocab = w.shape[0]
        self.start = chunk_offset(vocab, self.tp, self.rank)
        self.end = self.start + chunk_sizes(vocab, self.tp)[self.rank]
        pad = getattr(module, "padding_idx", None)
        if pad is not None:
            module.padding_idx = pad - self.start if self.start <= pad < self.end else None

    def _prepare_input(self, module, args, kwargs):
        key = _first_tensor_key(args, kwargs)
        ids = _get(args, kwargs, key)
        outside = (ids < self.start) | (ids >= self.end)
        module.__dict__.setdefault("_tpkit_mask", []).append(outside)
        return _put(args, kwargs, key, (ids - self.start).masked_fill(outside, 0))

    def _prepare_output(self, module, output):
        outside = module.__dict__["_tpkit_mask"].pop()

        def reduce(y):
            return reduce_from_tp(y.masked_fill(outside.unsqueeze(-1), 0), self.group)

        return _map_output(output, reduce)


class MoeExpertsStyle(AllReduceStyle):
    """Experts whose weights are split by their own parameter entries (gate_up packed_colwise,
    down rowwise): every float input gets f, the summed output g. A replicated
    ``down_proj_bias`` (GPT-OSS) is added inside every rank's partial sum, so it enters as
    bias / tp (exact for power-of-two tp) with its gradient summed over the group."""

    name = "moe_tp_experts"
    scale_down_bias = False

    def _setup(self, module):
        w, b = module._parameters.get("down_proj"), module._parameters.get("down_proj_bias")
        sharded = isinstance(w, DTensor) and any(p.is_shard() for p in w.placements)
        self.scale_down_bias = sharded and isinstance(b, DTensor)

    def _pre_hook(self, module, args, kwargs):
        out = super()._pre_hook(module, args, kwargs)
        if self.scale_down_bias:
            b = module._parameters["down_proj_bias"]  # the local tensor, swapped in
            if torch.is_grad_enabled() and b.requires_grad:
                b = copy_to_tp(b, self.group)
            module._parameters["down_proj_bias"] = b / self.tp
        return out


class MoeIdentityExpertStyle(TPStyle):
    """A parameter-free expert (LongCat-Flash's zero-computation ``identity_expert``) inside
    ``moe_tp_experts``: every rank computes the same output and the experts' g sums tp copies,
    so the input is divided by tp here (exact for power-of-two tp), as transformers does."""

    name = "moe_identity_expert"

    def _prepare_input(self, module, args, kwargs):
        key = _first_tensor_key(args, kwargs)
        return _put(args, kwargs, key, _get(args, kwargs, key) / self.tp)


STYLE_CLASSES: dict[str, type[TPStyle]] = {
    cls.name: cls
    for cls in (
        ReplicateStyle,
        ReplicateGradAllReduceStyle,
        ColwiseStyle,
        PackedColwiseStyle,
        PackedQKVColwiseStyle,
        ColwiseEmbeddingStyle,
        GatherOutputStyle,
        RowwiseStyle,
        VocabParallelStyle,
        MoeExpertsStyle,
        RowwiseSplitInputStyle,
        PackedRowwiseStyle,
        AllReduceStyle,
        MlaKvAProjStyle,
        MoeIdentityExpertStyle,
    )
}


def make_style(name: str) -> TPStyle:
    """A fresh style object for a (possibly aliased) style name."""
    return STYLE_CLASSES[canonical_style(name)]()


def shard_param(module: nn.Module, pname: str, style: str, mesh: DeviceMesh) -> nn.Parameter:
    """Apply a plan entry that names a single parameter (e.g. ``experts.gate_up_proj``)."""
    p = module._parameters[pname]
    return distribute_param(module, pname, param_layout(style, pname, p.ndim, module), mesh)


def apply_fixups(module: nn.Module, fixups: dict[str, Any], mesh: DeviceMesh) -> None:
    """Make a module's own code see this rank's share of the heads.

    ``divide``: integer attributes the module reads (``num_heads``, ``split_size``, ...) become
    their value / tp. ``head_inputs``: inputs computed for all heads outside the module (BLOOM's
    ``alibi``, [batch*heads, 1, k]) are sliced to this rank's contiguous heads, along dim 0
    (batch*heads) or dim 1 (heads), by a forward pre-hook. Done once: a module already fixed up
    is left alone.
    """
    if getattr(module, "_tpkit_fixed", False):
        return
    tp, rank = mesh.size(), mesh.get_local_rank()
    heads = None
    for attr in fixups.get("divide", []):
        value = getattr(module, attr)
        if attr in ("num_heads", "num_attention_heads", "n_head", "n_heads") and heads is None:
            heads = value
        setattr(module, attr, value // tp)
    head_inputs = dict(fixups.get("head_inputs") or {})
    if head_inputs and heads:
        per = heads // tp

        def slice_heads(mod, args, kwargs):
            for key, dim in head_inputs.items():
                kind, k = key.split(":", 1)
                t = args[int(k)] if kind == "arg" and int(k) < len(args) else kwargs.get(k)
                if not isinstance(t, torch.Tensor):
                    continue
                if dim == 0:
                    t = t.unflatten(0, (-1, heads))[:, rank * per : (rank + 1) * per].flatten(0, 1)
                elif t.shape[1] == heads:
                    t = t[:, rank * per : (rank + 1) * per]
                if kind == "arg":
                    args = (*args[: int(k)], t, *args[int(k) + 1 :])
                else:
                    kwargs = {**kwargs, k: t}
            return args, kwargs

        module.register_forward_pre_hook(slice_heads, with_kwargs=True)
    module._tpkit_fixed = True


def _read_directly(child: nn.Module) -> bool:
    """A replicated child whose parameters its parent may read without calling it: a conv
    (Mamba-style ``F.conv1d(x, self.conv1d.weight)``), a linear's weight in a matmul (Mamba's
    ``dt_proj.weight @ x``), an embedding table indexed by hand, a module driven through methods
    other than ``forward`` (JetMoe's ``experts.map``)."""
    if getattr(child, "_tpkit_style", None) != "replicate":
        return False  # a sharded child must be called: its hooks do the collectives
    return "norm" not in type(child).__name__.lower()


def install_parent_swaps(model: nn.Module, mesh: DeviceMesh) -> None:
    """Give each parameter-less module whose children may be read directly the local-tensor
    swap of its descendants' replicated parameters for the span of its forward."""
    for module in list(model.modules()):
        if getattr(module, "_tpkit_style", None) is None and any(
            _read_directly(c) for c in module.children()
        ):
            ReplicateStyle()._apply(module, mesh)
            module._tpkit_style = "parent_swap"  # not itself a replicated child of its parent
