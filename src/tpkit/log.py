"""tpkit's own log lines: rank 0 only by default, every rank with ``TPKIT_LOG_ALL_RANKS=1``.

Every line carries its rank (``[tpkit rank 1/2] ...``), so interleaved output from several ranks
stays readable. ``TPKIT_LOG_LEVEL`` (default ``INFO``) sets the level. Messages that every rank must
print whatever the setting (a rank's own failure report) use ``log_every_rank``.

This module reads the rank itself (live process group, else torchrun's RANK through
`tpkit.config`) so that parallel/mesh.py can import it without a cycle. The level is read once, when
the logger is first configured (at import); TPKIT_LOG_ALL_RANKS at every record.
"""

from __future__ import annotations

import logging
import sys

from tpkit import config

__all__ = ["all_ranks_enabled", "get_logger", "log_every_rank"]

_ROOT = "tpkit"


def _rank_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return config.rank(), config.world_size()


def all_ranks_enabled() -> bool:
    """TPKIT_LOG_ALL_RANKS, at call time (`tpkit.config.log_all_ranks`).

    A bad value is refused when the logger is configured (at ``import tpkit``, on every rank
    alike); set to a bad value later, it reads as "every rank" here instead of raising: this
    runs inside a log call, on ranks other than 0 only, and an error raised on one rank in the
    middle of a collective would hang the others."""
    try:
        return config.log_all_ranks()
    except config.ConfigurationError:
        return True


class _RankFilter(logging.Filter):
    """Let a record through on rank 0, on every rank with TPKIT_LOG_ALL_RANKS=1, or when it was
    logged with ``extra={"every_rank": True}``; stamp it with the rank either way."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank, world = _rank_world()
        record.rank_prefix = f"[tpkit rank {rank}/{world}]" if world > 1 else "[tpkit]"
        return rank == 0 or all_ranks_enabled() or getattr(record, "every_rank", False)


def _configure_root() -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not getattr(root, "_tpkit_configured", False):
        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("%(rank_prefix)s %(message)s"))
        root.addHandler(handler)
        root.setLevel(config.log_level())
        config.log_all_ranks()  # a typo fails here, at import on every rank, not in a log call
        root.propagate = False  # the rank filter must decide; a root handler would not filter
        root._tpkit_configured = True
    return root


def get_logger(name: str = _ROOT) -> logging.Logger:
    """A logger under ``tpkit`` whose lines are filtered and prefixed by rank."""
    _configure_root()
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")


def log_every_rank(logger: logging.Logger, level: int, msg: str, *args) -> None:
    """Log on this rank even when only rank 0 logs (a rank reporting its own failure)."""
    logger.log(level, msg, *args, extra={"every_rank": True})
