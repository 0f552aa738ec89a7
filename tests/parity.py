"""Shared checks for the full-size and parity tests: a tiny architecture split at tp vs the
unsharded model (logits and every gradient), and the share of >=2-D parameter bytes a plan
shards on an architecture's default (full-size) config built on the meta device."""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def tiny_parity(
    model_type: str,
    class_name: str,
    overrides: dict | None = None,
    encoder_states: int = 0,
    plan: str = "auto",
) -> dict:
    """Run on every rank: max |diff| of the logits and of every parameter gradient (backward of
    a fixed random projection of the logits) between ``tensor_parallel`` and the unsharded
    model, and the share of >=2-D parameters it sharded. ``encoder_states``: that many
    positions of random ``encoder_hidden_states`` (a decoder-only model's cross-attention)."""
    import transformers

    import tpkit
    from tests.tiny import inputs, tiny_config

    config = tiny_config(model_type, class_name)
    for k, v in (overrides or {}).items():
        setattr(config, k, v)
    torch.manual_seed(0)
    ref = getattr(transformers, class_name)(config).float().eval()
    kind = "seq2seq" if getattr(config, "is_encoder_decoder", False) else "causal-lm"
    x = inputs(ref, kind)
    if ref.main_input_name == "input_features":  # a speech encoder (Whisper)
        frames = 2 * config.max_source_positions
        g = torch.Generator().manual_seed(3)
        x["input_features"] = torch.randn(
            x.pop("input_ids").shape[0], config.num_mel_bins, frames, generator=g
        )
    if encoder_states:
        g = torch.Generator().manual_seed(4)
        shape = (x["input_ids"].shape[0], encoder_states, config.hidden_size)
        x["encoder_hidden_states"] = torch.randn(shape, generator=g)
    model = tpkit.tensor_parallel(copy.deepcopy(ref), plan=plan)
    w = None
    for m in (ref, model):
        out = _logits(m(**x))
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)) if w is None else w
        (out * w).sum().backward()
        m._out = out.detach()
    ref_params = dict(ref.named_parameters())
    grad, top, worst, missing, total, sharded = 0.0, 0.0, "", [], 0, 0
    for name, p in model.named_parameters():
        g, want = p.grad, ref_params[name].grad
        if (g is None) != (want is None):
            missing.append(name)
            continue
        if p.ndim >= 2:
            total += p.numel()
            sharded += (
                p.numel() if isinstance(p, DTensor) and not p.placements[0].is_replicate() else 0
            )
        if g is not None:
            g = g.full_tensor() if isinstance(g, DTensor) else g
            diff = (g - want).abs().max().item()
            worst = name if diff > grad else worst
            grad, top = max(grad, diff), max(top, want.abs().max().item())
    return {
        "logits": (model._out - ref._out).abs().max().item(),
        "grad": grad,
        "grad_scale": top,
        "worst": worst,
        "missing": missing,
        "share": sharded / max(1, total),
    }


def greedy_parity(model_type: str, class_name: str) -> tuple[Any, Any, bool]:
    """Run on every rank: the tiny model and ``tensor_parallel`` of a copy, each generating 6
    greedy tokens after a 5-token prompt with the cache on; (unsharded, split, same tokens)."""
    import tpkit
    from tests.tiny import build, inputs

    ref = build(model_type, class_name).eval()
    ref.config.use_cache = True
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    prompt = inputs(ref, "causal-lm")["input_ids"][:, :5]
    kw = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = ref.generate(prompt, **kw)
        tokens = model.generate(prompt, **kw)
    return ref, model, torch.equal(tokens, expected)


def full_size_share(class_name: str, tp: int = 2, **overrides: Any) -> tuple[float, dict]:
    """Share of >=2-D parameter elements the derived plan shards for the architecture's default
    config on the meta device (validated at ``tp``), and the largest whole ones by pattern."""
    r = full_size_report(class_name, tp, **overrides)
    return r["share"], r["whole"]


def full_size_report(
    class_name: str, tp: int = 2, model_type: str | None = None, **overrides: Any
) -> dict:
    """`full_size_share`'s figures and, below 90%, why: the largest pattern left whole, its
    part of the 2-D elements and the plan's note on it (``why``). With ``model_type`` the
    default config is built as `tests.tiny.full_config` repairs it."""
    import transformers

    from tests.tiny import full_config
    from tpkit.plan import derive_plan, param_layouts, validate

    cls = getattr(transformers, class_name)
    if model_type:
        config = full_config(model_type, class_name)
        for k, v in overrides.items():
            setattr(config, k, v)
    else:
        config = cls.config_class(**overrides)
    with torch.device("meta"):
        model = cls(config).float().eval()  # as from_pretrained returns it (Reformer's
        # training forward accepts only its full axial length)
    if hasattr(model, "set_default_language"):  # X-MOD routes through per-language adapters
        model.set_default_language(next(iter(config.languages)))
    plan = derive_plan(model, "auto", tp)
    validate(model, plan, tp)
    layouts = param_layouts(model, plan)
    total = sharded = 0
    whole: dict[str, int] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if p.ndim < 2 or id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if layouts[name][1].sharded:
            sharded += p.numel()
        else:
            key = _generic(name)
            whole[key] = whole.get(key, 0) + p.numel()
    whole = dict(sorted(whole.items(), key=lambda kv: -kv[1])[:5])
    share = sharded / max(1, total)
    why = ""
    if share < 0.9 and whole:
        top, n = next(iter(whole.items()))
        module = top.rsplit(".", 1)[0]
        note = next((v for k, v in plan.notes.items() if _generic(k) == module), "")
        why = f"{top} stays whole ({n / total:.0%} of 2-D elements): " + (
            note or "no plan entry splits it"
        )
    return {"share": share, "whole": whole, "why": why}


def full_size_reports_part(cases: list[tuple[str, dict]]) -> dict[int, dict]:
    """Run on every rank: `full_size_report` of this rank's share of ``cases`` (every world-th
    one, from its rank on), by index; an exception is returned as ``{"error": traceback}`` so it
    fails only its own case."""
    import traceback

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[int, dict] = {}
    for i in range(rank, len(cases), world):
        class_name, kwargs = cases[i]
        try:
            out[i] = full_size_report(class_name, **kwargs)
        except Exception:  # noqa: BLE001 - reported by the case's own test
            out[i] = {"error": traceback.format_exc()}
    return out


def full_size_reports(group: Any, cases: list[tuple[str, dict]]) -> list[dict]:
    """`full_size_report` of each ``(class_name, kwargs)`` in ``cases``, spread over the ranks
    of ``group`` (a `tests.harness.RankGroup`). A full-size build on meta runs in one process
    and leaves the other core idle; its plan is pure (no process group), so the ranks of a
    group can each derive a different one: on 2 cores that halves the wall time, with the
    same figures. Alternate cases go to alternate ranks: order them so the costly ones
    alternate too."""
    merged: dict[int, dict] = {}
    for part in group.run(full_size_reports_part, cases, timeout=600):
        merged.update(part)
    return [merged[i] for i in range(len(cases))]


def _generic(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def assert_parity(results: list[dict], tol: float = 1e-5) -> None:
    """Every rank's `tiny_parity` result within ``tol``: logits max-abs, gradients relative to
    the largest gradient when it exceeds 1 (float32 sums in another order), nothing missing."""
    for r in results:
        assert r["logits"] <= tol, r
        assert r["grad"] <= tol * max(1.0, r["grad_scale"]), r
        assert not r["missing"], r


class Residual(torch.nn.Module):
    """``x + inner(x)``: the residual add of the random graphs of `tests.test_property` (on
    features) and `tests.test_convs` (on channels), where a split output must not meet the
    whole stream it is added to."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


def module_parity(ref: torch.nn.Module, model: torch.nn.Module, *args: Any) -> dict:
    """Run on every rank: a plain module's output (one tensor) and every parameter gradient
    (backward of a fixed random projection of the output; full tensors) of the split ``model``
    against the unsharded ``ref`` on ``args``: max |diff| (``out``, ``grad``), the largest
    reference output and gradient (``out_scale``, ``scale``: float32 sums in another order
    differ relative to them), parameters with a gradient on one side only (``missing``)
    and the number of parameters the split sharded (``sharded``)."""
    outs = []
    for m in (ref, model):
        y = m(*args)
        y = y.full_tensor() if isinstance(y, DTensor) else y
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
        (y * w).sum().backward()
        outs.append(y.detach())
    want = dict(ref.named_parameters())
    grad, scale, missing, sharded = 0.0, 0.0, [], 0
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and any(not pl.is_replicate() for pl in p.placements):
            sharded += 1
        if (p.grad is None) != (want[name].grad is None):
            missing.append(name)
        elif p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grad = max(grad, (g - want[name].grad).abs().max().item())
            scale = max(scale, want[name].grad.abs().max().item())
    return {
        "out": (outs[0] - outs[1]).abs().max().item(),
        "out_scale": outs[0].abs().max().item(),
        "grad": grad,
        "scale": scale,
        "missing": missing,
        "sharded": sharded,
    }
