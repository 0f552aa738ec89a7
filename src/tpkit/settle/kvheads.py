"""KV heads fewer than tp: each KV head replicated over tp / kv ranks instead of refused.

At tp=4 a model with 2 KV heads (or MQA's 1 at tp=2) cannot split its key/value projections
by heads, but its query heads still split: rank r's query heads all read KV head
``r * kv // tp`` (query head i reads KV head ``i // (q / kv)``, and each rank holds ``q / tp``
consecutive query heads, no more than one KV group). So every rank keeps the KV projections
whole and computes only its KV head's rows (``colwise_replicated_heads``); the ranks sharing a
head each add a partial weight gradient (their own queries' share), summed by an all-reduce.
This is vLLM's layout. The attention module's code is told it has one KV head per rank
(``set`` fix-ups: ``num_key_value_groups`` = local query heads).

Pure: it rewrites plan entries, fix-ups and inferred groups for one tp size. When to is
`tpkit.settle.settle`'s (`settle_heads`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from tpkit.plan.layout import in_width, kind_of, out_width
from tpkit.plan.spec import Plan, matches

__all__ = ["KV_ATTRS", "Q_ATTRS", "head_counts", "replicate_kv_heads"]

KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_head_kv")
Q_ATTRS = ("num_attention_heads", "num_heads", "n_head", "n_heads")
_STYLE = "colwise_replicated_heads"


def _first_int(sources: list[Any], attrs: tuple[str, ...]) -> int | None:
    for src in sources:
        for attr in attrs:
            try:
                value = src.__dict__.get(attr) if isinstance(src, nn.Module) else getattr(src, attr)
            except (AttributeError, RuntimeError):  # per-layer configs refuse global reads
                continue
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def head_counts(model: nn.Module, owner: nn.Module) -> tuple[int | None, int | None, int | None]:
    """(query heads, KV heads, head dim) of an attention module: its own attributes first,
    then its config, then the model's text config."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    sources = [owner, getattr(owner, "config", None), config]
    sources = [s for s in sources if s is not None]
    q, kv = _first_int(sources, Q_ATTRS), _first_int(sources, KV_ATTRS)
    head_dim = _first_int(sources, ("head_dim",))
    hidden = _first_int(sources[1:], ("hidden_size",))
    if head_dim is None and q and hidden and hidden % q == 0:
        head_dim = hidden // q
    return q, kv, head_dim


def replicate_kv_heads(model: nn.Module, plan: Plan, tp: int) -> list[str]:
    """Rewrite ``plan`` for ``tp`` (see the module docstring) where an attention module has
    fewer KV heads than tp, tp is a multiple of them, and its query heads divide by tp; return
    the attention patterns changed."""
    if tp <= 1:
        return []
    modules = dict(model.named_modules())
    found: dict[str, list] = {}
    for t in plan.resolve(model):
        if t.kind == "module" and t.style == "colwise" and "." in t.name:
            found.setdefault(t.pattern, []).append(t)
    changed = []
    for pattern, targets in found.items():
        kv = _replicated_heads(model, modules, targets, tp)
        if kv is None:
            continue
        plan.set(pattern, _STYLE, targets[0].source, {"heads": kv})
        owner = pattern.rsplit(".", 1)[0]
        _owner_fixups(plan, owner, modules[targets[0].name.rsplit(".", 1)[0]], model, tp)
        _drop_counts(plan, pattern, owner)
        changed.append(owner)
    return sorted(set(changed))


def _replicated_heads(model, modules, targets, tp: int) -> int | None:
    """The KV head count when every module matched is a K or V projection of an attention
    with fewer KV heads than tp (each ``kv * head_dim`` wide), else None."""
    counts = set()
    for t in targets:
        mod, owner = modules[t.name], modules[t.name.rsplit(".", 1)[0]]
        q, kv, head_dim = head_counts(model, owner)
        kind = kind_of(mod)
        if kind not in ("linear", "conv1d") or not (q and kv and head_dim) or kv >= tp:
            return None
        if tp % kv or q % tp or out_width(mod, kind) != kv * head_dim or q == kv:
            return None
        if not _is_attention(owner, q * head_dim, in_width(mod, kind)):
            return None  # an MLP as wide as kv * head_dim, its head counts read off the config
        counts.add(kv)
    return counts.pop() if len(counts) == 1 else None


def _is_attention(owner: nn.Module, q_width: int, kv_in: int) -> bool:
    """Whether ``owner`` is an attention: it keeps head counts of its own, or holds a query
    projection (a linear-like child ``q_width`` wide reading what the K/V projections read)."""
    if any(
        isinstance(owner.__dict__.get(a), int)
        for a in (*Q_ATTRS, *KV_ATTRS, "num_key_value_groups")
    ):
        return True
    linears = [(c, kind_of(c)) for c in owner.children() if kind_of(c) in ("linear", "conv1d")]
    return any(out_width(c, k) == q_width and in_width(c, k) == kv_in for c, k in linears)


def _owner_fixups(plan: Plan, owner: str, module: nn.Module, model: nn.Module, tp: int) -> None:
    """One KV head per rank, as the attention's code reads it: KV counts become 1 (not
    divided), ``num_key_value_groups`` the rank's query heads."""
    q, kv, _ = head_counts(model, module)
    for pattern, fix in plan.fixups.items():
        if matches(pattern, owner) and fix.get("divide"):
            fix["divide"] = [a for a in fix["divide"] if a not in KV_ATTRS]
    values = {a: 1 for a in KV_ATTRS if isinstance(module.__dict__.get(a), int)}
    if isinstance(module.__dict__.get("num_key_value_groups"), int):
        values["num_key_value_groups"] = q // tp
    if values:
        fix = plan.fixups.setdefault(owner, {})
        fix["set"] = {**fix.get("set", {}), **values}


def _drop_counts(plan: Plan, pattern: str, owner: str) -> None:
    """An inferred group holding the projection no longer needs tp to divide the KV heads or
    the projection's width; the attention becomes one of its owners, so that the one-KV-head
    fix-ups go with the split when settling gathers the group or keeps it whole (left on a
    whole attention, ``num_key_value_groups`` = local query heads would pair its 8 query heads
    with 2 KV heads repeated once: Gemma-3n at tp=8, whose KV-sharing layers have no K/V
    projection of their own and keep the group from splitting)."""
    kv_labels = tuple(f".{a}" for a in KV_ATTRS)
    for i, group in enumerate(plan.groups):
        if pattern in group.modules:
            counts = {
                label: n
                for label, n in group.counts.items()
                if not (label.endswith(kv_labels) or pattern in label)
            }
            owners = group.owners if owner in group.owners else (*group.owners, owner)
            plan.groups[i] = replace(group, counts=counts, owners=owners)
