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
- output head (``colwise_gather_output``), vocab-parallel embedding and replicated layers: the
  adapters are replicated (r x vocab is small), act after the base's collective, no new one.
  So are they on a gathered pair (`tpkit.plan.gathered`): the column layer's adapter adds to
  its gathered output, and the ``rowwise_split_input`` layer's reads the same whole input its
  base slices, so its gradient is whole on every rank.

So a forward issues exactly the collectives of the base model; backward adds one all-reduce of
r-wide activations per column-parallel adapter and one of ``lora_B``'s gradient per row-parallel
adapter. LoRA dropout draws the same mask on every TP rank where the input is replicated and a
per-rank mask where it is sharded. ``merge_and_unload`` adds each rank's local delta to its
shard of the base weight (no communication). Adapters start as rank 0's (``distribute_tensor``
from rank 0).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from tpkit.fsdp import average_grads_over_dp, is_fsdp
from tpkit.mesh import rank
from tpkit.parallelize import tp_state
from tpkit.plan import style_spec
from tpkit.styles import (
    ParentSwap,
    ReplicateGradAllReduceStyle,
    ReplicateStyle,
    TPStyle,
    make_style,
    style_of,
)

__all__ = [
    "adapter_layout",
    "check_peft_type",
    "embedding_targeted",
    "global_in_out",
    "gathered_adapter_state_dict",
    "global_features",
    "hf_model",
    "lay_out_adapters",
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
    dora = [n for n, c in configs.items() if getattr(c, "use_dora", False)]
    if dora:
        raise ValueError(
            f"tpkit.integrations.peft does not support DoRA (adapter {dora[0]!r} has "
            "use_dora=True): DoRA rescales by the norm of each whole weight row or column, "
            "which no rank holds. Use plain LoRA (use_dora=False) on a tensor-parallel model."
        )
    if not bad:
        bad_layers = [n for n, m in tuner_layers(model) if not _is_lora_layer(m)]
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
    patched = global_in_out(original)
    owners = [m for m in (tuners_utils, lora_layer) if m.__dict__.get("_get_in_out_features")]
    for m in owners:
        m._get_in_out_features = patched
    try:
        yield
    finally:
        for m in owners:
            m._get_in_out_features = original


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


def _lay_out(module: nn.Module, style: TPStyle, mesh) -> None:
    """Apply ``style`` with rank 0's values (adapters are initialised randomly on each rank)."""
    style.src_data_rank = 0
    style._apply(module, mesh)


def _check_layer(name: str, layer: nn.Module, style: TPStyle) -> str:
    """The adapter layout for ``layer`` (see `adapter_layout`), or a ValueError saying why not."""
    if getattr(layer, "lora_variant", None):
        raise ValueError(
            f"{name}: LoRA variants (adapters {sorted(layer.lora_variant)}: DoRA and the like) are "
            "not supported on tensor-parallel bases; use plain LoRA."
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
    return layout


def _shard_layer(name: str, layer: nn.Module, mesh, seeds: dict[str, int]) -> None:
    from peft.tuners.lora import layer as lora_layer

    style = style_of(layer.get_base_layer())
    if style is None:
        return
    layout = _check_layer(name, layer, style)
    if isinstance(layer, lora_layer.Embedding):
        _shard_embedding_layer(name, layer, style, mesh)
    elif isinstance(layer, lora_layer.Linear):
        _shard_linear_layer(name, layer, style, layout, mesh, seeds)
    else:
        raise ValueError(f"{name}: {type(layer).__name__} adapters are not supported by tpkit.")


def _shard_embedding_layer(name: str, layer: nn.Module, style: TPStyle, mesh) -> None:
    if style.name not in ("vocab_parallel", "replicate"):
        raise ValueError(f"{name}: LoRA on a '{style.name}' embedding is not supported.")
    for dict_name in ("lora_embedding_A", "lora_embedding_B"):
        pdict = getattr(layer, dict_name)
        if any(not isinstance(p, DTensor) for p in pdict.parameters()):
            _lay_out(pdict, ReplicateStyle(), mesh)
    if style.name == "vocab_parallel":
        # the base's padding_idx is now this rank's local row (or None): peft's lookup of the
        # whole A table needs the global one
        layer._embed = types.MethodType(functools.partial(_embed_global_pad, style), layer)
    if style_of(layer) is None:
        # peft's embedding reads the tables directly: swap in local tensors around its forward
        ParentSwap()._apply(layer, mesh)
    layer.get_delta_weight = types.MethodType(_embedding_delta_weight, layer)


def _shard_linear_layer(name, layer, style: TPStyle, layout: str, mesh, seeds) -> None:
    for adapter in list(layer.lora_A):
        A, B = layer.lora_A[adapter], layer.lora_B[adapter]
        if isinstance(A.weight, DTensor):
            continue  # already laid out
        if layout == "column":
            _lay_out(A, ReplicateStyle(), mesh)
            _lay_out(B, make_style(style.name), mesh)  # split like the base weight; f on input
        elif layout == "row":
            if B.bias is not None:
                raise ValueError(
                    f"{name}: lora_bias=True on a row-parallel layer would add the bias on every "
                    "rank before the reduction; use lora_bias=False."
                )
            _lay_out(A, _RowShardLocal(), mesh)
            _lay_out(B, ReplicateGradAllReduceStyle(), mesh)  # acts on partial sums: grad summed
        else:
            _lay_out(A, ReplicateStyle(), mesh)
            _lay_out(B, ReplicateStyle(), mesh)
        drop = layer.lora_dropout[adapter]
        if isinstance(drop, nn.Dropout) and drop.p > 0:
            # the same on every rank of the group (torchrun ranks seed alike: tpkit's rule),
            # distinct per layer, and per rank where the input is sharded
            index = seeds.setdefault(name, len(seeds) + 1)
            rank_part = mesh.get_local_rank() + 1 if layout == "row" else 0
            seed = (torch.initial_seed() + 7919 * index + 104729 * rank_part) % 2**62
            layer.lora_dropout[adapter] = _TPDropout(drop.p, seed)
    if layout == "row" and "_tpkit_row" not in layer.__dict__:
        layer.register_forward_pre_hook(lambda *_: style.defer())
        layer.register_forward_hook(functools.partial(_finish_row, style), always_call=True)
        layer.__dict__["_tpkit_row"] = True
    layer.get_delta_weight = types.MethodType(_local_delta_weight, layer)


def _finish_row(style, module: nn.Module, args: tuple, output):
    """The peft wrapper's output: the base's partial sums plus the adapter's, reduced once."""
    if output is None:  # the forward raised: drop what it left, keep its exception
        style.drop_deferred()
        return None
    return style.finish_deferred(output)


def _embed_global_pad(
    style, self, input: torch.Tensor, weight: torch.Tensor, input_fn=None, output_fn=None
):
    """peft's ``lora.Embedding._embed`` with the unsharded base's padding_idx."""
    base = self.get_base_layer()
    if input_fn is not None:
        input = input_fn((input,))
    out = nn.functional.embedding(
        input,
        weight,
        padding_idx=style.global_padding_idx,
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


def lay_out_adapters(model: nn.Module) -> nn.Module:
    """Lay out every LoRA adapter of a PEFT model on a tpkit base that is not laid out yet
    (after ``add_adapter`` / ``load_adapter``). Run on every rank; idempotent."""
    state = tp_state(model)
    if state is None or state.tp_size <= 1 and state.dp_size <= 1:
        return model
    check_peft_type(model)
    seeds = model.__dict__.setdefault("_tpkit_lora_seeds", {})
    for name, layer in tuner_layers(model):
        _shard_layer(name, layer, state.tp_mesh, seeds)
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
        average_grads_over_dp(_tp_only_params(model, state.tp_mesh), state.mesh["dp"])
    return model


def _tp_only_params(model: nn.Module, tp_mesh) -> list[torch.Tensor]:
    """Trainable parameters on the TP mesh alone (FSDP2's live on the 2-D mesh)."""
    return [
        p
        for p in model.parameters()
        if p.requires_grad and isinstance(p, DTensor) and p.device_mesh == tp_mesh
    ]


# ---- saving ------------------------------------------------------------------------------------
def _adapter_prefixes(model: nn.Module) -> list[str]:
    out = []
    for name, layer in tuner_layers(model):
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


def embedding_targeted(model: nn.Module) -> bool:
    """peft's ``save_embedding_layers="auto"``: save them when an adapter sits on one (its other
    trigger, a resized vocabulary, is not detected here: pass ``save_embedding_layers=True``)."""
    if not hasattr(model, "get_input_embeddings"):
        return False
    layers = {id(m) for _, m in tuner_layers(model)}
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
        if rank() == 0:
            out[key] = full.detach().cpu()
    return out
