"""An analysis forward leaves the model's attributes as it found them.

The analysis runs the user's model (on fake tensors, or on zeros for a real dry run), and model
code keeps state in plain attributes that its forward writes: RWKV's first eval forward divides
its output weights in place and sets ``layers_are_rescaled = True``; rotary layers cache their
last sequence length; routers keep the input dtype. Left behind, such a write makes the real
model skip what it has not done (RWKV then halves its hidden states without having divided its
weights: logits 0.86 off after planning a 12-layer model), and it makes the next analysis
forward see a model unlike the one the user will run (the second trace of RWKV no longer saw
the rescale). `kept_attributes` puts every module's attributes back (the names and the objects
they held) when the forward is done; what each context of the analysis changes on purpose
(parameters swapped for fake ones, fix-ups, folded forwards) it undoes itself, inside.

Shallow by design: a container mutated in place (a list a forward appends to) is not copied
back, only the module tables are (a submodule swapped by a forward); model code that keeps
state across forwards in a container of its own is not known to us.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["kept_attributes"]


@contextlib.contextmanager
def kept_attributes(model: nn.Module) -> Iterator[None]:
    """Within the block the model may write its modules' attributes; after it, each module's
    ``__dict__`` and its tables of submodules, parameters and buffers hold the same names bound
    to the same objects as before (BigBird's first forward on a short sequence swaps each
    attention for a full one and says so in ``attention_type``: both are put back)."""
    saved = []
    for m in model.modules():
        saved.append((m.__dict__, dict(m.__dict__)))
        saved += [(store, dict(store)) for store in (m._modules, m._parameters, m._buffers)]
    try:
        yield
    finally:
        for now, before in saved:
            _restore(now, before)


def _restore(now: dict, before: dict) -> None:
    """``now`` made to hold ``before``'s names bound to ``before``'s objects, in place."""
    if now.keys() != before.keys():
        for k in [k for k in now if k not in before]:
            del now[k]
    for k, v in before.items():
        if now.get(k, _MISSING) is not v:
            now[k] = v


_MISSING = object()
