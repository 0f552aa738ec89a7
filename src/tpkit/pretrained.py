"""`from_pretrained`: a transformers checkpoint straight into shards.

The model is built on the meta device, the plan is derived, validated and applied there (every
parameter a DTensor with a meta local tensor), and only then is each rank's slice read from the
safetensors files (`tpkit.io.safetensors`, which reads just the slice's bytes) into a freshly
allocated local shard. No rank ever holds the whole model. The checkpoint's names and shapes are
checked against the model's first (`tpkit.io.loading_info`: missing, unexpected and mismatched
weights are an error unless opted in), on every rank, before any collective.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tpkit.io.build import SkipMetaFills, instantiate, model_class
from tpkit.io.expert_stream import expert_recipes, stream_experts
from tpkit.io.hub import resolve_checkpoint
from tpkit.io.load_kwargs import check_unused, sort_kwargs
from tpkit.io.loading_info import LoadingInfo, LoadingPolicy, fresh_weights, loading_info
from tpkit.io.safetensors import CheckpointIndex
from tpkit.io.shards import rank_device
from tpkit.io.stream import move_buffers, prefetch, stream_buffers, stream_params
from tpkit.parallel.mesh import dist_env
from tpkit.parallelize import apply_pending_fsdp, split
from tpkit.plan.checks import checkpoint_problems
from tpkit.quant import QuantizedLoad
from tpkit.sources.expert_placement import expert_modules
from tpkit.state import TPOptions

__all__ = ["from_pretrained", "meta_model"]


def _resolve_dtype(dtype, config) -> torch.dtype:
    dtype = dtype if dtype not in (None, "auto") else getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype or torch.float32


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    model_cls: type | str | None = None,
    device_ids: Sequence | None = None,
    config_kwargs: Mapping[str, Any] | None = None,
    quantization_config: Any = None,
    allow_missing_keys: bool | Sequence[str] = False,
    allow_unexpected_keys: bool | Sequence[str] = False,
    ignore_mismatched_sizes: bool = False,
    output_loading_info: bool = False,
    **kwargs: Any,
) -> nn.Module | tuple[nn.Module, dict[str, Any]]:
    """`tpkit.from_pretrained` on a rank (the package face decides rank or pool; every keyword
    means what its docstring says): build ``model_cls`` from ``path``'s config on meta, split
    it, then read each rank's slices."""
    import transformers

    tp_fields = [f.name for f in dataclasses.fields(TPOptions)]
    call = sort_kwargs({**(config_kwargs or {}), **kwargs}, tp_fields, dtype)
    options = TPOptions.of(call.tp_options)
    policy = LoadingPolicy(allow_missing_keys, allow_unexpected_keys, ignore_mismatched_sizes)
    source = str(path)
    ckpt = resolve_checkpoint(source, call.variant, call.use_safetensors, **call.download)
    download = ckpt.download  # the revision resolved to its commit: config and weights agree
    config = _load_config(transformers, source, call, download, tp_fields)
    cls = model_class(config, model_cls)
    dtype = _resolve_dtype(call.dtype, config)
    index = ckpt.open()  # headers checked / .bin unpickled without code, before any collective
    if ckpt.format == "safetensors":  # the kernel reads the files while the model is split
        prefetch({e.file for e in index.entries.values()})
    path = ckpt.folder
    model = _build(cls, config, dtype, call.trust_remote_code)
    # every check on every rank, before any collective: names, counts, shapes, dtypes
    info = loading_info(model, index)
    if call.overrides and info.unexpected:
        info = _skip_overridden(info, call, source, download, cls, index, path)
    fresh_names = policy.check(info, model, path)
    keys = {n: (None if n in fresh_names else k) for n, k in info.keys.items()}
    _check_against_model(model, index, keys, path)
    recipes = _expert_recipes(model, index, info, options, device_ids, quantization_config)
    if info.renamed and recipes is None:
        _warn_full_load(info.renamed, path)
        extra: dict[str, Any] = dict(download)
        if quantization_config is not None:
            extra["quantization_config"] = quantization_config  # sliced by tpkit.quant
        if call.trust_remote_code is not None:
            extra["trust_remote_code"] = call.trust_remote_code
        loaded, report = cls.from_pretrained(
            source,
            config=config,
            dtype=dtype,
            output_loading_info=True,
            ignore_mismatched_sizes=ignore_mismatched_sizes,
            variant=call.variant,
            use_safetensors=ckpt.format == "safetensors",
            **extra,
        )
        fresh_names = _check_transformers_report(report, loaded, path, policy, fresh_names)
        _put_fresh(loaded, fresh_weights(model, fresh_names))
        model = split(loaded, device_ids, options)
        how = "transformers"
    else:
        fresh = fresh_weights(model, fresh_names)
        model = _split_and_stream(
            model, index, keys, fresh, quantization_config, options, device_ids, path, recipes
        )
        how, report = "slices", info.to_dict()
    if getattr(model, "_tpkit", None) is not None:
        model._tpkit.loaded_from = how
    apply_pending_fsdp(model)  # FSDP2 after the weights are in
    _load_generation_config(model, source, download, call.generation_config)
    model.eval()
    return (model, report) if output_loading_info else model


def _build(cls, config, dtype: torch.dtype, trust_remote_code: bool | None) -> nn.Module:
    """The model ``from_pretrained`` splits: parameters on meta, buffers real, ties made."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False), SkipMetaFills():
        model = instantiate(cls, config, dtype, trust_remote_code)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # on meta too: tied parameters must be one object before sharding
    return model


def meta_model(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    model_cls: type | str | None = None,
) -> nn.Module:
    """The model ``from_pretrained(path, dtype=..., model_cls=...)`` builds before it splits,
    without reading a weight: what ``tpkit plan --save`` plans, so that the plan it stores has
    the key ``from_pretrained`` looks for (`tpkit.io.plans`)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(path))
    return _build(model_class(config, model_cls), config, _resolve_dtype(dtype, config), None)


def _expert_recipes(model, index, info, options, device_ids, quantization_config):
    """Per-expert checkpoint keys of the fused experts (`tpkit.io.expert_stream`) when every
    weight the checkpoint does not store under its own name is one expert parallelism will
    place (``ep_size`` > 1, found on the meta model as the split will find it): then each rank
    reads only its own experts. None otherwise (transformers' full load)."""
    if not info.renamed or quantization_config is not None or options.dims(device_ids).ep == 1:
        return None
    placed = expert_modules(model, list((options.ep_plan or {}).keys()))[0]
    if not all(any(n.startswith(f"{e}.") for e in placed) for n in info.renamed):
        return None
    return expert_recipes(model, index, info.renamed)


def _split_and_stream(
    model, index, keys, fresh, quantization_config, options, device_ids, folder, recipes=None
) -> nn.Module:
    """Split the model on meta, then read each rank's slices into its shards (quantizing the
    linears' slices as they are read when asked: `QuantizedLoad` takes part in the split as an
    extension, so its splits are checked against the one plan the split derives, before any
    collective). Weights in ``fresh`` (full values of new weights) take their slices from there
    instead. A plan ``tpkit plan --save`` stored in ``folder`` is used instead of planning."""
    quant = None
    if quantization_config is not None:
        quant = QuantizedLoad(model, quantization_config)
    later = dataclasses.replace(options, fill_later=True)  # the slices are read next
    extensions = (quant,) if quant is not None else ()
    model = split(model, device_ids, later, extensions=extensions, saved_plans=folder)
    device = rank_device(model)
    move_buffers(model, device)
    stream_buffers(model, index, keys, fresh, device)
    if quant is not None:
        quant.stream(model, index, keys, device, fresh)
    if recipes:  # a rank's own experts, from their per-expert keys
        left = stream_experts(model, index, recipes, device)
        if left:
            raise RuntimeError(f"tpkit: {left[0]} was expected to be split by experts; it is not.")
    stream_params(model, index, keys, device, fresh, skip=set(recipes or ()))
    return model


def _skip_overridden(info, call, source, download, cls, index, path) -> LoadingInfo:
    """Checkpoint tensors the model built from the checkpoint's own config uses but the config
    overrides leave out (``num_hidden_layers=1``: the later layers) are the caller's choice, as
    in transformers: skipped with a warning, not refused. Weights the overrides add stay
    missing (an error): they would be random."""
    import transformers
    from accelerate import init_empty_weights

    kwargs = dict(download)
    if call.trust_remote_code is not None:
        kwargs["trust_remote_code"] = call.trust_remote_code
    base_config = transformers.AutoConfig.from_pretrained(source, **kwargs)
    with init_empty_weights(include_buffers=True):
        base = instantiate(cls, base_config, None, call.trust_remote_code)
    used = {k for k in loading_info(base, index).keys.values() if k is not None}
    skipped = [k for k in info.unexpected if k in used]
    if skipped and dist_env().rank == 0:
        logging.getLogger("tpkit").warning(
            f"from_pretrained({path}): {len(skipped)} checkpoint tensor(s) the overrides "
            f"{sorted(call.overrides)} leave unused were skipped, e.g. {skipped[0]}."
        )
    return dataclasses.replace(info, unexpected=[k for k in info.unexpected if k not in used])


def _check_transformers_report(
    report: dict[str, Any], model: nn.Module, path: Path, policy: LoadingPolicy, fresh: list[str]
) -> list[str]:
    """transformers' own report of a load it did, held to the same policy (the names it
    renamed are its own to judge); returns the weights to initialise afresh, the same on every
    rank (transformers drew them from each rank's own RNG)."""
    mine = LoadingInfo(
        keys={},
        missing=sorted(report.get("missing_keys", ())),
        unexpected=sorted(report.get("unexpected_keys", ())),
        mismatched=sorted(report.get("mismatched_keys", ())),
    )
    again = policy.check(mine, model, path, quiet=True)
    return fresh + [n for n in again if n not in fresh]


def _put_fresh(model: nn.Module, fresh: Mapping[str, torch.Tensor]) -> None:
    """Fresh values into a model transformers loaded (real, unsplit) before it is split."""
    with torch.no_grad():
        for name, value in fresh.items():
            target = _tensor(model, name)
            target.copy_(value.to(target.device, target.dtype))


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    mod_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(mod_name)
    t = module._parameters.get(leaf)
    return t if t is not None else module._buffers[leaf]


def _warn_full_load(unmapped: list[str], path: Path) -> None:
    if dist_env().rank == 0:
        logging.getLogger("tpkit").warning(
            f"{len(unmapped)} parameters (e.g. {unmapped[0]}) are not stored under their own "
            f"names in {path}; loading through transformers (full model in memory) instead."
        )


def _load_generation_config(
    model: nn.Module, source: str, download: Mapping[str, Any], given: Any = None
) -> None:
    """The checkpoint's generation_config.json (or the one the caller passed), as transformers'
    ``from_pretrained`` sets it."""
    import transformers

    if getattr(model, "generation_config", None) is not None and model.can_generate():
        if given is not None:
            model.generation_config = given
            return
        with contextlib.suppress(OSError):
            model.generation_config = transformers.GenerationConfig.from_pretrained(
                source, **download
            )


def _load_config(transformers, source: str, call, download: Mapping[str, Any], tp_fields):
    """The config as transformers' ``from_pretrained`` builds it: the checkpoint's (or the
    ``config`` passed, copied), the keyword overrides applied (unknown ones refused by name),
    ``attn_implementation`` / ``experts_implementation`` set on it."""
    if isinstance(call.config, transformers.PretrainedConfig):
        if call.overrides:
            check_unused(call.overrides, call.config, tp_fields)
        config = copy.deepcopy(call.config)
    else:
        kwargs = {**download, **call.overrides}
        if call.trust_remote_code is not None:
            kwargs["trust_remote_code"] = call.trust_remote_code
        config, unused = transformers.AutoConfig.from_pretrained(
            str(call.config) if call.config is not None else source,
            return_unused_kwargs=True,
            **kwargs,
        )
        check_unused(unused, config, tp_fields)
    for name, value in call.implementations.items():
        setattr(config, f"_{name}", value)  # what transformers' from_pretrained does
    return config


def _check_against_model(
    model: nn.Module, index: CheckpointIndex, keys: dict[str, str | None], path: Path
) -> None:
    """Every tensor that will be read holds a dtype the model's converts from (shapes are
    `loading_info`'s)."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    stored = {
        name: (index.entries[key].file, index.entries[key].dtype, index.entries[key].shape)
        for name, key in keys.items()
        if key is not None
    }
    problems = checkpoint_problems(tensors, stored)
    if problems:
        more = f"\n- ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ValueError(
            f"The checkpoint in {path} does not fit the model built from its config "
            f"({type(model).__name__}):\n- " + "\n- ".join(problems[:10]) + more + "\nCheck "
            "that config.json belongs to these weights (vocab_size, hidden sizes, layers)."
        )
