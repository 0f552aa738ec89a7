"""`Plan`: which module (or parameter) gets which tensor-parallel style, as plain data.

A plan is an ordered mapping of dotted name patterns to style names, e.g.
``{"model.layers.*.self_attn.q_proj": "colwise", "lm_head": "colwise_gather_output"}``. A ``*``
matches exactly one name component. When several patterns match one name the *last* one wins, so
merging a user plan after a derived one overrides it entry by entry.

Besides styles a plan carries, keyed by module pattern: the style's arguments (``args``), the
per-rank fix-ups its modules' code needs (``fixups``, applied by `tpkit.plan.fixups`), why a module
stays replicated (``notes``) and each inferred column/row group with the counts tp must divide
(``groups``). Pure data: no process group, no collectives.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from torch import nn

from tpkit.plan.catalogue import canonical_style, style_spec

# members of a group that no count needs to divide: replicated, or the gathered pair's styles
WHOLE_STYLES = frozenset({"replicate", "colwise_gather_output", "rowwise_split_input"})

__all__ = ["WHOLE_STYLES", "Plan", "Target", "matches"]


@lru_cache(maxsize=4096)
def _compile(pattern: str) -> re.Pattern[str]:
    parts = [r"[^.]+" if p == "*" else re.escape(p) for p in pattern.split(".")]
    return re.compile(r"\.".join(parts))


def matches(pattern: str, name: str) -> bool:
    """True when ``pattern`` (``*`` = one name component) matches the dotted ``name`` fully."""
    return _compile(pattern).fullmatch(name) is not None


@dataclass(frozen=True)
class Target:
    """One resolved plan target: a module or a single parameter of a module."""

    name: str  # module name, or module name + "." + parameter name
    style: str
    pattern: str
    source: str
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
    - ``groups``: each inferred column/row pair with the counts that must divide tp, so that
      derivation can leave a pair that does not divide replicated instead of failing.
    """

    def __init__(self, entries: Mapping[str, str] | None = None, source: str = "user"):
        self._styles: dict[str, str] = {}
        self._sources: dict[str, str] = {}
        self._index: dict[tuple[int, str], list[tuple[int, str]]] | None = None  # style_for's
        self.args: dict[str, dict[str, Any]] = {}
        self.fixups: dict[str, dict[str, Any]] = {}
        self.notes: dict[str, str] = {}
        self.groups: list[dict[str, Any]] = []
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
        self, pattern: str, style: str, source: str = "user", args: Mapping | None = None
    ) -> None:
        """Add or replace one entry; a replaced entry keeps its position in the order."""
        self._styles[pattern] = canonical_style(style)
        self._sources[pattern] = source
        self._index = None
        if args:
            self.args[pattern] = dict(args)
        else:
            self.args.pop(pattern, None)

    def source(self, pattern: str) -> str:
        return self._sources[pattern]

    def merged(self, other: Mapping[str, str] | Plan, source: str = "user") -> Plan:
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

    def replicate_group(self, group: Mapping[str, Any], why: str) -> None:
        """Leave one inferred column/row group replicated (its modules and fix-ups), noting why."""
        for pattern in group["modules"]:
            self.set(pattern, "replicate", self._sources.get(pattern, "inferred"))
            self.notes[pattern] = f"replicated: {why}"
        for owner in group.get("owners", []):
            for key in self.owner_fixups(owner):
                self.fixups.pop(key)

    def owner_fixups(self, owner: str) -> list[str]:
        """The fix-up keys an inferred group's ``owner`` pattern covers: itself, and the layers
        it stands for whose fix-ups differ from their siblings' and so stayed concrete (MiniMax's
        one lightning-attention layer under ``model.layers.*.self_attn``)."""
        return [k for k in self.fixups if k == owner or matches(owner, k)]

    def settle_groups(self, tp_size: int) -> list[str]:
        """Replicate every inferred group ``tp_size`` does not divide (e.g. 3 heads at tp=2) so
        the rest of the model is still split; return the reasons written as notes. User and
        transformers entries are never changed: what they ask and tp does not divide is an
        error for validation to report. (`tpkit.plan.derive_plan` first tries each such group
        gathered, which needs the model; what is left is replicated here.)"""
        written = []
        for group, why in self.undivided_groups(tp_size):
            self.replicate_group(group, why)
            written.append(why)
        return written

    def undivided_groups(self, tp_size: int) -> list[tuple[dict, str]]:
        """(group, why) for each inferred group still split by a count ``tp_size`` does not
        divide; groups a user or transformers overrode, and whole ones (replicated or gathered),
        are not."""
        out = []
        for group in self.groups:
            live = [p for p in group["modules"] if p in self and self.source(p) == "inferred"]
            if len(live) != len(group["modules"]) or all(self[p] in WHOLE_STYLES for p in live):
                continue  # overridden by the user, or already whole
            bad = [
                f"{label} = {n}"
                for label, n in group["counts"].items()
                if n % tp_size and not self._uneven_width_ok(label)
            ]
            if bad:
                out.append((group, f"tp_size={tp_size} does not divide " + ", ".join(bad)))
        return out

    def _uneven_width_ok(self, label: str) -> bool:
        """A group's width count (``output features of up_proj``) need not divide tp when its
        module's style splits exactly into torch.chunk sizes (plain colwise / rowwise); head
        counts and packed parts always must."""
        for prefix in ("output features of ", "input features of "):
            if label.startswith(prefix) and label[len(prefix) :] in self._styles:
                return style_spec(self._styles[label[len(prefix) :]]).uneven_ok
        return False

    # -- resolution ------------------------------------------------------------------------
    def style_for(self, name: str) -> tuple[str, str] | None:
        """(style, pattern) of the last entry matching ``name``, or None.

        A pattern matches only names with as many components, ending in its last one (or any
        last one, for ``*``), so only those entries are tried: a plan of 500 entries (NLLB-MoE's
        128 experts per layer) resolves a model of 8,000 modules in linear time, not 4M matches."""
        if self._index is None:
            self._index = {}
            for position, pattern in enumerate(self._styles):
                parts = pattern.split(".")
                self._index.setdefault((len(parts), parts[-1]), []).append((position, pattern))
        parts = name.split(".")
        best: tuple[int, str] | None = None
        for key in ((len(parts), parts[-1]), (len(parts), "*")):
            for position, pattern in reversed(self._index.get(key, ())):
                if best is not None and position < best[0]:
                    break
                if matches(pattern, name):
                    best = (position, pattern)
                    break
        return None if best is None else (self._styles[best[1]], best[1])

    def resolve(self, model: nn.Module) -> list[Target]:
        """Every module and parameter of ``model`` that some entry names, in model order."""
        targets: list[Target] = []
        for mod_name, module in model.named_modules():
            hit = self.style_for(mod_name) if mod_name else None
            if hit:
                targets.append(Target(mod_name, hit[0], hit[1], self._sources[hit[1]], "module"))
            for p_name, _ in module.named_parameters(recurse=False):
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                hit = self.style_for(full)
                if hit:
                    targets.append(Target(full, hit[0], hit[1], self._sources[hit[1]], "param"))
        return targets

    def unmatched(self, model: nn.Module) -> list[str]:
        """Patterns that name no module and no parameter of ``model``."""
        names = [n for n, _ in model.named_modules() if n]
        names += [n for n, _ in model.named_parameters(remove_duplicate=False)]
        return [p for p in self._styles if not any(matches(p, n) for n in names)]

    # -- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, str]:
        return dict(self._styles)

    @classmethod
    def from_dict(cls, entries: Mapping[str, Any], source: str = "user") -> Plan:
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
    def from_yaml(cls, text_or_path: str | Path, source: str = "user") -> Plan:
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
