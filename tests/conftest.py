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


#: a session group's ranks are restarted after a test file that left one of them running more
#: threads than this. gloo runs 3 threads per process group, each waking every few milliseconds,
#: and checks that build their own meshes add groups the ranks keep to the end: measured, 200
#: idle groups cost a rank 0.2 CPU-seconds per second, and the suite ended with ~150 groups
#: in each rank of the 4-rank group (most of a core of 2, idle). A restart costs seconds.
_MAX_THREADS = 150


@pytest.fixture(autouse=True, scope="module")
def _restart_groups_with_many_threads():
    yield
    for g in _groups.values():
        if g.threads() > _MAX_THREADS:
            g.close()  # `RankGroup.run` starts it again when a later file asks


def pytest_sessionfinish(session, exitstatus):
    for g in _groups.values():
        g.close()
