"""PEFT (LoRA) adapters on tensor-parallel tpkit models: train, save, load, merge.

Usage (``torchrun --nproc-per-node 2 train.py``): plain peft calls, in either order::

    import peft, tpkit

    cfg = peft.LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                "gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(tpkit.tensor_parallel(model), cfg)      # adapters on a tpkit model
    model = tpkit.tensor_parallel(peft.get_peft_model(model, cfg), tp_size=2, dp_size=2)  # or
    model = peft.PeftModel.from_pretrained(tpkit.from_pretrained(path), adapter_dir)    # or

    model.save_pretrained("out")           # every rank; rank 0 writes a normal, unsharded adapter
    merged = model.merge_and_unload()      # the merged, still sharded, base model

``import tpkit`` makes these work (`tpkit.integrations.autopatch`): the first ``tensor_parallel``
applies `patch_peft` (now, or the moment peft is imported), and ``tpkit.tensor_parallel`` of a
PeftModel goes to `split_peft_model`. The functions here (`get_peft_model`, `from_pretrained`,
`tensor_parallel`, ...) are the same operations called explicitly; models tpkit did not shard go
through every patched call untouched.

Why peft needs this at all: *unpatched* ``peft.get_peft_model`` on a tpkit model sizes nn.Linear
adapters from the *local* shard (peft reads ``weight.to_local().shape`` for a DTensor weight on a
mesh not named "fsdp"), each rank with its own random adapter; and the base plan does not see
peft's wrapped names. These functions size adapters from the global shapes and then lay them out
as the base layer's style says (`tpkit.integrations.lora`): a forward issues exactly the base
model's collectives.

``peft.get_peft_model_state_dict(model)`` returns what it returns for the unsharded model (same
keys, whole plain tensors) on every rank, which must all call it: only the tensors it selects are
gathered (`patch_peft`). ``save_pretrained`` is peft's own on every rank through that same gather
(rank 0 writes), so the files are exactly what peft writes for the unsharded model;
``set_peft_model_state_dict`` with whole tensors (peft reshards them to each DTensor's layout) and
`from_pretrained` / `load_adapter` load them into a sharded model. FSDP2 (dp x tp): adapters added before FSDP2 (`tensor_parallel`
on the PEFT model, or a tpkit model built with ``sharded=False``) are FSDP-sharded with the base;
adapters added to a model FSDP2 already shards stay replicated over dp, their gradients averaged.

Exact (parity with unsharded peft): plain LoRA, DoRA, ``lora_bias``, ``use_rslora``,
``rank_pattern`` / ``alpha_pattern``, ``layers_to_transform``, dropout (the unsharded masks),
``init_lora_weights`` True / False / "gaussian" / "orthogonal" in either order; when the adapter
is added before the split, also the initialisations that read the whole base weight (PiSSA,
OLoRA, CorDA, LoftQ, LoRA-GA, EVA: they run on the unsharded model; tested for PiSSA and OLoRA)
and ``modules_to_save`` of whole-output modules (norms, heads, embeddings: the trainable copy is
kept whole on every rank).

Not supported (one clear error on every rank, naming the option): the other LoRA variants
(MiCA, aLoRA, Arrow, BD-LoRA, VeLoRA, MonteCLoRA, KaSA), whole-weight initialisations and
``modules_to_save`` on an already split base, ``modules_to_save`` of a module that sees or makes
one rank's shard, DoRA on gathered / vocab-parallel layers and embeddings, packed row styles
(``packed_rowwise``), MoE expert parameters, ``sequence_parallel`` and ``loss_parallel`` on
adapted layers, and peft tuners other than LoRA.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any

from torch import nn

from tpkit.integrations.lora import (
    check_lora_config,
    check_peft_type,
    dora_whole_weight,
    full_tensors,
    global_features,
    global_in_out,
    hf_model,
    lay_out_adapters,
    saved_copies,
    tuner_layers,
)
from tpkit.integrations.patching import original as unpatched
from tpkit.integrations.patching import unpatch_all, wrap
from tpkit.parallel.fsdp import apply_fsdp, is_fsdp, strided_1d
from tpkit.parallel.mesh import barrier, get_mesh, rank
from tpkit.parallelize import apply_pending_fsdp, split
from tpkit.state import TPOptions, tp_state

__all__ = [
    "from_pretrained",
    "get_peft_model",
    "load_adapter",
    "patch_peft",
    "shard_adapters",
    "split_peft_model",
    "tensor_parallel",
    "unpatch_peft",
]


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
    check_lora_config(peft_config, kwargs.get("adapter_name", "default"), base_split=True)
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
    with global_features():
        peft_model = PeftModel.from_pretrained(model, adapter_dir, *args, **kwargs)
    if state is not None:
        shard_adapters(peft_model)
        _maybe_fsdp(peft_model, state, fsdp)
    return peft_model


def load_adapter(peft_model: nn.Module, adapter_dir, adapter_name: str, **kwargs):
    """``PeftModel.load_adapter`` on a sharded PEFT model."""
    with global_features():
        out = peft_model.load_adapter(adapter_dir, adapter_name, **kwargs)
    shard_adapters(peft_model)
    return out


def tensor_parallel(model: nn.Module, *args, **kwargs) -> nn.Module:
    """`tpkit.tensor_parallel` for a PEFT model (which `tpkit.tensor_parallel` itself now does
    too, through `split_peft_model`); same arguments."""
    device_ids = args[0] if args else kwargs.pop("device_ids", None)
    options = TPOptions.of(kwargs)
    if not hasattr(model, "peft_config"):
        return apply_pending_fsdp(split(model, device_ids, options))
    return split_peft_model(model, device_ids, options)


def split_peft_model(model: nn.Module, device_ids, options: TPOptions) -> nn.Module:
    """Shard a PEFT model's base with the base model's plan, then lay out the adapters, then
    (dp > 1) FSDP2 over everything, adapters included."""
    check_peft_type(model)
    hf = hf_model(model)
    # the base model as tpkit's plan knows it: each peft wrapper swapped back for its base layer
    modules = dict(hf.named_modules())
    swaps = []
    for name, layer in tuner_layers(hf) + saved_copies(hf):
        parent, _, attr = name.rpartition(".")
        swaps.append((modules[parent], attr, layer))
    for parent, attr, layer in swaps:  # a modules_to_save wrapper: its original, for the plan
        saved = hasattr(layer, "modules_to_save")
        parent._modules[attr] = layer.original_module if saved else layer.get_base_layer()
    try:
        split(hf, device_ids, options)  # FSDP2, when asked, waits for the adapters
    finally:
        for parent, attr, layer in swaps:
            parent._modules[attr] = layer
    if tp_state(hf) is None:
        return model  # one process: nothing to do
    shard_adapters(model)
    _with_frozen_strided(hf, apply_pending_fsdp)
    return model


def _maybe_fsdp(peft_model: nn.Module, state, fsdp: bool | None) -> None:
    """FSDP2 over dp after the adapters, unless the base was sharded already (then the adapters
    stay replicated over dp with their gradients averaged: `tpkit.integrations.lora`)."""
    if state.dp_size > 1 and (fsdp is None or fsdp) and not is_fsdp(hf_model(peft_model)):
        hf = hf_model(peft_model)
        _with_frozen_strided(
            hf, lambda m: apply_fsdp(m, get_mesh(state.mesh, "dp_replicate", "dp_shard"))
        )


def _with_frozen_strided(model: nn.Module, fn) -> None:
    """``fn(model)`` (FSDP2), with the frozen packed 1-D biases FSDP keeps out briefly
    unfrozen: `tpkit.parallel.fsdp.apply_fsdp` registers a dp-averaging gradient hook on them, which a
    frozen tensor cannot take (the hook then never fires)."""
    frozen = [p for p in model.parameters() if not p.requires_grad and strided_1d(p)]
    for p in frozen:
        p.requires_grad_(True)
    try:
        fn(model)
    finally:
        for p in frozen:
            p.requires_grad_(False)


def shard_adapters(model: nn.Module) -> nn.Module:
    """Lay out every LoRA adapter of a PEFT model on a tpkit base that is not laid out yet
    (after ``add_adapter`` / ``load_adapter``; `tpkit.integrations.lora`), and make its
    ``save_pretrained`` gather. Run on every rank; idempotent."""
    lay_out_adapters(model)
    if tp_state(model) is not None:
        _install_save(model)
    return model


def _install_save(model: nn.Module) -> None:
    from peft import PeftModel

    if not isinstance(model, PeftModel) or "save_pretrained" in model.__dict__:
        return
    model.save_pretrained = functools.partial(
        _save_gathered, unpatched(PeftModel, "save_pretrained"), model
    )


def _save_gathered(original, model, save_directory, *args: Any, **kwargs: Any) -> None:
    """Every rank: peft's own ``save_pretrained``, whose ``get_peft_model_state_dict`` gathers
    the tensors it selects (`patch_peft`); rank 0 writes normal, unsharded peft files.

    With a ``state_dict`` the caller has gathered already (Trainer's ``save_model`` through
    `tpkit.integrations.trainer`, on the main process only): a plain peft save, no collective."""
    bound = original.__get__(model)
    if kwargs.get("state_dict") is not None:
        return bound(save_directory, *args, **kwargs)
    kwargs.pop("is_main_process", None)
    main = rank() == 0
    token = _rank0_only.set(True)  # the other ranks take part in the gathers, keep nothing
    try:
        bound(save_directory, *args, is_main_process=main, **kwargs)
    finally:
        _rank0_only.reset(token)
    barrier()


# ---- plain peft calls on tpkit models ----------------------------------------------------------
_deferred = contextvars.ContextVar("tpkit_peft_deferred", default=False)
#: set by the tuner's selection inside ``get_peft_model_state_dict``: the model is tpkit's
_gather = contextvars.ContextVar("tpkit_peft_gather", default=False)
#: set around `_save_gathered`: ranks other than 0 drop what they gather
_rank0_only = contextvars.ContextVar("tpkit_peft_rank0_only", default=False)


def _wrap(owner: Any, name: str, make, required: bool = True) -> None:
    wrap(owner, name, make, versions="peft", group="peft", required=required)


def patch_peft() -> None:
    """Make plain peft calls right on tpkit models: ``peft.get_peft_model(tpkit_model, cfg)``,
    ``PeftModel.from_pretrained(tpkit_model, dir)``, ``load_adapter``, ``add_adapter`` and
    ``save_pretrained`` then size, lay out, load and save adapters as this module's functions do.
    Idempotent; models tpkit did not shard go to peft untouched; `unpatch_peft` undoes it.
    ``tpkit.tensor_parallel`` calls it for you (`tpkit.integrations.autopatch`)."""
    from peft import PeftModel
    from peft.tuners import tuners_utils
    from peft.tuners.lora import layer as lora_layer

    for owner in (tuners_utils, lora_layer):  # lora's layer module binds its own name for it
        _wrap(owner, "_get_in_out_features", global_in_out, required=False)
    from peft.tuners.lora import dora

    _wrap(dora.DoraLinearLayer, "update_layer", dora_whole_weight)
    _wrap(tuners_utils.BaseTuner, "inject_adapter", _inject_adapter)
    _wrap(PeftModel, "load_adapter", lambda load: _for_tpkit(load, _load_adapter))
    _wrap(
        PeftModel,
        "from_pretrained",
        lambda cm: classmethod(_for_tpkit(cm.__func__, _from_pretrained, model_at=1)),
    )
    _wrap(PeftModel, "save_pretrained", lambda save: _for_tpkit(save, _save_gathered))
    _patch_state_dict()


def _patch_state_dict() -> None:
    """``peft.get_peft_model_state_dict(tpkit_model)`` returns full plain tensors on every rank.

    Users bind the function by name (``from peft import get_peft_model_state_dict``) before
    tpkit patches anything, so the function itself cannot be replaced (and replacing it would
    make the result depend on import order). Two names it looks up at call time are hooked
    instead: the tuner's ``_get_adapter_state_dict`` (which receives the model: is it tpkit's?)
    and ``_validate_lora_adapter_state_dict`` (which receives the finished dict: adapter tensors,
    ``modules_to_save`` copies, embedding layers). peft's own gather for transformers' TP
    (keyed on ``model._tp_size``) gathers the whole model's state dict, base weights included,
    before selecting; this gathers only what is returned. On a peft without those names the
    values stay DTensors (``full_tensor()`` them)."""
    from peft.tuners.lora import LoraModel
    from peft.utils import save_and_load

    select = LoraModel.__dict__.get("_get_adapter_state_dict")
    validate = save_and_load.__dict__.get("_validate_lora_adapter_state_dict")
    if not isinstance(select, classmethod) or validate is None:
        return

    @functools.wraps(select.__func__)
    def get_adapter_state_dict(cls, model, *args, **kwargs):
        _gather.set(tp_state(model) is not None)
        return select.__func__(cls, model, *args, **kwargs)

    @functools.wraps(validate)
    def validate_state_dict(state_dict, *args, **kwargs):
        if _gather.get():
            _gather.set(False)
            state_dict.update(full_tensors(state_dict, keep=not _rank0_only.get() or rank() == 0))
        return validate(state_dict, *args, **kwargs)

    _wrap(LoraModel, "_get_adapter_state_dict", lambda _: classmethod(get_adapter_state_dict))
    _wrap(save_and_load, "_validate_lora_adapter_state_dict", lambda _: validate_state_dict)


def _for_tpkit(original, handle, model_at: int = 0):
    """``original`` for models tpkit did not split; ``handle(original, *args, **kwargs)`` for
    the others (the model is positional argument ``model_at``)."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if tp_state(args[model_at]) is None:
            return original(*args, **kwargs)
        return handle(original, *args, **kwargs)

    return wrapper


def _then_shard(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with adapter layout held back (the injected adapters are laid out
    once, after the whole adapter files are loaded into them)."""
    token = _deferred.set(True)
    try:
        return fn(*args, **kwargs)
    finally:
        _deferred.reset(token)


def _inject_adapter(inject):
    @functools.wraps(inject)
    def inject_adapter(self, model, adapter_name, *args, **kwargs):
        tpkit_model = tp_state(model) is not None
        if tpkit_model:  # before peft creates (and initialises) anything on the split base
            config = self.peft_config.get(adapter_name)
            if config is not None and str(config.peft_type) == "LORA":
                check_lora_config(config, adapter_name, base_split=True)
        out = inject(self, model, adapter_name, *args, **kwargs)
        if tpkit_model and not _deferred.get():
            shard_adapters(model)
        return out

    return inject_adapter


def _load_adapter(load, self, *args, **kwargs):
    if _deferred.get():
        return load(self, *args, **kwargs)
    out = _then_shard(load, self, *args, **kwargs)
    shard_adapters(self)
    return out


def _from_pretrained(from_pretrained_, cls, model, *args, **kwargs):
    return shard_adapters(_then_shard(from_pretrained_, cls, model, *args, **kwargs))


def unpatch_peft() -> None:
    """Undo `patch_peft`."""
    unpatch_all("peft")
