"""Which modules expert parallelism can place whole experts of, and the numbers it needs.

Expert parallelism (EP) puts whole experts on ranks and sends each routed (token, expert) pair
to its expert's rank (`tpkit.styles.expert`). It wraps one module boundary: a *routed experts*
module, called as ``experts(hidden [.., H], index [T, K], weights [T, K])`` and returning, per
token, the sum over its K pairs of what each pair's expert gives it. transformers' fused experts
(``@use_experts_implementation``), DBRX's packed ``[E * F, H]`` experts and GPT-OSS's biased
ones are all of that form; so is a user's own module that keeps this contract.

A module is taken when it has an expert count E (``num_experts`` and the like, on itself or its
config), parameters whose first dim counts experts (``[E, ...]`` or E blocks of rows), and a
probe on small random weights shows the contract holds: the whole module's output equals, for
each half of the experts, the module run on just the pairs routed there, with its parameters cut
to those experts, expert ids made local, and its expert-count attributes set to the local count,
summed per token. So placement is decided by what the code does, not by its name; a model's
``base_model_ep_plan`` only records where an entry came from ("config"). A module the probe
refuses stays with tensor parallelism, with the reason (`expert_modules`' notes).

Pure torch, no process group: plan/ runs on a laptop, on meta.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tpkit.plan.catalogue import style_spec
from tpkit.plan.spec import Plan, Source, matches
from tpkit.sources.experts import EXPERT_ATTRS

__all__ = [
    "ExpertEntry",
    "check_expert_sizes",
    "chunk_sizes",
    "expert_targets",
    "place_experts",
    "config_ep_patterns",
    "expert_count",
    "expert_modules",
    "expert_params",
    "probe_grouped",
    "probe_kind",
    "probe_routed",
]

#: Elements of a module's parameters up to which the probe runs on their real shapes; larger
#: modules (full-size, on meta) are probed with 4 experts and narrow intermediate widths.
_REAL_LIMIT = 1 << 22
_PROBE_EXPERTS = 4
_PROBE_INNER = 8
#: Attribute names that hold a module's hidden width (the probe's token width).
_WIDTH_ATTRS = ("hidden_size", "hidden_dim", "d_model", "model_dim", "embed_dim", "input_size")


@dataclass(frozen=True)
class ExpertEntry:
    """One routed experts module EP places: its path, its expert count, the dotted attributes
    under it that hold the count (set to the local count while it runs) and where it was
    named ("config": the model's ``base_model_ep_plan``; "inferred": found by the probe)."""

    name: str
    num_experts: int
    count_attrs: tuple[str, ...]
    source: str
    #: the parameters under it (dotted, from the module) whose first dim counts experts
    params: tuple[str, ...] = ()
    #: how it is called: "routed" (hidden, ids, weights), "grouped" (rows grouped by expert
    #: and their counts: JetMoE), "blocks" (E equal blocks of rows: Llama-4)
    kind: str = "routed"


def _own_count(mod: nn.Module) -> int:
    """E from ``mod``'s own attributes or its config (0 when neither says)."""
    for holder in (mod, mod.__dict__.get("config")):
        for attr in EXPERT_ATTRS:
            try:
                v = getattr(holder, attr, None) if holder is not None else None
            except Exception:  # noqa: BLE001 - a per-layer config refuses a global read
                v = None
            if isinstance(v, int) and not isinstance(v, bool) and v > 1:
                return v
    return 0


def expert_params(mod: nn.Module, e: int) -> dict[str, int]:
    """The parameters under ``mod`` whose first dim counts its ``e`` experts, with the rows
    each expert has there: those ``[E, ...]`` where there are any (a norm of another width
    that E happens to divide is not one), else 2-D ones of E blocks of rows (DBRX's
    ``[E * F, H]``)."""
    params = dict(mod.named_parameters())
    exact = {n: 1 for n, p in params.items() if p.ndim >= 1 and p.shape[0] == e}
    if exact:
        return exact
    return {
        n: p.shape[0] // e
        for n, p in params.items()
        if p.ndim == 2 and p.shape[0] % e == 0 and p.shape[0] > e
    }


def expert_count(mod: nn.Module) -> int:
    """E for a candidate experts module: its own count, when some parameter under it has a
    first dim that counts experts (`expert_params`); else 0."""
    e = _own_count(mod)
    return e if e >= 2 and expert_params(mod, e) else 0


def _count_attrs(mod: nn.Module, e: int) -> tuple[str, ...]:
    """Dotted names of the integer attributes under ``mod`` that hold E and name experts."""
    out = []
    for path, m in mod.named_modules():
        for k, v in vars(m).items():
            if isinstance(v, int) and not isinstance(v, bool) and v == e and "expert" in k:
                out.append(f"{path}.{k}" if path else k)
    return tuple(out)


def config_ep_patterns(model: nn.Module) -> list[str]:
    """The module patterns the model's (and each sub-model's) ``base_model_ep_plan`` names
    ``ep_dispatch_experts``, joined to where that base model sits."""
    out = []
    for path, sub in model.named_modules():
        config = sub.__dict__.get("config")
        plan = getattr(config, "base_model_ep_plan", None) if config is not None else None
        if not plan or not hasattr(sub, "base_model_prefix"):
            continue
        base = getattr(sub, "base_model", sub)
        base_path = next((n for n, m in sub.named_modules() if m is base), "")
        prefix = ".".join(p for p in (path, base_path) if p)
        out += [
            f"{prefix}.{k}" if prefix else k for k, v in plan.items() if v == "ep_dispatch_experts"
        ]
    return out


def expert_modules(
    model: nn.Module, ep_plan: list[str] | None = None
) -> tuple[dict[str, ExpertEntry], dict[str, str]]:
    """Every experts module of ``model`` EP can place (outermost first; nothing inside a taken
    one), and, for each module a plan names that EP leaves alone, why. ``ep_plan``: more
    module patterns named for EP (a ``DistributedConfig(ep_plan=...)``'s), beside the model's
    own ``base_model_ep_plan``: they too must keep the contract the probe checks."""
    named = [*config_ep_patterns(model), *(ep_plan or [])]
    entries: dict[str, ExpertEntry] = {}
    notes: dict[str, str] = {}
    probed: dict[tuple, str] = {}  # one probe per kind of module, not per layer
    for name, mod in model.named_modules():
        if any(name.startswith(f"{e}.") for e in entries):
            continue
        e = expert_count(mod)
        if not e:
            continue
        key = _kind(mod)
        if key not in probed:
            probed[key] = probe_kind(mod, e)
        kind, why = probed[key]
        if not kind:
            if any(matches(p, name) for p in named):
                notes[name] = why
            continue
        source = "config" if any(matches(p, name) for p in named) else "inferred"
        entries[name] = ExpertEntry(
            name, e, _count_attrs(mod, e), source, tuple(expert_params(mod, e)), kind
        )
    return entries, notes


def _kind(mod: nn.Module) -> tuple:
    """What a probe's answer depends on: class, integer attributes, parameter shapes."""
    ints = tuple(
        sorted(
            (k, v)
            for k, v in vars(mod).items()
            if isinstance(v, int) and not k.startswith("_") and "layer" not in k and "idx" not in k
        )
    )
    return type(mod), ints, tuple((n, tuple(p.shape)) for n, p in mod.named_parameters())


def _width(mod: nn.Module, params: dict[str, torch.Tensor]) -> list[int]:
    """Candidate token widths H: width attributes of the module or its config first, then the
    dims its expert parameters share most."""
    out = []
    for holder in (mod, mod.__dict__.get("config")):
        for attr in _WIDTH_ATTRS:
            v = getattr(holder, attr, None) if holder is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0 and v not in out:
                out.append(v)
    dims: dict[int, int] = {}
    for p in params.values():
        for d in p.shape[1:]:
            dims[int(d)] = dims.get(int(d), 0) + 1
    out += [d for d, _ in sorted(dims.items(), key=lambda kv: -kv[1]) if d not in out]
    return out[:3]


def _probe_shapes(
    params: dict[str, torch.Tensor], e: int, width: int, experts: dict[str, int]
) -> tuple[int, dict[str, list[int]], dict[int, int]] | None:
    """The probe's expert count, parameter shapes and narrowed inner widths: the real ones for
    a small module, else `_PROBE_EXPERTS` experts and each inner (non-H) width d scaled to
    ``_PROBE_INNER * d / min inner`` (None when one does not divide)."""
    total = sum(p.numel() for p in params.values())
    if total <= _REAL_LIMIT:
        return e, {n: list(p.shape) for n, p in params.items()}, {}
    inner = {int(d) for p in params.values() for d in p.shape[1:] if d != width}
    low = min(inner) if inner else 1
    if any(d % low for d in inner):
        return None
    scale = {d: _PROBE_INNER * d // low for d in inner}
    pe = min(e, _PROBE_EXPERTS)
    shapes = {}
    for n, p in params.items():
        rows = experts.get(n, 0)
        first = pe * scale.get(rows, rows) if rows else scale.get(int(p.shape[0]), p.shape[0])
        shapes[n] = [first, *(scale.get(int(d), int(d)) for d in p.shape[1:])]
    return pe, shapes, scale


def probe_kind(mod: nn.Module, e: int) -> tuple[str, str]:
    """(kind, "") for the first contract ``mod`` keeps: "routed" (`probe_routed`), "grouped"
    or "blocks" (`probe_grouped`); ("", why) when none."""
    why = probe_routed(mod, e)
    if not why:
        return "routed", ""
    for kind in ("grouped", "blocks"):
        if not probe_grouped(mod, e, blocks=kind == "blocks"):
            return kind, ""
    return "", why


def probe_grouped(mod: nn.Module, e: int, blocks: bool) -> str:
    """The empty string when ``mod`` runs rows grouped by expert, each expert's rows on their
    own: ``mod(x, sizes)`` (``sizes[e]`` rows of expert e), or ``mod(x)`` on E equal blocks
    (``blocks``); checked as `probe_routed` checks, per half of the experts on their rows."""
    params = dict(mod.named_parameters())
    experts = expert_params(mod, e)
    if sum(p.numel() for p in params.values()) > _REAL_LIMIT:
        return "too large to probe its grouped rows"
    g = torch.Generator().manual_seed(0)
    shape_of = {n: list(p.shape) for n, p in params.items()}
    whole = {
        n: torch.randn(s, generator=g) / max(1.0, float(s[-1]) ** 0.5) for n, s in shape_of.items()
    }
    sizes = [3] * e if blocks else [int(torch.randint(0, 4, (), generator=g)) for _ in range(e)]
    attrs = {a: e for a in _count_attrs(mod, e)}
    for width in _width(mod, params):
        x = torch.randn(sum(sizes), width, generator=g)
        try:
            full = _run(mod, whole, attrs, x, *(() if blocks else (sizes,)))
            half = -(-e // 2)
            parts = []
            for lo, hi in ((0, half), (half, e)):
                local = {
                    n: w[lo * (len(w) // e) : hi * (len(w) // e)] if n in experts else w
                    for n, w in whole.items()
                }
                rows = x[sum(sizes[:lo]) : sum(sizes[:hi])]
                extra = () if blocks else (sizes[lo:hi],)
                parts.append(_run(mod, local, {a: hi - lo for a in attrs}, rows, *extra))
            total = torch.cat(parts)
        except Exception as exc:  # noqa: BLE001 - any failure means "not this contract"
            why = f"probe failed: {type(exc).__name__}: {str(exc)[:120]}"
            continue
        if full.shape == total.shape and bool(
            (full - total).abs().max() <= 1e-4 * max(1.0, float(full.abs().max()))
        ):
            return ""
        why = "its halves of experts do not give the whole output's rows"
    return why


def probe_routed(mod: nn.Module, e: int) -> str:
    """The empty string when ``mod`` keeps the routed-experts contract EP relies on (module docstring),
    else why not. Runs ``mod`` on random float32 weights and tokens, whole and per half of the
    experts, a few times, on the CPU."""
    params = dict(mod.named_parameters())
    why = "its forward is not (hidden, expert ids, routing weights) -> per-token sum of pairs"
    ran = False
    for width in _width(mod, params):
        shapes = _probe_shapes(params, e, width, expert_params(mod, e))
        if shapes is None:
            return "too large to probe with narrowed widths"
        pe, shape_of, scale = shapes
        try:
            ok = _probe_once(mod, pe, width, shape_of, scale, expert_params(mod, e))
        except Exception as exc:  # noqa: BLE001 - any failure means "not this contract"
            if not ran:  # a width that runs says more than one that does not
                why = f"probe failed: {type(exc).__name__}: {str(exc)[:120]}"
            continue
        if ok:
            return ""
        ran = True
        why = "the halves of its experts do not add up to the whole (a probe on random weights)"
    return why


def _probe_once(
    mod: nn.Module,
    e: int,
    width: int,
    shape_of: dict[str, list[int]],
    scale: dict[int, int],
    experts: dict[str, int],
) -> bool:
    g = torch.Generator().manual_seed(0)
    tokens, top_k = 7, min(2, e)
    whole = {
        n: torch.randn(s, generator=g) / max(1.0, float(s[-1]) ** 0.5) for n, s in shape_of.items()
    }
    hidden = torch.randn(tokens, width, generator=g)
    index = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g) + 0.5
    attrs = {a: e for a in _count_attrs(mod, _own_count(mod))}
    inner = _inner_attrs(mod, scale)
    full = _run(mod, whole, {**attrs, **inner}, hidden, index, weights)
    if full.numel() != tokens * width:
        return False
    total = torch.zeros(tokens, width)
    half = -(-e // 2)
    for lo, hi in ((0, half), (half, e)):
        mine = (index >= lo) & (index < hi)
        tok, k = mine.nonzero(as_tuple=True)
        local = {
            n: w[lo * (len(w) // e) : hi * (len(w) // e)] if n in experts else w
            for n, w in whole.items()
        }
        out = _run(
            mod,
            local,
            {**{a: hi - lo for a in attrs}, **inner},
            hidden[tok],
            (index[tok, k] - lo).unsqueeze(-1),
            weights[tok, k].unsqueeze(-1),
        )
        total.index_add_(0, tok, out.reshape(-1, width))
    full = full.reshape(tokens, width)
    return bool((full - total).abs().max() <= 1e-4 * max(1.0, float(full.abs().max())))


def _inner_attrs(mod: nn.Module, scale: dict[int, int]) -> dict[str, int]:
    """Integer attributes under ``mod`` holding a narrowed inner width (DBRX's
    ``ffn_hidden_size``), as they must read in the probe."""
    if not scale:
        return {}
    out = {}
    for path, m in mod.named_modules():
        for k, v in vars(m).items():
            if isinstance(v, int) and not isinstance(v, bool) and v in scale and "expert" not in k:
                out[f"{path}.{k}" if path else k] = scale[v]
    return out


def _run(
    mod: nn.Module,
    weights: dict[str, torch.Tensor],
    attrs: dict[str, int],
    *args: torch.Tensor,
) -> torch.Tensor:
    with _swapped(mod, weights, attrs), torch.no_grad():
        out = mod(*args)
    out = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{type(mod).__name__} returned {type(out).__name__}")
    return out.float()


@contextlib.contextmanager
def _swapped(mod: nn.Module, weights: dict[str, torch.Tensor], attrs: dict[str, int]) -> Iterator:
    saved: list = []
    try:
        for name, w in weights.items():
            owner, _, pname = name.rpartition(".")
            holder = mod.get_submodule(owner) if owner else mod
            saved.append((holder._parameters, pname, holder._parameters[pname]))
            holder._parameters[pname] = w
        for name, v in attrs.items():
            owner, _, attr = name.rpartition(".")
            holder = mod.get_submodule(owner) if owner else mod
            saved.append((holder.__dict__, attr, holder.__dict__[attr]))
            holder.__dict__[attr] = v
        yield
    finally:
        for store, key, value in reversed(saved):
            store[key] = value


def chunk_sizes(n: int, parts: int) -> list[int]:
    """torch.chunk's sizes of ``n`` over ``parts`` (DTensor's ``Shard``): the experts each EP
    rank holds."""
    chunk = -(-n // parts)
    return [max(0, min(chunk, n - r * chunk)) for r in range(parts)]


def _style_and_args(entry: ExpertEntry) -> tuple[str, dict]:
    args = {
        "num_experts": entry.num_experts,
        "params": list(entry.params),
        "count_attrs": list(entry.count_attrs),
    }
    if entry.kind == "routed":
        return "ep_experts", args
    return "ep_grouped_experts", {**args, "blocks": entry.kind == "blocks"}


def _generic(name: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def place_experts(
    model: nn.Module, plan: Plan, entries: dict[str, ExpertEntry] | None = None
) -> Plan:
    """``plan`` with each experts module EP places (``entries``, by default `expert_modules`)
    given its EP style (``ep_experts`` / ``ep_grouped_experts``, its numbers as arguments;
    one pattern per kind, ``*`` for layer indices, where it names exactly those modules), and
    every entry, fix-up, note and group that named only it or what is under it taken out: the
    tensor step leaves those modules alone, so a split of their experts' widths (DBRX's
    ``ffn_hidden_size`` divided by tp) must not be applied either."""
    entries = expert_modules(model)[0] if entries is None else dict(entries)
    targets = plan.resolve(model)
    for _ in range(2):  # an experts module whose TP group reaches outside it stays with TP
        inside = lambda n: any(n == e or n.startswith(f"{e}.") for e in entries)  # noqa: E731
        hits: dict[str, list[bool]] = {}
        for t in targets:
            hits.setdefault(t.pattern, []).append(inside(t.name))
        torn = [n for n in entries if _torn(plan, hits, n, model)]
        if not torn:
            break
        for n in torn:
            entries.pop(n)
    if not entries:
        return plan
    out = Plan()
    for pattern in plan:
        if hits.get(pattern) and all(hits[pattern]):
            continue
        out.set(pattern, plan[pattern], plan.source(pattern), plan.args.get(pattern))
    names = [n for n, _ in model.named_modules()]
    for key, fix in plan.fixups.items():
        matched = [n for n in names if matches(key, n)]
        if not matched or not any(inside(n) for n in matched):
            out.fixups[key] = dict(fix)
        else:  # a pattern over EP'd and other modules: kept for the others, by name
            out.fixups.update({n: dict(fix) for n in matched if not inside(n)})
    out.notes.update({k: v for k, v in plan.notes.items() if k not in hits or not all(hits[k])})
    out.groups.extend(g for g in plan.groups if any(p in out for p in g.modules))
    by_pattern: dict[str, list[ExpertEntry]] = {}
    for name, entry in entries.items():
        by_pattern.setdefault(_generic(name), []).append(entry)
    for pattern, group in by_pattern.items():
        kinds = {_style_and_args(e)[0] + repr(_style_and_args(e)[1]) for e in group}
        covered = {n for n in names if matches(pattern, n)} == {e.name for e in group}
        for e in group if len(kinds) > 1 or not covered else group[:1]:
            style, args = _style_and_args(e)
            key = e.name if len(kinds) > 1 or not covered else pattern
            source = Source.CONFIG if e.source == "config" else Source.INFERRED
            out.set(key, style, source, args)
    return out


def _torn(plan: Plan, hits: dict[str, list[bool]], name: str, model: nn.Module) -> bool:
    """Does a TP group of ``plan`` hold both a pattern naming only what is in or under the
    experts module ``name`` and one naming modules elsewhere (JetMoE's attention experts,
    split by heads with the key/value projection beside them)? Placing such experts whole
    would leave the rest of their group split for heads they no longer split."""
    for group in plan.groups:
        mine = [
            p
            for p in group.modules
            if hits.get(p) and all(hits[p]) and any(matches(p, n) for n in _under(model, name))
        ]
        if mine and any(hits.get(p) and not all(hits[p]) for p in group.modules):
            return True
    return False


def _under(model: nn.Module, name: str) -> list[str]:
    """``name`` and the module and parameter names under it."""
    module = model.get_submodule(name)
    out = [name]
    out += [f"{name}.{n}" for n, _ in module.named_modules() if n]
    out += [f"{name}.{n}" for n, _ in module.named_parameters()]
    return out


def expert_targets(model: nn.Module, plan: Plan) -> dict[str, tuple[str, dict]]:
    """Module name -> (EP style, its arguments) of every module ``plan`` gives an EP style."""
    return {
        t.name: (t.style, plan.args_for(t.pattern))
        for t in plan.resolve(model)
        if t.kind == "module" and style_spec(t.style).axis == "ep"
    }


def check_expert_sizes(model: nn.Module, plan: Plan, ep: int) -> None:
    """Every size problem of placing ``plan``'s experts over ``ep`` ranks, as one ValueError
    (raised on every rank alike, before any collective): an expert count that leaves a rank
    no expert (torch.chunk of E over ep leaves the last ranks empty), and experts stored as
    blocks of rows (``[E * F, H]``) that ep does not divide (a chunk would cut an expert)."""
    problems = []
    for name, (_, args) in expert_targets(model, plan).items():
        e = int(args["num_experts"])
        sizes = chunk_sizes(e, ep)
        if min(sizes) == 0:
            fits = [d for d in range(1, e + 1) if min(chunk_sizes(e, d)) > 0]
            problems.append(
                f"{name}: {e} experts over ep={ep} gives ranks {sizes} experts (torch.chunk), "
                f"so a rank would hold none; use an ep_size among {fits}"
            )
            continue
        params = dict(model.get_submodule(name).named_parameters())
        blocks = [n for n in args.get("params", ()) if n in params and params[n].shape[0] > e]
        if blocks and e % ep:
            problems.append(
                f"{name}: {blocks[0]} stores its {e} experts as blocks of rows; ep={ep} does not "
                f"divide {e}, so a rank's chunk would cut an expert; use an ep_size dividing {e}"
            )
    if problems:
        raise ValueError(
            "expert parallelism cannot place these experts:\n  " + "\n  ".join(problems)
        )
