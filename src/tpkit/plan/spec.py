"""`Plan`: which module (or parameter) gets which tensor-parallel style, as plain data.

A plan is an ordered mapping of dotted name patterns to style names, e.g.
``{"model.layers.*.self_attn.q_proj": "colwise", "lm_head": "colwise_gather_output"}``. A ``*``
matches exactly one name component. When several patterns match one name the *last* one wins, so
merging a user plan after a derived one overrides it entry by entry.

Besides styles a plan carries, keyed by module pattern: the style's arguments (``args``), the
per-rank fix-ups its modules' code needs (``fixups``, applied by `tpkit.plan.fixups`), why a module
stays replicated (``notes``) and each inferred column/row group with the counts tp must divide
(``groups``, typed `Group`s). Each entry records where it came from (`Source`). Pure data: no
process group, no collectives; what a plan becomes at one tp size is `tpkit.settle.settle`'s.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from torch import nn

from tpkit.plan.catalogue import canonical_style

__all__ = ["Group", "Plan", "Source", "Target", "matches"]


class Source(enum.StrEnum):
    """Where a plan entry came from. A `str` (``Source.USER == "user"``), so it prints, sorts,
    serialises and compares as the plain names always did; an unknown name is refused when an
    entry is set, instead of silently never matching a check such as "is this the user's?"."""

    USER = "user"  # the user's dict / Plan / YAML: never rewritten, validation reports it
    CONFIG = "config"  # transformers' base_model_tp_plan
    CLASS = "class"  # transformers' class-level _tp_plan (the output head)
    INFERRED = "inferred"  # tpkit.sources.infer, from the traced dataflow: settled for tp
    FALLBACK = "fallback"  # tpkit.sources.fallback, each layer on its own

    @classmethod
    def of(cls, value: str) -> Source:
        """``value`` as a `Source`, with the known names in the error when it is none."""
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(repr(s.value) for s in cls)
            raise ValueError(f"Unknown plan entry source {value!r}; use one of {known}.") from None


@dataclass(frozen=True)
class Group:
    """One inferred group of modules split together (a column/row pair with what rides along:
    per-head norms, per-head parameters, depthwise convs, an MLA tail; a fused-experts module;
    a Mamba mixer), so that settling (`tpkit.settle.settle`) changes it as one: gathered, or
    kept whole, never half split.

    - ``modules``: its plan patterns (the column sources first, then the rows, then the rest);
    - ``owners``: the patterns whose fix-ups belong to it (an attention's head counts), dropped
      when it stops being split by heads;
    - ``counts``: ``label -> number`` tp must divide for the split (``"output features of
      ...q_proj"``, ``"model.layers.*.self_attn.num_heads"``).

    Frozen: a rewrite makes a new Group (`dataclasses.replace`), so plans copied from one
    another never change each other's groups. ``counts`` is copied on construction and never
    changed in place. `to_dict` / `from_dict` round-trip it through plain data (YAML, JSON)."""

    modules: tuple[str, ...]
    owners: tuple[str, ...] = ()
    counts: Mapping[str, int] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", tuple(self.modules))
        object.__setattr__(self, "owners", tuple(self.owners))
        object.__setattr__(self, "counts", dict(self.counts))

    def to_dict(self) -> dict[str, Any]:
        """``{"modules": [...], "owners": [...], "counts": {...}}``: plain, YAML-safe data."""
        return {
            "modules": list(self.modules),
            "owners": list(self.owners),
            "counts": dict(self.counts),
        }

    @classmethod
    def from_dict(cls, data: Group | Mapping[str, Any]) -> Group:
        """A Group from `to_dict`'s form (``owners`` and ``counts`` optional); a Group as is."""
        if isinstance(data, Group):
            return data
        unknown = set(data) - {"modules", "owners", "counts"}
        if unknown or "modules" not in data:
            raise ValueError(
                f"A plan group is {{modules: [...], owners: [...], counts: {{...}}}}; got keys "
                f"{sorted(map(str, data))}."
            )
        counts = {str(k): int(v) for k, v in (data.get("counts") or {}).items()}
        return cls(
            tuple(map(str, data["modules"])), tuple(map(str, data.get("owners") or ())), counts
        )


@lru_cache(maxsize=4096)
def _compile(pattern: str) -> re.Pattern[str]:
    parts = [r"[^.]+" if p == "*" else re.escape(p) for p in pattern.split(".")]
    return re.compile(r"\.".join(parts))


def matches(pattern: str, name: str) -> bool:
    """True when ``pattern`` (``*`` = one name component) matches the dotted ``name`` fully."""
    return _compile(pattern).fullmatch(name) is not None


class _Bucket:
    """The plan patterns of one (component count, last component), matched as `matches` does
    (``*`` is any one component, anything else that component exactly) on bit sets: bit ``j``
    is the bucket's ``j``-th pattern, in plan order, so the highest bit left is the last entry
    that matches (the one that wins)."""

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.patterns: list[str] = []
        self.literal: list[dict[str, int]] = []  # per component: its text -> patterns with it
        self.star: list[int] = []  # per component: patterns with ``*`` there

    def add(self, position: int, pattern: str, parts: list[str]) -> None:
        bit = 1 << len(self.patterns)
        self.positions.append(position)
        self.patterns.append(pattern)
        for i, part in enumerate(parts[:-1]):  # the last component is the bucket's key
            if i == len(self.star):
                self.literal.append({})
                self.star.append(0)
            if part == "*":
                self.star[i] |= bit
            else:
                self.literal[i][part] = self.literal[i].get(part, 0) | bit

    def last_match(self, parts: list[str]) -> tuple[int, str] | None:
        """(plan position, pattern) of the last pattern matching the name ``parts``, or None."""
        mask = (1 << len(self.patterns)) - 1
        for i in range(len(self.star)):
            mask &= self.literal[i].get(parts[i], 0) | self.star[i]
            if not mask:
                return None
        j = mask.bit_length() - 1
        return self.positions[j], self.patterns[j]


#: `Plan.style_for`'s "not asked yet" (None is an answer: no entry matches)
_UNKNOWN = object()


def _named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()`` (pre-order, each module once, under its first name) without
    its generator per level: a resolve walks every module of the model, dozens of times while
    a plan is derived, and the nested generators were most of it for 8,000 modules."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        name, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        out.append((name, module))
        children = [(f"{name}.{k}" if name else k, c) for k, c in module._modules.items()]
        stack.extend(c for c in reversed(children) if c[1] is not None)
    return out


@dataclass(frozen=True)
class Target:
    """One resolved plan target: a module or a single parameter of a module."""

    name: str  # module name, or module name + "." + parameter name
    style: str
    pattern: str
    source: Source
    kind: str  # "module" or "param"


class Plan(Mapping[str, str]):
    """Ordered ``pattern -> style`` with a source per entry (config, class, inferred, user, ...).

    Besides the styles a plan carries, all keyed by module pattern:

    - ``args``: keyword arguments of the style (``{"tail": 64}`` for ``tail_grad_allreduce``);
    - ``fixups``: ``{"divide": [attr, ...], "head_inputs": {"kw:alibi": 0}}`` -- integer
      attributes the module's code reads (``num_heads``, ``split_size``, GPT-2's ``nf``, ...)
      divided by tp when the plan is applied, and per-head inputs sliced to the rank's heads
      (dim 0 = batch*heads, dim 1 = heads);
    - ``notes``: why a module stays replicated (shown by `explain`);
    - ``groups``: each inferred group (`Group`) with the counts that must divide tp, so that
      settling (`tpkit.settle.settle`) can gather a group that does not divide, or keep it
      whole, instead of failing.
    """

    def __init__(self, entries: Mapping[str, str] | None = None, source: str = Source.USER):
        self._styles: dict[str, str] = {}
        self._sources: dict[str, Source] = {}
        self._index: dict[tuple[int, str], _Bucket] | None = None  # style_for's
        self._hits: dict[str, tuple[str, str] | None] = {}  # style_for's answers by name
        self.args: dict[str, dict[str, Any]] = {}
        self.fixups: dict[str, dict[str, Any]] = {}
        self.notes: dict[str, str] = {}
        self.groups: list[Group] = []
        for pattern, style in (entries or {}).items():
            self.set(pattern, style, source)

    # -- mapping ---------------------------------------------------------------------------
    def __getitem__(self, pattern: str) -> str:
        return self._styles[pattern]

    def __iter__(self) -> Iterator[str]:
        return iter(self._styles)

    def __len__(self) -> int:
        return len(self._styles)

    def __repr__(self) -> str:
        return f"Plan({self._styles!r})"

    def set(
        self, pattern: str, style: str, source: str = Source.USER, args: Mapping | None = None
    ) -> None:
        """Add or replace one entry; a replaced entry keeps its position in the order."""
        self._styles[pattern] = canonical_style(style)
        self._sources[pattern] = Source.of(source)
        self._index = None
        if args:
            self.args[pattern] = dict(args)
        else:
            self.args.pop(pattern, None)

    def source(self, pattern: str) -> Source:
        """Where the entry ``pattern`` came from."""
        return self._sources[pattern]

    def merged(self, other: Mapping[str, str] | Plan, source: str = Source.USER) -> Plan:
        """A copy of self overridden entry by entry by ``other`` (whose entries then win)."""
        out = self.copy()
        for p, style in other.items():
            out._styles.pop(p, None)  # re-insert at the end: later entries win when matching
            out._index = None
            if isinstance(other, Plan):
                out.set(p, style, other.source(p), other.args.get(p))
            else:
                out.set(p, style, source)
            out.notes.pop(p, None)
        if isinstance(other, Plan):
            out.fixups.update(other.fixups)
            out.notes.update(other.notes)
            out.groups.extend(other.groups)
        return out

    def copy(self) -> Plan:
        """An independent copy: entries, args, fix-ups, notes and groups."""
        out = Plan()
        for p in self:
            out.set(p, self[p], self._sources[p], self.args.get(p))
        out.fixups.update({k: dict(v) for k, v in self.fixups.items()})
        out.notes.update(self.notes)
        out.groups.extend(self.groups)
        return out

    def args_for(self, pattern: str) -> dict[str, Any]:
        """The style arguments of one entry (empty when it has none)."""
        return dict(self.args.get(pattern, {}))

    def fixups_for(self, name: str) -> dict[str, Any]:
        """The fix-ups of every fixups pattern matching module ``name``, later ones winning."""
        out: dict[str, Any] = {}
        for pattern, fix in self.fixups.items():
            if matches(pattern, name):
                out.update(fix)
        return out

    def owner_fixups(self, owner: str) -> list[str]:
        """The fix-up keys an inferred group's ``owner`` pattern covers: itself, and the layers
        it stands for whose fix-ups differ from their siblings' and so stayed concrete (MiniMax's
        one lightning-attention layer under ``model.layers.*.self_attn``)."""
        return [k for k in self.fixups if k == owner or matches(owner, k)]

    # -- resolution ------------------------------------------------------------------------
    def style_for(self, name: str) -> tuple[str, str] | None:
        """(style, pattern) of the last entry matching ``name``, or None.

        A pattern matches only names with as many components, ending in its last one (or any
        last one, for ``*``), so only those entries (a `_Bucket`) are tried, component by
        component on bit sets: a plan of thousands of entries (NLLB-MoE's 128 experts per
        layer while it is derived) resolves a model of 8,000 modules in a few milliseconds,
        not millions of regex matches."""
        if self._index is None:
            self._index, self._hits = {}, {}
            for position, pattern in enumerate(self._styles):
                parts = pattern.split(".")
                key = (len(parts), parts[-1])
                self._index.setdefault(key, _Bucket()).add(position, pattern, parts)
        hit = self._hits.get(name, _UNKNOWN)
        if hit is _UNKNOWN:  # remembered until an entry changes (`_index` is reset then)
            hit = self._hits[name] = self._style_for(name)
        return hit

    def _style_for(self, name: str) -> tuple[str, str] | None:
        parts = name.split(".")
        best: tuple[int, str] | None = None
        for key in ((len(parts), parts[-1]), (len(parts), "*")):
            bucket = self._index.get(key)
            hit = bucket.last_match(parts) if bucket is not None else None
            if hit is not None and (best is None or hit[0] > best[0]):
                best = hit
        return None if best is None else (self._styles[best[1]], best[1])

    def resolve(self, model: nn.Module) -> list[Target]:
        """Every module and parameter of ``model`` that some entry names, in model order."""
        targets: list[Target] = []
        for mod_name, module in _named_modules(model):
            hit = self.style_for(mod_name) if mod_name else None
            if hit:
                targets.append(Target(mod_name, hit[0], hit[1], self._sources[hit[1]], "module"))
            seen: set[int] = set()  # as named_parameters(recurse=False): one name per tensor
            for p_name, param in module._parameters.items():
                if param is None or id(param) in seen:
                    continue
                seen.add(id(param))
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                hit = self.style_for(full)
                if hit:
                    targets.append(Target(full, hit[0], hit[1], self._sources[hit[1]], "param"))
        return targets

    def unmatched(self, model: nn.Module) -> list[str]:
        """Patterns that name no module and no parameter of ``model``.

        A pattern can only match names of as many components ending in its last one (any, for
        ``*``), so names are grouped by that first: NLLB-MoE's plan of 500 entries against its
        12,000 names was 6 million regex matches, half the time of `validate`'s checks."""
        names = {n for n, _ in _named_modules(model) if n}
        names.update(n for n, _ in model.named_parameters(remove_duplicate=False))
        by_end: dict[tuple[int, str], list[str]] = {}
        by_count: dict[int, list[str]] = {}
        for n in names:
            parts = n.split(".")
            by_end.setdefault((len(parts), parts[-1]), []).append(n)
            by_count.setdefault(len(parts), []).append(n)
        out = []
        for p in self._styles:
            if p in names:
                continue
            parts = p.split(".")
            alike = (
                by_count.get(len(parts), [])
                if parts[-1] == "*"
                else by_end.get((len(parts), parts[-1]), [])
            )
            if "*" in parts and any(matches(p, n) for n in alike):
                continue
            out.append(p)
        return out

    # -- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, str]:
        return dict(self._styles)

    @classmethod
    def from_dict(cls, entries: Mapping[str, Any], source: str = Source.USER) -> Plan:
        """``{pattern: style}``, or ``{plan: {...}, args: {...}, fixups: {...}, notes: {...}}``."""
        extra = entries
        if "plan" in entries and isinstance(entries["plan"], Mapping):
            entries = entries["plan"]
        else:
            extra = {}
        args = {str(k): dict(v) for k, v in (extra.get("args") or {}).items()}
        plan = cls()
        for k, v in entries.items():
            plan.set(str(k), str(v), source, args.get(str(k)))
        plan.fixups.update({str(k): dict(v) for k, v in (extra.get("fixups") or {}).items()})
        plan.notes.update({str(k): str(v) for k, v in (extra.get("notes") or {}).items()})
        return plan

    def to_yaml(self) -> str:
        import yaml

        data: dict[str, Any] = {"plan": self.to_dict()}
        for name in ("args", "fixups", "notes"):
            if getattr(self, name):
                data[name] = {k: v for k, v in getattr(self, name).items()}
        return yaml.safe_dump(data, sort_keys=False)

    @classmethod
    def from_yaml(cls, text_or_path: str | Path, source: str = Source.USER) -> Plan:
        """Read ``{plan: {pattern: style}}`` (or a flat mapping) from YAML text or a file path."""
        import yaml

        text = str(text_or_path)
        where = "the YAML plan text"
        if not text.lstrip().startswith(("{", "plan")) and Path(text).exists():
            where = f"YAML plan file {text}"
            text = Path(text).read_text()
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ValueError(f"{where} is not valid YAML{at}: {problem}.") from None
        if not isinstance(data, Mapping):
            raise ValueError(
                f"{where} must be a mapping of pattern -> style (or {{plan: {{...}}}}), got "
                f"{type(data).__name__}."
            )
        return cls.from_dict(data, source=source)
