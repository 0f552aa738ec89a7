"""Checkpoints: whole HF checkpoints out of a sharded model, and reshardable DCP checkpoints.

- `save_tensor_parallel(model)`: inside it ``model.state_dict()`` returns full tensors (gathered
  one parameter at a time) and ``model.save_pretrained(dir)`` writes a normal transformers
  checkpoint from rank 0 while every rank takes part in the gathers.
- `save_checkpoint` / `load_checkpoint`: torch.distributed.checkpoint (DCP) of the model and
  optimizer; DCP records global shapes, so a checkpoint saved at one (dp, tp) layout loads into
  any other. Writes go to a temporary directory that is renamed into place only when complete.
- `export_checkpoint`: DCP -> safetensors HF checkpoint, without a process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

MODEL_KEY, OPTIM_KEY = "model", "optim"
EXTRA_FILE, CONFIG_DIR = "tpkit_extra.json", "hf_config"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _full_state_dict_hook(rank0_only: bool, cpu_offload: bool):
    def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        keep = not rank0_only or _rank() == 0
        for key in list(state_dict):
            value = state_dict[key]
            if isinstance(value, DTensor):
                full = value.full_tensor()  # a collective: every rank, same order
                if cpu_offload:
                    full = full.cpu()
                if keep:
                    state_dict[key] = full
                else:
                    del state_dict[key]
                    del full
            elif not keep:
                del state_dict[key]

    return hook


@contextlib.contextmanager
def save_tensor_parallel(
    model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True
) -> Iterator[nn.Module]:
    """Inside this context the model's state dict is full and ``save_pretrained`` writes a normal,
    unsharded checkpoint that plain transformers loads.

    Every rank must enter it and call the same methods (the gathers are collectives). With
    ``rank0_only`` (default) only rank 0 keeps the gathered tensors: other ranks hold at most one
    full tensor at a time and get an empty state dict. ``cpu_offload`` moves each gathered tensor
    to CPU at once, so GPU memory stays at the shards plus one tensor.
    """
    handle = model.register_state_dict_post_hook(_full_state_dict_hook(rank0_only, cpu_offload))
    original = model.__dict__.get("save_pretrained")
    if hasattr(model, "save_pretrained"):
        bound = type(model).save_pretrained.__get__(model)

        def save_pretrained(save_directory, *args, **kwargs):
            state_dict = kwargs.pop("state_dict", None) or model.state_dict()
            if _rank() == 0:
                bound(save_directory, *args, state_dict=state_dict, is_main_process=True, **kwargs)
            del state_dict
            _barrier()

        model.save_pretrained = save_pretrained
    try:
        yield model
    finally:
        handle.remove()
        if original is None:
            model.__dict__.pop("save_pretrained", None)
        else:
            model.save_pretrained = original


# ---- DCP ---------------------------------------------------------------------------------------
def _states(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {MODEL_KEY: get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd}


def save_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    **extra_state: Any,
) -> Path:
    """Save a reshardable DCP checkpoint of ``model`` (and ``optimizer``) to ``directory``.

    ``extra_state`` (step, scheduler state, ...) must be JSON-serialisable: it is written as JSON,
    never pickled. The checkpoint is written to ``<directory>.tmp`` and renamed into place by rank
    0 once every rank has finished, so a crash mid-save leaves the previous checkpoint intact.
    """
    directory = Path(directory)
    extra_json = json.dumps(extra_state)  # fails here, on every rank, before any collective
    tmp = directory.with_name(directory.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    dcp.save(_states(model, optimizer), checkpoint_id=str(tmp))
    if _rank() == 0:
        (tmp / EXTRA_FILE).write_text(extra_json)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.architectures = [type(model).__name__]  # as save_pretrained records it
            config.save_pretrained(str(tmp / CONFIG_DIR))
    _barrier()
    if _rank() == 0:
        old = directory.with_name(directory.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if directory.exists():
            os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return directory


def load_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by `save_checkpoint` into ``model`` (and ``optimizer``), whatever
    the (dp, tp) layout it was saved with; return the ``extra_state`` saved with it."""
    directory = Path(directory)
    if not (directory / ".metadata").exists():
        raise FileNotFoundError(f"{directory} is not a tpkit/DCP checkpoint (no .metadata file).")
    states = _states(model, optimizer)  # get_state_dict initialises an empty optimizer's state
    dcp.load(states, checkpoint_id=str(directory))
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, states[MODEL_KEY], options=StateDictOptions(strict=True))
    else:
        set_state_dict(
            model, optimizer, model_state_dict=states[MODEL_KEY], optim_state_dict=states[OPTIM_KEY]
        )
    extra = directory / EXTRA_FILE
    return json.loads(extra.read_text()) if extra.exists() else {}


def export_checkpoint(
    checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, model_cls: str | None = None
) -> Path:
    """Turn a DCP checkpoint into a safetensors HF checkpoint (config + weights), no process group.

    Loads the full tensors in this one process, so it needs the model's size in memory once.
    """
    import transformers
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if not (checkpoint_dir / CONFIG_DIR).exists():
        raise FileNotFoundError(
            f"{checkpoint_dir} has no {CONFIG_DIR}/: it was not saved from a transformers model."
        )
    full: dict[str, Any] = {}
    _load_state_dict(
        full,
        storage_reader=dcp.FileSystemReader(str(checkpoint_dir)),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    weights = full[MODEL_KEY]
    config = transformers.AutoConfig.from_pretrained(str(checkpoint_dir / CONFIG_DIR))
    from tpkit.load import _instantiate, _model_class

    with torch.device("meta"):
        model = _instantiate(_model_class(config, model_cls), config)
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"The checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}.")
    model.save_pretrained(str(out_dir))
    return out_dir
