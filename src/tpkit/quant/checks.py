"""Can each quantized linear be split as the plan says? Decided before any collective.

Given the plan the split derived (once: a quantization extension's ``prepare`` receives it,
on every rank alike, before any collective), each quantized linear's split is checked against
its format: a 4-bit weight splits only where its blocks of 64 input features do not straddle
two ranks, and only along the output or input features (not by a vocabulary or a style's own
entries). A refusal names the module, the numbers and the fixes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import nn

from tpkit.io.shards import local_ranges
from tpkit.plan import Plan, param_layout, style_spec
from tpkit.quant.scheme import default_skip
from tpkit.styles import placement_for

__all__ = ["check_no_offload", "check_splits"]


def check_splits(
    model: nn.Module, plan: Plan, tp: int, targets: Mapping[str, tuple[str, int]]
) -> None:
    """ValueError listing every quantized linear ``plan`` would split in a way its format
    cannot follow. ``targets``: module name -> (kind, blocksize; 0 for int8)."""
    modules = dict(model.named_modules())
    styles = {t.name: t.style for t in plan.resolve(model) if t.kind == "module"}
    params = {t.name for t in plan.resolve(model) if t.kind == "param"}
    problems = []
    for name, (kind, blocksize) in targets.items():
        if f"{name}.weight" in params or f"{name}.bias" in params:
            problems.append((f"{name}: a plan entry names its parameters; name the module.", name))
            continue
        style = styles.get(name, "replicate")
        problem = _problem(name, modules[name], style, tp, kind, blocksize)
        if problem:
            problems.append((problem, name))
    if problems:
        raise ValueError(
            f"Quantized layers cannot be split at tp={tp} as planned:\n- "
            + "\n- ".join(p for p, _ in problems)
            + "\n"
            + _fixes(model, problems[0][1])
        )


def _fixes(model: nn.Module, name: str) -> str:
    """The three ways out, spelled for the first refused module ``name``."""
    leaf = name.rpartition(".")[2]
    heads = [n.rpartition(".")[2] for n in default_skip(model)]
    group = re.sub(r"\.\d+\.", ".*.", name.rpartition(".")[0] + ".") + "*"
    return (
        f"Keep it in floating point (BitsAndBytesConfig(..., llm_int8_skip_modules="
        f"{[leaf, *heads]!r}): its float weight splits as planned), leave its group whole "
        f"(plan={{{group!r}: 'replicate'}}), or pick a tp size whose slices are whole blocks."
    )


def _problem(name: str, module: nn.Module, style: str, tp: int, kind: str, bs: int) -> str:
    spec = style_spec(style)
    if spec.shard not in ("out", "in", None) or spec.own_entries:
        return f"{name}: a '{style}' split is not one of the output or input features."
    layout = param_layout(style, "weight", 2, module)
    in_f = module.in_features
    if not layout.sharded or not bs:
        return ""  # left whole: bitsandbytes pads the last block itself
    if in_f % bs:
        return (
            f"{name}: split ('{style}'), but its {in_f} input features are not whole {kind} "
            f"blocks of {bs}, so its rows do not start on block boundaries."
        )
    if layout.dim == 0:
        return ""
    placement = placement_for(layout)
    for rank in range(tp):
        for a, b in local_ranges(placement, in_f, tp, rank):
            if a % bs or b % bs:
                return (
                    f"{name}: row-parallel ('{style}') at tp={tp} gives rank {rank} input "
                    f"features [{a}, {b}) of {in_f}: {b - a} is not a multiple of the {kind} "
                    f"block size {bs} (the {in_f // bs} blocks of a row would straddle ranks)."
                )
    return ""


def check_no_offload(options: Any) -> None:
    """FSDP2's CPU offload moves the parameters FSDP2 shards; a quantized linear's packed
    weights are buffers (`tpkit.quant.linear.install`), never sharded, so they would stay on
    each rank's device while the call asked for them on the CPU: refused, before any collective."""
    if options is not None and options.fsdp().cpu_offload:
        raise ValueError(
            "cpu_offload=True (FSDP2's CPUOffloadPolicy) with a bitsandbytes-quantized base: "
            "FSDP2 offloads only the parameters it shards, and the packed 4-/8-bit weights are "
            "not among them (they would stay on the device). Drop cpu_offload (a 4-bit base is "
            "already about 1/8 of its float size), or load the model unquantized to offload it."
        )
