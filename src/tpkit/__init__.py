"""tpkit: one-line tensor parallelism for any PyTorch or Hugging Face model, on DTensor.

import tpkit                                   # torchrun --nproc-per-node 2 script.py
model = tpkit.tensor_parallel(model)           # every rank holds ~1/N of the weights

The package face: `tensor_parallel`, `from_pretrained` and `explain` decide here whether the
call runs on a rank (`tpkit.parallelize`, `tpkit.pretrained`) or hands the model to a worker
pool (`tpkit.pool`, outside torchrun with 2+ devices), so neither the split nor the loader
imports the pool.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tpkit import parallelize as _parallelize
from tpkit import pretrained as _pretrained
from tpkit.cli.launch import launch
from tpkit.extensions import set_builtin_extensions as _set_builtin_extensions

# plain peft / Trainer calls on tpkit models, and tensor_parallel of a PEFT model (no imports of
# either library happen here: see tpkit.integrations.autopatch)
from tpkit.integrations.autopatch import Integrations as _Integrations
from tpkit.io.checkpoint import (
    export_checkpoint,
    load_checkpoint,
    save_checkpoint,
    wait_for_checkpoint,
)
from tpkit.io.dcp import UnsafeCheckpointError
from tpkit.io.resume import resume
from tpkit.io.save import save_tensor_parallel
from tpkit.io.shards import convert_state_dict, infer_sharded_device_map, load_local_state_dict
from tpkit.parallel.context.apply import gather_sequence
from tpkit.parallel.dims import ParallelDims
from tpkit.parallel.mesh import build_mesh, dist_env, get_mesh, init_distributed
from tpkit.plan import Plan, PlanLike, StyleSpec, derive_plan, validate
from tpkit.pool import ModelHandle, PoolError, optim
from tpkit.pool.entry import pool_from_pretrained as _pool_from_pretrained
from tpkit.pool.entry import pool_tensor_parallel as _pool_tensor_parallel
from tpkit.quant.extension import QuantExtension as _QuantExtension
from tpkit.state import TPOptions, TPState, tp_state
from tpkit.styles import TPStyle, register_style
from tpkit.training.clip import clip_grad_norm_

# tpkit's own split extensions, in the one order every split consults them (tpkit.extensions),
# installed here and nowhere else: the quantized base first (a PEFT model on a bitsandbytes base
# is refused before the PEFT integration would split it), then the library integrations.
_set_builtin_extensions(_QuantExtension(), _Integrations())

__version__ = "0.1.0"

__all__ = [
    "ModelHandle",
    "ParallelDims",
    "Plan",
    "PoolError",
    "StyleSpec",
    "TPOptions",
    "TPState",
    "TPStyle",
    "UnsafeCheckpointError",
    "build_mesh",
    "clip_grad_norm_",
    "convert_state_dict",
    "derive_plan",
    "dist_env",
    "explain",
    "export_checkpoint",
    "from_pretrained",
    "gather_sequence",
    "get_mesh",
    "infer_sharded_device_map",
    "init_distributed",
    "launch",
    "load_checkpoint",
    "load_local_state_dict",
    "optim",
    "register_style",
    "resume",
    "save_checkpoint",
    "save_tensor_parallel",
    "tensor_parallel",
    "tp_state",
    "validate",
    "wait_for_checkpoint",
]


def tensor_parallel(
    model: nn.Module,
    device_ids: Sequence[str | int | torch.device] | None = None,
    *,
    tp_size: int | None = None,
    dp_size: int | None = None,
    dp_replicate_size: int | None = None,
    dp_shard_size: int | None = None,
    cp_size: int | None = None,
    cp_attention: str = "auto",
    ep_size: int | None = None,
    ep_implementation: str | None = None,
    ep_plan: Mapping[str, str] | None = None,
    distributed_config: Any = None,
    plan: PlanLike = "auto",
    mesh: DeviceMesh | None = None,
    sharded: bool | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    param_dtype: torch.dtype | None = None,
    mixed_precision: Any = None,
    cpu_offload: bool = False,
    reshard_after_forward: bool | int = True,
    fsdp_plan: Mapping[str, str] | None = None,
    example_inputs: tuple | Mapping | None = None,
    fill_later: bool = False,
) -> nn.Module:
    """Split ``model`` over the ranks of its tensor-parallel group, in place, and return it.

    Run on every rank (``torchrun --nproc-per-node N script.py``) with identical weights. Each
    parameter becomes a DTensor on ``mesh["tp"]``: sharded where the plan says so, replicated
    otherwise; the model keeps its class, ``forward``, ``generate`` and ``save_pretrained``.

    Args:
        model: any ``nn.Module``; a transformers model uses its ``base_model_tp_plan``.
        device_ids: the familiar ``["cuda:0", "cuda:1"]``: local rank i uses ``device_ids[i]``.
        tp_size: ranks per TP group; default what the other sizes leave of the world.
        dp_size: data-parallel ranks (dp_replicate x dp_shard); alone, the FSDP2 axis
            (``dp_shard_size``), or plain replicas with ``sharded=False``.
        dp_replicate_size: HSDP's replicas (outermost; across nodes): parameters sharded over
            dp_shard within a replica, gradients reduce-scattered there and all-reduced across
            replicas (with dp_shard_size=1: whole replicas, gradients all-reduced).
        dp_shard_size: FSDP2's axis; default what the other sizes leave of the world.
        cp_size: context parallelism: each batch's sequence split over this many ranks
            (zigzag chunks), attention over the whole context (`tpkit.parallel.context`).
            Every rank passes the whole batch and gets the whole batch's loss; per-token
            outputs are the rank's tokens (`tpkit.gather_sequence` puts them in order).
        cp_attention: how attention sees the rest of the sequence under CP: ``"allgather"``
            (keys and values gathered), ``"ring"`` (passed around the ring, online softmax),
            ``"ulysses"`` (all-to-all to heads), or ``"auto"`` (all-gather; the ring for
            long sequences).
        ep_size: expert parallelism: whole experts of every MoE layer placed on ranks, each
            routed token sent to its experts' ranks (a multiple of tp_size dividing
            dp_shard_size x tp_size, as transformers'; expert weights FSDP-sharded over the
            dp_shard x tp / ep ranks that hold the same experts). See docs/expert-parallel.md.
        ep_implementation: how tokens reach their experts: ``"all_to_all"`` (tokens
            exchanged, variable counts), ``"all_reduce"`` (every rank of the EP group holds the
            same tokens, ep == tp: each runs its own experts' pairs, the outputs summed), or
            ``"auto"`` (the default: all-reduce where ep == tp, all-to-all otherwise).
        ep_plan: experts modules to place beside those the model's ``base_model_ep_plan``
            names or tpkit's probe finds, in transformers' format
            (``{"model.layers.*.mlp.experts": "ep_dispatch_experts"}``).
        distributed_config: a transformers ``DistributedConfig`` or an accelerate
            ``ParallelismConfig``, read for the sizes above (`tpkit.parallel.dims.sizes_of`).
        plan: ``"auto"`` (transformers plan, else inferred), ``"config"``, ``"infer"``, or a
            ``{pattern: style}`` dict / `Plan` / YAML path merged over the auto plan.
        mesh: a DeviceMesh to use instead of building one from the world size: dimensions
            named among ``("dp_replicate", "dp_shard", "cp", "tp")`` ("dp" for dp_shard), tp
            innermost; a 1-D unnamed mesh is the TP group.
        sharded: FSDP2 (``fully_shard`` per block, then the root) over the data axes after TP;
            default on when dp > 1. With ``sharded=False`` the dp replicas are independent
            (inference, or your own gradient averaging).
        sequence_parallel: norms, dropout and residuals of each block split along the sequence
            (all-gather / reduce-scatter instead of all-reduce); training only, decoder-only.
        loss_parallel: in training, the lm_head hands the loss vocab-sharded logits (a
            ``Shard(-1)`` DTensor) and the cross-entropy never gathers the vocabulary.
        param_dtype: FSDP2 mixed precision: parameters and compute in this dtype (e.g.
            ``torch.bfloat16``), gradient reductions in float32. Needs ``sharded``.
        mixed_precision: torch's ``MixedPrecisionPolicy`` for FSDP2 (param, reduce and output
            dtypes), instead of ``param_dtype``'s.
        cpu_offload: FSDP2's CPU offload (torch's ``CPUOffloadPolicy``): sharded parameters,
            gradients and the optimizer step live on the CPU, copied to the device per unit.
        reshard_after_forward: FSDP2's: free each unit's gathered weights after its forward
            (True), keep them for backward (False), or reshard to a smaller group (an int).
        fsdp_plan: which modules are FSDP2 units, transformers' spelling
            (``{"model.layers.*": "free_full_weight", "lm_head": "keep_full_weight"}``), merged
            over the model's own ``fsdp_plan``; default that plan, else one unit per block.
        example_inputs: a positional tuple or kwargs dict for the plan's fake-tensor trace, for
            a forward the inputs tpkit makes up from the model (`tpkit.trace.inputs`) do not
            fit; without them, a model that cannot be traced is split per layer, exactly
            (`tpkit.sources.fallback`).
        fill_later: the model is on the meta device on purpose and its weights are put in after
            the split (training from scratch: ``to_empty`` and an init; `load_local_state_dict`;
            accelerate's ``load_checkpoint_in_model``). Without it a model with parameters on
            meta is refused, on every rank before any collective: built empty and never loaded,
            it cannot run (`tpkit.from_pretrained` loads after its own split).

    A model tpkit already split is returned as it is (or refused when asked for another layout).
    Outside torchrun (world size 1) the model is returned unchanged (moved to ``device_ids[0]``
    when given), unless the call names 2+ devices or sizes whose product is >= 2: then one
    worker process per device holds the shards and a `tpkit.pool.ModelHandle` is returned.
    """
    options = TPOptions(
        tp_size=tp_size,
        dp_size=dp_size,
        dp_replicate_size=dp_replicate_size,
        dp_shard_size=dp_shard_size,
        cp_size=cp_size,
        cp_attention=cp_attention,
        ep_size=ep_size,
        ep_implementation=ep_implementation,
        ep_plan=ep_plan,
        distributed_config=distributed_config,
        plan=plan,
        mesh=mesh,
        sharded=sharded,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        param_dtype=param_dtype,
        mixed_precision=mixed_precision,
        cpu_offload=cpu_offload,
        reshard_after_forward=reshard_after_forward,
        fsdp_plan=fsdp_plan,
        example_inputs=example_inputs,
        fill_later=fill_later,
    )
    if (handle := _pool_tensor_parallel(model, device_ids, options)) is not None:
        return handle  # outside torchrun, 2+ devices: a live model on worker processes
    return _parallelize.parallelize(model, device_ids, options)


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
    """Build ``model_cls`` from ``path``'s config on meta, shard it, then read each rank's slices.

    Peak memory per rank is its shards plus one read block (8 MiB), whatever the model size.
    ``dtype`` defaults to the config's dtype (else float32); every slice is converted as it is
    read. Checkpoints whose keys transformers renames or fuses at load time (e.g. per-expert MoE
    weights) fall back to transformers' loader for the whole model, with a warning.
    ``path`` is a checkpoint directory or a hub id, resolved as transformers resolves it
    (`tpkit.io.hub`: ``cache_dir``, ``revision``, ``subfolder``, ``variant``, ``token``,
    ``local_files_only``, ``HF_HUB_OFFLINE``); safetensors are preferred, ``pytorch_model*.bin``
    is read without running code (`tpkit.io.pickle_safe`). ``kwargs`` are `tensor_parallel`'s options
    (``tp_size``, ``dp_size``, ``plan``, ``sharded``, ...) and transformers' ``from_pretrained``
    keywords, meaning what they mean there (`tpkit.io.load_kwargs`: ``torch_dtype``,
    ``attn_implementation``, ``trust_remote_code``, ``distributed_config``, config overrides
    such as ``num_hidden_layers=1``); ``device_map`` and unknown keywords are refused, before any
    collective. FSDP2 (``sharded``, default on when dp_size > 1) is applied after the weights
    are in. ``config_kwargs``: more keywords, taken as if passed directly.
    ``quantization_config`` (a ``BitsAndBytesConfig``): each rank quantizes its own slices of the
    linears as they are read (`tpkit.quant`).

    Weights the model has and the checkpoint lacks, tensors the checkpoint holds and the model
    does not use, and weights of another shape are one ValueError on every rank, before any
    collective (transformers would warn and leave them random). Opt in to new weights with
    ``allow_missing_keys`` (True or regexes, e.g. ``["score"]`` for a fresh classification
    head: initialised by the model's ``_init_weights``, the same on every rank),
    ``allow_unexpected_keys`` (skip them) and ``ignore_mismatched_sizes`` (transformers'
    keyword: re-initialise them); see `tpkit.io.loading_info`. ``output_loading_info=True`` returns
    ``(model, info)`` with transformers' ``missing_keys`` / ``unexpected_keys`` /
    ``mismatched_keys`` / ``error_msgs``.
    """
    named = dict(
        dtype=dtype,
        model_cls=model_cls,
        config_kwargs=config_kwargs,
        quantization_config=quantization_config,
        allow_missing_keys=allow_missing_keys,
        allow_unexpected_keys=allow_unexpected_keys,
        ignore_mismatched_sizes=ignore_mismatched_sizes,
        output_loading_info=output_loading_info,
    )
    pooled = _pool_from_pretrained(path, device_ids, named, kwargs)
    if pooled is not None:  # outside torchrun, 2+ devices: a live model on workers
        return pooled
    return _pretrained.from_pretrained(path, device_ids=device_ids, **named, **kwargs)


def explain(plan: Any, model: nn.Module | None = None, tp_size: int = 1, ep_size: int = 1) -> str:
    """A plan as a table: without a model, its entries; with one, what ``tpkit plan`` prints
    (parameters, styles, global -> local shapes, bytes per rank, collectives; the experts of a
    plan placed by expert parallelism split by experts over ``ep_size`` ranks). For a
    `ModelHandle` (``tpkit.explain(model)``) the plan its workers applied."""
    from tpkit.plan.table import explain as explain_plan

    if isinstance(plan, ModelHandle):
        return plan.explain()
    return explain_plan(plan, model, tp_size, ep_size)
