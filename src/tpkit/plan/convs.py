"""Convolutions paired like Megatron's linears: one all-reduce per pair instead of a gather per
convolution.

Convolution A (``groups=1``, plain or transposed) splits its output channels and leaves them
split (``conv_colwise``); convolution B, which reads those channels, splits its input channels
and all-reduces its partial sums (``conv_rowwise``). That is exact when A's output reaches B
only through ops that compute each channel from that channel alone, so each rank can run them
on its channels:

- elementwise activations, dropout, pooling, interpolation, padding (of the spatial dims), a
  scalar scale or shift, a reduction over other dims than the channels (``mean((2, 3))``);
- BatchNorm (eval and train: its statistics are per channel, over every sample and position,
  which a rank holds) and GroupNorm when tp divides its groups (each rank holds whole groups):
  ``norm_channelwise``, weight, bias and running statistics split by channel;
- grouped and depthwise convolutions when tp divides their groups: ``channelwise`` with the
  groups divided (each rank's channels are whole groups).

Anything else on the way (a reshape or flatten, a reduction over the channels: ConvNeXt's
LayerNorm after its permute to channels-last, a residual add with a whole tensor, a linear, the
model's output, a second use of one module) breaks the pair: A goes back to the per-layer
fallback (``conv_colwise_gather``, `tpkit.plan.fallback`). Several convolutions reading one
split output (branches) all take ``conv_rowwise``.

Why a trace of its own: `tpkit.plan.trace` follows linear-like modules' features on the last
dim; a convolution's channels are dim 1 (0 unbatched) and what may ride between a pair is a
short allow-list, so this is a separate, smaller tagger on the same fake-tensor forward
(`tpkit.plan.fake`). Pairing is decided by a fixpoint: a convolution whose pair breaks is
excluded and the trace run again, so its own consumer may become a column layer in its turn.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tpkit.compat import FakeTensorMode, tree_flatten
from tpkit.plan.fake import fake_inputs, meta_state, quiet_fake_tensors
from tpkit.plan.layout import chunk_sizes
from tpkit.plan.reductions import reduced_dims

__all__ = ["NORMS", "CONVS", "TRANSPOSED_CONVS", "ConvPairs", "conv_pairs"]

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED_CONVS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm)
#: fixpoint rounds at most (each round excludes at least one more convolution)
_ROUNDS = 16

#: ops that compute each channel from that channel alone (the split tensor as first argument,
#: any other tensor a scalar)
_PER_CHANNEL = frozenset(
    # activations
    {"relu", "relu_", "relu6", "gelu", "silu", "silu_", "sigmoid", "sigmoid_", "tanh", "tanh_"}
    | {"hardtanh", "hardtanh_", "hardswish", "hardswish_", "hardsigmoid", "leaky_relu"}
    | {"leaky_relu_", "elu", "elu_", "selu", "selu_", "celu", "celu_", "mish", "softplus"}
    | {"softsign", "tanhshrink", "logsigmoid", "threshold", "threshold_", "prelu", "rrelu"}
    # elementwise, by a scalar
    | {"neg", "abs", "exp", "log", "sqrt", "rsqrt", "square", "pow", "__pow__", "sin", "cos"}
    | {"clamp", "clamp_", "clamp_min", "clamp_max", "clip", "mul", "mul_", "add", "add_"}
    | {"sub", "sub_", "div", "div_", "__mul__", "__rmul__", "__add__", "__radd__", "__sub__"}
    | {"__rsub__", "__truediv__", "__iadd__", "__imul__", "__isub__", "__itruediv__", "__neg__"}
    # dropout (per channel or per element; per-rank streams are `tpkit.training.rng`'s)
    | {"dropout", "dropout_", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout"}
    | {"feature_alpha_dropout"}
    # pooling and resampling of the spatial dims
    | {f"{p}_pool{d}d" for p in ("max", "avg", "lp", "adaptive_avg", "adaptive_max") for d in "123"}
    | {f"max_pool{d}d_with_indices" for d in "123"}
    | {f"adaptive_max_pool{d}d_with_indices" for d in "123"}
    | {"interpolate", "upsample", "upsample_nearest", "upsample_bilinear", "pad"}
    # copies, casts
    | {"contiguous", "clone", "detach", "float", "double", "half", "bfloat16", "to", "type_as"}
)


@dataclass
class ConvPairs:
    """What `conv_pairs` found: ``styles`` (module -> style), ``fixups`` (module -> its plan
    fix-up), ``notes`` (module -> why, for `tpkit plan`), ``broken`` (a convolution whose pair
    broke -> what broke it)."""

    styles: dict[str, str] = field(default_factory=dict)
    fixups: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)


def conv_pairs(
    model: nn.Module,
    tp: int,
    splittable: Callable[[str, nn.Module], bool],
    example: tuple | Mapping | None = None,
) -> ConvPairs:
    """The convolution pairs of ``model`` at ``tp`` (see the module docstring), found on one
    fake-tensor forward per fixpoint round (``example``: the trace inputs, else made up from
    the model). ``splittable(name, module)`` says whether a module may be split at all (the
    fallback's checks: not shared, not parametrized, not an overridden forward). A model whose
    forward cannot run on fake tensors pairs nothing."""
    excluded: set[str] = set()
    broken: dict[str, str] = {}
    for _ in range(_ROUNDS):
        try:
            found = _ConvTrace(model, tp, splittable, excluded).run(example)
        except Exception:  # noqa: BLE001 - model code may do anything: no pairs, as before
            return ConvPairs(broken=broken)
        newly = {s: why for s, why in found.broken.items() if s not in excluded}
        newly.update({s: "nothing reads its split channels" for s in found.unpaired()})
        newly = {s: why for s, why in newly.items() if s not in excluded}
        if not newly:
            return _result(found, broken, tp)
        broken.update(newly)
        excluded |= newly.keys()
    return ConvPairs(broken=broken)


def _result(found: _ConvTrace, broken: dict[str, str], tp: int) -> ConvPairs:
    out = ConvPairs(broken=broken)
    for col, rows in found.rows.items():
        partners = ", ".join(sorted(rows))
        out.styles[col] = "conv_colwise"
        out.notes[col] = f"paired convolution: output channels split, read split by {partners}"
        for row in rows:
            out.styles[row] = "conv_rowwise"
            out.notes[row] = f"paired convolution: input channels split (from {col}), all-reduced"
    for name, (col, mod) in found.followers.items():
        if col not in found.rows:
            continue
        if isinstance(mod, NORMS):
            out.styles[name] = "norm_channelwise"
            out.notes[name] = f"per-channel norm on {col}'s split channels"
            if isinstance(mod, nn.GroupNorm):
                out.fixups[name] = {"divide": ["num_groups"]}
            elif mod.running_mean is not None:
                out.fixups[name] = {"shard_buffers": ["running_mean", "running_var"]}
        else:
            out.styles[name] = "channelwise"
            out.notes[name] = f"grouped convolution on {col}'s split channels (groups / {tp})"
            out.fixups[name] = {"divide": ["groups", "in_channels", "out_channels"]}
    return out


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _is_scalar(obj: Any) -> bool:
    return not isinstance(obj, torch.Tensor) or obj.numel() <= 1


class _ConvTrace(TorchFunctionMode):
    """One fake forward: tensors holding a column candidate's split channels are tagged with
    it (and the dim of their channels); convolutions and norms are read at their module
    boundary, every other call on a tagged tensor must be a per-channel op or it breaks."""

    def __init__(
        self,
        model: nn.Module,
        tp: int,
        splittable: Callable[[str, nn.Module], bool],
        excluded: set[str],
    ):
        super().__init__()
        self.model, self.tp, self.splittable, self.excluded = model, tp, splittable, excluded
        self.names = {id(m): n for n, m in model.named_modules()}
        self.tag: dict[int, tuple[str, int]] = {}  # id(tensor) -> (column candidate, channel dim)
        self.keep: list[torch.Tensor] = []  # ids stay unique while the trace runs
        self.inside: list[str] = []  # convs and norms running: their own calls are theirs
        self.plans: dict[str, tuple[str, str, int]] = {}  # module -> (role, column, kernel dims)
        self.calls: dict[str, int] = {}
        self.rows: dict[str, set[str]] = {}  # column candidate -> the convs reading it split
        self.followers: dict[str, tuple[str, nn.Module]] = {}
        self.sources: set[str] = set()
        self.broken: dict[str, str] = {}

    # -- the forward ---------------------------------------------------------------------------
    def run(self, example: tuple | Mapping | None) -> _ConvTrace:
        model, hooks = self.model, []
        for mod in model.modules():
            if isinstance(mod, CONVS + TRANSPOSED_CONVS + NORMS) or mod is model:
                hooks.append(mod.register_forward_pre_hook(self._pre, with_kwargs=True))
                hooks.append(mod.register_forward_hook(self._post, with_kwargs=True))
        try:
            with quiet_fake_tensors():
                fake = FakeTensorMode(allow_non_fake_inputs=True)
                args, kwargs = fake_inputs(model, example, fake, real=False)
                with meta_state(model, fake), torch.no_grad(), fake, self:
                    model(*args, **kwargs)
        finally:
            for h in hooks:
                h.remove()
        for name, count in self.calls.items():
            if count > 1:  # one module, two roles or two inputs: nothing here can tell
                role, col, _ = self.plans.get(name, ("", "", 0))
                for c in {col, name} & (self.sources | self.rows.keys()):
                    self._break(c, f"{name} runs more than once")
        return self

    def unpaired(self) -> list[str]:
        return [s for s in self.sources if s not in self.broken and not self.rows.get(s)]

    def _break(self, col: str, why: str) -> None:
        self.broken.setdefault(col, why)

    def _set(self, t: torch.Tensor, col: str, dim: int) -> None:
        self.keep.append(t)
        self.tag[id(t)] = (col, dim)

    # -- module boundaries: convolutions and norms -------------------------------------------
    def _pre(self, mod: nn.Module, args: tuple, kwargs: dict) -> None:
        name = self.names[id(mod)]
        if mod is self.model or self.inside:
            return
        self.calls[name] = self.calls.get(name, 0) + 1
        self.inside.append(name)
        ins = _tensors((args, kwargs))
        x = ins[0] if ins else None
        col, dim = self.tag.get(id(x), ("", 0)) if x is not None else ("", 0)
        for t in ins[1:]:  # a second split input (output_size is ints): not per channel
            if id(t) in self.tag:
                self._break(self.tag[id(t)][0], f"{name} reads it as a second input")
        kernel = mod.weight.ndim - 2 if isinstance(mod, CONVS + TRANSPOSED_CONVS) else 0
        plain = self.splittable(name, mod)
        if isinstance(mod, NORMS):
            if not col:
                return
            if not plain:
                self._break(col, f"{name} cannot be split (see its note)")
            elif isinstance(mod, nn.GroupNorm) and mod.num_groups % self.tp:
                self._break(col, f"tp={self.tp} does not divide {name}'s {mod.num_groups} groups")
            elif dim != 1:
                self._break(col, f"{name} normalises another dim than its channels")
            else:
                self.plans[name] = ("follow", col, 0)
                self.followers[name] = (col, mod)
            return
        if col:
            if dim != x.ndim - kernel - 1:
                self._break(col, f"{name} reads another dim than its channels")
            elif mod.groups == 1 and plain:
                self.plans[name] = ("row", col, kernel)
                self.rows.setdefault(col, set()).add(name)
            elif isinstance(mod, CONVS) and plain and mod.groups % self.tp == 0:
                self.plans[name] = ("follow", col, kernel)
                self.followers[name] = (col, mod)
            else:
                why = "cannot be split" if not plain else f"has groups={mod.groups}"
                self._break(col, f"{name} {why} (tp={self.tp})")
            return
        sizes = chunk_sizes(mod.out_channels, self.tp)
        if mod.groups == 1 and plain and name not in self.excluded and min(sizes) >= 1:
            self.plans[name] = ("col", name, kernel)
            self.sources.add(name)

    def _post(self, mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        name = self.names[id(mod)]
        if mod is self.model:
            for t in _tensors(output):
                if id(t) in self.tag:
                    self._break(self.tag[id(t)][0], "the model returns its split channels")
            return
        if not self.inside or self.inside[-1] != name:
            return
        self.inside.pop()
        role, col, kernel = self.plans.pop(name, ("", "", 0))
        outs = [t for t in _tensors(output) if t.is_floating_point()]
        if role in ("col", "follow") and outs:
            y = outs[0]
            dim = y.ndim - kernel - 1 if role == "col" or kernel else 1
            self._set(y, col, dim)
        self.plans[name] = (role, col, kernel)  # kept for `run`'s count of calls

    # -- every other call --------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.inside:
            return out
        ins = _tensors((args, kwargs))
        tagged = [t for t in ins if id(t) in self.tag]
        if not tagged:
            return out
        outs = _tensors(out)
        if not outs:
            return out  # metadata (size(), dim()): no values read
        name = getattr(func, "__name__", "")
        cols = {self.tag[id(t)][0] for t in tagged}
        if len(cols) > 1:
            for c in cols:
                self._break(c, f"{name}() mixes it with another convolution's channels")
            return out
        col, dim = self.tag[id(tagged[0])]
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        new_dim = self._per_channel(name, args, kwargs, src, dim, tagged)
        if new_dim is None:
            self._break(col, f"{name}() reads across its channels or mixes them")
            return out
        for t in outs:
            if t.is_floating_point() and t.ndim > new_dim and t.shape[new_dim] == src.shape[dim]:
                self._set(t, col, new_dim)
        return out

    def _per_channel(self, name, args, kwargs, src, dim, tagged) -> int | None:
        """The channel dim of the result when ``name`` computes each channel from that channel
        alone; None when it does not (or cannot be told)."""
        if src is None or id(src) not in self.tag or len(tagged) > 1:
            return None
        others = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)]
        dims = reduced_dims(name, args, kwargs, src.ndim)
        if dims is not None:  # a reduction: over other dims than the channels, after them
            keep = kwargs.get("keepdim", False) or (len(args) > 2 and args[2] is True)
            ok = dims and dim not in dims and (keep or min(dims) > dim) and not others
            return dim if ok else None
        if name not in _PER_CHANNEL or not all(_is_scalar(a) for a in others):
            return None
        if name == "pad":  # F.pad pads the last len(pad) / 2 dims
            pad = args[1] if len(args) > 1 else kwargs.get("pad", ())
            return dim if len(pad) // 2 < src.ndim - dim else None
        return dim
