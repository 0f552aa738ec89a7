"""transformers' ``from_pretrained`` keywords, sorted for `tpkit.from_pretrained`.

A user coming from transformers types ``from_pretrained(id, torch_dtype=..., attn_implementation=
"eager", revision=..., num_hidden_layers=1, distributed_config=DistributedConfig(tp_size=2))``.
Each keyword means here what it means there, or is refused with the reason, on every rank
before any file is read or any collective runs:

- where the files come from (``cache_dir``, ``revision``, ``subfolder``, ``variant``, ``token``,
  ``local_files_only``, ``force_download``, ``proxies``, ``use_safetensors``): `tpkit.io.hub`;
- ``dtype`` / ``torch_dtype`` (transformers' older name: ``dtype`` wins when both are given);
- ``attn_implementation``, ``experts_implementation``: set on the config as transformers sets
  them; ``trust_remote_code``: passed to transformers, which asks or refuses as it does itself;
  ``config``: a config (object or path) instead of the checkpoint's; ``generation_config``;
- ``distributed_config`` (transformers' ``DistributedConfig``) and ``tp_plan`` / ``tp_size``:
  tpkit's ``tp_size``, ``plan``, ``dp_shard_size`` (its ``fsdp_size``: FSDP2 over the
  data-parallel ranks), ``dp_replicate_size`` (HSDP), ``fsdp_plan``, ``cpu_offload``
  (``fsdp_cpu_offload``), ``mixed_precision`` (``fsdp_mixed_precision``: bf16 parameters, float32
  reductions, as transformers builds it) and ``sequence_parallel``
  (``enable_sequence_parallel``); the settings tpkit has no counterpart for (pipeline, expert
  parallelism) are refused by name;
- ``device_map`` and its companions are refused: tpkit places every rank's shards itself;
- no-ops transformers itself ignores (``low_cpu_mem_usage`` ...) are accepted;
- everything else is a config override, as in transformers (``num_hidden_layers=1``): checked
  against the config when it is loaded, and a keyword the config does not have is refused by name
  (transformers would hand it to the model's ``__init__``, which fails further in).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from tpkit.io.hub import DOWNLOAD_KEYS

__all__ = ["PretrainedKwargs", "check_unused", "sort_kwargs"]

#: keywords transformers' from_pretrained accepts and drops itself
_IGNORED = frozenset({"low_cpu_mem_usage", "_fast_init", "mirror", "offload_state_dict",
                      "from_tf", "from_flax", "_from_auto", "_from_pipeline", "_commit_hash",
                      "disable_mmap", "tqdm_class"})  # fmt: skip

_PLACEMENT = (
    "tpkit places each rank's shards on that rank's device itself (device_ids=[...] picks the "
    "devices); {name} would place the model's modules across devices a second time and fight "
    "the tensor-parallel split. Drop {name}."
)

#: transformers keywords tpkit cannot honour, and why
_REFUSED = MappingProxyType(
    {
        "device_map": _PLACEMENT,
        "max_memory": _PLACEMENT,
        "offload_folder": _PLACEMENT,
        "offload_buffers": _PLACEMENT,
        "device_mesh": "pass tpkit's mesh= (a DeviceMesh with a 'tp' dimension) instead of {name}.",
        "state_dict": "{name} loads weights already in memory: build the model and call "
        "tpkit.tensor_parallel(model) instead.",
        "gguf_file": "tpkit reads safetensors and .bin checkpoints; {name} is not supported.",
        "key_mapping": "{name} renames checkpoint keys; tpkit loads keys as stored (save the "
        "renamed model with save_pretrained first).",
        "adapter_kwargs": "load the base model with tpkit.from_pretrained, then the adapter with "
        "peft's PeftModel.from_pretrained (tpkit splits it); {name} is not supported.",
        "adapter_name": "load the adapter with peft's PeftModel.from_pretrained after tpkit."
        "from_pretrained; {name} is not supported.",
        "use_kernels": "hub kernels replace modules tpkit splits; {name} is not supported.",
        "kernel_config": "hub kernels replace modules tpkit splits; {name} is not supported.",
        "fusion_config": "{name} fuses modules tpkit splits; it is not supported.",
    }
)

#: DistributedConfig fields that do nothing unless another one is set (ep_size > 1)
_DIST_INERT = frozenset({"ep_plan", "ep_implementation", "pp_size", "ep_size"})


@dataclass
class PretrainedKwargs:
    """One ``from_pretrained`` call's keywords, sorted (see the module docstring)."""

    download: dict[str, Any] = field(default_factory=dict)
    variant: str | None = None
    use_safetensors: bool | None = None
    dtype: Any = None
    trust_remote_code: bool | None = None
    implementations: dict[str, Any] = field(default_factory=dict)
    config: Any = None
    generation_config: Any = None
    overrides: dict[str, Any] = field(default_factory=dict)
    tp_options: dict[str, Any] = field(default_factory=dict)

    def config_kwargs(self) -> dict[str, Any]:
        """What ``AutoConfig.from_pretrained`` takes: the download keywords, trust_remote_code
        and the overrides."""
        out = {**self.download, **self.overrides}
        if self.trust_remote_code is not None:
            out["trust_remote_code"] = self.trust_remote_code
        return out


def sort_kwargs(
    kwargs: Mapping[str, Any], tp_fields: Iterable[str], dtype: Any = None
) -> PretrainedKwargs:
    """Sort ``kwargs`` (everything but tpkit's own named parameters); ``tp_fields`` are
    `TPOptions`' names. Pure: refusals are raised here, on every rank alike."""
    tp_fields = set(tp_fields)
    out = PretrainedKwargs(dtype=dtype)
    rest = dict(kwargs)
    for name in sorted(rest):
        if name in _REFUSED and rest[name] is not None and rest[name] is not False:
            raise ValueError(f"tpkit.from_pretrained: {_REFUSED[name].format(name=name)}")
    for name in list(rest):
        if name in _REFUSED or name in _IGNORED:
            rest.pop(name)
    torch_dtype = rest.pop("torch_dtype", None)
    out.dtype = dtype if dtype is not None else torch_dtype
    if rest.pop("weights_only", True) is not True:
        raise ValueError(
            "tpkit.from_pretrained: weights_only=False would unpickle code from .bin files; "
            "tpkit reads them with weights_only=True only (or use safetensors)."
        )
    for name in DOWNLOAD_KEYS:
        if name in rest:
            out.download[name] = rest.pop(name)
    out.variant = rest.pop("variant", None)
    out.use_safetensors = rest.pop("use_safetensors", None)
    out.trust_remote_code = rest.pop("trust_remote_code", None)
    out.config = rest.pop("config", None)
    out.generation_config = rest.pop("generation_config", None)
    for name in ("attn_implementation", "experts_implementation"):
        if name in rest:
            out.implementations[name] = rest.pop(name)
    dist = rest.pop("distributed_config", None)
    tp_plan = rest.pop("tp_plan", None)
    out.tp_options = {k: rest.pop(k) for k in list(rest) if k in tp_fields}
    if dist is not None:
        if tp_plan is not None or "tp_size" in kwargs:
            raise ValueError(
                "tpkit.from_pretrained: pass either distributed_config or tp_size / tp_plan, not "
                "both (as in transformers): set the sizes on the DistributedConfig."
            )
        _merge(out.tp_options, _from_distributed_config(dist))
    elif tp_plan is not None:
        _merge(out.tp_options, {"plan": tp_plan})
    out.overrides = rest
    return out


def _merge(options: dict[str, Any], extra: dict[str, Any]) -> None:
    for k, v in extra.items():
        if k in options and options[k] != v:
            raise ValueError(
                f"tpkit.from_pretrained: {k}={options[k]!r} and the distributed_config's "
                f"{v!r} disagree; give it once."
            )
        options[k] = v


def _from_distributed_config(dist: Any) -> dict[str, Any]:
    """transformers' ``DistributedConfig`` as tpkit options; a field tpkit has no counterpart
    for, set to anything but its default (sizes: anything above 1), is refused by name rather
    than silently ignored (a field a later transformers adds included)."""
    if not dataclasses.is_dataclass(dist):
        raise TypeError(
            f"distributed_config must be a transformers DistributedConfig, got {type(dist).__name__}."
        )
    values = {f.name: getattr(dist, f.name) for f in dataclasses.fields(dist)}
    defaults = {
        f.name: (f.default if f.default is not dataclasses.MISSING else None)
        for f in dataclasses.fields(dist)
    }
    out: dict[str, Any] = {}
    if values.pop("tp_size", None) is not None:
        out["tp_size"] = dist.tp_size
    if values.pop("tp_plan", None) not in (None, "auto"):
        out["plan"] = dist.tp_plan  # rules over the model's own plan, as in transformers
    replicate, shard = values.pop("dp_replicate_size", None), values.pop("fsdp_size", None)
    if (replicate or 1) * (shard or 1) > 1:  # FSDP2 / HSDP over the data axes
        out["dp_shard_size"], out["sharded"] = shard or 1, True
        if (replicate or 1) > 1:
            out["dp_replicate_size"] = replicate
    if values.pop("fsdp_plan", None) is not None:
        out["fsdp_plan"] = dist.fsdp_plan
    if values.pop("fsdp_cpu_offload", False):
        out["cpu_offload"] = True
    if values.pop("fsdp_mixed_precision", False):
        out["mixed_precision"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    if values.pop("enable_sequence_parallel", False):
        out["sequence_parallel"] = True
    values.pop("enable_expert_parallel", None)  # transformers' mirror of ep_size > 1
    ep = values.pop("ep_size", None)
    ep_plan, ep_impl = values.pop("ep_plan", None), values.pop("ep_implementation", None)
    if ep not in (None, 1):
        out["ep_size"] = ep
        if ep_impl not in (None, "auto"):
            out["ep_implementation"] = ep_impl
        if ep_plan:
            out["ep_plan"] = dict(ep_plan)
    for name in _DIST_INERT:  # sizes: 1 / None is off; plans follow their size
        value = values.pop(name, None)
        if name.endswith("_size") and value not in (None, 1):
            values[name] = value
    refused = [f"{k}={v!r}" for k, v in values.items() if v != defaults.get(k)]
    if refused:
        raise ValueError(
            f"tpkit.from_pretrained: distributed_config sets {', '.join(sorted(refused))}, which "
            "tpkit has no counterpart for (it maps tp_size, tp_plan -> plan, fsdp_size -> "
            "dp_shard_size and dp_replicate_size (FSDP2 / HSDP), fsdp_plan, fsdp_cpu_offload -> "
            "cpu_offload, fsdp_mixed_precision -> mixed_precision, enable_sequence_parallel -> "
            "sequence_parallel, ep_size, ep_plan and ep_implementation; it has no pipeline "
            "parallelism). Remove them."
        )
    return out


def check_unused(unused: Mapping[str, Any], config: Any, tp_fields: Iterable[str]) -> None:
    """Keywords neither tpkit, transformers' loader nor the config took: one TypeError naming
    them (transformers would pass them to the model's ``__init__``)."""
    if unused:
        raise TypeError(
            f"tpkit.from_pretrained got unknown keyword(s) {sorted(unused)}: not a "
            f"tensor_parallel option ({', '.join(sorted(tp_fields))}), not a transformers "
            f"from_pretrained keyword, and not an attribute of {type(config).__name__} to "
            "override. Check the spelling."
        )
