"""Trainer checkpoints of tpkit models: ``save_model``, optimizer state, resuming at any layout.

The methods `tpkit.integrations.trainer.patch_trainer` puts on ``Trainer`` for saving and
loading (each hands models tpkit did not split to the original):

- ``_save`` (``save_model``): every rank gathers (`tpkit.save_tensor_parallel`), the main
  process writes a normal transformers checkpoint;
- ``_save_optimizer_and_scheduler``: ``checkpoint-N/tpkit_dcp/``, a `tpkit.save_checkpoint`
  (DCP) of model and optimizer, reshardable to any (dp, tp) layout, and the scheduler;
- ``_load_from_checkpoint`` / ``_load_optimizer_and_scheduler`` / ``_load_best_model``: the
  DCP copy (recovered after an interrupted save), or the gathered weights
  (`load_full_weights`) for ``save_only_model=True`` checkpoints;
- ``_load_rng_state``: after Trainer's own, the TP group's RNG synced again.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from tpkit.io import atomic
from tpkit.io.checkpoint import load_checkpoint, save_checkpoint
from tpkit.io.dcp import METADATA_FILE
from tpkit.io.save import save_tensor_parallel
from tpkit.parallel.mesh import barrier, sync_rng
from tpkit.state import tp_state

__all__ = [
    "DCP_DIR",
    "SCHEDULER_NAME",
    "load_full_weights",
    "patched_load_best_model",
    "patched_load_from_checkpoint",
    "patched_load_optimizer_and_scheduler",
    "patched_load_rng_state",
    "patched_save",
    "patched_save_optimizer_and_scheduler",
]

#: Subdirectory of a Trainer checkpoint holding tpkit's DCP checkpoint (model + optimizer).
DCP_DIR = "tpkit_dcp"
SCHEDULER_NAME = "scheduler.pt"


def _unwrap_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer


def patched_save(original):
    def _save(self, output_dir=None, state_dict=None):
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if tp_state(model) is None:
            return original(self, output_dir, state_dict)
        if state_dict is None:
            with save_tensor_parallel(model, rank0_only=True, cpu_offload=True):
                state_dict = model.state_dict()  # every rank: the gathers are collectives
        if self.args.should_save:
            original(self, output_dir, state_dict)
        del state_dict
        barrier()
        return None

    return _save


def patched_save_optimizer_and_scheduler(original):
    def _save_optimizer_and_scheduler(self, output_dir):
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if tp_state(model) is None:
            return original(self, output_dir)
        save_checkpoint(os.path.join(output_dir, DCP_DIR), model, _unwrap_optimizer(self.optimizer))
        if self.args.should_save and self.lr_scheduler is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        barrier()
        return None

    return _save_optimizer_and_scheduler


# ---- resuming ----------------------------------------------------------------------------------
def _dcp_dir(checkpoint: str) -> str:
    path = os.path.join(checkpoint, DCP_DIR)
    # a save interrupted between its two renames leaves a complete .tmp/.old that loads
    if atomic.find_complete(path, legacy_file=METADATA_FILE) is None:
        raise ValueError(
            f"{checkpoint} has no {DCP_DIR}/ checkpoint: it was not written by a Trainer training a "
            "tpkit model (or was saved with "
            "save_only_model=True), so optimizer state cannot be restored."
        )
    return path


def patched_load_from_checkpoint(original):
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        target = model if model is not None else self.model
        target = self.accelerator.unwrap_model(target, keep_torch_compile=False)
        if tp_state(target) is None:
            return original(self, resume_from_checkpoint, model)
        load_checkpoint(_dcp_dir(resume_from_checkpoint), target)  # model only, any layout
        return None

    return _load_from_checkpoint


def patched_load_optimizer_and_scheduler(original):
    def _load_optimizer_and_scheduler(self, checkpoint):
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if checkpoint is None or tp_state(model) is None:
            return original(self, checkpoint)
        load_checkpoint(_dcp_dir(checkpoint), model, _unwrap_optimizer(self.optimizer))
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
        return None

    return _load_optimizer_and_scheduler


def patched_load_rng_state(original):
    def _load_rng_state(self, checkpoint):
        original(self, checkpoint)
        state = tp_state(self.model)
        if checkpoint is None or state is None:
            return
        # A checkpoint from another layout has no RNG file for some ranks; whatever each rank now
        # holds, the ranks of one TP group must draw the same numbers (replicated dropout).
        sync_rng(state.tp_mesh)

    return _load_rng_state


def patched_load_best_model(original):
    def _load_best_model(self):
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if tp_state(model) is None:
            return original(self)
        best = self.state.best_model_checkpoint
        if atomic.find_complete(os.path.join(best, DCP_DIR), legacy_file=METADATA_FILE):
            load_checkpoint(os.path.join(best, DCP_DIR), model)
        else:  # save_only_model=True: the gathered full weights are all there is
            load_full_weights(model, best)
        return None

    return _load_best_model


def load_full_weights(model: nn.Module, checkpoint: str) -> None:
    """Load a normal (unsharded) safetensors checkpoint into a tpkit model: every rank reads the
    files and keeps its own shards (``set_model_state_dict(full_state_dict=True)``)."""
    import json

    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    index = os.path.join(checkpoint, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    full: dict[str, torch.Tensor] = {}
    for name in files:
        full.update(load_file(os.path.join(checkpoint, name), device="cpu"))
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))
