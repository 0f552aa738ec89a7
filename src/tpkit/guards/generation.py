"""``generate()`` on a tensor-parallel model: inputs moved to this rank's device and checked to
agree across the TP group before decoding starts.

Sampling needs no extra machinery: `tensor_parallel` broadcast TP-rank 0's RNG state to the group,
and the logits every rank samples from are bitwise identical (the row-parallel all-reduce and the
lm_head all-gather hand every rank the same numbers). So every rank draws the same tokens with no
per-step collective, and with the same ``torch.manual_seed`` the same tokens as the unsharded
model. We chose this over broadcasting the sampled token from rank 0 because it adds nothing to
the decode loop, and it keeps any logits processor (or user sampling code) correct unchanged.

Decode itself takes the fast path by construction: every style runs on local shards, so a no-grad
step issues one all-reduce per row-parallel layer and one all-gather of the last position's
logits, with no DTensor dispatch.

A decode step is short (a 57M Llama: ~8 ms of arithmetic per token on two cores), so the Python
around it counts: every split module's pre- and post-hook swapping its DTensor parameters for
their local shards was ~1,400 Python calls per decode step at tp=2 against ~1,250 for the whole
unsharded step. For the length of ``generate`` the guard therefore swaps once: every module whose
style declares ``nograd_identity`` (its hooks only swap parameters when no grad is taken: colwise,
replicated, channelwise; no sequence parallelism) gets its local shards in place and its tpkit
hooks taken off, so it runs on ``nn.Module``'s hook-free path; the modules that communicate
(row-parallel g, the vocab-parallel embedding, the gathered lm_head) keep theirs. Everything is
put back when ``generate`` returns or raises. It runs under ``torch.no_grad()`` (as ``generate``
does), and a forward that turns grad back on inside it is refused rather than run without f's
gradient all-reduce. A model with FSDP over dp keeps its hooks (FSDP unshards through them).
``tp_local_decode=False`` turns it off.

Why the lm_head still gathers the whole vocabulary even for greedy decoding (issue 5 asked): an
argmax over vocab shards (each rank's (max, index), then the global one, ties to the lowest index)
is exact only when nothing touches the scores between the head and the argmax, and transformers'
``generate`` runs its logits processors there on the full-vocab tensor: ``min_new_tokens`` sets
EOS to -inf, repetition penalties rescale chosen ids, ``output_scores``/``output_logits`` return
them. A shard-local argmax would pick EOS where the processor had masked it. Doing it exactly would
mean owning the decode loop, not ``generate``; and the gather it saves is one all-gather of
vocab/tp values per step, latency-bound like the (max, index) exchange that would replace it.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tpkit.guards.debug import check_inputs

__all__ = ["install_generate_guard", "local_forward"]


def _move(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device) if obj.device != device else obj
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_move(v, device) for v in obj)
    return obj


_RECORD = "_tpkit_style"  # styles/base.py's RECORD (guards/ does not import styles/)


def _hook_free_modules(model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(module, style) for every split module whose hooks do nothing but swap parameters when no
    grad is taken: the style's class itself declares ``nograd_identity`` (not inherited, so a
    subclass that adds work to a hook is never taken for one) and it has no sequence parallelism."""
    found = []
    for m in model.modules():
        style = m.__dict__.get(_RECORD)
        if (
            style is not None
            and type(style).__dict__.get("nograd_identity") is True
            and getattr(style, "sp", None) is None
        ):
            found.append((m, style))
    return found


def _no_grad_only(_module: nn.Module, _args: Any) -> None:
    if torch.is_grad_enabled():
        raise RuntimeError(
            "tpkit: a forward with grad enabled inside generate(): tpkit runs generate on local "
            "shards without the column layers' gradient all-reduce, so gradients would be wrong. "
            "Call the model directly for a forward with grad, or pass tp_local_decode=False."
        )


@contextlib.contextmanager
def local_forward(model: nn.Module) -> Iterator[int]:
    """Run ``model`` with no grad, every `_hook_free_modules` module on its local shards with
    tpkit's hooks off (swapped once here, not per call); yields how many. Restores everything on
    exit, also when the block raises. A model with FSDP over dp is left as it is (yields 0)."""
    state = model._tpkit
    if state.dp_size > 1 or state.pending_fsdp is not None:
        with torch.no_grad():
            yield 0
        return
    done: list[tuple[nn.Module, Any, dict, dict]] = []
    guard = model.register_forward_pre_hook(_no_grad_only)
    try:
        with torch.no_grad():  # the shards as they are: no autograd edge, no f
            _swap_all(model, done)
        with torch.no_grad():
            yield len(done)
    finally:
        guard.remove()
        for m, style, pre, post in reversed(done):
            _restore(m._forward_pre_hooks, pre)
            _restore(m._forward_hooks, post)
            style._swap_out(m)


def _swap_all(model: nn.Module, done: list) -> None:
    """Swap in the local shards of every `_hook_free_modules` module and take its tpkit hooks
    off, recording in ``done`` what to put back."""
    for m, style in _hook_free_modules(model):
        pre, post = m._forward_pre_hooks, m._forward_hooks
        mine = {
            k: v for k, v in (*pre.items(), *post.items()) if getattr(v, "__self__", None) is style
        }
        if not mine:
            continue
        style._swap_in(m)
        done.append((m, style, dict(pre), dict(post)))
        for k in mine:
            pre.pop(k, None)
            post.pop(k, None)


def _restore(hooks: dict, saved: dict) -> None:
    """``hooks`` as ``saved``, in its order, keeping any hook added meanwhile after them."""
    added = {k: v for k, v in hooks.items() if k not in saved}
    hooks.clear()
    hooks.update(saved)
    hooks.update(added)


def _guarded_generate(
    self: nn.Module,
    *args: Any,
    tp_check_inputs: bool = True,
    tp_local_decode: bool = True,
    **kwargs: Any,
):
    """The model class's ``generate`` with tpkit's input handling first.

    ``tp_check_inputs=False`` skips the cross-rank agreement check (one small all-gather of
    checksums per call, not per step). ``tp_local_decode=False`` keeps every split module's hooks
    on for each step (see the module doc: `local_forward`).
    """
    state = self._tpkit
    device = next(p.to_local().device for p in self.parameters())
    args, kwargs = _move(args, device), _move(kwargs, device)
    if tp_check_inputs:
        check_inputs(args, kwargs, state.tp_mesh)
    if not tp_local_decode:
        return type(self).generate(self, *args, **kwargs)
    with local_forward(self):
        return type(self).generate(self, *args, **kwargs)


def install_generate_guard(model: nn.Module) -> None:
    """Shadow ``model.generate`` with `_guarded_generate` (bound, so ``copy.deepcopy`` rebinds it)."""
    if callable(getattr(type(model), "generate", None)):
        model.generate = types.MethodType(_guarded_generate, model)
