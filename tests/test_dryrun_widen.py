"""A dry run's gathered output (`tpkit.settle.dryrun`'s width hook) holds zeros, not whatever
memory held: a shadow run computes it for real, and a NaN there made BLT's patcher's
``Categorical(logits=...)`` fail its check now and then, so its gathered attention at tp=8 was
refused (replicated) at random."""

import torch
from torch import nn

from tpkit.compat import FakeTensorMode
from tpkit.settle import dryrun
from tpkit.trace.shadow import ShadowValues


def test_a_gathered_output_under_shadow_values_is_zeros():
    widen = dryrun._widen  # the hook itself, private to the dry run
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    mode = ShadowValues(fake)
    lin = nn.Linear(4, 2, device="meta")
    lin.register_forward_hook(widen(8))
    for _ in range(20):  # freed NaNs the allocator may hand out again uninitialised
        dirty = torch.full((3, 8), float("nan"))
        del dirty
        with fake, mode:
            out = lin(torch.arange(12.0, device="meta").view(3, 4))  # made: shadowed
            assert tuple(out.shape) == (3, 8)
            value = mode.known(out)
        assert value is not None and torch.equal(value, torch.zeros(3, 8))
