"""Every environment variable tpkit reads, read here and nowhere else.

One small typed function per setting, each reading its variable when called (never cached at
import), so a test's ``monkeypatch.setenv`` or a notebook's ``os.environ[...] = ...`` applies
to the next call. Each parses its value and raises `ConfigurationError` (a ``ValueError``)
naming the variable, the value and what is accepted: a typo fails where the setting is read,
on every rank alike (they share the launcher's environment), not as a silent default. An empty
value counts as unset.

Two settings are read once on purpose by the module that uses them, not here: the level of
tpkit's logger (`log.py`, when the logger is first configured) and the shared-memory vote
(`parallel/shm.py`, at import: what each rank brings to its groups' vote).

Writing variables for child processes (threads per rank, the backend for torchrun, a worker's
devices) stays with the code that starts them (`cli/launch.py`, `pool/`). The documented
table is docs/configuration.md; `tests/test_config.py` holds every other module to this rule.

torch itself and torch.distributed read more (MASTER_ADDR, MASTER_PORT, NCCL_*): tpkit never
reads those, it leaves them to torch.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "START_METHODS",
    "ConfigurationError",
    "backend",
    "cuda_visible_devices",
    "debug",
    "local_rank",
    "local_world_size",
    "log_all_ranks",
    "log_level",
    "omp_num_threads",
    "plan_cache",
    "rank",
    "rank_given",
    "restart_count",
    "shm",
    "start_method",
    "timeout_seconds",
    "under_torchelastic",
    "world_size",
]

#: TPKIT_TIMEOUT's default. Short enough that a rank that never arrives at a collective fails
#: loudly within minutes instead of hanging a job for torch's default 10 to 30 minutes.
DEFAULT_TIMEOUT_S = 300.0

#: What TPKIT_START_METHOD accepts: the start methods of torch's elastic launcher.
START_METHODS = ("spawn", "fork", "forkserver")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigurationError(ValueError):
    """An environment variable tpkit reads holds a value it cannot use. The message names the
    variable, its value and what is accepted."""


def _bad(name: str, raw: str, accepted: str) -> ConfigurationError:
    return ConfigurationError(f"{name}={raw!r} is not valid: {accepted}. Set it so, or unset it.")


def _flag(name: str, raw: str | None, default: bool) -> bool:
    """An on/off switch: 1/true/yes/on or 0/false/no/off (any case); unset or empty: default."""
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise _bad(name, raw, f"use one of {', '.join(_TRUE)} (on) or {', '.join(_FALSE)} (off)")


def _int(name: str, raw: str | None, default: int, minimum: int) -> int:
    """A whole number >= ``minimum``; unset or empty: ``default``."""
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise _bad(name, raw, f"a whole number >= {minimum}") from None
    if value < minimum:
        raise _bad(name, raw, f"a whole number >= {minimum}")
    return value


def _text(raw: str | None) -> str | None:
    return raw.strip() if raw is not None and raw.strip() else None


# ---- tpkit's own settings ---------------------------------------------------------------------
def timeout_seconds() -> float:
    """TPKIT_TIMEOUT: seconds before a collective of a group tpkit creates fails (default 300);
    also the wait of tpkit's own collectives (the shared-memory all-reduce)."""
    raw = os.environ.get("TPKIT_TIMEOUT")
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise _bad("TPKIT_TIMEOUT", raw, "a number of seconds > 0") from None
    if not value > 0 or value == float("inf"):
        raise _bad("TPKIT_TIMEOUT", raw, "a number of seconds > 0")
    return value


def backend() -> str | None:
    """TPKIT_BACKEND: the torch.distributed backend for the process group tpkit creates (None:
    nccl on CUDA, gloo otherwise). A backend name torch knows (``gloo``, ``nccl``, a registered
    one) or torch's per-device form (``cpu:gloo,cuda:nccl``)."""
    raw = os.environ.get("TPKIT_BACKEND")
    value = _text(raw)
    if value is None:
        return None
    import torch.distributed as dist  # here: `log.py` imports this module before torch

    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    names = [part.split(":", 1)[-1].strip().lower() for part in value.split(",")]
    if not all(names) or any(n not in known for n in names):
        raise _bad(
            "TPKIT_BACKEND",
            raw or "",
            f"a backend torch knows ({', '.join(known)}) or 'device:backend' pairs joined by "
            "commas ('cpu:gloo,cuda:nccl')",
        )
    return value


def start_method() -> str | None:
    """TPKIT_START_METHOD: how ``tpkit.launch`` starts its ranks (None: it chooses)."""
    raw = os.environ.get("TPKIT_START_METHOD")
    value = _text(raw)
    if value is None:
        return None
    if value.lower() not in START_METHODS:
        raise _bad("TPKIT_START_METHOD", raw or "", f"one of {', '.join(START_METHODS)}")
    return value.lower()


def debug() -> bool:
    """TPKIT_DEBUG: cross-rank checks before every forward; the CLI shows tracebacks."""
    return _flag("TPKIT_DEBUG", os.environ.get("TPKIT_DEBUG"), False)


def log_all_ranks() -> bool:
    """TPKIT_LOG_ALL_RANKS: every rank prints tpkit's messages, not rank 0 only."""
    return _flag("TPKIT_LOG_ALL_RANKS", os.environ.get("TPKIT_LOG_ALL_RANKS"), False)


def log_level() -> int:
    """TPKIT_LOG_LEVEL: the level of tpkit's logger (default INFO), a level name or number."""
    raw = os.environ.get("TPKIT_LOG_LEVEL")
    value = _text(raw)
    if value is None:
        return logging.INFO
    if value.isdigit():
        return int(value)
    level = logging.getLevelName(value.upper())  # the number for a registered name
    if not isinstance(level, int):
        raise _bad(
            "TPKIT_LOG_LEVEL", raw or "", "DEBUG, INFO, WARNING, ERROR, CRITICAL or a number"
        )
    return level


def shm() -> bool:
    """TPKIT_CPU_SHM_ALLREDUCE: the same-host shared-memory path of tpkit's CPU collectives
    (default on)."""
    return _flag("TPKIT_CPU_SHM_ALLREDUCE", os.environ.get("TPKIT_CPU_SHM_ALLREDUCE"), True)


def huge_pages() -> bool:
    """TPKIT_HUGE_PAGES: new CPU shards in transparent huge pages (default off;
    `tpkit.parallel.shard_memory` says why)."""
    return _flag("TPKIT_HUGE_PAGES", os.environ.get("TPKIT_HUGE_PAGES"), False)


def plan_cache() -> Path | None:
    """TPKIT_PLAN_CACHE: the folder derived plans are stored in and read from
    (`tpkit.io.plans`); unset: ``$XDG_CACHE_HOME/tpkit/plans``, else ``~/.cache/tpkit/plans``;
    ``off`` (or 0 / false / no) turns the cache off (None)."""
    raw = os.environ.get("TPKIT_PLAN_CACHE")
    value = _text(raw)
    if value is not None and value.lower() in _FALSE:
        return None
    if value is not None:
        return Path(value).expanduser()
    base = _text(os.environ.get("XDG_CACHE_HOME"))
    return (Path(base) if base else Path.home() / ".cache") / "tpkit" / "plans"


# ---- what torchrun tells a rank -----------------------------------------------------------------
def rank() -> int:
    """RANK, set by torchrun (0 when not launched)."""
    return _int("RANK", os.environ.get("RANK"), 0, 0)


def rank_given() -> bool:
    """Whether RANK is set: this process was started as a rank (torchrun, a pool worker)."""
    return _text(os.environ.get("RANK")) is not None


def world_size() -> int:
    """WORLD_SIZE, set by torchrun (1 when not launched)."""
    return _int("WORLD_SIZE", os.environ.get("WORLD_SIZE"), 1, 1)


def local_rank(default: int) -> int:
    """LOCAL_RANK, the rank on this node (``default``, the global rank, when unset)."""
    return _int("LOCAL_RANK", os.environ.get("LOCAL_RANK"), default, 0)


def local_world_size(default: int) -> int:
    """LOCAL_WORLD_SIZE, the ranks on this node (``default`` when unset)."""
    return _int("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_WORLD_SIZE"), default, 1)


def under_torchelastic() -> bool:
    """Whether torchrun's agent started this process (it sets TORCHELASTIC_RUN_ID and
    TORCHELASTIC_RESTART_COUNT in every rank)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return _text(run_id) is not None or _text(restarts) is not None


def restart_count() -> int:
    """TORCHELASTIC_RESTART_COUNT: how often torchrun restarted the job (0 without torchrun)."""
    raw = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return _int("TORCHELASTIC_RESTART_COUNT", raw, 0, 0)


# ---- the machine --------------------------------------------------------------------------------
def omp_num_threads() -> int | None:
    """OMP_NUM_THREADS, or None when unset: then tpkit gives each rank its share of the cores.
    OpenMP's nested form (``4,2``) counts its outer level, as OpenMP does for torch's pool."""
    raw = os.environ.get("OMP_NUM_THREADS")
    value = _text(raw)
    if value is None:
        return None
    outer = value.split(",")[0].strip()
    if not outer.isdigit() or int(outer) < 1:
        raise _bad("OMP_NUM_THREADS", raw or "", "a whole number of threads >= 1 (or '4,2')")
    return int(outer)


def cuda_visible_devices() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as its entries, or None when unset or empty (every GPU visible).
    Entries are kept as written (indices or UUIDs): a pool worker is given a subset of them."""
    value = _text(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if value is None:
        return None
    return [part.strip() for part in value.split(",")]
