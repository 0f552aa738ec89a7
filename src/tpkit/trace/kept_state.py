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
(parameters swapped for fake ones, fix-ups, folded forwards, its own hooks) it sets up before
this block and undoes itself after it. The real-tensor trace (`tpkit.trace.trace`, small
models whose fake trace failed) runs on the user's own tensors and is left as it was: putting
a flag back there would undo the flag but not an in-place change of a weight.

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
    ``__dict__`` and its tables (`_TABLES`: submodules, parameters, buffers, hooks) hold the
    same names bound to the same objects as before (BigBird's first forward on a short sequence swaps each
    attention for a full one and says so in ``attention_type``: both are put back)."""
    saved, empty = [], []
    for m in model.modules():
        attrs = m.__dict__
        saved.append((attrs, attrs.copy()))
        for name in _TABLES:
            table = attrs.get(name)
            if not isinstance(table, dict):
                continue
            if table:
                saved.append((table, table.copy()))
            else:
                # most hook tables are empty: kept as "empty", not copied (copying an empty
                # OrderedDict costs as much as a small one: 27 of 28 ms per forward of an
                # 800-module model, and every analysis forward pays it)
                empty.append(table)
    try:
        yield
    finally:
        for now, before in saved:
            _restore(now, before)
        for table in empty:
            if table:
                table.clear()


#: a module's tables besides ``__dict__``: its children, tensors and hooks (transformers
#: installs output-capturing hooks inside a forward that asks for hidden states, and says so
#: in a flag: the flag put back without the hooks would add a second set at the next forward)
_TABLES = (
    "_modules",
    "_parameters",
    "_buffers",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _restore(now: dict, before: dict) -> None:
    """``now`` made to hold ``before``'s names bound to ``before``'s objects, in place and in
    ``before``'s order (the order of ``_modules`` is ``named_modules``')."""
    if list(now) != list(before):
        now.clear()
        now.update(before)
        return
    for k, v in before.items():
        if now[k] is not v:
            now[k] = v
