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
  groups divided (each rank's channels are whole groups);
- a GLU over the channels (``F.glu`` / ``nn.GLU``: ``a | b -> a * sigmoid(b)``), read straight
  off A's output (through elementwise ops only): A's channels are then a packed pair, like a
  fused gate|up linear, and A takes ``conv_packed_colwise`` (each half split in torch.chunk
  sizes, so rank r holds ``a_r | b_r`` and its GLU gives channels ``r`` of the result, the same
  chunk the row convolution takes). The conformer convolution module (pointwise conv -> GLU ->
  depthwise conv -> BatchNorm -> activation -> pointwise conv) is one such pair.
- an elementwise op with a tensor that broadcasts over the channels (size 1 there: a padding
  mask ``[batch, 1, time]`` in ``masked_fill``), whichever side of the op the split tensor is.

Anything else on the way (a norm or grouped convolution before the GLU, a second GLU, a
``chunk`` of the channels, a reshape or flatten, a reduction over the channels: ConvNeXt's
LayerNorm after its permute to channels-last, a residual add with a whole tensor, a linear, the
model's output, a second use of one module) breaks the pair: A goes back to the per-layer
fallback (``conv_colwise_gather``, `tpkit.sources.fallback`). Several convolutions reading one
split output (branches) all take ``conv_rowwise``.

Two kinds of convolution that no pair takes are still split by output channels and gathered
(``conv_colwise_gather``, one group each), as ``conv_pairs``' own entries, since the callers'
per-layer rules keep them whole:

- a grouped or depthwise convolution whose input is whole (SqueezeBERT's grouped 1x1 q, k, v
  and feed-forward; RegNet's grouped 3x3 where its column's pair breaks): each rank's torch
  chunk of the output channels, its rows padded with zero rows to the whole groups they touch
  and the input narrowed to those groups (`tpkit.plan.layout.GroupedRows`), so groups tp does
  not divide (17 at tp=2) are exact too;
- a convolution subclass with its own ``forward`` that a probe shows computes each output
  channel from that channel's weight rows alone (`rows_exact`: BiT's weight standardization,
  per output channel over the input channels and kernel), with ``out_channels`` set to the
  rank's count (``shard_width`` fix-up: its forward reshapes the weight by it). It may also be
  a column (``conv_colwise``), never a row nor inside a pair: its statistics span the input
  channels, so a rank's input-channel slice would be standardized by other numbers. A
  subclass the probe does not pass (a transform over the whole weight) stays whole.

Why a trace of its own: `tpkit.trace.trace` follows linear-like modules' features on the last
dim; a convolution's channels are dim 1 (0 unbatched) and what may ride between a pair is a
short allow-list, so this is a separate, smaller tagger on the same fake-tensor forward
(`tpkit.trace.fake`). Pairing is decided by a fixpoint: a convolution whose pair breaks is
excluded and the trace run again, so its own consumer may become a column layer in its turn.

Inference (`tpkit.sources.infer`) adds the pairs of a model whose linears it splits too
(`conv_pairs` with ``groups``: one `tpkit.plan.spec.Group` per pair, the counts tp must divide
being the grouped convolutions' and GroupNorms' groups), so a conformer's convolution module is
split with its attention and feed-forward; the per-layer fallback uses the same pairs.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils.parametrize import is_parametrized
from torch.overrides import TorchFunctionMode

from tpkit.compat import fake_mode
from tpkit.plan.layout import chunk_sizes
from tpkit.trace.analysis import Analysis
from tpkit.trace.fake import fake_inputs, meta_state, quiet_fake_tensors
from tpkit.trace.fold import FoldBroken, Twins, folded, known_values
from tpkit.trace.inputs import InputRecipe
from tpkit.trace.reductions import reduced_dims
from tpkit.trace.shadow import GivenValues, ShadowValues, needs_values, tensors_in

__all__ = [
    "MIN_GATHER_CHANNELS",
    "not_gathered",
    "NORMS",
    "CONVS",
    "TRANSPOSED_CONVS",
    "ConvPairs",
    "conv_pairs",
    "exact_row_convs",
    "own_forward",
    "rows_exact",
    "shared_params",
    "splittable_conv",
]

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED_CONVS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm)
#: a convolution read whole is split by output channels and gathered only where torch.chunk
#: gives every rank at least this many of them (`not_gathered`, for this module's gathered
#: convolutions and the per-layer fallback's alike)
MIN_GATHER_CHANNELS = 2
#: fixpoint rounds at most (each round excludes at least one more convolution)
_ROUNDS = 16


def not_gathered(mod: nn.Module, tp: int, depthwise: bool = False) -> str | None:
    """Why convolution ``mod``, read whole, is not split by output channels and gathered at
    ``tp`` (None: it is). A depthwise one (one input channel per group) stays whole unless
    ``depthwise`` (its own forward transforms the weight, so no other split exists): its weight
    is a kernel per channel, as small as a norm's, and splitting it would add an all-gather of
    its output to save next to nothing. One whose output channels leave some rank fewer than
    `MIN_GATHER_CHANNELS` (9 at tp=4: 3, 3, 3, 0) stays whole too: a grouped convolution's
    rows are padded to whole groups, which needs rows on every rank, and a rank with one row
    does a collective for one channel."""
    if not depthwise and mod.groups > 1 and mod.in_channels == mod.groups:
        return f"depthwise (groups={mod.groups}): a kernel per channel, not worth an all-gather"
    sizes = chunk_sizes(mod.out_channels, tp)
    if min(sizes) < MIN_GATHER_CHANNELS:
        return (
            f"too small to split at tp={tp}: its {mod.out_channels} output channels give a "
            f"rank {min(sizes)} (fewer than {MIN_GATHER_CHANNELS})"
        )
    return None


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
    # a mask broadcast over the channels
    | {"masked_fill", "masked_fill_"}
)
#: elementwise ops whose operands may come in either order (``mask * x``)
_COMMUTATIVE = frozenset({"mul", "mul_", "add", "add_", "__mul__", "__rmul__", "__add__"})
_COMMUTATIVE |= {"__radd__", "__iadd__", "__imul__"}
#: the tag of a column's output: the packed halves are still in place (nothing but elementwise
#: ops since the column) / they were consumed (after a GLU, a norm or a grouped convolution)
_DIRECT, _FOLLOWED = 0, 1


@dataclass
class ConvPairs:
    """What `conv_pairs` found: ``styles`` (module -> style), ``fixups`` (module -> its plan
    fix-up), ``notes`` (module -> why, for `tpkit plan`), ``broken`` (a convolution whose pair
    broke -> what broke it)."""

    styles: dict[str, str] = field(default_factory=dict)
    fixups: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)


def shared_params(model: nn.Module) -> set[int]:
    """ids of the parameters held by more than one module (tied): never split per layer."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    return {k for k, v in counts.items() if v > 1}


def splittable_conv(
    module: nn.Module, shared: set[int], exact: frozenset[int] | None = None
) -> bool:
    """A convolution or norm the paired styles may split: its own parameters (none in
    ``shared``), not parametrized (weight norm computes over the whole weight), and its class's
    own ``forward`` (a subclass's forward could read across the weight), or a convolution
    subclass whose forward a probe shows computes each output channel from that channel's
    weight rows alone (`rows_exact`: weight standardization); such a one is only ever split by
    its output channels (never read split: the roles `conv_pairs` gives check `own_forward`).
    ``exact``: the ids of the modules whose probe passed (`exact_row_convs`), probed before
    the fake forwards that ask; without it the module is probed here, outside any forward."""
    if is_parametrized(module) or any(id(p) in shared for p in module.parameters(recurse=False)):
        return False
    if own_forward(module):
        return True
    return id(module) in exact if exact is not None else rows_exact(module)


def own_forward(module: nn.Module) -> bool:
    """``module`` is a convolution or norm running its torch class's own ``forward``."""
    base = next((c for c in (*CONVS, *TRANSPOSED_CONVS, *NORMS) if isinstance(module, c)), None)
    return base is not None and type(module).forward is base.forward


def exact_row_convs(model: nn.Module) -> frozenset[int]:
    """ids of ``model``'s convolution subclasses whose own forward `rows_exact` shows exact on
    their rows of the weight: probed once, here, outside the fake forwards that ask
    (`splittable_conv`'s ``exact``)."""
    return frozenset(id(m) for m in model.modules() if rows_exact(m))


def rows_exact(module: nn.Module) -> bool:
    """A convolution subclass with its own ``forward`` (BiT's ``WeightStandardizedConv2d``:
    the weight standardized per output channel, then ``conv2d``) whose output channels are
    exact when each rank runs that forward on its rows of the weight (and bias), its
    ``out_channels`` set to their count (the plan's ``shard_width`` fix-up): checked once per
    module by running it on small random float64 weights and input, whole and per rank's rows
    at tp 2 and 3, every part compared with the whole output's channels. A transform over the
    input channels (weight standardization spans them) makes the module unfit to be read
    split: it is only ever split by output channels. Anything the probe cannot run (children
    with parameters or buffers, an error) is False: the module stays whole. Run it outside a
    fake forward (`exact_row_convs`)."""
    if not isinstance(module, CONVS) or own_forward(module):
        return False
    try:
        return _probe_rows(module)
    except Exception:  # noqa: BLE001 - model code may do anything: not provably exact
        return False


def _probe_rows(module: nn.Module) -> bool:
    if any(True for c in module.children() for _ in (*c.parameters(), *c.buffers())):
        return False
    if any(b is not None for b in module._buffers.values()):
        return False
    gen = torch.Generator().manual_seed(0)
    params = {
        n: torch.randn(p.shape, generator=gen, dtype=torch.float64, device="cpu")
        for n, p in module._parameters.items()
        if p is not None
    }
    kernel, stride, dilation = module.kernel_size, module.stride, module.dilation
    spatial = [dilation[i] * (kernel[i] - 1) + 2 * stride[i] + 1 for i in range(len(kernel))]
    x = torch.randn(
        2, module.in_channels, *spatial, generator=gen, dtype=torch.float64, device="cpu"
    )

    def run(rows: slice | None) -> torch.Tensor:
        probe = copy.copy(module)  # shallow: its own dicts below, nothing of the module changed
        probe._forward_hooks, probe._forward_pre_hooks = OrderedDict(), OrderedDict()
        local = {n: (p if rows is None else p[rows]) for n, p in params.items()}
        probe._parameters = {n: local.get(n) for n in module._parameters}  # None kept (bias)
        probe._buffers = {}
        probe.out_channels = local["weight"].shape[0]
        return type(module).forward(probe, x)

    with torch.no_grad():
        whole = run(None)
        out = module.out_channels
        if not isinstance(whole, torch.Tensor) or whole.ndim < 2 or whole.shape[1] != out:
            return False
        for tp in (2, 3):
            for r, size in enumerate(chunk_sizes(out, tp)):
                lo = r * chunk_sizes(out, tp)[0]
                if size and not torch.allclose(
                    run(slice(lo, lo + size)), whole[:, lo : lo + size], rtol=1e-9, atol=1e-12
                ):
                    return False
    return True


def conv_pairs(
    model: nn.Module,
    tp: int,
    splittable: Callable[[str, nn.Module], bool],
    example: tuple | Mapping | None = None,
    recipe: InputRecipe | None = None,
    analysis: Analysis | None = None,
) -> ConvPairs:
    """The convolution pairs of ``model`` at ``tp`` (see the module docstring), found on one
    fake-tensor forward per fixpoint round (``example``: the trace inputs, else made up from
    the model as ``recipe`` says). ``splittable(name, module)`` says whether a module may be
    split at all (the fallback's checks: not shared, not parametrized, not an overridden
    forward), asked inside those forwards. A model whose forward cannot run on fake tensors
    pairs nothing (nor does one without a convolution). With ``analysis`` (of ``model``), each
    forward folds the twin layers that hold no convolution or norm (`_conv_free`). A model
    none of whose convolutions could take a role (`_may_take_a_role`: Mamba's depthwise
    convolutions only) pairs nothing without a forward."""
    if not any(_may_take_a_role(m, tp) for m in model.modules()):
        return ConvPairs()
    excluded: set[str] = set()
    broken: dict[str, str] = {}

    def forward(values: bool) -> _ConvTrace:
        def run(twins: Twins) -> _ConvTrace:
            trace = _ConvTrace(model, tp, splittable, excluded)
            return trace.run(example, values=values, recipe=recipe, twins=twins)

        return run(Twins()) if analysis is None else analysis.folding(run, purpose="conv pairs")

    for _ in range(_ROUNDS):
        try:
            found = forward(False)
        except Exception as exc:  # noqa: BLE001 - model code may do anything: no pairs
            if not needs_values(exc):
                return ConvPairs(broken=broken)
            try:  # data-dependent code (a layerdrop draw, a mask's length): made-up values
                found = forward(True)
            except Exception:  # noqa: BLE001 - as above
                return ConvPairs(broken=broken)
        newly = {s: why for s, why in found.broken.items() if s not in excluded}
        newly.update({s: "nothing reads its split channels" for s in found.unpaired()})
        newly = {s: why for s, why in newly.items() if s not in excluded}
        if not newly:
            return _result(found, broken, tp)
        broken.update(newly)
        excluded |= newly.keys()
    return ConvPairs(broken=broken)


def _may_take_a_role(mod: nn.Module, tp: int) -> bool:
    """Whether convolution ``mod`` could be a column or be gathered in `_ConvTrace._pre` (a
    superset: the splittable and exclusion checks left out). Every other role (a row, a
    follower) and every break needs a column's split channels, so a model with no such
    convolution gets nothing from the forward: `conv_pairs` skips it (Zamba's 76 Mamba layers
    hold depthwise convolutions only, read whole)."""
    if not isinstance(mod, CONVS + TRANSPOSED_CONVS):
        return False
    if mod.groups == 1 and min(chunk_sizes(mod.out_channels, tp)) >= 1:
        return True  # a column candidate
    own = own_forward(mod)
    return (
        isinstance(mod, CONVS)
        and (mod.groups > 1 or not own)
        and not_gathered(mod, tp, depthwise=not own) is None
    )


def _conv_free(model: nn.Module, twins: Twins) -> Twins:
    """``twins`` less every kind of layer that holds a convolution or a norm: the conv trace
    reads those at their boundaries (`_ConvTrace._pre`), so each must run as itself. What is
    left is exact to fold here: a layer with none of them changes nothing the trace keeps
    unless it is handed, or computes with, a tensor carrying split channels, and that breaks
    the fold (`_ConvTrace._enter`, `_ConvTrace.__torch_function__`)."""
    if not twins:
        return twins
    modules = dict(model.named_modules())
    held = CONVS + TRANSPOSED_CONVS + NORMS
    kinds = {
        r for r in set(twins.rep.values()) if any(isinstance(m, held) for m in modules[r].modules())
    }
    rep = {t: r for t, r in twins.rep.items() if r not in kinds}
    watched = {r: w for r, w in twins.watched.items() if r in set(rep.values())}
    return Twins(rep, watched, twins.tally, twins.layers, twins.distinguishing, twins.fixed)


def _result(found: _ConvTrace, broken: dict[str, str], tp: int) -> ConvPairs:
    out = ConvPairs(broken=broken)
    members: dict[str, list[str]] = {}
    counts: dict[str, dict[str, int]] = {}
    for col, rows in found.rows.items():
        partners = ", ".join(sorted(rows))
        members[col] = [col, *sorted(rows)]
        counts[col] = {}
        if col in found.packed:
            out.styles[col] = "conv_packed_colwise"
            out.notes[col] = (
                f"paired convolution: output channels split per GLU half (a_r | b_r), read "
                f"split by {partners}"
            )
        else:
            out.styles[col] = "conv_colwise"
            out.notes[col] = f"paired convolution: output channels split, read split by {partners}"
        if not own_forward(found.modules[col]):  # its forward reads out_channels (a reshape)
            out.fixups[col] = {"shard_width": {"out_channels": ["weight", 0]}}
            out.notes[col] += "; its own forward transforms the weight per output channel"
        for row in sorted(rows):  # a set: its order would follow the hash seed
            out.styles[row] = "conv_rowwise"
            out.notes[row] = f"paired convolution: input channels split (from {col}), all-reduced"
    for name, (col, mod) in found.followers.items():
        if col not in found.rows:
            continue
        members[col].append(name)
        if isinstance(mod, nn.GroupNorm):
            counts[col][f"groups of {name}"] = mod.num_groups
        elif not isinstance(mod, NORMS):
            counts[col][f"groups of {name}"] = mod.groups
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
    out.groups = [{"modules": members[col], "owners": [], "counts": counts[col]} for col in members]
    for name in sorted(found.gathered - out.styles.keys() - found.sources):
        mod = found.modules[name]
        out.styles[name] = "conv_colwise_gather"
        if mod.groups > 1:
            out.notes[name] = (
                f"grouped convolution (groups={mod.groups}) read whole: output channels split "
                "(rows padded to whole groups, input narrowed to them), all-gathered"
            )
        else:
            out.notes[name] = "output channels split, all-gathered"
        if not own_forward(mod):
            out.fixups[name] = {"shard_width": {"out_channels": ["weight", 0]}}
            out.notes[name] += (
                "; its own forward transforms the weight per output channel (checked on random "
                "weights), over the input channels too: never read split"
            )
        out.groups.append({"modules": [name], "owners": [], "counts": {}})
    return out


_tensors = tensors_in


def _is_scalar(obj: Any) -> bool:
    return not isinstance(obj, torch.Tensor) or obj.numel() <= 1


def _broadcasts_over(other: torch.Tensor, src: torch.Tensor, dim: int) -> bool:
    """``other`` broadcasts against ``src`` without a size at ``src``'s channel dim ``dim``
    (a mask ``[batch, 1, time]``), so every channel sees the same values of it."""
    at = dim - (src.ndim - other.ndim)
    return other.ndim <= src.ndim and (at < 0 or other.shape[at] == 1)


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
        # id(tensor) -> (column candidate, channel dim, _DIRECT or _FOLLOWED)
        self.tag: dict[int, tuple[str, int, int]] = {}
        self.keep: list[torch.Tensor] = []  # ids stay unique while the trace runs
        self.inside: list[str] = []  # convs and norms running: their own calls are theirs
        self.plans: dict[str, tuple[str, str, int]] = {}  # module -> (role, column, kernel dims)
        self.calls: dict[str, int] = {}
        self.rows: dict[str, set[str]] = {}  # column candidate -> the convs reading it split
        self.followers: dict[str, tuple[str, nn.Module]] = {}
        self.sources: set[str] = set()
        self.packed: set[str] = set()  # columns whose output a GLU splits into halves
        self.direct: dict[str, str] = {}  # column -> a module reading its halves unconsumed
        self.broken: dict[str, str] = {}
        self.gathered: set[str] = set()  # grouped / transformed convs read whole: gathered
        self.modules = dict(model.named_modules())
        self.folded = 0  # folded layers running (`run`'s ``twins``): split channels break it

    # -- the forward ---------------------------------------------------------------------------
    def run(
        self,
        example: tuple | Mapping | None,
        values: bool = False,
        recipe: InputRecipe | None = None,
        twins: Twins | None = None,
    ) -> _ConvTrace:
        """One fake forward; ``values``: with `ShadowValues` (code that reads a value);
        ``twins``: the layers folded (`tpkit.trace.fold`), those `_conv_free` leaves."""
        model, hooks = self.model, []
        fake = fake_mode()
        given = GivenValues()
        with quiet_fake_tensors():  # before the hooks: an audio-LLM's inputs run its tower
            args, kwargs = fake_inputs(model, example, fake, False, recipe, given)
        twins = _conv_free(model, Twins() if twins is None else twins)
        for mod in model.modules():
            if isinstance(mod, CONVS + TRANSPOSED_CONVS + NORMS) or mod is model:
                hooks.append(mod.register_forward_pre_hook(self._pre, with_kwargs=True))
                hooks.append(mod.register_forward_hook(self._post, with_kwargs=True))
        modules = self.modules
        for name in {*twins.rep, *twins.rep.values()}:
            hooks.append(modules[name].register_forward_pre_hook(self._enter, with_kwargs=True))
            hooks.append(modules[name].register_forward_hook(self._leave, always_call=True))
        try:
            with quiet_fake_tensors():
                shadow = ShadowValues(fake, given) if values else None
                describe = known_values(shadow) if shadow is not None else None
                with (
                    folded(model, twins, describe=describe),
                    meta_state(model, fake),
                    torch.no_grad(),
                    fake,
                    shadow if shadow is not None else contextlib.nullcontext(),
                    self,
                ):
                    model(*args, **kwargs)
        finally:
            for h in hooks:
                h.remove()
        for name, count in self.calls.items():
            if count > 1:  # one module, two roles or two inputs: nothing here can tell
                role, col, _ = self.plans.get(name, ("", "", 0))
                # sorted: a set's order follows the hash seed, and the broken (so the
                # plan's groups) keep this order
                for c in sorted({col, name} & (self.sources | self.rows.keys())):
                    self._break(c, f"{name} runs more than once")
        for col in self.packed & self.direct.keys():  # one layout cannot serve both readers
            self._break(col, f"{self.direct[col]} reads its channels before the GLU halves them")
        return self

    def unpaired(self) -> list[str]:
        return [s for s in self.sources if s not in self.broken and not self.rows.get(s)]

    def _break(self, col: str, why: str) -> None:
        self.broken.setdefault(col, why)

    def _set(self, t: torch.Tensor, col: str, dim: int, stage: int) -> None:
        self.keep.append(t)
        self.tag[id(t)] = (col, dim, stage)

    # -- folded layers: exact only while no split channels reach them ------------------------
    def _enter(self, mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if any(id(t) in self.tag for t in _tensors((args, kwargs))):
            raise FoldBroken(f"{self.names[id(mod)]} is handed a convolution's split channels")
        self.folded += 1

    def _leave(self, mod: nn.Module, args: tuple, output: Any) -> None:
        self.folded -= 1

    # -- module boundaries: convolutions and norms -------------------------------------------
    def _pre(self, mod: nn.Module, args: tuple, kwargs: dict) -> None:
        name = self.names[id(mod)]
        if mod is self.model or self.inside:
            return
        self.calls[name] = self.calls.get(name, 0) + 1
        self.inside.append(name)
        ins = _tensors((args, kwargs))
        x = ins[0] if ins else None
        col, dim, stage = self.tag.get(id(x), ("", 0, 0)) if x is not None else ("", 0, 0)
        if col and stage == _DIRECT:
            self.direct.setdefault(col, name)
        for t in ins[1:]:  # a second split input (output_size is ints): not per channel
            if id(t) in self.tag:
                self._break(self.tag[id(t)][0], f"{name} reads it as a second input")
        kernel = mod.weight.ndim - 2 if isinstance(mod, CONVS + TRANSPOSED_CONVS) else 0
        plain = self.splittable(name, mod)
        own = own_forward(mod)
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
            elif mod.groups == 1 and plain and own:
                self.plans[name] = ("row", col, kernel)
                self.rows.setdefault(col, set()).add(name)
            elif isinstance(mod, CONVS) and plain and own and mod.groups % self.tp == 0:
                self.plans[name] = ("follow", col, kernel)
                self.followers[name] = (col, mod)
            else:
                why = "cannot be split" if not plain else f"has groups={mod.groups}"
                if plain and not own:
                    why = "transforms its weight over the input channels in its own forward"
                self._break(col, f"{name} {why} (tp={self.tp})")
            return
        sizes = chunk_sizes(mod.out_channels, self.tp)
        if mod.groups == 1 and plain and name not in self.excluded and min(sizes) >= 1:
            self.plans[name] = ("col", name, kernel)
            self.sources.add(name)
        elif (
            isinstance(mod, CONVS)
            and plain
            and (mod.groups > 1 or not own)
            and not_gathered(mod, self.tp, depthwise=not own) is None
        ):
            self.gathered.add(name)  # its input whole: gathered on its own

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
            self._set(y, col, dim, _DIRECT if role == "col" else _FOLLOWED)
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
        if self.folded:
            raise FoldBroken("a folded layer computes with a convolution's split channels")
        outs = _tensors(out)
        if not outs:
            return out  # metadata (size(), dim()): no values read
        name = getattr(func, "__name__", "")
        cols = {self.tag[id(t)][0] for t in tagged}
        if len(cols) > 1:
            for c in sorted(cols):  # as `run`'s breaks: not in the hash seed's order
                self._break(c, f"{name}() mixes it with another convolution's channels")
            return out
        col, dim, stage = self.tag[id(tagged[0])]
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in _COMMUTATIVE and len(tagged) == 1 and src is not tagged[0]:
            src, args = tagged[0], (tagged[0], *(a for a in args if a is not tagged[0]))
        if name == "glu":
            return self._glu(out, args, kwargs, col, dim, stage)
        new_dim = self._per_channel(name, args, kwargs, src, dim, tagged)
        if new_dim is None:
            self._break(col, f"{name}() reads across its channels or mixes them")
            return out
        for t in outs:
            if t.is_floating_point() and t.ndim > new_dim and t.shape[new_dim] == src.shape[dim]:
                self._set(t, col, new_dim, stage)
        return out

    def _glu(self, out, args, kwargs, col: str, dim: int, stage: int) -> Any:
        """``glu(x, dim)`` over the channels of a column's own output: its two halves are a
        packed pair, each rank's GLU gives its channels of the result (see the module doc)."""
        x = args[0]
        glu_dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
        if not isinstance(out, torch.Tensor) or glu_dim % x.ndim != dim:
            self._break(col, "glu() over another dim than its channels")
        elif stage != _DIRECT or id(x) not in self.tag or x.shape[dim] % 2:
            self._break(col, "glu() halves channels that are no longer its own output's")
        elif not own_forward(self.modules[col]):  # its probe checked contiguous rows only
            self._break(col, "glu() halves the channels of a convolution with its own forward")
        else:
            self.packed.add(col)
            self._set(out, col, dim, _FOLLOWED)
        return out

    def _per_channel(self, name, args, kwargs, src, dim, tagged) -> int | None:
        """The channel dim of the result when ``name`` computes each channel from that channel
        alone; None when it does not (or cannot be told)."""
        if src is None or id(src) not in self.tag or len(tagged) > 1:
            return None
        others = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)]
        if name in _PER_CHANNEL and reduced_dims(name, args, kwargs, src.ndim) is None:
            # a tensor with size 1 at the channels (or no such dim) is the same for each one
            others = [a for a in others if not _broadcasts_over(a, src, dim)]
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
