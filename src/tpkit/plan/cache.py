"""A derived plan on disk: its key, its exact serialisation, and the atomic reader / writer.

`derive_plan` costs seconds (fake-tensor dry runs of the whole model) and its result depends only
on what the key holds, so a plan derived once is reused by every rank and every later run
(`tpkit.io.plans` decides where to look; ``tpkit plan --save`` writes one beside a checkpoint).
The key is everything the derivation reads:

- the model: its class, every config it reaches (attention and experts implementations too),
  and a fingerprint of its modules (names, classes, public scalar attributes such as head
  counts, every parameter's and buffer's name, shape, dtype and ties), so a model changed after
  it was built (a layer swapped, pruned heads) misses;
- the source files of every model class that is not torch's or transformers' (remote code, a
  user's own module): an edit misses;
- the plan asked for (a mode, or the user's entries as data), the tp size, which modules are
  in training mode, the registered styles;
- the versions of tpkit (and a digest of its own source, so a development tree that changed
  planning code misses), transformers and torch.

A key that differs in any field is stale: the plan is derived again, never reused. The stored
plan carries its sha256: a file that does not match it (damaged, edited by hand) is corrupt,
and the plan is derived again too. A plan is
stored so that it comes back EXACTLY (entry order, styles, sources, args, fix-ups, notes,
groups, the types of every value, tuples as tuples): `encode` refuses any value it cannot bring
back as it was, and such a plan is simply not cached. Pure apart from the files it is given: no
environment, no process group, no logging.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import math
import os
import tempfile
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tpkit.plan.catalogue import all_specs
from tpkit.plan.spec import Group, Plan

__all__ = [
    "FORMAT",
    "NotCacheable",
    "PlanFileError",
    "decode",
    "encode",
    "key_digest",
    "model_fingerprint",
    "plan_arg_digest",
    "plan_differences",
    "plan_from_data",
    "plan_key",
    "plan_to_data",
    "read_plan",
    "write_plan",
]

#: the file format; a file of another format is stale (2: the plan's sha256 stored beside it)
FORMAT = 2


class NotCacheable(ValueError):
    """The plan or the call cannot be keyed or stored exactly: it is derived, not cached."""


class PlanFileError(ValueError):
    """A plan file that cannot be used: unreadable, corrupt, of another format, or stale (its
    key differs from the call's). ``stale`` tells the last from the others."""

    def __init__(self, message: str, stale: bool = False) -> None:
        super().__init__(message)
        self.stale = stale


# ---- exact values ------------------------------------------------------------------------------
def encode(value: Any) -> Any:
    """``value`` as JSON data that `decode` turns back into an equal value of the same types:
    None, bool, int, str, finite or not floats, lists, tuples and dicts of those (any such keys).
    Anything else (an enum, a tensor, a numpy int, a subclass) raises `NotCacheable`."""
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if kind is list:
        return [encode(v) for v in value]
    if kind is tuple:
        return {"__tuple__": [encode(v) for v in value]}
    if kind is dict:
        if all(type(k) is str and not k.startswith("__") for k in value):
            return {k: encode(v) for k, v in value.items()}
        return {"__dict__": [[encode(k), encode(v)] for k, v in value.items()]}
    raise NotCacheable(f"a plan value of type {kind.__name__} ({value!r:.80}) is not stored")


def decode(data: Any) -> Any:
    """The value `encode` made ``data`` from."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if isinstance(data, dict):
        if set(data) == {"__float__"}:
            return float(data["__float__"])
        if set(data) == {"__tuple__"}:
            return tuple(decode(v) for v in data["__tuple__"])
        if set(data) == {"__dict__"}:
            return {decode(k): decode(v) for k, v in data["__dict__"]}
        return {k: decode(v) for k, v in data.items()}
    return data


# ---- a plan as data ----------------------------------------------------------------------------
def plan_to_data(plan: Plan) -> dict[str, Any]:
    """Every field of ``plan`` as JSON data, in order (`plan_from_data` brings it back)."""
    groups = []
    for g in plan.groups:
        if type(g) is not Group:
            raise NotCacheable(f"a plan group of type {type(g).__name__} is not stored")
        groups.append([encode(g.modules), encode(g.owners), encode(dict(g.counts))])
    return {
        "entries": [[p, plan[p], plan.source(p).value] for p in plan],
        "args": [[p, encode(a)] for p, a in plan.args.items()],
        "fixups": [[p, encode(f)] for p, f in plan.fixups.items()],
        "notes": [[p, encode(n)] for p, n in plan.notes.items()],
        "groups": groups,
    }


def plan_from_data(data: Mapping[str, Any]) -> Plan:
    """The `Plan` `plan_to_data` wrote (a KeyError / TypeError / ValueError when it is not)."""
    plan = Plan()
    for pattern, style, source in data["entries"]:
        plan.set(pattern, style, source)
    plan.args.update((p, decode(a)) for p, a in data["args"])
    plan.fixups.update((p, decode(f)) for p, f in data["fixups"])
    plan.notes.update((p, decode(n)) for p, n in data["notes"])
    plan.groups.extend(Group(decode(m), decode(o), decode(c)) for m, o, c in data["groups"])
    return plan


def plan_differences(a: Plan, b: Plan) -> list[str]:
    """Where two plans differ, field by field, types included (empty: the same plan)."""

    def fields(plan: Plan) -> dict[str, Any]:
        return {
            "entries": [(p, plan[p], plan.source(p)) for p in plan],
            "args": list(plan.args.items()),
            "fixups": list(plan.fixups.items()),
            "notes": list(plan.notes.items()),
            "groups": [(g.modules, g.owners, dict(g.counts)) for g in plan.groups],
        }

    fa, fb = fields(a), fields(b)
    return [
        f"{name}: {_first_difference(fa[name], fb[name])}"
        for name in fa
        if not _same(fa[name], fb[name])
    ]


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def _first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if not _same(x, y):
            return f"item {i}: {x!r:.200} != {y!r:.200}"
    return f"{len(a)} items != {len(b)} items"


# ---- the key -----------------------------------------------------------------------------------
def plan_key(
    model: nn.Module,
    plan: Any,
    tp_size: int | None,
    example_inputs: Any = None,
) -> dict[str, Any]:
    """Everything ``derive_plan(model, plan, tp_size, example_inputs)`` reads, as JSON data.
    `NotCacheable` when the call cannot be keyed: example inputs (tensors) given, a plan
    argument that is not a mode or plain data, a model class whose source cannot be read."""
    if example_inputs is not None:
        raise NotCacheable("example_inputs are not part of a plan key")
    cls = type(model)
    return {
        "format": FORMAT,
        "model": f"{cls.__module__}.{cls.__qualname__}",
        "configs": _configs_digest(model),
        "modules": _modules_digest(model),
        "code": _code_digest(model),
        "plan": _plan_arg(plan),
        "tp": tp_size,
        "training": _training_digest(model),
        "styles": _digest(sorted(repr(s) for s in all_specs(derived=False))),
        "versions": _versions(),
    }


def model_fingerprint(model: nn.Module) -> str:
    """sha256 of the model's class, configs and structure (the key's model part, without the
    code digest): equal on ranks that were given the same model."""
    cls = type(model)
    parts = [f"{cls.__module__}.{cls.__qualname__}", _configs_digest(model), _modules_digest(model)]
    return _digest(parts)


def plan_arg_digest(plan: Any) -> str | None:
    """sha256 of the plan argument as the key holds it (a mode, or the user's entries as data):
    equal on ranks that were asked for the same plan. None when it cannot be read as data."""
    try:
        return _digest([json.dumps(_plan_arg(plan), sort_keys=True)])
    except NotCacheable:
        return None


def key_digest(key: Mapping[str, Any]) -> str:
    """A file name for ``key``: the sha256 of its canonical JSON."""
    text = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _plan_arg(plan: Any) -> Any:
    if plan is None:
        return "auto"
    if isinstance(plan, str) and plan in ("auto", "config", "infer"):
        return plan
    try:
        if isinstance(plan, Plan):
            user = plan
        elif isinstance(plan, Mapping):
            user = Plan.from_dict(plan)
        else:
            user = Plan.from_yaml(plan)
    except (ValueError, TypeError, OSError) as exc:  # derive_plan raises it itself
        raise NotCacheable(f"the plan argument cannot be read ({exc})") from None
    return {"user": plan_to_data(user)}


def _training_digest(model: nn.Module) -> str:
    """sha256 of which modules are in training mode: the trace runs the model as it is, and a
    module's code may branch on ``self.training`` (dropout, routers' jitter, aux losses)."""
    return _digest(["".join("1" if m.training else "0" for m in model.modules())])


def _digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


_COVERED = ("torch", "transformers")  # their code is keyed by their versions


def _covered(module_name: str) -> bool:
    return module_name.split(".")[0] in _COVERED


def _code_digest(model: nn.Module) -> str:
    """sha256 of the source files of every module class not covered by a version (a user's own
    model, remote code): an edit to them misses."""
    files: set[str] = set()
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls in (nn.Module, object) or _covered(cls.__module__):
                continue
            try:
                files.add(inspect.getsourcefile(cls) or "")
            except TypeError:  # a class made at run time has no file
                files.add("")
    if "" in files:
        raise NotCacheable("a model class has no source file to key its code by")
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + Path(name).read_bytes() + b"\0")
    return h.hexdigest()


#: config fields no plan reads that ranks may hold apart: where it was saved from, and what
#: ``save_pretrained`` writes into the config it saves (rank 0 saving alone sets
#: ``architectures`` and ``dtype`` on its copy); the parameters' dtypes are keyed with the modules
_VOLATILE_CONFIG = (
    "_name_or_path",
    "transformers_version",
    "_commit_hash",
    "architectures",
    "dtype",
    "torch_dtype",
)
_IMPLEMENTATIONS = ("_attn_implementation_internal", "_experts_implementation_internal")


def _configs_digest(model: nn.Module) -> str:
    """sha256 of every distinct config object the model's modules hold (``config``)."""
    seen: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen:
            seen[id(config)] = config
    h = hashlib.sha256()
    for config in seen.values():
        if hasattr(config, "to_dict"):
            data = config.to_dict()
        elif hasattr(config, "__dict__"):
            data = dict(vars(config))
        else:  # a module's ``config`` that is no config (a gated layer's float)
            data = {"__value__": repr(config)}
        data = {k: v for k, v in data.items() if k not in _VOLATILE_CONFIG}
        if hasattr(config, "__dict__"):
            data.update(_implementations(config))
        h.update(json.dumps(data, sort_keys=True, default=repr).encode() + b"\0")
    return h.hexdigest()


def _implementations(config: Any, prefix: str = "") -> dict[str, Any]:
    """The attention / experts implementations a config and its sub-configs hold (``to_dict``
    leaves them out, and the trace runs the code they pick)."""
    out = {f"{prefix}{k}": repr(getattr(config, k, None)) for k in _IMPLEMENTATIONS}
    for name, value in vars(config).items():
        if hasattr(value, "to_dict") and hasattr(value, "_attn_implementation_internal"):
            out.update(_implementations(value, f"{prefix}{name}."))
    return out


_SCALARS = (bool, int, float, str, type(None))


def _modules_digest(model: nn.Module) -> str:
    """sha256 of the model's structure: every module's name, class and public scalar attributes
    (head counts, widths, flags its code reads), every parameter's and buffer's name, class,
    shape and dtype, and which names share one tensor (ties)."""
    h = hashlib.sha256()
    first: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        cls = type(module)
        attrs = sorted(
            (k, repr(v))
            for k, v in vars(module).items()
            if not k.startswith("_") and k != "training" and _scalar(v)
        )
        tensors = []
        for kind, table in (("p", module._parameters), ("b", module._buffers)):
            for leaf, t in table.items():
                full = f"{name}.{leaf}" if name else leaf
                if t is None:
                    tensors.append((kind, leaf, None))
                    continue
                tied = first.setdefault(id(t), full)
                persistent = leaf not in module._non_persistent_buffers_set
                about = (type(t).__name__, tuple(t.shape), str(t.dtype), t.device.type)
                tensors.append((kind, leaf, *about, tied, persistent))
        row = (name, f"{cls.__module__}.{cls.__qualname__}", attrs, tensors)
        h.update(repr(row).encode() + b"\n")
    return h.hexdigest()


def _scalar(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return len(value) <= 64 and all(isinstance(v, _SCALARS) for v in value)
    return isinstance(value, _SCALARS)


@cache
def _versions() -> dict[str, str]:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "none"

    return {
        "tpkit": version("tpkit"),
        "tpkit_source": _tpkit_source_digest(),
        "transformers": version("transformers"),
        "torch": torch.__version__,
    }


def _tpkit_source_digest() -> str:
    """sha256 of tpkit's own source files: a changed tree (development, a patched install)
    never reuses plans the old code derived."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


# ---- files -------------------------------------------------------------------------------------
def read_plan(path: str | os.PathLike, key: Mapping[str, Any]) -> Plan | None:
    """The plan stored at ``path`` under ``key``; None when there is no file. `PlanFileError`
    when there is one that cannot be used (``stale=True`` when it holds another key)."""
    path = Path(path)
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise PlanFileError(f"{path} cannot be read ({exc})") from None
    try:
        data = json.loads(text)
        stored = data["key"]
        if not isinstance(stored, dict):
            raise TypeError("the key is no mapping")
    except (ValueError, TypeError, KeyError):
        raise PlanFileError(f"{path} is not a plan file tpkit wrote (corrupt)") from None
    if stored != key:
        changed = sorted(k for k in set(stored) | set(key) if stored.get(k) != key.get(k))
        raise PlanFileError(f"{path} holds a plan for another key ({', '.join(changed)})", True)
    if data.get("plan_sha256") != _plan_checksum(data.get("plan")):  # edited or damaged
        raise PlanFileError(f"{path} fails its checksum (corrupt or edited)")
    try:
        return plan_from_data(data["plan"])
    except (ValueError, TypeError, KeyError, AttributeError):
        raise PlanFileError(f"{path} is not a plan file tpkit wrote (corrupt)") from None


def _plan_checksum(plan_data: Any) -> str:
    """sha256 of a plan's data as canonical JSON: a file whose plan was changed by hand or
    damaged (a flipped byte that still parses) is never read as a plan."""
    return hashlib.sha256(json.dumps(plan_data, sort_keys=True).encode()).hexdigest()


def write_plan(path: str | os.PathLike, key: Mapping[str, Any], plan: Plan) -> Path:
    """Store ``plan`` under ``key`` at ``path``, atomically: written to a temporary file in the
    same folder, flushed to disk, then renamed over ``path``. A reader sees no file, the old
    one or the new one, never a part; jobs writing the same key at once each rename a whole
    file (the same plan) and the last rename wins. `NotCacheable` when the plan holds a value
    that cannot be stored exactly; OSError when the folder is not writable."""
    path = Path(path)
    data = plan_to_data(plan)
    text = json.dumps(
        {"key": dict(key), "plan": data, "plan_sha256": _plan_checksum(data)}, indent=1
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
