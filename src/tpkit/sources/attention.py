"""``nn.MultiheadAttention`` modules and the entries that split them by heads.

torch's attention module computes with bare parameters (``in_proj_weight`` packs [q; k; v])
and reads its ``out_proj``'s weight without calling it, so the dataflow trace, which follows
linear layers, sees neither as a layer. Whatever code surrounds it, the module is one
self-contained region: whole input in, whole output out. Splitting it by heads
(``mha_heads`` on the module, ``rowwise`` on its ``out_proj``: `tpkit.styles.attention`) is
therefore exact wherever it sits, in an inferred plan or in the per-layer fallback, as long
as tp divides its heads (one `Group` each, counted by ``num_heads``, so settling keeps it
whole otherwise) and no other module reads its parameters.

A module that calls torch's ``multi_head_attention_forward`` itself on its child linears'
weights (WavLM's attention, whose gated relative position bias is the call's per-head mask)
is found by the trace (`tpkit.trace.trace`: the call's separate q / k / v and output weights)
and split likewise: ``mha_functional`` on it, ``colwise`` on q, k, v, ``rowwise`` on out.

Users' own transformers built from ``nn.TransformerEncoderLayer`` / ``DecoderLayer`` hold these,
as do SigLIP's pooling head, Idefics-2's perceiver, Aria's projector and BridgeTower.
"""

from __future__ import annotations

from torch import nn
from torch.nn.utils.parametrize import is_parametrized

from tpkit.plan.spec import Group

__all__ = ["FUNCTIONAL_STYLE", "MHA_STYLE", "functional_splits", "mha_splits"]

MHA_STYLE = "mha_heads"
#: a module that calls torch's ``multi_head_attention_forward`` on its child linears (WavLM)
FUNCTIONAL_STYLE = "mha_functional"


def mha_splits(
    model: nn.Module, shared: set[int], taken: set[str] = frozenset(), tp: int | None = None
) -> tuple[dict[str, str], list[Group], dict[str, str]]:
    """(styles, groups, why): ``mha_heads`` and ``out_proj: rowwise`` for every
    ``nn.MultiheadAttention`` of ``model`` that may split, one group each; ``why`` says why
    each other one stays whole. ``shared``: ids of parameters held elsewhere too (tied, or
    read outside their module); ``taken``: names another rule already styled; ``tp``: the
    size a plan that is not settled afterwards (the per-layer fallback) is made for."""
    styles: dict[str, str] = {}
    groups: list[Group] = []
    why: dict[str, str] = {}
    for name, mod in model.named_modules():
        out = f"{name}.out_proj"
        if not isinstance(mod, nn.MultiheadAttention) or not name or {name, out} & taken:
            continue
        reason = _whole_because(mod, shared)
        if not reason and tp and mod.num_heads % tp:
            reason = f"tp_size={tp} does not divide num_heads={mod.num_heads}"
        if reason:
            why[name] = why[out] = reason  # out_proj: its weight is read by the attention
            continue
        styles[name] = MHA_STYLE
        styles[out] = "rowwise"
        groups.append(Group((name, out), (), {f"{name}.num_heads": int(mod.num_heads)}))
    return styles, groups, why


def _whole_because(mod: nn.MultiheadAttention, shared: set[int]) -> str:
    if type(mod).forward is not nn.MultiheadAttention.forward:
        return "a subclass of nn.MultiheadAttention with its own forward"
    if any(id(p) in shared for p in mod.parameters()):
        return "a parameter of this attention is shared with another module"
    if is_parametrized(mod) or is_parametrized(mod.out_proj):
        return "a parametrized weight (computed over the whole weight)"
    if not isinstance(mod.out_proj, nn.Linear):
        return "its out_proj is not a linear"
    if mod.num_heads < 2:
        return "a single head"
    return ""


def functional_splits(
    model: nn.Module, calls: dict[str, dict], taken: set[str] = frozenset()
) -> tuple[dict[str, str], dict[str, dict], list[Group]]:
    """(styles, args, groups) for each module the trace saw call torch's
    ``multi_head_attention_forward`` on its own child linears (``calls``: module -> roles
    q, k, v, out -> linear, and ``heads``), one group each, counted by its heads."""
    styles: dict[str, str] = {}
    args: dict[str, dict] = {}
    groups: list[Group] = []
    for owner, call in calls.items():
        linears = [call[r] for r in ("q", "k", "v", "out")]
        if owner in taken or any(n in taken for n in linears) or len(set(linears)) != 4:
            continue
        if not all(n.startswith(f"{owner}.") for n in linears):
            continue  # another module's layers: not a region of its own
        styles[owner] = FUNCTIONAL_STYLE
        args[owner] = {r: call[r][len(owner) + 1 :] for r in ("q", "k", "v", "out")}
        for r in ("q", "k", "v"):
            styles[call[r]] = "colwise"
        styles[call["out"]] = "rowwise"
        groups.append(Group((owner, *linears), (), {f"heads of {owner}": int(call["heads"])}))
    return styles, args, groups
