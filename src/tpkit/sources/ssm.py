"""Selective state-space mixers (Mamba-1: Mamba, FalconMamba, Jamba's Mamba layers) split by
channels, where the trace alone leaves them whole.

The mixer projects the stream into 2C channels ([x | gate]), convolves each channel on its
own, projects x to a few shared values (dt rank R, B and C of the state size N), widens dt back
to C channels, scans each channel with its own A and D, and projects C channels back. Every step
but two is per channel, so Megatron's split is exact:

    in_proj   packed_colwise        [x | gate] each split by channel (f on the stream)
    conv1d    channelwise           depthwise: this rank's channels only, read by the parent
    x_proj    rowwise_feeds_split   partial sums all-reduced (g); dt, B, C are then read by
                                    every rank's channels, so their gradients are summed (f)
    dt_proj   channelwise           R -> this rank's C channels (its weight read directly)
    A, D      channelwise entries   per channel (the mixer's own parameters)
    out_proj  rowwise               C channels back into the stream (g)

Other parametrised children (Jamba's norms over dt, B, C) act on x_proj's whole output and feed
the rank's channels: their gradients are partial, so ``replicated_with_grad_allreduce``. Modules
are recognised by shapes, not names: a depthwise ``nn.Conv1d`` of C channels among linears
H -> 2C, C -> R + 2N, R -> C and C -> H. The group it makes is dry-run like any other.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["ssm_groups"]


def _roles(mixer: nn.Module) -> dict[str, str] | None:
    """Child name -> style for a Mamba-1 mixer (see the module docstring), or None."""
    children = dict(mixer.named_children())
    convs = [n for n, m in children.items() if isinstance(m, nn.Conv1d)]
    if len(convs) != 1:
        return None
    conv = children[convs[0]]
    c = conv.out_channels
    if conv.groups != c or conv.in_channels != c:
        return None
    linears = {n: m for n, m in children.items() if isinstance(m, nn.Linear)}
    roles: dict[str, str] = {convs[0]: "channelwise"}
    width = {lin.in_features for lin in linears.values() if lin.out_features == 2 * c}
    if len(width) != 1:
        return None
    hidden = width.pop()
    for name, lin in linears.items():
        i, o = lin.in_features, lin.out_features
        if o == 2 * c and i == hidden:
            roles[name] = "packed_colwise"
        elif i == c and o == hidden:
            roles[name] = "rowwise"
        elif i == c and o < c:
            roles[name] = "rowwise_feeds_split"
        elif o == c and i < c:
            roles[name] = "channelwise"
    counts = {s: list(roles.values()).count(s) for s in set(roles.values())}
    if counts != {"channelwise": 2, "packed_colwise": 1, "rowwise_feeds_split": 1, "rowwise": 1}:
        return None
    for name, m in children.items():
        if name not in roles and any(True for _ in m.parameters()):
            roles[name] = "replicated_with_grad_allreduce"
    return roles


def ssm_groups(model: nn.Module) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """Styles (module and parameter names) and one group per recognised mixer."""
    styles: dict[str, str] = {}
    groups: list[dict[str, Any]] = []
    for name, mixer in model.named_modules():
        roles = _roles(mixer)
        if roles is None:
            continue
        conv = next(m for m in mixer.children() if isinstance(m, nn.Conv1d))
        c = conv.out_channels
        members = {f"{name}.{child}": style for child, style in roles.items()}
        for pname, p in mixer.named_parameters(recurse=False):
            if p.ndim and p.shape[0] == c:
                members[f"{name}.{pname}"] = "channelwise"
        styles.update(members)
        groups.append(
            {"modules": list(members), "owners": [], "counts": {f"channels of {name}": c}}
        )
    return styles, groups
