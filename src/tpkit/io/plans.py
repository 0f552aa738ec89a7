"""The plan a split applies: made once, on rank 0, from a stored plan when one matches its key.

Deriving a plan costs seconds (fake-tensor dry runs of the model), and its result depends only on
what `tpkit.plan.cache.plan_key` holds. So `plan_for` looks first for a stored plan under that
key, in order:

1. ``tpkit-plans/<key>.json`` beside the checkpoint (`from_pretrained` passes its folder;
   ``tpkit plan --save`` writes it there), so a shipped checkpoint never plans on the critical
   path;
2. the plan cache, ``TPKIT_PLAN_CACHE`` (default ``~/.cache/tpkit/plans``; ``off`` turns it
   off), which every later run reads.

A file under another key is stale and never reused; a missing, unreadable or corrupt one means
the plan is derived, as it always was (a corrupt file, or a cache folder that cannot be written,
is one warning on rank 0, never an error: the cache only ever saves time). A derived plan is
stored atomically (`tpkit.plan.cache.write_plan`).

Under torchrun, rank 0 alone looks the plan up or derives it, and every rank receives it in one
collective (the process group comes up here, before validation, instead of after it). Measured
(benchmarks/ready.py, 57M Llama at tp=2 on 2 cores): planning 1.0 s on rank 0 alone against
1.7 s when both ranks plan at once and compete for the cores, so rank 0 plans; where every rank
has cores of its own the two are even, less the collective (milliseconds), and ranks beyond
the cores gain the most. Ranks of one job then agree by construction, whatever their nodes'
caches hold. The house rule holds: the same collective first checks that every rank was given
the same model, plan argument and tp (a fingerprint each), and carries rank 0's planning error
instead of a plan when there is one, so a mismatch or a refusal is the same error on every
rank, never a hang. A split over some of the world's ranks only (a user's mesh for one
pipeline stage) plans on each of its ranks, as before: the others may split another model.
Logs and the progress note are rank 0's.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch.distributed as dist
from torch import nn

from tpkit import config
from tpkit.compat import default_store
from tpkit.log import get_logger
from tpkit.parallel.mesh import dist_env, init_distributed
from tpkit.plan import Plan, derive_plan
from tpkit.plan.cache import (
    NotCacheable,
    PlanFileError,
    key_digest,
    model_fingerprint,
    plan_arg_digest,
    plan_key,
    read_plan,
    write_plan,
)

__all__ = [
    "OPTIONS_AFTER_THE_PLAN",
    "OPTIONS_IN_THE_KEY",
    "SAVED_DIR",
    "plan_for",
    "saved_plan_path",
]

log = get_logger(__name__)

#: the folder beside a checkpoint that ``tpkit plan --save`` writes plans into
SAVED_DIR = "tpkit-plans"
#: seconds of planning after which rank 0 says what it is doing
NOTE_AFTER_S = 2.0
#: seconds the other ranks wait for rank 0's plan (TPKIT_TIMEOUT if that is longer)
PLAN_WAIT_S = 3600.0

#: `TPOptions` fields that reach `derive_plan`, and how the key holds them: a plan stored under
#: the key must be the plan these would derive (tests/test_plan_cache.py holds every field to
#: one of these two tables, so a new option must be placed before it ships)
OPTIONS_IN_THE_KEY = MappingProxyType(
    {
        "plan": "the key's plan (a mode, or the user's entries as data)",
        "example_inputs": "given: not cached (tensors are no key), derived every time",
        "tp_size": "the key's tp (the resolved size, whichever option gave it)",
        "dp_size": "only through the resolved tp",
        "dp_replicate_size": "only through the resolved tp",
        "dp_shard_size": "only through the resolved tp",
        "cp_size": "only through the resolved tp",
        "ep_size": "only through the resolved tp",
        "distributed_config": "only through the resolved tp",
        "mesh": "only through the resolved tp",
    }
)
#: `TPOptions` fields derivation never reads: applied after the plan, and `validate` checks
#: each against the plan (stored or derived) on every call
OPTIONS_AFTER_THE_PLAN = MappingProxyType(
    {
        "sharded": "FSDP2 after the split; validate checks the plan's shards divide",
        "sequence_parallel": "applied after the split; validate checks it against the plan",
        "loss_parallel": "applied after the split; validate checks it against the plan",
        "param_dtype": "FSDP2's mixed precision; validate checks it",
        "cp_attention": "context parallelism's attention, applied after the split",
        "fill_later": "whether the weights are put in after the split",
        "mixed_precision": "FSDP2's MixedPrecisionPolicy, after the split; fsdp_problems checks it",
        "cpu_offload": "FSDP2's CPUOffloadPolicy, after the split; fsdp_problems checks it",
        "reshard_after_forward": "FSDP2's setting, after the split",
        "fsdp_plan": "FSDP2's units (the model's modules, not the TP plan); fsdp_problems checks it",
        "ep_implementation": "expert parallelism's dispatch, applied after the split",
        "ep_plan": "which experts modules expert parallelism places, after the plan (stored or not)",
    }
)

_warned: set[str] = set()  # a cache that cannot be used is one warning per process


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
    device_type: str | None = None,
    ranks: int | None = None,
    derive: Callable[..., Plan] | None = None,
    analysis: Any = None,
) -> Plan:
    """``derive(model, plan, tp_size, example_inputs)`` (`derive_plan`), or the same plan read
    from a file stored under its key (beside the checkpoint folder ``beside``, then the plan
    cache); a plan derived here is stored in the cache. Under torchrun the process group is
    brought up (on ``device_type``'s backend) and rank 0's plan, or its error, goes to every
    rank. ``ranks``: how many ranks this split spans (its mesh's size); a split over some of the
    world's ranks (a user's mesh for one pipeline stage) plans on each of its ranks, as the other
    ranks may split other models, or none, at that moment. ``analysis``: the `Analysis` of
    ``model`` that derivation fills and the caller's validation reuses (it caches work on the
    model, it does not change the plan, so it is not in the key)."""
    derive = derive or derive_plan  # looked up now: a test may count the calls

    def here() -> Plan:
        return _stored_or_derived(model, plan, tp_size, example_inputs, beside, derive, analysis)

    env = dist_env()
    if not env.is_distributed or (ranks is not None and ranks != env.world_size):
        return here()
    init_distributed(device_type=device_type)
    return _from_rank0(model, here, plan, tp_size)


def _from_rank0(
    model: nn.Module, compute: Callable[[], Plan], plan: Any = None, tp_size: int | None = None
) -> Plan:
    """Rank 0's ``compute()`` (its plan, or its error), on every rank.

    First one all-gather of every rank's model fingerprint and plan argument: different models
    or plans asked for raise the same error everywhere (a rank whose fingerprint fails sends
    its error instead). Then rank 0 computes while the others wait on the process group's store
    for its result, for up to `PLAN_WAIT_S` (planning a large MoE model takes minutes of CPU,
    longer than a collective's TPKIT_TIMEOUT allows)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    token = uuid.uuid4().hex if rank == 0 else None  # names rank 0's result on the store
    try:
        mine: tuple[Any, ...] = (model_fingerprint(model), plan_arg_digest(plan), tp_size, token)
    except Exception as exc:  # noqa: BLE001 - sent to every rank, raised there and here
        mine = ("error", f"{type(exc).__name__}: {exc}", None, token)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    _check_alike(every)
    key = f"tpkit/plan/{every[0][3]}"
    store = default_store()
    if rank == 0:
        try:
            found = compute()
        except BaseException as exc:  # noqa: BLE001 - sent to every rank, raised there and here
            store.set(key, pickle.dumps(("error", _portable(exc))))
            raise
        store.set(key, pickle.dumps(("plan", found)))
        return found
    store.wait([key], datetime.timedelta(seconds=max(PLAN_WAIT_S, config.timeout_seconds())))
    kind, value = pickle.loads(store.get(key))  # noqa: S301 - rank 0 of this job wrote it
    if store.add(f"{key}/read", 1) == world - 1:  # the last reader clears it
        with contextlib.suppress(Exception):
            store.delete_key(key)
            store.delete_key(f"{key}/read")
    if kind == "error":
        raise value
    return value


def _check_alike(every: list[tuple[Any, ...]]) -> None:
    """Every rank's (model fingerprint, plan digest, tp) from the all-gather: one error, the same
    on every rank, when a rank could not fingerprint its model or the ranks differ."""
    failed = [(r, e[1]) for r, e in enumerate(every) if e[0] == "error"]
    if failed:
        r, message = failed[0]
        raise ValueError(
            f"tensor_parallel: rank {r} could not read its model to compare it with the other "
            f"ranks' ({message})."
        )
    for i, what, differ in (
        (0, "models", "in their modules, parameter shapes, dtypes or config"),
        (1, "plans", "in the plan argument"),
        (2, "tp sizes", "in the tp size"),
    ):
        odd = [r for r, e in enumerate(every) if e[i] != every[0][i]]
        if odd:
            raise ValueError(
                f"tensor_parallel was given different {what} on different ranks (ranks {odd} "
                f"differ from rank 0 {differ}): every rank must build the same model (same "
                "config, same code, same changes), ask for the same plan, and split it."
            )


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (the other ranks raise an equal one), else a
    RuntimeError with its type and message; an interrupt is a RuntimeError too (the other
    ranks were not interrupted, they only must not wait)."""
    if not isinstance(exc, Exception):
        return RuntimeError(f"{type(exc).__name__} on rank 0 while planning")
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception that cannot travel
        return RuntimeError(f"{type(exc).__name__} on rank 0: {exc}")


def _stored_or_derived(model, plan, tp_size, example_inputs, beside, derive, analysis) -> Plan:
    cache = config.plan_cache()
    key = None
    if cache is not None or beside is not None:
        try:
            key = plan_key(model, plan, tp_size, example_inputs)
        except NotCacheable as exc:
            log.debug("plan not cached: %s", exc)
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
    derived = _derive_noted(model, plan, tp_size, example_inputs, derive, cache, analysis)
    if key is not None and cache is not None:
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


def _derive_noted(model, plan, tp_size, example_inputs, derive, cache, analysis) -> Plan:
    """``derive(...)``, with a note on rank 0 when it takes more than `NOTE_AFTER_S`."""
    name = type(model).__name__
    where = f"stored in {cache} for later runs" if cache is not None else "the plan cache is off"
    note = threading.Timer(
        NOTE_AFTER_S, log.info, ("planning %s for tp=%s (%s)...", name, tp_size, where)
    )
    note.daemon = True
    start = time.perf_counter()
    note.start()
    try:
        if analysis is None:
            return derive(model, plan, tp_size, example_inputs)
        return derive(model, plan, tp_size, example_inputs, analysis=analysis)
    finally:
        note.cancel()
        seconds = time.perf_counter() - start
        if seconds > NOTE_AFTER_S:
            log.info("planned %s for tp=%s in %.1f s", name, tp_size, seconds)
