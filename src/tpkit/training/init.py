"""Random initialisation of split parameters draws the unsharded values.

The from-scratch flow (build on meta, split, ``to_empty``, then ``model.init_weights()``,
``model.apply(model._init_weights)``, ``nn.init.*`` or a module's ``reset_parameters``) fills
DTensor parameters with in-place random ops (``normal_``, ``uniform_``, ...). torch runs such an
op on each rank's local shard: on CPU from that rank's own generator, which tpkit syncs across
the TP group, so every shard gets the *same* numbers (twin neurons: all 16 split weights of a
tiny Llama, vocabulary 100, had identical halves at tp=2), and after an uneven split (vocabulary
101: 51 and 50 rows) the ranks' generators part ways, so replicated dropout masks differ too; on
CUDA torch's offset-based tracker gives shards distinct numbers, but not the unsharded model's,
and leaves the generator at another state than the unsharded draw.

Here an in-place random op on a DTensor of a mesh tpkit uses draws the whole (global) tensor on
the local device with the caller's generator, exactly as the unsharded model would, and copies
this rank's part into the local shard. So under the same seed every shard holds exactly its
slice of what the unsharded model draws (uneven ``Shard``, ``Replicate``, the strided parts of
packed q|k|v and of FSDP2 over a TP split), on CPU and CUDA alike, and the generator ends where
the unsharded run's does (the next draw, dropout or the next parameter, matches too). The cost
is one whole tensor at a time, freed after the copy: what initialising it unsharded costs.

Scope: DTensors whose mesh (or that mesh's root) is one tpkit built or was given
(`register_mesh`, called by ``tensor_parallel``); a DTensor of any other mesh, a ``Partial``
one, one on meta, or an op with a tensor argument (``bernoulli_(p_tensor)``) gets torch's own
behaviour unchanged. On the same meshes ``item()`` / ``bool()`` of a ``Partial`` DTensor
returns the reduced value, not the local summand (`_scalar_read`: ``trunc_normal_``'s rejection
loop asks ``mask.any()``). Ranks must start from the same generator state (tpkit's rule: every rank
seeds alike; ``tensor_parallel`` syncs the TP group), as for the unsharded draw to exist at all.

torch has no public hook for this: the handler goes into the DTensor dispatcher's custom-op
table (`tpkit.compat.dtensor_op_handlers`); torch's own handler tables (loss parallelism,
context parallelism) use the same one. Functions built on the in-place ops (``trunc_normal_``,
``kaiming_*``, ``xavier_*``, ``nn.Linear.reset_parameters``) follow. ``orthogonal_`` and
``sparse_`` work on the whole matrix with ops DTensor refuses (torch raises, nothing silent):
`init_unsharded` runs any such init on the whole tensor and keeps this rank's part.

Not a matter of draws, so not covered: torch's ``to_empty`` unties an unsharded model's tied
meta parameters (transformers' ``init_weights`` re-ties them after drawing both) but keeps a
tie between DTensors, so a tied embedding / head holds the head's draw when split and the
embedding's unsharded; and an in-place fill of an indexed row of a split dimension
(``weight[padding_idx].zero_()``) writes a gathered copy, not the shard.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from tpkit.compat import dtensor_op_handlers, root_mesh

__all__ = [
    "MESH_FLAG",
    "RANDOM_INPLACE_OPS",
    "init_unsharded",
    "install_random_init",
    "is_registered_mesh",
    "register_mesh",
]

_aten = torch.ops.aten

#: the in-place random fills ``torch.nn.init`` and ``Tensor.*_`` reach (tensor-valued
#: parameters, ``bernoulli_.Tensor``, fall through to torch: see the module docstring)
RANDOM_INPLACE_OPS = (
    _aten.normal_.default,
    _aten.uniform_.default,
    _aten.bernoulli_.float,
    _aten.bernoulli_.Tensor,
    _aten.exponential_.default,
    _aten.geometric_.default,
    _aten.log_normal_.default,
    _aten.cauchy_.default,
    _aten.random_.default,
    getattr(_aten.random_, "from"),  # "from" is a Python keyword
    _aten.random_.to,
)

#: what ``item()`` and ``bool()`` of a tensor reach (see `_scalar_read`)
_SCALAR_READ = _aten._local_scalar_dense.default

#: The mark `register_mesh` puts on a mesh (and its root): a flag on the object, so it lives and
#: dies with the mesh and no registry of meshes is kept here.
MESH_FLAG = "_tpkit_random_init"
# Serialises the rare fall-through to torch's own handling (the handler is out of the table
# for its duration). Module-wide because the table it guards is: torch's dispatcher has one.
_FALLTHROUGH = threading.RLock()


def register_mesh(mesh: DeviceMesh) -> None:
    """Treat DTensors of ``mesh``, its sub-meshes and whatever FSDP2 derives from it, as tpkit's:
    their random fills draw the unsharded values."""
    for m in (mesh, root_mesh(mesh)):
        setattr(m, MESH_FLAG, True)


def is_registered_mesh(mesh: DeviceMesh) -> bool:
    """Whether `register_mesh` covers ``mesh`` (it, or its root, was registered)."""
    return any(getattr(m, MESH_FLAG, False) is True for m in (mesh, root_mesh(mesh)))


def install_random_init(mesh: DeviceMesh) -> None:
    """Register ``mesh`` and make sure the handler is in the DTensor dispatcher (idempotent:
    ``tensor_parallel`` calls it on every split)."""
    register_mesh(mesh)
    table = dtensor_op_handlers()
    for op in RANDOM_INPLACE_OPS:
        if table.get(op) is not _random_fill:
            table[op] = _random_fill
    if table.get(_SCALAR_READ) is not _scalar_read:
        table[_SCALAR_READ] = _scalar_read


def _random_fill(op: Callable[..., Any], args: tuple, kwargs: dict) -> object:
    """DTensor handler for one in-place random op: the whole tensor drawn, this rank's part
    kept (see the module docstring)."""
    target = args[0]
    if not _ours(target, args[1:], kwargs):
        return _torch_default(op, args, kwargs)
    local = target._local_tensor
    if all(p.is_replicate() for p in target.placements):
        op(local, *args[1:], **kwargs)  # the local tensor is the whole one: draw in place
        return target
    whole = _whole_like(target)
    op(whole, *args[1:], **kwargs)
    _keep_part(target, whole)
    return target


def init_unsharded(
    tensor: torch.Tensor, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> torch.Tensor:
    """``fn(tensor, *args, **kwargs)`` as on the unsharded tensor, for an init the handler
    cannot follow op by op: ``nn.init.orthogonal_`` (a QR of the whole matrix) and
    ``nn.init.sparse_`` raise torch's errors on a split parameter. The whole tensor is built on
    this rank's device, ``fn`` runs on it and this rank's part is kept: exact, one whole tensor
    at a time. Every rank of the mesh must call it alike (they draw the same numbers); a plain
    tensor is passed to ``fn`` as it is. Returns ``tensor``."""
    if not isinstance(tensor, DTensor):
        fn(tensor, *args, **kwargs)
        return tensor
    if any(p.is_partial() for p in tensor.placements):
        raise ValueError(
            f"init_unsharded: a {tuple(tensor.shape)} DTensor with placements "
            f"{tensor.placements} holds partial sums, not values; initialise a Shard or "
            "Replicate tensor."
        )
    if tensor._local_tensor.is_meta:
        return tensor
    whole = _whole_like(tensor)
    with torch.no_grad():
        fn(whole, *args, **kwargs)
        _keep_part(tensor, whole)
    return tensor


def _whole_like(target: DTensor) -> torch.Tensor:
    """An empty tensor shaped like ``target``'s global tensor, with its (dense) global strides,
    so an op fills it in the order the unsharded tensor would be filled."""
    local = target._local_tensor
    shape, stride = tuple(target.shape), tuple(target.stride())
    if _dense(shape, stride):
        return torch.empty_strided(shape, stride, dtype=local.dtype, device=local.device)
    return torch.empty(shape, dtype=local.dtype, device=local.device)


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` lays ``shape`` out densely without overlap (a permuted contiguous)."""
    expected = 1
    for size, step in sorted(zip(shape, stride, strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if step != expected:
            return False
        expected *= size
    return True


def _keep_part(target: DTensor, whole: torch.Tensor) -> None:
    """Copy this rank's part of ``whole`` into ``target``'s local shard."""
    local = target._local_tensor
    piece = distribute_tensor(
        whole, target.device_mesh, target.placements, src_data_rank=None
    )._local_tensor
    if piece.shape != local.shape:  # a layout distribute_tensor does not reproduce: never guess
        raise RuntimeError(
            f"tpkit random init: a {tuple(target.shape)} DTensor with placements "
            f"{target.placements} holds a {tuple(local.shape)} local shard, but slicing the "
            f"whole tensor gives {tuple(piece.shape)}; its layout is not torch's standard one. "
            "Initialise it before splitting, or load its values from a checkpoint."
        )
    local.copy_(piece)


def _scalar_read(op: Callable[..., Any], args: tuple, kwargs: dict) -> object:
    """``item()`` / ``bool()`` of a ``Partial`` DTensor of a registered mesh: the reduced value.

    torch reads the local summand (its sharding propagation skips ``_local_scalar_dense``), so
    ``if not mask.any():`` on a sharded mask branches differently per rank: the rejection loops
    of ``nn.init.trunc_normal_`` then draw a different number of times on each rank and every
    later draw diverges. Every rank reaches such a read at the same point (SPMD code), so the
    all-reduce it now costs is matched; a read on some ranks only ends in tpkit's timeout
    report instead of a wrong number."""
    target = args[0]
    if (
        isinstance(target, DTensor)
        and is_registered_mesh(target.device_mesh)
        and any(p.is_partial() for p in target.placements)
    ):
        return op(target.full_tensor(), *args[1:], **kwargs)
    return _torch_default(op, args, kwargs)


def _ours(target: Any, rest: tuple, kwargs: dict) -> bool:
    """A DTensor of a registered mesh, with real memory, no Partial placement and only
    non-tensor arguments besides itself."""
    if not isinstance(target, DTensor) or not is_registered_mesh(target.device_mesh):
        return False
    if target._local_tensor.is_meta or any(p.is_partial() for p in target.placements):
        return False
    return not any(isinstance(a, torch.Tensor) for a in (*rest, *kwargs.values()))


def _torch_default(op: Callable[..., Any], args: tuple, kwargs: dict) -> object:
    """torch's own handling of ``op``: dispatched again with this handler out of the table."""
    table = dtensor_op_handlers()
    with _FALLTHROUGH:
        mine = table.pop(op, None)
        try:
            return op(*args, **kwargs)
        finally:
            if mine is not None:
                table[op] = mine
