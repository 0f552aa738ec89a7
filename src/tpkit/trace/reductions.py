"""Which dims a torch call reads across: reductions, normalisations, selections, scans and
Python-side reads of values.

On split features each rank would compute such an op on its own part of the features: a wrong
number with no error. The trace (`tpkit.trace.trace`) asks `reduced_dims` of every call on a
linear's output, and a pair whose features are read across runs in the gathered form
(`tpkit.settle.gathered`). Per-head ops after the reshape to heads read whole heads, which a rank
holds, so they are left alone by the trace, not here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["REDUCTIONS", "reduced_dims"]


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


_ALL = "all"
#: ops whose result at one feature reads other features of the same row: reductions (mean,
#: var/std, norms, logsumexp, sum/prod/amax/amin/any/all, count_nonzero), normalisations over a
#: dim (softmax, log_softmax, F.normalize, layer/RMS/group norm), selections (top-k, sort,
#: max/min/argmax/argmin, median, quantile, kthvalue, mode, unique, nonzero), scans (cumsum,
#: cumprod, ...), index reads (gather, index_select, take_along_dim), features moved or paired
#: (flip, roll, diff, glu), and Python-side reads of values (``.item()``, ``.tolist()``, ``bool``).
#: op name -> (position of its dim argument or None, the dims it reduces without one: `_ALL`, a
#: dim, a tuple of dims, or "softmax" for F.softmax's implicit dim). On split features each
#: rank would compute them on its own part: a wrong number, no error.
REDUCTIONS: dict[str, tuple[int | None, Any]] = {
    **dict.fromkeys(
        ("sum", "nansum", "mean", "nanmean", "prod", "amax", "amin", "max", "min"), (1, _ALL)
    ),
    **dict.fromkeys(("argmax", "argmin", "std", "var", "std_mean", "var_mean"), (1, _ALL)),
    **dict.fromkeys(("logsumexp", "any", "all", "count_nonzero", "median", "nanmedian"), (1, _ALL)),
    **dict.fromkeys(("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"), (1, _ALL)),
    **dict.fromkeys(("quantile", "nanquantile", "norm", "linalg_vector_norm"), (2, _ALL)),
    **dict.fromkeys(("linalg_norm", "roll", "take_along_dim"), (2, _ALL)),
    **dict.fromkeys(("softmax", "log_softmax", "softmin"), (1, "softmax")),
    **dict.fromkeys(("sort", "argsort", "mode", "glu"), (1, -1)),
    **dict.fromkeys(("topk", "kthvalue", "diff"), (2, -1)),
    **dict.fromkeys(("flip", "gather", "index_select"), (1, _ALL)),
    **dict.fromkeys(
        ("aminmax", "unique", "unique_consecutive", "nonzero", "argwhere"), (None, _ALL)
    ),
    **dict.fromkeys(("bincount", "histc", "item", "tolist", "numpy"), (None, _ALL)),
    **dict.fromkeys(("__bool__", "__int__", "__float__", "__index__"), (None, _ALL)),
    "linalg_matrix_norm": (2, (-2, -1)),
    "normalize": (2, 1),
    "gumbel_softmax": (4, -1),
    "msort": (None, 0),
    "flipud": (None, 0),
    "fliplr": (None, 1),
    "renorm": (2, "renorm"),  # every dim but ``dim`` (each slice along it renormalised)
    "layer_norm": (1, "normalized_shape"),
    "rms_norm": (1, "normalized_shape"),
    "group_norm": (None, "channels"),  # channels (dim 1) and everything after
    "instance_norm": (None, "spatial"),  # everything after the channels
}
_DIM_KWARGS = ("dim", "axis", "dims", "normalized_shape")


def reduced_dims(name: str, args: tuple, kwargs: Mapping, ndim: int) -> set[int] | None:
    """The dims of ``args[0]`` (``ndim`` dims) that the call ``name(*args, **kwargs)`` reads
    across (see `REDUCTIONS`); None when it is no such op, or a binary elementwise form of one
    (``torch.max(a, b)``, ``sum`` of two tensors is not)."""
    if name not in REDUCTIONS:
        return None
    pos, default = REDUCTIONS[name]
    dim = next((kwargs[k] for k in _DIM_KWARGS if kwargs.get(k) is not None), None)
    if dim is None and pos is not None and len(args) > pos:
        dim = args[pos]
    if isinstance(dim, torch.Tensor):
        return None  # torch.max(a, b): elementwise
    if isinstance(dim, bool) or not isinstance(dim, (int, tuple, list, torch.Size)):
        dim = None  # torch.std(x, unbiased): legacy form, every dim
    everything = set(range(ndim))
    if default == "normalized_shape":
        n = 1 if isinstance(dim, int) else len(dim) if dim is not None else ndim
        return set(range(ndim - n, ndim))
    if default == "renorm":
        return everything - {_norm_dim(int(dim), ndim)} if dim is not None else everything
    if default in ("channels", "spatial"):
        return set(range(1 if default == "channels" else 2, ndim))
    if dim is None:
        if default == _ALL:
            return everything
        dim = (0 if ndim in (0, 1, 3) else 1) if default == "softmax" else default
    dims = dim if isinstance(dim, (tuple, list, torch.Size)) else (dim,)
    if not dims and name in ("amax", "amin", "sum", "mean", "nansum", "nanmean"):
        return everything  # amax(x, dim=()) reduces every dim
    return {_norm_dim(int(d), max(ndim, 1)) for d in dims}
