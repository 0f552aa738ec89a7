"""Experts held as stacked parameters: which of their dims inference splits.

Three kinds are recognised, all split along each expert's intermediate width I, so that every
rank runs every expert on its slice of I and the module's output is a partial sum that
``moe_tp_experts`` all-reduces (f on its float inputs, g on its output):

- transformers' fused experts, read from the layout flags the module declares about itself
  (`fused_experts`); a module with parameters inside them that reads their summed output
  (Ergo's per-expert RMSNorm of each route) gets its input all-reduced first
  (``moe_reduced_input``), checked by running the experts once on small random weights
  (`reduced_children`);
- experts a module keeps as its own 3-D parameters and applies with ``bmm`` (Inkling's shared
  experts: gate and up ``[E, I, H]``, down ``[E, H, I]``), recognised by their shapes and then
  checked by running the module once on small random weights (`bmm_experts`);
- experts stored 2-D as ``[E * I, H]`` and viewed per expert by the module's code
  (DBRX: ``w1.view(-1, self.ffn_hidden_size, H)[expert]``), split as E packed parts each cut
  like a column (``packed_colwise_x<E>``), the attribute the view reads divided by tp, checked
  by running the module once (`stacked_experts`).

The checks run the module on made-up inputs of the traced shapes. The trace records only float
inputs; a positional input it did not record is taken for the routing indices and made as
expert ids shaped like the routing weights that follow it (a wrong guess fails the run, and
the module stays whole).

Pure torch, no process group: plan/ runs on a laptop, on meta.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tpkit.plan.catalogue import packed_style
from tpkit.plan.layout import param_layout

__all__ = [
    "EXPERT_ATTRS",
    "bmm_experts",
    "expert_groups",
    "fused_experts",
    "reduced_children",
    "stacked_experts",
]

#: The intermediate width the check of `bmm_experts` runs with (split 2 + 2).
_PROBE_INTER = 4
#: The intermediate width the checks of fused and stacked experts run with (split 4 + 4: rows
#: of 16 bytes in float32, which torch's CPU grouped_mm needs).
_PROBE_WIDE = 8
#: Attributes that count experts (on a module, its descendants or their configs).
EXPERT_ATTRS = ("num_experts", "moe_num_experts", "num_local_experts", "n_routed_experts")


def expert_groups(
    model: nn.Module,
    info: dict,
    exclude: set[str],
    styles: dict,
    why: dict,
    fixups: dict | None = None,
) -> list[dict]:
    """Add the styles of every experts module (not in ``exclude``, not styled yet) to
    ``styles`` and the attributes their code must see divided to ``fixups``; return their
    groups, each with the intermediate width tp must divide. Fused experts with parameters of
    their own (Ergo's per-expert RMSNorm of each route's output) are split when those
    parameters' modules read only the summed output (`reduced_children`), else stay whole,
    with the reason in ``why``: they would read each rank's partial sum."""
    groups: list[dict] = []
    done: list[str] = []  # experts modules styled here: their descendants are theirs
    probed: dict[tuple, Any] = {}  # one probe per kind of experts module, not per layer
    for name, mod in model.named_modules():
        if name in exclude or any(name.startswith(f"{d}.") for d in done):
            continue
        inputs = info["module_inputs"].get(name, [])
        entries, inter, owners, divide = fused_experts(mod), 0, [], []
        extra = [n for n, c in mod.named_children() if any(True for _ in c.parameters())]
        key = _probe_key(mod, inputs, entries, extra)
        if (
            entries
            and extra
            and not _once(probed, ("reduced", *key), reduced_children, mod, inputs, entries, extra)
        ):
            why[name] = (
                f"its {extra[0]} has parameters and acts inside the experts module on what "
                "is not the experts' summed output (a check on small random weights)"
            )
            continue
        if entries:
            counts = _fused_counts(name, mod, entries)
            entries.update({child: "moe_reduced_input" for child in extra})
        elif name not in styles:
            entries, inter = bmm_experts(mod, inputs)
            counts = {f"intermediate size of {name}": inter}
            if not entries and fixups is not None:  # the view's F must be divided
                entries, divide = _once(probed, ("stacked", *key), stacked_experts, mod, inputs)
                entries, divide = dict(entries), list(divide)
                counts = {f"{name}.{a}": int(getattr(mod, a)) for a in divide}
        if entries:
            styles[name] = "moe_tp_experts"
            styles.update({f"{name}.{p}": style for p, style in entries.items()})
            why.pop(name, None)
            if divide and fixups is not None:  # (always given with divide)
                fixups[name] = {**fixups.get(name, {}), "divide": divide}
                owners = [name]
            done.append(name)
            groups.append(
                {
                    "modules": [name, *(f"{name}.{p}" for p in entries)],
                    "owners": owners,
                    "counts": counts,
                }
            )
    return groups


def _probe_key(mod: nn.Module, inputs: list, entries: dict, extra: list[str]) -> tuple:
    """What a probe's answer depends on: the module's class, its integer attributes, its
    parameters' names and shapes, the traced input shapes and what is split. The layers of a
    model share it (a layer's index is left out), so a 64-layer model is probed once, not 64
    times at full size."""
    ints = tuple(
        sorted(
            (k, v)
            for k, v in vars(mod).items()
            if isinstance(v, int) and not k.startswith("_") and "layer" not in k and "idx" not in k
        )
    )
    params = tuple((n, tuple(p.shape)) for n, p in mod.named_parameters())
    shapes = tuple((k, tuple(shape)) for k, shape, _ in inputs)
    return type(mod), ints, params, shapes, tuple(sorted(entries.items())), tuple(extra)


def _once(memo: dict, key: tuple, fn: Callable, *args: Any) -> Any:
    """``fn(*args)``, computed once per ``key`` within one plan."""
    if key not in memo:
        memo[key] = fn(*args)
    return memo[key]


def _fused_counts(name: str, mod: nn.Module, entries: dict[str, str]) -> dict[str, int]:
    """What tp must divide for fused experts, said truthfully so that settling keeps whole only
    what an uneven split would get wrong. Each expert's intermediate width I is produced by the
    up (and gate) projection and read by the down projection one channel at a time
    (``act(gate) * up`` is elementwise), so a split of I into torch.chunk sizes is exact: a
    packed [gate; up] is split per part (rank r: chunk r of gate and chunk r of up; its
    ``chunk(2)`` still pairs them), down's I the same chunks. The counts name those parameters
    (``output features of <up>``, ``input features of <down>``), whose styles the catalogue
    marks uneven-ok. Interleaved gate/up (GPT-OSS: g0 u0 g1 u1 ...) split unevenly would cut a
    pair: there I itself must divide."""
    inter = _fused_inter(mod)
    d = mod.__dict__
    if d["has_gate"] and not d["is_concatenated"]:
        return {f"intermediate size of {name}": inter}
    up = "gate_up_proj" if d["has_gate"] else "up_proj"
    return {
        f"output features of {name}.{up}": inter,
        f"input features of {name}.down_proj": inter,
    }


def fused_experts(mod: nn.Module) -> dict[str, str]:
    """Styles for the 3-D weights of a transformers fused-experts module, read from what the
    module declares about itself (``use_experts_implementation``: ``has_gate``,
    ``is_concatenated`` [gate; up] or interleaved, ``is_transposed``, ``has_bias``): each
    expert's up (and gate) projection column-parallel, its down projection row-parallel.
    {} for any other module."""
    d = mod.__dict__
    if not all(isinstance(d.get(k), bool) for k in ("has_gate", "is_concatenated")):
        return {}
    up = "gate_up_proj" if d["has_gate"] else "up_proj"
    params = dict(mod.named_parameters(recurse=False))
    if params.get(up) is None or params[up].ndim != 3 or params.get("down_proj") is None:
        return {}
    # styles name raw dims, as in transformers' plans (see layout.param_layout): the output dim
    # of gate_up is -2 ("colwise") or, transposed, -1 ("rowwise"); its 2-D bias [E, out] -1
    packed = "packed_" if d["has_gate"] and d["is_concatenated"] else ""
    transposed = d.get("is_transposed") is True
    out = {
        up: f"{packed}{'rowwise' if transposed else 'colwise'}",
        "down_proj": "colwise" if transposed else "rowwise",
    }
    if f"{up}_bias" in params:
        out[f"{up}_bias"] = f"{packed}rowwise"
    return out


def _fused_inter(mod: nn.Module) -> int:
    """Each expert's intermediate width, from its down projection."""
    w = mod.down_proj
    return int(w.shape[1] if mod.__dict__.get("is_transposed") else w.shape[2])


def bmm_experts(mod: nn.Module, inputs: list[tuple[str, tuple, Any]]) -> tuple[dict[str, str], int]:
    """Styles and I for a module whose own parameters are all 3-D with the same E and have
    one dim H (the width of its first input, from the trace's ``inputs``) and one other dim I,
    the same for all; ({}, 0) for any other module, and where H == I (nothing says which to
    split). Splitting I in each parameter is exact whichever way each is stored (``x W^T`` or
    ``x W``) when I is produced by the first products and summed by the last, so the module's
    output is the sum of what its slices of I give. Shapes cannot tell that (a residual added
    inside the module, or a norm over I, would break it), so `_sums_over_slices` checks it by
    running the module once on small random weights. Raw dims as in transformers' plans: I at
    -2 is "colwise", at -1 "rowwise"."""
    params = dict(mod.named_parameters())
    width = int(inputs[0][1][-1]) if inputs and inputs[0][1] else 0
    if width <= 0 or len(params) < 2 or any(p.ndim != 3 for p in params.values()):
        return {}, 0
    if len({p.shape[0] for p in params.values()}) != 1 or len(params) != len(mod._parameters):
        return {}, 0
    inner = {int(d) for p in params.values() for d in p.shape[1:] if d != width}
    if len(inner) != 1 or any(width not in p.shape[1:] for p in params.values()):
        return {}, 0
    inter = inner.pop()
    styles = {n: "colwise" if p.shape[1] == inter else "rowwise" for n, p in params.items()}
    return (styles, inter) if _sums_over_slices(mod, inputs, styles) else ({}, 0)


def _sums_over_slices(mod: nn.Module, inputs: list[tuple[str, tuple, Any]], styles: dict) -> bool:
    """Run ``mod`` on random float32 inputs of the traced shapes with random weights whose I is
    `_PROBE_INTER`, once whole and once per half of I: True when the halves' outputs add up to
    the whole one. False when the module cannot run that way (a positional input the trace did
    not record, code that reads I from elsewhere): then it stays whole."""
    args, kwargs = [], {}
    g = torch.Generator().manual_seed(0)
    for key, shape, _ in inputs:
        kind, k = key.split(":", 1)
        x = torch.randn(shape, generator=g)
        if kind == "kw":
            kwargs[k] = x
        elif int(k) != len(args):
            return False
        else:
            args.append(x)
    whole = {}
    for n, p in mod.named_parameters():
        shape = list(p.shape)
        shape[1 if styles[n] == "colwise" else 2] = _PROBE_INTER
        whole[n] = torch.randn(shape, generator=g) / 2
    half = _PROBE_INTER // 2

    def run(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        with _swapped(mod, weights), torch.no_grad():
            out = mod(*args, **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{type(mod).__name__} returned {type(out).__name__}")
        return out.float()

    try:
        full = run(whole)
        parts = [
            run(
                {
                    n: w.narrow(1 if styles[n] == "colwise" else 2, lo, half)
                    for n, w in whole.items()
                }
            )
            for lo in (0, half)
        ]
    except Exception:  # noqa: BLE001 - any failure means "not this pattern": left whole
        return False
    total = parts[0] + parts[1]
    if full.shape != total.shape:
        return False
    # float32 sums in another order: relative to the largest value (a residual inside the
    # module, the case this rules out, is off by the whole input)
    return bool((full - total).abs().max() <= 1e-4 * max(1.0, float(full.abs().max())))


@contextlib.contextmanager
def _swapped(mod: nn.Module, weights: dict[str, torch.Tensor]):
    """``mod``'s parameters, and its descendants' (by dotted name), replaced while inside."""
    saved = []
    try:
        for name, w in weights.items():
            owner, _, pname = name.rpartition(".")
            holder = mod.get_submodule(owner) if owner else mod
            saved.append((holder, pname, holder._parameters[pname]))
            holder._parameters[pname] = w
        yield
    finally:
        for holder, pname, p in reversed(saved):
            holder._parameters[pname] = p


def _probe_inputs(
    inputs: list[tuple[str, tuple, Any]], experts: int, g: torch.Generator
) -> tuple[list, dict] | None:
    """Random float inputs of the traced shapes; a positional gap (an input the trace, which
    records floats only, did not record) filled with expert ids in [0, experts) shaped like the
    float input after it (top-k routing: indices and weights of the same routes). None when
    that cannot be made."""
    args: list = []
    kwargs: dict = {}
    for key, shape, _ in inputs:
        kind, k = key.split(":", 1)
        x = torch.randn(shape, generator=g)
        if kind == "kw":
            kwargs[k] = x
            continue
        if int(k) > len(args) + 1 or experts < 1:
            return None
        if int(k) == len(args) + 1:
            args.append(torch.randint(0, experts, shape, generator=g))
        args.append(x)
    return args, kwargs


def _run_probe(
    mod: nn.Module,
    args: list,
    kwargs: dict,
    weights: dict[str, torch.Tensor],
    attrs: dict[str, int] | None = None,
    hook: Callable | None = None,
    hooked: list[nn.Module] = (),
) -> torch.Tensor:
    """``mod``'s first output (float32) with its parameters (and descendants', by name) swapped
    for ``weights``, its attributes set to ``attrs``, ``hook`` as a forward pre-hook of each
    module of ``hooked``; everything restored after."""
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in hooked if hook]
    try:
        with _swapped(mod, weights), _attrs_set(mod, attrs or {}), torch.no_grad():
            out = mod(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    out = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{type(mod).__name__} returned {type(out).__name__}")
    return out.float()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float32 sums in another order, relative to the largest value."""
    if a.shape != b.shape:
        return False
    return bool((a - b).abs().max() <= 1e-4 * max(1.0, float(a.abs().max())))


def _expert_count(mod: nn.Module) -> int:
    """The number of experts, from `EXPERT_ATTRS` on ``mod``, its descendants or their configs
    (0 when none says)."""
    for m in mod.modules():
        for holder in (m, getattr(m, "config", None)):
            for attr in EXPERT_ATTRS:
                v = getattr(holder, attr, None) if holder is not None else None
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
    return 0


def _halves(w: torch.Tensor, dim: int, parts: int) -> list[torch.Tensor]:
    """The two halves of ``w`` along ``dim``, each of its ``parts`` packed parts cut alike."""
    split = w.unflatten(dim, (parts, w.shape[dim] // parts))
    half = split.shape[dim + 1] // 2
    return [split.narrow(dim + 1, lo, half).flatten(dim, dim + 1) for lo in (0, half)]


def reduced_children(
    mod: nn.Module, inputs: list[tuple[str, tuple, Any]], entries: dict[str, str], extra: list[str]
) -> bool:
    """True when the children ``extra`` of fused experts ``mod`` (modules with parameters: Ergo's
    per-expert RMSNorm) read only the experts' summed output, so that all-reducing their first
    input (``moe_reduced_input``) makes the split exact. Checked by running ``mod`` on small
    random weights, each of its split parameters (``entries``) cut in two halves of I: each
    half's run, with every call of those children given the sum of both halves' inputs to it,
    must give the whole run's output (then the output is whole on every rank, which
    ``moe_tp_experts`` relies on). A child that reads the module's input, or anything but the
    summed output, fails it and the experts stay whole."""
    g = torch.Generator().manual_seed(0)
    made = _probe_inputs(inputs, _expert_count(mod), g)
    children = [mod.get_submodule(c) for c in extra]
    if made is None or any(len(list(c.children())) for c in children):
        return False
    args, kwargs = made
    whole: dict[str, torch.Tensor] = {}
    halves: list[dict[str, torch.Tensor]] = [{}, {}]
    for n, p in mod.named_parameters():
        shape, style = list(p.shape), entries.get(n)
        if style is None:
            w = torch.randn(shape, generator=g) / 2 + (1.0 if p.ndim <= 2 else 0.0)
            whole[n] = w
            scale = 0.5 if n == "down_proj_bias" else 1.0  # moe_tp_experts: bias / tp
            halves[0][n], halves[1][n] = w * scale, w * scale
            continue
        layout = param_layout(style, n, p.ndim, mod)
        shape[layout.dim] = _PROBE_WIDE * layout.split_factor
        whole[n] = torch.randn(shape, generator=g) / 2
        halves[0][n], halves[1][n] = _halves(whole[n], layout.dim, layout.split_factor)
    seen: list[list[torch.Tensor]] = [[], []]

    def record(i: int) -> Callable:
        def hook(m: nn.Module, a: tuple, kw: dict):
            seen[i].append((a[0] if a else next(iter(kw.values()))).clone())

        return hook

    def summed(m: nn.Module, a: tuple, kw: dict):
        k = calls.pop(0)
        x = seen[0][k] + seen[1][k]
        return ((x, *a[1:]), kw) if a else (a, {**kw, next(iter(kw)): x})

    try:
        full = _run_probe(mod, args, kwargs, whole)
        for i in (0, 1):
            _run_probe(mod, args, kwargs, halves[i], hook=record(i), hooked=children)
        if not seen[0] or len(seen[0]) != len(seen[1]):
            return False
        for i in (0, 1):
            calls = list(range(len(seen[0])))
            if not _close(full, _run_probe(mod, args, kwargs, halves[i], None, summed, children)):
                return False
    except Exception:  # noqa: BLE001 - any failure means "not this pattern": left whole
        return False
    return True


def stacked_experts(
    mod: nn.Module, inputs: list[tuple[str, tuple, Any]]
) -> tuple[dict[str, str], list[str]]:
    """Styles of experts stored 2-D and viewed per expert by ``mod``'s code (DBRX's
    ``w1``, ``v1``, ``w2``: ``[E * F, H]``, read as ``w.view(-1, self.ffn_hidden_size, H)[e]``),
    and the attributes of ``mod`` that hold F (divided by tp on every rank: the view then
    reads each rank's F / tp rows of every expert); ({}, []) for any other module.

    Every parameter under ``mod`` must be 2-D of one shape, one dim H (the width of its first
    input) and the other E * F, with E from `EXPERT_ATTRS` and F an integer attribute of
    ``mod``. Each is split as E packed parts, each part (one expert) cut like a column
    (``packed_colwise_x<E>``, or ``packed_rowwise_x<E>`` when stored ``[H, E * F]``): every rank
    holds F / tp rows of every expert. Exact when the module's output is the sum of what its
    slices of F give (``act(x w1_e) * (x v1_e)`` is per row of F, ``w2_e`` sums over them):
    checked by running ``mod`` with F set to 8 on random weights, whole and per half of every
    expert's rows."""
    params = dict(mod.named_parameters())
    width = int(inputs[0][1][-1]) if inputs and inputs[0][1] else 0
    if width <= 0 or len(params) < 2 or len({p.shape for p in params.values()}) != 1:
        return {}, []
    shape = next(iter(params.values())).shape
    if len(shape) != 2 or width not in shape or shape[0] == shape[1]:
        return {}, []
    dim = 1 if shape[0] == width else 0
    experts = _expert_count(mod)
    if experts < 2 or shape[dim] % experts:
        return {}, []
    inter = shape[dim] // experts
    attrs = [
        a
        for a, v in vars(mod).items()
        if isinstance(v, int) and not isinstance(v, bool) and v == inter and not a.startswith("_")
    ]
    if not attrs or inter == width:
        return {}, []
    g = torch.Generator().manual_seed(0)
    made = _probe_inputs(inputs, experts, g)
    if made is None:
        return {}, []
    args, kwargs = made
    probe = list(shape)
    probe[dim] = experts * _PROBE_WIDE
    whole = {n: torch.randn(probe, generator=g) / 2 for n in params}
    halves = [{}, {}]
    for n, w in whole.items():
        halves[0][n], halves[1][n] = _halves(w, dim, experts)
    try:
        full = _run_probe(mod, args, kwargs, whole, dict.fromkeys(attrs, _PROBE_WIDE))
        half = dict.fromkeys(attrs, _PROBE_WIDE // 2)
        total = sum(_run_probe(mod, args, kwargs, h, half) for h in halves)
    except Exception:  # noqa: BLE001 - any failure means "not this pattern": left whole
        return {}, []
    if not _close(full, total):
        return {}, []
    style = packed_style("packed_colwise" if dim == 0 else "packed_rowwise", experts)
    return dict.fromkeys(params, style), attrs


@contextlib.contextmanager
def _attrs_set(mod: nn.Module, attrs: dict[str, int]):
    saved = {a: mod.__dict__[a] for a in attrs}
    try:
        mod.__dict__.update(attrs)
        yield
    finally:
        mod.__dict__.update(saved)
