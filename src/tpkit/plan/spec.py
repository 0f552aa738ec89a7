"""`Plan`: which module (or parameter) gets which tensor-parallel style, as plain data.

A plan is an ordered mapping of dotted name patterns to style names, e.g.
``{"model.layers.*.self_attn.q_proj": "colwise", "lm_head": "colwise_gather_output"}``. A ``*``
matches exactly one name component. When several patterns match one name the *last* one wins, so
merging a user plan after a derived one overrides it entry by entry.

This module is pure analysis: no process group, no collectives. It also owns the one table that
says how each style lays out each parameter (`param_layout`), so validation, `tpkit plan`,
loading and sharding all agree on where a slice comes from.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from torch import nn

#: Style name -> (what it does in one line, collective it issues in forward or "").
STYLES: dict[str, tuple[str, str]] = {
    "colwise": ("Y_i = X W_i: output features split, output stays sharded", ""),
    "rowwise": ("Y = sum_i X_i W_i: input features split, output all-reduced", "all_reduce"),
    "colwise_gather_output": (
        "output features split, output all-gathered (e.g. lm_head)",
        "all_gather",
    ),
    "vocab_parallel": ("embedding rows split by vocab, output all-reduced", "all_reduce"),
    "packed_colwise": ("fused [gate; up] output split per part (strided)", ""),
    "packed_qkv_colwise": ("fused [q; k; v] output split per part (strided, 3 parts)", ""),
    "colwise_embedding": ("embedding columns split (per-head bias), output stays sharded", ""),
    "moe_tp_experts": ("experts run their own shards, output all-reduced", "all_reduce"),
    "rowwise_split_input": (
        "rowwise on a replicated input: each rank takes its slice of the input first",
        "all_reduce",
    ),
    "packed_rowwise": (
        "input features split per packed part (strided), output all-reduced",
        "all_reduce",
    ),
    "all_reduce": (
        "parameters as their own entries say, input gradients and output all-reduced",
        "all_reduce",
    ),
    "moe_identity_expert": (
        "an identity expert inside moe_tp_experts: input / tp, as the experts' sum adds tp copies",
        "",
    ),
    "mla_kv_a_proj": (
        "replicated MLA kv_a projection: the rope part's gradient all-reduced",
        "",
    ),
    "replicate": ("parameters replicated, compute on local tensors", ""),
    "replicated_with_grad_allreduce": (
        "replicated, acts on sharded activations: gradient all-reduced",
        "",
    ),
}

#: Attributes that count attention heads (on modules or their configs): validation checks that
#: tp divides them, inference divides them on the modules that own a column/row pair.
HEAD_ATTRS = (
    "num_heads",
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "n_head_kv",
)

#: Names other libraries use for the same styles (transformers' plan strings).
ALIASES: dict[str, str] = {
    "embedding_rowwise": "vocab_parallel",
    "gather_output": "colwise_gather_output",
    "colwise_rep": "colwise_gather_output",
    "local_colwise": "colwise",
    "local_rowwise": "rowwise",
    "local_packed_colwise": "packed_colwise",
    "replicated": "replicate",
    "local": "replicate",
    # transformers' "local_params": a module whose parameters are sharded by their own entries
    # runs on local tensors -- what every tpkit style does; "replicate" leaves those entries be.
    "local_params": "replicate",
    "rowwise_rep": "rowwise_split_input",
    "embedding_colwise": "colwise_embedding",
}

# Styles whose module-level application leaves parameters to their own entries.
MODULE_ONLY_STYLES = {"moe_tp_experts", "all_reduce", "moe_identity_expert"}
SHARDING_STYLES = {
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "vocab_parallel",
    "packed_colwise",
    "packed_qkv_colwise",
    "colwise_embedding",
    "rowwise_split_input",
    "packed_rowwise",
}
#: How many equal parts a packed style splits separately.
PACKED_PARTS = {"packed_colwise": 2, "packed_qkv_colwise": 3}


def canonical_style(style: str) -> str:
    """Map an alias to its tpkit name; raise a ValueError listing the known names otherwise."""
    style = ALIASES.get(style, style)
    if style not in STYLES:
        raise ValueError(
            f"Unknown tensor-parallel style {style!r}; known styles: {', '.join(sorted(STYLES))} "
            f"(aliases: {', '.join(sorted(ALIASES))})."
        )
    return style


@dataclass(frozen=True)
class ParamLayout:
    """Where a parameter is split: ``dim`` (None = replicated) and, for packed weights such as a
    fused [gate; up], ``split_factor`` > 1 parts that are each split along ``dim``."""

    dim: int | None
    split_factor: int = 1

    @property
    def sharded(self) -> bool:
        return self.dim is not None


REPLICATED = ParamLayout(None)


def _is_conv1d(module: nn.Module | None) -> bool:
    # transformers' GPT-2 Conv1D keeps its weight as [in, out]; matched by name so plan/ needs no
    # transformers import.
    return module is not None and type(module).__name__ == "Conv1D"


def param_layout(
    style: str, param_name: str, ndim: int, module: nn.Module | None = None
) -> ParamLayout:
    """The layout a style gives one parameter, from its name and rank alone.

    Linear weights are ``[out, in]`` (Conv1D: ``[in, out]``), 3D expert weights ``[E, out, in]``,
    embeddings ``[vocab, hidden]``. As in transformers' plans, a style names raw dims of an
    expert tensor: "colwise" splits dim -2, "rowwise" dim -1, whatever the module computes with
    them (transposed experts: ``packed_rowwise`` gate_up, ``colwise`` down; a 2-D expert bias
    ``[E, out]``: "rowwise"). 1-D biases of column styles are split with the output; biases of
    row styles are added after the reduction, so they stay replicated.
    """
    style = canonical_style(style)
    if style in MODULE_ONLY_STYLES or style in (
        "replicate",
        "replicated_with_grad_allreduce",
        "mla_kv_a_proj",
    ):
        return REPLICATED
    is_bias = param_name.endswith("bias") and ndim == 1
    conv1d = _is_conv1d(module)
    if style == "vocab_parallel":
        return ParamLayout(1 if conv1d else 0) if ndim == 2 else REPLICATED
    if style == "colwise_embedding":  # [num_embeddings, dim]: split the dim (e.g. heads)
        return ParamLayout(1) if ndim == 2 else REPLICATED
    if style in ("colwise", "colwise_gather_output", *PACKED_PARTS):
        split = PACKED_PARTS.get(style, 1)
        if is_bias or ndim == 1:
            return ParamLayout(0, split)
        return ParamLayout(ndim - 1 if conv1d else ndim - 2, split)
    # rowwise, rowwise_split_input, packed_rowwise
    if is_bias or ndim == 1:
        return REPLICATED
    return ParamLayout(0 if conv1d else ndim - 1, 2 if style == "packed_rowwise" else 1)


def local_shape(shape: tuple[int, ...], layout: ParamLayout, tp: int, rank: int = 0) -> tuple:
    """This rank's shard shape under torch.chunk semantics (uneven splits give the tail less)."""
    if not layout.sharded or tp == 1:
        return tuple(shape)
    out = list(shape)
    size = shape[layout.dim]
    part = size // layout.split_factor
    chunk = -(-part // tp)
    mine = max(0, min(chunk, part - rank * chunk))
    out[layout.dim] = mine * layout.split_factor
    return tuple(out)


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

    Besides the styles a plan carries three kinds of data, all keyed by module pattern:

    - ``fixups``: ``{"divide": [attr, ...], "head_inputs": {"kw:alibi": 0}}`` -- integer
      attributes the module's code reads (``num_heads``, ``split_size``, ...) divided by tp when
      the plan is applied, and per-head inputs sliced to the rank's heads (dim 0 = batch*heads,
      dim 1 = heads);
    - ``notes``: why a module stays replicated (shown by `explain`);
    - ``groups``: each inferred column/row pair with the counts that must divide tp, so that
      validation can leave a pair that does not divide replicated instead of failing.
    """

    def __init__(self, entries: Mapping[str, str] | None = None, source: str = "user"):
        self._styles: dict[str, str] = {}
        self._sources: dict[str, str] = {}
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

    def set(self, pattern: str, style: str, source: str = "user") -> None:
        """Add or replace one entry; a replaced entry keeps its position in the order."""
        self._styles[pattern] = canonical_style(style)
        self._sources[pattern] = source

    def source(self, pattern: str) -> str:
        return self._sources[pattern]

    def merged(self, other: Mapping[str, str] | Plan, source: str = "user") -> Plan:
        """A copy of self overridden entry by entry by ``other`` (whose entries then win)."""
        out = Plan()
        for p in self:
            out.set(p, self[p], self._sources[p])
        out.fixups.update(self.fixups)
        out.notes.update(self.notes)
        out.groups.extend(self.groups)
        for p, style in other.items():
            out._styles.pop(p, None)  # re-insert at the end: later entries win when matching
            out.set(p, style, other.source(p) if isinstance(other, Plan) else source)
            out.notes.pop(p, None)
        if isinstance(other, Plan):
            out.fixups.update(other.fixups)
            out.notes.update(other.notes)
            out.groups.extend(other.groups)
        return out

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
            self.fixups.pop(owner, None)

    # -- resolution ------------------------------------------------------------------------
    def style_for(self, name: str) -> tuple[str, str] | None:
        """(style, pattern) of the last entry matching ``name``, or None."""
        found = None
        for pattern, style in self._styles.items():
            if matches(pattern, name):
                found = (style, pattern)
        return found

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
        """``{pattern: style}``, or ``{plan: {...}, fixups: {...}, notes: {...}}``."""
        extra = entries
        if "plan" in entries and isinstance(entries["plan"], Mapping):
            entries = entries["plan"]
        else:
            extra = {}
        plan = cls({str(k): str(v) for k, v in entries.items()}, source=source)
        plan.fixups.update({str(k): dict(v) for k, v in (extra.get("fixups") or {}).items()})
        plan.notes.update({str(k): str(v) for k, v in (extra.get("notes") or {}).items()})
        return plan

    def to_yaml(self) -> str:
        import yaml

        data: dict[str, Any] = {"plan": self.to_dict()}
        if self.fixups:
            data["fixups"] = {k: dict(v) for k, v in self.fixups.items()}
        if self.notes:
            data["notes"] = dict(self.notes)
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

    # -- explanation -----------------------------------------------------------------------
    def explain(self, model: nn.Module | None = None, tp_size: int = 1) -> str:
        """A table a person can read: module, style, global -> local shape, source; with a model,
        also the share of parameters sharded, bytes per rank and collectives per forward."""
        if model is None:
            rows = [(p, s, "", self._sources[p]) for p, s in self._styles.items()]
            return _table(("pattern", "style", "", "source"), rows)
        return explain_model(self, model, tp_size)


def _param_rows(plan: Plan, model: nn.Module) -> Iterable[tuple[str, nn.Module, str, Any, str]]:
    """(param full name, owning module, style, param, source) for every parameter of the model."""
    module_style: dict[str, tuple[str, str]] = {}
    param_style: dict[str, tuple[str, str]] = {}
    for t in plan.resolve(model):
        (module_style if t.kind == "module" else param_style)[t.name] = (t.style, t.source)
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            style, source = (
                param_style.get(full) or module_style.get(mod_name) or ("replicate", "-")
            )
            if style in MODULE_ONLY_STYLES:
                style = "replicate"
            yield full, module, style, p, source


def explain_model(plan: Plan, model: nn.Module, tp_size: int) -> str:
    rows, total, per_rank, sharded = [], 0, 0, 0
    for full, module, style, p, source in _param_rows(plan, model):
        layout = param_layout(style, full.rsplit(".", 1)[-1], p.ndim, module)
        loc = local_shape(tuple(p.shape), layout, tp_size)
        nbytes = p.numel() * p.element_size()
        local_bytes = nbytes * _prod(loc) // max(1, p.numel())
        total += nbytes
        per_rank += local_bytes
        if layout.sharded:
            sharded += nbytes
            rows.append((full, style, f"{tuple(p.shape)} -> {loc}", source))
    n_replicated = sum(1 for *_, s, _p, _src in _param_rows(plan, model) if s == "replicate")
    comms = collectives_per_forward(plan, model)
    fixups = [(p, ", ".join(f"{k}={v}" for k, v in f.items()), "") for p, f in plan.fixups.items()]
    notes = [(p, n, "") for p, n in plan.notes.items()]
    lines = [
        _table(("parameter", "style", "global -> local shape", "source"), rows),
        "",
        f"tp_size={tp_size}: {len(rows)} parameters sharded, {n_replicated} replicated; "
        f"{100.0 * sharded / max(1, total):.1f}% of parameter bytes sharded",
        f"bytes per rank: {_human(per_rank)} of {_human(total)} "
        f"({per_rank / max(1, total):.3f} of the unsharded model)",
        "collectives per forward: "
        + (", ".join(f"{n} {kind}" for kind, n in sorted(comms.items())) or "none"),
    ]
    if fixups:
        lines += ["", "fix-ups applied per rank (attributes divided by tp_size, inputs sliced):"]
        lines += [_table(("module", "fix-up", ""), fixups)]
    if notes:
        lines += ["", "notes:", _table(("module", "note", ""), notes)]
    return "\n".join(lines)


def collectives_per_forward(plan: Plan, model: nn.Module) -> dict[str, int]:
    """Forward collectives the plan issues, by kind, counting each targeted module once."""
    counts: dict[str, int] = {}
    for t in plan.resolve(model):
        if t.kind != "module":
            continue
        kind = STYLES[t.style][1]
        if kind:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def _prod(shape: Iterable[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _human(n: float) -> str:
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
