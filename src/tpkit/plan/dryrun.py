"""The dry run: one forward of the split model on fake tensors, before anything is split.

Each sharded parameter is swapped for a fake meta tensor of rank 0's shard shape, the plan's
fix-ups are applied as the real split applies them (`tpkit.plan.fixups`), and layers whose style
gathers or slices change the widths they hand on (a gathered head, a row layer slicing its own
input). If the model's code still runs, the plan fits it: nothing is allocated, computed or
communicated, so derivation and settling can try plans freely (transformers' plan, the inferred
one, one with a group gathered or left whole) and validation can check a user's entries. A
failure names the first error. The dry run only answers "does this plan run at tp?"; what to do
when it does not is `tpkit.plan.settle`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tpkit.compat import FakeTensorMode
from tpkit.plan.catalogue import style_spec
from tpkit.plan.fake import (
    REAL_TRACE_MAX_PARAMS,
    fake_friendly_experts,
    fake_inputs,
    meta_state,
    quiet_fake_tensors,
    real_state,
)
from tpkit.plan.fixups import apply_fixups
from tpkit.plan.layout import (
    chunk_offset,
    in_width,
    kind_of,
    local_shape,
    out_width,
    param_layout,
    param_layouts,
)
from tpkit.plan.settle import lay_out
from tpkit.plan.shadow import ShadowValues, needs_values
from tpkit.plan.spec import Plan

__all__ = ["dry_run"]

_NOTHING_LEARNED = "<nothing learned>"


def dry_run(model: nn.Module, plan: Plan, example: tuple | Mapping | None, tp: int) -> str | None:
    """None when ``model`` runs with ``plan`` at ``tp`` on fake tensors (rank 0's shard shapes,
    fix-ups applied; the last rank's too when a split is uneven), else the error in brief. A
    model whose code needs real values (a data-dependent branch) is dry-run again with made-up
    routing values (`tpkit.plan.shadow`), then on its real weights with zero shards when it is
    small, and otherwise counts as passing: nothing can be learned without running it."""
    for rank in (0, tp - 1) if _uneven(model, plan, tp) else (0,):
        error = _dry_run_modes(model, plan, example, tp, rank)
        if error is not None:
            return error
    return None


def _dry_run_modes(model: nn.Module, plan: Plan, example, tp: int, rank: int) -> str | None:
    error = _dry_run_once(model, plan, example, tp, real=False, rank=rank)
    if error == _NOTHING_LEARNED:  # data-dependent routing: made-up values (`plan.shadow`)
        error = _dry_run_once(model, plan, example, tp, real=False, values=True, rank=rank)
    if error == _NOTHING_LEARNED:
        params = list(model.parameters())
        real = params and params[0].device.type != "meta"
        small = sum(p.numel() for p in params) <= REAL_TRACE_MAX_PARAMS
        run = real and small
        error = _dry_run_once(model, plan, example, tp, real=True, rank=rank) if run else None
    return None if error == _NOTHING_LEARNED else error


def _uneven(model: nn.Module, plan: Plan, tp: int) -> bool:
    """Some parameter's shard is smaller on the last rank than on rank 0."""
    layouts = param_layouts(model, plan)
    for name, p in model.named_parameters(remove_duplicate=False):
        layout, shape = layouts[name][1], tuple(p.shape)
        if layout.sharded and local_shape(shape, layout, tp, 0) != local_shape(
            shape, layout, tp, tp - 1
        ):
            return True
    return False


def _shard_shapes(model: nn.Module, plan: Plan, tp: int, rank: int = 0) -> dict[int, tuple]:
    """id(parameter) -> ``rank``'s shard shape, for every parameter the plan splits."""
    layouts = param_layouts(model, plan)
    shapes = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        layout = layouts[name][1]
        if layout.sharded:
            shapes[id(p)] = local_shape(tuple(p.shape), layout, tp, rank)
    return shapes


def _width_hooks(
    model: nn.Module, plan: Plan, shapes: Mapping[int, tuple], tp: int, rank: int
) -> list:
    """A gathered head or table hands on its full width; a row layer that slices its own input
    (rowwise_split_input) takes only its slice: hooks that do what those styles' collectives
    and slicing do to the shapes."""
    hooks = []
    for t in plan.resolve(model):
        if t.kind != "module":
            continue
        mod = model.get_submodule(t.name)
        kind = kind_of(mod) or "linear"
        if t.style == "vocab_parallel" and getattr(mod, "padding_idx", None) is not None:
            hooks.append(_local_padding(mod, shapes, tp, rank))
        elif t.style == "colwise_replicated_heads":  # this rank's one KV head
            width = out_width(mod, kind) // int(plan.args_for(t.pattern).get("heads", 1))
            hooks.append(mod.register_forward_hook(_widen(width)))
        elif style_spec(t.style).collective == "all_gather":  # a gathered head or table
            w = mod.weight
            width = w.shape[param_layout(t.style, "weight", w.ndim, mod).dim]
            conv = isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d))  # gathered on channels
            hooks.append(mod.register_forward_hook(_widen(int(width), w.ndim - 2 if conv else 0)))
        elif t.style == "rowwise_split_input":
            local = in_width(mod, kind)
            if id(mod.weight) in shapes:
                local = shapes[id(mod.weight)][0 if kind == "conv1d" else -1]
            hooks.append(mod.register_forward_pre_hook(_narrow(local)))
    return hooks


def _dry_run_once(
    model: nn.Module,
    plan: Plan,
    example,
    tp: int,
    real: bool,
    values: bool = False,
    rank: int = 0,
) -> str | None:
    """None when a forward with ``rank``'s shapes runs, else the error in brief."""
    plan = plan.copy()
    lay_out(model, plan, tp)  # as settling lays the plan out for this tp, before any trial
    shapes = _shard_shapes(model, plan, tp, rank)
    undo, hooks, running = (lambda: None), [], []
    try:  # every temporary change is made inside, so the finally undoes all of them
        undo = apply_fixups(model, plan, tp, rank)
        hooks = _width_hooks(model, plan, shapes, tp, rank)
        fake = None if real else FakeTensorMode(allow_non_fake_inputs=True)
        args, kwargs = fake_inputs(model, example, fake, real)
        hooks += _where(model, running)
        with quiet_fake_tensors(), torch.no_grad():
            if real:
                with real_state(model, shapes):
                    model(*args, **kwargs)
            else:
                shadow = ShadowValues(fake) if values else contextlib.nullcontext()
                with meta_state(model, fake, shapes), fake_friendly_experts(model), fake, shadow:
                    model(*args, **kwargs)
        return None
    except Exception as exc:  # noqa: BLE001 - whatever the model's code raises
        error = _brief(exc)
        inner = running[-1] if running else ""
        return f"in {inner}: {error}" if inner and error != _NOTHING_LEARNED else error
    finally:
        for h in hooks:
            h.remove()
        undo()


def _where(model: nn.Module, running: list[str]) -> list:
    """Hooks keeping ``running`` the stack of modules whose forward is running, so a failure
    names the innermost one (the attention whose reshape does not fit its shard)."""

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        running.pop()  # returns None: a forward hook's return value replaces the output

    hooks = []
    for name, mod in model.named_modules():
        if name:
            hooks.append(mod.register_forward_pre_hook(lambda m, a, n=name: running.append(n)))
            hooks.append(mod.register_forward_hook(leave))
    return hooks


def _brief(exc: Exception) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    if needs_values(exc):
        return _NOTHING_LEARNED  # the fake forward cannot run this model at all
    return f"{type(exc).__name__}: {first[:160]}"


class _Restore:
    """A temporary attribute change with a hook's ``remove()``, undone with the hooks."""

    def __init__(self, module: nn.Module, attr: str, value: Any):
        self.module, self.attr, self.saved = module, attr, getattr(module, attr)
        setattr(module, attr, value)

    def remove(self) -> None:
        setattr(self.module, self.attr, self.saved)


def _local_padding(mod: nn.Module, shapes: Mapping[int, tuple], tp: int, rank: int) -> _Restore:
    """A vocab-parallel embedding's ``padding_idx`` as ``rank``'s rows see it (the style makes
    it local, or None when another rank owns it): F.embedding asserts it is within the shard."""
    rows = shapes.get(id(mod.weight), tuple(mod.weight.shape))[0]
    start = chunk_offset(mod.weight.shape[0], tp, rank)
    pad = mod.padding_idx - start
    return _Restore(mod, "padding_idx", pad if 0 <= pad < rows else None)


def _narrow(local: int):
    def hook(mod: nn.Module, args: tuple):
        if args and isinstance(args[0], torch.Tensor):
            return (args[0][..., :local], *args[1:])
        return args

    return hook


def _widen(full: int, kernel_dims: int = 0):
    def hook(mod: nn.Module, args: tuple, output: Any):
        if isinstance(output, torch.Tensor):
            shape = list(output.shape)
            shape[-1 - kernel_dims] = full  # a convolution's channels sit before its kernel dims
            return output.new_empty(shape)
        return output

    return hook
