"""Which modules FSDP2 makes units of and how each reshards (the FSDP plan), and the checks of
FSDP2's settings that run before any collective.

The plan is transformers' spelling: ``{module pattern: "free_full_weight" | "keep_full_weight"}``
(``*`` stands for one name segment, e.g. ``"model.layers.*"``). A ``free`` unit's gathered
weights are freed after its forward and gathered again for its backward (``reshard_after_forward``);
a ``keep`` unit holds them from forward to backward (one all-gather less, more memory). The
model's own plan (transformers' ``model.fsdp_plan``: the class ``_fsdp_plan`` over the config's
``base_model_fsdp_plan``) is read where its patterns name modules the model has; a user's plan is
merged over it. Every repeated block no unit covers gets a ``free`` unit of its own, and the root
is the last unit, so any plan shards the blocks one by one.

Two rules make any plan safe to apply:

- a unit whose parameter is also used outside it (an embedding tied to the head) is dropped: the
  shared weight falls to the root's unit, gathered for the whole forward. (FSDP2 frees a unit's
  weights after its forward; the head would read the embedding's shard.)
- units are applied innermost first: FSDP2 needs a submodule sharded before its parent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tpkit.parallel.dims import ParallelDims
from tpkit.state import FSDPOptions
from tpkit.trace.trace import repeated_blocks

__all__ = ["FSDP_STYLES", "FSDPUnit", "fsdp_problems", "fsdp_units", "model_fsdp_plan"]

#: transformers' FSDP plan styles
FSDP_STYLES = ("free_full_weight", "keep_full_weight")


@dataclass(frozen=True)
class FSDPUnit:
    """One ``fully_shard`` call: a module and whether it keeps its gathered weights."""

    name: str
    module: nn.Module
    keep: bool


def _pattern(key: str) -> re.Pattern:
    return re.compile(re.escape(key).replace(r"\*", r"[^.]+"))


def _matches(names: list[str], key: str) -> list[str]:
    pattern = _pattern(key)
    return [n for n in names if pattern.fullmatch(n)]


def model_fsdp_plan(model: nn.Module) -> dict[str, str]:
    """The model's own FSDP plan (transformers' ``model.fsdp_plan``), the patterns that name
    none of its modules left out: transformers' config-wide default (``embed_tokens``,
    ``layers.*``, ``norm``) is on every config, GPT-2's included, whose modules are named
    otherwise."""
    own = getattr(model, "fsdp_plan", None)
    if not isinstance(own, Mapping):
        return {}
    names = [n for n, _ in model.named_modules() if n]
    return {
        k: v
        for k, v in own.items()
        if isinstance(k, str) and v in FSDP_STYLES and _matches(names, k)
    }


def fsdp_problems(
    model: nn.Module,
    options: FSDPOptions,
    dims: ParallelDims,
    sharded: bool,
    mesh: DeviceMesh | None = None,
) -> list[str]:
    """What is wrong with FSDP2's settings for this run, before any collective: settings asked
    where FSDP2 is not applied, plan styles it does not know and patterns naming no module, and a
    user's mesh that has no 2-D data mesh for HSDP."""
    applied = sharded and dims.dp * dims.cp > 1  # FSDP2 shards over dp_shard x cp
    found = []
    asked = [a for a in options.asked if not a.startswith("mixed_precision")]
    if options.mixed_precision is not None and options.param_dtype is None:
        asked.append(f"mixed_precision={options.mixed_precision}")
    if asked and not applied:
        why = "sharded=False" if dims.dp * dims.cp > 1 else "dp_size=1: no data axis to shard over"
        found.append(
            f"{', '.join(asked)}: FSDP2's settings, but FSDP2 is not applied ({why}); use "
            "dp_shard_size > 1 (or dp_replicate_size x dp_shard_size) with sharded=True, or drop "
            "them."
        )
    if options.plan is not None:
        found += _plan_problems(model, options.plan)
    names = mesh.mesh_dim_names or () if mesh is not None else ()
    shard_axis = "dp_shard" in names or "cp" in names  # FSDP's shard dim: dp_shard x cp
    if applied and mesh is not None and dims.dp_replicate > 1 and not shard_axis:
        found.append(
            f"the mesh {tuple(names)} has dp_replicate={dims.dp_replicate} and no 'dp_shard' "
            "dimension: HSDP needs the 2-D data mesh (dp_replicate, dp_shard); add a 'dp_shard' "
            "dimension (size 1 for replicas whose gradients FSDP2 all-reduces), or pass "
            "sharded=False for replicas nothing synchronizes."
        )
    return found


def _plan_problems(model: nn.Module, plan: Mapping[str, str]) -> list[str]:
    if not isinstance(plan, Mapping):
        return [f"fsdp_plan must be a dict of module pattern -> style, got {type(plan).__name__}."]
    names = [n for n, _ in model.named_modules() if n]
    found = []
    for key, style in plan.items():
        if style not in FSDP_STYLES:
            found.append(f"fsdp_plan[{key!r}] = {style!r}: the styles are {FSDP_STYLES}.")
        elif not isinstance(key, str) or not _matches(names, key):
            found.append(
                f"fsdp_plan key {key!r} names no module of {type(model).__name__} (patterns are "
                "module names, '*' one segment, e.g. 'model.layers.*')."
            )
    return found


def fsdp_units(
    model: nn.Module, plan: Mapping[str, str] | None = None, ignored: set | frozenset = frozenset()
) -> list[FSDPUnit]:
    """The units FSDP2 wraps before the root, innermost first (module docstring): the model's
    own plan with ``plan`` over it, every uncovered repeated block, tied units dropped.
    ``ignored``: parameters FSDP2 leaves out (they belong to no unit)."""
    merged = {**model_fsdp_plan(model), **dict(plan or {})}
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    chosen: dict[str, bool] = {}
    for key, style in merged.items():
        for name in _matches(names, key):
            chosen[name] = style == "keep_full_weight"
    by_id = {id(m): n for n, m in modules.items()}
    for block in repeated_blocks(model):
        name = by_id.get(id(block))
        if name is not None and not any(name == c or name.startswith(c + ".") for c in chosen):
            chosen[name] = False
    owners, skip = _owners(model), {id(p) for p in ignored}
    pair = _tied_later(model, modules)
    ordered = sorted(chosen, key=lambda n: -n.count("."))
    units, claimed = [], set()
    for name in ordered:
        own = [p for p in modules[name].parameters() if id(p) not in claimed and id(p) not in skip]
        if not own or any(not _inside(o, name) for p in own for o in owners[id(p)]):
            continue  # nothing of its own, or a weight shared outside it (module docstring)
        if len({_inside(t, name) for t in pair}) > 1:
            continue  # one of the embeddings the config ties (maybe after the split: accelerate)
        claimed.update(id(p) for p in own)
        units.append(FSDPUnit(name, modules[name], chosen[name]))
    return units


def _tied_later(model: nn.Module, modules: dict[str, nn.Module]) -> list[str]:
    """The input and output embeddings' module names when the config ties them, tied yet or not:
    a model built inside accelerate's ``init_empty_weights`` is tied by ``tie_weights()`` after
    the split, and a weight in two FSDP units is untied by FSDP2's next unshard."""
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    if not getattr(text, "tie_word_embeddings", False):
        return []
    try:
        found = [model.get_input_embeddings(), model.get_output_embeddings()]
    except (AttributeError, NotImplementedError):
        return []
    by_id = {id(m): n for n, m in modules.items()}
    names = [by_id.get(id(m)) for m in found if m is not None]
    return [n for n in names if n is not None] if len(names) == 2 else []


def _owners(model: nn.Module) -> dict[int, list[str]]:
    """Each parameter's holders: every module that has it as its own (a tied weight: several)."""
    out: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                out.setdefault(id(p), []).append(name)
    return out


def _inside(owner: str, unit: str) -> bool:
    return owner == unit or owner.startswith(unit + ".")
