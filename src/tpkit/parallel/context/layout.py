"""Which part of a sequence each context-parallel rank holds, and how the parts go back together.

Causal attention costs a query in proportion to its position, so equal contiguous chunks would
give the last rank most of the work. Zigzag (torch's and Megatron's load balancer) cuts the
sequence into 2·cp chunks and gives rank r chunks r and 2·cp−1−r: every rank then holds one early
and one late chunk and does the same work. Bidirectional attention is balanced anyway; those models
get cp contiguous chunks (rank r holds chunk r).

Everything here is pure index arithmetic on one `Layout`; the collectives that use it live in
`tpkit.parallel.context.attention` and `tpkit.parallel.context.ring`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["Layout", "check_length"]


def check_length(length: int, cp: int, zigzag: bool) -> None:
    """A sequence of ``length`` tokens splits into ``2·cp`` (zigzag) or ``cp`` equal chunks, or
    this raises the ValueError that names the padding that makes it split."""
    parts = 2 * cp if zigzag else cp
    if length % parts:
        kind = "2 x cp_size zigzag chunks (causal load balance)" if zigzag else "cp_size chunks"
        raise ValueError(
            f"context parallelism: a sequence of {length} tokens does not split into {parts} "
            f"equal parts ({kind}, cp_size={cp}); pad the batch to a multiple of {parts} "
            f"(e.g. pad_to_multiple_of={parts} in the tokenizer or data collator)."
        )


@dataclass(frozen=True)
class Layout:
    """``length`` tokens over ``cp`` ranks; this rank is ``rank``.

    ``chunks_of(r)`` are the chunk indices rank r holds, in the order its local tensor holds them.
    """

    cp: int
    rank: int
    length: int
    zigzag: bool

    def __post_init__(self) -> None:
        check_length(self.length, self.cp, self.zigzag)

    @property
    def n_chunks(self) -> int:
        return 2 * self.cp if self.zigzag else self.cp

    @property
    def chunk(self) -> int:
        return self.length // self.n_chunks

    @property
    def local_length(self) -> int:
        return self.length // self.cp

    def chunks_of(self, r: int) -> tuple[int, ...]:
        return (r, 2 * self.cp - 1 - r) if self.zigzag else (r,)

    @cached_property
    def local_index(self) -> torch.Tensor:
        """The global position of each of this rank's tokens ([local_length], int64)."""
        return self.index_of(self.rank)

    def index_of(self, r: int) -> torch.Tensor:
        c = self.chunk
        return torch.cat([torch.arange(i * c, (i + 1) * c) for i in self.chunks_of(r)])

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a whole-sequence tensor (its chunks, concatenated)."""
        return self.part_of(x, self.rank, dim)

    def part_of(self, x: torch.Tensor, r: int, dim: int = 1) -> torch.Tensor:
        c = self.chunk
        parts = [x.narrow(dim, i * c, c) for i in self.chunks_of(r)]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim)

    def natural(self, parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The whole sequence, in order, from every rank's local part (``parts[r]`` from rank r)."""
        by_chunk: dict[int, torch.Tensor] = {}
        for r, part in enumerate(parts):
            for k, i in enumerate(self.chunks_of(r)):
                by_chunk[i] = part.narrow(dim, k * self.chunk, self.chunk)
        return torch.cat([by_chunk[i] for i in range(self.n_chunks)], dim)

    def rank_major(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """A whole-sequence tensor reordered so that rank r's part is the r-th equal slice (what a
        reduce-scatter along ``dim`` hands out)."""
        return torch.cat([self.part_of(x, r, dim) for r in range(self.cp)], dim)
