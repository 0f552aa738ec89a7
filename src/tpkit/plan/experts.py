"""Experts held as 3-D parameters ``[experts, ., .]``: which of their dims inference splits.

Two kinds are recognised, both split along each expert's intermediate width I, so that every
rank runs every expert on its slice of I and the module's output is a partial sum that
``moe_tp_experts`` all-reduces (f on its float inputs, g on its output):

- transformers' fused experts, read from the layout flags the module declares about itself
  (`fused_experts`);
- experts a module keeps as its own 3-D parameters and applies with ``bmm`` (Inkling's shared
  experts: gate and up ``[E, I, H]``, down ``[E, H, I]``), recognised by their shapes and then
  checked by running the module once on small random weights (`bmm_experts`).

Pure torch, no process group: plan/ runs on a laptop, on meta.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

__all__ = ["bmm_experts", "expert_groups", "fused_experts"]

#: The intermediate width the check of `bmm_experts` runs with (split 2 + 2).
_PROBE_INTER = 4


def expert_groups(
    model: nn.Module, info: dict, exclude: set[str], styles: dict, why: dict
) -> list[dict]:
    """Add the styles of every experts module (not in ``exclude``, not styled yet) to
    ``styles``; return their groups, each with the intermediate width tp must divide. Fused
    experts with parameters of their own after the projections (Ergo's per-expert RMSNorm of
    each route's output) stay whole, with the reason in ``why``: that norm would read each
    rank's partial sum, before the all-reduce."""
    groups = []
    for name, mod in model.named_modules():
        if name in exclude:
            continue
        entries, inter = fused_experts(mod), 0
        extra = [n for n, c in mod.named_children() if any(True for _ in c.parameters())]
        if entries and extra:
            why[name] = (
                f"its {extra[0]} has parameters and acts inside the experts module, on each "
                "rank's partial sum before the all-reduce"
            )
            continue
        if entries:
            counts = _fused_counts(name, mod, entries)
        elif name not in styles:
            entries, inter = bmm_experts(mod, info["module_inputs"].get(name, []))
            counts = {f"intermediate size of {name}": inter}
        if entries:
            styles[name] = "moe_tp_experts"
            styles.update({f"{name}.{p}": style for p, style in entries.items()})
            groups.append(
                {
                    "modules": [name, *(f"{name}.{p}" for p in entries)],
                    "owners": [],
                    "counts": counts,
                }
            )
    return groups


def _fused_counts(name: str, mod: nn.Module, entries: dict[str, str]) -> dict[str, int]:
    """What tp must divide for fused experts, said truthfully so that settling keeps whole only
    what an uneven split would get wrong. Each expert's intermediate width I is produced by the
    up (and gate) projection and read by the down projection one channel at a time
    (``act(gate) * up`` is elementwise), so a split of I into torch.chunk sizes is exact: a
    packed [gate; up] is split per part (rank r: chunk r of gate and chunk r of up; its
    ``chunk(2)`` still pairs them), down's I the same chunks. The counts name those parameters
    (``output features of <up>``, ``input features of <down>``), whose styles the catalogue
    marks uneven-ok. Interleaved gate/up (GPT-OSS: g0 u0 g1 u1 ...) split unevenly would cut a
    pair: there I itself must divide."""
    inter = _fused_inter(mod)
    d = mod.__dict__
    if d["has_gate"] and not d["is_concatenated"]:
        return {f"intermediate size of {name}": inter}
    up = "gate_up_proj" if d["has_gate"] else "up_proj"
    return {
        f"output features of {name}.{up}": inter,
        f"input features of {name}.down_proj": inter,
    }


def fused_experts(mod: nn.Module) -> dict[str, str]:
    """Styles for the 3-D weights of a transformers fused-experts module, read from what the
    module declares about itself (``use_experts_implementation``: ``has_gate``,
    ``is_concatenated`` [gate; up] or interleaved, ``is_transposed``, ``has_bias``): each
    expert's up (and gate) projection column-parallel, its down projection row-parallel.
    {} for any other module."""
    d = mod.__dict__
    if not all(isinstance(d.get(k), bool) for k in ("has_gate", "is_concatenated")):
        return {}
    up = "gate_up_proj" if d["has_gate"] else "up_proj"
    params = dict(mod.named_parameters(recurse=False))
    if params.get(up) is None or params[up].ndim != 3 or params.get("down_proj") is None:
        return {}
    # styles name raw dims, as in transformers' plans (see layout.param_layout): the output dim
    # of gate_up is -2 ("colwise") or, transposed, -1 ("rowwise"); its 2-D bias [E, out] -1
    packed = "packed_" if d["has_gate"] and d["is_concatenated"] else ""
    transposed = d.get("is_transposed") is True
    out = {
        up: f"{packed}{'rowwise' if transposed else 'colwise'}",
        "down_proj": "colwise" if transposed else "rowwise",
    }
    if f"{up}_bias" in params:
        out[f"{up}_bias"] = f"{packed}rowwise"
    return out


def _fused_inter(mod: nn.Module) -> int:
    """Each expert's intermediate width, from its down projection."""
    w = mod.down_proj
    return int(w.shape[1] if mod.__dict__.get("is_transposed") else w.shape[2])


def bmm_experts(mod: nn.Module, inputs: list[tuple[str, tuple, Any]]) -> tuple[dict[str, str], int]:
    """Styles and I for a module whose own parameters are all 3-D with the same E and have
    one dim H (the width of its first input, from the trace's ``inputs``) and one other dim I,
    the same for all; ({}, 0) for any other module, and where H == I (nothing says which to
    split). Splitting I in each parameter is exact whichever way each is stored (``x W^T`` or
    ``x W``) when I is produced by the first products and summed by the last, so the module's
    output is the sum of what its slices of I give. Shapes cannot tell that (a residual added
    inside the module, or a norm over I, would break it), so `_sums_over_slices` checks it by
    running the module once on small random weights. Raw dims as in transformers' plans: I at
    -2 is "colwise", at -1 "rowwise"."""
    params = dict(mod.named_parameters())
    width = int(inputs[0][1][-1]) if inputs and inputs[0][1] else 0
    if width <= 0 or len(params) < 2 or any(p.ndim != 3 for p in params.values()):
        return {}, 0
    if len({p.shape[0] for p in params.values()}) != 1 or len(params) != len(mod._parameters):
        return {}, 0
    inner = {int(d) for p in params.values() for d in p.shape[1:] if d != width}
    if len(inner) != 1 or any(width not in p.shape[1:] for p in params.values()):
        return {}, 0
    inter = inner.pop()
    styles = {n: "colwise" if p.shape[1] == inter else "rowwise" for n, p in params.items()}
    return (styles, inter) if _sums_over_slices(mod, inputs, styles) else ({}, 0)


def _sums_over_slices(mod: nn.Module, inputs: list[tuple[str, tuple, Any]], styles: dict) -> bool:
    """Run ``mod`` on random float32 inputs of the traced shapes with random weights whose I is
    `_PROBE_INTER`, once whole and once per half of I: True when the halves' outputs add up to
    the whole one. False when the module cannot run that way (a positional input the trace did
    not record, code that reads I from elsewhere): then it stays whole."""
    args, kwargs = [], {}
    g = torch.Generator().manual_seed(0)
    for key, shape, _ in inputs:
        kind, k = key.split(":", 1)
        x = torch.randn(shape, generator=g)
        if kind == "kw":
            kwargs[k] = x
        elif int(k) != len(args):
            return False
        else:
            args.append(x)
    whole = {}
    for n, p in mod.named_parameters():
        shape = list(p.shape)
        shape[1 if styles[n] == "colwise" else 2] = _PROBE_INTER
        whole[n] = torch.randn(shape, generator=g) / 2
    half = _PROBE_INTER // 2

    def run(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        with _swapped(mod, weights), torch.no_grad():
            out = mod(*args, **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{type(mod).__name__} returned {type(out).__name__}")
        return out.float()

    try:
        full = run(whole)
        parts = [
            run(
                {
                    n: w.narrow(1 if styles[n] == "colwise" else 2, lo, half)
                    for n, w in whole.items()
                }
            )
            for lo in (0, half)
        ]
    except Exception:  # noqa: BLE001 - any failure means "not this pattern": left whole
        return False
    total = parts[0] + parts[1]
    if full.shape != total.shape:
        return False
    # float32 sums in another order: relative to the largest value (a residual inside the
    # module, the case this rules out, is off by the whole input)
    return bool((full - total).abs().max() <= 1e-4 * max(1.0, float(full.abs().max())))


@contextlib.contextmanager
def _swapped(mod: nn.Module, weights: dict[str, torch.Tensor]):
    saved = dict(mod._parameters)
    try:
        mod._parameters.update(weights)
        yield
    finally:
        mod._parameters.update(saved)
