"""The base of every style: DTensor parameters, local compute, one record per module.

A style keeps the module's class and ``forward``. Applied (``parallelize_module`` calls
`TPStyle._apply`), it turns the module's parameters into DTensors on the TP mesh (sharded as
`tpkit.plan.layout` says, or ``Replicate()``), then adds a forward pre-hook that hands ``forward``
the *local* shards (``DTensor.to_local``, so gradients flow back to the DTensor parameters) and
Megatron's f/g collectives from `tpkit.parallel.comm` around it.

Why not torch's ``ColwiseParallel``/``RowwiseParallel`` as they are: they produce the same
parameter layouts (``Shard(0)``/``Shard(1)``) but run every op of the module through DTensor
dispatch, which costs tens of microseconds per linear in a decode step, and they have no Conv1D
(GPT-2), no packed [gate; up], no vocab-parallel output gather with uneven vocab, and no
replicated-with-grad-all-reduce. These subclass ``ParallelStyle``, so ``parallelize_module``
applies them, and the DTensor parameters give ``clip_grad_norm_``, FSDP2, DCP and optimizers their
full global view.

The style object is the module's record (``module._tpkit_style``): its name, its options (set at
construction: sequence parallelism, compute dtype, loss parallelism, style arguments), and the
per-call state its hooks keep. Nothing else is stored on the module.
"""

from __future__ import annotations

import copy
import types
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from tpkit.compat import StridedShard, as_parameter, storage_holders
from tpkit.parallel.comm import copy_to_tp
from tpkit.parallel.shard_memory import empty_shard, give_back, keep_in_place
from tpkit.plan.catalogue import StyleSpec, bind, style_spec
from tpkit.plan.layout import ParamLayout, chunk_ranges, param_layout

__all__ = [
    "RECORD",
    "LocalReplicated",
    "ParentSwap",
    "ReplicateGradAllReduceStyle",
    "ReplicateStyle",
    "TPStyle",
    "distribute_param",
    "first_tensor",
    "implements",
    "map_output",
    "placement_for",
    "read_directly",
    "replace_first_tensor",
    "style_of",
]

#: The one attribute tpkit sets on a module it split: its style object (`style_of`).
RECORD = "_tpkit_style"


def style_of(module: nn.Module) -> TPStyle | None:
    """The style applied to ``module`` (its record), or None."""
    return module.__dict__.get(RECORD)


def placement_for(layout: ParamLayout) -> Placement:
    """The DTensor placement of a layout (``StridedShard`` for packed parts: torch's only way
    to say "each of k parts split separately")."""
    if not layout.sharded:
        return Replicate()
    if layout.split_factor > 1:
        return StridedShard(layout.dim, split_factor=layout.split_factor)
    return Shard(layout.dim)


def distribute_param(
    module: nn.Module,
    name: str,
    layout: ParamLayout,
    mesh: DeviceMesh,
    src_data_rank: int | None = None,
) -> nn.Parameter:
    """Replace ``module.<name>`` by a DTensor parameter with ``layout`` (kept if already one).

    ``src_data_rank=None`` (tpkit's default): each rank slices its shard from its own copy, with
    no communication; tpkit requires identical weights on every rank (same seed or checkpoint),
    and on the meta device there is nothing to send anyway. Where the module was the weight's
    only holder, a shard that is one contiguous run of it stays in its memory (`_split_here`).
    """
    param = module._parameters[name]
    if isinstance(param, DTensor):
        return param
    if src_data_rank is None and mesh.ndim == 1 and param.device.type != "meta":
        del param  # a reference held here would keep the weight from being its module's alone
        return _split_here(module, name, layout, mesh)
    dt = distribute_tensor(
        param.detach(), mesh, [placement_for(layout)], src_data_rank=src_data_rank
    )
    local = dt._local_tensor
    if local.device.type != "meta" and _shares_storage(local, param):
        # Own memory for every shard: a dim-0 chunk is a view of the whole weight, which would
        # then stay alive; a replicated parameter loaded by transformers is a view into the
        # memory-mapped checkpoint, and one such view keeps the whole file mapped and resident
        # (on a 57M Llama at tp=2: 300 -> 175 MiB over the baseline after the split).
        dt = DTensor.from_local(
            local.clone(), mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride()
        )
    new = as_parameter(dt, param.requires_grad)
    module.register_parameter(name, new)
    return new


def _split_here(
    module: nn.Module, name: str, layout: ParamLayout, mesh: DeviceMesh
) -> nn.Parameter:
    """`distribute_param` on a 1-D mesh, each rank cutting its shard from its own copy.

    Is the module the weight's only holder? Then its shard may stay in the weight's memory, the
    rest given back (`keep_in_place`). The parameter is let go of here, and seen to die or not:
    a tie, an optimizer, a user's handle keep it alive, a state_dict's tensor its storage, and
    then the shard is a copy and the weight is left as it was for them."""
    param = module._parameters[name]
    whole, requires_grad = param.detach(), param.requires_grad
    try:
        alive = weakref.ref(param)
    except TypeError:  # a parameter class without weak references: not known to be alone
        alive = (lambda p: lambda: p)(param)
    module._parameters[name] = None
    del param
    alone = alive() is None and storage_holders(whole) == 1
    try:
        local = _own_shard(whole, layout, mesh, in_place=alone)
    except BaseException:
        old = alive()
        module._parameters[name] = old if old is not None else nn.Parameter(whole, requires_grad)
        raise
    new = as_parameter(local, requires_grad)
    module.register_parameter(name, new)
    return new


def _own_shard(
    t: torch.Tensor, layout: ParamLayout, mesh: DeviceMesh, in_place: bool = False
) -> DTensor:
    """``t`` laid out as ``layout`` over a 1-D ``mesh``, this rank's shard cut from its own copy
    into fresh memory, once. What ``distribute_tensor`` gives, without its cost: it makes every
    rank's chunk contiguous (a copy of the whole weight for a column split) before keeping one,
    and a kept view would pin the whole weight (or the file transformers mapped it from).

    ``in_place`` (``t`` is its memory's only holder): a shard that is one contiguous run of
    ``t`` stays where it is, the rest of ``t``'s pages given back (`keep_in_place`); any other
    shard is copied and then all of ``t``'s pages are given back (`give_back`)."""
    parts = [t]
    if layout.sharded and mesh.size() > 1:
        ranges = chunk_ranges(
            t.shape[layout.dim], mesh.size(), mesh.get_local_rank(), layout.split_factor
        )
        parts = [t.narrow(layout.dim, a, b - a) for a, b in ranges]
    shape = list(t.shape)
    if layout.sharded:
        shape[layout.dim] = sum(p.shape[layout.dim] for p in parts)
    local = None
    if in_place and len(parts) == 1 and parts[0].is_contiguous():
        start = (parts[0].data_ptr() - t.data_ptr()) // t.element_size()
        local = keep_in_place(t, start, tuple(shape))
    copied = local is None
    if copied:
        local = empty_shard(tuple(shape), t.dtype, t.device)  # its pages faulted in at once
        if len(parts) > 1:
            torch.cat(parts, layout.dim, out=local)
        else:
            local.copy_(parts[0])
    dt = DTensor.from_local(  # the global stride is the weight's, as distribute_tensor's
        local, mesh, [placement_for(layout)], run_check=False, shape=t.shape, stride=t.stride()
    )
    if copied and in_place:
        give_back(t)  # last; what the copy read stays resident otherwise (`give_back`)
    return dt


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def first_tensor(args: tuple, kwargs: dict) -> tuple[str, Any] | None:
    """Where a module's main input is: ("arg", 0) or ("kw", name), or None."""
    if args and isinstance(args[0], torch.Tensor):
        return ("arg", 0)
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            return ("kw", k)
    return None


def replace_first_tensor(args: tuple, kwargs: dict, fn) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the main input replaced by ``fn(input)`` (unchanged if none)."""
    key = first_tensor(args, kwargs)
    if key is None:
        return args, kwargs
    if key[0] == "arg":
        return (fn(args[0]), *args[1:]), kwargs
    return args, {**kwargs, key[1]: fn(kwargs[key[1]])}


def map_output(output: Any, fn) -> Any:
    """Apply ``fn`` to a module's main output (a tensor, or the first of a tuple)."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (fn(output[0]), *output[1:])
    return output


_IMPL = "_experts_implementation_internal"


def _grouped_mm_fallback(module: nn.Module) -> str:
    """torch's CPU grouped_mm needs every row of its operands to be a multiple of 16 bytes; a
    shard narrower than that (an intermediate width of 12 at tp=4 in float32: 3 values per rank),
    or a whole expert weight as odd (transformers' Mixtral tester: 37 wide, which fails
    unsharded too), makes it raise mid-forward (or, for a shard of 38 rows, in its backward).
    Such a module gets its own copy of its config that says ``batched_mm`` (the same products,
    per expert): the fix in words, or "". Experts on another implementation at the split
    (``eager``, ``batched_mm``) keep it in their own copy too, so a later
    ``set_experts_implementation("grouped_mm")`` on the model, which rewrites the shared config,
    never puts them on grouped_mm's refused strides (the first forward, the backward or a
    ``generate`` after the switch would raise)."""
    config = getattr(module, "config", None)  # any object: IDEFICS keeps a float there
    impl = getattr(config, "__dict__", {}).get(_IMPL)
    experts = hasattr(module, "is_concatenated") and hasattr(module, "has_gate")  # transformers'
    if impl != "grouped_mm" and not (experts and impl is not None):
        return ""
    for p in module._parameters.values():
        if p is not None and p.ndim == 3:
            local = p._local_tensor if isinstance(p, DTensor) else p
            if any(n * local.element_size() % 16 for n in local.shape[-2:]):
                module.config = copy.copy(config)
                if impl != "grouped_mm":
                    return ""  # pinned to what it runs now
                module.config.__dict__[_IMPL] = "batched_mm"
                return "batched_mm (grouped_mm needs 16-byte rows)"
    return ""


def implements(cls: type) -> type:
    """Class decorator: ``cls`` runs the catalogue's style ``cls.name`` (`tpkit.plan.catalogue`
    says what that style is: its role, the dim it shards, its collective). A new built-in style
    is its spec in the catalogue and its class here, decorated: nothing else to list."""
    bind(cls.name, cls)
    return cls


class TPStyle(ParallelStyle):
    """Base: distribute the module's own parameters, run ``forward`` on their local shards.

    Options, fixed at construction: ``sp`` (the sequence-parallel state of the block this layer
    sits in, `tpkit.parallel.sequence.SPState`; for a replicated layer outside the regions it
    means its gradient is all-reduced while SP is active), ``compute_dtype`` (cast local
    parameters: FSDP2 mixed precision for parameters FSDP leaves out). Subclasses add their own.
    """

    name = "replicate"
    grad_allreduce = False  # every step, not only under SP (replicated_with_grad_allreduce)
    read_by_parent = False  # its parent may read its local parameters without calling it
    # its replicated parameters may be local for the whole model's forward (`LocalReplicated`):
    # only styles whose local parameter is `_local` and nothing else, per call. Read from the
    # class's own dict: a subclass that changes `_swap_in` (LoRA's row lora_B) must declare it.
    local_in_model = False
    # True: with no grad and no sequence parallelism its hooks only swap in the local
    # parameters, so a no-grad loop (generate) may swap once and run the module hook-free. Read
    # from the class's own dict only: a subclass that changes a hook must declare it again.
    nograd_identity = False

    def __init__(self, *, sp: Any = None, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.sp = sp
        self.compute_dtype = compute_dtype
        self.src_data_rank: int | None = None
        self.module_name = ""
        self._saved: list[dict[str, DTensor]] = []
        self._nested: list[tuple[nn.Module, str]] | None = None
        self._nested_saved: list[list[tuple[nn.Module, str, DTensor]]] = []
        self.kernel_fallback = ""  # set at _apply: a kernel swapped for one that runs
        # own parameters whose gradient is all-reduced although the style's is not: a bare
        # parameter the plan names ``replicated_with_grad_allreduce`` (`tpkit.parallel.tensor.apply_plan`)
        self.allreduce_params: set[str] = set()

    @property
    def spec(self) -> StyleSpec:
        """The catalogue record of the style this one lays its parameters out as."""
        return style_spec(self.layout_style)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.mesh = device_mesh
        self.group = device_mesh.get_group()
        self.tp = device_mesh.size()
        self.rank = device_mesh.get_local_rank()
        held = [n for n, p in module._parameters.items() if p is not None]
        for pname in held:  # by name: a reference held here would keep each weight's memory
            ndim = module._parameters[pname].ndim
            layout = param_layout(self.layout_style, pname, ndim, module)
            distribute_param(module, pname, layout, device_mesh, self.src_data_rank)
        # a replicated layer on a sequence chunk sees a partial gradient while SP is active
        self._sp_grads = self.spec.role == "replicate"
        self._setup(module)
        self.kernel_fallback = _grouped_mm_fallback(module)
        module.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        module.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True)
        module.__dict__[RECORD] = self
        module.extra_repr = types.MethodType(_extra_repr_with_style, module)  # print(model)
        return module

    @property
    def layout_style(self) -> str:
        """The catalogue style whose layout this style's parameters take."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

    def extra_repr(self) -> str:
        """The style and its options, as ``print(model)`` shows them."""
        parts = [f"tp={self.name}"]
        if self.sp is not None:
            parts.append("sp")
        if self.compute_dtype is not None:
            parts.append(f"compute_dtype={self.compute_dtype}")
        if self.kernel_fallback:
            parts.append(self.kernel_fallback)
        return ", ".join(parts)

    def describe(self, module: nn.Module) -> str:
        """`extra_repr` plus this rank's shape of each split parameter of ``module``."""
        local = [
            f"{name}: local {tuple(p.to_local().shape)}"
            for name, p in module._parameters.items()
            if isinstance(p, DTensor) and any(not pl.is_replicate() for pl in p.placements)
        ]
        return ", ".join([self.extra_repr(), *local])

    # -- hooks -------------------------------------------------------------------------------
    def _setup(self, module: nn.Module) -> None:
        """Per-module one-time preparation after the parameters are distributed."""

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        self._swap_in(module)
        return self._prepare_input(module, args, kwargs)

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        try:
            return self._prepare_output(module, output)
        finally:
            self._swap_out(module)

    def _prepare_input(self, module: nn.Module, args: tuple, kwargs: dict):
        return args, kwargs

    def _prepare_output(self, module: nn.Module, output: Any) -> Any:
        return output

    # -- local parameters --------------------------------------------------------------------
    def _nested_replicated(self, module: nn.Module) -> list[tuple[nn.Module, str]]:
        """Replicated parameters of children the module may read without calling them (Mamba's
        ``self.conv1d.weight`` in a functional conv), bypassing the children's own hooks."""
        if self._nested is None:
            # direct children only: a deeper module is swapped by its own parent, and sweeping a
            # whole subtree would bypass descendants' own hooks (sequence-parallel gradient
            # all-reduce) and FSDP's per-block unsharding
            self._nested = [
                (m, n)
                for m in module.children()
                if read_directly(m)
                for n, p in m._parameters.items()
                if p is not None  # a DTensor or not at this moment (LocalReplicated): swap checks
            ]
        return self._nested

    def _local(self, p: DTensor, grad: bool, name: str = "") -> torch.Tensor:
        if not (grad and p.requires_grad):
            local = p._local_tensor  # no autograd edge needed: no DTensor dispatch either
        else:
            local = p.to_local()
            sp = self.sp
            if (
                self.grad_allreduce
                or name in self.allreduce_params
                or (sp is not None and self._sp_grads and sp.active)
            ):
                local = copy_to_tp(local, self.group)
        if self.compute_dtype is not None and local.is_floating_point():
            local = local.to(self.compute_dtype)
        return local

    def _swap_in(self, module: nn.Module) -> None:
        grad = torch.is_grad_enabled()
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
            self._nested_saved.append(nested)
        params = module._parameters
        saved = {name: p for name, p in params.items() if isinstance(p, DTensor)}
        if grad or self.compute_dtype is not None:
            for name, p in saved.items():
                params[name] = self._local(p, grad, name)
        else:  # no-grad fast path (decode): the local shards as they are
            for name, p in saved.items():
                params[name] = p._local_tensor
        self._saved.append(saved)

    def _swap_out(self, module: nn.Module) -> None:
        if self._saved:
            module._parameters.update(self._saved.pop())
        if self._nested and self._nested_saved:
            for child, name, p in self._nested_saved.pop():
                child._parameters[name] = p


@implements
class ReplicateStyle(TPStyle):
    """Replicated parameters (``Replicate()`` DTensors), local compute: Y = f(X; W)."""

    name = "replicate"
    local_in_model = True
    nograd_identity = True


@implements
class ReplicateGradAllReduceStyle(TPStyle):
    """Replicated, acting on sharded activations (Qwen3's per-head ``q_norm``): each rank's
    gradient covers its heads only, so it is all-reduced (f on the local weight)."""

    name = "replicated_with_grad_allreduce"
    grad_allreduce = True
    local_in_model = True
    nograd_identity = True


class ParentSwap(TPStyle):
    """Not a plan style: a parameter-less module whose children may be read directly (a
    functional conv on ``self.conv1d.weight``) gets their local tensors for its forward."""

    name = "parent_swap"

    @property
    def layout_style(self) -> str:
        return "replicate"


class LocalReplicated:
    """The model's replicated parameters as local tensors for the span of its forward.

    A style swaps a module's parameters for their local tensors only while that module's own
    ``forward`` runs. Model code also reads parameters elsewhere: a parent reads a child's or
    grandchild's weight (MobileBERT's head: ``x @ cat([decoder.weight.t(), dense.weight])``),
    a bare ``nn.Parameter`` of a module is read in its parent's forward (Perceiver's latents),
    a module's table is read through a method other than ``forward`` (Gemma-4's per-layer
    inputs). There the parameter is still a ``Replicate()`` DTensor, and the first op mixing it
    with a plain activation raises "got mixed torch.Tensor and DTensor". Installed on the model
    `apply_plan` split (a forward pre-hook and an always-called forward hook), this swaps every
    replicated parameter of a plainly replicated module (`TPStyle.local_in_model`) for its local
    tensor when the model's forward starts and back when it ends, so every such read sees the
    same plain tensor the unsharded model would, wherever it happens.

    Exact, gradients included: the local tensor is the module style's own `TPStyle._local`
    (``to_local`` with an autograd edge to the DTensor, f where the plan all-reduces the
    gradient: a replicated parameter on split activations, `ReplicateGradAllReduceStyle`), taken
    once per parameter per forward, so a read anywhere accumulates into the same DTensor
    gradient as a read in the module's forward. Between forwards the parameters are DTensors
    again: optimizers, ``state_dict``, ``clip_grad_norm_``, FSDP2 and DCP see no change.

    Left to the module's own hooks: sharded parameters (a rank's shard read outside its module
    would be a different number; the plan keeps such reads whole, `tpkit.sources.fallback`),
    modules under sequence parallelism (whether their gradient is all-reduced is decided per
    block, at call time), parameters that are not ``Replicate()`` on the TP mesh when the
    forward starts (FSDP2's sharded ones, unsharded by their block's own hook), a forward
    run outside the model's (a block recomputed under activation checkpointing), and a model
    run under ``torch.compile`` (the hook would break the graph).
    """

    def __init__(self) -> None:
        self._slots: list[tuple[nn.Module, str, TPStyle]] | None = None
        self._saved: list[list[tuple[nn.Module, str, DTensor, torch.Tensor]]] = []

    def install(self, model: nn.Module) -> None:
        """Register the hooks on ``model`` (its forward pre-hook first in line after FSDP's)."""
        model.register_forward_pre_hook(self._pre_hook, prepend=True)
        model.register_forward_hook(self._post_hook, always_call=True)

    def _eligible(self, model: nn.Module) -> list[tuple[nn.Module, str, TPStyle]]:
        """Every (module, name, style) whose parameter this may make local: each module holding
        it has a plainly replicated style (`local_in_model`, not under sequence parallelism),
        and, for a parameter held by several modules, all those styles make the same local
        tensor (the same gradient all-reduce and compute dtype); any other parameter is left to
        its modules' own hooks."""
        if self._slots is None:
            holders: dict[int, list[tuple[nn.Module, str, TPStyle | None]]] = {}
            for module in model.modules():
                style = style_of(module)
                ok = (
                    style is not None
                    and style.sp is None
                    and type(style).__dict__.get("local_in_model", False)  # not inherited
                )
                for n, p in module._parameters.items():
                    if p is not None:
                        holders.setdefault(id(p), []).append((module, n, style if ok else None))
            slots = []
            for held in holders.values():
                styles = [s for _, _, s in held]
                if any(s is None for s in styles):
                    continue
                allreduce = {s.grad_allreduce or n in s.allreduce_params for _, n, s in held}
                if len(allreduce) > 1 or len({s.compute_dtype for s in styles}) > 1:
                    continue
                slots.extend(held)
            self._slots = slots
        return self._slots

    def _pre_hook(self, model: nn.Module, args: tuple) -> None:
        saved: list[tuple[nn.Module, str, DTensor, torch.Tensor]] = []
        self._saved.append(saved)  # first: a raise below still leaves the post hook its list
        if torch.compiler.is_compiling():  # a graph break here; the modules' own hooks serve
            return
        grad = torch.is_grad_enabled()
        local_of: dict[int, torch.Tensor] = {}  # a tied parameter: one local tensor
        for module, name, style in self._eligible(model):
            p = module._parameters.get(name)
            if not isinstance(p, DTensor) or p.device_mesh != style.mesh:
                continue
            if not all(pl.is_replicate() for pl in p.placements):
                continue
            local = local_of.get(id(p))
            if local is None:
                local = local_of[id(p)] = style._local(p, grad, name)
            module._parameters[name] = local
            saved.append((module, name, p, local))

    def _post_hook(self, model: nn.Module, args: tuple, output: Any) -> None:
        if not self._saved:
            return
        for module, name, p, local in self._saved.pop():
            if module._parameters.get(name) is local:  # not replaced meanwhile (FSDP2)
                module._parameters[name] = p


def _extra_repr_with_style(module: nn.Module) -> str:
    """A split module's line in ``print(model)``: its own, then what tpkit did to it (bound to
    the module, so ``copy.deepcopy`` rebinds it to the copy)."""
    own = type(module).extra_repr(module)
    style = style_of(module)
    return ", ".join(x for x in (own, style.describe(module) if style else "") if x)


def read_directly(child: nn.Module) -> bool:
    """A replicated child whose parameters its parent may read without calling it: a conv
    (Mamba-style ``F.conv1d(x, self.conv1d.weight)``), a linear's weight in a matmul (Mamba's
    ``dt_proj.weight @ x``), an embedding table indexed by hand, a module driven through methods
    other than ``forward`` (JetMoe's ``experts.map``). Norms are always called."""
    style = style_of(child)
    if style is not None and style.read_by_parent:
        return True  # a sharded child with no collective of its own (channelwise)
    if style is None or type(style) is not ReplicateStyle:
        return False  # a sharded child must be called: its hooks do the collectives
    return "norm" not in type(child).__name__.lower()
