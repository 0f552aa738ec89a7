"""Session-wide rank groups: ``ranks2``, ``ranks3`` and ``ranks4`` start once and run many checks
each. Starting a group (spawned ranks importing torch and transformers) costs several seconds on
2 cores: a module that starts its own group of a size named here pays that again. Under
pytest-xdist (``make test``: two workers, ``--dist loadfile``) each worker process has its own
groups, and a file's tests all run in one worker, so its module fixtures are built once."""

from __future__ import annotations

import os

import pytest

from tests.harness import RankGroup

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TPKIT_PLAN_CACHE", "off")  # every test derives (test_plan_cache sets one)

_groups: dict[int, RankGroup] = {}


def _group(world: int) -> RankGroup:
    if world not in _groups:
        _groups[world] = RankGroup(world)
    return _groups[world]


@pytest.fixture(scope="session")
def ranks2() -> RankGroup:
    return _group(2)


@pytest.fixture(scope="session")
def ranks3() -> RankGroup:
    """tp=3: widths and head counts tp does not divide."""
    return _group(3)


@pytest.fixture(scope="session")
def ranks4() -> RankGroup:
    return _group(4)


def pytest_sessionfinish(session, exitstatus):
    for g in _groups.values():
        g.close()
