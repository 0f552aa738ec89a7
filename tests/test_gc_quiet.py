"""Planning's collector pause (`tpkit.trace.gc_quiet`): old objects skipped, none leaked."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from tpkit.plan import derive_plan
from tpkit.trace import gc_quiet


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_block_freezes_what_existed_and_gives_it_back():
    assert gc.get_freeze_count() == 0

    with gc_quiet.frozen_heap():
        assert gc.get_freeze_count() > 0
        new = weakref.ref(_Cycle())  # garbage made inside is still collected inside
        gc.collect()
        assert new() is None
    assert gc.get_freeze_count() == 0


def test_an_old_cycle_dropped_inside_is_collected_after_not_leaked():
    old = weakref.ref(_Cycle())  # garbage already, uncollected: it is frozen with the rest
    with gc_quiet.frozen_heap():
        gc.collect()
        assert old() is not None  # skipped while frozen: the point of the pause
    gc.collect()
    assert old() is None


def test_nested_blocks_unfreeze_once_and_a_users_freeze_is_left_alone():
    with gc_quiet.frozen_heap():
        outer = gc.get_freeze_count()
        with gc_quiet.frozen_heap():
            pass
        assert gc.get_freeze_count() == outer  # the inner block undid nothing
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the user's own (a fork server's, say)
    try:
        mine = gc.get_freeze_count()
        with gc_quiet.frozen_heap():  # its own generator object would be frozen by a freeze
            assert gc.get_freeze_count() <= mine  # nothing frozen on top of the user's
        # and not unfrozen (0); not compared exactly: another thread (pytest-xdist's) may free
        # a few of the objects the user froze meanwhile (seen once: 2 of 1,052,892)
        assert mine - 64 < gc.get_freeze_count() <= mine
    finally:
        gc.unfreeze()


def test_planning_runs_frozen_and_returns_the_heap():
    seen: list[int] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            seen.append(gc.get_freeze_count())
            return self.down(torch.relu(self.up(x)))

    plan = derive_plan(Probe(), "infer", example_inputs=(torch.randn(2, 8),))
    assert seen and all(n > 0 for n in seen)  # every traced forward ran inside the pause
    assert gc.get_freeze_count() == 0
    assert plan["up"] == "colwise" and plan["down"] == "rowwise"


def test_main_in_a_process_that_goes_on_leaves_the_collector_be(monkeypatch, tmp_path):
    """Only the ``tpkit`` script (`tpkit.cli.main.entry`) freezes the heap before it exits;
    ``main()`` run in this process from a patched ``sys.argv`` (as tests and notebooks do) must
    not freeze it for good."""
    import sys

    import pytest

    from tpkit.cli.main import main

    monkeypatch.setattr(sys, "argv", ["tpkit", "export", str(tmp_path / "none"), str(tmp_path)])
    with pytest.raises(SystemExit):
        main()
    assert gc.get_freeze_count() == 0
