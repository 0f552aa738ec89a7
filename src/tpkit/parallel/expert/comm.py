"""Expert-parallel collectives: each routed (token, expert) pair to the expert's rank and back.

Routed experts are called as ``experts(hidden [T, H], index [T, K], weights [T, K])`` and return
``sum_k weights[t, k] * E_index[t, k](hidden[t])`` per token. With whole experts placed on the
ranks of an expert-parallel (EP) group, a pair is computed where its expert lives:

- `AllToAllDispatch`: each pair is sent to its expert's rank (counts exchanged first: variable
  sizes, no capacity, nothing dropped), computed there with its routing weight, sent back and
  summed per token over its K pairs, as the unsharded experts sum them. Ranks of a batch group
  (ranks that hold the same tokens: a TP group) each send a disjoint slice of the rows, and the
  per-token results are gathered back over the batch group.
- `AllReduceDispatch`: where every rank of the EP group holds the same tokens, each rank computes
  only the pairs of its own experts, and one all-reduce sums the per-token partial outputs (f on
  the inputs, g on the output: Megatron's pair). No tokens move and no count is read back.

Experts that take their rows already grouped by expert (``sizes[e]`` rows of expert e: JetMoE's
grouped linears, Llama-4's experts run on every token, E equal blocks) go the same way in
blocks: `GroupedAllToAll` (each expert's rows to its rank) or, on a shared batch,
`GroupedAllGather` (each rank runs its experts' rows, one all-gather joins them).

All are autograd-exact: every collective here has its backward stated (the reverse all-to-all,
the all-gather of row gradients, the all-reduce of partial input gradients). A rank that receives
no pair still takes part in every collective, forward and backward (the caller keeps it in the
graph with one dummy row: `tpkit.styles.expert`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tpkit.parallel.comm import all_gather_parts, copy_to_tp, reduce_from_tp

__all__ = [
    "AllReduceDispatch",
    "AllToAllDispatch",
    "Dispatched",
    "ExpertPlacement",
    "GroupedAllGather",
    "GroupedAllToAll",
    "all_to_all",
    "gather_rows",
    "slice_rows",
]


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts each rank of an EP group holds: torch.chunk sizes of ``num_experts`` over
    ``ep`` ranks (DTensor's ``Shard(0)``), so the placement and the weights' layout agree.
    Rank r holds experts ``[offsets[r], offsets[r] + sizes[r])``."""

    num_experts: int
    ep: int

    @property
    def sizes(self) -> list[int]:
        chunk = -(-self.num_experts // self.ep)
        return [max(0, min(chunk, self.num_experts - r * chunk)) for r in range(self.ep)]

    @property
    def offsets(self) -> list[int]:
        sizes = self.sizes
        return [sum(sizes[:r]) for r in range(self.ep)]

    def local(self, rank: int) -> range:
        """The global ids of the experts rank ``rank`` holds."""
        return range(self.offsets[rank], self.offsets[rank] + self.sizes[rank])

    def owner(self, device: torch.device | None = None) -> torch.Tensor:
        """Expert id -> the rank holding it."""
        return torch.repeat_interleave(torch.arange(self.ep), torch.tensor(self.sizes)).to(device)

    def local_id(self, device: torch.device | None = None) -> torch.Tensor:
        """Expert id -> its index among its rank's experts."""
        offsets = torch.tensor(self.offsets)
        return (torch.arange(self.num_experts) - offsets[self.owner()]).to(device)


class _AllToAll(torch.autograd.Function):
    """Rows exchanged with variable counts; backward: the same exchange reversed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group):
        ctx.sizes, ctx.group = (out_sizes, in_sizes), group
        out = x.new_empty((sum(out_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_sizes, in_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        out_sizes, in_sizes = ctx.sizes
        back = grad.new_empty((sum(in_sizes), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_sizes, out_sizes, group=ctx.group)
        return back, None, None, None


def all_to_all(
    x: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: ProcessGroup
) -> torch.Tensor:
    """Send ``in_sizes[r]`` rows of ``x`` (in rank order) to rank r; receive ``out_sizes[r]``
    from each. Differentiable: its backward sends each row's gradient back where it came from."""
    return _AllToAll.apply(x, out_sizes, in_sizes, group)


def _row_bounds(rows: int, parts: int, rank: int) -> tuple[int, int]:
    chunk = -(-rows // parts) if rows else 0
    lo = min(rows, rank * chunk)
    return lo, min(rows, lo + chunk)


def _gather_all_rows(x: torch.Tensor, rows: int, parts: int, group: ProcessGroup) -> torch.Tensor:
    """Every rank's torch.chunk slice of ``rows`` rows, joined in rank order (padded to one
    size for the all-gather, the padding dropped)."""
    chunk = -(-rows // parts) if rows else 0
    pad = x.new_zeros((chunk, *x.shape[1:]))
    pad[: x.shape[0]] = x
    got = all_gather_parts(pad.contiguous(), group)
    return torch.cat([g[: hi - lo] for g, (lo, hi) in zip(got, _bounds(rows, parts))])


def _bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    return [_row_bounds(rows, parts, r) for r in range(parts)]


class _SliceRows(torch.autograd.Function):
    """This rank's rows of a tensor its batch group holds alike; backward: every rank's row
    gradients gathered, so the whole (replicated) input gets its whole gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, parts: int, rank: int, group):
        ctx.rows, ctx.parts, ctx.group = x.shape[0], parts, group
        lo, hi = _row_bounds(x.shape[0], parts, rank)
        return x[lo:hi].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _gather_all_rows(grad, ctx.rows, ctx.parts, ctx.group), None, None, None


class _GatherRows(torch.autograd.Function):
    """Every rank's rows joined; backward: this rank's rows of the (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: int, parts: int, rank: int, group):
        ctx.bounds = _row_bounds(rows, parts, rank)
        return _gather_all_rows(x, rows, parts, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        lo, hi = ctx.bounds
        return grad[lo:hi].contiguous(), None, None, None, None


def slice_rows(x: torch.Tensor, parts: int, rank: int, group: ProcessGroup) -> torch.Tensor:
    """Rank ``rank``'s torch.chunk slice of ``x``'s rows (see `_SliceRows`)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _SliceRows.apply(x, parts, rank, group)
    lo, hi = _row_bounds(x.shape[0], parts, rank)
    return x[lo:hi]


def gather_rows(
    x: torch.Tensor, rows: int, parts: int, rank: int, group: ProcessGroup
) -> torch.Tensor:
    """The ``rows`` rows whose torch.chunk slices the ranks hold, joined (see `_GatherRows`)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _GatherRows.apply(x, rows, parts, rank, group)
    return _gather_all_rows(x, rows, parts, group)


@dataclass
class Dispatched:
    """The pairs this rank's experts run on, and what `combine` needs to bring results back:
    ``tokens [R, H]``, ``index [R, 1]`` (local expert ids), ``weights [R, 1]``."""

    tokens: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor
    state: tuple


class AllToAllDispatch:
    """Pairs to their experts' ranks by all-to-all (see the module docstring). ``batch``: the
    group of ranks holding the same tokens (None: this rank alone), whose members each send a
    torch.chunk slice of the rows. One host sync per call: the exchanged counts."""

    name = "all_to_all"

    def __init__(
        self,
        placement: ExpertPlacement,
        group: ProcessGroup,
        rank: int,
        batch: tuple[ProcessGroup, int, int] | None = None,
    ) -> None:
        self.placement, self.group, self.rank, self.batch = placement, group, rank, batch
        self.owner = placement.owner()
        self.local_id = placement.local_id()
        self.width = max(placement.sizes)

    def dispatch(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor):
        rows = hidden.shape[0]
        if self.batch is not None:
            group, parts, rank = self.batch
            hidden, weights = (slice_rows(t, parts, rank, group) for t in (hidden, weights))
            index = index[slice(*_row_bounds(rows, parts, rank))]
        top_k = index.shape[1]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert: by owner, then local id
        ids = flat[order]
        ep, width = self.placement.ep, self.width
        slots = self.owner.to(ids.device)[ids] * width + self.local_id.to(ids.device)[ids]
        send = torch.zeros(ep * width, dtype=torch.long, device=ids.device)
        send.index_add_(0, slots, torch.ones_like(slots))
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_sizes, recv_sizes = torch.stack(
            [send.view(ep, width).sum(1), recv.view(ep, width).sum(1)]
        ).tolist()
        tokens = hidden[order // top_k]
        w = weights.reshape(-1)[order].unsqueeze(-1)
        if w.dtype == tokens.dtype:  # one exchange for both
            got = all_to_all(torch.cat([tokens, w], -1), recv_sizes, send_sizes, self.group)
            got_tokens, got_w = got[:, :-1], got[:, -1:]
        else:
            got_tokens = all_to_all(tokens, recv_sizes, send_sizes, self.group)
            got_w = all_to_all(w, recv_sizes, send_sizes, self.group)
        local = torch.arange(width, device=ids.device).repeat(ep)
        local = local.repeat_interleave(recv, output_size=sum(recv_sizes)).unsqueeze(-1)
        state = (order, top_k, send_sizes, recv_sizes, rows)
        return Dispatched(got_tokens, local, got_w, state)

    def combine(self, out: torch.Tensor, d: Dispatched) -> torch.Tensor:
        """The weighted pair outputs back to their tokens' ranks, summed over each token's K
        pairs (as the unsharded experts sum them: ``view(T, K, H).sum(1)``)."""
        order, top_k, send_sizes, recv_sizes, rows = d.state
        back = all_to_all(out, send_sizes, recv_sizes, self.group)
        pairs = back[torch.argsort(order)]
        y = pairs.view(-1, top_k, out.shape[-1]).sum(1)
        if self.batch is not None:
            group, parts, rank = self.batch
            y = gather_rows(y, rows, parts, rank, group)
        return y


class AllReduceDispatch:
    """Every rank of the EP group holds the same tokens: each computes the pairs of its own
    experts, one all-reduce sums the partial per-token outputs. f on the inputs sums their
    partial gradients (each rank backpropagates through its own experts only)."""

    name = "all_reduce"

    def __init__(self, placement: ExpertPlacement, group: ProcessGroup, rank: int) -> None:
        self.placement, self.group, self.rank = placement, group, rank
        self.owner = placement.owner()
        self.local_id = placement.local_id()

    def dispatch(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor):
        hidden, weights = copy_to_tp(hidden, self.group), copy_to_tp(weights, self.group)
        mine = self.owner.to(index.device)[index] == self.rank
        tok, k = mine.nonzero(as_tuple=True)
        local = self.local_id.to(index.device)[index[tok, k]].unsqueeze(-1)
        return Dispatched(hidden[tok], local, weights[tok, k].unsqueeze(-1), (tok, index.shape[0]))

    def combine(self, out: torch.Tensor, d: Dispatched) -> torch.Tensor:
        """Each token's pairs added in k order (``nonzero`` lists them by token, then k), as
        the unsharded experts sum them; then the ranks' partial sums."""
        tok, rows = d.state
        partial = out.new_zeros((rows, out.shape[-1])).index_add(0, tok, out)
        return reduce_from_tp(partial, self.group)


def _gather_blocks(x: torch.Tensor, sizes: list[int], group: ProcessGroup) -> torch.Tensor:
    pad = x.new_zeros((max(sizes), *x.shape[1:]))
    pad[: x.shape[0]] = x
    got = all_gather_parts(pad.contiguous(), group)
    return torch.cat([g[:n] for g, n in zip(got, sizes)])


class _GatherBlocks(torch.autograd.Function):
    """Each rank's block of rows joined in rank order (blocks of any size, given); backward:
    this rank's block of the (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sizes: list[int], rank: int, group):
        ctx.lo, ctx.hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
        return _gather_blocks(x, sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad[ctx.lo : ctx.hi].contiguous(), None, None, None


class GroupedAllGather:
    """Rows grouped by expert (``sizes[e]`` rows of expert e, in expert order), the same on
    every rank of the EP group: each rank runs its experts' rows, one all-gather joins the
    blocks. f on the input: each rank's gradient covers its rows only, summed over the group."""

    name = "all_gather"

    def __init__(self, placement: ExpertPlacement, group: ProcessGroup, rank: int) -> None:
        self.placement, self.group, self.rank = placement, group, rank

    def dispatch(self, x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, list[int], Any]:
        mine = self.placement.local(self.rank)
        lo, hi = sum(sizes[: mine.start]), sum(sizes[: mine.stop])
        x = copy_to_tp(x, self.group)
        blocks = [
            sum(sizes[r.start : r.stop])
            for r in map(self.placement.local, range(self.placement.ep))
        ]
        return x[lo:hi], list(sizes[mine.start : mine.stop]), blocks

    def combine(self, y: torch.Tensor, blocks: Any) -> torch.Tensor:
        if torch.is_grad_enabled() and y.requires_grad:
            return _GatherBlocks.apply(y, blocks, self.rank, self.group)
        return _gather_blocks(y, blocks, self.group)


class GroupedAllToAll:
    """Rows grouped by expert, each rank its own batch: each expert's rows to its rank (counts
    exchanged first), arranged there by local expert (every source's rows of expert 0, then of
    expert 1, ...), and back the same way."""

    name = "all_to_all"

    def __init__(self, placement: ExpertPlacement, group: ProcessGroup, rank: int) -> None:
        self.placement, self.group, self.rank = placement, group, rank
        self.width = max(placement.sizes)

    def dispatch(self, x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, list[int], Any]:
        ep, width = self.placement.ep, self.width
        send = torch.zeros(ep, width, dtype=torch.long)
        for r in range(ep):
            r_experts = self.placement.local(r)
            send[r, : len(r_experts)] = torch.tensor(sizes[r_experts.start : r_experts.stop])
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv.view(-1), send.view(-1), group=self.group)
        send_sizes, recv_sizes = send.sum(1).tolist(), recv.sum(1).tolist()
        got = all_to_all(x, recv_sizes, send_sizes, self.group)
        local = len(self.placement.local(self.rank))
        counts = recv[:, :local]  # [source, local expert]
        starts = torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)
        order = torch.cat(
            [
                torch.arange(int(starts[s * local + e]), int(starts[s * local + e] + counts[s, e]))
                for e in range(local)
                for s in range(ep)
            ]
            or [torch.zeros(0, dtype=torch.long)]
        )
        return got[order], counts.sum(0).tolist(), (order, send_sizes, recv_sizes)

    def combine(self, y: torch.Tensor, state: Any) -> torch.Tensor:
        order, send_sizes, recv_sizes = state
        back = y[torch.argsort(order)]
        return all_to_all(back, send_sizes, recv_sizes, self.group)
