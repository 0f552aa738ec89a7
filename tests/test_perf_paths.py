"""The fast paths of issue 30, checked by behaviour and by counts, never by timing.

- ``generate`` runs the modules whose hooks only swap parameters (colwise, replicated norms)
  hook-free on their local shards, swapped once; the same tokens as the unsharded model, every
  parameter a DTensor again afterwards (also when generate raises), and a forward that turns grad
  back on inside it refused.
- the lm_head's all-gather along the vocabulary writes straight into the result on the
  shared-memory path: no ``aten::cat``, no padding, exact for even and uneven splits, with and
  without grad.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.models import batch, build


def _greedy(model, prompt, **extra):
    return model.generate(
        prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0, **extra
    )


def _hook_calls(fn) -> tuple[object, dict[str, int]]:
    """``fn()`` and how often each style's tpkit pre-hook ran, by style name."""
    calls: dict[str, int] = {}

    def prof(frame, event, _arg):
        if event == "call" and frame.f_code.co_name == "_pre_hook":
            style = frame.f_locals.get("self")
            name = getattr(style, "name", "?")
            calls[name] = calls.get(name, 0) + 1

    sys.setprofile(prof)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, calls


def _hook_count(model) -> int:
    """tpkit's own hooks on the model (bound to a module's style record)."""
    n = 0
    for m in model.modules():
        style = m.__dict__.get("_tpkit_style")
        hooks = (*m._forward_pre_hooks.values(), *m._forward_hooks.values())
        n += sum(1 for h in hooks if style is not None and getattr(h, "__self__", None) is style)
    return n


def check_generate_hook_free(name: str) -> dict:
    import tpkit

    ref = build(name)
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    prompt = batch(ref.config.vocab_size, shape=(2, 5))
    hooks_before = _hook_count(model)
    expected = _greedy(ref, prompt)
    tokens, calls = _hook_calls(lambda: _greedy(model, prompt))
    _, calls_off = _hook_calls(lambda: _greedy(model, prompt, tp_local_decode=False))

    class Boom(Exception):
        pass

    def raising(_ids, scores):
        raise Boom

    raised = False
    try:
        _greedy(model, prompt, logits_processor=[raising])
    except Boom:
        raised = True

    def grad_inside(ids, scores):
        with torch.enable_grad():
            model(input_ids=ids)
        return scores

    refused = ""
    try:
        _greedy(model, prompt, logits_processor=[grad_inside])
    except RuntimeError as exc:
        refused = str(exc)
    return {
        "equal": torch.equal(tokens, expected),
        "calls": calls,
        "calls_off": calls_off,
        "raised": raised,
        "refused": refused,
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "hooks_same": _hook_count(model) == hooks_before,
        # after all that, a forward with grad still matches (hooks and shards back in place)
        "logits_diff": (model(input_ids=prompt).logits - ref(input_ids=prompt).logits)
        .abs()
        .max()
        .item(),
    }


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_generate_runs_identity_modules_hook_free(ranks2, name):
    for r in ranks2.run(check_generate_hook_free, name):
        assert r["equal"], r
        # column layers and norms are not hooked during generate; row layers still are
        assert not {"colwise", "packed_qkv_colwise", "replicate"} & set(r["calls"]), r["calls"]
        assert r["calls"].get("rowwise", 0) > 0, r["calls"]
        # ... and with tp_local_decode=False every split module is, as before
        assert r["calls_off"].get("colwise", 0) + r["calls_off"].get("packed_qkv_colwise", 0)
        assert r["raised"] and r["all_dtensor"] and r["hooks_same"], r
        assert "grad enabled inside generate" in r["refused"], r["refused"]
        assert r["logits_diff"] <= 1e-5, r


def check_gather_last(sizes: list[int], lead: tuple[int, ...], grad: bool) -> dict:
    import torch.distributed as dist

    from tpkit.parallel.comm import gather_from_tp

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7)
    full = torch.randn((*lead, sum(sizes)), generator=g)
    start = sum(sizes[:rank])
    x = full[..., start : start + sizes[rank]].clone().requires_grad_(grad)
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu) as prof, torch.set_grad_enabled(grad):
        out = gather_from_tp(x, sizes, rank, dist.group.WORLD)
    ops = {e.key for e in prof.key_averages()}
    res = {"equal": torch.equal(out.detach(), full), "cat": "aten::cat" in ops}
    res["pad"] = "aten::constant_pad_nd" in ops
    if grad:
        out.backward(torch.arange(out.numel(), dtype=out.dtype).view_as(out))
        want = torch.arange(out.numel(), dtype=out.dtype).view_as(out)
        res["grad"] = torch.equal(x.grad, want[..., start : start + sizes[rank]])
    return res


@pytest.mark.parametrize(
    "sizes,lead,grad",
    [
        ([16, 16], (3, 5), False),  # even
        ([51, 50], (2, 9), False),  # uneven (a 101-token vocabulary)
        ([51, 50], (2, 9), True),  # with grad: backward keeps this rank's slice
        ([4000, 4000], (3, 70), False),  # 3.2 MiB per rank: several slot-sized pieces of rows
        ([2, 0], (2, 3), False),  # a rank with an empty part takes the path with the others
    ],
)
def test_gather_last_straight_into_result(ranks2, sizes, lead, grad):
    for r in ranks2.run(check_gather_last, sizes, lead, grad):
        assert r["equal"], r
        assert not r["cat"] and not r["pad"], r  # no stacked copy, padding or cat
        assert r.get("grad", True), r


def test_gather_last_row_wider_than_a_slot_falls_back(ranks2):
    # one row of 300k float32 values (1.2 MiB) exceeds a 1 MiB slot: the generic path, exact
    for r in ranks2.run(check_gather_last, [300_000, 299_999], (2,), False):
        assert r["equal"], r


def test_threads_per_rank_divides_the_cores():
    from tpkit.parallel.shm import threads_per_rank

    assert threads_per_rank(2, cores=2) == 1  # this box at tp=2: what the ratios used
    assert threads_per_rank(2, cores=16) == 8  # torchrun's default of 1 would idle 14 cores
    assert threads_per_rank(4, cores=2) == 1  # never 0
    assert threads_per_rank(1) >= 1
