"""Whole checkpoints out of a sharded model: ``save_pretrained`` gathers, ``state_dict`` on ask.

- A tpkit model's ``save_pretrained(dir)`` writes a normal, unsharded transformers checkpoint:
  every rank calls it (the gathers are collectives), rank 0 writes, the others wait for it, as
  transformers' own TP does. `install_save_pretrained` puts that on the model at split time.
- Inside `save_tensor_parallel(model)`, ``model.state_dict()`` returns the full tensors too
  (for code that saves a state dict its own way).
- Either way the directory is replaced atomically (`save_pretrained_atomic`): transformers writes
  into the target in place, so a crash over an existing checkpoint would leave a mix of old and
  new shards, or a config transformers cannot read.

Both gather with torch's ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``: one
tensor at a time, each moved to CPU at once, kept on rank 0 only, FSDP2 x TP layouts included.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tpkit.io import atomic
from tpkit.io.checkpoint import run_on_rank0
from tpkit.log import get_logger

__all__ = [
    "gathered_state_dict",
    "install_save_pretrained",
    "save_pretrained_atomic",
    "save_tensor_parallel",
]

log = get_logger(__name__)


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


def _in_place_reason(directory: Path) -> str | None:
    """Why ``directory`` cannot be replaced by a sibling (None when it can): a mount point cannot
    be renamed, and a parent we may not write to cannot hold ``<directory>.tmp``."""
    if os.path.ismount(directory):
        return "it is a mount point"
    parent = directory.parent
    if parent.is_dir() and not os.access(parent, os.W_OK | os.X_OK):
        return f"its parent {parent} is not writable"
    return None


def save_pretrained_atomic(
    model: nn.Module, save_directory: str | os.PathLike, *args: Any, **kwargs: Any
) -> Any:
    """The model class's own ``save_pretrained`` (one process, no collective), made crash-proof.

    transformers writes into ``save_directory`` in place: killed mid-write over an existing
    checkpoint, the directory loads as a mix of old and new shards, or not at all. Here the new
    checkpoint is written into ``<save_directory>.tmp``, fsynced, marked complete and swapped in
    (`tpkit.io.atomic.replace_dir`, `tpkit.io.atomic.HF_CHECKPOINT`):

    - **At every instant** ``save_directory`` loads with plain transformers as the old checkpoint
      or the new one, never a mix: on Linux the swap is one ``renameat2(RENAME_EXCHANGE)``. Where
      the OS has no exchange, two renames leave ``save_directory`` missing for an instant (never
      mixed); the complete copy is then ``<save_directory>.tmp``, and the next save restores it.
    - **Files that are not the checkpoint's survive**: a README, tokenizer files saved before or
      after, a Trainer's ``checkpoint-N/`` folders are hard-linked into the new version before
      the swap (copied where links fail), so they are there before, during and after.
    - **Only checkpoint files are replaced** (config, generation config, weights, index, tpkit's
      marker): as transformers does, stale shards of an old sharded save are dropped, and a stale
      ``model.safetensors`` too (transformers leaves it, and it would load instead of the shards).

    A ``save_directory`` that cannot have a sibling swapped in (a mount point, a parent we may
    not write to) is written in place as transformers does, with a warning. Non-main calls
    (``is_main_process=False``) are passed through untouched: they write nothing.
    """
    plain = type(model).save_pretrained
    directory = Path(save_directory)
    if not kwargs.get("is_main_process", True) or directory.is_file():
        return plain(model, save_directory, *args, **kwargs)  # transformers' own answers
    real = Path(os.path.realpath(directory))
    reason = _in_place_reason(real)
    if reason is not None:
        log.warning(
            "save_pretrained(%s): %s, so the checkpoint is written in place, as transformers "
            "does: a crash mid-write can leave a mix of old and new files.",
            directory,
            reason,
        )
        return plain(model, save_directory, *args, **kwargs)
    if kwargs.get("push_to_hub"):
        kwargs.setdefault("repo_id", real.name)  # not the name of the .tmp it is written in
    return atomic.replace_dir(
        real, lambda tmp: plain(model, str(tmp), *args, **kwargs), kind=atomic.HF_CHECKPOINT
    )


def _save_pretrained(self: nn.Module, save_directory, *args: Any, **kwargs: Any) -> Any:
    """The model class's ``save_pretrained`` with tpkit's gather first: every rank calls it, rank
    0 writes the whole checkpoint (`save_pretrained_atomic`); a failure there raises on every
    rank. A caller that passes its own ``state_dict`` (already gathered: HF Trainer's ``_save``)
    gets the atomic save on its rank alone."""
    if kwargs.get("state_dict") is not None:
        return save_pretrained_atomic(self, save_directory, *args, **kwargs)
    _refuse_unsaved(self)  # every rank, before the gather
    kwargs.update(state_dict=gathered_state_dict(self), is_main_process=True)

    def write() -> Any:
        return save_pretrained_atomic(self, save_directory, *args, **kwargs)

    try:
        # one broadcast at the end: no rank reads the directory before rank 0 has written it
        return run_on_rank0(write, f"save_pretrained({save_directory})")
    finally:
        kwargs.clear()  # the gathered tensors go now, not with this frame


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
