"""What the model's trace never ran: towers planned on their own, other layers split per layer.

A multimodal model's plan comes from one trace of the whole model on made-up inputs. Where its
tower inputs cannot be made (an audio tower whose feature length a default config's own
formula rejects, a vision tower that takes pre-flattened patches and a grid), the trace runs on
the text alone (`tpkit.trace.inputs`, ``text_only``), and the towers, never called, get no
entry: Voxtral's 637M-parameter audio tower, MOSS-Transcribe's, GIT's vision encoder stayed
whole at full size (shares 0.51-0.86). transformers builds its plans the same way per
sub-model (`init_parallel_plans`): each tower is a model of its own, with its own config and
main input. So each such tower (a sub-module with a ``config`` and a ``main_input_name``, none
of whose modules the trace called and none the plan names) is planned as the model it is
(``derive``: tpkit's whole derivation on the tower alone: its transformers plan, its own
trace on inputs made from its config, else the per-layer fallback), and its entries join the
plan under its path.

Exact for the same reason each of those plans is: a tower's plan takes its input whole and
hands its output on whole (row layers all-reduce, gathered layers gather), which is how its
parent calls it. A tower whose weights the parent reads outside the tower would break that;
the trace of the whole model would have said so, and such a tower was called by it.

Layers outside such towers that the trace never ran and no entry names (Longformer's
global-attention projections, used only under a global mask) take the per-layer fallback's
split (`tpkit.sources.fallback`: whole input, output gathered): exact whatever code runs around
them. Only those styles: a paired split needs a trace of the pair. Not tables: a table's
weight is often read without a call (a vision tower's position table, interpolated to the
image grid), and a split one read so is a DTensor amid plain tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn

from tpkit.plan.catalogue import style_spec
from tpkit.plan.spec import Group, Plan

__all__ = ["complete_towers", "complete_untraced_layers"]

_OF = re.compile(r"^(?P<what>.* of )(?P<name>.+)$")


def complete_towers(
    model: nn.Module, plan: Plan, called: set[str], derive: Callable[[nn.Module], Plan]
) -> Plan:
    """``plan`` with the plan ``derive`` gives each untraced tower of ``model`` joined under its
    path (see the module docstring; a new plan); ``called``: the modules the model's trace
    ran."""
    plan = plan.copy()
    named = [t.name for t in plan.resolve(model)]
    done: list[str] = []
    for name, sub in model.named_modules():
        if not name or not _is_tower(sub) or any(name.startswith(f"{d}.") for d in done):
            continue
        inside = {f"{name}.{n}" if n else name for n, _ in sub.named_modules()}
        if inside & called or any(n in inside for n in named):
            continue
        try:
            sub_plan = derive(sub)
        except Exception:  # noqa: BLE001 - a tower no derivation plans stays whole, as before
            continue
        if _join(plan, sub_plan, name, sub):
            done.append(name)
    if done:
        plan.notes[type(model).__name__ + " towers"] = (
            "planned on their own, the model's trace never ran them: " + ", ".join(done)
        )
    return plan


def complete_untraced_layers(
    model: nn.Module, plan: Plan, called: set[str], fallback: Plan
) -> Plan:
    """``plan`` with ``fallback``'s entry added for each layer the trace never ran (not in
    ``called``) that no entry of ``plan`` names, nor a module above it, when that entry splits
    the layer on its own with a whole input and a gathered output (role "whole":
    ``colwise_gather_output``, ``conv_colwise_gather``; a new plan). Tables (``nn.Embedding``,
    ``nn.EmbeddingBag``) are never added, whatever the fallback gives them: no trace saw how
    their weight is read. ``called`` holds, with the layers the trace ran, those holding a
    weight one of them holds (`tpkit.plan.derive`): that one's entry lays the weight out."""
    plan = plan.copy()
    modules = dict(model.named_modules())
    for name in fallback:
        if name in called or style_spec(fallback[name]).role != "whole":
            continue
        if isinstance(modules.get(name), (nn.Embedding, nn.EmbeddingBag)):
            continue  # a table's weight is often read without a call (interpolated positions)
        parts = name.split(".")
        if any(plan.style_for(".".join(parts[:i])) for i in range(1, len(parts) + 1)):
            continue
        plan.set(name, fallback[name], fallback.source(name), fallback.args.get(name))
        plan.notes[name] = "per-layer fallback: the model's trace never ran it"
    return plan


def _is_tower(module: nn.Module) -> bool:
    return getattr(module, "config", None) is not None and isinstance(
        getattr(module, "main_input_name", None), str
    )


def _join(plan: Plan, sub: Plan, prefix: str, tower: nn.Module) -> bool:
    """``sub``'s entries, arguments, fix-ups, notes and groups under ``prefix``; False when it
    splits nothing (then nothing is added). A table the tower's per-layer fallback splits is
    left out: no trace saw how its weight is read (a position table interpolated by hand)."""
    modules = dict(tower.named_modules())
    unseen = {
        p
        for p in sub
        if sub.source(p) == "fallback"
        and isinstance(modules.get(p), (nn.Embedding, nn.EmbeddingBag))
    }
    if all(style == "replicate" for p, style in sub.items() if p not in unseen):
        return False
    for pattern, style in sub.items():
        if pattern in unseen:
            continue
        full = f"{prefix}.{pattern}"
        plan.set(full, style, sub.source(pattern), sub.args.get(pattern))
    plan.fixups.update((f"{prefix}.{k}", v) for k, v in sub.fixups.items())
    plan.notes.update((f"{prefix}.{k}", v) for k, v in sub.notes.items())
    for g in sub.groups:
        plan.groups.append(
            Group(
                tuple(f"{prefix}.{m}" for m in g.modules),
                tuple(f"{prefix}.{o}" for o in g.owners),
                {_label(label, prefix): n for label, n in g.counts.items()},
            )
        )
    return True


def _label(label: str, prefix: str) -> str:
    """A group count's label under ``prefix``: ``output features of X`` names a module after
    "of", ``X.num_heads`` starts with one."""
    m = _OF.match(label)
    return f"{m['what']}{prefix}.{m['name']}" if m else f"{prefix}.{label}"
