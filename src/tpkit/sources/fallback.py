"""The per-layer fallback: a plan for any model, with no trace.

When the model's dataflow cannot be traced (its forward needs inputs tpkit cannot make up, or
code fake tensors cannot run), or the trace recognises nothing to split, each layer is split on
its own, its input and output whole, so whatever code sits between layers sees exactly the
unsharded values:

- ``nn.Linear`` / transformers' ``Conv1D``: ``colwise_gather_output`` (output features split,
  then all-gathered);
- ``nn.Embedding``: ``vocab_parallel`` (rows split, the masked lookups all-reduced: exact for
  any ids), ``colwise_embedding_gather`` (columns split, gathered) where the rows are too few;
- ``nn.EmbeddingBag``: ``colwise_embedding_gather`` (exact in every bag mode);
- ``nn.Conv1d`` / ``Conv2d`` / ``Conv3d``: ``conv_colwise_gather`` (output channels split,
  all-gathered on the channel dim, `tpkit.styles.conv`; a grouped one's rows padded to whole
  groups and its input narrowed to them, `tpkit.plan.layout.GroupedRows`, so any groups are
  exact at any tp), unless it pairs:
  convolutions whose channels reach another convolution only through per-channel ops
  (activations, pooling, BatchNorm, GroupNorm and grouped convolutions tp divides) are split
  like a column/row pair instead, one all-reduce per pair (`tpkit.sources.convs`), transposed
  convolutions included.

Weights and matmul work are still divided by tp; each layer costs one collective, so this is the
slowest exact split, which is why a traced plan is always tried first. A layer too small to be
worth it (fewer than `MIN_PER_RANK` features or rows per rank), a weight shared with another
module or read outside its forward, a subclass that overrides ``forward`` (the style runs it
on the shard, and it may compute over the whole weight), ``max_norm`` (renormalises each row
over all its columns), sparse gradients, a parametrized weight (weight norm) and depthwise
convolutions (one input channel per group: a kernel per channel, as small as a norm's, not
worth an all-gather) stay whole. The old ``tensor_parallel`` package split every
layer this way; tpkit keeps it as the floor under inference instead of a refusal.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from types import MappingProxyType

from torch import nn
from torch.nn.utils.parametrize import is_parametrized

from tpkit.plan.layout import kind_of, out_width, param_layouts
from tpkit.plan.spec import Plan
from tpkit.settle.fits import MIN_PER_RANK, experts_unfit, too_small
from tpkit.sources.attention import mha_splits
from tpkit.sources.convs import (
    CONVS,
    conv_pairs,
    exact_row_convs,
    not_gathered,
    shared_params,
    splittable_conv,
)
from tpkit.sources.experts import fused_experts
from tpkit.trace.analysis import Analysis

__all__ = ["MIN_PER_RANK", "SOURCE", "fallback_plan", "splits_anything"]

#: the source the fallback's entries carry (`Plan.source`, `tpkit plan`'s table)
SOURCE = "fallback"
#: the forwards the fallback's styles are exact for (a subclass that keeps them is fine)
_CONVS = CONVS
_BASE_FORWARD = MappingProxyType(
    {
        "linear": nn.Linear.forward,
        "embedding": nn.Embedding.forward,
        "bag": nn.EmbeddingBag.forward,
        **{c: c.forward for c in _CONVS},
    }
)


def fallback_plan(
    model: nn.Module,
    why: str,
    tp_size: int | None = None,
    read_outside: Collection[str] = (),
    example: tuple | Mapping | None = None,
    analysis: Analysis | None = None,
) -> Plan:
    """Every Linear, Conv1D, Embedding and EmbeddingBag of ``model`` split on its own, its
    output gathered (see the module docstring). ``why`` (why the dataflow is not used) goes
    into each split layer's note, so `tpkit plan` names the layers that took the fallback.
    ``tp_size`` (2 when unknown) decides which layers are too small to split;
    ``read_outside`` names layers a trace saw computed with outside their own forward (a
    weight read directly elsewhere sees only this rank's part), which stay whole. Convolution
    pairs (`tpkit.sources.convs`) are found on a fake forward with ``example`` (the trace inputs,
    else made up as ``analysis`` settled them) and take the paired styles; a model that cannot
    be traced pairs none. The per-layer size rules are settling's (`tpkit.settle.fits`:
    `too_small`, `experts_unfit`)."""
    tp = tp_size if tp_size and tp_size > 1 else 2
    analysis = Analysis(model, example) if analysis is None else analysis
    shared = shared_params(model) - _tied_tables(model, tp)
    shared.update(id(model.get_submodule(n).weight) for n in read_outside)
    exact = exact_row_convs(model)
    plan = Plan()
    analysis.settle_inputs()  # the conv pairs' forwards are fed as the trace settled it
    splittable = lambda _, mod: splittable_conv(mod, shared, exact)  # noqa: E731
    pairs = conv_pairs(model, tp, splittable, analysis.example, analysis.recipe, analysis)
    for name, style in pairs.styles.items():
        plan.set(name, style, SOURCE)
        plan.notes[name] = f"per-layer fallback, {pairs.notes[name]}: {why}"
    plan.fixups.update(pairs.fixups)
    attention, _, whole = mha_splits(model, shared, tp=tp)  # exact wherever they sit: by heads
    for name, style in attention.items():
        plan.set(name, style, SOURCE)
        plan.notes[name] = f"per-layer fallback, split by heads: {why}"
    plan.notes.update((name, f"replicated: {reason}") for name, reason in whole.items())
    experts: list[str] = []  # fused experts split here: their parameters are theirs
    for name, mod in model.named_modules():
        if not name or name in pairs.styles or name in attention or name in whole:
            continue  # the model itself: never a leaf layer worth a collective
        if any(name.startswith(f"{e}.") for e in experts):
            continue
        split, reason = _experts_styles(mod, tp, shared)
        if split:
            plan.set(name, "moe_tp_experts", SOURCE)
            for param, style in split.items():
                plan.set(f"{name}.{param}", style, SOURCE)
            plan.notes[name] = f"per-layer fallback, experts split by intermediate width: {why}"
            experts.append(name)
            continue
        if reason is not None:
            plan.notes[name] = f"replicated: {reason}"
            continue
        style, reason = _style(mod, tp, shared)
        if style == "conv_colwise_gather" and name in pairs.broken:
            why_gathered = f"{why}; not paired: {pairs.broken[name]}"
            plan.set(name, style, SOURCE)
            plan.notes[name] = f"per-layer fallback: {why_gathered}"
            continue
        if style is not None:
            plan.set(name, style, SOURCE)
            plan.notes[name] = f"per-layer fallback: {why}"
        elif reason is not None:
            plan.notes[name] = f"replicated: {reason}"
    return plan


def _tied_tables(model: nn.Module, tp: int) -> set[int]:
    """ids of the tied weights whose every holder is a plain ``nn.Linear`` or ``nn.Embedding``
    holding it as its ``weight`` (a BERT decoder's word table and the head tied to it) and
    whose fallback style at ``tp`` splits its rows (``colwise_gather_output``,
    ``vocab_parallel``): each holder splits the same rows of the same [rows, columns] weight
    and computes only with it in its own forward, so the tie is split one way and each holder
    is exact as an untied one; left whole, a speech-encoder-decoder's BERT decoder kept its
    10% table whole at full size. A holder that would stay whole (an Embedding with
    ``max_norm``) or split the columns keeps the tie whole: one layout for every holder."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for pname, p in mod._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((mod, pname))
    plain = (nn.Linear, nn.Embedding)
    return {
        key
        for key, hold in holders.items()
        if len(hold) > 1
        and all(
            pname == "weight"
            and any(type(mod).forward is c.forward and isinstance(mod, c) for c in plain)
            and _style(mod, tp, set())[0] in _ROW_STYLES
            for mod, pname in hold
        )
    }


#: the fallback styles that split a weight's rows (dim 0) alike, a tied table's one layout
_ROW_STYLES = ("colwise_gather_output", "vocab_parallel")


def _experts_styles(mod: nn.Module, tp: int, shared: set[int]) -> tuple[dict, str | None]:
    """({parameter: style}, None) for transformers' fused experts to split along each
    expert's intermediate width (`tpkit.sources.experts.fused_experts`: their input whole, their
    output a partial sum all-reduced, so exact whatever code runs around them, as a gathered
    layer is); ({}, why) for fused experts left whole; ({}, None) for any other module. Left
    whole: modules with parameters inside the experts (no trace says they read only the
    summed output), shared or parametrized weights, an interleaved gate/up that tp does not
    divide (a cut would split a gate from its up), and fewer than `MIN_PER_RANK` channels of
    the intermediate width per rank (`tpkit.settle.fits.experts_unfit`)."""
    styles = fused_experts(mod)
    if not styles:
        return {}, None
    if any(True for c in mod.children() for _ in c.parameters()):
        return {}, "fused experts with parameters inside them: nothing traced says what they read"
    if is_parametrized(mod) or any(id(p) in shared for p in mod.parameters(recurse=False)):
        return {}, "its weights are parametrized, shared, or read outside its forward"
    down = mod.down_proj
    inter = int(down.shape[1] if mod.__dict__.get("is_transposed") is True else down.shape[2])
    interleaved = mod.__dict__["has_gate"] and not mod.__dict__["is_concatenated"]
    unfit = experts_unfit(inter, interleaved, tp)
    return ({}, unfit) if unfit else (styles, None)


def _style(mod: nn.Module, tp: int, shared: set[int]) -> tuple[str | None, str | None]:
    """(style, None) for a layer to split, (None, why) for one left whole on purpose, (None,
    None) for every other module."""
    kind = kind_of(mod)
    if isinstance(mod, nn.EmbeddingBag):
        kind = "bag"
    elif isinstance(mod, _CONVS):
        kind = next(c for c in _CONVS if isinstance(mod, c))
    if kind not in _BASE_FORWARD and kind != "conv1d":
        return None, None
    if is_parametrized(mod):  # weight norm: the parameters are not the weight's layout
        return None, "its weight is parametrized"
    weight = mod.weight
    if id(weight) in shared:
        return None, "its weight is shared with another module or read outside its forward"
    if kind != "conv1d" and type(mod).forward is not _BASE_FORWARD[kind]:
        # a style runs the module's own forward on its shard: one that computes over the whole
        # weight (a norm of it) would be wrong, and nothing here can tell
        return None, f"{type(mod).__name__} overrides forward: what it computes is unknown"
    if kind in _CONVS:
        # a grouped one too: each rank's rows padded to whole groups, its input narrowed to
        # them (`tpkit.plan.layout.GroupedRows`), exact whether or not tp divides the groups;
        # depthwise and too few rows per rank decided as for `tpkit.sources.convs`' gathers
        why = not_gathered(mod, tp)
        return (None, why) if why else ("conv_colwise_gather", None)
    bag = kind == "bag"
    if bag or kind == "embedding":
        if mod.max_norm is not None:
            return None, f"max_norm={mod.max_norm} renormalises each row over all its columns"
        if getattr(mod, "sparse", False):
            return None, "sparse gradients"
        rows, cols = weight.shape
        if not bag and not too_small(rows, tp):
            return "vocab_parallel", None
        small = too_small(cols, tp)
        return (None, small) if small else ("colwise_embedding_gather", None)
    small = too_small(out_width(mod, kind), tp)
    return (None, small) if small else ("colwise_gather_output", None)


def splits_anything(model: nn.Module, plan: Plan) -> bool:
    """True when ``plan`` splits at least one of ``model``'s parameters."""
    return any(layout.sharded for _, layout, _ in param_layouts(model, plan).values())
