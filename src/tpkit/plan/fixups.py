"""Fix-ups: what a module's own code must see per rank, applied from plan data.

Model code reads sizes that tensor parallelism changes: ``self.num_heads`` in a reshape, GPT-2
``Conv1D.nf`` in a view, BLOOM's ``alibi`` built for every head outside the attention. A plan
lists them per module pattern (``plan.fixups``); this module applies them, the same way for the
real split (`tpkit.parallel.tensor`, permanently) and for the dry run on fake tensors (`tpkit.settle.dryrun`,
undone afterwards), and `tpkit plan` prints them:

- ``divide``: integer attributes divided by tp (head counts, widths equal to a split width);
- ``shard_width``: ``{attr: [parameter, dim]}``: the attribute becomes this rank's size of that
  parameter's dimension (``nf`` of a column-parallel Conv1D, exact for uneven splits too).
  Derived from the plan's styles by one rule (`shard_width_fixups`, `FORWARD_WIDTH_ATTRS`)
  wherever fix-ups are applied or printed, so no plan source has to remember it;
- ``set``: ``{attr: value}``: the attribute becomes ``value`` on every rank (one KV head per
  rank when KV heads are replicated, `tpkit.settle.kvheads`);
- ``head_inputs``: ``{"kw:alibi": 0}``: a per-head input computed outside the module is sliced
  to the rank's contiguous heads, along dim 0 (batch*heads) or dim 1 (heads);
- ``head_buffers``: ``{"slope_rate": 0}``: the module's own per-head buffers (made at init
  for every head) cut to the rank's heads along that dim;
- ``shard_buffers``: ``["running_mean", ...]``: per-channel buffers cut to the rank's
  channels (dim 0, torch.chunk sizes) for the dry run; the real split's style
  (``norm_channelwise``) has already made them DTensors, which this leaves be;
- ``merge_heads``: ``[width, ...]``: the module's code merges its heads back to a width read off
  its input (``bsz, tgt_len, embed_dim = hidden_states.size()`` ... ``.reshape(bsz, tgt_len,
  embed_dim)``, older BART-style attention), a local variable no attribute fix-up reaches:
  while its forward runs, a ``view``/``reshape`` to such a width that cannot fit the rank's
  heads is given the rank's width instead (`MergeHeads`). A reshape that fits is never changed.

No process group: a rank's share is arithmetic on tp and its rank.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tpkit.plan.layout import chunk_offset, chunk_sizes, local_shape, param_layout
from tpkit.plan.spec import Plan

__all__ = [
    "HEAD_ATTRS",
    "WIDTH_ATTRS",
    "MergeHeads",
    "apply_fixups",
    "head_slicer",
    "shard_width_fixups",
]

#: Attributes that count attention heads (on modules or their configs): validation checks that
#: tp divides them, inference divides them on the modules that own a column/row pair.
HEAD_ATTRS = (
    "num_heads",
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "n_head_kv",
    "num_attn_heads",  # ProphetNet
)
#: Attributes that hold a width; inference divides them only when they equal a split width.
WIDTH_ATTRS = (
    "embed_dim",
    "hidden_size",
    "hidden_size_per_partition",
    "inner_dim",
    "split_size",
    "all_head_size",
)
#: Width attributes a module's own forward reads to shape its output: they must follow the shard.
FORWARD_WIDTH_ATTRS = {"nf": ("weight", -1)}  # transformers' Conv1D: x @ W viewed as (..., nf)


def shard_width_fixups(model: nn.Module, plan: Plan) -> dict[str, dict[str, Any]]:
    """``shard_width`` fix-ups for every module whose forward reads the width of a parameter
    the plan splits (GPT-2's Conv1D ``nf``), keyed by module name."""
    out: dict[str, dict[str, Any]] = {}
    for t in plan.resolve(model):
        if t.kind != "module":
            continue
        module = model.get_submodule(t.name)
        for attr, (pname, dim) in FORWARD_WIDTH_ATTRS.items():
            p = module._parameters.get(pname)
            if not isinstance(getattr(module, attr, None), int) or p is None:
                continue
            if param_layout(t.style, pname, p.ndim, module).dim == dim % p.ndim:
                out.setdefault(t.name, {}).setdefault("shard_width", {})[attr] = [pname, dim]
        if _depthwise(module) and param_layout(t.style, "weight", 3, module).dim == 0:
            # a depthwise conv split by channels: its forward passes groups=self.groups
            widths = out.setdefault(t.name, {}).setdefault("shard_width", {})
            widths.update({a: ["weight", 0] for a in ("in_channels", "out_channels", "groups")})
    return out


def _depthwise(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.Conv1d)
        and module.groups == module.out_channels == module.in_channels
        and module.groups > 1
    )


def head_slicer(
    head_inputs: Mapping[str, int],
    heads: int,
    tp: int,
    rank: int,
    before_slice: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Callable:
    """A forward pre-hook keeping ``rank``'s heads of each per-head input it names.

    ``before_slice`` is applied to the whole input first: the real split passes Megatron's f
    (identity forward, gradient all-reduced), since each rank's gradient for a replicated input
    it slices covers only its heads (CPM-Ant's position bias, made by parameters outside the
    attention); the dry run passes nothing (no collectives in plan/)."""
    per = heads // tp
    lo, hi = rank * per, (rank + 1) * per

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        for key, dim in head_inputs.items():
            kind, k = key.split(":", 1)
            t = args[int(k)] if kind == "arg" and int(k) < len(args) else kwargs.get(k)
            if not isinstance(t, torch.Tensor):
                continue
            if before_slice is not None:
                t = before_slice(t)
            if dim == 0:
                t = t.unflatten(0, (-1, heads))[:, lo:hi].flatten(0, 1)
            elif t.shape[1] == heads:
                t = t[:, lo:hi]
            if kind == "arg":
                args = (*args[: int(k)], t, *args[int(k) + 1 :])
            else:
                kwargs = {**kwargs, k: t}
        return args, kwargs

    return hook


class MergeHeads(TorchFunctionMode):
    """A ``view``/``reshape`` of a rank's heads to one of the full ``widths`` (the last dim,
    given as a number) that cannot fit gets the rank's width: what the code means by merging
    its heads. Only a call that would fail is changed, so every other reshape is the model's."""

    def __init__(self, widths: list[int]):
        super().__init__()
        self.widths = set(widths)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("view", "reshape") and len(args) >= 2 and isinstance(args[0], torch.Tensor):
            shape = _merged(args[0], args[1:], self.widths)
            if shape is not None:
                return func(args[0], shape)
        return func(*args, **kwargs)


def _merged(t: torch.Tensor, rest: tuple, widths: set[int]) -> tuple | None:
    """The shape ``t.view(*rest)`` means when it asks for a full width ``t`` holds a share of."""
    shape = tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
    if not shape or not all(isinstance(d, int) for d in shape) or shape[-1] not in widths:
        return None
    lead = 1
    for d in shape[:-1]:
        lead *= d
    if lead <= 0 or lead * shape[-1] == t.numel() or t.numel() % lead:
        return None
    return (*shape[:-1], t.numel() // lead)


def _merging_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    with MergeHeads(self.__dict__["_tpkit_merge_widths"]):
        return self.__dict__["_tpkit_inner_forward"](*args, **kwargs)


def _merge_heads(module: nn.Module, widths: list[int]) -> Callable[[], None]:
    """Run ``module``'s forward under `MergeHeads`; return what undoes it."""
    had = "forward" in module.__dict__
    module.__dict__["_tpkit_inner_forward"] = module.forward
    module.__dict__["_tpkit_merge_widths"] = list(widths)
    module.forward = types.MethodType(_merging_forward, module)

    def undo() -> None:
        inner = module.__dict__.pop("_tpkit_inner_forward")
        module.__dict__.pop("_tpkit_merge_widths", None)
        if had:
            module.forward = inner
        else:
            del module.forward

    return undo


def _local_size(module: nn.Module, style: str, pname: str, dim: int, tp: int, rank: int) -> int:
    p = module._parameters[pname]
    layout = param_layout(style, pname, p.ndim, module)
    return local_shape(tuple(p.shape), layout, tp, rank)[dim]


def apply_fixups(
    model: nn.Module,
    plan: Plan,
    tp: int,
    rank: int,
    before_slice: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Callable[[], None]:
    """Apply every fix-up of ``plan`` to ``model`` for ``rank`` of ``tp``; return a function that
    undoes them all (attributes restored, hooks removed). Parameters are read by global shape,
    so this runs before or after they are distributed alike. ``before_slice``: see
    `head_slicer`."""
    restore: list[tuple[nn.Module, str, Any]] = []
    hooks = []
    undos: list[Callable[[], None]] = []
    styles = {t.name: t.style for t in plan.resolve(model) if t.kind == "module"}
    widths = shard_width_fixups(model, plan)
    for name, module in model.named_modules():
        fix = {**(plan.fixups_for(name) if plan.fixups else {}), **widths.get(name, {})}
        if not fix:
            continue
        heads = None
        for attr in fix.get("divide", []):
            value = getattr(module, attr, None)
            if isinstance(value, int):
                restore.append((module, attr, value))
                setattr(module, attr, value // tp)
                heads = heads or (value if attr in HEAD_ATTRS else None)
        for attr, value in (fix.get("set") or {}).items():  # per-rank values (kvheads.py)
            if hasattr(module, attr):
                restore.append((module, attr, getattr(module, attr)))
                setattr(module, attr, value)
        for attr, (pname, dim) in (fix.get("shard_width") or {}).items():
            restore.append((module, attr, getattr(module, attr)))
            style = styles.get(name, "replicate")
            setattr(module, attr, _local_size(module, style, pname, dim, tp, rank))
        for bname, dim in (fix.get("head_buffers") or {}).items():
            buf = module._buffers.get(bname)
            if buf is not None and heads and buf.shape[dim] == heads:
                restore.append((module, bname, buf))
                per = heads // tp
                module._buffers[bname] = buf.narrow(dim, rank * per, per).clone()
        for bname in fix.get("shard_buffers") or []:  # per-channel running statistics
            buf = module._buffers.get(bname)
            if buf is not None and not hasattr(buf, "placements"):  # a DTensor: its style's
                restore.append((module, bname, buf))
                size = chunk_sizes(buf.shape[0], tp)[rank]
                module._buffers[bname] = buf.narrow(0, chunk_offset(buf.shape[0], tp, rank), size)
        if fix.get("merge_heads"):
            undos.append(_merge_heads(module, fix["merge_heads"]))
        if fix.get("head_inputs") and heads:
            slicer = head_slicer(fix["head_inputs"], heads, tp, rank, before_slice)
            hooks.append(module.register_forward_pre_hook(slicer, with_kwargs=True))

    def undo() -> None:
        for h in hooks:
            h.remove()
        for u in reversed(undos):
            u()
        for module, attr, value in reversed(restore):
            setattr(module, attr, value)

    return undo
