"""`from_pretrained`: a transformers checkpoint straight into shards.

The model is built on the meta device, the plan is derived, validated and applied there (every
parameter a DTensor with a meta local tensor), and only then is each rank's slice read from the
safetensors files (`tpkit.safetensors_io`, which reads just the slice's bytes) into a freshly
allocated local shard. No rank ever holds the whole model. Every stored tensor is checked
against the model's global shape first, on every rank, before any collective.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tpkit.build import instantiate, model_class
from tpkit.mesh import dist_env
from tpkit.parallelize import TPOptions, apply_pending_fsdp, split
from tpkit.plan.validate import checkpoint_problems
from tpkit.quant import QuantizedLoad
from tpkit.safetensors_io import CheckpointIndex
from tpkit.shards import param_owners, rank_device
from tpkit.stream import move_buffers, stream_params

__all__ = ["from_pretrained"]


def _resolve_dtype(dtype, config) -> torch.dtype:
    dtype = dtype if dtype not in (None, "auto") else getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype or torch.float32


def _checkpoint_key(full: str, index: CheckpointIndex, prefix: str) -> str | None:
    if full in index:
        return full
    if prefix and full.startswith(prefix + ".") and full[len(prefix) + 1 :] in index:
        return full[len(prefix) + 1 :]
    if prefix and f"{prefix}.{full}" in index:
        return f"{prefix}.{full}"
    return None


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    model_cls: type | str | None = None,
    device_ids: Sequence | None = None,
    config_kwargs: Mapping[str, Any] | None = None,
    quantization_config: Any = None,
    **tp_options: Any,
) -> nn.Module:
    """Build ``model_cls`` from ``path``'s config on meta, shard it, then read each rank's slices.

    Peak memory per rank is its shards plus one read block (8 MiB), whatever the model size.
    ``dtype`` defaults to the config's dtype (else float32); every slice is converted as it is
    read. Checkpoints whose keys transformers renames or fuses at load time (e.g. per-expert MoE
    weights) fall back to transformers' loader for the whole model, with a warning.
    ``tp_options`` are `tensor_parallel`'s (``tp_size``, ``dp_size``, ``plan``, ``sharded``, ...);
    FSDP2 (``sharded``, default on when dp_size > 1) is applied after the weights are in.
    ``config_kwargs`` go to ``AutoConfig.from_pretrained`` (``revision``, ``trust_remote_code``).
    ``quantization_config`` (a ``BitsAndBytesConfig``): each rank quantizes its own slices of the
    linears as they are read (`tpkit.quant`).
    """
    import transformers
    from accelerate import init_empty_weights

    options = TPOptions.of(tp_options)
    kwargs = dict(config_kwargs or {})
    path = Path(path)
    config = transformers.AutoConfig.from_pretrained(str(path), **kwargs)
    cls = model_class(config, model_cls)
    dtype = _resolve_dtype(dtype, config)
    index = CheckpointIndex(path)
    with init_empty_weights(include_buffers=False):
        model = instantiate(cls, config, dtype)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # on meta too: tied parameters must be one object before sharding
    keys = _checkpoint_keys(model, index)
    _check_against_model(model, index, keys, path)  # every rank, before any collective
    unmapped = [n for n, k in keys.items() if k is None]
    if unmapped:
        _warn_full_load(unmapped, path)
        if quantization_config is not None:
            kwargs["quantization_config"] = quantization_config  # sliced by tpkit.quant
        model = split(cls.from_pretrained(str(path), dtype=dtype, **kwargs), device_ids, options)
        how = "transformers"
    else:
        model = _split_and_stream(model, index, keys, quantization_config, options, device_ids)
        how = "slices"
    if getattr(model, "_tpkit", None) is not None:
        model._tpkit.loaded_from = how
    apply_pending_fsdp(model)  # FSDP2 after the weights are in
    _load_generation_config(model, path)
    return model.eval()


def _split_and_stream(model, index, keys, quantization_config, options, device_ids) -> nn.Module:
    """Split the model on meta, then read each rank's slices into its shards (quantizing the
    linears' slices as they are read when asked; its refusals come before any collective)."""
    quant = None
    if quantization_config is not None:
        quant = QuantizedLoad(model, quantization_config, options, device_ids)
    model = split(model, device_ids, options)
    device = rank_device(model)
    move_buffers(model, device)
    if quant is not None:
        quant.stream(model, index, keys, device)
    stream_params(model, index, keys, device)
    return model


def _warn_full_load(unmapped: list[str], path: Path) -> None:
    if dist_env().rank == 0:
        logging.getLogger("tpkit").warning(
            f"{len(unmapped)} parameters (e.g. {unmapped[0]}) are not stored under their own "
            f"names in {path}; loading through transformers (full model in memory) instead."
        )


def _load_generation_config(model: nn.Module, path: Path) -> None:
    import transformers

    if getattr(model, "generation_config", None) is not None and model.can_generate():
        with contextlib.suppress(OSError):
            model.generation_config = transformers.GenerationConfig.from_pretrained(str(path))


def _checkpoint_keys(model: nn.Module, index: CheckpointIndex) -> dict[str, str | None]:
    """First name of each (possibly tied) parameter -> the key it is stored under, or None."""
    prefix = getattr(model, "base_model_prefix", "")
    keys = {}
    for group in param_owners(model).values():
        key = next((k for _, _, full in group if (k := _checkpoint_key(full, index, prefix))), None)
        keys[group[0][2]] = key
    return keys


def _check_against_model(
    model: nn.Module, index: CheckpointIndex, keys: dict[str, str | None], path: Path
) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    stored = {
        name: (index.entries[key].file, index.entries[key].dtype, index.entries[key].shape)
        for name, key in keys.items()
        if key is not None
    }
    problems = checkpoint_problems(params, stored)
    if problems:
        more = f"\n- ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ValueError(
            f"The checkpoint in {path} does not fit the model built from its config "
            f"({type(model).__name__}):\n- " + "\n- ".join(problems[:10]) + more + "\nCheck "
            "that config.json belongs to these weights (vocab_size, hidden sizes, layers)."
        )
