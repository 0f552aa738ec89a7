"""Each rank's RNG states saved with a checkpoint and put back by `tpkit.resume`
(`tpkit.io.rng_state`): torch, Python's ``random`` and NumPy continue exactly where the save
left them; a file for another world size or no file at all changes nothing. One process."""

from __future__ import annotations

import json
import random

import numpy as np
import torch

from tpkit.io.rng_state import restore_rng_state, rng_file, save_rng_state


def _draw() -> tuple[list[float], float, list[float]]:
    return torch.rand(4).tolist(), random.random(), np.random.rand(3).tolist()


def test_saved_states_make_every_generator_draw_the_same_again(tmp_path):
    torch.manual_seed(3)
    random.seed(4)
    np.random.seed(5)
    _draw()  # somewhere inside the streams, not at a seed
    random.gauss(0, 1)  # Python's cached second Gaussian is part of its state
    save_rng_state(tmp_path, rank=1, world_size=2)
    expected = _draw() + (random.gauss(0, 1),)
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    assert restore_rng_state(tmp_path, rank=1, world_size=2) is True
    assert _draw() + (random.gauss(0, 1),) == expected
    state = json.loads(rng_file(tmp_path, 1).read_text())  # plain JSON: loading runs no code
    assert {"torch", "python", "numpy", "world_size"} <= state.keys()


def test_another_world_size_or_no_file_changes_nothing(tmp_path):
    torch.manual_seed(3)
    save_rng_state(tmp_path, rank=0, world_size=2)
    for rank, world in ((0, 4), (1, 2)):  # saved by 2 ranks, resumed by 4; rank 1 saved nothing
        torch.manual_seed(11)
        random.seed(11)
        np.random.seed(11)
        expected = _draw()
        torch.manual_seed(11)
        random.seed(11)
        np.random.seed(11)
        assert restore_rng_state(tmp_path, rank=rank, world_size=world) is False
        assert _draw() == expected
