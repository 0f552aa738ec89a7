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
from tpkit.trace.shadow import tensors_in

__all__ = ["TwinRecords"]

#: the name a layer's float input's bare parameters go by while it runs (`carry_in`)
CARRIED = re.compile(r"\.<carried(\d+)>$")


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
        self.carried: dict[str, frozenset[str]] = {}  # token -> the parameters it stands for
        self.outs: dict[str, list[tuple[int, frozenset[str] | None]]] = {}  # layer -> outputs
        self.source_of: dict[str, str] = {}  # twin standing in now -> its source

    def carry_in(self, name: str, stream: list, params: dict[int, frozenset[str]]) -> None:
        """Layer ``name`` (of a kind with twins) is given ``stream`` (its float inputs: the
        stream, and any other, such as Inkling-2's block states, one tensor handed to several
        layers): the bare parameters each carries (the trace's ``params``) go by a name of the
        layer's own (``<name>.<carriedI>``, the I-th float input) from now on (see the module
        docstring); `resolve` puts them back. A layer called again (HRM's cycles) adds what
        each call carries to its tokens, as an unfolded run's records add up over its calls."""
        if name not in self.members:
            return
        done: set[int] = set()
        for i, t in enumerate(stream):
            if id(t) in done or not params.get(id(t)):
                continue
            done.add(id(t))
            token = f"{name}.<carried{i}>"
            self.carried[token] = self.carried.get(token, frozenset()) | params[id(t)]
            params[id(t)] = frozenset({token})

    def started(self, name: str) -> None:
        """The trace's pre-hook of module ``name`` has recorded its own entries."""
        if name in self.members:
            self.before[name] = [{k: id(v) for k, v in t.items()} for t in self.tables]

    def finished(
        self, name: str, output: Any = None, params: dict[int, frozenset[str]] | None = None
    ) -> None:
        """The trace's post-hook of module ``name``, which returned ``output``; ``params``: the
        trace's bare parameters per tensor. A twin that stood in hands on what its source's
        outputs carried (renamed), not what the stand-in's copy of its input carries."""
        ran = name not in self.source_of  # its own forward ran, no stand-in
        if params is not None and name in self.members:
            outs = tensors_in(output)
            source = self.source_of.pop(name, None)
            if source is None:
                self.outs[name] = [(id(t), params.get(id(t))) for t in outs]
            else:
                theirs = self.outs.get(source)
                if theirs is None or len(theirs) != len(outs):
                    raise FoldBroken(f"{name} returns other tensors than {source}")
                rename = self.relative.rename(source, name)
                for t, (i, carried) in zip(outs, theirs, strict=True):
                    if id(t) == i:
                        continue  # the very tensor the source made: as it is
                    if carried:
                        params[id(t)] = frozenset(map(rename, carried))
                    else:
                        params.pop(id(t), None)
                self.outs[name] = [(id(t), params.get(id(t))) for t in outs]
        if name in self.before:
            before = self.before.pop(name)
            if name in self.spans and not ran:
                return  # called again and stood on a call of its own (HRM's cycles)
            keys = [
                [k for k, v in t.items() if b.get(k) != id(v)]
                for t, b in zip(self.tables, before, strict=True)
            ]
            # a later call that ran (Inkling-2-Loop's passes, handed messages): its entries too
            old = self.spans.get(name, [[] for _ in keys])
            self.spans[name] = [
                o + [k for k in n if k not in o] for o, n in zip(old, keys, strict=True)
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
        self.source_of[twin] = source

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

    def resolve(self, params_of: list[set[str]], input_params: dict[str, dict]) -> None:
        """After `finish`: every token (`carry_in`) in ``params_of`` (the nodes'
        ``partial_params``, changed in place) and ``input_params`` replaced by the parameters
        it stands for (their own tokens resolved first: tokens are made in the run's order).
        A token of no layer's input (a record renamed onto a layer that carried nothing in)
        breaks the fold: the trace runs again unfolded."""
        if not self.carried and not any(_tokens(s) for s in params_of):
            return
        done = _closed(self.carried)
        for s in params_of:
            if _tokens(s):
                new = _expanded(s, done)
                s.clear()
                s.update(new)
        for entry in input_params.values():
            for key, names in entry.items():
                if _tokens(names):
                    entry[key] = _expanded(names, done)


def _closed(carried: dict[str, frozenset[str]]) -> dict[str, frozenset[str]]:
    """Each token's parameters, its tokens followed to the end: a layer called again may
    carry in a later layer's token (HRM's cycles hand the last layer's output to the first),
    so tokens may name each other in any order, in a cycle too."""
    done: dict[str, frozenset[str]] = {}
    for token in carried:
        seen, todo, found = {token}, [token], set()
        while todo:
            for n in carried[todo.pop()]:
                if not CARRIED.search(n):
                    found.add(n)
                elif n not in carried:
                    raise FoldBroken(f"{n} stands for no layer's stream input")
                elif n not in seen:
                    seen.add(n)
                    todo.append(n)
        done[token] = frozenset(found)
    return done


def _tokens(names) -> bool:
    return any(CARRIED.search(n) for n in names)


def _expanded(names, done: dict[str, frozenset[str]]) -> frozenset[str]:
    out: set[str] = set()
    for n in names:
        if CARRIED.search(n):
            if n not in done:
                raise FoldBroken(f"{n} stands for no layer's stream input")
            out |= done[n]
        else:
            out.add(n)
    return frozenset(out)


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
