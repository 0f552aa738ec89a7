"""Embedding styles: the vocabulary split by rows, a table split by columns.

- `VocabParallelStyle`: E[x] = sum_i E_i[x - off_i], each rank looking up only the ids in its
  rows (the others masked to 0), the partial lookups all-reduced (g). Uneven splits are exact.
  A plain ``nn.Embedding`` gets local ids in and its output masked and reduced. Any other
  module (a subclass with its own ``forward``) keeps its ids and gets whole rows back from the
  lookup itself (`_VocabLookup`): T5Gemma-2's embedding writes ``eoi_embedding`` where
  ``input_ids == eoi_token_index`` after the lookup, which on shifted, masked ids matched
  nothing (logits off by 0.4-1.2, no error). Its code after the lookup then runs on the same
  whole rows on every rank, so its own parameters and children need no gradient all-reduce.
- `ColwiseEmbeddingStyle`: E_i = E[:, cols_i], a table with one column per head (T5's relative
  attention bias); its output stays sharded like a column linear's, its integer input needs no f.
- `GatherColumnsEmbeddingStyle`: E_i = E[:, cols_i] for an ``nn.EmbeddingBag`` (a recommender's
  table), its bags reduced per column and the columns all-gathered. Columns rather than rows:
  every reduction of a bag (sum, mean, max) acts on each column alone, so the split is exact in
  all modes, with ``per_sample_weights`` and ``padding_idx``; a row split would be exact for
  ``sum`` only. torch's ``ColwiseParallel`` treats an EmbeddingBag as a linear and would split
  its rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tpkit.parallel.comm import copy_to_tp, reduce_from_tp
from tpkit.plan.layout import chunk_offset, chunk_sizes
from tpkit.styles.base import TPStyle, implements, map_output, replace_first_tensor
from tpkit.styles.linear import ColwiseStyle, GatherOutputStyle

__all__ = ["ColwiseEmbeddingStyle", "GatherColumnsEmbeddingStyle", "VocabParallelStyle"]


@implements
class VocabParallelStyle(TPStyle):
    """See the module docstring; ``padding_idx`` becomes this rank's local row (or None)."""

    name = "vocab_parallel"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._masks: list[torch.Tensor] = []
        self._lookups: list[_VocabLookup] = []

    def _setup(self, module: nn.Module) -> None:
        vocab = module._parameters["weight"].shape[0]
        self.start = chunk_offset(vocab, self.tp, self.rank)
        self.end = self.start + chunk_sizes(vocab, self.tp)[self.rank]
        pad = getattr(module, "padding_idx", None)
        self.global_padding_idx = pad
        if pad is not None:
            module.padding_idx = pad - self.start if self.start <= pad < self.end else None
        self.local_padding_idx = getattr(module, "padding_idx", None)
        # nn.Embedding.forward is the lookup alone; any other forward may read its ids or
        # change the rows after the lookup, so the lookup itself is made vocab-parallel
        self.intercept = type(module).forward is not nn.Embedding.forward

    def _prepare_input(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.intercept:
            lookup = _VocabLookup(self, module)
            self._lookups.append(lookup)
            lookup.__enter__()
            return args, kwargs

        def local_ids(ids: torch.Tensor) -> torch.Tensor:
            self._masks.append(self._outside(ids))
            return (ids - self.start).masked_fill(self._masks[-1], 0)

        return replace_first_tensor(args, kwargs, local_ids)

    def _prepare_output(self, module: nn.Module, output: Any) -> Any:
        if self.intercept:
            lookup = self._lookups.pop()
            lookup.__exit__(None, None, None)
            if not lookup.calls and not lookup.refused and output is not None:
                raise self.refusal(module, "never called F.embedding on its weight")
            return output
        outside = self._masks.pop()

        def reduce(y: torch.Tensor) -> torch.Tensor:
            return reduce_from_tp(y.masked_fill(outside.unsqueeze(-1), 0), self.group)

        return map_output(output, reduce)

    def refusal(self, module: nn.Module | None, what: str) -> RuntimeError:
        """The error for a forward whose use of the weight the split cannot follow: raised on
        every rank alike, since every rank runs the same code on the same ids."""
        name = self.module_name or type(module).__name__
        return RuntimeError(
            f"tpkit: {name} ({type(module).__name__}) is split by vocabulary ('vocab_parallel') "
            f"but its forward {what}: each rank holds {self.end - self.start} of its rows, and "
            "only an F.embedding lookup of the weight is made to see them all. Keep it whole "
            f"with plan={{'{name}': 'replicate'}}."
        )

    def _outside(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids < self.start) | (ids >= self.end)

    def lookup(
        self, ids: torch.Tensor, weight: torch.Tensor, max_norm, norm_type, scale_grad, sparse
    ) -> torch.Tensor:
        """The whole rows of the global ``ids``: this rank's rows looked up in its local
        ``weight`` (the others masked to 0), summed over the group (g)."""
        outside = self._outside(ids)
        local = (ids - self.start).masked_fill(outside, 0)
        pad = self.local_padding_idx
        rows = F.embedding(local, weight, pad, max_norm, norm_type, scale_grad, sparse)
        return reduce_from_tp(rows.masked_fill(outside.unsqueeze(-1), 0), self.group)


class _VocabLookup(TorchFunctionMode):
    """Active for the span of a vocab-parallel module's own ``forward``: its
    ``F.embedding(ids, weight, ...)`` on this rank's local ``weight`` becomes the group's
    lookup of the global ids (`VocabParallelStyle.lookup`); any other op on the local weight
    (indexing it, ``weight.size(0)``, scaling it before the lookup) would read the rank's rows
    as the whole table and is refused; reading its dtype or device is fine."""

    def __init__(self, style: VocabParallelStyle, module: nn.Module) -> None:
        super().__init__()
        self.style, self.module, self.calls, self.refused = style, module, 0, False
        self.weight = module._parameters["weight"]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding:
            bound = _bind_embedding(args, kwargs)
            if bound["weight"] is self.weight:
                self.calls += 1
                return self.style.lookup(
                    bound["input"],
                    bound["weight"],
                    bound["max_norm"],
                    bound["norm_type"],
                    bound["scale_grad_by_freq"],
                    bound["sparse"],
                )
        elif getattr(func, "__name__", "") != "__get__" and any(
            a is self.weight for a in (*args, *kwargs.values())
        ):
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
            self.refused = True
            raise self.style.refusal(self.module, f"calls {name} on its weight")
        return func(*args, **kwargs)


_EMBEDDING_ARGS = (
    ("input", None),
    ("weight", None),
    ("padding_idx", None),
    ("max_norm", None),
    ("norm_type", 2.0),
    ("scale_grad_by_freq", False),
    ("sparse", False),
)


def _bind_embedding(args: tuple, kwargs: dict) -> dict[str, Any]:
    """``F.embedding``'s arguments by name (positional or keyword, defaults filled)."""
    out = dict(_EMBEDDING_ARGS)
    out.update(zip((n for n, _ in _EMBEDDING_ARGS), args))
    out.update(kwargs)
    return out


@implements
class ColwiseEmbeddingStyle(ColwiseStyle):
    """See the module docstring."""

    name = "colwise_embedding"


@implements
class GatherColumnsEmbeddingStyle(GatherOutputStyle):
    """See the module docstring. The ids need no f; float inputs (``per_sample_weights``) get
    it, since each rank's gradient for them covers only its columns."""

    name = "colwise_embedding_gather"

    def _prepare_input(self, module: nn.Module, args: tuple, kwargs: dict):
        if not torch.is_grad_enabled():
            return args, kwargs

        def f(x: Any) -> Any:
            floating = isinstance(x, torch.Tensor) and x.is_floating_point()
            return copy_to_tp(x, self.group) if floating and x.requires_grad else x

        return tuple(f(a) for a in args), {k: f(v) for k, v in kwargs.items()}
