"""`tensor_parallel()`: plan -> validate -> mesh -> apply styles. The one line of tpkit.

Order matters and is visible here: everything that can fail (sizes, plan, divisibility, device
map) runs before the first collective, identically on every rank; only then is the process group
and mesh built, the RNG synced across the TP group, and the plan applied.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tpkit.debug import debug_enabled, install_debug_checks, install_first_forward_checks
from tpkit.fsdp import apply_fsdp, repeated_blocks
from tpkit.generation import install_generate_guard
from tpkit.log import get_logger
from tpkit.mesh import (
    build_mesh,
    default_device_type,
    dist_env,
    init_distributed,
    resolve_sizes,
    sync_rng,
    tp_submesh,
)
from tpkit.plan import Plan, PlanLike, check_plan_arg, derive_plan, validate
from tpkit.rng import install_region_rng
from tpkit.sequence_parallel import (
    COLUMN_STYLES,
    ROW_STYLES,
    install_sequence_parallel,
    sequence_parallel_problems,
)
from tpkit.styles import (
    ReplicateStyle,
    apply_fixups,
    install_parent_swaps,
    make_style,
    shard_param,
)

log = get_logger(__name__)


@dataclass
class TPState:
    """What tpkit attached to a parallelized model (``model._tpkit``)."""

    mesh: DeviceMesh
    tp_mesh: DeviceMesh
    plan: Plan
    tp_size: int
    dp_size: int


def _launch_hint(n: int) -> str:
    return (
        f"Tensor parallelism runs one process per rank. Launch {n} ranks with\n"
        f"    torchrun --nproc-per-node {n} your_script.py\n"
        f"or from Python / a notebook: tpkit.launch(fn, nproc={n})."
    )


def _pick_device(device_ids: Sequence | None, local_rank: int, device_type: str) -> torch.device:
    if device_ids:
        # every rank of the node checks against the node's rank count, so all raise alike
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
        if max(local_rank + 1, local_world) > len(device_ids):
            raise ValueError(
                f"device_ids has {len(device_ids)} entries but this node runs {local_world} "
                "ranks; give one device per rank on this node, or leave device_ids unset."
            )
        return torch.device(device_ids[local_rank])
    if device_type == "cuda":
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device(device_type)


def _model_device(model: nn.Module) -> torch.device | None:
    for p in model.parameters():
        return p.device
    return None


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
) -> nn.Module:
    """Split ``model`` over the ranks of its tensor-parallel group, in place, and return it.

    Run on every rank (``torchrun --nproc-per-node N script.py``) with identical weights. Each
    parameter becomes a DTensor on ``mesh["tp"]``: sharded where the plan says so, replicated
    otherwise; the model keeps its class, ``forward``, ``generate`` and ``save_pretrained``.

    Args:
        model: any ``nn.Module``; a transformers model uses its ``base_model_tp_plan``.
        device_ids: the familiar ``["cuda:0", "cuda:1"]``: local rank i uses ``device_ids[i]``.
        tp_size: ranks per TP group; default the world size (or the mesh's "tp" size).
        plan: ``"auto"`` (transformers plan, else inferred), ``"config"``, ``"infer"``, or a
            ``{pattern: style}`` dict / `Plan` / YAML path merged over the auto plan.
        dp_size: data-parallel replicas; default world size / tp_size.
        mesh: a DeviceMesh to use instead of building ``("dp", "tp")`` from the world size.
        sharded: FSDP2 (``fully_shard`` per block, then the root) over ``mesh["dp"]`` after TP;
            default on when dp_size > 1. With dp_size == 1 nothing is sharded further (what TP
            leaves replicated is norms and biases, ~0.01% of a transformer). With
            ``sharded=False`` and dp_size > 1 the dp replicas are independent (inference, or
            your own gradient averaging; tpkit's Trainer integration averages them).
        sequence_parallel: norms, dropout and residuals of each block split along the sequence
            (all-gather / reduce-scatter instead of all-reduce); training only, decoder-only.
        loss_parallel: in training, the lm_head hands the loss vocab-sharded logits (a
            ``Shard(-1)`` DTensor) and the cross-entropy never gathers the vocabulary.
        param_dtype: FSDP2 mixed precision: parameters and compute in this dtype (e.g.
            ``torch.bfloat16``), gradient reductions in float32. Needs ``sharded``.

    Outside torchrun (world size 1) the model is returned unchanged (moved to ``device_ids[0]``
    when given).
    """
    _reject_peft_wrapper(model)
    _check_sizes_are_ints(tp_size=tp_size, dp_size=dp_size)
    check_plan_arg(plan)
    done = _already_parallel(model, tp_size, dp_size, plan, mesh)
    if done is not None:
        return done
    env = dist_env()
    if mesh is None and not env.is_distributed:
        distinct = {str(d) for d in device_ids or ()}
        if len(distinct) > 1:
            raise RuntimeError(
                f"device_ids={list(device_ids)} asks for {len(distinct)} devices, but this is a single "
                "process. " + _launch_hint(len(distinct))
            )
        n = (tp_size or 1) * (dp_size or 1)
        if n > 1:
            raise ValueError(
                f"tp_size={tp_size or 1} x dp_size={dp_size or 1} needs {n} processes. "
                + _launch_hint(n)
            )
        _log_single_process_once()
        return model.to(device_ids[0]) if device_ids else model

    if mesh is not None:
        tp_mesh = tp_submesh(mesh)
        tp, dp = tp_mesh.size(), mesh.size() // tp_mesh.size()
        if tp_size not in (None, tp) or dp_size not in (None, dp):
            raise ValueError(
                f"tp_size={tp_size}, dp_size={dp_size} disagree with the mesh (tp={tp}, dp={dp})."
            )
        device_type = mesh.device_type
    else:
        tp, dp = resolve_sizes(tp_size, dp_size, env.world_size)
        device_type = default_device_type()
    device = _pick_device(device_ids, env.local_rank, device_type)

    sharded = dp > 1 if sharded is None else sharded
    the_plan = derive_plan(model, plan)
    # every check that can fail, before any collective, on every rank alike
    validate(model, the_plan, tp)
    _check_training_options(
        model, the_plan, dp, sharded, sequence_parallel, loss_parallel, param_dtype
    )

    if mesh is None:
        init_distributed(device_type=device_type)
        mesh = build_mesh(tp, dp, device_type)
        tp_mesh = tp_submesh(mesh)
    current = _model_device(model)
    if current is not None and current.type != "meta" and current != device:
        model.to(device)
    if tp > 1:
        sync_rng(tp_mesh)
        apply_plan(model, the_plan, tp_mesh)
        sp = install_sequence_parallel(model, the_plan, tp_mesh) if sequence_parallel else None
        install_region_rng(
            model, _rng_regions(model, the_plan, sp is not None), tp_mesh.get_local_rank()
        )
        if loss_parallel:
            _enable_loss_parallel(model)
    model._tpkit = TPState(mesh=mesh, tp_mesh=tp_mesh, plan=the_plan, tp_size=tp, dp_size=dp)
    if sharded and dp > 1:
        apply_fsdp(model, mesh["dp"], param_dtype=param_dtype)
    if tp > 1:
        install_generate_guard(model)
        if debug_enabled():  # TPKIT_DEBUG=1: inputs and replicated params agree at every forward
            install_debug_checks(model, tp_mesh)
        else:  # the inputs of the first forwards agree across the TP group, then no more cost
            install_first_forward_checks(model, tp_mesh)
    return model


_said_single = []


def _log_single_process_once() -> None:
    if not _said_single:
        _said_single.append(True)
        log.info(
            "tensor_parallel: one process (no torchrun), so the model is returned unsplit. "
            + _launch_hint(2).replace("\n", " ")
        )


def _check_sizes_are_ints(**sizes) -> None:
    """``tp_size="2"`` or ``2.0`` would fail deep inside mesh arithmetic: refuse it here."""
    for name, value in sizes.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(
                f"{name} must be an int or None, got {value!r} ({type(value).__name__}); "
                f"pass {name}={int(value) if _is_whole(value) else 2}."
            )


def _is_whole(value) -> bool:
    try:
        return float(value) == int(float(value))
    except (TypeError, ValueError):
        return False


def _already_parallel(model, tp_size, dp_size, plan, mesh) -> nn.Module | None:
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
        tp_size in (None, state.tp_size)
        and dp_size in (None, state.dp_size)
        and (mesh is None or mesh is state.mesh)
        and (isinstance(plan, str) and plan == "auto")
    )
    if not same:
        raise ValueError(
            f"{type(model).__name__} is already tensor-parallel (tp_size={state.tp_size}, "
            f"dp_size={state.dp_size}); tensor_parallel cannot split it again with "
            f"tp_size={tp_size}, dp_size={dp_size}, plan={plan!r}. Call it once on the "
            "unsharded model with the options you want (tpkit.from_pretrained takes them too)."
        )
    return model


def _reject_peft_wrapper(model: nn.Module) -> None:
    """A PeftModel hides the base model's names behind ``base_model.model.``: the base's plan
    would match nothing and the model would silently stay replicated."""
    try:
        from peft import PeftModel
    except ImportError:  # peft is a dependency, but the core must not need it
        return
    if isinstance(model, PeftModel):
        raise ValueError(
            f"tensor_parallel got a PEFT model ({type(model).__name__}); use "
            "tpkit.integrations.peft.tensor_parallel(model, ...) to shard the base and lay out "
            "the adapters, or add adapters after sharding with "
            "tpkit.integrations.peft.get_peft_model(tpkit.tensor_parallel(base), config)."
        )


def _check_training_options(
    model, plan, dp, sharded, sequence_parallel, loss_parallel, param_dtype
) -> None:
    problems = []
    if loss_parallel:
        problems += _loss_parallel_problems(model, plan)
    if param_dtype is not None and not (sharded and dp > 1):
        problems.append(
            f"param_dtype={param_dtype} is FSDP2's mixed precision and needs sharded=True with "
            "dp_size > 1; for tp only, cast the model (model.to(torch.bfloat16)) instead."
        )
    if sequence_parallel:
        problems += sequence_parallel_problems(model, plan)
    if problems:
        raise ValueError("Cannot apply tensor parallelism:\n- " + "\n- ".join(problems))


def _loss_parallel_problems(model: nn.Module, plan: Plan) -> list[str]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {id(m): n for n, m in model.named_modules()}
    hit = plan.style_for(names[id(head)]) if head is not None and id(head) in names else None
    forward = getattr(inspect.unwrap(type(model).forward), "__code__", None)
    calls_loss = forward is not None and "loss_function" in forward.co_names
    if hit is None or hit[0] != "colwise_gather_output" or not calls_loss:
        return [
            f"loss_parallel needs a causal LM whose output head uses colwise_gather_output and "
            f"whose loss goes through model.loss_function; {type(model).__name__} does not "
            "(use loss_parallel=False)."
        ]
    return []


def _rng_regions(model: nn.Module, plan: Plan, sequence_parallel: bool) -> dict[str, list[str]]:
    """Where dropout must differ across TP ranks: with SP every block (its activations are
    sequence chunks); otherwise each module holding column-parallel layers, up to its
    row-parallel layer."""
    modules = dict(model.named_modules())
    if sequence_parallel:
        names = {id(m): n for n, m in modules.items()}
        return {names[id(b)]: [] for b in repeated_blocks(model)}
    styles = {t.name: t.style for t in plan.resolve(model) if t.kind == "module"}
    regions: dict[str, list[str]] = {}
    for name, style in styles.items():
        if style in COLUMN_STYLES and "." in name:
            regions.setdefault(name.rsplit(".", 1)[0], [])
    for name, style in styles.items():
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if style in ROW_STYLES and parent in regions:
            regions[parent].append(name)
    return regions


def _enable_loss_parallel(model: nn.Module) -> None:
    """Vocab-sharded logits into a vocab-parallel cross-entropy, never gathered (training)."""
    from tpkit.loss import causal_lm_loss

    style = model.get_output_embeddings().__dict__["_tpkit_style_obj"]  # checked before
    style.loss_parallel = True
    model.loss_function = causal_lm_loss


def _rope_dim(model: nn.Module, modules: dict[str, nn.Module], name: str) -> int:
    """MLA's rope width for ``name``'s kv_a projection: the attention module's own value, else
    its (per-layer) config's, else the model config's, as transformers reads it."""
    parent = modules.get(name.rsplit(".", 1)[0] if "." in name else "")
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for src in (parent, getattr(parent, "config", None), config):
        try:
            value = getattr(src, "qk_rope_head_dim", None)
        except RuntimeError:  # a heterogeneous config refuses global reads of per-layer values
            value = None
        if isinstance(value, int):
            return value
    return 0


def apply_plan(model: nn.Module, plan: Plan, tp_mesh: DeviceMesh) -> None:
    """Apply a validated plan on a 1D TP mesh: parameter entries, then module styles, then
    ``Replicate()`` for every parameter nothing named, then the plan's fix-ups (per-rank head
    counts, per-head inputs sliced), then re-tie tied parameters."""
    ties = _tied_groups(model)
    modules = dict(model.named_modules())
    targets = plan.resolve(model)
    styled: set[str] = set()
    for t in targets:
        if t.kind == "param":
            owner, pname = t.name.rsplit(".", 1) if "." in t.name else ("", t.name)
            shard_param(modules[owner], pname, t.style, tp_mesh)
    for t in targets:
        if t.kind == "module":
            if t.style == "mla_kv_a_proj":
                modules[t.name]._tpkit_rope_dim = _rope_dim(model, modules, t.name)
            make_style(t.style)._apply(modules[t.name], tp_mesh)
            styled.add(t.name)
    for name, module in modules.items():
        if name not in styled and any(p is not None for p in module._parameters.values()):
            ReplicateStyle()._apply(module, tp_mesh)
    install_parent_swaps(model, tp_mesh)  # replicated weights read by a parent directly
    for name, module in modules.items():
        fixups = plan.fixups_for(name) if plan.fixups else None
        if fixups:
            apply_fixups(module, fixups, tp_mesh)  # per-rank head counts the module reads
    for group in ties:
        first_mod, first_name = group[0]
        shared = first_mod._parameters[first_name]
        for mod, pname in group[1:]:
            mod._parameters[pname] = shared


def _tied_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    by_id: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for pname, p in module._parameters.items():
            if p is not None:
                by_id.setdefault(id(p), []).append((module, pname))
    return [g for g in by_id.values() if len(g) > 1]
