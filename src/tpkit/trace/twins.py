"""What a folded trace's twins would have recorded, copied from their representatives'.

In a folded trace (`tpkit.trace.fold`) a twin layer runs none of its own modules, so the
trace (`tpkit.trace.trace`) records nothing inside it. `TwinRecords` fills that in: whatever
the representative's run recorded under its own name (its modules' inputs, the bare
parameters they were handed, torch attention calls, its linear-like modules' `Node`s) is
copied under the twin's name, at the point of the run where the twin stood in, so that every
table keeps the order an unfolded run gives it; names of the representative's modules inside
any value are renamed to the twin's. Nodes elsewhere that name the representative's modules
(a table every layer reads, T5's position bias made in its first layer) name the twin's too.

Names of other layers of the same list (what the layer before handed on, besides the stream)
move with the twin (`tpkit.trace.fold.Relative`): the fold compared them so when it let the
twin stand in. Node fields are copied generically (every string, set of strings, and list of
sets renamed), so this module needs no import of the trace's own types.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

from tpkit.trace.fold import FoldBroken, Relative, Twins

__all__ = ["TwinRecords"]


class TwinRecords:
    """The trace's tables (by reference: the trace fills them) and the twins of its run."""

    def __init__(
        self,
        twins: Twins,
        nodes: dict[str, Any],
        module_inputs: dict[str, list],
        input_params: dict[str, dict],
        functional_mha: dict[str, dict],
    ):
        self.members = set(twins.rep) | set(twins.rep.values())  # layers of a kind with twins
        self.relative = Relative(twins.layers, twins.fixed)
        self.tables = (module_inputs, input_params, functional_mha, nodes)
        self.before: dict[str, list[dict[str, int]]] = {}  # layer -> each table's ids at its start
        self.spans: dict[str, list[list[str]]] = {}  # layer -> each table's keys its run set
        self.stood: list[tuple[str, str]] = []  # (twin, the layer whose call it stood on)

    def started(self, name: str) -> None:
        """The trace's pre-hook of module ``name`` has recorded its own entries."""
        if name in self.members:
            self.before[name] = [{k: id(v) for k, v in t.items()} for t in self.tables]

    def finished(self, name: str) -> None:
        """The trace's post-hook of module ``name``."""
        if name in self.before:
            before = self.before.pop(name)
            if name in self.spans:
                return  # called again (HRM's cycles): its first call is the one that ran
            self.spans[name] = [
                [k for k, v in t.items() if b.get(k) != id(v)]
                for t, b in zip(self.tables, before, strict=True)
            ]

    def stand_in(self, twin: str, source: str) -> None:
        """``twin`` stands on ``source``'s call now: its entries go where its run would put
        them."""
        if source not in self.spans:
            raise FoldBroken(f"{twin} stands on {source} before its run was recorded")
        rename = self.relative.rename(source, twin)
        module_inputs, input_params, functional_mha, nodes = self.tables
        keys = self.spans[source]
        for k in keys[0]:
            module_inputs[rename(k)] = [
                (key, shape, frozenset(map(rename, tags))) for key, shape, tags in module_inputs[k]
            ]
        for k in keys[1]:
            input_params[rename(k)] = {
                key: frozenset(map(rename, v)) for key, v in input_params[k].items()
            }
        for k in keys[2]:
            functional_mha[rename(k)] = _renamed(functional_mha[k], rename)
        for k in keys[3]:
            if rename(k) not in nodes:  # a functional layer, a node from its first call on
                nodes[rename(k)] = copy.copy(nodes[k])  # filled in by `finish`
        self.stood.append((twin, source))

    def finish(self) -> None:
        """After the run (liveness marked): each twin's nodes as those of the layer it stood
        on (names of that layer's list moved by the twin's offset: `Relative`), and every
        node outside the folded layers that names that layer's modules naming the twin's
        too."""
        nodes = self.tables[3]

        def layer_of(name: str) -> str | None:
            hit = self.relative.split(name)
            return hit[0] if hit is not None and hit[0] in self.members else None

        owners = {n: layer_of(n) for n in nodes}
        twins_of: dict[str, list[str]] = {}
        for twin, source in self.stood:
            if twin != source and twin not in twins_of.get(source, ()):  # not a layer's own
                twins_of.setdefault(source, []).append(twin)  # call stood on again
        for source, twins in twins_of.items():
            inside = [n for n in nodes if owners[n] == source]
            for twin in twins:
                rename = self.relative.rename(source, twin)
                for n in inside:
                    nodes[rename(n)] = _renamed(nodes[n], rename)
        for n, node in nodes.items():
            if owners.get(n) is not None:
                continue
            for source, twins in twins_of.items():
                renames = [self.relative.rename(source, t) for t in twins]
                _add_twins(node, source, renames)


def _under(name: str, layer: str) -> bool:
    return name == layer or name.startswith(layer + ".")


def _renamed(value: Any, rename) -> Any:
    """``value`` with every name in it renamed: strings (a reason names a module), sets and
    lists of them, dicts' values, a dataclass's fields."""
    if isinstance(value, str):
        return _in_text(value, rename)
    if isinstance(value, (set, frozenset)):
        return type(value)(_renamed(v, rename) for v in value)
    if isinstance(value, list):
        return [_renamed(v, rename) for v in value]
    if isinstance(value, tuple):
        return tuple(_renamed(v, rename) for v in value)
    if isinstance(value, dict):
        return {k: _renamed(v, rename) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: _renamed(getattr(value, f.name), rename) for f in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **changes)
    return value


def _in_text(text: str, rename) -> str:
    """A module name, or a reason naming modules (``"... needs its whole output"``): each
    name in it that starts with the representative's is the twin's."""
    return _NAME.sub(lambda m: rename(m.group(0)), text)


#: a dotted name in a text (what `_in_text` renames)
_NAME = re.compile(r"[A-Za-z_0-9]+(?:\.[A-Za-z_0-9]+)+")


def _add_twins(node: Any, rep: str, renames: list) -> None:
    """Where ``node``'s sets name a module of ``rep``, add the twins' modules alike."""
    for f in dataclasses.fields(node):
        v = getattr(node, f.name)
        if isinstance(v, set):
            hits = [x for x in v if isinstance(x, str) and _under(x, rep)]
            v.update(r(x) for x in hits for r in renames)
        elif isinstance(v, list):
            for x in v:
                if isinstance(x, set):
                    hits = [y for y in x if isinstance(y, str) and _under(y, rep)]
                    x.update(r(y) for y in hits for r in renames)
