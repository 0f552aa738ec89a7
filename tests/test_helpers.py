"""The test helpers stay shared: a module of the random-graph property tests defines no copy of
a helper that `tests.parity` holds, so a fix to one reaches both (issue: `Residual` was defined
twice, in `tests.test_convs` and `tests.test_property`)."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.parity import Residual


@pytest.mark.parametrize("module", ["tests.test_convs", "tests.test_property"])
def test_random_graph_modules_use_the_shared_residual(module):
    assert importlib.import_module(module).Residual is Residual


def test_residual_adds_its_input():
    inner = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    assert torch.equal(Residual(inner)(x), x + inner(x))
