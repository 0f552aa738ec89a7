"""Every check that can fail, run before the first collective and identically on every rank.

Each problem becomes one line of a single ``ValueError`` that names the module, the numbers and
the fix, so a bad configuration is one clear error on all ranks instead of a reshape crash in
forward or a hang in a collective. Pure: nothing here changes the plan or the model (derivation
settles what it may change, `tpkit.settle.settle`), and nothing communicates.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from tpkit.plan.catalogue import style_spec
from tpkit.plan.layout import param_layouts
from tpkit.plan.spec import Plan, Source
from tpkit.settle.dryrun import dry_run
from tpkit.settle.kvheads import head_counts
from tpkit.settle.settle import constraints, head_constraints
from tpkit.trace.analysis import Analysis
from tpkit.trace.gc_quiet import with_frozen_heap
from tpkit.trace.inputs import output_embeddings
from tpkit.trace.trace import repeated_blocks

__all__ = ["checkpoint_problems", "head_constraints", "problems", "validate"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _use(values: Iterable[int]) -> str:
    g = 0
    for v in values:
        g = math.gcd(g, v)
    options = _divisors(g) if g else [1]
    if len(options) == 1:
        return "use tp_size 1"
    return "use tp_size " + ", ".join(map(str, options[:-1])) + f" or {options[-1]}"


@with_frozen_heap  # as derive_plan: its dry runs skip the imported world
def validate(model: nn.Module, plan: Plan, tp_size: int, **options: Any) -> None:
    """Raise one ValueError listing every problem with applying ``plan`` at ``tp_size`` and the
    training ``options`` (`problems`' keyword arguments), or return None. Derive the plan for
    the same ``tp_size`` first (`derive_plan(model, plan, tp_size)`): inferred groups it does not
    divide are then already replicated, with a note, and are not errors."""
    found = problems(model, plan, tp_size, **options)
    if found:
        raise ValueError("Cannot apply tensor parallelism:\n- " + "\n- ".join(found))


def problems(
    model: nn.Module,
    plan: Plan,
    tp_size: int,
    *,
    dp_size: int = 1,
    sharded: bool = False,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    param_dtype: torch.dtype | None = None,
    example_inputs: tuple | Mapping | None = None,
    analysis: Analysis | None = None,
) -> list[str]:
    """`validate`'s problems as a list (empty when there are none). ``analysis``: the one
    `derive_plan` built for this model and these inputs, whose dry runs are answered already
    (`tpkit.trace.analysis.Analysis`); else one is built here."""
    found = _device_map_problems(model) + _pattern_problems(model, plan)
    if found:
        return found
    found += _option_problems(model, plan, dp_size, sharded, sequence_parallel, loss_parallel)
    if param_dtype is not None and not (sharded and dp_size > 1):
        found.append(
            f"param_dtype={param_dtype} is FSDP2's mixed precision and needs sharded=True with "
            "dp_size > 1; for tp only, cast the model (model.to(torch.bfloat16)) instead."
        )
    if tp_size <= 1:
        return found
    found_constraints = [(c.owner, c.label, c.count) for c in constraints(model, plan)]
    fix = _use(c[2] for c in found_constraints)
    for owner, label, count in found_constraints:
        if count % tp_size:
            found.append(f"tp_size={tp_size} does not divide {label} of {owner}; {fix}.")
    found += _replicated_heads_problems(model, plan, tp_size)
    found += _tied_problems(model, plan)
    found += _identity_expert_problems(model, plan)
    found += _dtype_problems(model, plan)
    found += _max_norm_problems(model, plan)
    analysis = Analysis(model, example_inputs) if analysis is None else analysis
    if not found:
        found += _user_dataflow_problems(analysis, plan, tp_size)
    user = any(plan.source(p) == Source.USER for p in plan)  # then dry-run at tp_size just above
    if not found and tp_size != 2 and not user:
        found += _tp_dataflow_problems(analysis, plan, tp_size, fix)
    return found


def _tp_dataflow_problems(analysis: Analysis, plan: Plan, tp: int, fix: str) -> list[str]:
    """A derived plan is dry-run at tp=2 when it is made; at another tp the model's code may
    still not fit its shards (CodeGen's ``qkv_proj`` interleaves 4 fixed groups, ``mp_num``,
    whatever the heads: tp=3 cuts groups apart). Under "auto" derivation settles that (the
    group gathered or whole); transformers' plan forced (``plan="config"``) is not rewritten,
    so it is refused here. One forward on fake tensors with rank 0's
    (and the last rank's) shards at this tp, no collectives; the failing module is named with
    its integer attributes tp does not divide, and the tp sizes that do run are listed."""
    model = analysis.model
    error = dry_run(analysis, plan, tp)
    if error is None or dry_run(analysis, Plan(), tp) is not None:
        return []
    where, _, brief = error[3:].partition(": ") if error.startswith("in ") else ("", "", error)
    module = dict(model.named_modules()).get(where)
    odd = [
        f"{a}={v}"
        for a, v in getattr(module, "__dict__", {}).items()
        if isinstance(v, int)
        and not isinstance(v, bool)
        and v > 1
        and v % tp
        and not any(k in a for k in ("dim", "idx", "layer"))  # sizes within a head, indices
    ]
    hint = f" (its {', '.join(odd[:3])}: not a multiple of tp_size={tp})" if odd else ""
    candidates = [int(t) for t in re.findall(r"\d+", fix)][:8]
    runs = [t for t in candidates if t == 1 or dry_run(analysis, plan, t) is None]
    use = ", ".join(map(str, runs)) if runs else "1"
    return [
        f"tp_size={tp}: {where or 'the model'} cannot run on its shards{hint}: {brief}; "
        f"use tp_size {use}."
    ]


def _replicated_heads_problems(model: nn.Module, plan: Plan, tp: int) -> list[str]:
    """colwise_replicated_heads gives each rank one whole KV head: tp must be a multiple of the
    KV heads, and tp must divide the attention's query heads."""
    out = []
    modules = dict(model.named_modules())
    for t in plan.resolve(model):
        if t.kind != "module" or t.style != "colwise_replicated_heads":
            continue
        kv = int(plan.args_for(t.pattern).get("heads", 1))
        q, _, _ = head_counts(model, modules[t.name.rsplit(".", 1)[0]])
        if kv <= 0 or tp % kv or (q and q % tp):
            out.append(
                f"{t.name} is colwise_replicated_heads with {kv} KV heads and {q} query heads: "
                f"tp_size={tp} must be a multiple of the KV heads and divide the query heads; "
                f"use a tp_size that does, or plain colwise when tp divides the KV heads."
            )
            break
    return out


def _device_map_problems(model: nn.Module) -> list[str]:
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return []
    devices = sorted({str(d) for d in device_map.values()})
    return [
        f"the model was loaded with a device_map (devices {devices}); tensor parallelism places "
        "the shards itself. Load it without device_map, or with tpkit.from_pretrained(path)."
    ]


def _pattern_problems(model: nn.Module, plan: Plan) -> list[str]:
    if not any(plan.source(p) == Source.USER for p in plan):
        return []  # only a user's pattern can name nothing: derived ones come from the model
    user = [p for p in plan.unmatched(model) if plan.source(p) == Source.USER]
    return [
        f"plan pattern {p!r} (style {plan[p]!r}) matches no module or parameter of "
        f"{type(model).__name__}; check the name against `tpkit plan` or model.named_modules()."
        for p in user
    ]


def _identity_expert_problems(model: nn.Module, plan: Plan) -> list[str]:
    """moe_identity_expert divides its input by tp for the experts' all-reduce to add back:
    outside a moe_tp_experts module nothing adds it back."""
    out = []
    for t in plan.resolve(model):
        if t.kind == "module" and t.style == "moe_identity_expert":
            parts = t.name.split(".")
            ancestors = (".".join(parts[:i]) for i in range(1, len(parts)))
            if not any((plan.style_for(a) or ("",))[0] == "moe_tp_experts" for a in ancestors):
                out.append(
                    f"{t.name} is moe_identity_expert but no module above it is moe_tp_experts "
                    "(whose all-reduce restores its input / tp); give its experts module "
                    "moe_tp_experts or the identity expert 'replicate'."
                )
    return out


def _option_problems(model, plan, dp_size, sharded, sequence_parallel, loss_parallel) -> list:
    out = []
    if loss_parallel:
        out += _loss_parallel_problems(model, plan)
    if sequence_parallel:
        out += _sequence_parallel_problems(model, plan)
    return out


def _loss_parallel_problems(model: nn.Module, plan: Plan) -> list[str]:
    """The vocab-parallel loss replaces ``model.loss_function``: the head must be gathered (then
    handed on sharded) and the model's forward must compute its loss through that function."""
    head = output_embeddings(model)
    names = {id(m): n for n, m in model.named_modules()}
    hit = plan.style_for(names[id(head)]) if head is not None and id(head) in names else None
    forward = getattr(inspect.unwrap(type(model).forward), "__code__", None)
    calls_loss = forward is not None and "loss_function" in forward.co_names
    if hit is None or hit[0] != "colwise_gather_output" or not calls_loss:
        return [
            "loss_parallel needs a causal LM whose output head uses colwise_gather_output and "
            f"whose loss goes through model.loss_function; {type(model).__name__} does not "
            "(use loss_parallel=False)."
        ]
    return []


_GATHERED_PAIR_STYLES = ("colwise_gather_output", "rowwise_split_input")


def _sequence_parallel_problems(model: nn.Module, plan: Plan) -> list[str]:
    """Why sequence parallelism cannot apply to this model (see `tpkit.parallel.sequence`)."""
    out = []
    name = type(model).__name__
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        out.append(
            f"sequence_parallel supports decoder-only models; {name} is an encoder-decoder (its "
            "cross-attention reads the encoder's whole sequence). Use sequence_parallel=False."
        )
    moe = [t.name for t in plan.resolve(model) if t.style == "moe_tp_experts"]
    if moe:
        out.append(
            f"sequence_parallel does not support tensor-parallel MoE experts ({moe[0]}); use "
            "sequence_parallel=False."
        )
    blocks = repeated_blocks(model)
    if not blocks:
        out.append(f"sequence_parallel needs repeated blocks (an nn.ModuleList) in {name}.")
    styles = {t.name: t.style for t in plan.resolve(model) if t.kind == "module"}
    names = {id(m): n for n, m in model.named_modules()}
    prefixes = tuple(names[id(b)] + "." for b in blocks)
    gathered = [
        n
        for n, s in styles.items()
        if n.startswith(prefixes) and style_spec(s).name in _GATHERED_PAIR_STYLES
    ]
    if gathered:
        out.append(
            f"sequence_parallel does not support gathered pairs inside blocks ({name}'s "
            f"{gathered[0]} is {styles[gathered[0]]}: the code between its column and row layers "
            "runs on whole activations, which a sequence chunk is not). Use "
            "sequence_parallel=False, or plan the pair as colwise / rowwise if its code can run "
            "split."
        )
    regions = {n.rsplit(".", 1)[0] for n, s in styles.items() if style_spec(s).splits_output}
    apart = [
        n
        for n, s in styles.items()
        if style_spec(s).splits_input and (n.rsplit(".", 1)[0] if "." in n else "") not in regions
    ]
    if apart:
        out.append(
            "sequence_parallel needs every row-parallel layer in the same module as the column "
            f"layers feeding it (Llama's self_attn, mlp), so that the module's output is the "
            f"sequence chunk; {name}'s {apart[0]} is not (a post-norm block whose residual add "
            "sits in a module of its own). Use sequence_parallel=False."
        )
    return out


def checkpoint_problems(
    params: Mapping[str, torch.Tensor], stored: Mapping[str, tuple[str, torch.dtype, tuple]]
) -> list[str]:
    """Every stored tensor a model will read must have the model's global shape and a dtype
    that converts to it. ``stored``: parameter name -> (file, dtype, shape) of what holds it.
    A checkpoint of another model size (a 512-row embedding into a 256-vocab model) is one clear
    error, never a silent partial load."""
    out = []
    for name, (file, dtype, shape) in stored.items():
        p = params[name]
        if tuple(shape) != tuple(p.shape):
            out.append(
                f"{name}: the model expects shape {tuple(p.shape)}, {file} holds shape "
                f"{tuple(shape)}"
            )
        elif p.is_floating_point() != dtype.is_floating_point:
            out.append(
                f"{name}: the model expects {p.dtype}, {file} holds {dtype} (a quantized or "
                "integer checkpoint is not a float one)"
            )
    return out


def _max_norm_problems(model: nn.Module, plan: Plan) -> list[str]:
    """An embedding with ``max_norm`` renormalises each looked-up row by its norm over all
    columns, in place: with its columns split, each rank would use its own columns' norm."""
    out, modules = [], dict(model.named_modules())
    for t in plan.resolve(model):
        mod = modules.get(t.name) if t.kind == "module" else None
        if getattr(mod, "max_norm", None) is not None and style_spec(t.style).shard == "cols":
            out.append(
                f"{t.name} ({type(mod).__name__}, max_norm={mod.max_norm}) cannot be split by "
                f"columns ({t.style}): each rank would renormalise rows by its own columns' "
                "norm; replicate it ('replicate') or drop max_norm."
            )
    return out


def _dtype_problems(model: nn.Module, plan: Plan) -> list[str]:
    """Integer (quantized) weights cannot be split by these styles: their bytes are not the
    values a slice of the float weight would hold (packed 4-bit, per-block scales)."""
    out = []
    for full, (style, layout, module) in param_layouts(model, plan).items():
        p = module._parameters[full.rsplit(".", 1)[-1]]
        if layout.sharded and not (p.is_floating_point() or p.is_complex()):
            out.append(
                f"{full} ({style}) holds {p.dtype} values ({type(p).__name__}): quantized or "
                "integer weights cannot be split as float ones; load the model in a float "
                "dtype (dtype=torch.bfloat16) or leave this module replicated."
            )
            if len(out) >= 5:
                break
    return out


def _user_dataflow_problems(analysis: Analysis, plan: Plan, tp_size: int) -> list[str]:
    """User entries that the model's dataflow cannot run: a column layer fed by another column
    layer's split output (``down_proj: colwise`` after ``up_proj: colwise``), a row layer fed a
    whole activation. Found by one forward on fake tensors with rank 0's shard shapes (no
    memory, no collectives), only when the user named a module: derived plans are checked when
    they are made."""
    user = [p for p in plan if plan.source(p) == Source.USER]
    if not user:
        return []
    model = analysis.model
    error = dry_run(analysis, plan, tp_size)
    if error is None or dry_run(analysis, Plan(), tp_size) is not None:
        return []  # runs, or the default trace inputs do not fit this model's forward at all
    hints = []
    traced = analysis.traced()  # without it the dry run's error alone still says what failed
    nodes = traced.nodes if traced is not None else {}
    styles = {t.name: t.style for t in plan.resolve(model) if t.kind == "module"}
    for name, style in styles.items():
        feeders = sorted(s for s in getattr(nodes.get(name), "src", ()) if s in styles)
        split_in = [s for s in feeders if style_spec(styles[s]).splits_output]
        if style_spec(style).splits_output and split_in:
            hints.append(
                f"{name} is {style} but its input comes from {split_in[0]} "
                f"({styles[split_in[0]]}), whose output is already split: make {name} rowwise"
            )
        elif style_spec(style).splits_input and name in nodes and not split_in:
            hints.append(
                f"{name} is {style} but its input is not split by a column layer: make its "
                "producer colwise, or use rowwise_split_input"
            )
    lines = [
        f"the plan (with entries {', '.join(map(repr, user[:4]))}) fails a tp={tp_size} "
        f"forward on fake tensors: {error}"
    ]
    return lines + hints[:3]


def _tied_problems(model: nn.Module, plan: Plan) -> list[str]:
    layouts = param_layouts(model, plan)
    by_id: dict[int, list[str]] = {}
    for full, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(full)
    problems = []
    for names in by_id.values():
        kinds = {layouts[n][1] for n in names}
        if len(names) > 1 and len(kinds) > 1:
            styles = ", ".join(f"{n} ({layouts[n][0]})" for n in names)
            problems.append(
                f"tied parameters would be split differently: {styles}; give them styles that split "
                "the same dimension (vocab_parallel with colwise_gather_output) or untie them."
            )
    return problems
