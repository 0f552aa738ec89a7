"""Running a model on fake tensors: what the trace and the dry run share.

Parameters and buffers are swapped for fake meta tensors of the same (or a shard's) shape,
the inputs are fake too, and torch's ``FakeTensorMode`` propagates shapes and dtypes without
allocating or computing anything. A model whose code needs real values (a data-dependent branch)
can instead run on its real weights with zero shards, when it is small (`real_state`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tpkit.compat import tree_map
from tpkit.trace.inputs import InputRecipe, synthesize_inputs, trying
from tpkit.trace.kept_state import kept_attributes
from tpkit.trace.shadow import GivenValues

__all__ = [
    "REAL_TRACE_MAX_PARAMS",
    "TRACE_BATCH",
    "TRACE_SEQ",
    "example_inputs",
    "fake_friendly_experts",
    "fake_inputs",
    "meta_state",
    "quiet_fake_tensors",
    "real_state",
    "trace_batch",
    "trace_one_row",
]

TRACE_BATCH, TRACE_SEQ = 3, 7
#: Largest model traced on its real weights when the fake-tensor trace fails.
REAL_TRACE_MAX_PARAMS = 50_000_000  # odd sizes, unlikely to coincide with a width or head count


def trace_batch(recipe: InputRecipe | None = None) -> int:
    """The batch size of the made-up inputs: `TRACE_BATCH`, or 1 where the forward refused
    more rows (`tpkit.trace.inputs.InputRecipe.one_row`: GPT-2's sequence classifiers without a
    pad token, "Cannot handle batch sizes > 1"); the dry runs then use one row too."""
    return 1 if recipe is not None and recipe.one_row else TRACE_BATCH


def trace_one_row(recipe: InputRecipe) -> contextlib.AbstractContextManager[None]:
    """Make up one-row inputs inside the block, and from then on if it exits cleanly (the
    forward accepted them)."""
    return trying(recipe, one_row=True)


def example_inputs(model: nn.Module, recipe: InputRecipe | None = None) -> tuple[tuple, dict]:
    """Made-up trace inputs (`tpkit.trace.inputs.synthesize_inputs`) at the trace's sizes, as
    ``recipe`` makes them (a fresh one: the first try)."""
    return synthesize_inputs(model, trace_batch(recipe), TRACE_SEQ, recipe)


@contextlib.contextmanager
def meta_state(model: nn.Module, fake, shapes: Mapping[int, tuple] | None = None):
    """Temporarily swap every parameter and buffer for a fake meta tensor of the same shape.

    Fake tensors (torch's ``FakeTensorMode``) rather than bare meta ones: transformers' code asks
    ``is_tracing(tensor)`` before data-dependent checks (packed sequences, all-ones masks) and
    skips them for fake tensors, as it does under torch.compile.
    """
    saved = []
    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for k, v in list(store.items()):
                if v is not None and (v.device.type != "meta" or id(v) in (shapes or {})):
                    saved.append((store, k, v))
    memo: dict[int, torch.Tensor] = {}
    try:
        for store, k, v in saved:
            if id(v) not in memo:
                shape = (shapes or {}).get(id(v), tuple(v.shape))
                meta = torch.empty(shape, dtype=v.dtype, device="meta")
                if isinstance(v, nn.Parameter):  # made a parameter first: 4x cheaper than after
                    meta = nn.Parameter(meta, v.requires_grad)
                memo[id(v)] = fake.from_tensor(meta)
            store[k] = memo[id(v)]
        with kept_attributes(model):  # what the forward writes, undone (RWKV's rescale flag)
            yield
    finally:
        for store, k, v in saved:
            store[k] = v


@contextlib.contextmanager
def fake_friendly_experts(model: nn.Module):
    """Temporarily run transformers' fused MoE experts as ``batched_mm`` instead of
    ``grouped_mm``, whose meta kernel accepts only bfloat16 (a float32 model would not trace).
    Both compute the same thing with the same weights, so the dataflow is the same. The raw
    value of every config reachable from a module (sub-configs too: transformers' setter
    copies a value into them) is saved and put back as it was."""
    key = "_experts_implementation_internal"
    configs: dict[int, Any] = {}
    todo = [getattr(m, "config", None) for m in model.modules()]
    while todo:
        c = todo.pop()
        if c is None or id(c) in configs or not hasattr(c, "__dict__"):
            continue
        configs[id(c)] = c
        for sub in getattr(c, "sub_configs", None) or {}:
            todo.append(c.__dict__.get(sub))
    saved = [(c, c.__dict__[key]) for c in configs.values() if key in c.__dict__]
    try:
        for c, value in saved:
            if value == "grouped_mm":
                c.__dict__[key] = "batched_mm"
        yield
    finally:
        for c, value in saved:
            c.__dict__[key] = value


@contextlib.contextmanager
def real_state(model: nn.Module, shapes: Mapping[int, tuple]):
    """Temporarily give each sharded parameter a zero tensor of its shard's shape, and every
    other parameter and buffer a copy: the forward may change them in place (RWKV's rescale
    divides its output weights, a batch norm in training updates its running stats), and the
    user's tensors must come out as they went in. Real dry runs are for small models only
    (`tpkit.settle.dryrun`), so the copies are small."""
    saved = []
    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            saved += [(store, k, v) for k, v in store.items() if v is not None]
    try:
        memo: dict[int, torch.Tensor] = {}
        for store, k, v in saved:
            if id(v) not in memo:
                stand_in = v.new_zeros(shapes[id(v)]) if id(v) in shapes else v.detach().clone()
                if isinstance(v, nn.Parameter):
                    stand_in = nn.Parameter(stand_in, v.requires_grad)
                memo[id(v)] = stand_in
            store[k] = memo[id(v)]
        with kept_attributes(model):  # as `meta_state`
            yield
    finally:
        for store, k, v in saved:
            store[k] = v


def fake_inputs(
    model: nn.Module,
    given: tuple | Mapping | None,
    fake: Any,
    real: bool,
    recipe: InputRecipe | None = None,
    values: GivenValues | None = None,
):
    """(args, kwargs) for one traced forward: ``given`` (a positional tuple or a kwargs dict, any
    device) or `example_inputs` made as ``recipe`` says; as fake meta tensors, or (``real``)
    zeros on the model's device. The values of integer inputs go to ``values`` (for the
    forward's `tpkit.trace.shadow.ShadowValues`)."""
    if given is None:
        args, kwargs = example_inputs(model, recipe)
    elif isinstance(given, Mapping):
        args, kwargs = (), dict(given)
    else:
        args, kwargs = tuple(given), {}
    if real:
        device = next(model.parameters()).device
        convert = lambda t: _real_input(t, device)  # noqa: E731
    else:  # integer inputs keep their values for the shadow run (`GivenValues`)
        kept = values if values is not None else GivenValues()
        convert = lambda t: kept.keep(fake.from_tensor(t.to("meta")), t)  # noqa: E731
    return tree_map(lambda t: convert(t) if isinstance(t, torch.Tensor) else t, (args, kwargs))


def _real_input(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An input of a real forward: zeros, but an integer one with values keeps them (an image
    grid and its placeholder ids must agree)."""
    if t.device.type != "meta" and not (t.is_floating_point() or t.is_complex()):
        return t.to(device)
    return torch.zeros_like(t, device=device)


@contextlib.contextmanager
def quiet_fake_tensors():
    """Silence torch's fake-tensor logger: a failed fake forward is reported by its caller."""
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level, quiet.level = quiet.level, logging.CRITICAL
    try:
        yield
    finally:
        quiet.setLevel(level)
