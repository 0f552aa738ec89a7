"""The plan a split applies: a stored one when its key matches, else derived here, then stored.

Deriving a plan costs seconds (fake-tensor dry runs of the model) on every rank of every run, and
its result depends only on what `tpkit.plan.cache.plan_key` holds. So `plan_for` looks first
for a stored plan under that key, in order:

1. ``tpkit-plans/<key>.json`` beside the checkpoint (`from_pretrained` passes its folder;
   ``tpkit plan --save`` writes it there), so a shipped checkpoint never plans on the critical
   path;
2. the plan cache, ``TPKIT_PLAN_CACHE`` (default ``~/.cache/tpkit/plans``; ``off`` turns it
   off), which every rank and every later run on this machine reads.

A file under another key is stale and never reused; a missing, unreadable or corrupt one means
the plan is derived, as it always was (a corrupt file or a cache folder that cannot be written
is one warning on rank 0, never an error: the cache only ever saves time). A derived plan is
written by each node's first rank, atomically (`tpkit.plan.cache.write_plan`).

Every rank derives on its own (in parallel, no collective: the house rule that every check that
can fail runs before the first collective holds as before), which measured as fast as deriving
on rank 0 and broadcasting at tp=2, and faster than waiting for one rank whenever the ranks
have cores of their own (benchmarks/ready.py). Derivation is deterministic: the split later
confirms with one checksum collective (`check_same_plan`) that every rank holds the same plan.
Logs and the progress note are rank 0's.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from tpkit import config
from tpkit.log import get_logger
from tpkit.parallel.mesh import dist_env
from tpkit.plan import Plan, derive_plan
from tpkit.plan.cache import (
    NotCacheable,
    PlanFileError,
    key_digest,
    plan_key,
    plan_to_data,
    read_plan,
    write_plan,
)

__all__ = ["SAVED_DIR", "check_same_plan", "plan_checksum", "plan_for", "saved_plan_path"]

log = get_logger(__name__)

#: the folder beside a checkpoint that ``tpkit plan --save`` writes plans into
SAVED_DIR = "tpkit-plans"
#: seconds of planning after which rank 0 says what it is doing
NOTE_AFTER_S = 2.0

_warned: set[str] = set()


def saved_plan_path(folder: str | Path, key: dict[str, Any]) -> Path:
    """Where the plan under ``key`` is stored beside the checkpoint in ``folder``."""
    return Path(folder) / SAVED_DIR / f"{key_digest(key)}.json"


def plan_for(
    model: nn.Module,
    plan: Any,
    tp_size: int | None,
    example_inputs: Any = None,
    *,
    beside: str | Path | None = None,
    derive: Callable[..., Plan] | None = None,
    device_type: str | None = None,
) -> Plan:
    """``derive(model, plan, tp_size, example_inputs)`` (`derive_plan`), or the same plan read
    from a stored file under its key (beside the checkpoint folder ``beside``, then the plan
    cache); a plan derived here is stored in the cache."""
    derive = derive or derive_plan  # looked up now: a test may count the calls
    if SHARE == "broadcast" and dist_env().is_distributed:
        return _from_rank0(
            lambda: _plan_here(model, plan, tp_size, example_inputs, beside, derive), device_type
        )
    return _plan_here(model, plan, tp_size, example_inputs, beside, derive)


SHARE = "parallel"


def _from_rank0(compute: Callable[[], Plan], device_type: str | None) -> Plan:
    """EXPERIMENT: rank 0 computes, every rank gets its plan or its error."""
    import pickle

    from tpkit.parallel.mesh import init_distributed

    init_distributed(device_type=device_type)
    box: list[Any] = [None]
    error = None
    if dist.get_rank() == 0:
        try:
            box = [("ok", compute())]
        except Exception as exc:  # noqa: BLE001
            error = exc
            try:
                pickle.dumps(exc)
                box = [("error", exc)]
            except Exception:  # noqa: BLE001
                box = [("error", RuntimeError(f"{type(exc).__name__}: {exc}"))]
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise error if error is not None else value
    return value


def _plan_here(model, plan, tp_size, example_inputs, beside, derive) -> Plan:
    try:
        key = plan_key(model, plan, tp_size, example_inputs)
    except NotCacheable as exc:
        log.debug("plan not cached: %s", exc)
        key = None
    cache = config.plan_cache()
    places = []
    if key is not None:
        if beside is not None:
            places.append(saved_plan_path(beside, key))
        if cache is not None:
            places.append(cache / f"{key_digest(key)}.json")
    for path in places:
        found = _read(path, key)
        if found is not None:
            log.debug("plan read from %s", path)
            return found
    derived = _derive_noted(model, plan, tp_size, example_inputs, derive, cache)
    if key is not None and cache is not None and dist_env().local_rank == 0:
        _write(cache / f"{key_digest(key)}.json", key, derived)
    return derived


def _read(path: Path, key: dict[str, Any]) -> Plan | None:
    try:
        return read_plan(path, key)
    except PlanFileError as exc:
        if exc.stale:  # another model, config, tp or version: derived afresh, as it must be
            log.debug("%s; deriving the plan", exc)
        else:
            _warn_once(f"{exc}; deriving the plan instead (delete the file to stop this note)")
        return None


def _write(path: Path, key: dict[str, Any], plan: Plan) -> None:
    try:
        write_plan(path, key, plan)
    except NotCacheable as exc:
        log.debug("plan not cached: %s", exc)
    except OSError as exc:
        _warn_once(
            f"the plan cache {path.parent} cannot be written ({exc.strerror or exc}): plans are "
            "derived on every run. Set TPKIT_PLAN_CACHE to a writable folder, or to off."
        )


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def _derive_noted(model, plan, tp_size, example_inputs, derive, cache) -> Plan:
    """``derive(...)``, with a note on rank 0 when it takes more than `NOTE_AFTER_S`."""
    name = type(model).__name__
    where = f"stored in {cache} for later runs" if cache is not None else "the plan cache is off"
    note = threading.Timer(
        NOTE_AFTER_S,
        log.info,
        ("planning %s for tp=%s (%s)...", name, tp_size, where),
    )
    note.daemon = True
    start = time.perf_counter()
    note.start()
    try:
        return derive(model, plan, tp_size, example_inputs)
    finally:
        note.cancel()
        seconds = time.perf_counter() - start
        if seconds > NOTE_AFTER_S:
            log.info("planned %s for tp=%s in %.1f s", name, tp_size, seconds)


def plan_checksum(plan: Plan) -> str | None:
    """sha256 of every field of ``plan`` (None when a value cannot be stored as data)."""
    try:
        data = plan_to_data(plan)
    except NotCacheable:
        return None
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def check_same_plan(plan: Plan, group: Any) -> None:
    """Every rank of ``group`` (the TP group) holds the same plan (one all-gather of a
    checksum), or one ValueError on each of them alike: ranks derive (or read) their plans on
    their own, and a plan that differs between them would split one weight two ways."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    every: list[Any] = [None] * size
    dist.all_gather_object(every, plan_checksum(plan), group=group)
    if len(set(every)) > 1:
        odd = [r for r, c in enumerate(every) if c != every[0]]
        raise ValueError(
            f"The ranks hold different plans (TP ranks {odd} differ from TP rank 0): a stored plan "
            "that one node has and another does not, or code that differs between nodes. Set "
            "TPKIT_PLAN_CACHE=off (and remove tpkit-plans/ beside the checkpoint) to derive "
            "on every rank, and make every node run the same tpkit and transformers."
        )
