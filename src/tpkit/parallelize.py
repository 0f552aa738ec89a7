"""A split on a rank, as the list of its steps: `parallelize` = `split`, then FSDP2 / HSDP.

sizes -> adapt -> derive -> prepare -> validate -> mesh -> random init -> tensor (+ sp, rng,
loss) -> finish -> guards -> fsdp (the order `docs/architecture.md` shows, checked by
tests/test_docs.py). The plan is derived once; the split extensions (`tpkit.extensions`, one
ordered list) adapt the model before it and check themselves against it after. Everything
that can fail (sizes, plan, divisibility, options, device map) runs before the first
collective, identically on every rank; only then is the process group and mesh built and each
parallelism applied, in mesh order, one call each. Whether a call runs here or hands the model
to a worker pool is the package face's decision (`tpkit.tensor_parallel`), not this module's.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tpkit.extensions import SplitExtension, register_split_extension, split_extensions
from tpkit.guards.debug import install_input_checks
from tpkit.guards.generation import install_generate_guard
from tpkit.io.plans import plan_for
from tpkit.io.save import install_save_pretrained
from tpkit.log import get_logger
from tpkit.parallel.context.apply import apply_context_parallel
from tpkit.parallel.context.checks import check_context
from tpkit.parallel.dims import SIZE_KEYWORDS, ParallelDims, launch_hint
from tpkit.parallel.expert.apply import apply_expert_parallel, expert_data_parallel
from tpkit.parallel.fsdp import apply_fsdp
from tpkit.parallel.fsdp_plan import fsdp_problems
from tpkit.parallel.mesh import (
    build_expert_mesh,
    build_mesh,
    get_mesh,
    init_distributed,
    tp_submesh,
)
from tpkit.parallel.tensor import apply_tensor_parallel
from tpkit.plan import check_plan_arg, validate
from tpkit.sources.expert_placement import check_expert_sizes, expert_modules, place_experts
from tpkit.state import TPOptions, TPState
from tpkit.styles.expert import IMPLEMENTATIONS
from tpkit.trace.analysis import Analysis
from tpkit.training.init import install_random_init

__all__ = [
    "SplitExtension",
    "apply_pending_fsdp",
    "parallelize",
    "register_split_extension",
    "split",
]

log = get_logger(__name__)


def parallelize(
    model: nn.Module,
    device_ids: Sequence[str | int | torch.device] | None = None,
    options: TPOptions | None = None,
) -> nn.Module:
    """`tpkit.tensor_parallel` on a rank (under torchrun): the split, then FSDP2 / HSDP over the
    data axes. The package face (`tpkit.tensor_parallel`) decides rank or pool and calls this
    on a rank; the options' meanings are in its docstring."""
    return apply_pending_fsdp(split(model, device_ids, options))


def split(
    model: nn.Module,
    device_ids: Sequence[str | int | torch.device] | None = None,
    options: TPOptions | None = None,
    *,
    extensions: Sequence[SplitExtension] = (),
    saved_plans: str | Path | None = None,
) -> nn.Module:
    """`parallelize` without its FSDP2 step, for callers that must put something in first
    (`from_pretrained` loads the weights, the PEFT integration adds adapters): FSDP2 is recorded
    on ``model._tpkit.pending_fsdp`` and applied by `apply_pending_fsdp`. ``extensions``: more
    `SplitExtension` s for this call only, after the registered ones (`from_pretrained`'s
    quantization, which needs the one derived plan). ``saved_plans``: a checkpoint folder whose
    ``tpkit-plans/`` may hold this model's plan (``tpkit plan --save``; `tpkit.io.plans`)."""
    o = options or TPOptions()
    every = (*split_extensions(), *extensions)
    for extension in every:
        handled = extension.handle(model, device_ids, o)
        if handled is not None:
            return handled
    _reject_peft_wrapper(model)
    check_plan_arg(o.plan)
    dims = o.dims(device_ids)
    done = _already_parallel(model, o, dims)
    if done is not None:
        return done
    if not (o.fill_later or _building_empty()):
        _refuse_never_loaded(model)
    if dims.single_process:
        _log_single_process_once()
        return model.to(dims.device) if device_ids else model
    # cp ranks hold the same parameters: FSDP shards over dp_shard x cp (torchtitan's dp_shard_cp)
    sharded = dims.dp * dims.cp > 1 if o.sharded is None else o.sharded
    fsdp = o.fsdp()
    _refuse_axes_not_built(dims)
    if dims.cp > 1:
        check_context(model, o.cp_attention, o.sequence_parallel, dims.cp, dims.tp)
    adapted: list[tuple[SplitExtension, Any]] = []
    try:  # no collective yet: a refusal puts back what the extensions adapted
        for e in every:
            if (a := e.adapt(model, o)) is not None:
                adapted.append((e, a))
        experts = _expert_entries(model, dims, o) if dims.ep > 1 else None  # no collective yet
        analysis = Analysis(model, o.example_inputs)  # one analysis: validation reuses its runs
        the_plan = plan_for(  # derive_plan's, or the same stored under its key; rank 0's
            model,
            o.plan,
            dims.tp,
            o.example_inputs,
            beside=saved_plans,
            device_type=dims.device_type,
            ranks=dims.world,
            analysis=analysis,
        )
        if experts is not None:  # whole experts per EP rank: out of the tensor step's plan
            the_plan = place_experts(model, the_plan, experts)
            check_expert_sizes(model, the_plan, dims.ep)
        states = dict(adapted)
        contexts = [
            (e, c)
            for e in every
            if (c := e.prepare(model, the_plan, dims.tp, o, states.get(e))) is not None
        ]
        validate(  # every check that can fail, before any collective, on every rank alike
            model,
            the_plan,
            dims.tp,
            dp_size=dims.dp * dims.cp,  # the ranks FSDP shards over
            sharded=sharded,
            sequence_parallel=o.sequence_parallel,
            loss_parallel=o.loss_parallel,
            param_dtype=o.param_dtype,
            example_inputs=o.example_inputs,
            analysis=analysis,
        )
        if found := fsdp_problems(model, fsdp, dims, sharded, o.mesh):
            raise ValueError("FSDP2 settings:\n  " + "\n  ".join(found))
    except BaseException:
        for e, a in reversed(adapted):
            e.undo(model, a)
        raise
    mesh = o.mesh if o.mesh is not None else _world_mesh(dims)
    tp_mesh = tp_submesh(mesh)
    install_random_init(mesh)  # init after the split draws the unsharded values
    expert_mesh = _expert_mesh(dims)
    fsdp_later = sharded and dims.dp * dims.cp > 1
    with torch_registration():
        _move(model, dims.device)
        if dims.tp > 1:
            mixed = fsdp.param_dtype if fsdp_later else None
            apply_tensor_parallel(
                model,
                the_plan,
                tp_mesh,
                sequence_parallel=o.sequence_parallel,
                loss_parallel=o.loss_parallel,
                mixed_dtype=mixed,
            )
        if expert_mesh is not None:
            apply_expert_parallel(
                model,
                the_plan,
                expert_mesh["ep"],
                batch_mesh=tp_mesh if dims.tp > 1 else None,
                implementation=_ep_implementation(o),
            )
            if not fsdp_later:  # with FSDP its step does it (`apply_pending_fsdp`)
                expert_data_parallel(model, expert_mesh, fsdp=False)
        if dims.cp > 1:
            cp_mesh = get_mesh(mesh, "cp")
            apply_context_parallel(model, cp_mesh, o.cp_attention, average_grads=not fsdp_later)
    model._tpkit = TPState(
        mesh=mesh,
        tp_mesh=tp_mesh,
        plan=the_plan,
        dims=dims,
        pending_fsdp=fsdp if fsdp_later else None,
        expert_mesh=expert_mesh,
    )
    for extension, context in contexts:
        extension.finish(model, context, tp_mesh)
    _install_guards(model, dims.tp, tp_mesh)
    return model


def _world_mesh(dims: ParallelDims) -> DeviceMesh:
    """The process group (if not up yet) and the world mesh of ``dims``' axes."""
    init_distributed(device_type=dims.device_type)
    return build_mesh(
        dims.tp,
        dims.dp_shard,
        dims.device_type,
        dp_replicate_size=dims.dp_replicate,
        cp_size=dims.cp,
    )


def _ep_implementation(o: TPOptions) -> str:
    """``ep_implementation`` as asked: the keyword, else the ``DistributedConfig``'s, else
    "auto"."""
    if o.ep_implementation is not None:
        return o.ep_implementation
    return getattr(o.distributed_config, "ep_implementation", None) or "auto"


def _expert_entries(model: nn.Module, dims: ParallelDims, o: TPOptions) -> list:
    """The experts modules EP places (`tpkit.sources.expert_placement`), and every problem an EP
    split can have that the model alone shows, checked before any collective (the plan comes
    from rank 0): no experts module to place, an ``ep_implementation`` that is not one, or
    all-reduce asked where the EP group holds more than one batch. The expert counts and
    layouts are checked against the plan (`check_expert_sizes`), the same plan on every rank."""
    implementation = _ep_implementation(o)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"ep_implementation={implementation!r}: use one of {', '.join(IMPLEMENTATIONS)}."
        )
    if implementation == "all_reduce" and dims.ep != dims.tp:
        raise ValueError(
            f"ep_implementation='all_reduce' needs every rank of an expert-parallel group to hold "
            f"the same tokens (ep_size == tp_size); got ep_size={dims.ep}, tp_size={dims.tp}. "
            "Use 'all_to_all' or 'auto'."
        )
    entries, notes = expert_modules(model, _ep_plan_patterns(o))
    if not entries:
        said = "; ".join(f"{k}: {v}" for k, v in list(notes.items())[:3])
        raise ValueError(
            f"ep_size={dims.ep}: {type(model).__name__} has no experts module expert "
            f"parallelism can place ({said or 'no module with an expert count and weights whose first dim counts experts'}); "
            "pass ep_size=1, or make the experts one module called as (hidden, expert ids, "
            "routing weights)."
        )
    return entries


def _ep_plan_patterns(o: TPOptions) -> list[str]:
    """The experts modules a ``DistributedConfig(ep_plan=...)`` names (transformers' format:
    ``{"layers.*.mlp.experts": "ep_dispatch_experts", ...}``), as patterns of the model."""
    ep_plan = {**(getattr(o.distributed_config, "ep_plan", None) or {}), **(o.ep_plan or {})}
    return [k for k, v in ep_plan.items() if v == "ep_dispatch_experts"]


def _expert_mesh(dims: ParallelDims) -> DeviceMesh | None:
    """The expert mesh of ``dims`` (ep innermost, efsdp = dp_shard x tp / ep), or None at
    ep = 1."""
    if dims.ep == 1:
        return None
    efsdp = dims.dp_shard * dims.tp // dims.ep
    return build_expert_mesh(dims.dp_replicate, efsdp, dims.ep, dims.device_type)


def _refuse_axes_not_built(dims: ParallelDims) -> None:
    """Pairs of axes this build does not apply together: one clear error, before any
    collective, instead of a model that silently ignores one. (dp_replicate > 1 with
    dp_shard = 1 is HSDP over an (R, 1) data mesh: replicas whose gradients FSDP2 all-reduces.)"""
    if dims.ep > 1 and dims.cp > 1:
        raise ValueError(
            f"ep_size={dims.ep} with cp_size={dims.cp}: expert and context parallelism are not "
            "built together yet; pass one of them."
        )


def _building_empty() -> bool:
    """Inside ``accelerate.init_empty_weights()``: the model is built empty to be filled after
    the split (the old ``tensor_parallel`` package's documented flow, which scripts still use),
    so its meta parameters are meant."""
    return nn.Module.register_parameter is not _TORCH_REGISTRATION[0]


def _refuse_never_loaded(model: nn.Module) -> None:
    """A model with parameters on meta that nobody will fill: one clear error on every rank
    (each built the same model) before the process group and mesh, instead of a split that
    takes a dozen collectives and a first forward that then refuses it (`refuse_meta`).
    ``fill_later=True``, or a call inside accelerate's ``init_empty_weights()``, says the weights come
    after the split."""
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise ValueError(
            f"{type(model).__name__} has {len(meta)} parameter(s) on the meta device (e.g. "
            f"{', '.join(meta[:3])}): built empty and never loaded, it cannot run. Load it with "
            "tpkit.from_pretrained(path) (it splits on meta, then reads each rank's slices), or "
            "pass fill_later=True to put the weights in after the split yourself "
            "(model.to_empty(device=...) and its init to train from scratch, "
            "tpkit.load_local_state_dict, accelerate's load_checkpoint_in_model)."
        )


def _install_guards(model: nn.Module, tp: int, tp_mesh: DeviceMesh) -> None:
    """save_pretrained that gathers (every rank calls it, rank 0 writes); at tp > 1 the inputs
    of generate and of the first forwards checked across the TP group."""
    install_save_pretrained(model)
    if tp > 1:
        install_generate_guard(model)
        install_input_checks(model, tp_mesh)


def apply_pending_fsdp(model: nn.Module) -> nn.Module:
    """Apply the FSDP2 step `split` left for later (nothing when there is none), with its
    settings: over the data axes of the mesh, dp_shard (x cp) alone (FSDP) or dp_replicate x
    dp_shard (x cp) (HSDP): cp ranks hold the same parameters, so FSDP shards over them too."""
    state = getattr(model, "_tpkit", None)
    if state is not None and state.pending_fsdp is not None:
        options, state.pending_fsdp = state.pending_fsdp, None
        if state.expert_mesh is not None:  # first: the dense FSDP leaves expert weights out
            expert_data_parallel(
                model, state.expert_mesh, fsdp=True, param_dtype=options.param_dtype
            )
        apply_fsdp(model, get_mesh(state.mesh, "dp_replicate", "dp_shard_cp"), options)
    return model


_TORCH_REGISTRATION = (nn.Module.register_parameter, nn.Module.register_buffer)


@contextlib.contextmanager
def torch_registration():
    """torch's own ``register_parameter`` / ``register_buffer`` while tpkit puts DTensors in.

    accelerate's ``init_empty_weights()`` replaces them with versions that rebuild every new
    parameter as ``type(param)(param.to("meta"))``, which for a DTensor drops its spec (and
    fails); ``tensor_parallel`` inside that context would break on the first shard. The
    model is on meta there anyway, so the split itself is all that context would change."""
    saved = (nn.Module.register_parameter, nn.Module.register_buffer)
    patched = saved != _TORCH_REGISTRATION and all(
        f.__module__ == "torch.nn.modules.module" for f in _TORCH_REGISTRATION
    )
    if patched:
        nn.Module.register_parameter, nn.Module.register_buffer = _TORCH_REGISTRATION
    try:
        yield
    finally:
        if patched:
            nn.Module.register_parameter, nn.Module.register_buffer = saved


def _move(model: nn.Module, device: torch.device) -> None:
    current = next((p.device for p in model.parameters()), None)
    if current is not None and current.type != "meta" and current != device:
        model.to(device)


_said_single: list[bool] = []


def _log_single_process_once() -> None:
    if not _said_single:
        _said_single.append(True)
        log.info(
            "tensor_parallel: one process (no torchrun), so the model is returned unsplit. "
            + launch_hint(2).replace("\n", " ")
        )


def _already_parallel(model: nn.Module, o: TPOptions, dims: ParallelDims) -> nn.Module | None:
    """A model tpkit already split: returned as it is when the call asks for nothing new (so
    ``tensor_parallel(tpkit.from_pretrained(p))`` is harmless), else a clear error. Applying the
    styles twice would split the shards again and silently corrupt the forward."""
    state = getattr(model, "_tpkit", None)
    if state is None:
        foreign = next((n for n, p in model.named_parameters() if isinstance(p, DTensor)), None)
        if foreign is not None:
            raise ValueError(
                f"{type(model).__name__} already has DTensor parameters (e.g. {foreign}): it "
                "was distributed by other code (parallelize_module, FSDP, transformers' tp_plan). "
                "tensor_parallel needs the plain model: load it without tp_plan/device_mesh."
            )
        return None
    asked = [k for k in SIZE_KEYWORDS if getattr(o, k) is not None]
    has = {**{f"{a}_size": v for a, v in state.dims.shape.items()}, "ep_size": state.dims.ep}
    has["dp_size"] = state.dims.dp
    same = (
        all(getattr(o, k) == has[k] for k in asked)
        and (o.distributed_config is None or dims.shape == state.dims.shape)
        and (o.mesh is None or o.mesh is state.mesh)
        and (isinstance(o.plan, str) and o.plan == "auto")
    )
    if not same:
        now = ", ".join(f"{k}={v}" for k, v in has.items() if v > 1 or k == "tp_size")
        wanted = ", ".join(f"{k}={getattr(o, k)}" for k in asked) or "its sizes"
        raise ValueError(
            f"{type(model).__name__} is already tensor-parallel ({now}); tensor_parallel "
            f"cannot split it again with {wanted}, plan={o.plan!r}. Call it once on the "
            "unsharded model with the options you want (tpkit.from_pretrained takes them too)."
        )
    return model


def _reject_peft_wrapper(model: nn.Module) -> None:
    """A PeftModel hides the base model's names behind ``base_model.model.``: the base's plan
    would match nothing and the model would silently stay replicated. (``import tpkit``
    registers the PEFT integration, which splits such models; this is for core-only use.)"""
    peft = sys.modules.get("peft")  # a PeftModel exists only once peft is imported
    if peft is not None and isinstance(model, peft.PeftModel):
        raise ValueError(
            f"tensor_parallel got a PEFT model ({type(model).__name__}); use "
            "tpkit.integrations.peft.tensor_parallel(model, ...) to shard the base and lay out "
            "the adapters, or add adapters after sharding with "
            "tpkit.integrations.peft.get_peft_model(tpkit.tensor_parallel(base), config)."
        )
