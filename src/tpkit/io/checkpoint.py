"""Reshardable checkpoints of training state: torch.distributed.checkpoint (DCP), made safe.

- `save_checkpoint` / `load_checkpoint`: torch.distributed.checkpoint (DCP) of the model and
  optimizer; DCP records global shapes, so a checkpoint saved at one (dp, tp) layout loads into
  any other. Writes go to a temporary directory that is fsynced, marked complete and swapped into
  place (`tpkit.io.atomic`); loads read only plain data and check keys and shapes first; packed
  (strided) shards are saved in their global layout (`tpkit.io.dcp`).
- `export_checkpoint`: DCP -> safetensors HF checkpoint, without a process group.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from tpkit.io import atomic
from tpkit.io.build import instantiate, model_class
from tpkit.io.dcp import (
    METADATA_FILE,
    SafeFileSystemReader,
    SafeLoadPlanner,
    StridedSavePlanner,
    UnsafeCheckpointError,
    read_metadata,
)
from tpkit.parallel.mesh import barrier, rank

__all__ = [
    "DCP_CHECKPOINT",
    "export_checkpoint",
    "load_checkpoint",
    "run_on_rank0",
    "save_checkpoint",
]

MODEL_KEY, OPTIM_KEY = "model", "optim"
EXTRA_FILE, CONFIG_DIR = "tpkit_extra.json", "hf_config"

#: What `save_checkpoint` writes: DCP's data files and metadata (and their temporaries), tpkit's
#: extra state and the saved config. Any other file in the directory is the user's and is kept.
DCP_CHECKPOINT = atomic.DirKind(
    name="tpkit/DCP checkpoint",
    patterns=(
        r".*\.distcp",
        r"(__\d+_?)?\.metadata(\.tmp)?",
        re.escape(EXTRA_FILE),
        re.escape(CONFIG_DIR) + r"/[^/]+\.json",
    ),
    legacy_file=METADATA_FILE,
    untagged_siblings=True,  # checkpoints and partial writes from before tags existed
)


# ---- DCP ---------------------------------------------------------------------------------------
def _states(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {MODEL_KEY: get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd}


def run_on_rank0(fn: Callable[[], Any], what: str) -> Any:
    """Run ``fn`` on rank 0 only (file-system work) and return its result there (None on the
    other ranks); if it fails there, every rank raises, so no rank is left waiting at the next
    collective for one that has given up. Every rank must call it: it ends in one broadcast,
    which also keeps the other ranks from going on before rank 0 has finished."""
    error: Exception | None = None
    out = None
    if rank() == 0:
        try:
            out = fn()
        except Exception as exc:
            error = exc
    report = None
    if dist.is_initialized():
        box = [None if error is None else (type(error).__name__, str(error))]
        dist.broadcast_object_list(box, src=0)
        report = box[0]
    if error is not None:
        raise error
    if report is not None:
        name, message = report
        cls = ValueError if name == "ValueError" else RuntimeError
        raise cls(f"{what} failed on rank 0: {name}: {message}")
    return out


def _run_dcp(what: str, directory: Path, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Call ``dcp.save`` / ``dcp.load``, turning DCP's ``CheckpointException`` (a BaseException,
    which ``except Exception`` does not catch) into a RuntimeError chained from it, or into the
    `UnsafeCheckpointError` a rank refused a file with. DCP hands every rank the same failures."""
    try:
        fn(*args, **kwargs)
    except CheckpointException as exc:
        for _, failure in sorted(exc.failures.items()):
            error = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(error, UnsafeCheckpointError):
                raise UnsafeCheckpointError(str(error)) from exc
        raise RuntimeError(f"{what} {directory} failed: {exc}") from exc


def _not_a_checkpoint(directory: Path) -> str:
    if directory.is_dir() and any(directory.iterdir()):
        return f"{directory} is not a complete tpkit/DCP checkpoint"
    return f"{directory} is not a tpkit/DCP checkpoint (no {METADATA_FILE} file)"


def _prepare_save(directory: Path) -> None:
    atomic.recover(directory, kind=DCP_CHECKPOINT)
    if directory.is_dir() and not atomic.is_complete(directory, legacy_file=METADATA_FILE):
        held = sorted(p.name for p in directory.iterdir())
        if held:
            raise ValueError(
                f"{directory} exists, is not empty and is not a complete checkpoint (it holds "
                f"{_some(held)}); refusing to replace it. Move it away or save somewhere else."
            )
    atomic.prepare_tmp(directory, kind=DCP_CHECKPOINT)


def _finish_save(directory: Path, model: nn.Module, extra_json: str) -> None:
    tmp = atomic.tmp_sibling(directory)
    (tmp / EXTRA_FILE).write_text(extra_json)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.architectures = [type(model).__name__]  # as save_pretrained records it
        config.save_pretrained(str(tmp / CONFIG_DIR))
    atomic.mark_complete(tmp)  # fsyncs every file first; the marker is the last thing written
    atomic.swap_in(directory, kind=DCP_CHECKPOINT)


def save_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    **extra_state: Any,
) -> Path:
    """Save a reshardable DCP checkpoint of ``model`` (and ``optimizer``) to ``directory``.

    ``extra_state`` (step, scheduler state, ...) must be JSON-serialisable: it is written as JSON,
    never pickled. The checkpoint is written to ``<directory>.tmp``, fsynced, marked complete and
    swapped into place by rank 0 once every rank has finished (`tpkit.io.atomic`): a crash at any
    point leaves a complete copy that `load_checkpoint` finds, and the next save first restores
    it as ``directory``. Packed (strided) shards such as GPT-2's ``c_attn`` are written in their
    global layout (`tpkit.io.dcp`). Files in ``directory`` that are not the checkpoint's (notes,
    a Trainer's files) are kept; a symlinked ``directory`` is replaced where it points.
    """
    given = directory
    directory = Path(os.path.realpath(directory))  # the same path on every rank: its .tmp too
    extra_json = json.dumps(extra_state)  # fails here, on every rank, before any collective
    states = _states(model, optimizer)
    # Rank 0's first act may move the copy a load just read (an interrupted swap's .tmp back to
    # directory): no rank may still be reading it, and nothing in a load waits for the slowest.
    barrier()
    run_on_rank0(lambda: _prepare_save(directory), f"preparing to save {directory}")
    tmp = atomic.tmp_sibling(directory)
    _run_dcp(
        "saving",
        Path(given),
        dcp.save,
        states,
        storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True),
        planner=StridedSavePlanner(),
    )
    run_on_rank0(lambda: _finish_save(directory, model, extra_json), f"finishing {directory}")
    return Path(given)


def _some(items: list[str], limit: int = 10) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def _describe(md: Any) -> str:
    if isinstance(md, TensorStorageMetadata):
        return f"tensor {tuple(md.size)}"
    if isinstance(md, torch.Tensor):
        return f"tensor {tuple(md.shape)}"
    return "a non-tensor value"


def _check_matches(
    metadata: Metadata, states: dict[str, Any], source: Path, with_optimizer: bool
) -> None:
    """Compare the checkpoint's keys and global shapes with the state dict about to be loaded,
    on every rank from the same file, before any collective: DCP would ignore checkpoint keys the
    model lacks and raise a BaseException (on every rank, after collectives) for shapes."""
    # DCP's own flattening (private): the comparison must use exactly the keys DCP will use.
    from tpkit.compat import flatten_state_dict

    flat, _ = flatten_state_dict(states)
    saved = metadata.state_dict_metadata
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}

    def namespace(key: str) -> str:
        path = paths.get(key)
        return str(path[0]) if path else key.split(".", 1)[0]

    unexpected = sorted(k for k in saved if namespace(k) in states and k not in flat)
    missing = sorted(k for k in flat if k not in saved)
    mismatched = []
    for key in sorted(k for k in flat if k in saved):
        md, value = saved[key], flat[key]
        saved_tensor = isinstance(md, TensorStorageMetadata)
        if saved_tensor != isinstance(value, torch.Tensor) or (
            saved_tensor and tuple(md.size) != tuple(value.shape)
        ):
            mismatched.append(f"{key}: checkpoint {_describe(md)}, model {_describe(value)}")
    if not (unexpected or missing or mismatched):
        return
    what = "model and optimizer" if with_optimizer else "model"
    lines = [f"The checkpoint {source} does not match the {what} it is loaded into:"]
    for title, keys in (
        ("in the checkpoint but not in the " + what, unexpected),
        ("in the " + what + " but not in the checkpoint", missing),
        ("with a different shape", mismatched),
    ):
        if keys:
            lines.append(f"  {len(keys)} keys {title}:")
            lines += [f"    {k}" for k in keys[:10]]
            if len(keys) > 10:
                lines.append(f"    ... ({len(keys) - 10} more)")
    saved_optim = any(namespace(k) == OPTIM_KEY for k in saved)
    if with_optimizer and not saved_optim and all(k.startswith(OPTIM_KEY + ".") for k in missing):
        lines.append(
            "It was saved without optimizer state: load it with optimizer=None (the optimizer "
            "then starts fresh)."
        )
    else:
        hint = "the same model class and configuration"
        if (source / CONFIG_DIR).is_dir():
            config_dir = str(source / CONFIG_DIR)
            hint = f"the configuration saved with it: AutoConfig.from_pretrained({config_dir!r})"
        lines.append(
            "A checkpoint loads into any dp/tp layout of the architecture it was saved from "
            f"(same layers and sizes, same optimizer class): build the model from {hint}."
        )
    raise ValueError("\n".join(lines))


def _find_source(directory: Path) -> Path:
    source = atomic.find_complete(directory, legacy_file=METADATA_FILE)
    if source is None:
        raise FileNotFoundError(_not_a_checkpoint(directory) + ".")
    return source


def load_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by `save_checkpoint` into ``model`` (and ``optimizer``), whatever
    the (dp, tp) layout it was saved with; return the ``extra_state`` saved with it.

    Nothing in the checkpoint is unpickled beyond plain data (`tpkit.io.dcp`): a file that asks
    for more raises `tpkit.io.dcp.UnsafeCheckpointError`. Keys or global shapes that differ from
    the model's (and optimizer's) raise one ValueError listing them, on every rank, before any
    collective. If ``directory`` is missing or incomplete after an interrupted save, the complete
    ``<directory>.tmp`` or ``<directory>.old`` is read instead (with a warning).
    """
    source = _find_source(Path(directory))
    metadata = read_metadata(source)  # every rank, no collective: refusals raise everywhere
    extra = source / EXTRA_FILE  # read now, from the copy every rank found, before any rank
    extra_state = json.loads(extra.read_text()) if extra.exists() else {}  # can move on
    states = _states(model, optimizer)  # get_state_dict initialises an empty optimizer's state
    _check_matches(metadata, states, source, optimizer is not None)
    _run_dcp(
        "loading",
        source,
        dcp.load,
        states,
        storage_reader=SafeFileSystemReader(str(source)),
        planner=SafeLoadPlanner(checkpoint_dir=source),
    )
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, states[MODEL_KEY], options=StateDictOptions(strict=True))
    else:
        set_state_dict(
            model, optimizer, model_state_dict=states[MODEL_KEY], optim_state_dict=states[OPTIM_KEY]
        )
    return extra_state


def _relation(a: Path, b: Path) -> str | None:
    """How path ``a`` stands to path ``b`` (both resolved): "is", "is inside", "contains", or None."""
    if a == b:
        return "is"
    if b in a.parents:
        return "is inside"
    if a in b.parents:
        return "contains"
    return None


def _check_export_overlap(checkpoint_dir: Path, out_dir: Path) -> None:
    """Refuse an output that is the checkpoint being read, lies inside it or contains it (symlinks
    resolved, the interrupted-save copies ``.tmp`` / ``.old`` of either included): the swap
    would replace or delete the very files the export reads."""
    reads = [checkpoint_dir, atomic.tmp_sibling(checkpoint_dir), atomic.old_sibling(checkpoint_dir)]
    writes = [out_dir, atomic.tmp_sibling(out_dir), atomic.old_sibling(out_dir)]
    for w in writes:
        for r in reads:
            how = _relation(Path(os.path.realpath(w)), Path(os.path.realpath(r)))
            if how is not None:
                suggestion = checkpoint_dir.with_name(checkpoint_dir.name + "-hf")
                raise ValueError(
                    f"export: the output {out_dir} (writing {w}) {how} the checkpoint {r} it "
                    f"reads from {checkpoint_dir} (symlinks resolved): the export would replace "
                    f"or delete the training checkpoint. Give an output directory outside it, "
                    f"e.g. {suggestion}."
                )


def _check_export_target(out_dir: Path) -> None:
    if (out_dir.exists() or out_dir.is_symlink()) and not out_dir.is_dir():
        raise FileExistsError(
            f"{out_dir} exists and is not a directory: export writes a directory (config.json "
            "and safetensors). Give a new directory path."
        )
    if not out_dir.is_dir():
        return
    if (out_dir / METADATA_FILE).exists():
        raise ValueError(
            f"{out_dir} holds a tpkit/DCP training checkpoint ({METADATA_FILE}); refusing to write "
            "an export into it. Give a new or empty directory, or an earlier export."
        )
    held = sorted(p.name for p in out_dir.iterdir())
    if held and not any(atomic.HF_CHECKPOINT.owns(name) for name in held):
        raise ValueError(
            f"{out_dir} is not empty and does not hold a Hugging Face checkpoint (it holds "
            f"{_some(held)}); refusing to replace it. Give an empty or new directory."
        )


def export_checkpoint(
    checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, model_cls: str | None = None
) -> Path:
    """Turn a DCP checkpoint into a safetensors HF checkpoint (config + weights), no process group.

    Loads the full tensors in this one process, so it needs the model's size in memory once. Reads
    nothing but plain data from the checkpoint (`tpkit.io.dcp`). ``out_dir`` must be new, empty
    or an HF checkpoint, and apart from the checkpoint read (not it, not inside it, not around
    it: a ValueError before anything is written). It is written as ``<out_dir>.tmp`` and swapped
    in (`tpkit.io.atomic`, `tpkit.io.atomic.HF_CHECKPOINT`): the checkpoint files of a previous export
    are replaced (a stale ``model.safetensors.index.json`` or shard does not survive), every
    other file in ``out_dir`` (a README, tokenizer files) is kept, and a crash at any point
    leaves ``out_dir`` loading as the previous export or the new one.
    """
    import transformers

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    _check_export_overlap(checkpoint_dir, out_dir)
    _check_export_target(out_dir)
    source = _find_source(checkpoint_dir)
    if not (source / CONFIG_DIR).exists():
        raise FileNotFoundError(
            f"{checkpoint_dir} has no {CONFIG_DIR}/: it was not saved from a transformers model."
        )
    metadata = read_metadata(source)
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    weights: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        path = tuple(paths.get(key) or key.split(".", 1))
        if len(path) == 2 and path[0] == MODEL_KEY:
            is_tensor = isinstance(md, TensorStorageMetadata)
            weights[path[1]] = (
                torch.empty(md.size, dtype=md.properties.dtype) if is_tensor else None
            )
    _run_dcp(
        "exporting",
        source,
        dcp.load,
        {MODEL_KEY: weights},
        storage_reader=SafeFileSystemReader(str(source)),
        planner=SafeLoadPlanner(checkpoint_dir=source),
        no_dist=True,
    )
    config = transformers.AutoConfig.from_pretrained(str(source / CONFIG_DIR))
    with torch.device("meta"):
        model = instantiate(model_class(config, model_cls), config)
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"The checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}.")
    atomic.replace_dir(
        out_dir, lambda tmp: model.save_pretrained(str(tmp)), kind=atomic.HF_CHECKPOINT
    )
    return out_dir
