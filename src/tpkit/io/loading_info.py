"""Which checkpoint tensor fills which weight of a model, counted the way transformers counts it.

transformers 5 loads a checkpoint that does not fit its config with a warning: weights the
checkpoint lacks are left at a fresh random init, tensors the model has no place for are dropped
(a Llama config over GPT-2 weights "loads", its logits 0.88 off). tpkit refuses that: a weight the
model has and the checkpoint lacks (missing), a tensor the checkpoint holds and the model does not
use (unexpected), and one of another shape (mismatched) are one ``ValueError`` that counts them
and names examples, raised on every rank before any collective, since everything here is read
from the safetensors headers and the model built on meta. Tied weights count once (stored under
any of their names), non-persistent buffers never count, and the model class's own
``_keys_to_ignore_on_load_missing`` / ``_keys_to_ignore_on_load_unexpected`` apply as in
transformers (``_adjust_missing_and_unexpected_keys``). Checkpoint keys that transformers' own
conversion mapping renames or fuses (per-expert MoE weights) count as filled: those load through
transformers' loader.

Weights meant to be new are an explicit opt-in (`LoadingPolicy`): ``allow_missing_keys`` (True or
regexes) initialises them with the model's ``_init_weights``, as transformers does, from a
generator seeded by the weight's name, so every rank (and every run) gets the same values;
``allow_unexpected_keys`` skips tensors the model does not use; ``ignore_mismatched_sizes``
(transformers' own keyword) re-initialises weights of another shape.
"""

from __future__ import annotations

import copy
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tpkit.io.safetensors import CheckpointIndex
from tpkit.io.shards import param_owners
from tpkit.log import get_logger

__all__ = ["LoadingInfo", "LoadingPolicy", "checkpoint_key", "fresh_weights", "loading_info"]

log = get_logger(__name__)

_EXAMPLES = 10


def checkpoint_key(full: str, index: CheckpointIndex | Mapping, prefix: str) -> str | None:
    """The key ``full`` (a model name) is stored under in ``index``: as it is, or with the
    model's ``base_model_prefix`` added or stripped (a base model's checkpoint in a task model
    and back, as transformers allows); None when the checkpoint does not hold it."""
    if full in index:
        return full
    if prefix and full.startswith(prefix + ".") and full[len(prefix) + 1 :] in index:
        return full[len(prefix) + 1 :]
    if prefix and f"{prefix}.{full}" in index:
        return f"{prefix}.{full}"
    return None


@dataclass
class LoadingInfo:
    """What a checkpoint holds for a model. Names are the model's (the first name of tied
    weights), except ``unexpected``, which are checkpoint keys."""

    #: first name of each (tied) parameter and persistent buffer -> its checkpoint key, or None
    keys: dict[str, str | None]
    #: weights nothing in the checkpoint fills (after the class's ignore patterns)
    missing: list[str] = field(default_factory=list)
    #: checkpoint keys no weight takes (after the class's ignore patterns)
    unexpected: list[str] = field(default_factory=list)
    #: (name, checkpoint shape, model shape) of weights stored with another shape
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    #: weights only transformers' conversion mapping fills (renamed or fused keys)
    renamed: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """transformers' ``output_loading_info=True`` form."""
        return {
            "missing_keys": set(self.missing),
            "unexpected_keys": set(self.unexpected),
            "mismatched_keys": set(self.mismatched),
            "error_msgs": [],
        }


def loading_info(model: nn.Module, index: CheckpointIndex) -> LoadingInfo:
    """Compare ``model`` (meta is fine) with the tensors ``index`` lists (names and shapes:
    safetensors headers, or a ``.bin``'s mapped tensors, `tpkit.io.pickle_safe`). Pure: no data read."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    groups = _weights(model)
    keys = {
        first: next((k for n in names if (k := checkpoint_key(n, index, prefix))), None)
        for first, (names, _) in groups.items()
    }
    mismatched = [
        (first, tuple(index.entries[k].shape), tuple(groups[first][1].shape))
        for first, k in keys.items()
        if k is not None and tuple(index.entries[k].shape) != tuple(groups[first][1].shape)
    ]
    used = {k for k in keys.values() if k is not None}
    rest = sorted(k for k in index.entries if k not in used)
    names = {n for ns, _ in groups.values() for n in ns}
    targets = _transformers_targets(model, rest, names)
    filled = set().union(*targets.values()) if targets else set()
    renamed = [
        first
        for first, k in keys.items()
        if k is None and any(n in filled for n in groups[first][0])
    ]
    missing = [first for first, k in keys.items() if k is None and first not in set(renamed)]
    unexpected = [k for k in rest if not targets.get(k)]
    missing_re, unexpected_re = _ignore_patterns(model)
    return LoadingInfo(
        keys=keys,
        missing=[n for n in missing if not _search(missing_re, n)],
        unexpected=[k for k in unexpected if not _search(unexpected_re, k)],
        mismatched=mismatched,
        renamed=renamed,
    )


@dataclass(frozen=True)
class LoadingPolicy:
    """What a load may leave to a fresh init or skip (`tpkit.from_pretrained`'s keywords).

    ``allow_missing_keys``: True, or regexes (searched in the weight's name, like
    ``_keys_to_ignore_on_load_missing``) of weights meant to be new, e.g. ``["score"]`` for a
    classification head on a causal-LM checkpoint; they are initialised by the model's
    ``_init_weights``. ``allow_unexpected_keys``: True or regexes of checkpoint tensors to skip
    (the causal-LM checkpoint's ``lm_head.weight`` there). ``ignore_mismatched_sizes``:
    transformers' keyword; weights stored with another shape are initialised afresh instead.
    """

    allow_missing_keys: bool | Sequence[str] = False
    allow_unexpected_keys: bool | Sequence[str] = False
    ignore_mismatched_sizes: bool = False

    def check(
        self, info: LoadingInfo, model: nn.Module, path: Any, quiet: bool = False
    ) -> list[str]:
        """Raise one ValueError for what is not allowed; else return the names to initialise
        afresh (allowed missing ones and, with ``ignore_mismatched_sizes``, mismatched ones),
        after one warning on rank 0 that lists them (unless ``quiet``)."""
        missing = [n for n in info.missing if not _allowed(n, self.allow_missing_keys)]
        unexpected = [k for k in info.unexpected if not _allowed(k, self.allow_unexpected_keys)]
        mismatched = [] if self.ignore_mismatched_sizes else info.mismatched
        cls = type(model).__name__
        if missing or unexpected or mismatched:
            raise ValueError(_refusal(cls, path, missing, unexpected, mismatched))
        fresh = list(info.missing)
        if self.ignore_mismatched_sizes:
            fresh += [n for n, _, _ in info.mismatched if n not in fresh]
        if not quiet:
            _warn(cls, path, info, fresh)
        return fresh


def fresh_weights(model: nn.Module, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Full-size values for the weights ``names`` of ``model`` (meta or real), initialised as
    transformers initialises missing weights: the owning module's ``_init_weights`` of its
    nearest ``PreTrainedModel`` (``reset_parameters`` for a plain module). Each module is
    initialised on a shallow copy holding fresh CPU tensors, from a CPU generator seeded by the
    weight's name, so the values are the same on every rank and the model's own tensors and the
    global RNG are untouched."""
    owners = {
        full: (mod, pname) for group in param_owners(model).values() for mod, pname, full in group
    }
    out: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules(remove_duplicate=False))
    for name in names:
        mod_name, _, leaf = name.rpartition(".")
        module = modules[mod_name]
        is_param = name in owners
        source = module._parameters[leaf] if is_param else module._buffers[leaf]
        clone = copy.copy(module)
        clone._parameters = {
            k: (
                nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
                if p is not None
                else None
            )
            for k, p in module._parameters.items()
        }
        clone._buffers = {
            k: (torch.empty_like(b, device="cpu") if b is not None else None)
            for k, b in module._buffers.items()
        }
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(zlib.crc32(name.encode()))
            _init_module(model, mod_name, clone, name)
        value = clone._parameters[leaf] if is_param else clone._buffers[leaf]
        out[name] = value.detach().to(source.dtype)
    return out


# ---- helpers ----------------------------------------------------------------------------------
def _weights(model: nn.Module) -> dict[str, tuple[list[str], torch.Tensor]]:
    """First name -> (all names, tensor) of each parameter (tied ones once) and persistent
    buffer: what a checkpoint of ``model`` holds, the names of its ``state_dict``."""
    out: dict[str, tuple[list[str], torch.Tensor]] = {}
    for group in param_owners(model).values():
        module, pname, first = group[0]
        out[first] = ([full for _, _, full in group], module._parameters[pname])
    seen: dict[int, str] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for bname, b in module._buffers.items():
            if b is None or bname in module._non_persistent_buffers_set:
                continue
            full = f"{mod_name}.{bname}" if mod_name else bname
            if id(b) in seen:
                out[seen[id(b)]][0].append(full)
            else:
                seen[id(b)] = full
                out[full] = ([full], b)
    return out


def _transformers_targets(
    model: nn.Module, ckpt_keys: list[str], names: set[str]
) -> dict[str, set[str]]:
    """Checkpoint key -> the model names transformers' loader would fill from it (its key
    renamings and converters, e.g. per-expert weights fused into one); empty when none."""
    out: dict[str, set[str]] = {k: set() for k in ckpt_keys}
    if not ckpt_keys:
        return out
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:  # an older transformers: no conversion mapping, names only
        return out
    if not isinstance(model, PreTrainedModel):
        return out
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    present = dict.fromkeys(names, True)
    prefix = model.base_model_prefix
    for key in ckpt_keys:
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, present)
        if renamed not in present:
            continue
        out[key].add(renamed)
        conv = by_pattern.get(pattern) if pattern is not None else None
        if conv is not None:  # one source, several targets (a fused qkv chunked): each of them
            first = conv.target_patterns[0]
            out[key].update(
                v for t in conv.target_patterns[1:] if (v := renamed.replace(first, t)) in present
            )
    return out


def _ignore_patterns(model: nn.Module) -> tuple[re.Pattern | None, re.Pattern | None]:
    """transformers' ``_adjust_missing_and_unexpected_keys``: the class's patterns, plus the
    ``rotary_emb.inv_freq`` and ``position_ids`` buffers older checkpoints stored."""
    missing = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
    unexpected = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [n for n, _ in model.named_buffers()]
    if any(n.endswith("rotary_emb.inv_freq") for n in buffers):
        unexpected.add(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in buffers):
        unexpected.add(r"(^|\.)position_ids$")

    def compile_(patterns: set[str]) -> re.Pattern | None:
        return re.compile("|".join(f"({p})" for p in sorted(patterns))) if patterns else None

    return compile_(missing), compile_(unexpected)


def _search(pattern: re.Pattern | None, name: str) -> bool:
    return pattern is not None and pattern.search(name) is not None


def _allowed(name: str, allow: bool | Sequence[str]) -> bool:
    if isinstance(allow, bool):
        return allow
    if isinstance(allow, str):
        allow = [allow]
    return any(re.search(p, name) for p in allow)


def _examples(items: list[str]) -> str:
    more = f", ... and {len(items) - _EXAMPLES} more" if len(items) > _EXAMPLES else ""
    return ", ".join(items[:_EXAMPLES]) + more


def _refusal(cls: str, path: Any, missing, unexpected, mismatched) -> str:
    lines = [f"The checkpoint in {path} does not hold the weights of {cls} built from its config:"]
    if missing:
        lines.append(
            f"- {len(missing)} weight(s) in the model but not in the checkpoint (missing), e.g. "
            + _examples(missing)
        )
    if unexpected:
        lines.append(
            f"- {len(unexpected)} tensor(s) in the checkpoint but not in the model (unexpected), "
            "e.g. " + _examples(unexpected)
        )
    if mismatched:
        shapes = [f"{n} (checkpoint {tuple(a)}, model {tuple(b)})" for n, a, b in mismatched]
        lines.append(f"- {len(mismatched)} weight(s) of another shape, e.g. " + _examples(shapes))
    fixes = []
    if missing:
        fixes.append(
            "allow_missing_keys=True or regexes (e.g. allow_missing_keys=['score']) for weights "
            f"meant to be new, such as a fresh task head: they are initialised by "
            f"{cls}._init_weights, the same on every rank"
        )
    if unexpected:
        fixes.append(
            "allow_unexpected_keys=True (or regexes) to skip tensors the model does not use"
        )
    if mismatched:
        fixes.append("ignore_mismatched_sizes=True to initialise weights of another shape afresh")
    lines.append(
        "Check that config.json (and model_cls) belongs to these weights: loaded anyway, the "
        "weights it lacks would stay random and give wrong numbers with no error. Or pass "
        + "; ".join(fixes)
        + "."
    )
    return "\n".join(lines)


def _warn(cls: str, path: Any, info: LoadingInfo, fresh: list[str]) -> None:
    parts = []
    if fresh:
        parts.append(
            f"{len(fresh)} weight(s) not in the checkpoint initialised by {cls}._init_weights "
            f"(train them before use): {_examples(fresh)}"
        )
    if info.unexpected:
        parts.append(
            f"{len(info.unexpected)} checkpoint tensor(s) the model does not use were skipped: "
            + _examples(info.unexpected)
        )
    if parts:
        log.warning(f"from_pretrained({path}): " + "; ".join(parts))


def _init_module(model: nn.Module, mod_name: str, clone: nn.Module, name: str) -> None:
    """``clone`` initialised by the ``_init_weights`` of the nearest ``PreTrainedModel`` that
    holds the module (transformers dispatches per sub-model the same way)."""
    owner = None
    parts = mod_name.split(".") if mod_name else []
    for i in range(len(parts) + 1):
        candidate = model.get_submodule(".".join(parts[:i]))
        if callable(getattr(candidate, "_init_weights", None)):
            owner = candidate
    if owner is not None:
        owner._init_weights(clone)
    elif callable(getattr(clone, "reset_parameters", None)):
        clone.reset_parameters()
    else:
        raise ValueError(
            f"{name} is missing from the checkpoint and {type(model).__name__} has no "
            "_init_weights (nor its module reset_parameters) to initialise it with; load a "
            "checkpoint that holds it."
        )
