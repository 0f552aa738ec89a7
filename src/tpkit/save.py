"""Whole checkpoints out of a sharded model: ``save_pretrained`` gathers, ``state_dict`` on ask.

- A tpkit model's ``save_pretrained(dir)`` writes a normal, unsharded transformers checkpoint:
  every rank calls it (the gathers are collectives), rank 0 writes, the others wait for it, as
  transformers' own TP does. `install_save_pretrained` puts that on the model at split time.
- Inside `save_tensor_parallel(model)`, ``model.state_dict()`` returns the full tensors too
  (for code that saves a state dict its own way).

Both gather with torch's ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``: one
tensor at a time, each moved to CPU at once, kept on rank 0 only, FSDP2 x TP layouts included.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tpkit.mesh import barrier, rank

__all__ = ["gathered_state_dict", "install_save_pretrained", "save_tensor_parallel"]


def gathered_state_dict(
    model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True
) -> dict[str, Any]:
    """The model's full (unsharded) state dict; every rank must call it. With ``rank0_only``
    (default) only rank 0 gets the tensors, the others an empty dict."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only and cpu_offload)
    plain = model.__dict__.pop("state_dict", None)  # torch's walk needs the module's own
    try:
        state = get_model_state_dict(model, options=options)
    finally:
        if plain is not None:
            model.state_dict = plain
    if not rank0_only and cpu_offload:
        state = {k: v.cpu() if hasattr(v, "cpu") else v for k, v in state.items()}
    return state


def _save_pretrained(self: nn.Module, save_directory, *args: Any, **kwargs: Any) -> Any:
    """The model class's ``save_pretrained`` with tpkit's gather first: every rank calls it, rank
    0 writes the whole checkpoint. A caller that passes its own ``state_dict`` (already
    gathered) gets the plain method on its rank alone."""
    if kwargs.get("state_dict") is not None:
        return type(self).save_pretrained(self, save_directory, *args, **kwargs)
    _refuse_unsaved(self)  # every rank, before the gather
    state_dict = gathered_state_dict(self)
    out = None
    if rank() == 0:
        kwargs.update(state_dict=state_dict, is_main_process=True)
        out = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    del state_dict
    barrier()  # no rank reads the directory before rank 0 has written it
    return out


def _refuse_unsaved(model: nn.Module) -> None:
    """A module class whose state is not in ``state_dict()`` says why in ``tpkit_not_saved``
    (tpkit's quantized shards, `tpkit.quant`): the checkpoint would silently lack it."""
    for name, module in model.named_modules():
        why = getattr(type(module), "tpkit_not_saved", None)
        if why:
            raise ValueError(f"save_pretrained: {name} {why}")


def install_save_pretrained(model: nn.Module) -> None:
    """Shadow ``model.save_pretrained`` with the gathering one (bound, so ``copy.deepcopy``
    rebinds it); nothing for a model without one."""
    if callable(getattr(type(model), "save_pretrained", None)):
        model.save_pretrained = types.MethodType(_save_pretrained, model)


@contextlib.contextmanager
def save_tensor_parallel(
    model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True
) -> Iterator[nn.Module]:
    """Inside this context ``model.state_dict()`` is full, and ``save_pretrained`` writes a
    normal, unsharded checkpoint that plain transformers loads (as it does outside, too).

    Every rank must enter it and call the same methods (the gathers are collectives). With
    ``rank0_only`` (default) only rank 0 keeps the gathered tensors: other ranks get an empty
    state dict. ``cpu_offload`` moves each gathered tensor to CPU at once, so device memory stays
    at the shards plus one tensor.
    """
    previous = model.__dict__.get("state_dict")

    def state_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return gathered_state_dict(model, rank0_only=rank0_only, cpu_offload=cpu_offload)

    model.state_dict = state_dict
    try:
        yield model
    finally:
        if previous is None:
            model.__dict__.pop("state_dict", None)
        else:
            model.state_dict = previous
