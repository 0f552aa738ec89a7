"""`tensor_parallel()`: the one line of tpkit, as the list of its steps.

sizes -> adapt -> derive -> prepare -> validate -> mesh -> random init -> apply (+ sp, rng, loss)
-> finish -> guards -> fsdp (the order `docs/architecture.md` shows, checked by
tests/test_docs.py). The plan is derived once; the split extensions (`tpkit.extensions`, one
ordered list) adapt the model before it and check themselves against it after. Everything that can fail
(sizes, plan, divisibility, options, device map) runs before the first collective, identically
on every rank; only then is the process group and mesh built, the plan applied and the RNG
synced across the TP group. Outside torchrun, a call naming 2+ devices hands the model to a
worker pool instead (`tpkit.pool`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tpkit.apply import StyleOptions, apply_plan
from tpkit.dist.mesh import build_mesh, init_distributed, sync_rng, tp_submesh
from tpkit.dist.parallel_dims import ParallelDims, launch_hint
from tpkit.dist.shm import prepare_shm
from tpkit.extensions import SplitExtension, register_split_extension, split_extensions
from tpkit.guards.debug import install_input_checks
from tpkit.guards.generation import install_generate_guard
from tpkit.io.save import install_save_pretrained
from tpkit.log import get_logger
from tpkit.plan import Plan, PlanLike, check_plan_arg, derive_plan, validate
from tpkit.plan.layout import tp_regions
from tpkit.training.fsdp import apply_fsdp, strided_owners
from tpkit.training.init import install_random_init
from tpkit.training.loss import enable_loss_parallel
from tpkit.training.rng import install_region_rng
from tpkit.training.sequence_parallel import SequenceParallel

__all__ = [
    "SplitExtension",
    "TPOptions",
    "TPState",
    "apply_pending_fsdp",
    "register_split_extension",
    "split",
    "tensor_parallel",
    "tp_state",
    "wrapper_chain",
]

log = get_logger(__name__)


@dataclass
class TPState:
    """What tpkit attached to a parallelized model (``model._tpkit``)."""

    mesh: DeviceMesh
    tp_mesh: DeviceMesh
    plan: Plan
    tp_size: int
    dp_size: int
    #: FSDP2 still to apply (``(param_dtype,)``), when `split` was asked to leave it for later
    pending_fsdp: tuple[torch.dtype | None] | None = None
    #: how the weights arrived: "" (the model's own), "slices" or "transformers" (from_pretrained)
    loaded_from: str = ""


def wrapper_chain(model: object, depth: int = 6) -> list:
    """``model`` and each wrapper inside it, outermost first, down to the module tpkit split (the
    one holding a `TPState`) or the innermost wrapper: accelerate's / DDP's ``module``,
    torch.compile's ``_orig_mod``, a PEFT model's base. The one walk through wrappers: `tp_state`
    reads the last link, the Trainer integration marks every link."""
    chain = []
    for _ in range(depth):
        if model is None:
            break
        chain.append(model)
        if isinstance(getattr(model, "_tpkit", None), TPState):
            break
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None and hasattr(model, "get_base_model"):
            try:
                inner = model.get_base_model()
            except Exception:  # noqa: BLE001 - a wrapper mid-construction
                inner = None
        if inner is model:
            break
        model = inner
    return chain


def tp_state(model: object) -> TPState | None:
    """The `TPState` tpkit attached to ``model``, looking through wrappers (`wrapper_chain`),
    or None for any other."""
    chain = wrapper_chain(model)
    state = getattr(chain[-1], "_tpkit", None) if chain else None
    return state if isinstance(state, TPState) else None


def tensor_parallel(
    model: nn.Module,
    device_ids: Sequence[str | int | torch.device] | None = None,
    *,
    tp_size: int | None = None,
    dp_size: int | None = None,
    plan: PlanLike = "auto",
    mesh: DeviceMesh | None = None,
    sharded: bool | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    param_dtype: torch.dtype | None = None,
    example_inputs: tuple | Mapping | None = None,
) -> nn.Module:
    """Split ``model`` over the ranks of its tensor-parallel group, in place, and return it.

    Run on every rank (``torchrun --nproc-per-node N script.py``) with identical weights. Each
    parameter becomes a DTensor on ``mesh["tp"]``: sharded where the plan says so, replicated
    otherwise; the model keeps its class, ``forward``, ``generate`` and ``save_pretrained``.

    Args:
        model: any ``nn.Module``; a transformers model uses its ``base_model_tp_plan``.
        device_ids: the familiar ``["cuda:0", "cuda:1"]``: local rank i uses ``device_ids[i]``.
        tp_size: ranks per TP group; default the world size (or the mesh's "tp" size).
        dp_size: data-parallel replicas; default world size / tp_size.
        plan: ``"auto"`` (transformers plan, else inferred), ``"config"``, ``"infer"``, or a
            ``{pattern: style}`` dict / `Plan` / YAML path merged over the auto plan.
        mesh: a DeviceMesh to use instead of building ``("dp", "tp")`` from the world size.
        sharded: FSDP2 (``fully_shard`` per block, then the root) over ``mesh["dp"]`` after TP;
            default on when dp_size > 1. With ``sharded=False`` and dp_size > 1 the dp replicas
            are independent (inference, or your own gradient averaging).
        sequence_parallel: norms, dropout and residuals of each block split along the sequence
            (all-gather / reduce-scatter instead of all-reduce); training only, decoder-only.
        loss_parallel: in training, the lm_head hands the loss vocab-sharded logits (a
            ``Shard(-1)`` DTensor) and the cross-entropy never gathers the vocabulary.
        param_dtype: FSDP2 mixed precision: parameters and compute in this dtype (e.g.
            ``torch.bfloat16``), gradient reductions in float32. Needs ``sharded``.
        example_inputs: a positional tuple or kwargs dict for the plan's fake-tensor trace, for
            a forward the inputs tpkit makes up from the model (`tpkit.plan.inputs`) do not
            fit; without them, a model that cannot be traced is split per layer, exactly
            (`tpkit.plan.fallback`).

    A model tpkit already split is returned as it is (or refused when asked for another layout).
    Outside torchrun (world size 1) the model is returned unchanged (moved to ``device_ids[0]``
    when given), unless the call names 2+ devices or ``tp_size`` x ``dp_size`` >= 2: then one
    worker process per device holds the shards and a `tpkit.pool.ModelHandle` is returned.
    """
    options = TPOptions(
        tp_size=tp_size,
        dp_size=dp_size,
        plan=plan,
        mesh=mesh,
        sharded=sharded,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        param_dtype=param_dtype,
        example_inputs=example_inputs,
    )
    from tpkit.pool.entry import pool_tensor_parallel  # lazy: for a process that is not a rank

    if (handle := pool_tensor_parallel(model, device_ids, options)) is not None:
        return handle  # outside torchrun, 2+ devices: a live model on worker processes
    return apply_pending_fsdp(split(model, device_ids, options))


@dataclass(frozen=True)
class TPOptions:
    """`tensor_parallel`'s keyword arguments as one value, for the callers that pass them on
    (`split`, `tpkit.from_pretrained`, the PEFT integration); the meaning of each is in
    `tensor_parallel`'s docstring."""

    tp_size: int | None = None
    dp_size: int | None = None
    plan: PlanLike = "auto"
    mesh: DeviceMesh | None = None
    sharded: bool | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False
    param_dtype: torch.dtype | None = None
    example_inputs: tuple | Mapping | None = None

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> TPOptions:
        """From keyword arguments, naming the valid ones for a typo."""
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            valid = ", ".join(f.name for f in fields(cls))
            raise TypeError(f"unknown tensor_parallel option(s) {unknown}; valid: {valid}.")
        return cls(**options)


def split(
    model: nn.Module,
    device_ids: Sequence[str | int | torch.device] | None = None,
    options: TPOptions | None = None,
    *,
    extensions: Sequence[SplitExtension] = (),
) -> nn.Module:
    """`tensor_parallel` without its FSDP2 step, for callers that must put something in first
    (`from_pretrained` loads the weights, the PEFT integration adds adapters): FSDP2 is recorded
    on ``model._tpkit.pending_fsdp`` and applied by `apply_pending_fsdp`. ``extensions``: more
    `SplitExtension` s for this call only, after the registered ones (`from_pretrained`'s
    quantization, which needs the one derived plan)."""
    o = options or TPOptions()
    plan, mesh, param_dtype = o.plan, o.mesh, o.param_dtype
    every = (*split_extensions(), *extensions)
    for extension in every:
        handled = extension.handle(model, device_ids, o)
        if handled is not None:
            return handled
    _reject_peft_wrapper(model)
    check_plan_arg(plan)
    dims = ParallelDims.resolve(o.tp_size, o.dp_size, mesh=mesh, device_ids=device_ids)
    done = _already_parallel(model, o)
    if done is not None:
        return done
    if dims.single_process:
        _log_single_process_once()
        return model.to(dims.device) if device_ids else model
    sharded = dims.dp > 1 if o.sharded is None else o.sharded
    adapted: list[tuple[SplitExtension, Any]] = []
    try:  # no collective yet: a refusal puts back what the extensions adapted
        for e in every:
            if (a := e.adapt(model, o)) is not None:
                adapted.append((e, a))
        the_plan = derive_plan(model, plan, dims.tp, o.example_inputs)  # once, for everyone
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
            dp_size=dims.dp,
            sharded=sharded,
            sequence_parallel=o.sequence_parallel,
            loss_parallel=o.loss_parallel,
            param_dtype=param_dtype,
            example_inputs=o.example_inputs,
        )
    except BaseException:
        for e, a in reversed(adapted):
            e.undo(model, a)
        raise
    if mesh is None:
        init_distributed(device_type=dims.device_type)
        mesh = build_mesh(dims.tp, dims.dp, dims.device_type)
    tp_mesh = tp_submesh(mesh)
    install_random_init(mesh)  # init after the split draws the unsharded values
    fsdp_later = sharded and dims.dp > 1
    with torch_registration():
        _move(model, dims.device)
        if dims.tp > 1:
            sync_rng(tp_mesh)
            if dims.device.type == "cpu":  # decided now, so a first call under torch.compile
                # also finds the shared-memory path (tpkit.dist.shm)
                prepare_shm(tp_mesh.get_group())
            mixed = param_dtype if fsdp_later else None
            _split_tp(model, the_plan, tp_mesh, o.sequence_parallel, o.loss_parallel, mixed)
    model._tpkit = TPState(
        mesh=mesh,
        tp_mesh=tp_mesh,
        plan=the_plan,
        tp_size=dims.tp,
        dp_size=dims.dp,
        pending_fsdp=(param_dtype,) if fsdp_later else None,
    )
    for extension, context in contexts:
        extension.finish(model, context, tp_mesh)
    _install_guards(model, dims.tp, tp_mesh)
    return model


def _install_guards(model: nn.Module, tp: int, tp_mesh: DeviceMesh) -> None:
    """save_pretrained that gathers (every rank calls it, rank 0 writes); at tp > 1 the inputs
    of generate and of the first forwards checked across the TP group."""
    install_save_pretrained(model)
    if tp > 1:
        install_generate_guard(model)
        install_input_checks(model, tp_mesh)


def _split_tp(model, plan, tp_mesh, sequence_parallel, loss_parallel, mixed_dtype) -> None:
    """apply -> sp -> rng -> loss: the styles, built with their final options, then the
    sequence-parallel hooks, the per-rank dropout streams and the vocab-parallel loss."""
    sp = SequenceParallel(model, plan, tp_mesh) if sequence_parallel else None
    compute = dict.fromkeys(strided_owners(model, plan), mixed_dtype) if mixed_dtype else {}
    options = StyleOptions(
        sp=sp.style_sp if sp is not None else {},
        loss_parallel=loss_parallel,
        compute_dtype=compute,
    )
    apply_plan(model, plan, tp_mesh, options)
    if sp is not None:
        sp.install(model)
    install_region_rng(model, _rng_regions(model, plan, sp), tp_mesh.get_local_rank())
    if loss_parallel:
        enable_loss_parallel(model)


def apply_pending_fsdp(model: nn.Module) -> nn.Module:
    """Apply the FSDP2 step `split` left for later (nothing when there is none)."""
    state = getattr(model, "_tpkit", None)
    if state is not None and state.pending_fsdp is not None:
        (param_dtype,) = state.pending_fsdp
        state.pending_fsdp = None
        apply_fsdp(model, state.mesh["dp"], param_dtype=param_dtype)
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


def _already_parallel(model: nn.Module, o: TPOptions) -> nn.Module | None:
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
    same = (
        o.tp_size in (None, state.tp_size)
        and o.dp_size in (None, state.dp_size)
        and (o.mesh is None or o.mesh is state.mesh)
        and (isinstance(o.plan, str) and o.plan == "auto")
    )
    if not same:
        raise ValueError(
            f"{type(model).__name__} is already tensor-parallel (tp_size={state.tp_size}, "
            f"dp_size={state.dp_size}); tensor_parallel cannot split it again with "
            f"tp_size={o.tp_size}, dp_size={o.dp_size}, plan={o.plan!r}. Call it once on the "
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


def _rng_regions(model: nn.Module, plan: Plan, sp: SequenceParallel | None) -> dict[str, list]:
    """Where dropout must differ across TP ranks: with SP every block (its activations are
    sequence chunks); otherwise each tensor-parallel region, up to its row-parallel layer."""
    if sp is not None:
        names = {id(m): n for n, m in model.named_modules()}
        return {names[id(b)]: [] for b in sp.blocks}
    return tp_regions(model, plan)
