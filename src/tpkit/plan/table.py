"""`explain`: a plan as a table a person can read, with what it costs per rank.

What `tpkit plan` prints: every sharded parameter with its global -> local shape, the share of
parameter bytes sharded, bytes per rank, the collectives one forward issues, the fix-ups applied
per rank and why modules stay replicated. Repeated layers collapse into one row group
(``layers.*``) so a 32-layer model reads like a 1-layer one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from torch import nn

from tpkit.plan.catalogue import style_spec
from tpkit.plan.fixups import shard_width_fixups
from tpkit.plan.layout import ParamLayout, local_shape, param_layout, param_styles
from tpkit.plan.spec import Plan

__all__ = ["collectives_per_forward", "expert_params", "explain", "human_bytes"]


def expert_params(plan: Plan, model: nn.Module) -> dict[str, tuple[str, str]]:
    """Full parameter name -> (EP style, source) for every parameter an experts module under
    expert parallelism splits by experts (its entry's ``params`` argument)."""
    out = {}
    for t in plan.resolve(model):
        if t.kind == "module" and style_spec(t.style).axis == "ep":
            for rel in plan.args_for(t.pattern).get("params", ()):
                out[f"{t.name}.{rel}"] = (t.style, t.source)
    return out


def _param_rows(plan: Plan, model: nn.Module) -> Iterable[tuple[str, nn.Module, str, object, str]]:
    """(full name, owning module, style, parameter, source) once per distinct parameter."""
    styles = {**param_styles(model, plan), **expert_params(plan, model)}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            style, source = styles[full]
            if style_spec(style).own_entries:
                style = "replicate"  # the module's style leaves its parameters be
            yield full, module, style, p, source


def _generic(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def explain(plan: Plan, model: nn.Module | None = None, tp_size: int = 1, ep_size: int = 1) -> str:
    """Without a model: the plan's entries. With one: the table described in the module doc;
    the weights of experts modules under expert parallelism split by experts over ``ep_size``
    ranks (their whole experts: rank 0's share shown)."""
    if model is None:
        rows = [(p, s, "", plan.source(p)) for p, s in plan.items()]
        return _table(("pattern", "style", "", "source"), rows)
    rows: dict[tuple, list[str]] = {}
    total = per_rank = sharded = n_replicated = 0
    for full, module, style, p, source in _param_rows(plan, model):
        expert = style_spec(style).axis == "ep"
        layout = (
            ParamLayout(0)
            if expert
            else param_layout(style, full.rsplit(".", 1)[-1], p.ndim, module)
        )
        loc = local_shape(tuple(p.shape), layout, ep_size if expert else tp_size)
        nbytes = p.numel() * p.element_size()
        total += nbytes
        per_rank += nbytes * math.prod(loc) // max(1, p.numel())
        if not layout.sharded:
            n_replicated += 1
            continue
        sharded += nbytes
        key = (_generic(full), style, f"{tuple(p.shape)} -> {loc}", source)
        rows.setdefault(key, []).append(full)
    table = [
        (name if len(names) == 1 else f"{name} (x{len(names)})", style, shapes, source)
        for (name, style, shapes, source), names in rows.items()
    ]
    n_sharded = sum(len(v) for v in rows.values())
    comms = collectives_per_forward(plan, model, tp_size)
    if ep_size > 1:
        n_ep = sum(1 for t in plan.resolve(model) if style_spec(t.style).axis == "ep")
        if n_ep:
            comms["all_to_all / all_reduce (expert dispatch)"] = n_ep
    sizes = f"tp_size={tp_size}" + (f", ep_size={ep_size}" if ep_size > 1 else "")
    lines = [
        _table(("parameter", "style", "global -> local shape", "source"), table),
        "",
        f"{sizes}: {n_sharded} parameters sharded, {n_replicated} replicated; "
        f"{100.0 * sharded / max(1, total):.1f}% of parameter bytes sharded",
        f"bytes per rank: {human_bytes(per_rank)} of {human_bytes(total)} "
        f"({per_rank / max(1, total):.3f} of the unsharded model)",
        "collectives per forward: "
        + (", ".join(f"{n} {kind}" for kind, n in sorted(comms.items())) or "none"),
    ]
    derived = {_generic(n): f for n, f in shard_width_fixups(model, plan).items()}
    all_fixups = {**plan.fixups, **{k: v for k, v in derived.items() if k not in plan.fixups}}
    fixups = [(p, ", ".join(f"{k}={v}" for k, v in f.items()), "") for p, f in all_fixups.items()]
    fixups += [(p, ", ".join(f"{k}={v}" for k, v in a.items()), "") for p, a in plan.args.items()]
    if fixups:
        lines += ["", "fix-ups and style arguments applied per rank (attributes divided by tp):"]
        lines += [_table(("module", "fix-up", ""), fixups)]
    notes = [(p, n, "") for p, n in plan.notes.items()]
    if notes:
        lines += ["", "notes:", _table(("module", "note", ""), notes)]
    return "\n".join(lines)


def collectives_per_forward(plan: Plan, model: nn.Module, tp_size: int = 2) -> dict[str, int]:
    """Forward collectives the plan issues, by kind, counting each targeted module once (none
    at ``tp_size`` 1: every style is then local)."""
    counts: dict[str, int] = {}
    if tp_size <= 1:
        return counts
    for t in plan.resolve(model):
        spec = style_spec(t.style)
        kind = spec.collective if t.kind == "module" and spec.axis == "tp" else ""
        if kind:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(line.rstrip() for line in out)
