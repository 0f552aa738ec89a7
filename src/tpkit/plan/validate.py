"""Every check that can fail, run before the first collective and identically on every rank.

Each problem becomes one line of a single ``ValueError`` that names the module, the numbers and the
fix, so a bad configuration is one clear error on all ranks instead of a reshape crash in forward or
a hang in a collective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from torch import nn

from tpkit.plan.spec import HEAD_ATTRS, ParamLayout, Plan, param_layout

# Styles whose split dimension is a vocabulary: torch.chunk-style uneven splits are handled.
UNEVEN_OK = {"vocab_parallel", "colwise_gather_output"}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _use(values: Iterable[int]) -> str:
    g = 0
    for v in values:
        g = math.gcd(g, v)
    options = _divisors(g) if g else [1]
    if len(options) == 1:
        return "use tp_size 1"
    return "use tp_size " + ", ".join(map(str, options[:-1])) + f" or {options[-1]}"


def param_layouts(model: nn.Module, plan: Plan) -> dict[str, tuple[str, ParamLayout, nn.Module]]:
    """Full parameter name -> (style, layout, owning module) for every parameter the plan shards
    or replicates explicitly; duplicates (tied parameters) appear under each of their names."""
    module_style: dict[str, str] = {}
    param_style: dict[str, str] = {}
    for t in plan.resolve(model):
        (module_style if t.kind == "module" else param_style)[t.name] = t.style
    out = {}
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{pname}" if mod_name else pname
            style = param_style.get(full) or module_style.get(mod_name) or "replicate"
            out[full] = (style, param_layout(style, pname, p.ndim, module), module)
    return out


def _constraints(model: nn.Module, plan: Plan) -> list[tuple[str, str, int]]:
    """(owner name, label, count) for every number that must be a multiple of tp_size."""
    out: list[tuple[str, str, int]] = []
    layouts = param_layouts(model, plan)
    params = dict(model.named_parameters(remove_duplicate=False))
    for full, (style, layout, _module) in layouts.items():
        if not layout.sharded or style in UNEVEN_OK:
            continue
        size = params[full].shape[layout.dim]
        what = "output features" if style != "rowwise" else "input features"
        if layout.split_factor > 1:
            what = f"{what} per packed part ({layout.split_factor} parts)"
            size //= layout.split_factor
        out.append((f"{full} ({style})", f"the {what} ({size})", size))
    out += _head_constraints(model, plan)
    return out


def _head_constraints(model: nn.Module, plan: Plan) -> list[tuple[str, str, int]]:
    """Head counts of every module whose projections the plan splits by output."""
    modules = dict(model.named_modules())
    owners: dict[str, nn.Module] = {}
    for t in plan.resolve(model):
        if t.kind == "module" and t.style in ("colwise", "packed_colwise") and "." in t.name:
            parent = t.name.rsplit(".", 1)[0]
            owners.setdefault(parent, modules[parent])
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    out, seen = [], set()
    for name, module in owners.items():
        sources = [module]
        if any(k in name.rsplit(".", 1)[-1].lower() for k in ("attn", "attention")):
            # configs hold the model's head counts for every module that keeps a reference
            # to them (an MLP's config has num_attention_heads too): attention modules only
            sources += [getattr(module, "config", None), config]
        for src in sources:
            for attr in HEAD_ATTRS:
                value = _read(src, attr)
                if isinstance(value, int) and value > 0 and (attr, value) not in seen:
                    seen.add((attr, value))
                    out.append((name, f"{attr}={value}", value))
    return out


def _read(obj: object, attr: str) -> object:
    """``getattr(obj, attr, None)``, also None where a heterogeneous transformers config refuses
    a global read of a per-layer attribute (it raises a RuntimeError); the per-layer value is on
    the layer's module or its own config, which are read too."""
    if obj is None:
        return None
    try:
        return getattr(obj, attr, None)
    except RuntimeError:
        return None


def validate(model: nn.Module, plan: Plan, tp_size: int) -> None:
    """Raise one ValueError listing every problem with applying ``plan`` at ``tp_size``.

    An *inferred* column/row group whose counts ``tp_size`` does not divide (e.g. 3 heads at
    tp=2) is not an error: it is set to ``replicate`` in ``plan`` (in place) with a note saying
    why, so the rest of the model is still split. User and transformers entries are never changed.
    """
    problems = _device_map_problems(model)
    problems += _pattern_problems(model, plan)
    if not problems and tp_size > 1:
        settle_inferred_groups(plan, tp_size)
        constraints = _constraints(model, plan) + _fixup_constraints(model, plan)
        fix = _use(c[2] for c in constraints)
        for owner, label, count in constraints:
            if count % tp_size:
                problems.append(f"tp_size={tp_size} does not divide {label} of {owner}; {fix}.")
        problems += _tied_problems(model, plan)
        problems += _identity_expert_problems(model, plan)
        problems += _dtype_problems(model, plan)
        if not problems:
            problems += _user_dataflow_problems(model, plan, tp_size)
    if problems:
        raise ValueError("Cannot apply tensor parallelism:\n- " + "\n- ".join(problems))


def settle_inferred_groups(plan: Plan, tp_size: int) -> list[str]:
    """Replicate every inferred group ``tp_size`` does not divide; return the notes written."""
    written = []
    for group in plan.groups:
        live = [p for p in group["modules"] if p in plan and plan.source(p) == "inferred"]
        if len(live) != len(group["modules"]) or all(plan[p] == "replicate" for p in live):
            continue  # overridden by the user, or already replicated
        bad = [f"{label} = {n}" for label, n in group["counts"].items() if n % tp_size]
        if bad:
            why = f"tp_size={tp_size} does not divide " + ", ".join(bad)
            plan.replicate_group(group, why)
            written.append(why)
    return written


def _fixup_constraints(model: nn.Module, plan: Plan) -> list[tuple[str, str, int]]:
    out = []
    if not plan.fixups:
        return out
    for name, module in model.named_modules():
        for attr in plan.fixups_for(name).get("divide", []):
            value = getattr(module, attr, None)
            if not isinstance(value, int):
                out.append((name, f"attribute {attr} (missing)", 0))
            else:
                out.append((name, f"{attr}={value}", value))
    return out


def _device_map_problems(model: nn.Module) -> list[str]:
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return []
    devices = sorted({str(d) for d in device_map.values()})
    return [
        f"the model was loaded with a device_map (devices {devices}); tensor parallelism places "
        "the shards itself. Load it without device_map, or with tpkit.from_pretrained(path)."
    ]


def _pattern_problems(model: nn.Module, plan: Plan) -> list[str]:
    user = [p for p in plan.unmatched(model) if plan.source(p) == "user"]
    return [
        f"plan pattern {p!r} (style {plan[p]!r}) matches no module or parameter of "
        f"{type(model).__name__}; check the name against `tpkit plan` or model.named_modules()."
        for p in user
    ]


def _identity_expert_problems(model: nn.Module, plan: Plan) -> list[str]:
    """moe_identity_expert divides its input by tp for the experts' all-reduce to add back:
    outside a moe_tp_experts module nothing adds it back."""
    out = []
    for t in plan.resolve(model):
        if t.kind == "module" and t.style == "moe_identity_expert":
            parts = t.name.split(".")
            ancestors = (".".join(parts[:i]) for i in range(1, len(parts)))
            if not any((plan.style_for(a) or ("",))[0] == "moe_tp_experts" for a in ancestors):
                out.append(
                    f"{t.name} is moe_identity_expert but no module above it is moe_tp_experts "
                    "(whose all-reduce restores its input / tp); give its experts module "
                    "moe_tp_experts or the identity expert 'replicate'."
                )
    return out


def _dtype_problems(model: nn.Module, plan: Plan) -> list[str]:
    """Integer (quantized) weights cannot be split by these styles: their bytes are not the
    values a slice of the float weight would hold (packed 4-bit, per-block scales)."""
    out = []
    for full, (style, layout, module) in param_layouts(model, plan).items():
        p = module._parameters[full.rsplit(".", 1)[-1]]
        if layout.sharded and not (p.is_floating_point() or p.is_complex()):
            out.append(
                f"{full} ({style}) holds {p.dtype} values ({type(p).__name__}): quantized or "
                "integer weights cannot be split as float ones; load the model in a float "
                "dtype (dtype=torch.bfloat16) or leave this module replicated."
            )
            if len(out) >= 5:
                break
    return out


def _user_dataflow_problems(model: nn.Module, plan: Plan, tp_size: int) -> list[str]:
    """User entries that the model's dataflow cannot run: a column layer fed by another column
    layer's split output (``down_proj: colwise`` after ``up_proj: colwise``), a row layer fed a
    whole activation. Found by one forward on fake tensors with rank 0's shard shapes (no
    memory, no collectives), only when the user named a module: derived plans are checked when
    they are made."""
    user = [p for p in plan if plan.source(p) == "user"]
    if not user:
        return []
    from tpkit.plan.infer import dry_run, trace

    error = dry_run(model, plan, None, tp_size)
    if error is None or dry_run(model, Plan(), None, tp_size) is not None:
        return []  # runs, or the default trace inputs do not fit this model's forward at all
    hints = []
    try:
        nodes = trace(model)["nodes"]
    except Exception:  # noqa: BLE001 - the dry run's error alone still says what failed
        nodes = {}
    styles = {t.name: t.style for t in plan.resolve(model) if t.kind == "module"}
    column = {"colwise", "packed_colwise", "packed_qkv_colwise"}
    for name, style in styles.items():
        feeders = sorted(s for s in getattr(nodes.get(name), "src", ()) if s in styles)
        split_in = [s for s in feeders if styles[s] in column]
        if style in column and split_in:
            hints.append(
                f"{name} is {style} but its input comes from {split_in[0]} "
                f"({styles[split_in[0]]}), whose output is already split: make {name} rowwise"
            )
        elif style in ("rowwise", "packed_rowwise") and name in nodes and not split_in:
            hints.append(
                f"{name} is {style} but its input is not split by a column layer: make its "
                "producer colwise, or use rowwise_split_input"
            )
    lines = [
        f"the plan (with entries {', '.join(map(repr, user[:4]))}) fails a tp={tp_size} "
        f"forward on fake tensors: {error}"
    ]
    return lines + hints[:3]


def _tied_problems(model: nn.Module, plan: Plan) -> list[str]:
    layouts = param_layouts(model, plan)
    by_id: dict[int, list[str]] = {}
    for full, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(full)
    problems = []
    for names in by_id.values():
        kinds = {layouts[n][1] for n in names}
        if len(names) > 1 and len(kinds) > 1:
            styles = ", ".join(f"{n} ({layouts[n][0]})" for n in names)
            problems.append(
                f"tied parameters would be split differently: {styles}; give them styles that split "
                "the same dimension (vocab_parallel with colwise_gather_output) or untie them."
            )
    return problems
