"""Tensor parallelism applied: a validated plan on the TP mesh, through torch's
``parallelize_module`` with tpkit's styles, then what rides on it (`apply_tensor_parallel`:
sequence-parallel hooks, per-rank dropout streams, the vocab-parallel loss).

`apply_plan`, in order: parameter entries first (an expert tensor sharded by its own entry), then one style
object per named module and ``Replicate()`` for every other module with parameters (mixed plain
and DTensor parameters break ``clip_grad_norm_``, FSDP2 and DCP), all through one
``parallelize_module`` call; then the parent swaps for children read directly, the plan's
fix-ups (`tpkit.plan.fixups`), the re-tying of tied parameters, and `LocalReplicated` on the
model (replicated parameters local for its whole forward, wherever model code reads them). Each style object is built
with its final options (`StyleOptions`): nothing changes it afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from tpkit.parallel.comm import copy_to_tp
from tpkit.parallel.fsdp import strided_owners
from tpkit.parallel.mesh import sync_rng
from tpkit.parallel.sequence import SequenceParallel
from tpkit.parallel.shm import prepare_shm
from tpkit.plan import Plan, param_layout
from tpkit.plan.catalogue import style_spec
from tpkit.plan.fixups import apply_fixups
from tpkit.plan.layout import tp_regions
from tpkit.styles import (
    ParentSwap,
    ReplicateStyle,
    TPStyle,
    distribute_param,
    make_style,
    read_directly,
    style_of,
)
from tpkit.styles.base import LocalReplicated
from tpkit.training.loss import enable_loss_parallel
from tpkit.training.rng import install_region_rng

__all__ = ["StyleOptions", "apply_plan", "apply_tensor_parallel", "tied_groups"]


def apply_tensor_parallel(
    model: nn.Module,
    plan: Plan,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    mixed_dtype: torch.dtype | None = None,
) -> None:
    """rng sync -> shm -> apply -> sp -> rng -> loss: the TP group's RNG made one, the
    same-host shared-memory path decided (now, so a first call under torch.compile finds it
    too), the styles built with their final options, then the sequence-parallel hooks, the
    per-rank dropout streams and the vocab-parallel loss. ``mixed_dtype``: FSDP2's parameter
    dtype, for the modules whose strided parameters it leaves out (`strided_owners`)."""
    sync_rng(tp_mesh)
    if tp_mesh.device_type == "cpu":
        prepare_shm(tp_mesh.get_group())
    sp = SequenceParallel(model, plan, tp_mesh) if sequence_parallel else None
    compute = dict.fromkeys(strided_owners(model, plan), mixed_dtype) if mixed_dtype else {}
    options = StyleOptions(
        sp=sp.style_sp if sp is not None else {},
        loss_parallel=loss_parallel,
        compute_dtype=compute,
    )
    apply_plan(model, plan, tp_mesh, options)
    if sp is not None:
        sp.install(model)
    install_region_rng(model, _rng_regions(model, plan, sp), tp_mesh.get_local_rank())
    if loss_parallel:
        enable_loss_parallel(model)


def _rng_regions(model: nn.Module, plan: Plan, sp: SequenceParallel | None) -> dict[str, list]:
    """Where dropout must differ across TP ranks: with SP every block (its activations are
    sequence chunks); otherwise each tensor-parallel region, up to its row-parallel layer."""
    if sp is not None:
        names = {id(m): n for n, m in model.named_modules()}
        return {names[id(b)]: [] for b in sp.blocks}
    return tp_regions(model, plan)


@dataclass
class StyleOptions:
    """What tensor_parallel's options change in individual styles, decided before they exist.

    ``sp``: module name -> its block's sequence-parallel state (`tpkit.parallel.sequence`);
    ``loss_parallel``: the head's logits go to the loss vocab-sharded; ``compute_dtype``: module
    name -> the dtype its local parameters are cast to (FSDP2 mixed precision for parameters it
    leaves out)."""

    sp: dict[str, Any] = field(default_factory=dict)
    loss_parallel: bool = False
    compute_dtype: dict[str, torch.dtype] = field(default_factory=dict)

    def for_module(self, name: str, style: str) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if name in self.sp:
            options["sp"] = self.sp[name]
        if name in self.compute_dtype:
            options["compute_dtype"] = self.compute_dtype[name]
        if self.loss_parallel and style == "colwise_gather_output":
            options["loss_parallel"] = True
        return options


def tied_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Each set of (module, parameter name) sharing one parameter object, of two or more."""
    by_id: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for pname, p in module._parameters.items():
            if p is not None:
                by_id.setdefault(id(p), []).append((module, pname))
    return [g for g in by_id.values() if len(g) > 1]


def apply_plan(
    model: nn.Module,
    plan: Plan,
    tp_mesh: DeviceMesh,
    options: StyleOptions | None = None,
) -> dict[str, TPStyle]:
    """Split ``model`` in place as ``plan`` says; return module name -> its style object."""
    options = options or StyleOptions()
    ties = tied_groups(model)
    modules = dict(model.named_modules())
    targets = plan.resolve(model)
    # modules another axis's step places (whole experts on the EP mesh): left alone here, with
    # everything under them
    elsewhere = [t.name for t in targets if t.kind == "module" and style_spec(t.style).axis != "tp"]
    if elsewhere:
        inside = lambda n: any(n == e or n.startswith(f"{e}.") for e in elsewhere)  # noqa: E731
        targets = [t for t in targets if not inside(t.name)]
        modules = {n: m for n, m in modules.items() if not inside(n)}
    for t in targets:
        if t.kind == "param":  # before the module styles, which keep DTensors as they are
            owner, _, pname = t.name.rpartition(".")
            ndim = modules[owner]._parameters[pname].ndim
            layout = param_layout(t.style, pname, ndim, modules[owner])
            distribute_param(modules[owner], pname, layout, tp_mesh)
    styles: dict[str, TPStyle] = {}
    for t in targets:
        if t.kind == "module":
            args = {**plan.args_for(t.pattern), **options.for_module(t.name, t.style)}
            styles[t.name] = make_style(t.style, **args)
            styles[t.name].module_name = t.name
    for name, module in modules.items():
        if name not in styles and any(p is not None for p in module._parameters.values()):
            styles[name] = ReplicateStyle(**options.for_module(name, "replicate"))
            styles[name].module_name = name
    for t in targets:  # a bare parameter on split activations (MLCD's class_pos_emb)
        if t.kind == "param" and t.style == "replicated_with_grad_allreduce":
            owner, _, pname = t.name.rpartition(".")
            styles[owner].allreduce_params |= {pname}
    parallelize_module(model, tp_mesh, styles, src_data_rank=None)
    _install_parent_swaps(model, tp_mesh)
    group = tp_mesh.get_group()
    apply_fixups(  # a per-head input sliced here has partial gradients: f sums them
        model, plan, tp_mesh.size(), tp_mesh.get_local_rank(), lambda t: copy_to_tp(t, group)
    )
    for group in ties:  # distributing replaced each parameter object: share the first again
        first_mod, first_name = group[0]
        shared = first_mod._parameters[first_name]
        for mod, pname in group[1:]:
            mod._parameters[pname] = shared
    LocalReplicated().install(model)  # a replicated parameter read outside its module's forward
    return styles


def _install_parent_swaps(model: nn.Module, mesh: DeviceMesh) -> None:
    """Give each parameter-less module whose children may be read directly the local-tensor
    swap of their replicated parameters for the span of its forward."""
    for module in list(model.modules()):
        if style_of(module) is None and any(read_directly(c) for c in module.children()):
            ParentSwap()._apply(module, mesh)
