"""LoRA adapters laid out on tensor-parallel bases: which adapter tensor is split how.

A LoRA adapter on a base layer follows the base's style (the catalogue's role):

- column-parallel base (``colwise``, ``packed_colwise``, GPT-2's ``packed_qkv_colwise``):
  ``lora_A`` replicated, ``lora_B`` split like the base weight (the same strided split for packed
  q|k|v and gate|up), with Megatron's f on ``lora_B``'s input, so the r-wide activation's gradient
  is summed once per layer. The base layer keeps its own f.
- row-parallel base (``rowwise``): ``lora_A`` split by input rows, ``lora_B`` replicated (its
  gradient all-reduced), and the adapter output added to the base layer's *partial* sums before
  its single all-reduce (`tpkit.styles.RowwiseStyle.defer` holds the base's reduction back while
  the peft wrapper runs, and a hook on the wrapper finishes it).
- vocab-parallel embedding: peft's own layout (as on transformers' ``embedding_rowwise``):
  ``lora_embedding_A`` ([r, vocab]) split by vocabulary like the base's rows, each rank looking
  up its own tokens, the r-wide lookup all-reduced (one all-reduce of r values per token);
  ``lora_embedding_B`` replicated, acting on that whole lookup.
- output head (``colwise_gather_output``) and replicated layers: the adapters are replicated
  (r x vocab is small), act after the base's collective, no new one. So are they on a gathered
  pair (`tpkit.settle.gathered`): the column layer's adapter adds to
  its gathered output, and the ``rowwise_split_input`` layer's reads the same whole input its
  base slices, so its gradient is whole on every rank.

So a forward issues exactly the collectives of the base model (plus the r-wide one of a LoRA'd
vocab-parallel embedding); backward adds one all-reduce of
r-wide activations per column-parallel adapter and one of ``lora_B``'s gradient per row-parallel
adapter. A row base's ``lora_bias`` joins the partial sums on TP rank 0 only (added once).
LoRA dropout draws the unsharded model's mask (`_TPDropout`). ``merge_and_unload`` adds each
rank's local delta to its shard of the base weight (no communication). Adapters start as rank
0's (``distribute_tensor`` from rank 0).

DoRA (``use_dora``) scales each output feature by ``m / ||W + s B A||`` over its input
features: on a column base each rank holds whole rows, so the norm is local and the magnitude
``m`` is split like the outputs; on a row base each rank holds a slice of every row, so the
squared norms are summed with one all-reduce of an out-wide vector per forward (and merge), and
``m`` is replicated with its gradient summed. On gathered and vocab-parallel layers (whose
weight is split but whose adapters act on whole activations) and on embeddings it is refused.
Every option of a ``LoraConfig`` is either exact or refused up front (`check_lora_config`).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tpkit.io.shards import dtensor_like
from tpkit.parallel.comm import all_reduce_, copy_to_tp
from tpkit.parallel.fsdp import average_grads_over_dp, is_fsdp
from tpkit.parallel.mesh import get_mesh
from tpkit.plan import style_spec
from tpkit.state import tp_state
from tpkit.styles import (
    ParentSwap,
    ReplicateGradAllReduceStyle,
    ReplicateStyle,
    TPStyle,
    make_style,
    style_of,
)
from tpkit.training.rng import replicated_stream

__all__ = [
    "adapter_layout",
    "check_lora_config",
    "check_peft_type",
    "dora_whole_weight",
    "full_tensors",
    "global_features",
    "global_in_out",
    "hf_model",
    "lay_out_adapters",
    "saved_copies",
    "tuner_layers",
]


def hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PeftModel (or the model itself)."""
    if hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def adapter_layout(style: str) -> str | None:
    """How adapters on a base of ``style`` are laid out: "column", "row", "replicated", or None
    when tpkit does not support LoRA there (see the module docstring)."""
    s = style_spec(style)
    if s.role == "column" and s.shard == "out":
        return "column"
    if s.role == "row" and s.packed_parts == 1:
        return "row"
    if s.name in ("colwise_gather_output", "rowwise_split_input", "vocab_parallel") or (
        s.role == "replicate" and not s.own_entries and s.name != "tail_grad_allreduce"
    ):
        return "replicated"
    return None


def tuner_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]


def check_peft_type(model: nn.Module) -> None:
    from peft import PeftType

    configs = getattr(model, "peft_config", {}) or {}
    bad = {
        n: str(c.peft_type) for n, c in configs.items() if str(c.peft_type) != str(PeftType.LORA)
    }
    for n, c in configs.items():
        if n not in bad:
            check_lora_config(c, n)
    if not bad:
        bad_layers = [n for n, m in tuner_layers(model) if not _is_lora_layer(m)]
        if not bad_layers:
            return
        bad = {"layers": ", ".join(bad_layers[:3])}
    raise ValueError(
        f"tpkit.integrations.peft supports LoRA adapters only; got {bad}. Other peft tuners would "
        "see sharded weights as if they were whole."
    )


#: ``init_lora_weights`` values that read (and most of them rewrite) the whole base weight, or
#: derive the adapters from whole-layer activations: on a split base each rank would see its shard
_WHOLE_WEIGHT_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga", "eva")


def check_lora_config(config, adapter: str = "default", base_split: bool = False) -> None:
    """Refuse, before any collective and alike on every rank, a LoRA option tpkit cannot lay out
    exactly on tensor-parallel layers, naming the option, the adapter and what to do.

    Supported (parity with unsharded peft): plain LoRA, DoRA (``use_dora``), ``lora_bias``,
    ``use_rslora``, ``init_lora_weights`` True / False / "gaussian" / "orthogonal",
    ``rank_pattern`` / ``alpha_pattern``, ``layers_to_transform``, ``fan_in_fan_out``,
    ``modules_to_save``, dropout, ``use_qalora`` (peft applies it to GPTQ layers only, which tpkit
    does not split). Refused: the other LoRA variants (each changes the adapter's math in a way
    no rule here splits). ``base_split``: the
    adapters are about to be created on an already split base, where the initialisations that
    read the whole base weight (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA, EVA) would see one shard;
    on the unsharded model they are exact, so the fix is the other order."""
    import dataclasses

    where = f"tpkit.integrations.peft: adapter {adapter!r}"
    if base_split and getattr(config, "modules_to_save", None):
        raise ValueError(
            f"{where} sets modules_to_save={config.modules_to_save!r}: peft copies each of those "
            "modules, and a module already split across ranks cannot be copied. Add the adapter "
            "before splitting: tpkit.tensor_parallel(peft.get_peft_model(model, config)), which "
            "keeps each trainable copy whole on every rank."
        )
    for f in dataclasses.fields(config):
        value = getattr(config, f.name, None)
        if f.metadata.get("is_lora_variant") and f.name != "use_dora" and value:
            raise ValueError(
                f"{where} sets {f.name}={value!r}, a LoRA variant tpkit does not split across "
                "tensor-parallel ranks. Use plain LoRA or DoRA (use_dora=True), or apply the "
                "adapter to an unsharded model."
            )
        init = config.init_lora_weights
        if f.name == "init_lora_weights" and isinstance(init, str):
            if init.lower() in f.metadata.get("lora_variants", ()):
                raise ValueError(
                    f"{where} sets init_lora_weights={init!r}, a LoRA variant tpkit does not "
                    "split across tensor-parallel ranks. Use init_lora_weights=True, False, "
                    "'gaussian' or 'orthogonal'."
                )
            if base_split and init.lower().startswith(_WHOLE_WEIGHT_INITS):
                raise ValueError(
                    f"{where} sets init_lora_weights={init!r}, which reads the whole base weight "
                    "(and rewrites it), but the base is already split across ranks. Add the "
                    "adapter before splitting: tpkit.tensor_parallel(peft.get_peft_model(model, "
                    "config)). To load a saved adapter, set init_lora_weights=True in its "
                    "adapter_config.json (the saved tensors replace the initial ones)."
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
    from peft.tuners.lora import dora
    from peft.tuners.lora import layer as lora_layer

    original = tuners_utils._get_in_out_features
    patched = global_in_out(original)
    owners = [m for m in (tuners_utils, lora_layer) if m.__dict__.get("_get_in_out_features")]
    for m in owners:
        m._get_in_out_features = patched
    dora_init = dora.DoraLinearLayer.__dict__["update_layer"]
    dora.DoraLinearLayer.update_layer = dora_whole_weight(dora_init)
    try:
        yield
    finally:
        for m in owners:
            m._get_in_out_features = original
        dora.DoraLinearLayer.update_layer = dora_init


def dora_whole_weight(original):
    """peft's ``DoraLinearLayer.update_layer`` (DoRA's initial magnitude, the norm of each row of
    the whole weight) given the whole weight of a split base: gathered for the call (every
    rank, in the same module order), then dropped. The magnitude is laid out afterwards."""
    if getattr(original, "_tpkit_patch", False):
        return original

    @functools.wraps(original)
    def update_layer(self, *, base_layer: nn.Module, **kwargs):
        weight = base_layer._parameters.get("weight")
        if not isinstance(weight, DTensor):
            return original(self, base_layer=base_layer, **kwargs)
        base_layer._parameters["weight"] = weight.full_tensor().detach()
        try:
            return original(self, base_layer=base_layer, **kwargs)
        finally:
            base_layer._parameters["weight"] = weight

    update_layer._tpkit_patch = True
    return update_layer


def global_in_out(original):
    if getattr(original, "_tpkit_patch", False):
        return original

    @functools.wraps(original)
    def patched(module: nn.Module):
        if isinstance(module, nn.Linear) and style_of(module) is not None:
            return module.in_features, module.out_features
        return original(module)

    patched._tpkit_patch = True
    return patched


# ---- layouts -----------------------------------------------------------------------------------
class _RowShardLocal(TPStyle):
    """``lora_A`` of a row-parallel base: weight ``Shard(1)`` (input rows), local product, no
    collective (the partial sums join the base's before its all-reduce)."""

    name = "lora_row_local"

    @property
    def layout_style(self) -> str:
        return "rowwise"


class _RowLoraB(ReplicateGradAllReduceStyle):
    """``lora_B`` of a row-parallel base: replicated, acting on the partial sums of the rank's
    input features (its gradient all-reduced). Its bias (``lora_bias=True``) joins the sum on TP
    rank 0 only, so the reduction adds it once; elsewhere it is multiplied by zero, so its
    gradient (zero there) still takes part in the all-reduce."""

    def _swap_in(self, module: nn.Module) -> None:
        super()._swap_in(module)
        bias = module._parameters.get("bias")
        if bias is not None and self.rank != 0:
            module._parameters["bias"] = bias * 0


class _TPDropout(nn.Module):
    """LoRA dropout that draws exactly the unsharded model's mask: from the default stream, which
    tpkit keeps identical across the TP group (`tpkit.training.rng.replicated_stream`, also inside a
    tensor-parallel region, whose own per-rank stream is left alone), in the same order as the
    unsharded model draws it. On a sharded input (a row-parallel base: this rank's slice of the
    input features) the whole mask is drawn and this rank's slice kept, so every rank advances
    the stream alike and the mask is the unsharded one. Drawn as ``nn.functional.dropout`` does
    (``bernoulli_(1 - p)`` on a tensor of the input's shape, divided by ``1 - p``)."""

    def __init__(self, p: float, in_features: int = 0, start: int = 0):
        super().__init__()
        self.p, self.in_features, self.start = p, in_features, start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        whole = self.in_features or x.shape[-1]
        with replicated_stream():
            if self.p == 1:
                return x * 0
            noise = torch.empty((*x.shape[:-1], whole), dtype=x.dtype, device=x.device)
            noise.bernoulli_(1 - self.p).div_(1 - self.p)
        if whole != x.shape[-1]:
            noise = noise.narrow(-1, self.start, x.shape[-1])
        return x * noise


def _lay_out(module: nn.Module, style: TPStyle, mesh) -> None:
    """Apply ``style`` with rank 0's values (adapters are initialised randomly on each rank)."""
    style.src_data_rank = 0
    style._apply(module, mesh)


def _check_layer(name: str, layer: nn.Module, style: TPStyle) -> str:
    """The adapter layout for ``layer`` (see `adapter_layout`), or a ValueError saying why not."""
    from peft.tuners.lora.variants import DoraLinearVariant

    for adapter, variant in getattr(layer, "lora_variant", {}).items():
        if not isinstance(variant, DoraLinearVariant):
            raise ValueError(
                f"{name}: adapter {adapter!r} is a {type(variant).__name__} LoRA variant, which "
                "tpkit does not split across tensor-parallel ranks; use plain LoRA or DoRA."
            )
    if style.sp is not None:
        raise ValueError(f"{name}: LoRA with sequence_parallel=True is not supported yet.")
    if getattr(style, "loss_parallel", False):
        raise ValueError(
            f"{name}: LoRA on the output head with loss_parallel=True is not supported."
        )
    layout = adapter_layout(style.layout_style)
    if layout is None:
        raise ValueError(
            f"{name}: LoRA on a '{style.name}' tensor-parallel layer is not supported (column, "
            "row, vocabulary and replicated layers are). Leave it out of target_modules."
        )
    if getattr(layer, "lora_variant", None) and (
        layout == "replicated" and _is_sharded(layer.get_base_layer().weight)
    ):
        raise ValueError(
            f"{name}: DoRA (use_dora=True) on a '{style.name}' tensor-parallel layer is not "
            "supported (column, row and replicated layers are): its weight norm would need the "
            "whole weight. Leave this module out of target_modules, or use plain LoRA."
        )
    return layout


def _shard_layer(name: str, layer: nn.Module, mesh) -> None:
    from peft.tuners.lora import layer as lora_layer

    style = style_of(layer.get_base_layer())
    if style is None:
        return
    layout = _check_layer(name, layer, style)
    if isinstance(layer, lora_layer.Embedding):
        _shard_embedding_layer(name, layer, style, mesh)
    elif isinstance(layer, lora_layer.Linear):
        _shard_linear_layer(name, layer, style, layout, mesh)
    else:
        raise ValueError(f"{name}: {type(layer).__name__} adapters are not supported by tpkit.")


def _shard_embedding_layer(name: str, layer: nn.Module, style: TPStyle, mesh) -> None:
    """peft's layout for LoRA on an embedding. On a vocab-parallel base ``lora_embedding_A``
    ([r, vocab]) is split by vocabulary like the base's rows (``Shard(1)``), so each rank looks
    up its own tokens' columns and the r-wide lookup is all-reduced (`_embed_vocab_parallel`,
    exact: every token is found on exactly one rank); ``lora_embedding_B`` ([h, r]) acts on that
    whole lookup, so it is replicated with a whole gradient. This is what peft itself does on
    transformers' ``embedding_rowwise`` (its checkpoint loading compares the tables to the base's
    vocabulary), at one all-reduce of r values per token. On a replicated base both are whole."""
    if style.name not in ("vocab_parallel", "replicate"):
        raise ValueError(f"{name}: LoRA on a '{style.name}' embedding is not supported.")
    split = style.name == "vocab_parallel"
    if split:
        rows = style.end - style.start
        for adapter, a in list(layer.lora_embedding_A.items()):
            if isinstance(a, DTensor):
                continue  # already laid out
            dt = distribute_tensor(a.detach(), mesh, [Shard(1)], src_data_rank=0)
            if dt.to_local().shape[1] != rows:  # the same chunks as the base; a guard
                raise ValueError(
                    f"{name}: lora_embedding_A[{adapter!r}] would hold "
                    f"{dt.to_local().shape[1]} of {a.shape[1]} vocabulary columns on this rank, "
                    f"its base {rows} rows: the split is not the base's."
                )
            layer.lora_embedding_A[adapter] = nn.Parameter(dt, requires_grad=a.requires_grad)
    for dict_name in ("lora_embedding_A", "lora_embedding_B"):
        pdict = getattr(layer, dict_name)  # its record lets ParentSwap hand peft local tables
        if style_of(pdict) is None or any(not isinstance(p, DTensor) for p in pdict.parameters()):
            _lay_out(pdict, ReplicateStyle(), mesh)
    if split:
        layer._embed = types.MethodType(functools.partial(_embed_vocab_parallel, style), layer)
    if style_of(layer) is None:
        # peft's embedding reads the tables directly: swap in local tensors around its forward
        ParentSwap()._apply(layer, mesh)
    layer.get_delta_weight = types.MethodType(_embedding_delta_weight, layer)


def _shard_linear_layer(name, layer, style: TPStyle, layout: str, mesh) -> None:
    for adapter in list(layer.lora_A):
        A, B = layer.lora_A[adapter], layer.lora_B[adapter]
        if isinstance(A.weight, DTensor):
            continue  # already laid out
        if layout == "column":
            _lay_out(A, ReplicateStyle(), mesh)
            _lay_out(B, make_style(style.name), mesh)  # split like the base weight; f on input
        elif layout == "row":
            _lay_out(A, _RowShardLocal(), mesh)
            _lay_out(B, _RowLoraB(), mesh)  # acts on partial sums: grad summed, bias added once
        else:
            _lay_out(A, ReplicateStyle(), mesh)
            _lay_out(B, ReplicateStyle(), mesh)
        if adapter in getattr(layer, "lora_magnitude_vector", {}):
            _lay_out_dora(layer.lora_magnitude_vector[adapter], B, layout, mesh)
            layer.lora_variant[adapter] = _dora_variant(layout, mesh.get_group())
        drop = layer.lora_dropout[adapter]
        if isinstance(drop, nn.Dropout) and drop.p > 0:
            if layout == "row":  # this rank's input features: the columns of its lora_A shard
                start = -(-A.weight.shape[1] // mesh.size()) * mesh.get_local_rank()
                layer.lora_dropout[adapter] = _TPDropout(drop.p, A.weight.shape[1], start)
            else:
                layer.lora_dropout[adapter] = _TPDropout(drop.p)
    if layout == "row" and "_tpkit_row" not in layer.__dict__:
        layer.register_forward_pre_hook(lambda *_: style.defer())
        layer.register_forward_hook(functools.partial(_finish_row, style), always_call=True)
        layer.__dict__["_tpkit_row"] = True
    layer.get_delta_weight = types.MethodType(_local_delta_weight, layer)


def _lay_out_dora(dora: nn.Module, lora_b: nn.Module, layout: str, mesh) -> None:
    """DoRA's magnitude (one entry per output feature) laid out like the outputs: split like
    ``lora_B``'s rows on a column base, whole on a row or replicated one; its forward replaced
    by `_dora_forward`, which works on this rank's shards."""
    m = dora.weight
    if not isinstance(m, DTensor):
        placements = lora_b.weight.placements if layout == "column" else [Replicate()]
        dt = distribute_tensor(m.detach(), mesh, placements, src_data_rank=0)
        dora.register_parameter("weight", nn.Parameter(dt, requires_grad=m.requires_grad))
    group = mesh.get_group() if layout in ("column", "row") else None
    dora.forward = types.MethodType(functools.partial(_dora_forward, layout, group), dora)


def _dora_variant(layout: str, group):
    """peft's DoRA variant with merge and unmerge on this rank's shards: the merged weight is
    ``m / ||W + dW|| * (W + dW)`` per output feature, the norm local on a column base and summed
    over the ranks (one all-reduce of squared norms) on a row one."""
    from peft.tuners.lora.variants import DoraLinearVariant
    from peft.utils.other import transpose

    def factor(module, adapter: str, weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        fan_in_fan_out = module.fan_in_fan_out
        combined = transpose(weight + delta, fan_in_fan_out)
        if layout == "row":
            squares = combined.pow(2).sum(dim=1).contiguous()
            norm = all_reduce_(squares, group).sqrt()
        else:
            norm = torch.linalg.norm(combined, dim=1)
        module._cache_store(f"{adapter}-weight_norm", norm)
        magnitude = _local(module.lora_magnitude_vector[adapter].weight).detach()
        return transpose((magnitude / norm).view(-1, 1), fan_in_fan_out)

    def merged(module, adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        weight = _local(orig_weight).detach()
        delta = _local(module.get_delta_weight(adapter)).detach().to(weight.dtype)
        return (factor(module, adapter, weight, delta) * (weight + delta)).to(weight.dtype)

    class TPDora(DoraLinearVariant):
        @staticmethod
        def merge_safe(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
            return dtensor_like(orig_weight, merged(module, active_adapter, orig_weight))

        @staticmethod
        def merge_unsafe(module, active_adapter: str, orig_weight: torch.Tensor) -> None:
            new = merged(module, active_adapter, orig_weight)
            with torch.no_grad():
                _local(orig_weight).copy_(new)

        @staticmethod
        def unmerge(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
            weight = _local(orig_weight).detach()
            delta = _local(module.get_delta_weight(active_adapter)).detach().to(weight.dtype)
            norm = module._cache_pop(f"{active_adapter}-weight_norm")
            magnitude = _local(module.lora_magnitude_vector[active_adapter].weight).detach()
            scale = transpose((magnitude / norm).view(-1, 1), module.fan_in_fan_out)
            return dtensor_like(orig_weight, (weight / scale - delta).to(weight.dtype))

    return TPDora()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _dora_forward(
    layout: str,
    group,
    self: nn.Module,
    x: torch.Tensor,
    *,
    lora_A: nn.Module,
    lora_B: nn.Module,
    scaling: float,
    base_layer: nn.Module,
    base_result: torch.Tensor | None = None,
    adapter_name: str = "default",
) -> torch.Tensor:
    """peft's ``DoraLinearLayer.forward`` on this rank's shards, exactly.

    DoRA scales output feature o by ``m[o] / ||W[o, :] + s (B A)[o, :]||`` (the norm detached).
    On a column base this rank holds whole rows of W and of B A: its norms are local. On a row
    base it holds a slice of every row: the squared norms of the slices are summed with one
    all-reduce of an out-wide vector. The scaled outputs are this rank's output features
    (column) or partial sums that the base's single all-reduce then adds (row: scaling each
    output feature commutes with that sum), so no other collective is needed."""
    from peft.utils.other import transpose

    a, b = _local(lora_A.weight).detach(), _local(lora_B.weight).detach()
    lora_weight = b @ a
    if lora_B.bias is not None:  # peft forms B A as lora_B(lora_A(eye)).T: the bias in each column
        lora_weight = lora_weight + _local(lora_B.bias).detach()[:, None]
    weight = transpose(_local(base_layer.weight).detach().to(x.dtype), self.fan_in_fan_out)
    combined = weight + scaling * lora_weight.to(x.dtype)
    if layout == "row":
        squares = combined.pow(2).sum(dim=1).contiguous()
        weight_norm = all_reduce_(squares, group).sqrt()
    else:
        weight_norm = torch.linalg.norm(combined, dim=1)
    magnitude = _local(self.weight)
    if layout == "row":  # acts on partial sums: its gradient is summed over the ranks
        magnitude = copy_to_tp(magnitude, group)
    mag_norm_scale = (magnitude / weight_norm.to(weight.dtype).detach()).view(1, -1)
    lora_result = lora_B(lora_A(x))
    if base_result is not None:
        bias = base_layer.bias
        if bias is not None and layout != "row":  # a row base's partial sums have no bias yet
            base_result = base_result - _local(bias)
    else:  # dropout: the base output on the dropped input
        if layout == "column":  # whole input, this rank's outputs: its gradient is summed
            x = copy_to_tp(x, group)
        base_result = nn.functional.linear(x, weight)
    return (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling


def _finish_row(style, module: nn.Module, args: tuple, output):
    """The peft wrapper's output: the base's partial sums plus the adapter's, reduced once."""
    if output is None:  # the forward raised: drop what it left, keep its exception
        style.drop_deferred()
        return None
    return style.finish_deferred(output)


def _embed_vocab_parallel(
    style, self, input: torch.Tensor, weight: torch.Tensor, input_fn=None, output_fn=None
):
    """peft's ``lora.Embedding._embed`` of this rank's columns of ``lora_embedding_A`` (as
    ``weight``, [vocab shard, r]) for the global ids: the base style's vocab-parallel lookup
    (ids outside the shard masked, the base's local padding row, one all-reduce of the r-wide
    rows), so every rank gets the whole ``after_A`` of the unsharded model."""
    base = self.get_base_layer()
    if input_fn is not None:
        input = input_fn((input,))
    out = style.lookup(
        input, weight, base.max_norm, base.norm_type, base.scale_grad_by_freq, base.sparse
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
    """peft's embedding delta ``(B @ A).T * scaling``: with A split by vocabulary, this rank's
    columns of A give exactly its rows of the delta (the base's shard); with whole tables, the
    whole delta cut to the base's layout."""
    A, B = self.lora_embedding_A[adapter], self.lora_embedding_B[adapter]
    local_a = A.to_local() if isinstance(A, DTensor) else A
    local_b = B.to_local() if isinstance(B, DTensor) else B
    delta = (local_b @ local_a).T * self.scaling[adapter]
    return _as_base_shard(self, delta, replicated=not _is_sharded(A))


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


def saved_copies(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """peft's ``modules_to_save`` wrappers (the original module and its trainable copies)."""
    from peft.utils.other import ModulesToSaveWrapper

    return [(n, m) for n, m in model.named_modules() if isinstance(m, ModulesToSaveWrapper)]


def _check_saved_copy(name: str, wrapper: nn.Module) -> None:
    """A ``modules_to_save`` copy is kept whole on every rank, which is exact where the original
    maps a whole input to a whole output (replicated, gathered, vocab-parallel layers)."""
    style = style_of(wrapper.original_module)
    if style is None or adapter_layout(style.layout_style) != "replicated":
        what = f"a '{style.name}' tensor-parallel layer" if style else "a module holding split ones"
        raise ValueError(
            f"{name}: modules_to_save on {what} is not supported (its trainable copy is kept "
            "whole, and this module sees or makes one rank's shard). List only whole-output "
            "modules (norms, the output head, embeddings, classifier heads) in modules_to_save."
        )


def lay_out_adapters(model: nn.Module) -> nn.Module:
    """Lay out every LoRA adapter of a PEFT model on a tpkit base that is not laid out yet
    (after ``add_adapter`` / ``load_adapter``). Run on every rank; idempotent."""
    state = tp_state(model)
    if state is None or state.tp_size <= 1 and state.dp_size <= 1:
        return model
    check_peft_type(model)
    layers = tuner_layers(model)
    for name, layer in layers:  # every refusal before the first collective, alike on every rank
        style = style_of(layer.get_base_layer())
        if style is not None:
            _check_layer(name, layer, style)
    copies = saved_copies(model)
    for name, wrapper in copies:
        _check_saved_copy(name, wrapper)
    for name, layer in layers:
        _shard_layer(name, layer, state.tp_mesh)
    for _, wrapper in copies:
        for copy in wrapper.modules_to_save.values():
            for m in copy.modules():
                if style_of(m) is None and any(
                    p is not None and not isinstance(p, DTensor) for p in m._parameters.values()
                ):
                    _lay_out(m, ReplicateStyle(), state.tp_mesh)
    # whatever adapter parameter is still a plain tensor (modules_to_save copies, ...) is replicated
    for module in model.modules():
        if any(
            isinstance(p, nn.Parameter) and not isinstance(p, DTensor)
            for p in module._parameters.values()
            if p is not None
        ):
            for pname, p in list(module._parameters.items()):
                if p is not None and not isinstance(p, DTensor):  # rank 0's values, replicated
                    dt = distribute_tensor(
                        p.detach(), state.tp_mesh, [Replicate()], src_data_rank=0
                    )
                    module.register_parameter(
                        pname, nn.Parameter(dt, requires_grad=p.requires_grad)
                    )
    if state.dp_size > 1 and is_fsdp(hf_model(model)):
        # adapters added after FSDP2 stay replicated over dp, their gradients averaged over it
        average_grads_over_dp(_tp_only_params(model, state.tp_mesh), get_mesh(state.mesh, "dp"))
    return model


def _tp_only_params(model: nn.Module, tp_mesh) -> list[torch.Tensor]:
    """Trainable parameters on the TP mesh alone (FSDP2's live on the 2-D mesh)."""
    return [
        p
        for p in model.parameters()
        if p.requires_grad and isinstance(p, DTensor) and p.device_mesh == tp_mesh
    ]


# ---- state dicts ------------------------------------------------------------------------------
def full_tensors(state_dict: dict[str, Any], keep: bool = True) -> dict[str, Any]:
    """The DTensor values of ``state_dict`` as whole plain tensors (on their device, as the
    unsharded model's own state dict has them); other values as they are. Every rank must call
    it with the same keys in the same order: each DTensor is gathered with a collective.
    ``keep=False``: take part in the gathers but keep nothing (a meta tensor of the whole shape
    in its place), for ranks that will not write the file."""
    out = {}
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            whole = value.full_tensor().detach()
            value = whole if keep else torch.empty_like(whole, device="meta")
        out[key] = value
    return out
