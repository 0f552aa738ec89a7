"""The suite registry: a suite is a name, how it runs, what it measures and how to print it.

Plugging in a suite (e.g. ``train`` for FSDP x TP): write ``benchmarks/<name>.py`` with a
``SUITE = Suite(...)`` and add the module name to ``_MODULES`` below. Two kinds exist:

- shared (``isolated=False``): one torchrun group per (tp, dtype) loads every system once and
  runs all shared suites on them, interleaving the systems so ratios come from one run.
  ``run(ctx, systems)`` gets ``{name: System | "error text"}`` and returns rows.
- isolated (``isolated=True``): one torchrun group per (system, tp, dtype), for figures a shared
  process would spoil (peak RSS). ``run(ctx, system_name, checkpoint_dir)`` returns rows.

A row is ``{"system", "tp", "dtype", "status": "ok" | reason, <figures>}``. ``columns`` says
what the markdown table shows; ``goals(rows)`` returns the acceptance figures for the summary.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Column = tuple[
    str, str, str
]  # (row key, header, format: "ms", "x", "mib", "int", "f3", "str", ...)


@dataclass
class Suite:
    name: str
    title: str
    run: Callable[..., list[dict[str, Any]]]
    columns: list[Column]
    explain: str = ""
    isolated: bool = False
    package: bool = True  # the tensor-parallel package runs it too (in its own venv)
    goals: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None
    available: Callable[[], str | None] = field(default=lambda: None)  # reason it cannot run
    default: bool = True  # part of a plain `python -m benchmarks`
    # (name, ranks) of each run for suites that choose their own worlds; see the docstring
    launches: Callable[[dict[str, Any]], list[tuple[str, int]]] | None = None
    finish: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None
    train_model: bool = False  # launched runs use the --train-size preset, not --size


_MODULES = (
    "forward",
    "step",
    "generate",
    "comm",
    "memory",
    "load",
    "train",
    "moe",
    "longseq",
    "checkpoints",
    "hsdp_memory",
)


def all_suites() -> dict[str, Suite]:
    suites = {}
    for mod in _MODULES:
        suite = importlib.import_module(f"benchmarks.{mod}").SUITE
        suites[suite.name] = suite
    return suites


def ok(systems: dict[str, Any]) -> dict[str, Any]:
    """The systems that loaded (values that are not error strings)."""
    return {k: v for k, v in systems.items() if not isinstance(v, str)}


def failed_rows(ctx, systems: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**ctx.base_row(k), "status": v} for k, v in systems.items() if isinstance(v, str)]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
