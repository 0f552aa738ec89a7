"""A rank's experts read from a checkpoint that stores one tensor per expert.

transformers 5 keeps fused experts (``experts.gate_up_proj [E, 2I, H]``) in memory but saves and
ships them per expert (``experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``), fusing them
at load time with its conversion mapping: ``MergeModulelist(dim=0)`` (stack the experts), then
``Concatenate(dim=d)`` (gate beside up). Under expert parallelism each rank holds whole experts,
``Shard(0)``, so it needs only its own experts' tensors: `expert_recipes` reads the mapping into
one `ExpertRecipe` per fused parameter (its per-expert keys, the concatenation dim), and
`stream_experts` reads the rank's experts' keys straight into its shard. A conversion of any
other form (or keys that are not all there) gives no recipe, and the loader takes transformers'
full load instead, as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from tpkit.io.safetensors import CheckpointIndex
from tpkit.io.shards import local_ranges, param_owners, set_local, tp_coords

__all__ = ["ExpertRecipe", "expert_recipes", "stream_experts"]


@dataclass(frozen=True)
class ExpertRecipe:
    """How one fused parameter ``[E, ...]`` is built from per-expert checkpoint tensors: expert
    e is ``cat([keys[e][0], keys[e][1], ...], dim)`` (one key per source pattern)."""

    keys: tuple[tuple[str, ...], ...]
    dim: int


def _ops(converter) -> int | None:
    """The per-expert concatenation dim of a converter that is MergeModulelist(dim=0) and
    optionally Concatenate(dim=d) (d - 1: the expert dim is not there yet); None otherwise."""
    names = [type(op).__name__ for op in converter.operations]
    if names == ["MergeModulelist"] and converter.operations[0].dim == 0:
        return 0
    if names == ["MergeModulelist", "Concatenate"] and converter.operations[0].dim == 0:
        d = converter.operations[1].dim
        return d - 1 if d >= 1 else None
    return None


def expert_recipes(model: nn.Module, index: CheckpointIndex, names: list[str]) -> dict | None:
    """Parameter name -> `ExpertRecipe` for each of ``names`` (parameters the checkpoint does not
    store under their own names); None when one of them has no recipe (another conversion,
    or an expert's key missing)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:
        return None
    converters = [c for c in get_model_conversion_mapping(model) if isinstance(c, WeightConverter)]
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name in names:
        recipe = None
        for conv in converters:
            dim = _ops(conv)
            target = conv.target_patterns[0] if len(conv.target_patterns) == 1 else None
            if dim is None or target is None or not name.endswith(target.replace("\\", "")):
                continue
            recipe = _recipe(name, target, conv.source_patterns, dim, params[name], index)
            if recipe is not None:
                break
        if recipe is None:
            return None
        out[name] = recipe
    return out


def _recipe(name, target, sources, dim, param, index) -> ExpertRecipe | None:
    prefix = name[: len(name) - len(target.replace("\\", ""))]
    keys = []
    for e in range(param.shape[0]):
        row = []
        for src in sources:
            key = prefix + src.replace("*", str(e))
            if key not in index.entries and re.sub(r"^model\.", "", key) in index.entries:
                key = re.sub(r"^model\.", "", key)
            if key not in index.entries:
                return None
            row.append(key)
        keys.append(tuple(row))
    return ExpertRecipe(tuple(keys), dim)


def stream_experts(
    model: nn.Module, index: CheckpointIndex, recipes: dict[str, ExpertRecipe], device
) -> list[str]:
    """Read each recipe parameter's local experts (its ``Shard(0)`` rows) from their per-expert
    keys into a fresh shard on ``device``; return the names of recipe parameters that are not
    split by experts (none, when expert parallelism placed them all)."""
    left = []
    for owners in param_owners(model).values():
        module, pname, full = owners[0]
        if full not in recipes:
            continue
        p = module._parameters[pname]
        placement, ep, rank = tp_coords(p)
        if not (isinstance(p, DTensor) and isinstance(placement, Shard) and placement.dim == 0):
            left.append(full)
            continue
        recipe = recipes[full]
        ((lo, hi),) = local_ranges(placement, p.shape[0], ep, rank)
        local = torch.empty((hi - lo, *p.shape[1:]), dtype=p.dtype, device=device)
        for e in range(lo, hi):
            parts = [index.read(k, dtype=p.dtype) for k in recipe.keys[e]]
            local[e - lo] = torch.cat(parts, recipe.dim) if len(parts) > 1 else parts[0]
        new = set_local(module, pname, local)
        for mod, name, _ in owners[1:]:
            mod._parameters[name] = new
    return left
