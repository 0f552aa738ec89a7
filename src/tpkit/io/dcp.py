"""Safe and strided-aware torch.distributed.checkpoint (DCP) I/O: a reader and two planners.

What torch's DCP lacks, and what this module adds:

- **No code execution from a checkpoint directory.** ``FileSystemReader.read_metadata``
  ``pickle.load``s the ``.metadata`` file and ``DefaultLoadPlanner.load_bytes`` does
  ``torch.load(weights_only=False)`` on every non-tensor item (an optimizer's ``lr``, its
  param_groups), so a planted ``__reduce__`` payload runs as soon as a checkpoint is loaded.
  `read_metadata` unpickles ``.metadata`` with an allow-list of exactly the DCP metadata classes
  and the torch/builtin types they hold (`SafeFileSystemReader` uses it), and `SafeLoadPlanner`
  loads non-tensor items with ``torch.load(weights_only=True)``. Tensor data was already read with
  ``weights_only=True`` by DCP. A refused file raises `UnsafeCheckpointError` naming the file and
  the refused global.
- **Strided (packed) shards.** A DTensor with a ``StridedShard(dim, split_factor)`` placement
  (GPT-2's packed ``c_attn`` q|k|v, fused gate|up, FSDP2 over TP on the same dim) holds on each
  rank ``split_factor`` separate pieces of the global tensor, not one block. DCP describes every
  local tensor as one block (``compute_local_shape_and_global_offset``), so saving GPT-2 at tp=2
  fails with "overlapping chunks" (and a load would put the pieces in the wrong place).
  `StridedSavePlanner` / `SafeLoadPlanner` describe such a tensor as one chunk per contiguous
  piece, with its true global offsets, each mapped to a view of the local tensor; the checkpoint
  keeps the natural global layout, so it reshards to any layout and loads into a plain model.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import os
import pathlib
import pickle
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor, Shard

from tpkit.compat import StridedShard, set_element

# Private torch names, unavoidable here: ``StridedShard`` is the placement this module exists to
# handle (torch has no public name for it); ``set_element`` is how DCP puts a loaded non-tensor
# item back into the nested state dict (the planner API offers no other way); ``_split_tensor`` (in
# `_global_indices`) is DTensor's own definition of which elements a rank holds.

__all__ = [
    "METADATA_FILE",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "StridedSavePlanner",
    "UnsafeCheckpointError",
    "local_pieces",
    "read_metadata",
]

#: DCP's metadata file in a checkpoint directory.
METADATA_FILE = ".metadata"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_PATH_CLASSES = ("PosixPath", "WindowsPath")
#: Every global a real DCP ``.metadata`` pickle needs (found by listing the GLOBAL/STACK_GLOBAL
#: opcodes of model + AdamW checkpoints at tp, dp x tp with FSDP2, and strided layouts), besides
#: torch's dtypes, layouts and memory formats. None of them runs code from its arguments.
_METADATA_GLOBALS = frozenset(
    {
        (_DCP_METADATA, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a torch.layout, looked up by its name
    }
    # StorageMeta.checkpoint_id is the path it was saved to (pathlib._local on Python >= 3.13)
    | {(module, name) for module in ("pathlib", "pathlib._local") for name in _PATH_CLASSES}
)


class UnsafeCheckpointError(pickle.UnpicklingError, ValueError):
    """A checkpoint file asks to unpickle something other than plain data (a global outside the
    allow-list): loading it could run code, so it is refused. The message names the file and the
    refused global."""


def _torch_value(name: str) -> bool:
    value = getattr(torch, name, None)
    return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and _torch_value(name)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.path}: refused to unpickle the global {module}.{name}. A DCP .metadata file "
            "only holds checkpoint metadata classes, torch sizes and dtypes; this one names other "
            "code, which unpickling would run. Do not load this checkpoint unless you wrote it."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.path}: refused a persistent id ({pid!r}) in metadata.")


def read_metadata(path: str | os.PathLike) -> Metadata:
    """Unpickle a DCP ``.metadata`` file (or a checkpoint directory's) with an allow-list.

    Raises `UnsafeCheckpointError` for a global outside the allow-list (nothing from the file
    runs), ``ValueError`` for a file that is not DCP metadata at all.
    """
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / METADATA_FILE
    with open(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f, str(path)).load()
        except UnsafeCheckpointError:
            raise
        except Exception as exc:
            raise ValueError(f"{path} is not a readable DCP metadata file: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path} is not DCP metadata (it holds a {type(metadata).__name__}).")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses the allow-listed `read_metadata` instead
    of ``pickle.load``. Pair it with `SafeLoadPlanner` (non-tensor items)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ---- strided shards ----------------------------------------------------------------------------
def _is_strided(obj: Any) -> bool:
    return (
        isinstance(obj, DTensor)
        and any(isinstance(p, StridedShard) for p in obj.placements)
        and not hasattr(obj.to_local(), "__create_write_items__")  # a tensor subclass's own way
        and obj.device_mesh.get_coordinate() is not None
    )


def _global_indices(t: DTensor, dim: int) -> list[int]:
    """The global indices along ``dim`` of this rank's local tensor, in local order: the
    placements applied left to right (mesh dim order) to ``arange``, with DTensor's own split."""
    coordinate = t.device_mesh.get_coordinate()
    index = torch.arange(t.shape[dim])
    for mesh_dim, placement in enumerate(t.placements):
        if not isinstance(placement, (Shard, StridedShard)) or placement.dim % t.ndim != dim:
            continue
        if isinstance(placement, StridedShard):
            split = StridedShard(0, split_factor=placement.split_factor)
        else:
            split = Shard(0)
        pieces, _ = split._split_tensor(index, t.device_mesh.size(mesh_dim), with_padding=False)
        mine = coordinate[mesh_dim]
        index = pieces[mine] if mine < len(pieces) else index[:0]
    return index.tolist()


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive global indices: (local start, global start, length)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(indices) + 1):
        if i == len(indices) or indices[i] != indices[i - 1] + 1:
            runs.append((start, indices[start], i - start))
            start = i
    return runs


def local_pieces(fqn: str, t: DTensor) -> Iterator[tuple[torch.Size, torch.Tensor]]:
    """The contiguous pieces of a DTensor's local tensor in the global tensor: ``(global offsets,
    view of the local tensor)`` for each, in local order. A ``StridedShard`` dim gives one piece
    per packed part; other dims one piece. Empty pieces are skipped."""
    local = t.to_local()
    per_dim = []
    for dim in range(t.ndim):
        indices = _global_indices(t, dim)
        if len(indices) != local.shape[dim]:
            raise ValueError(
                f"{fqn}: the local shard has {local.shape[dim]} elements on dim {dim} but its "
                f"placements {t.placements} give {len(indices)}; cannot checkpoint it."
            )
        per_dim.append(_runs(indices) if indices else [])
    for box in itertools.product(*per_dim):
        view = local
        for dim, (local_start, _, length) in enumerate(box):
            view = view.narrow(dim, local_start, length)
        yield torch.Size(g for _, g, _ in box), view


def _strided_pieces(state_dict: dict[str, Any]) -> dict[str, dict[torch.Size, torch.Tensor]]:
    return {
        fqn: dict(local_pieces(fqn, obj)) for fqn, obj in state_dict.items() if _is_strided(obj)
    }


class StridedSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that writes a ``StridedShard`` DTensor as one chunk per contiguous
    piece at its true global offsets (DCP writes one block per local tensor, which for a packed
    q|k|v or gate|up shard overlaps the other ranks' blocks and misplaces the data)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._enable_plan_caching = False  # a cached plan would be the unsplit one
        self._pieces: dict[str, dict[torch.Size, torch.Tensor]] = {}

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self._pieces = _strided_pieces(self.state_dict)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if not self._pieces:
            return plan
        items = [item for item in plan.items if item.index.fqn not in self._pieces]
        for fqn, pieces in self._pieces.items():
            t = self.state_dict[fqn]
            properties = TensorProperties.create_from_tensor(t.to_local())
            for offsets, view in pieces.items():
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.size()),
                            properties=properties,
                            size=t.size(),
                        ),
                    )
                )
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        pieces = self._pieces.get(write_item.index.fqn)
        if pieces is not None:
            return pieces[torch.Size(write_item.index.offset)]  # DCP copies a view compactly
        return super().resolve_data(write_item)


_GLOBAL_IN_MESSAGE = re.compile(r"Unsupported global: (?:GLOBAL )?(\S+)")


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor items with ``torch.load(weights_only=True)``
    (torch's uses ``weights_only=False``) and reads ``StridedShard`` DTensors piece by piece, the
    way `StridedSavePlanner` wrote them (or from any other layout: chunks are resharded).

    ``checkpoint_dir`` only names files in errors.
    """

    def __init__(self, *, checkpoint_dir: str | os.PathLike | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checkpoint_dir = checkpoint_dir
        self._pieces: dict[str, dict[torch.Size, torch.Tensor]] = {}

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()  # may switch to pre-2.4 keys: pieces come after
        self._pieces = _strided_pieces(self.state_dict)
        if not self._pieces:
            return plan
        items = [item for item in plan.items if item.dest_index.fqn not in self._pieces]
        for fqn, pieces in self._pieces.items():
            md = self.metadata.state_dict_metadata.get(fqn) if self.metadata else None
            if md is None:
                continue  # not in the checkpoint: the base plan already allowed or refused it
            chunks = [ChunkStorageMetadata(offsets=o, sizes=v.size()) for o, v in pieces.items()]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        pieces = self._pieces.get(index.fqn)
        if pieces is not None:
            return pieces[torch.Size(index.offset)]
        return super().lookup_tensor(index)

    def _file_of(self, read_item: ReadItem) -> str:
        info = (getattr(self.metadata, "storage_data", None) or {}).get(read_item.storage_index)
        name = getattr(info, "relative_path", "?")
        return str(pathlib.Path(self.checkpoint_dir) / name) if self.checkpoint_dir else name

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            match = _GLOBAL_IN_MESSAGE.search(str(exc))
            refused = f"the global {match.group(1)}" if match else "a type outside the allow-list"
            raise UnsafeCheckpointError(
                f"{self._file_of(read_item)}: refused to unpickle the item {fqn!r}: it needs "
                f"{refused}, which torch.load(weights_only=True) does not allow (loading it could "
                "run code). Checkpoint values other than tensors must be plain numbers, strings "
                "and containers of them."
            ) from exc
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
