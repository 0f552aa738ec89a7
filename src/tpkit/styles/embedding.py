"""Embedding styles: the vocabulary split by rows, a table split by columns.

- `VocabParallelStyle`: E[x] = sum_i E_i[x - off_i], each rank looking up only the ids in its
  rows (the others masked to 0), the partial lookups all-reduced (g). Uneven splits are exact.
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
from torch import nn

from tpkit.comm import copy_to_tp, reduce_from_tp
from tpkit.plan.layout import chunk_offset, chunk_sizes
from tpkit.styles.base import TPStyle, map_output, replace_first_tensor
from tpkit.styles.linear import ColwiseStyle, GatherOutputStyle

__all__ = ["ColwiseEmbeddingStyle", "GatherColumnsEmbeddingStyle", "VocabParallelStyle"]


class VocabParallelStyle(TPStyle):
    """See the module docstring; ``padding_idx`` becomes this rank's local row (or None)."""

    name = "vocab_parallel"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._masks: list[torch.Tensor] = []

    def _setup(self, module: nn.Module) -> None:
        vocab = module._parameters["weight"].shape[0]
        self.start = chunk_offset(vocab, self.tp, self.rank)
        self.end = self.start + chunk_sizes(vocab, self.tp)[self.rank]
        pad = getattr(module, "padding_idx", None)
        self.global_padding_idx = pad
        if pad is not None:
            module.padding_idx = pad - self.start if self.start <= pad < self.end else None

    def _prepare_input(self, module: nn.Module, args: tuple, kwargs: dict):
        def local_ids(ids: torch.Tensor) -> torch.Tensor:
            outside = (ids < self.start) | (ids >= self.end)
            self._masks.append(outside)
            return (ids - self.start).masked_fill(outside, 0)

        return replace_first_tensor(args, kwargs, local_ids)

    def _prepare_output(self, module: nn.Module, output: Any) -> Any:
        outside = self._masks.pop()

        def reduce(y: torch.Tensor) -> torch.Tensor:
            return reduce_from_tp(y.masked_fill(outside.unsqueeze(-1), 0), self.group)

        return map_output(output, reduce)


class ColwiseEmbeddingStyle(ColwiseStyle):
    """See the module docstring."""

    name = "colwise_embedding"


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
