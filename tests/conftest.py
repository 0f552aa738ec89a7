"""Session-wide rank groups: ``ranks2`` and ``ranks4`` start once and run many checks each."""

from __future__ import annotations

import os

import pytest

from tests.harness import RankGroup

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_groups: dict[int, RankGroup] = {}


def _group(world: int) -> RankGroup:
    if world not in _groups:
        _groups[world] = RankGroup(world)
    return _groups[world]


@pytest.fixture(scope="session")
def ranks2() -> RankGroup:
    return _group(2)


@pytest.fixture(scope="session")
def ranks4() -> RankGroup:
    return _group(4)


def pytest_sessionfinish(session, exitstatus):
    for g in _groups.values():
        g.close()
