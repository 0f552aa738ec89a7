"""Megatron's model-parallel RNG: one random stream for replicated activations, one per rank for
sharded ones.

Dropout on a replicated activation (after a row-parallel all-reduce, on embeddings) must draw the
same mask on every TP rank, or the replicas diverge: `mesh.sync_rng` makes the default generator
identical across the group. Dropout *inside* a tensor-parallel region (attention probabilities of
this rank's heads, the MLP's intermediate activations) must draw *different* masks on different
ranks, or heads h and h + H/t would share a mask. So a region (the module whose children are the
column-parallel layers) runs on a per-rank stream, seeded from the synced state and the TP rank,
and the default stream is restored before the region's row-parallel layer and on exit. The
default stream is never advanced inside a region, so it stays identical across the group.

torch has no such tracker outside Megatron/torchtitan internals; this is the smallest version of
it: two forward pre-hooks and one forward hook per region, CPU and CUDA generators.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["install_region_rng", "replicated_stream", "rng_state"]

_OFFSET = 2718  # Megatron's model-parallel seed offset


@dataclass
class _RegionRNG:
    cpu: torch.Tensor
    cuda: torch.Tensor | None
    saved: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)

    def enter(self) -> None:
        self.saved.append(rng_state())
        _set(self.cpu, self.cuda)
        _ACTIVE.append(self)

    def leave(self) -> None:
        if not self.saved:
            return
        self.cpu, self.cuda = rng_state()
        _set(*self.saved.pop())
        _ACTIVE.remove(self)


_ACTIVE: list[_RegionRNG] = []  # the streams of the regions being run, innermost last


@contextlib.contextmanager
def replicated_stream() -> Iterator[None]:
    """Draw from the default (TP-synced) stream even inside a region, and leave it advanced as
    the unsharded model's would be: for dropout on a replicated activation there (a LoRA
    adapter's input), which must draw the same mask on every rank."""
    rng = _ACTIVE[-1] if _ACTIVE else None
    if rng is None or not rng.saved:
        yield
        return
    region = rng_state()
    _set(*rng.saved[-1])
    try:
        yield
    finally:
        rng.saved[-1] = rng_state()
        _set(*region)


def rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    """The default CPU (and, once initialised, CUDA) generator states."""
    cuda = (
        torch.cuda.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else None
    )
    return torch.get_rng_state(), cuda


def _set(cpu: torch.Tensor, cuda: torch.Tensor | None) -> None:
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def _region_state(tp_rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A per-rank stream derived from the (synced) default one, without advancing it."""
    saved = rng_state()
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) + _OFFSET + tp_rank
    torch.manual_seed(seed)
    state = rng_state()
    _set(*saved)
    return state


def install_region_rng(model: nn.Module, regions: dict[str, list[str]], tp_rank: int) -> None:
    """``regions``: module name -> names of its row-parallel children (where the region ends).

    Only switches streams while the region is in training mode: in eval nothing draws random
    numbers inside a forward.
    """
    modules = dict(model.named_modules())
    rng = _RegionRNG(*_region_state(tp_rank))  # one stream for all regions: it keeps advancing
    for name, exits in regions.items():
        region = modules[name]

        def enter(module, args, rng=rng):
            if module.training:
                rng.enter()

        def leave(module, *args, rng=rng):
            if module.training:
                rng.leave()

        region.register_forward_pre_hook(enter)
        region.register_forward_hook(leave, always_call=True)
        for exit_name in exits:
            modules[exit_name].register_forward_pre_hook(leave)
