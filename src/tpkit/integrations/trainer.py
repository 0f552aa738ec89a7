"""Hugging Face ``Trainer`` for tpkit models: train, ``save_model``, resume, on CPU and GPU.

Usage (``torchrun --nproc-per-node 2 train.py``), the stock Trainer::

    import tpkit
    from accelerate import ParallelismConfig
    from transformers import Trainer, TrainingArguments

    model = tpkit.tensor_parallel(model)              # also applies patch_trainer() for you
    args = TrainingArguments(..., parallelism_config=ParallelismConfig(tp_size=2))
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    trainer.train()                                   # or train(resume_from_checkpoint=...)
    trainer.save_model("out")                         # a normal checkpoint plain transformers loads

dp x tp (``torchrun --nproc-per-node 4``): ``tpkit.tensor_parallel(model, tp_size=2)`` (FSDP2
over the other dimension when tpkit shards, else dp replicas) with
``ParallelismConfig(tp_size=2, dp_shard_size=2)``; the config may also be left out, tpkit fills it
in from the model. HSDP (``torchrun --nproc-per-node 8``): ``pc = ParallelismConfig(
dp_replicate_size=2, dp_shard_size=2, tp_size=2)``, ``tpkit.tensor_parallel(model,
distributed_config=pc)`` and ``TrainingArguments(parallelism_config=pc)``. A checkpoint saved at
one layout resumes at another.

Why a patch and not a ``TPTrainer`` subclass: user code keeps the stock ``Trainer`` (and
``Seq2SeqTrainer``, TRL's ``SFTTrainer`` or any other subclass, and scripts that build the Trainer
themselves) with no extra line: ``tpkit.tensor_parallel`` applies `patch_trainer` (now, or when
``transformers.trainer`` is imported: `tpkit.integrations.autopatch`). Every patched method first asks whether the Trainer's model is a
tpkit model (``model._tpkit``) and otherwise calls the original untouched, so other models in the
same process train exactly as before; ``unpatch_trainer()`` restores everything.

What Trainer and accelerate need, and what this module does about it:

- **No second wrap, no device move, every rank in ``save_model``.** Trainer has exactly this path
  for models transformers sharded at load time: it keys on ``model.is_distributed_loading_by_
  transformers``. tpkit sets ``model._is_distributed_loading_by_transformers = True`` (the
  attribute behind that property) when such a model meets a Trainer.
- **Resuming.** For those models Trainer refuses any ``save_strategy`` that writes optimizer state
  ("Resuming is not supported for models sharded at load time"). tpkit lets the check pass and
  replaces the model/optimizer part of a checkpoint: ``checkpoint-N/tpkit_dcp/`` is a
  `tpkit.save_checkpoint` (torch DCP) of model and optimizer, reshardable to any (dp, tp) layout;
  the scheduler, RNG and trainer state are Trainer's own files. ``checkpoint-N/`` also holds the
  gathered full model (``model.safetensors``), as for any Trainer run.
- **Whole checkpoints, resume or start.** ``checkpoint-N/`` is written under a staging name and
  renamed into place complete; ``get_last_checkpoint`` skips incomplete ones; and
  ``train(resume_from_checkpoint=True)`` starts fresh when there is none yet
  (`tpkit.integrations.trainer_resume`).
- **``save_model``** gathers each DTensor to a full tensor (`tpkit.save_tensor_parallel`), rank 0
  writes with ``save_pretrained``, the other ranks only take part in the gathers.
- **CPU.** A model on a CPU mesh sets ``args.use_cpu`` (accelerate's MULTI_CPU needs it; without
  it every rank would train alone), rebuilding the device state TrainingArguments made already.
- **ParallelismConfig on CPU.** accelerate rejects a ParallelismConfig unless the run is FSDP2,
  DeepSpeed or multi-*GPU* (``DistributedType.MULTI_CPU`` is refused). While a Trainer builds
  its Accelerator for a tpkit model, tpkit accepts MULTI_CPU after the one check that matters
  (the config's total size equals the number of processes). Nothing else in accelerate changes.
- **The config must describe the model.** Without a ``parallelism_config`` tpkit fills one in from
  the model (``tp_size``, ``dp_replicate_size``, ``dp_shard_size``), as Trainer does for
  transformers' own TP models; a config that disagrees with the model is a ``ValueError`` naming
  both, because a wrong ``tp_size`` would silently give the ranks of one TP group different
  batches (and a model FSDP2 shards must be told its own dp_replicate x dp_shard split).
- **Data.** With the config's device mesh accelerate's data loader gives data rank
  ``rank // tp_size`` (= replica x dp_shard + shard): the ranks of one TP group get the same
  batch, every data rank its own. tpkit's mesh has tp innermost, so the two agree.
- **dp > 1.** With FSDP2 over the data axes FSDP reduces the gradients; gradient accumulation
  defers its reduce-scatter (HSDP: its all-reduce across replicas) to the last micro-batch (Trainer's own deferral reads transformers'
  ``config.distributed_config``, which a tpkit model does not have). A TP model replicated over
  dp (no FSDP) gets a per-parameter hook that averages its local gradient over the dp group at
  the end of each accumulation window, as DDP would (``model._tpkit_dp_sync`` marks it; core code
  that reduces dp gradients itself can set that flag to turn the hook off).
- **cp > 1.** ``ParallelismConfig(cp_size=...)`` makes accelerate wrap each step in torch's
  ``context_parallel`` (no CPU kernel; it splits the batch in place) after hooks that drop every
  self-attention mask, and Trainer insist on SDPA. For a tpkit CP model both are replaced: the
  step runs in `tpkit.parallel.context.ContextParallel.trainer_mode` and the model splits the
  batch accelerate gave the whole cp group, once. The loss is then this rank's share, as the
  Trainer's arithmetic expects (it multiplies by its process count and averages gradients).
- **evaluate / predict.** TP partners hold the same predictions: they are gathered over the dp
  group only, so the last short batch is trimmed right and nothing is repeated ``tp_size`` times.
  ``num_input_tokens_seen`` is counted once per TP group for the same reason.
- **``load_best_model_at_end``** loads the best checkpoint's DCP copy (or, with
  ``save_only_model=True``, its gathered safetensors via `load_full_weights`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tpkit.integrations.patching import applied, unpatch_all, wrap
from tpkit.integrations.trainer_checkpoints import (
    DCP_DIR,
    load_full_weights,
    patched_load_best_model,
    patched_load_from_checkpoint,
    patched_load_optimizer_and_scheduler,
    patched_load_rng_state,
    patched_save,
    patched_save_optimizer_and_scheduler,
)
from tpkit.integrations.trainer_resume import (
    patched_get_last_checkpoint,
    patched_save_checkpoint,
    patched_train,
)
from tpkit.parallel.context.apply import context_of
from tpkit.parallel.fsdp import average_over_dp, is_fsdp
from tpkit.parallel.mesh import get_mesh
from tpkit.state import tp_state, wrapper_chain

__all__ = ["DCP_DIR", "load_full_weights", "patch_trainer", "tp_state", "unpatch_trainer"]

_building_accelerator = contextvars.ContextVar("tpkit_building_accelerator", default=False)


def patch_trainer() -> None:
    """Teach ``transformers.Trainer`` (and every subclass) to train, save and resume tpkit models.

    Idempotent; call it once per process before building the Trainer. Models that tpkit did not
    parallelize are untouched: every patched method hands them to the original. Each patch goes
    through `tpkit.integrations.patching` (original recorded, tested versions checked).
    """
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import Trainer, trainer_utils

    for name, make, required in _TRAINER_PATCHES:
        wrap(Trainer, name, make, versions="transformers", group="trainer", required=required)
    wrap(  # skips incomplete checkpoint-N folders (trainer_resume.py)
        trainer_utils,
        "get_last_checkpoint",
        patched_get_last_checkpoint,
        versions="transformers",
        group="trainer",
        holders="transformers",
    )
    wrap(
        ParallelismConfig,
        "_validate_accelerator",
        _validate_accelerator,
        versions="accelerate",
        group="trainer",
    )
    wrap(Accelerator, "_prepare_cp", _prepare_cp, versions="accelerate", group="trainer")


def unpatch_trainer() -> None:
    """Undo `patch_trainer`."""
    unpatch_all("trainer")


def is_patched() -> bool:
    return bool(applied("trainer"))


# ---- Trainer.__init__ / accelerator ------------------------------------------------------------
def _init(original):
    def __init__(self, model=None, args=None, *rest, **kwargs):
        state = tp_state(model)
        if state is None:
            return original(self, model, args, *rest, **kwargs)
        if args is None:
            from transformers import TrainingArguments

            args = TrainingArguments(output_dir="tmp_trainer")
        if state.mesh.device_type == "cpu" and not args.use_cpu:
            _use_cpu(args)
        _mark_self_distributed(model)
        # ... which refuses checkpoints with optimizer state; tpkit writes those itself (DCP).
        save_only_model = args.save_only_model
        args.save_only_model = True
        try:
            original(self, model, args, *rest, **kwargs)
        finally:
            args.save_only_model = save_only_model
        _install_dp_grad_sync(model, state)

    return __init__


def _use_cpu(args: Any) -> None:
    """accelerate treats a CPU run as distributed (MULTI_CPU) only with ``use_cpu=True``; without
    it each rank would see one process and train alone. The model's mesh says where it runs, so
    the user need not say it again. ``TrainingArguments`` built its device state already (a
    cached property and accelerate's process-wide ``PartialState``): both are rebuilt."""
    from accelerate.state import AcceleratorState

    args.use_cpu = True
    if "_setup_devices" in args.__dict__:
        AcceleratorState._reset_state(reset_partial_state=True)
        del args.__dict__["_setup_devices"]
        _ = args.device  # rebuild now, with cpu=True


def _mark_self_distributed(model: nn.Module) -> None:
    """Put the model on Trainer's path for models that own their placement and gradient
    reduction (``is_distributed_loading_by_transformers``): the property on transformers models
    (read through PEFT wrappers, hence every link), a plain attribute on other modules."""
    for m in wrapper_chain(model):
        if isinstance(getattr(type(m), "is_distributed_loading_by_transformers", None), property):
            m._is_distributed_loading_by_transformers = True
        else:
            m.is_distributed_loading_by_transformers = True


def _install_dp_grad_sync(model: nn.Module, state) -> None:
    """Average gradients over the dp dimension for a model whose dp replicas nothing reduces.

    With FSDP2 on the data axes (``sharded=True``) FSDP reduce-scatters the gradients. A model
    that is TP-sharded and replicated over dp (``dp_size > 1``, no FSDP) gets one hook per
    parameter that all-reduces its local gradient over the dp group at the end of each gradient
    accumulation window (accelerate's ``sync_gradients``), as DDP would. Registered once per
    parameter; a no-op for dp = 1.
    """
    if _model_dp(state) == 1 or is_fsdp(model) or getattr(model, "_tpkit_dp_sync", False):
        return
    from accelerate.state import GradientState

    dp_mesh = get_mesh(state.mesh, "dp")

    def average(param: torch.Tensor) -> None:
        if param.grad is not None and GradientState().sync_gradients:
            average_over_dp(param.grad, dp_mesh)

    for param in model.parameters():
        # one averaged elsewhere already (expert weights over their own replicas) is left out
        if param.requires_grad and not getattr(param, "_tpkit_dp_averaged", False):
            param.register_post_accumulate_grad_hook(average)
    model._tpkit_dp_sync = True


def _create_accelerator(original):
    def create_accelerator_and_postprocess(self):
        if tp_state(getattr(self, "model", None)) is None:
            return original(self)
        token = _building_accelerator.set(True)
        try:
            return original(self)
        finally:
            _building_accelerator.reset(token)

    return create_accelerator_and_postprocess


def _evaluation_loop(original):
    def evaluation_loop(self, *args, **kwargs):
        state = tp_state(self.model)
        if state is not None:  # Trainer resets gather_function at the end of every loop
            self.gather_function = functools.partial(
                gather_for_metrics,
                self.accelerator,
                state,
                use_gather_object=self.args.eval_use_gather_object,
            )
        return original(self, *args, **kwargs)

    return evaluation_loop


def gather_for_metrics(accelerator, state, data, use_gather_object: bool = False):
    """accelerate's ``gather_for_metrics`` for a TP model: gather over the dp group only.

    The ranks of a TP group evaluate the same batch and hold the same outputs; gathering over the
    whole world would repeat every prediction ``tp_size`` times, and accelerate's trim of the last
    batch (``gradient_state.remainder``, counted in dp ranks) would then keep the wrong rows.
    """
    from accelerate.utils import recursively_apply

    try:
        recursively_apply(lambda x: x, data, error_on_other_type=True)
        all_tensors = True
    except TypeError:
        all_tensors = False
    dp = _model_dp(state)
    if dp > 1:
        group = get_mesh(state.mesh, "dp").get_group()
        if use_gather_object or not all_tensors:
            parts: list = [None] * dp
            dist.all_gather_object(parts, data, group=group)
            data = [x for part in parts for x in part]
        else:
            data = recursively_apply(functools.partial(_gather_dim0, group=group, n=dp), data)
    gradient_state = accelerator.gradient_state
    if gradient_state.end_of_dataloader and gradient_state.remainder > 0:
        keep = gradient_state.remainder
        if isinstance(data, list) and not all_tensors:
            return data[:keep]
        return recursively_apply(lambda t: t[:keep], data)
    return data


def _gather_dim0(tensor: torch.Tensor, group, n: int) -> torch.Tensor:
    tensor = tensor.contiguous()
    if tensor.ndim == 0:
        tensor = tensor[None]
    parts = [torch.empty_like(tensor) for _ in range(n)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=0)


def _defer_fsdp_gradient_reduction(original):
    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        # Trainer's version reads config.distributed_config (transformers' own TP); tpkit's FSDP2
        # modules are told directly to hold the reduce-scatter until the last micro-batch.
        if tp_state(self.model) is None:
            with original(self):
                yield
            return
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        # HSDP: only the all-reduce across replicas waits; the reduce-scatter within a replica
        # runs per micro-batch, so gradients stay sharded (transformers' own choice)
        dims = tp_state(self.model).dims
        hold = "set_requires_all_reduce" if dims.dp_replicate > 1 and dims.dp_shard > 1 else None
        for m in modules:
            if hold:
                m.set_requires_all_reduce(False, recurse=False)
            else:
                m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in modules:
                m.set_requires_gradient_sync(True, recurse=False)

    return _defer_fsdp_gradient_reduction


def _track_num_input_tokens(original):
    def _track_num_input_tokens(self, inputs):
        before = self.state.num_input_tokens_seen
        original(self, inputs)
        state = tp_state(self.model)
        if state is not None:  # the gather summed each tp x cp block's (identical) count
            seen = self.state.num_input_tokens_seen - before
            self.state.num_input_tokens_seen = before + seen // (state.tp_size * state.dims.cp)

    return _track_num_input_tokens


def _model_dp(state) -> int:
    return int(getattr(state, "dp_size", 1) or 1)


def _build_accelerator_args(original):
    def _build_accelerator_args(self, **kwargs):
        args = original(self, **kwargs)
        state = tp_state(getattr(self, "model", None))
        if state is None:
            return args
        pc, sharded = args.get("parallelism_config"), is_fsdp(self.model)
        if pc is None:
            args["parallelism_config"] = _config_of(state, sharded)
        else:
            _check_config(pc, state, sharded)
        return args

    return _build_accelerator_args


def _config_of(state, sharded: bool):
    """The ``ParallelismConfig`` describing a tpkit model: FSDP2's (dp_replicate, dp_shard)
    split where FSDP2 shards it, else every data rank on dp_shard (replicas tpkit averages: the
    data loader counts only the product)."""
    from accelerate import ParallelismConfig

    dims = state.dims
    if sharded:
        return ParallelismConfig(
            tp_size=dims.tp,
            dp_replicate_size=dims.dp_replicate,
            dp_shard_size=dims.dp_shard,
            cp_size=dims.cp,
        )
    return ParallelismConfig(tp_size=dims.tp, dp_shard_size=dims.dp, cp_size=dims.cp)


def _check_config(pc, state, sharded: bool) -> None:
    """A config that does not describe the model is refused: a wrong tp_size or cp_size would give
    the ranks of one TP or CP group different batches, and a model FSDP2 shards must be told its own
    (dp_replicate, dp_shard) split (an HSDP config over a plainly sharded model, or back)."""
    dims = state.dims
    pc_dp = pc.dp_shard_size * pc.dp_replicate_size
    wrong = pc.tp_size != dims.tp or pc_dp != dims.dp or pc.cp_size != dims.cp or pc.sp_size != 1
    split = (pc.dp_replicate_size, pc.dp_shard_size) != (dims.dp_replicate, dims.dp_shard)
    if wrong or (sharded and split):
        cp = f", cp_size={dims.cp}" if dims.cp > 1 else ""
        raise ValueError(
            f"TrainingArguments.parallelism_config (tp_size={pc.tp_size}, dp_shard_size="
            f"{pc.dp_shard_size}, dp_replicate_size={pc.dp_replicate_size}, cp_size={pc.cp_size}, "
            f"sp_size={pc.sp_size}) does not describe the tpkit model (tp_size={dims.tp}, "
            f"dp_size={dims.dp}{cp}), whose data ranks are dp_replicate_size={dims.dp_replicate} "
            f"x dp_shard_size={dims.dp_shard}. Split the model with the same config, "
            "tpkit.tensor_parallel(model, distributed_config=parallelism_config), or leave it "
            "unset and tpkit fills it in; a wrong tp_size or cp_size would give the ranks of one "
            "TP or CP group different batches."
        )


def _prepare_context_parallel_inputs(original):
    def _prepare_context_parallel_inputs(self, model, inputs):
        # Trainer's version insists on sdpa and hands the batch to torch's context_parallel
        # (which splits it in place); a tpkit model splits the whole batch in its own forward
        cp = context_of(model)
        if cp is None:
            return original(self, model, inputs)
        return cp.trainer_mode, inputs

    return _prepare_context_parallel_inputs


def _prepare_cp(original):
    def _prepare_cp(self, *args):
        # accelerate's: torch's context_parallel (no CPU kernel) and hooks that drop every
        # self-attention mask. A tpkit CP model splits its batch itself: accelerate's
        # maybe_context_parallel then only marks the Trainer's convention (no second split).
        found = next((context_of(a) for a in args if isinstance(a, nn.Module)), None)
        if found is None:
            return original(self, *args)
        self._cp_context = lambda **_: found.trainer_mode()
        return args

    return _prepare_cp


def _validate_accelerator(original):
    def _validate_accelerator(self, accelerator):
        from accelerate.utils import DistributedType

        if (
            _building_accelerator.get()
            and accelerator.distributed_type == DistributedType.MULTI_CPU
        ):
            # accelerate accepts ParallelismConfig only for multi-GPU-like types, FSDP2, DeepSpeed.
            # The model is already parallelized by tpkit; the mesh only has to match the world.
            if self.total_size != accelerator.num_processes:
                raise ValueError(
                    f"ParallelismConfig total_size ({self.total_size}) does not match num_processes "
                    f"({accelerator.num_processes})."
                )
            return None
        return original(self, accelerator)

    return _validate_accelerator


# ---- what patch_trainer patches (the saving and loading wrappers: trainer_checkpoints.py) ------
#: Trainer attribute -> the wrapper built from its original, required in the tested versions
_TRAINER_PATCHES = (
    ("__init__", _init, True),
    ("create_accelerator_and_postprocess", _create_accelerator, True),
    ("_build_accelerator_args", _build_accelerator_args, True),
    ("evaluation_loop", _evaluation_loop, True),
    ("_defer_fsdp_gradient_reduction", _defer_fsdp_gradient_reduction, False),
    ("_track_num_input_tokens", _track_num_input_tokens, False),
    ("train", patched_train, True),
    ("_save_checkpoint", patched_save_checkpoint, True),
    ("_prepare_context_parallel_inputs", _prepare_context_parallel_inputs, False),
    ("_save", patched_save, True),
    ("_save_optimizer_and_scheduler", patched_save_optimizer_and_scheduler, True),
    ("_load_from_checkpoint", patched_load_from_checkpoint, True),
    ("_load_optimizer_and_scheduler", patched_load_optimizer_and_scheduler, True),
    ("_load_rng_state", patched_load_rng_state, True),
    ("_load_best_model", patched_load_best_model, False),
)
