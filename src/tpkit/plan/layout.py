"""Where each parameter is split: the one rule that sharding, loading, validation, explanation
and checkpoints all use, derived from the style catalogue.

A layout is plain data (`ParamLayout`: a dim and a number of packed parts); `tpkit.styles` turns
it into a DTensor placement, `tpkit.pretrained` into byte ranges of a file, `explain` into a local shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from tpkit.plan.catalogue import style_spec
from tpkit.plan.spec import Plan

__all__ = [
    "REPLICATED",
    "GroupedRows",
    "ParamLayout",
    "chunk_offset",
    "chunk_sizes",
    "chunk_ranges",
    "grouped_rows_hooks",
    "in_width",
    "is_conv1d",
    "kind_of",
    "local_shape",
    "out_width",
    "param_layout",
    "param_layouts",
    "param_styles",
    "tp_regions",
]


@dataclass(frozen=True)
class ParamLayout:
    """Where a parameter is split: ``dim`` (None = replicated) and, for packed weights such as a
    fused [gate; up], ``split_factor`` > 1 parts that are each split along ``dim``."""

    dim: int | None
    split_factor: int = 1

    @property
    def sharded(self) -> bool:
        return self.dim is not None


REPLICATED = ParamLayout(None)


def is_conv1d(module: nn.Module | None) -> bool:
    """transformers' GPT-2 ``Conv1D`` keeps its weight as [in, out]; matched by name so plan/
    needs no transformers import."""
    return module is not None and type(module).__name__ == "Conv1D"


_CONVS = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)


def kind_of(module: nn.Module) -> str | None:
    """``linear``, ``conv1d``, ``embedding``, or ``experts``: a leaf module whose own weight is
    3-D ``[experts, out, in]``, each expert a linear (JetMoE's ``ParallelExperts``, the layout
    of MegaBlocks, ScatterMoE and vLLM); the trace checks the widths it computes with."""
    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return "conv1d"
    if isinstance(module, nn.Embedding):
        return "embedding"
    w = module._parameters.get("weight")
    # Conv1d's weight is 3-D too, and so is a model's own subclass of it (Moonshine-Streaming's
    # causal conv: read as experts, its split failed the forward on the bias)
    builtin = isinstance(module, _CONVS) or type(module).__module__.startswith("torch.nn")
    if w is not None and w.ndim == 3 and not module._modules and not builtin:
        return "experts"
    return None


def out_width(module: nn.Module, kind: str) -> int:
    w = module.weight
    return int(w.shape[1] if kind in ("conv1d", "embedding") else w.shape[-2])


def in_width(module: nn.Module, kind: str) -> int:
    w = module.weight
    return int(w.shape[0] if kind == "conv1d" else w.shape[-1])


def param_layout(
    style: str, param_name: str, ndim: int, module: nn.Module | None = None
) -> ParamLayout:
    """The layout ``style`` gives one parameter, from its rank alone (see catalogue.SHARDS).

    Linear weights are ``[out, in]`` (Conv1D: ``[in, out]``), 3-D expert weights ``[E, out, in]``,
    embeddings ``[vocab, hidden]``. As in transformers' plans a style names raw dims of an expert
    tensor ("colwise" splits dim -2, "rowwise" dim -1, whatever the module computes with them).
    1-D parameters follow the output: split with a column style's output, replicated otherwise
    (a row layer's bias is added after the reduction).
    """
    s = style_spec(style)
    if s.shard is None or s.own_entries:
        return REPLICATED
    if s.name == "mha_heads":  # nn.MultiheadAttention's own parameters, by name
        return _MHA_LAYOUTS.get(param_name, REPLICATED)
    if ndim <= 1:
        return ParamLayout(0, s.packed_parts) if s.shard == "out" else REPLICATED
    if s.shard == "out" and module is not None and kind_of(module) is None:
        p = module._parameters.get(param_name)
        if p is not None and math.prod(p.shape[1:]) == 1 and not isinstance(module, _CONVS):
            return ParamLayout(0)  # a bare per-head parameter [heads, 1, 1]: by its first dim
    conv1d = is_conv1d(module)
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):  # [out, in / groups, *kernel]
        return ParamLayout(0 if s.shard == "out" else 1, s.packed_parts)
    if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return ParamLayout(1 if s.shard == "out" else 0, s.packed_parts)  # [in, out / groups, *k]
    if s.shard in ("vocab", "cols"):  # [num_embeddings, dim]
        if ndim != 2:
            return REPLICATED
        return ParamLayout(1 if s.shard == "cols" or conv1d else 0)
    if s.shard == "out":
        return ParamLayout(ndim - 1 if conv1d else ndim - 2, s.packed_parts)
    return ParamLayout(0 if conv1d else ndim - 1, s.packed_parts)  # "in"


#: ``mha_heads``: where each of ``nn.MultiheadAttention``'s own parameters holds its heads
#: (``out_proj`` is a child with its own ``rowwise`` entry)
_MHA_LAYOUTS = MappingProxyType(
    {
        "in_proj_weight": ParamLayout(0, 3),  # [q; k; v] packed, [3 E, E]
        "in_proj_bias": ParamLayout(0, 3),
        "q_proj_weight": ParamLayout(0),  # [E, E], [E, kdim], [E, vdim]
        "k_proj_weight": ParamLayout(0),
        "v_proj_weight": ParamLayout(0),
        "bias_k": ParamLayout(2),  # [1, 1, E]
        "bias_v": ParamLayout(2),
    }
)


def chunk_sizes(size: int, parts: int) -> list[int]:
    """Sizes torch.chunk (and DTensor's Shard) gives: ceil-sized chunks, the tail shorter or 0."""
    chunk = -(-size // parts)
    return [max(0, min(chunk, size - r * chunk)) for r in range(parts)]


def chunk_offset(size: int, parts: int, rank: int) -> int:
    """Where ``rank``'s chunk starts under `chunk_sizes`."""
    return min(size, rank * -(-size // parts))


def chunk_ranges(size: int, parts: int, rank: int, split_factor: int = 1) -> list[tuple]:
    """Half-open ranges along a dim of ``size`` that make up ``rank``'s chunk (concatenated):
    one range, or one per packed part when ``split_factor`` parts are each split separately
    (DTensor's ``_StridedShard``)."""
    part = size // split_factor
    off, n = chunk_offset(part, parts, rank), chunk_sizes(part, parts)[rank]
    return [(k * part + off, k * part + off + n) for k in range(split_factor)]


def local_shape(shape: tuple[int, ...], layout: ParamLayout, tp: int, rank: int = 0) -> tuple:
    """This rank's shard shape under torch.chunk semantics (uneven splits give the tail less)."""
    if not layout.sharded or tp == 1:
        return tuple(shape)
    out = list(shape)
    part = shape[layout.dim] // layout.split_factor
    out[layout.dim] = chunk_sizes(part, tp)[rank] * layout.split_factor
    return tuple(out)


def param_styles(model: nn.Module, plan: Plan) -> dict[str, tuple[str, str]]:
    """Full parameter name -> (style, source) for every parameter: its own entry, else its
    module's, else ("replicate", "-"). Tied parameters appear under each of their names."""
    module_style: dict[str, tuple[str, str]] = {}
    param_style: dict[str, tuple[str, str]] = {}
    for t in plan.resolve(model):
        (module_style if t.kind == "module" else param_style)[t.name] = (t.style, t.source)
    out = {}
    for mod_name, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{pname}" if mod_name else pname
            out[full] = param_style.get(full) or module_style.get(mod_name) or ("replicate", "-")
    return out


def param_layouts(model: nn.Module, plan: Plan) -> dict[str, tuple[str, ParamLayout, nn.Module]]:
    """Full parameter name -> (style, layout, owning module) for every parameter of ``model``."""
    modules = dict(model.named_modules())
    out = {}
    for full, (style, _) in param_styles(model, plan).items():
        owner, _, pname = full.rpartition(".")
        module = modules[owner]
        p = module._parameters[pname]
        out[full] = (style, param_layout(style, pname, p.ndim, module), module)
    return out


def tp_regions(model: nn.Module, plan: Plan) -> dict[str, list[str]]:
    """Tensor-parallel regions: each module whose children include column-parallel linears
    (``self_attn``, ``mlp``), with its row-parallel children, where the region's split
    activations end. Dropout differs across ranks inside a region (`tpkit.training.rng`); sequence
    parallelism gathers the sequence at a region's entry (`tpkit.parallel.sequence`)."""
    styles = {t.name: t.style for t in plan.resolve(model) if t.kind == "module"}
    regions: dict[str, list[str]] = {}
    for name, style in styles.items():
        if style_spec(style).splits_output and style_spec(style).shard == "out" and "." in name:
            regions.setdefault(name.rsplit(".", 1)[0], [])
    for name, style in styles.items():
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if style_spec(style).splits_input and parent in regions:
            regions[parent].append(name)
    return regions


@dataclass(frozen=True)
class GroupedRows:
    """How one rank computes its torch.chunk of a grouped convolution's output channels from
    the whole input (``conv_colwise_gather`` on ``groups > 1``): its rows padded with ``pad``
    zero rows before and after to the whole groups they touch (``groups`` of them), the input
    narrowed to those groups' channels (``start``, ``width``), the padded output channels
    dropped (``keep`` channels from ``pad[0]``). Zero rows add nothing to the rows kept and
    get no gradient, so this is exact at any tp, 17 groups at tp=2 included, for at most two
    groups' extra work. The style (`tpkit.styles.conv.ConvGatherStyle`) and the dry run
    (`grouped_rows_hooks`) both run it. The input must be whole (``channels``, the module's
    ``in_channels``): a narrowed slice of a split input could have the right shape on some
    ranks and hold other channels, so any other width is an error, in the dry run too."""

    pad: tuple[int, int]
    groups: int
    start: int
    width: int
    keep: int
    channels: int = 0

    @classmethod
    def of(cls, module: nn.Module, tp: int, rank: int) -> GroupedRows:
        """``rank``'s rows of ``module`` (a grouped ``nn.Conv1d/2d/3d``) at ``tp``."""
        out, per_in = module.out_channels, module.in_channels // module.groups
        per_out = out // module.groups
        lo = rank * -(-out // tp)
        keep = chunk_sizes(out, tp)[rank]
        first, last = min(lo, out) // per_out, -(-(lo + keep) // per_out)
        first = min(first, last)
        pad = (lo - first * per_out, last * per_out - lo - keep) if keep else (0, 0)
        groups = last - first
        return cls(pad, groups, first * per_in, groups * per_in, keep, module.in_channels)

    def enter(self, module: nn.Module) -> tuple[int, dict[str, torch.Tensor | None]]:
        """Pad the module's (local) weight and bias in place and set its groups; returns what
        `leave` puts back. The padded weight is built on each forward (one copy of the rank's
        rows, small beside the convolution over every position) so that its gradient reaches
        the parameter's shard through the concatenation."""
        params = module._parameters
        saved = {n: params.get(n) for n in ("weight", "bias")}
        for n, p in saved.items():
            if p is not None:  # zero rows up to whole groups: constants, no gradient
                zeros = (p.new_zeros(k, *p.shape[1:]) for k in self.pad)
                params[n] = torch.cat([next(zeros), p, next(zeros)])
        groups, module.groups = module.groups, self.groups
        return groups, saved

    @staticmethod
    def leave(module: nn.Module, state: tuple[int, dict[str, torch.Tensor | None]]) -> None:
        """Undo `enter`."""
        module.groups = state[0]
        module._parameters.update(state[1])

    def narrow_input(self, x: torch.Tensor, kernel_dims: int) -> torch.Tensor:
        """The input channels of this rank's groups, from the whole input."""
        dim = x.ndim - kernel_dims - 1
        if self.channels and (dim < 0 or x.shape[dim] != self.channels):
            got = x.shape[dim] if dim >= 0 else tuple(x.shape)
            raise ValueError(
                f"conv_colwise_gather on a grouped convolution needs its whole input "
                f"({self.channels} channels at dim {dim}), got {got}: an earlier layer leaves "
                "it split; leave this convolution whole (replicate) or gather that layer."
            )
        return x.narrow(dim, self.start, self.width)

    def narrow_output(self, y: torch.Tensor, kernel_dims: int) -> torch.Tensor:
        """This rank's channels of the padded output."""
        return y.narrow(y.ndim - kernel_dims - 1, self.pad[0], self.keep)


def grouped_rows_hooks(module: nn.Module, tp: int, rank: int) -> list:
    """Forward hooks doing what ``conv_colwise_gather`` does to a grouped convolution's
    shapes (`GroupedRows`), for the dry run (`tpkit.settle.dryrun`); none for another module."""
    if not isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) or module.groups == 1:
        return []
    rows, kernel, states = GroupedRows.of(module, tp, rank), module.weight.ndim - 2, []

    def pre(mod: nn.Module, args: tuple) -> tuple:
        states.append(rows.enter(mod))
        return (rows.narrow_input(args[0], kernel), *args[1:]) if args else args

    def post(mod: nn.Module, args: tuple, output: Any) -> Any:
        if states:
            GroupedRows.leave(mod, states.pop())
        return rows.narrow_output(output, kernel) if isinstance(output, torch.Tensor) else output

    post_hook = module.register_forward_hook(post, always_call=True)  # groups put back always
    return [module.register_forward_pre_hook(pre), post_hook]
