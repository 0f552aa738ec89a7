"""The dry run: one forward of the split model on fake tensors, before anything is split.

Each sharded parameter is swapped for a fake meta tensor of rank 0's shard shape, the plan's
fix-ups are applied as the real split applies them (`tpkit.plan.fixups`), and layers whose style
gathers or slices change the widths they hand on (a gathered head, a row layer slicing its own
input). If the model's code still runs, the plan fits it: nothing is allocated, computed or
communicated, so derivation and settling can try plans freely (transformers' plan, the inferred
one, one with a group gathered or left whole) and validation can check a user's entries. A
failure names the first error. The dry run only answers "does this plan run at tp?"; what to do
when it does not is `tpkit.settle.settle`'s.

Running is not enough: a reshape can fit a shard and still cut it in the wrong place. CodeGen's
``qkv_proj`` output is 4 fixed groups of [q | v | k] (``mp_num``), viewed as
``(-1, 3 * embed_dim // 4)``: with ``embed_dim`` divided the view fits every shard, but each
rank's groups are cut into quarters-of-groups and q, v and k read each other's features (no
error, wrong numbers). So every fake dry run also compares its reshapes with those of the
unsplit model's fake forward (`_cut_inside`): a shard's view may only have fewer of the outermost
blocks a split last dim (a column layer's features) is viewed as, never blocks of another size;
else it fails like a reshape that does not fit, and settling gathers or keeps that group whole.
The unsplit forward is run once per analysis, and not at all where the trace ran it already
(`tpkit.trace.trace.Trace.reshapes`: a fake trace, less the calls this fold would stand) and
a split run's reshapes match it in number, module by module.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tpkit.compat import fake_mode
from tpkit.plan.catalogue import style_spec
from tpkit.plan.fixups import apply_fixups
from tpkit.plan.layout import (
    chunk_offset,
    grouped_rows_hooks,
    in_width,
    kind_of,
    local_shape,
    out_width,
    param_layout,
    param_layouts,
)
from tpkit.plan.spec import Plan
from tpkit.settle.settle import lay_out
from tpkit.trace.analysis import Analysis, plan_key
from tpkit.trace.fake import (
    REAL_TRACE_MAX_PARAMS,
    fake_friendly_experts,
    fake_inputs,
    meta_state,
    quiet_fake_tensors,
    real_state,
)
from tpkit.trace.fold import Twins, folded, known_values, plan_twins
from tpkit.trace.shadow import GivenValues, ShadowValues, metadata_only, needs_values
from tpkit.trace.trace import record_reshape

__all__ = ["dry_run"]

_NOTHING_LEARNED = "<nothing learned>"


def dry_run(analysis: Analysis, plan: Plan, tp: int) -> str | None:
    """None when the analysed model runs with ``plan`` at ``tp`` on fake tensors (rank 0's
    shard shapes, fix-ups applied; the last rank's too when a split is uneven), else the error
    in brief. A model whose code needs real values (a data-dependent branch) is dry-run again
    with made-up routing values (`tpkit.trace.shadow`), then on its real weights with zero
    shards when it is small, and otherwise counts as passing: nothing can be learned without
    running it. Each question (the plan's content, ``tp``) is answered once per analysis
    (`tpkit.trace.analysis.Analysis.answers`): settling asks the same ones again."""
    key = (plan_key(plan), tp)
    if key not in analysis.answers:
        analysis.settle_inputs()  # fed as the trace settled it (one row, the text alone)
        run = lambda twins: _dry_run(analysis, plan, tp, twins)  # noqa: E731
        analysis.answers[key] = analysis.folding(run, purpose="dry run")
    return analysis.answers[key]


def _dry_run(analysis: Analysis, plan: Plan, tp: int, twins: Twins) -> str | None:
    for rank in (0, tp - 1) if _uneven(analysis.model, plan, tp) else (0,):
        error = _dry_run_modes(analysis, plan, tp, rank, twins)
        if error is not None:
            return error
    return None


def _dry_run_modes(analysis: Analysis, plan: Plan, tp: int, rank: int, twins: Twins) -> str | None:
    """A plain fake run; where it meets a data-dependent branch, one with made-up routing
    values (`tpkit.trace.shadow`); where that learns nothing either, a real one (small models).

    A model whose plain fake run met such a branch once meets it in every dry run (its routing
    is its code's, not the plan's), so later dry runs of the analysis (``needs_values``) start
    with the values: the plain try that fails costs 20-25% of planning an audio LLM or a MoE.
    The answer stays the plain run's wherever that one could differ: when the run with values
    fails, the plain run is asked too, and its own error (met before any data-dependent
    branch, or one the values do not meet) is the answer, as it was."""
    model = analysis.model
    plain = lambda: _dry_run_once(analysis, plan, tp, real=False, rank=rank, twins=twins)  # noqa: E731
    if analysis.needs_values:
        error = _dry_run_once(analysis, plan, tp, real=False, values=True, rank=rank, twins=twins)
        if error is not None:
            first = plain()
            error = error if first == _NOTHING_LEARNED else first
    else:
        error = plain()
        if error == _NOTHING_LEARNED:  # data-dependent routing: made-up values (`plan.shadow`)
            analysis.needs_values = True
            error = _dry_run_once(
                analysis, plan, tp, real=False, values=True, rank=rank, twins=twins
            )
    if error == _NOTHING_LEARNED:
        params = list(model.parameters())
        real = params and params[0].device.type != "meta"
        small = sum(p.numel() for p in params) <= REAL_TRACE_MAX_PARAMS
        run = real and small
        error = _dry_run_once(analysis, plan, tp, real=True, rank=rank) if run else None
    return None if error == _NOTHING_LEARNED else error


def _uneven(model: nn.Module, plan: Plan, tp: int) -> bool:
    """Some parameter's shard is smaller on the last rank than on rank 0, where that can
    change the forward. It cannot for a plain ``nn.Linear`` whose output the style gathers
    and no fix-up touches (a vocabulary head: Inkling-2's 200,058 rows at tp=8): ``F.linear``
    takes a weight of any height, and the dry run hands on the gathered width on every rank
    (`_width_hooks`), so from there on the last rank's run is rank 0's."""
    layouts = param_layouts(model, plan)
    gathered = _gathered_linears(model, plan)
    for name, p in model.named_parameters(remove_duplicate=False):
        layout, shape = layouts[name][1], tuple(p.shape)
        if layout.sharded and local_shape(shape, layout, tp, 0) != local_shape(
            shape, layout, tp, tp - 1
        ):
            owner, _, pname = name.rpartition(".")
            if owner not in gathered or pname not in ("weight", "bias"):
                return True
    return False


def _gathered_linears(model: nn.Module, plan: Plan) -> set[str]:
    """Plain ``nn.Linear`` layers whose output the plan gathers, with no fix-up of their own."""
    return {
        t.name
        for t in plan.resolve(model)
        if t.kind == "module"
        and style_spec(t.style).collective == "all_gather"
        and type(model.get_submodule(t.name)) is nn.Linear
        and not plan.fixups_for(t.name)
    }


def _shard_shapes(model: nn.Module, plan: Plan, tp: int, rank: int = 0) -> dict[int, tuple]:
    """id(parameter) -> ``rank``'s shard shape, for every parameter the plan splits."""
    layouts = param_layouts(model, plan)
    # an attention split by heads is one self-contained region (whole in, whole out): its
    # forward runs as it is, on whole weights, with its out_proj's
    whole = tuple(f"{t.name}." for t in plan.resolve(model) if style_spec(t.style).self_contained)
    shapes = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        layout = layouts[name][1]
        if layout.sharded and not name.startswith(whole):
            shapes[id(p)] = local_shape(tuple(p.shape), layout, tp, rank)
    return shapes


def _width_hooks(
    model: nn.Module, plan: Plan, shapes: Mapping[int, tuple], tp: int, rank: int
) -> list:
    """A gathered head or table hands on its full width; a row layer that slices its own input
    (rowwise_split_input) takes only its slice: hooks that do what those styles' collectives
    and slicing do to the shapes."""
    hooks = []
    for t in plan.resolve(model):
        if t.kind != "module":
            continue
        mod = model.get_submodule(t.name)
        kind = kind_of(mod) or "linear"
        if t.style == "vocab_parallel" and getattr(mod, "padding_idx", None) is not None:
            hooks.append(_local_padding(mod, shapes, tp, rank))
        elif t.style == "colwise_replicated_heads":  # this rank's one KV head
            width = out_width(mod, kind) // int(plan.args_for(t.pattern).get("heads", 1))
            hooks.append(mod.register_forward_hook(_widen(width)))
        elif style_spec(t.style).collective == "all_gather":  # a gathered head or table
            w = mod.weight
            width = w.shape[param_layout(t.style, "weight", w.ndim, mod).dim]
            conv = isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d))  # gathered on channels
            hooks += grouped_rows_hooks(mod, tp, rank) if conv else []  # whole groups, padded
            hooks.append(mod.register_forward_hook(_widen(int(width), w.ndim - 2 if conv else 0)))
        elif t.style == "rowwise_split_input":
            local = in_width(mod, kind)
            if id(mod.weight) in shapes:
                local = shapes[id(mod.weight)][0 if kind == "conv1d" else -1]
            hooks.append(mod.register_forward_pre_hook(_narrow(local)))
    return hooks


def _dry_run_once(
    analysis: Analysis,
    plan: Plan,
    tp: int,
    real: bool,
    values: bool = False,
    rank: int = 0,
    record: dict[str, list] | None = None,
    twins: Twins | None = None,
) -> str | None:
    """None when a forward with ``rank``'s shapes runs, else the error in brief. A fake run
    also fails where a reshape cuts the shards inside their blocks (`_cut_inside`); with
    ``record`` (the unsplit reference run) it only fills it. ``twins``: the layers a fake run
    folds (`tpkit.trace.fold`), those the plan lays out alike."""
    model, example = analysis.model, analysis.example
    plan = plan.copy()
    reshapes: dict[str, list] = {} if record is None else record
    lay_out(model, plan, tp)  # as settling lays the plan out for this tp, before any trial
    twins = Twins() if twins is None or real else plan_twins(twins, plan, model)
    shapes = _shard_shapes(model, plan, tp, rank)
    undo, hooks, running = (lambda: None), [], []
    try:  # every temporary change is made inside, so the finally undoes all of them
        undo = apply_fixups(model, plan, tp, rank)
        hooks = _width_hooks(model, plan, shapes, tp, rank)
        fake = None if real else fake_mode()
        given = GivenValues()
        args, kwargs = fake_inputs(model, example, fake, real, analysis.recipe, given)
        hooks += _where(model, running)
        with quiet_fake_tensors(), torch.no_grad():
            if real:
                with real_state(model, shapes):
                    model(*args, **kwargs)
            else:
                shadow = ShadowValues(fake, given) if values else None
                recorder = _Reshapes(running, reshapes)
                with (
                    folded(
                        model, twins, describe=known_values(shadow) if shadow is not None else None
                    ),
                    meta_state(model, fake, shapes),
                    fake_friendly_experts(model),
                    fake,
                    shadow if shadow is not None else contextlib.nullcontext(),
                    recorder,
                ):
                    model(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever the model's code raises
        error = _brief(exc)
        inner = running[-1] if running else ""
        return f"in {inner}: {error}" if inner and error != _NOTHING_LEARNED else error
    finally:
        for h in hooks:
            h.remove()
        undo()
    if real or record is not None:
        return None
    unsplit = _unsplit(analysis, values, twins)
    key = (values, tuple(twins.rep.items()))
    if key in analysis.borrowed and _counts_differ(reshapes, unsplit):
        # the trace's record, where it is not this run's: the trace was the model's first
        # forward, and DINOv3's fills a cache of its patch grid there (one reshape more)
        analysis.borrowed.discard(key)
        del analysis.references[key]
        unsplit = _unsplit(analysis, values, twins)
    return _cut_inside(reshapes, unsplit, tp, rank)


def _counts_differ(split: dict[str, list], unsplit: dict[str, list] | None) -> bool:
    """Whether a module of the split run recorded another number of reshapes than the
    unsplit run's (`_cut_inside` would skip it)."""
    return unsplit is not None and any(len(unsplit.get(w, ())) != len(c) for w, c in split.items())


class _Reshapes(TorchFunctionMode):
    """Records each view / reshape as (input shape, output shape), per innermost running
    module (``running``, kept by `_where`'s hooks), in ``out``."""

    def __init__(self, running: list[str], out: dict[str, list]):
        super().__init__()
        self.running, self.out = running, out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if metadata_only(func):  # no reshape
            return func(*args, **(kwargs or {}))
        result = func(*args, **(kwargs or {}))
        where = self.running[-1] if self.running else ""
        record_reshape(self.out, where, getattr(func, "__name__", ""), args, result)
        return result


def _unsplit(analysis: Analysis, values: bool, twins: Twins) -> dict[str, list] | None:
    """The unsplit model's reshapes on the same fake inputs, its same layers folded (once per
    analysis, with shadow values or not: `tpkit.trace.analysis.Analysis.references`); None
    when that forward does not run (then nothing can be compared)."""
    key = (values, tuple(twins.rep.items()))
    if key not in analysis.references:
        record: dict[str, list] = {}
        error = _dry_run_once(
            analysis, Plan(), 1, real=False, values=values, record=record, twins=twins
        )
        analysis.references[key] = None if error is not None else record
    return analysis.references[key]


def _cut_inside(
    split: dict[str, list], unsplit: dict[str, list] | None, tp: int, rank: int
) -> str | None:
    """The first reshape of the split run that views a shard as blocks of another size than
    the unsplit run's same reshape (see the module docstring), as an error; None when there is
    none. Calls are matched per module, in order; a module whose calls differ in number or
    rank is skipped (nothing to compare)."""
    for where, calls in split.items():
        ref = (unsplit or {}).get(where, [])
        if len(ref) != len(calls):
            continue
        for (s_in, s_out), (u_in, u_out) in zip(calls, ref, strict=True):
            if (s_in, s_out) != (u_in, u_out) and _cuts(u_in, u_out, s_in, s_out):
                return (
                    f"in {where}: a reshape cuts the split features inside their blocks: "
                    f"{list(u_in)} -> {list(u_out)} unsplit, {list(s_in)} -> {list(s_out)} on "
                    f"rank {rank} at tp={tp} (the shard is not a whole number of blocks)"
                )
    return None


def _cuts(u_in: tuple, u_out: tuple, s_in: tuple, s_out: tuple) -> bool:
    """The split view ``s_in -> s_out`` cuts a shard's last dim (a column layer's features, a
    contiguous cut of them) into blocks of another size than the unsplit view ``u_in -> u_out``
    does: the last dim, viewed as several dims, may only have fewer of the outermost blocks on
    a shard (``(4, 144)`` as ``(2, 144)``, not ``(4, 72)``), and where the shard holds it whole,
    the same blocks. Other dims are not judged (a head dim sliced per batch row is cut in
    strides, which shapes cannot tell from a cut inside blocks), nor are shapes that do not
    line up (another number of dims, zero sizes, the last dim merged with others)."""
    if len(u_in) != len(s_in) or len(u_out) != len(s_out) or 0 in (*s_in, *s_out, *u_in):
        return False
    last = len(u_in) - 1
    for gi, go in _groups(u_in, u_out):
        if gi != [last] or math.prod(s_out[j] for j in go) != s_in[last]:
            continue  # another group, the last dim merged with others, or grouped otherwise
        d_out = [j for j in go if u_out[j] != s_out[j]]
        if u_in[last] == s_in[last] or len(d_out) != 1:
            return bool(d_out)  # whole, viewed otherwise; or blocks of several sizes changed
        return math.prod(u_out[go[0] : d_out[0]]) != 1  # the cut is not of the outer blocks
    return False


def _groups(a: tuple, b: tuple) -> list[tuple[list[int], list[int]]]:
    """Dims of ``a`` and of ``b`` grouped where a view of ``a`` as ``b`` maps one onto the
    other (equal running products); [] when the shapes do not line up."""
    out, i, j = [], 0, 0
    pa, pb = 1, 1
    while i < len(a) or j < len(b):
        gi, gj = [], []
        if i < len(a):
            pa, i = pa * a[i], i + 1
            gi.append(i - 1)
        if j < len(b):
            pb, j = pb * b[j], j + 1
            gj.append(j - 1)
        while pa != pb:
            if pa < pb and i < len(a):
                pa, i = pa * a[i], i + 1
                gi.append(i - 1)
            elif pb < pa and j < len(b):
                pb, j = pb * b[j], j + 1
                gj.append(j - 1)
            else:
                return []
        out.append((gi, gj))
    return out


def _where(model: nn.Module, running: list[str]) -> list:
    """Hooks keeping ``running`` the stack of modules whose forward is running, so a failure
    names the innermost one (the attention whose reshape does not fit its shard)."""

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        running.pop()  # returns None: a forward hook's return value replaces the output

    hooks = []
    for name, mod in model.named_modules():
        if name:
            hooks.append(mod.register_forward_pre_hook(lambda m, a, n=name: running.append(n)))
            hooks.append(mod.register_forward_hook(leave))
    return hooks


def _brief(exc: Exception) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    if needs_values(exc):
        return _NOTHING_LEARNED  # the fake forward cannot run this model at all
    return f"{type(exc).__name__}: {first[:160]}"


class _Restore:
    """A temporary attribute change with a hook's ``remove()``, undone with the hooks."""

    def __init__(self, module: nn.Module, attr: str, value: Any):
        self.module, self.attr, self.saved = module, attr, getattr(module, attr)
        setattr(module, attr, value)

    def remove(self) -> None:
        setattr(self.module, self.attr, self.saved)


def _local_padding(mod: nn.Module, shapes: Mapping[int, tuple], tp: int, rank: int) -> _Restore:
    """A vocab-parallel embedding's ``padding_idx`` as ``rank``'s rows see it (the style makes
    it local, or None when another rank owns it): F.embedding asserts it is within the shard."""
    rows = shapes.get(id(mod.weight), tuple(mod.weight.shape))[0]
    start = chunk_offset(mod.weight.shape[0], tp, rank)
    pad = mod.padding_idx - start
    return _Restore(mod, "padding_idx", pad if 0 <= pad < rows else None)


def _narrow(local: int):
    def hook(mod: nn.Module, args: tuple):
        if args and isinstance(args[0], torch.Tensor):
            return (args[0][..., :local], *args[1:])
        return args

    return hook


def _widen(full: int, kernel_dims: int = 0):
    def hook(mod: nn.Module, args: tuple, output: Any):
        if isinstance(output, torch.Tensor):
            shape = list(output.shape)
            shape[-1 - kernel_dims] = full  # a convolution's channels sit before its kernel dims
            # zeros, not new_empty: a shadow run (`tpkit.trace.shadow`) computes this op for
            # real, and uninitialised memory (NaN at random) made BLT's patcher's
            # Categorical(logits=...) fail its check now and then: the gathered plan refused
            return output.new_zeros(shape)
        return output

    return hook
