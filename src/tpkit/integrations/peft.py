"""PEFT (LoRA) adapters on tensor-parallel tpkit models: train, save, load, merge.

Usage (``torchrun --nproc-per-node 2 train.py``)::

    import tpkit
    from peft import LoraConfig
    from tpkit.integrations import peft as tp_peft

    cfg = LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                           "gate_proj", "up_proj", "down_proj"])
    # adapters on an already sharded model (tp only) ...
    model = tp_peft.get_peft_model(tpkit.tensor_parallel(model), cfg)
    # ... or shard a PEFT model (needed for dp x tp with FSDP2: adapters come before sharding)
    model = tp_peft.tensor_parallel(peft.get_peft_model(model, cfg), tp_size=2, dp_size=2)
    # ... or load a saved adapter onto a sharded base (e.g. from tpkit.from_pretrained)
    model = tp_peft.from_pretrained(tpkit.from_pretrained(path), adapter_dir)

    model.save_pretrained("out")           # every rank; rank 0 writes a normal, unsharded adapter
    merged = model.merge_and_unload()      # the merged, still sharded, base model

Or keep plain peft calls: after ``tp_peft.patch_peft()`` (once per process, like
``patch_trainer``), ``peft.get_peft_model(tpkit_model, cfg)``, ``PeftModel.from_pretrained(
tpkit_model, dir)``, ``load_adapter`` / ``add_adapter`` and ``save_pretrained`` do the same;
models tpkit did not shard are untouched.

Why explicit entry points and not automatic handling inside ``tpkit.tensor_parallel``: core tpkit
never imports integrations, and *unpatched* ``peft.get_peft_model`` on a tpkit model silently sizes
nn.Linear adapters from the *local* shard (peft reads ``weight.to_local().shape`` for a DTensor
weight on a mesh not named "fsdp"), each rank with its own random adapter. ``tpkit.tensor_parallel``
of a PeftModel must go through this module's `tensor_parallel` (core's plan does not see the
wrapped names). These functions size adapters from the global shapes and then lay them out:

- column-parallel base (``colwise``, ``packed_colwise``, GPT-2's ``packed_qkv_colwise``): ``lora_A``
  replicated, ``lora_B`` split like the base weight (the same strided split for packed q|k|v and
  gate|up), with Megatron's f on ``lora_B``'s input, so the r-wide activation's gradient is summed
  once per layer. The base layer keeps its own f.
- row-parallel base (``rowwise``): ``lora_A`` split by input rows, ``lora_B`` replicated (its
  gradient all-reduced), and the adapter output added to the base layer's *partial* sums before
  its single all-reduce: `tpkit.styles.RowwiseStyle.defer_reduction` holds the base's reduction
  and bias back while the peft wrapper runs, and a hook on the wrapper finishes it.
- output head (``colwise_gather_output``), vocab-parallel embedding and replicated layers: the
  adapters are replicated (r x vocab is small), act after the base's collective, no new one.

So a forward issues exactly the collectives of the base model; backward adds one all-reduce of
r-wide activations per column-parallel adapter and one of ``lora_B``'s gradient per row-parallel
adapter. LoRA dropout draws the same mask on every TP rank where the input is replicated and a
per-rank mask where it is sharded.

``save_pretrained`` gathers only the adapter tensors (every rank takes part, rank 0 writes), so the
files are exactly what peft writes for the unsharded model; `from_pretrained` / `load_adapter` load
such files into a sharded model. ``merge_and_unload`` adds each rank's local delta to its shard of
the base weight (no communication). FSDP2 (dp x tp): adapters must exist before ``fully_shard``:
use `tensor_parallel` on the PEFT model, or `get_peft_model` on a tpkit model built with
``sharded=False`` (FSDP is then applied after the adapters).

Not supported (clear errors): LoRA variants (DoRA, ...), ``lora_bias`` on row-parallel bases,
row styles that split a replicated input (``rowwise_split_input``, ``packed_rowwise``), MoE expert
parameters, ``sequence_parallel`` and ``loss_parallel`` on adapted layers, and peft tuners other
than LoRA.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from tpkit.checkpoint import _barrier, _rank
from tpkit.fsdp import _strided_1d, apply_fsdp
from tpkit.parallelize import tensor_parallel as _core_tensor_parallel
from tpkit.styles import (
    ReplicateGradAllReduceStyle,
    ReplicateStyle,
    TPStyle,
    make_style,
)

__all__ = [
    "from_pretrained",
    "get_peft_model",
    "load_adapter",
    "patch_peft",
    "shard_adapters",
    "tensor_parallel",
    "unpatch_peft",
]

COLUMN = ("colwise", "packed_colwise", "packed_qkv_colwise")
REPLICATED = (
    "colwise_gather_output",
    "vocab_parallel",
    "replicate",
    "replicated_with_grad_allreduce",
)
ROW = ("rowwise",)


# ---- what the model is -------------------------------------------------------------------------
def _hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PeftModel (or the model itself)."""
    if hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def _state(model: nn.Module):
    return getattr(_hf_model(model), "_tpkit", None)


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _tuner_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]


def _check_peft_type(model: nn.Module) -> None:
    from peft import PeftType

    configs = getattr(model, "peft_config", {}) or {}
    bad = {
        n: str(c.peft_type) for n, c in configs.items() if str(c.peft_type) != str(PeftType.LORA)
    }
    dora = [n for n, c in configs.items() if getattr(c, "use_dora", False)]
    if dora:
        raise ValueError(
            f"tpkit.integrations.peft does not support DoRA (adapter {dora[0]!r} has "
            "use_dora=True): DoRA rescales by the norm of each whole weight row or column, "
            "which no rank holds. Use plain LoRA (use_dora=False) on a tensor-parallel model."
        )
    if not bad:
        bad_layers = [n for n, m in _tuner_layers(model) if not _is_lora_layer(m)]
        if not bad_layers:
            return
        bad = {"layers": ", ".join(bad_layers[:3])}
    raise ValueError(
        f"tpkit.integrations.peft supports LoRA adapters only; got {bad}. Other peft tuners would "
        "see sharded weights as if they were whole."
    )


def _is_lora_layer(m: nn.Module) -> bool:
    from peft.tuners.lora import layer as lora_layer

    return isinstance(m, (lora_layer.Linear, lora_layer.Embedding))


@contextlib.contextmanager
def global_features() -> Iterator[None]:
    """While active, peft sizes adapters of tpkit-sharded layers from their global shapes.

    peft reads ``weight.to_local().shape`` for an nn.Linear with a DTensor weight (transformers'
    own TP computes on full-width inputs of local size); tpkit keeps ``in_features`` and
    ``out_features`` global, and that is what the adapters must have.
    """
    from peft.tuners import tuners_utils
    from peft.tuners.lora import layer as lora_layer

    original = tuners_utils._get_in_out_features
    patched = _global_in_out(original)
    owners = [m for m in (tuners_utils, lora_layer) if m.__dict__.get("_get_in_out_features")]
    for m in owners:
        m._get_in_out_features = patched
    try:
        yield
    finally:
        for m in owners:
            m._get_in_out_features = original


def _global_in_out(original):
    if getattr(original, "_tpkit_patch", False):
        return original

    @functools.wraps(original)
    def patched(module: nn.Module):
        if isinstance(module, nn.Linear) and getattr(module, "_tpkit_style", None) is not None:
            return module.in_features, module.out_features
        return original(module)

    patched._tpkit_patch = True
    return patched


# ---- layouts -----------------------------------------------------------------------------------
class _RowShardLocal(TPStyle):
    """``lora_A`` of a row-parallel base: weight ``Shard(1)`` (input rows), local product, no
    collective (the partial sums join the base's before its all-reduce)."""

    name = "rowwise"

    def _apply(self, module, device_mesh):
        module = super()._apply(module, device_mesh)
        module._tpkit_style = "lora_row_local"
        return module


class _TPDropout(nn.Module):
    """LoRA dropout with its own generator: seeded alike on the TP group for a replicated input
    (every rank must drop the same features), per rank for a sharded one. The default and
    per-region streams of `tpkit.rng` are left untouched."""

    def __init__(self, p: float, seed: int):
        super().__init__()
        self.p, self.seed, self._gen = p, seed, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self._gen is None or self._gen.device != x.device:
            self._gen = torch.Generator(device=x.device).manual_seed(self.seed)
        keep = torch.empty_like(x).bernoulli_(1 - self.p, generator=self._gen)
        return x * keep / (1 - self.p)


def _sync_from_rank0(module: nn.Module) -> None:
    """Adapters are initialised randomly on each rank: make every rank hold rank 0's."""
    if not dist.is_initialized():
        return
    for p in module.parameters(recurse=True):
        if not isinstance(p, DTensor):
            dist.broadcast(p.data, src=0)


def _base_style(layer: nn.Module):
    return layer.get_base_layer().__dict__.get("_tpkit_style_obj")


def _shard_layer(name: str, layer: nn.Module, mesh, seeds: dict[str, int]) -> None:
    from peft.tuners.lora import layer as lora_layer

    style = _base_style(layer)
    if style is None:
        return
    kind = style.name
    if getattr(layer, "lora_variant", None):
        raise ValueError(
            f"{name}: LoRA variants (adapters {sorted(layer.lora_variant)}: DoRA and the like) are "
            "not supported on tensor-parallel bases; use plain LoRA."
        )
    if getattr(style, "sp", None) is not None:
        raise ValueError(f"{name}: LoRA with sequence_parallel=True is not supported yet.")
    if kind == "colwise_gather_output" and getattr(style, "loss_parallel", False):
        raise ValueError(
            f"{name}: LoRA on the output head with loss_parallel=True is not supported."
        )
    if kind not in COLUMN + ROW + REPLICATED:
        raise ValueError(
            f"{name}: LoRA on a '{kind}' tensor-parallel layer is not supported; supported base "
            f"styles: {', '.join(COLUMN + ROW + REPLICATED)}. Leave it out of target_modules."
        )
    tp_rank = mesh.get_local_rank()
    if isinstance(layer, lora_layer.Embedding):
        if kind not in ("vocab_parallel", "replicate"):
            raise ValueError(f"{name}: LoRA on a '{kind}' embedding is not supported.")
        for dict_name in ("lora_embedding_A", "lora_embedding_B"):
            pdict = getattr(layer, dict_name)
            if any(not isinstance(p, DTensor) for p in pdict.parameters()):
                _sync_from_rank0(pdict)
                ReplicateStyle()._apply(pdict, mesh)
        if kind == "vocab_parallel" and "_tpkit_pad" not in layer.__dict__:
            # the base's padding_idx is now this rank's local row (or None): peft's lookup of the
            # whole A table needs the global one back
            pad = layer.get_base_layer().padding_idx
            t = torch.tensor([pad + style.start if pad is not None else -1])
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=style.group)
            layer.__dict__["_tpkit_pad"] = None if t.item() < 0 else int(t.item())
            layer._embed = types.MethodType(_embed_global_pad, layer)
        if layer.__dict__.get("_tpkit_style_obj") is None:
            # peft's embedding reads the tables directly: swap in local tensors around its forward
            ReplicateStyle()._apply(layer, mesh)
            layer._tpkit_style = "parent_swap"
        layer.get_delta_weight = types.MethodType(_embedding_delta_weight, layer)
        return
    if not isinstance(layer, lora_layer.Linear):
        raise ValueError(f"{name}: {type(layer).__name__} adapters are not supported by tpkit.")
    for adapter in list(layer.lora_A):
        A, B = layer.lora_A[adapter], layer.lora_B[adapter]
        if isinstance(A.weight, DTensor):
            continue  # already laid out
        _sync_from_rank0(A)
        _sync_from_rank0(B)
        if kind in COLUMN:
            ReplicateStyle()._apply(A, mesh)
            make_style(kind)._apply(B, mesh)  # split like the base weight; f on its input
            replicated_input = True
        elif kind in ROW:
            if B.bias is not None:
                raise ValueError(
                    f"{name}: lora_bias=True on a row-parallel layer would add the bias on every "
                    "rank before the reduction; use lora_bias=False."
                )
            _RowShardLocal()._apply(A, mesh)
            ReplicateGradAllReduceStyle()._apply(B, mesh)  # acts on partial sums: grad summed
            replicated_input = False
        else:
            ReplicateStyle()._apply(A, mesh)
            ReplicateStyle()._apply(B, mesh)
            replicated_input = True
        drop = layer.lora_dropout[adapter]
        if isinstance(drop, nn.Dropout) and drop.p > 0:
            # the same on every rank of the group (torchrun ranks seed alike: tpkit's rule),
            # distinct per layer, and per rank where the input is sharded
            index = seeds.setdefault(name, len(seeds) + 1)
            rank_part = 0 if replicated_input else tp_rank + 1
            seed = (torch.initial_seed() + 7919 * index + 104729 * rank_part) % 2**62
            layer.lora_dropout[adapter] = _TPDropout(drop.p, seed)
    if kind in ROW and not layer.__dict__.get("_tpkit_row_hooks"):
        base = layer.get_base_layer()

        def defer(module, args, kwargs, style=style):
            style.defer_reduction = True

        def finish(module, args, kwargs, output, style=style, base=base):
            style.defer_reduction = False
            if output is None:  # the forward raised: drop what it left, keep its exception
                base.__dict__.pop("_tpkit_deferred_bias", None)
                return None
            return style.finish_deferred(base, output)

        layer.register_forward_pre_hook(defer, with_kwargs=True)
        layer.register_forward_hook(finish, with_kwargs=True, always_call=True)
        layer.__dict__["_tpkit_row_hooks"] = True
    layer.get_delta_weight = types.MethodType(_local_delta_weight, layer)


def _embed_global_pad(
    self, input: torch.Tensor, weight: torch.Tensor, input_fn=None, output_fn=None
):
    """peft's ``lora.Embedding._embed`` with the unsharded base's padding_idx."""
    base = self.get_base_layer()
    if input_fn is not None:
        input = input_fn((input,))
    out = nn.functional.embedding(
        input,
        weight,
        padding_idx=self.__dict__["_tpkit_pad"],
        max_norm=base.max_norm,
        norm_type=base.norm_type,
        scale_grad_by_freq=base.scale_grad_by_freq,
        sparse=base.sparse,
    )
    return output_fn(out) if output_fn is not None else out


def _local_delta_weight(self, adapter: str) -> torch.Tensor:
    """peft's ``B @ A * scaling`` as a DTensor laid out like the base weight, from this rank's
    shards alone: a column base's rows of B (strided parts included) times the whole A, or the
    whole B times a row base's columns of A, are exactly this rank's shard of the delta."""
    from peft.utils.other import transpose

    A, B = self.lora_A[adapter].weight, self.lora_B[adapter].weight
    local_a = A.to_local() if isinstance(A, DTensor) else A
    local_b = B.to_local() if isinstance(B, DTensor) else B
    delta = transpose(local_b @ local_a, self.fan_in_fan_out) * self.scaling[adapter]
    return _as_base_shard(self, delta, replicated=not _is_sharded(A) and not _is_sharded(B))


def _embedding_delta_weight(self, adapter: str) -> torch.Tensor:
    """peft's embedding delta ``(B @ A).T * scaling`` from the replicated tables, cut to the
    base's vocab shard."""
    A, B = self.lora_embedding_A[adapter], self.lora_embedding_B[adapter]
    local_a = A.to_local() if isinstance(A, DTensor) else A
    local_b = B.to_local() if isinstance(B, DTensor) else B
    delta = (local_b @ local_a).T * self.scaling[adapter]
    return _as_base_shard(self, delta, replicated=True)


def _is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and any(not p.is_replicate() for p in t.placements)


def _as_base_shard(layer: nn.Module, delta: torch.Tensor, replicated: bool) -> torch.Tensor:
    weight = layer.get_base_layer().weight
    if not isinstance(weight, DTensor):
        return delta
    if weight.device_mesh.ndim > 1:
        raise ValueError(
            "Merging LoRA into an FSDP2-sharded (dp x tp) model is not supported: save the "
            "adapter (model.save_pretrained) and merge it on a tp-only model."
        )
    if replicated:  # the whole delta on every rank: keep this rank's part of the base layout
        return distribute_tensor(
            delta.detach().to(weight.dtype),
            weight.device_mesh,
            weight.placements,
            src_data_rank=None,
        )
    return DTensor.from_local(
        delta.to(weight.dtype),
        weight.device_mesh,
        weight.placements,
        run_check=False,
        shape=weight.shape,
        stride=weight.stride(),
    )


def shard_adapters(model: nn.Module) -> nn.Module:
    """Lay out every LoRA adapter of a PEFT model on a tpkit base that is not laid out yet
    (after ``add_adapter`` / ``load_adapter``). Run on every rank; idempotent."""
    state = _state(model)
    if state is None or state.tp_size <= 1 and state.dp_size <= 1:
        return model
    _check_peft_type(model)
    seeds = model.__dict__.setdefault("_tpkit_lora_seeds", {})
    for name, layer in _tuner_layers(model):
        _shard_layer(name, layer, state.tp_mesh, seeds)
    # whatever adapter parameter is still a plain tensor (modules_to_save copies, ...) is replicated
    for module in model.modules():
        if any(
            isinstance(p, nn.Parameter) and not isinstance(p, DTensor)
            for p in module._parameters.values()
            if p is not None
        ):
            _sync_from_rank0(module)
            for pname, p in list(module._parameters.items()):
                if p is not None and not isinstance(p, DTensor):
                    dt = distribute_tensor(
                        p.detach(), state.tp_mesh, [Replicate()], src_data_rank=None
                    )
                    module.register_parameter(
                        pname, nn.Parameter(dt, requires_grad=p.requires_grad)
                    )
    _install_save(model)
    return model


# ---- entry points ------------------------------------------------------------------------------
def get_peft_model(model: nn.Module, peft_config, *args, fsdp: bool | None = None, **kwargs):
    """``peft.get_peft_model`` for a model tpkit has sharded (or not yet: then it is plain peft,
    and `tensor_parallel` shards the result). Adapters are sized from global shapes and laid out
    on the TP mesh. ``fsdp``: apply FSDP2 over dp after adding the adapters (default: when the
    model has dp > 1 and is not FSDP-sharded yet)."""
    import peft

    state = getattr(model, "_tpkit", None)
    if state is None:
        return peft.get_peft_model(model, peft_config, *args, **kwargs)
    _refuse_fsdp(model)
    with global_features():
        peft_model = peft.get_peft_model(model, peft_config, *args, **kwargs)
    shard_adapters(peft_model)
    _maybe_fsdp(peft_model, state, fsdp)
    return peft_model


def from_pretrained(model: nn.Module, adapter_dir, *args, fsdp: bool | None = None, **kwargs):
    """``peft.PeftModel.from_pretrained`` onto a tpkit model: the adapter is read whole on every
    rank, then each rank keeps its shards."""
    from peft import PeftModel

    state = getattr(model, "_tpkit", None)
    if state is not None:
        _refuse_fsdp(model)
    with global_features():
        peft_model = PeftModel.from_pretrained(model, adapter_dir, *args, **kwargs)
    if state is not None:
        shard_adapters(peft_model)
        _maybe_fsdp(peft_model, state, fsdp)
    return peft_model


def load_adapter(peft_model: nn.Module, adapter_dir, adapter_name: str, **kwargs):
    """``PeftModel.load_adapter`` on a sharded PEFT model (not FSDP-sharded)."""
    _refuse_fsdp(peft_model)
    with global_features():
        out = peft_model.load_adapter(adapter_dir, adapter_name, **kwargs)
    shard_adapters(peft_model)
    return out


def tensor_parallel(model: nn.Module, *args, **kwargs) -> nn.Module:
    """`tpkit.tensor_parallel` for a PEFT model: shard the base with the base model's plan, then
    lay out the adapters, then (dp > 1) FSDP2 over everything, adapters included. Same arguments;
    a model that is not a PEFT model goes straight to `tpkit.tensor_parallel`."""
    if not hasattr(model, "peft_config"):
        return _core_tensor_parallel(model, *args, **kwargs)
    _check_peft_type(model)
    hf = _hf_model(model)
    sharded = kwargs.pop("sharded", None)
    param_dtype = kwargs.pop("param_dtype", None)
    # the base model as tpkit's plan knows it: each peft wrapper swapped back for its base layer
    modules = dict(hf.named_modules())
    swaps = []
    for name, layer in _tuner_layers(hf):
        parent, _, attr = name.rpartition(".")
        swaps.append((modules[parent], attr, layer))
    for parent, attr, layer in swaps:
        parent._modules[attr] = layer.get_base_layer()
    try:
        _core_tensor_parallel(hf, *args, sharded=False, **kwargs)
    finally:
        for parent, attr, layer in swaps:
            parent._modules[attr] = layer
    state = getattr(hf, "_tpkit", None)
    if state is None:
        return model  # one process: nothing to do
    shard_adapters(model)
    if (state.dp_size > 1 if sharded is None else sharded) and state.dp_size > 1:
        _apply_fsdp(hf, state.mesh["dp"], param_dtype=param_dtype)
    elif param_dtype is not None:
        raise ValueError("param_dtype is FSDP2's mixed precision and needs dp_size > 1.")
    return model


def _refuse_fsdp(model: nn.Module) -> None:
    if _is_fsdp(model):
        raise ValueError(
            "This tpkit model is already FSDP2-sharded over dp: adapters cannot join FSDP's "
            "parameter groups afterwards. Add them before sharding: "
            "tpkit.integrations.peft.tensor_parallel(peft.get_peft_model(model, cfg), tp_size=.., "
            "dp_size=..), or build the tpkit model with sharded=False and pass it to "
            "tpkit.integrations.peft.get_peft_model (FSDP is applied after the adapters)."
        )


def _maybe_fsdp(peft_model: nn.Module, state, fsdp: bool | None) -> None:
    if state.dp_size > 1 and (fsdp is None or fsdp):
        _apply_fsdp(_hf_model(peft_model), state.mesh["dp"])


def _apply_fsdp(model: nn.Module, dp_mesh, param_dtype=None) -> None:
    """`tpkit.fsdp.apply_fsdp`, which registers a dp-averaging gradient hook on the packed 1-D
    biases it keeps out of FSDP; frozen ones (a LoRA base) cannot take a hook, so they are
    unfrozen for the call (the hook then never fires) and frozen again."""
    frozen = [p for p in model.parameters() if not p.requires_grad and _strided_1d(p)]
    for p in frozen:
        p.requires_grad_(True)
    try:
        apply_fsdp(model, dp_mesh, param_dtype=param_dtype)
    finally:
        for p in frozen:
            p.requires_grad_(False)


# ---- saving ------------------------------------------------------------------------------------
def _adapter_prefixes(model: nn.Module) -> list[str]:
    out = []
    for name, layer in _tuner_layers(model):
        for attr in tuple(layer.adapter_layer_names) + tuple(layer.other_param_names):
            if isinstance(getattr(layer, attr, None), nn.Module):
                out.append(f"{name}.{attr}.")
    return out


def _embedding_prefixes(model: nn.Module) -> list[str]:
    """The input / output embedding modules, which peft may save with the adapter."""
    if not hasattr(model, "get_input_embeddings"):
        return []
    wanted = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    return [f"{n}." for n, m in model.named_modules() if id(m) in wanted]


def _embedding_targeted(model: nn.Module) -> bool:
    """peft's ``save_embedding_layers="auto"``: save them when an adapter sits on one (its other
    trigger, a resized vocabulary, is not detected here: pass ``save_embedding_layers=True``)."""
    if not hasattr(model, "get_input_embeddings"):
        return False
    layers = {id(m) for _, m in _tuner_layers(model)}
    return bool(layers & {id(model.get_input_embeddings()), id(model.get_output_embeddings())})


def gathered_adapter_state_dict(
    model: nn.Module, embeddings: bool = False
) -> dict[str, torch.Tensor]:
    """Full (unsharded) adapter tensors under the model's state-dict keys, on rank 0; every rank
    must call it (each DTensor is gathered with a collective, in the same order everywhere).
    ``embeddings``: the input / output embedding layers too, for peft's
    ``save_embedding_layers`` to choose from."""
    prefixes = tuple(_adapter_prefixes(model) + (_embedding_prefixes(model) if embeddings else []))
    out = {}
    for key, value in model.state_dict().items():
        if not key.startswith(prefixes) and "modules_to_save" not in key:
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if _rank() == 0:
            out[key] = full.detach().cpu()
    return out


def _install_save(model: nn.Module) -> None:
    from peft import PeftModel

    if not isinstance(model, PeftModel) or "save_pretrained" in model.__dict__:
        return
    model.save_pretrained = functools.partial(
        _save_gathered,
        model,
        _originals.get((PeftModel, "save_pretrained"), PeftModel.save_pretrained),
    )


def _save_gathered(model, original, save_directory, *args: Any, **kwargs: Any) -> None:
    """Every rank: gather the adapter tensors; rank 0 writes normal, unsharded peft files.

    With a ``state_dict`` the caller has gathered already (Trainer's ``save_model`` through
    `tpkit.integrations.trainer`, on the main process only): a plain peft save, no collective."""
    bound = original.__get__(model)
    if kwargs.get("state_dict") is not None:
        return bound(save_directory, *args, **kwargs)
    kwargs.pop("is_main_process", None)
    flag = kwargs.get("save_embedding_layers", "auto")
    embeddings = flag is True or (flag == "auto" and _embedding_targeted(model))
    kwargs.pop("state_dict", None)
    state_dict = gathered_adapter_state_dict(model, embeddings)
    if _rank() == 0:
        bound(save_directory, *args, state_dict=state_dict, is_main_process=True, **kwargs)
    _barrier()


# ---- plain peft calls on tpkit models ----------------------------------------------------------
_originals: dict[tuple[Any, str], Any] = {}
_deferred = contextvars.ContextVar("tpkit_peft_deferred", default=False)


def _set(owner: Any, name: str, value: Any) -> None:
    _originals.setdefault((owner, name), owner.__dict__[name])
    setattr(owner, name, value)


def patch_peft() -> None:
    """Make plain peft calls right on tpkit models: ``peft.get_peft_model(tpkit_model, cfg)``,
    ``PeftModel.from_pretrained(tpkit_model, dir)``, ``load_adapter``, ``add_adapter`` and
    ``save_pretrained`` then size, lay out, load and save adapters as this module's functions do.
    Idempotent; models tpkit did not shard go to peft untouched; `unpatch_peft` undoes it.
    (`tensor_parallel` of a PEFT model still needs this module's `tensor_parallel`.)"""
    from peft import PeftModel
    from peft.tuners import tuners_utils
    from peft.tuners.lora import layer as lora_layer

    if _originals:
        return
    for owner in (tuners_utils, lora_layer):
        if "_get_in_out_features" in owner.__dict__:
            _set(owner, "_get_in_out_features", _global_in_out(owner._get_in_out_features))

    inject = tuners_utils.BaseTuner.inject_adapter

    @functools.wraps(inject)
    def inject_adapter(self, model, *args, **kwargs):
        tpkit_model = getattr(model, "_tpkit", None) is not None
        if tpkit_model:
            _refuse_fsdp(model)
        out = inject(self, model, *args, **kwargs)
        if tpkit_model and not _deferred.get():
            shard_adapters(model)
        return out

    _set(tuners_utils.BaseTuner, "inject_adapter", inject_adapter)

    load = PeftModel.load_adapter

    @functools.wraps(load)
    def load_adapter(self, *args, **kwargs):
        if _state(self) is None or _deferred.get():
            return load(self, *args, **kwargs)
        token = _deferred.set(True)  # lay out after the full tensors are loaded
        try:
            out = load(self, *args, **kwargs)
        finally:
            _deferred.reset(token)
        shard_adapters(self)
        return out

    _set(PeftModel, "load_adapter", load_adapter)

    from_pretrained_ = PeftModel.__dict__["from_pretrained"].__func__

    @functools.wraps(from_pretrained_)
    def from_pretrained(cls, model, *args, **kwargs):
        if getattr(model, "_tpkit", None) is None:
            return from_pretrained_(cls, model, *args, **kwargs)
        _refuse_fsdp(model)
        token = _deferred.set(True)
        try:
            out = from_pretrained_(cls, model, *args, **kwargs)
        finally:
            _deferred.reset(token)
        shard_adapters(out)
        return out

    _set(PeftModel, "from_pretrained", classmethod(from_pretrained))

    save = PeftModel.save_pretrained

    @functools.wraps(save)
    def save_pretrained(self, save_directory, *args, **kwargs):
        if _state(self) is None:
            return save(self, save_directory, *args, **kwargs)
        return _save_gathered(self, save, save_directory, *args, **kwargs)

    _set(PeftModel, "save_pretrained", save_pretrained)


def unpatch_peft() -> None:
    """Undo `patch_peft`."""
    for (owner, name), original in list(_originals.items()):
        setattr(owner, name, original)
        del _originals[(owner, name)]
