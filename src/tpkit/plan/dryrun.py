"""The dry run: one forward of the split model on fake tensors, before anything is split.

Each sharded parameter is swapped for a fake meta tensor of rank 0's shard shape, the plan's
fix-ups are applied as the real split applies them (`tpkit.plan.fixups`), and layers whose style
gathers or slices change the widths they hand on (a gathered head, a row layer slicing its own
input). If the model's code still runs, the plan fits it: nothing is allocated, computed or
communicated, so derivation can try plans freely (transformers' plan, the inferred one, one with
a group left whole) and validation can check a user's entries. A failure names the first error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tpkit.compat import FakeTensorMode
from tpkit.plan.fake import (
    REAL_TRACE_MAX_PARAMS,
    fake_friendly_experts,
    fake_inputs,
    meta_state,
    quiet_fake_tensors,
    real_state,
)
from tpkit.plan.fixups import apply_fixups
from tpkit.plan.kvheads import replicate_kv_heads
from tpkit.plan.layout import in_width, kind_of, local_shape, out_width, param_layouts
from tpkit.plan.shadow import ShadowValues, needs_values
from tpkit.plan.spec import Plan

__all__ = ["dry_run", "fewest_replicated"]

_NOTHING_LEARNED = "<nothing learned>"


def dry_run(model: nn.Module, plan: Plan, example: tuple | Mapping | None, tp: int) -> str | None:
    """None when ``model`` runs with ``plan`` at ``tp`` on fake tensors (rank 0's shard shapes,
    fix-ups applied), else the error in brief. A model whose code needs real values (a
    data-dependent branch) is dry-run again with made-up routing values (`tpkit.plan.shadow`),
    then on its real weights with zero shards when it is small, and otherwise counts as
    passing: nothing can be learned without running it."""
    error = _dry_run_once(model, plan, example, tp, real=False)
    if error == _NOTHING_LEARNED:  # data-dependent routing: made-up values (`plan.shadow`)
        error = _dry_run_once(model, plan, example, tp, real=False, values=True)
    if error == _NOTHING_LEARNED:
        params = list(model.parameters())
        real = params and params[0].device.type != "meta"
        small = sum(p.numel() for p in params) <= REAL_TRACE_MAX_PARAMS
        error = _dry_run_once(model, plan, example, tp, real=True) if real and small else None
    return None if error == _NOTHING_LEARNED else error


def _shard_shapes(model: nn.Module, plan: Plan, tp: int) -> dict[int, tuple]:
    """id(parameter) -> rank 0's shard shape, for every parameter the plan splits."""
    layouts = param_layouts(model, plan)
    shapes = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        layout = layouts[name][1]
        if layout.sharded:
            shapes[id(p)] = local_shape(tuple(p.shape), layout, tp)
    return shapes


def _width_hooks(model: nn.Module, plan: Plan, shapes: Mapping[int, tuple]) -> list:
    """A gathered head hands on its full width; a row layer that slices its own input
    (rowwise_split_input) takes only its slice: hooks that do what those styles' collectives
    and slicing do to the shapes."""
    hooks = []
    for t in plan.resolve(model):
        if t.kind != "module":
            continue
        mod = model.get_submodule(t.name)
        kind = kind_of(mod) or "linear"
        if t.style == "vocab_parallel" and getattr(mod, "padding_idx", None) is not None:
            hooks.append(_local_padding(mod, shapes))
        elif t.style == "colwise_replicated_heads":  # this rank's one KV head
            width = out_width(mod, kind) // int(plan.args_for(t.pattern).get("heads", 1))
            hooks.append(mod.register_forward_hook(_widen(width)))
        elif t.style == "colwise_gather_output":
            hooks.append(mod.register_forward_hook(_widen(out_width(mod, kind))))
        elif t.style == "rowwise_split_input":
            local = in_width(mod, kind)
            if id(mod.weight) in shapes:
                local = shapes[id(mod.weight)][0 if kind == "conv1d" else -1]
            hooks.append(mod.register_forward_pre_hook(_narrow(local)))
    return hooks


def _dry_run_once(
    model: nn.Module, plan: Plan, example, tp: int, real: bool, values: bool = False
) -> str | None:
    """None when a forward with rank 0's shapes runs, else the error in brief."""
    plan = plan.copy()
    replicate_kv_heads(model, plan, tp)  # as derivation lays the plan out for this tp
    plan.settle_groups(tp)  # what tp does not divide is validation's to report
    shapes = _shard_shapes(model, plan, tp)
    undo, hooks = (lambda: None), []
    try:  # every temporary change is made inside, so the finally undoes all of them
        undo = apply_fixups(model, plan, tp, 0)
        hooks = _width_hooks(model, plan, shapes)
        fake = None if real else FakeTensorMode(allow_non_fake_inputs=True)
        args, kwargs = fake_inputs(model, example, fake, real)
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
        return _brief(exc)
    finally:
        for h in hooks:
            h.remove()
        undo()


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


def _local_padding(mod: nn.Module, shapes: Mapping[int, tuple]) -> _Restore:
    """A vocab-parallel embedding's ``padding_idx`` as rank 0's rows see it (the style makes it
    local, or None when another rank owns it): F.embedding asserts it is within the shard."""
    rows = shapes.get(id(mod.weight), tuple(mod.weight.shape))[0]
    pad = mod.padding_idx
    return _Restore(mod, "padding_idx", pad if 0 <= pad < rows else None)


def _narrow(local: int):
    def hook(mod: nn.Module, args: tuple):
        if args and isinstance(args[0], torch.Tensor):
            return (args[0][..., :local], *args[1:])
        return args

    return hook


def _widen(full: int):
    def hook(mod: nn.Module, args: tuple, output: Any):
        if isinstance(output, torch.Tensor):
            return output.new_empty((*output.shape[:-1], full))
        return output

    return hook


def fewest_replicated(model: nn.Module, plan: Plan, example, tp: int = 2) -> Plan:
    """``plan`` when it passes a tp dry run; else the plan with the fewest of its inferred groups
    left replicated that makes the model's code run (a global head count read where no fix-up
    reaches, a split output fed to a layer that needs it whole, like LFM2's short convolution),
    each noted with the error. Groups are replicated one more at a time (attention groups
    first) until the dry run passes, then each is given back its split if it still passes."""
    error = dry_run(model, plan, example, tp)
    if error is None:
        return plan
    why = f"a dry run of the split forward failed: {error}"

    def trial(replicated: list[int]) -> Plan:
        out = plan.copy()
        for i in replicated:
            out.replicate_group(plan.groups[i], why)
        return out

    order = sorted(range(len(plan.groups)), key=lambda i: not plan.groups[i]["owners"])
    chosen: list[int] = []
    for i in order:
        chosen.append(i)
        if dry_run(model, trial(chosen), example, tp) is None:
            break
    else:
        return trial(chosen)  # nothing split runs: everything stays replicated, noted
    for i in list(chosen[:-1]):
        rest = [j for j in chosen if j != i]
        if dry_run(model, trial(rest), example, tp) is None:
            chosen = rest
    return trial(chosen)
