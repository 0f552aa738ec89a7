"""Every monkey-patch tpkit applies to another library, through one door.

tpkit adapts transformers' ``Trainer``, peft and accelerate by replacing attributes of their
classes and modules (`tpkit.integrations.trainer`, `tpkit.integrations.peft`,
`tpkit.integrations.accelerate_loading`). Each of those once kept its own registry of
originals, its own idempotence rule and its own undo (accelerate had none). Here there is one:

- `patch` (and `wrap`, the common "replacement built from the original" form) records the
  original exactly as it sat in the owner's ``__dict__`` (a ``classmethod`` stays one), marks
  the replacement (``_tpkit_patch``) and makes a second patch of the same attribute a no-op;
- ``versions``: the library's tested range (`TESTED`). Outside it, one warning per library
  naming the installed and tested versions; an attribute the library no longer has is a
  RuntimeError naming it (unless the patch is optional: ``required=False``);
- ``holders``: a function other modules imported by name (accelerate's
  ``set_module_tensor_to_device``, which ``accelerate.utils`` and ``accelerate.big_modeling``
  bind at import) is replaced in every loaded module under that prefix that holds the original,
  and each of them is put back by `unpatch_all`;
- `unpatch_all` restores every original (or one ``group``'s: "trainer", "peft", "accelerate"),
  newest first, in every module that holds a replacement.

`original` gives the recorded original of a patched attribute (or the attribute itself when it
is not patched), for code that must call the library's own version.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["TESTED", "Patch", "applied", "original", "patch", "unpatch_all", "wrap"]

#: library -> the versions tpkit's patches were written and tested against
TESTED: dict[str, str] = {
    "transformers": ">=5.0,<6",
    "accelerate": ">=1.10,<2",
    "peft": ">=0.17,<1",
}

MARK = "_tpkit_patch"


@dataclass
class Patch:
    """One applied patch: ``owner.name`` was ``original`` and is ``replacement``; ``holders``
    are the other modules whose own name for it was replaced too."""

    owner: Any
    name: str
    original: Any
    replacement: Any
    group: str
    holders: list[tuple[Any, str]] = field(default_factory=list)
    holder_prefix: str = ""


_applied: dict[tuple[int, str], Patch] = {}
_warned: set[str] = set()


def _where(owner: Any, name: str) -> str:
    module = getattr(owner, "__module__", None)
    qual = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
    if isinstance(owner, type(sys)):  # a module
        return f"{owner.__name__}.{name}"
    return f"{module}.{qual}.{name}" if module else f"{qual}.{name}"


def _installed(library: str) -> str | None:
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return None


def _check_version(library: str) -> str:
    """The installed version of ``library``; a warning (once) when it is outside `TESTED`."""
    version = _installed(library) or "unknown"
    tested = TESTED.get(library)
    if tested is None or library in _warned:
        return version
    try:
        inside = Version(version) in SpecifierSet(tested)
    except InvalidVersion:
        inside = False
    if not inside:
        _warned.add(library)
        message = (
            f"tpkit adapts {library} {version}, outside the versions it was tested with "
            f"({library}{tested}): plain {library} calls on tpkit models may break. Install a "
            f"tested version (pip install '{library}{tested}') or report what fails."
        )
        warnings.warn(message, RuntimeWarning, stacklevel=4)
        logging.getLogger("tpkit").warning(message)
    return version


def _mark(replacement: Any) -> Any:
    with contextlib.suppress(AttributeError, TypeError):  # a builtin: the registry knows it
        setattr(_func(replacement), MARK, True)
    return replacement


def patch(
    owner: Any,
    name: str,
    replacement: Any,
    *,
    versions: str,
    group: str | None = None,
    required: bool = True,
    holders: str = "",
) -> bool:
    """Set ``owner.name`` to ``replacement``, recording the original; True when it did.

    ``versions``: the library whose tested range applies (a key of `TESTED`). ``group``: what
    `unpatch_all` can undo separately (default the library). ``required``: a missing attribute
    is a RuntimeError (else the patch is skipped). ``holders``: a module prefix under which every
    loaded module that imported the original by name gets the replacement too. A second patch
    of the same attribute is a no-op (False)."""
    key = (id(owner), name)
    if key in _applied:
        return False
    version = _check_version(versions)
    current = owner.__dict__.get(name) if hasattr(owner, "__dict__") else None
    if current is None:
        if not required:
            return False
        raise RuntimeError(
            f"tpkit adapts {_where(owner, name)}, which {versions} {version} does not have; "
            f"it was written against {versions}{TESTED.get(versions, '')}. Install a tested "
            "version."
        )
    if getattr(_func(current), MARK, False):
        return False  # patched by an earlier copy of this module: nothing to record
    record = Patch(owner, name, current, _mark(replacement), group or versions)
    setattr(owner, name, replacement)
    if holders:
        record.holder_prefix = holders
        plain = getattr(owner, name)
        for module in _modules(holders):
            if module is not owner and module.__dict__.get(name) is current:
                setattr(module, name, plain)
                record.holders.append((module, name))
    _applied[key] = record
    return True


def wrap(
    owner: Any,
    name: str,
    make: Callable[[Any], Any],
    *,
    versions: str,
    group: str | None = None,
    required: bool = True,
    holders: str = "",
) -> bool:
    """`patch` with ``make(original)`` as the replacement, built only when it is applied.
    ``original`` is the value in the owner's ``__dict__`` (a classmethod stays a classmethod);
    a plain function replacement takes the original's name and docstring (``__wrapped__``)."""
    current = owner.__dict__.get(name) if hasattr(owner, "__dict__") else None
    if (id(owner), name) in _applied or current is None or getattr(_func(current), MARK, False):
        return patch(  # a no-op, or the clear error for a missing attribute
            owner, name, current, versions=versions, group=group, required=required
        )
    replacement = make(current)
    if inspect.isfunction(replacement) and inspect.isfunction(current):
        functools.update_wrapper(replacement, current)
    return patch(
        owner,
        name,
        replacement,
        versions=versions,
        group=group,
        required=required,
        holders=holders,
    )


def _func(value: Any) -> Any:
    return value.__func__ if isinstance(value, (classmethod, staticmethod)) else value


def _modules(prefix: str) -> list[Any]:
    return [
        m
        for n, m in list(sys.modules.items())
        if m is not None and (n == prefix or n.startswith(prefix + "."))
    ]


def original(owner: Any, name: str) -> Any:
    """The attribute ``owner.name`` had before tpkit patched it (itself when unpatched)."""
    record = _applied.get((id(owner), name))
    if record is None:
        return getattr(owner, name)
    value = record.original
    if isinstance(value, (classmethod, staticmethod)):
        return value.__get__(None, owner)
    return value


def applied(group: str | None = None) -> list[Patch]:
    """The patches in place (of one ``group``), oldest first."""
    return [p for p in _applied.values() if group is None or p.group == group]


def unpatch_all(group: str | None = None) -> int:
    """Restore every original (only ``group``'s when given), newest first, in the owner and in
    every module that holds the replacement (also those that imported it after the patch);
    returns how many patches were undone."""
    undone = 0
    for key, record in reversed(list(_applied.items())):
        if group is not None and record.group != group:
            continue
        setattr(record.owner, record.name, record.original)
        plain = _func(record.replacement)
        holders = list(record.holders)
        if record.holder_prefix:
            holders += [
                (m, record.name)
                for m in _modules(record.holder_prefix)
                if m is not record.owner and _func(m.__dict__.get(record.name)) is plain
            ]
        plain_original = getattr(record.owner, record.name)
        for module, name in holders:
            setattr(module, name, plain_original)
        del _applied[key]
        undone += 1
    return undone
