"""The analysis of one model as one value, built once and handed to every stage.

`derive_plan` builds an `Analysis` for the model it plans (its example inputs, if given) and
hands it down: every stage reads what the others learned from it, and nothing else carries
state between them (no module-level caches, weak sets or context variables):

- ``recipe`` (`tpkit.trace.inputs.InputRecipe`): how the model is fed its made-up inputs, as
  the trace settled it (one row, the text alone, patches unflattened) and measured once;
- the typed traces (`trace`, one per reading of the stream and per fake or real run), run at
  most once each (a failure too is kept and raised again: the same model fails the same way);
- the answers of the dry runs (`tpkit.settle.dryrun.dry_run`), one per question: the content
  of a plan (entries, sources, arguments, fix-ups, groups; notes never change a run) and a tp;
- ``plan.resolve(model)`` per plan content (`resolve`), which every stage asks again;
- the inferred plan (``inferred``), derived once however many stages ask for it;
- which layers are alike (`twins`): every fake forward runs one layer of each kind and folds
  the others onto it (`tpkit.trace.fold`), so an analysis costs about one layer, not N; where
  a fold cannot stand for the unfolded forward the run is repeated unfolded (`folding`).

The model must not change while its analysis is in use (nothing here notices if it did).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import nn

from tpkit.plan.spec import Plan, Target
from tpkit.trace.fold import FoldBroken, Twins, find_twins
from tpkit.trace.inputs import InputRecipe
from tpkit.trace.trace import Trace, blocks, trace

__all__ = ["Analysis", "PlanKey", "plan_key"]

T = TypeVar("T")

#: a plan's content as a hashable value (`plan_key`)
PlanKey = tuple


def plan_key(plan: Plan) -> PlanKey:
    """What a forward with ``plan`` depends on, as a hashable value: every entry in order with
    its style, source and arguments, the fix-ups in order, the groups. Notes are left out:
    they explain a plan and never change how it runs."""
    entries = tuple((p, plan[p], str(plan.source(p)), repr(plan.args.get(p))) for p in plan)
    return (entries, repr(list(plan.fixups.items())), repr(plan.groups))


@dataclass(eq=False)
class Analysis:
    """One model's analysis (see the module docstring): built once per `derive_plan` (or
    `validate`) call and passed to every stage; ``example`` replaces the made-up inputs."""

    model: nn.Module
    example: tuple | Mapping | None = None
    recipe: InputRecipe = field(default_factory=InputRecipe)
    #: (plan content, tp) -> the dry run's answer (`tpkit.settle.dryrun.dry_run`)
    answers: dict[tuple[PlanKey, int], str | None] = field(default_factory=dict, repr=False)
    #: (shadow values or not, the twins folded) -> the unsplit model's reshapes
    #: (`tpkit.settle.dryrun`); a fake trace fills its own in (`Trace.reshapes`)
    references: dict[tuple, Any] = field(default_factory=dict, repr=False)
    #: the keys of ``references`` a trace filled in: a dry run whose reshapes differ from one
    #: in number, in any module, runs the reference itself (`tpkit.settle.dryrun`)
    borrowed: set[tuple] = field(default_factory=set, repr=False)
    #: a plain fake forward of this model (its trace, a dry run) met a data-dependent
    #: branch: the next dry runs start with shadow values (`tpkit.settle.dryrun`)
    needs_values: bool = False
    #: whether fake forwards fold identical layers (`folding`)
    fold: bool = True
    #: the kinds of forward ("trace", "dry run") that run unfolded: a fold of theirs broke
    unfolded: set[str] = field(default_factory=set)
    #: index attributes that tell layers apart (a layer read its own: `tpkit.trace.fold`)
    distinguishing: frozenset[str] = frozenset()
    #: why the last fold broke ("" while none has)
    broke: str = ""
    #: the folded forwards' layer calls: how many ran ("run"), how many stood on another's
    tally: dict[str, int] = field(default_factory=dict)
    #: the inferred plan (`tpkit.sources.infer.infer`), or the ValueError inferring raised:
    #: "auto" asks for it twice (transformers' plan checked, then completed at a tp)
    inferred: Any = field(default=None, repr=False)
    _twins: dict[tuple, Twins] = field(default_factory=dict, repr=False)
    _traces: dict[tuple[bool, bool], Trace | Exception] = field(default_factory=dict, repr=False)
    _resolved: dict[PlanKey, list[Target]] = field(default_factory=dict, repr=False)

    def trace(self, real: bool = False, mixed: bool = True) -> Trace:
        """The model's trace (`tpkit.trace.trace.trace`), run once per ``(real, mixed)``;
        raises what the forward raised, every time it is asked."""
        key = (real, mixed)
        if key not in self._traces:

            def run(twins: Twins) -> Trace:
                model, example, recipe = self.model, self.example, self.recipe
                found = trace(model, example, real, mixed=mixed, recipe=recipe, twins=twins)
                if found.reshapes is not None:  # the dry run's unsplit reference, run already
                    key = (found.values, tuple(twins.rep.items()))
                    if key not in self.references:
                        self.references[key] = found.reshapes
                        self.borrowed.add(key)
                # its plain fake run met a data-dependent branch: so will every dry run's
                # (`tpkit.settle.dryrun`), which can start with the values
                self.needs_values |= found.values
                return found

            try:
                self._traces[key] = run(Twins()) if real else self.folding(run, mixed, "trace")
            except Exception as exc:  # noqa: BLE001 - model code may do anything on meta
                self._traces[key] = exc
        found = self._traces[key]
        if isinstance(found, Exception):
            raise found
        return found

    def traced(self, real: bool = False, mixed: bool = True) -> Trace | None:
        """`trace`, or None where the model's forward does not run."""
        try:
            return self.trace(real, mixed)
        except Exception:  # noqa: BLE001 - model code may do anything on meta
            return None

    def settle_inputs(self) -> None:
        """Settle the made-up inputs before a forward that is no trace (a dry run): the trace's
        retries decide them (one row, the text alone), and every forward of the analysis is fed
        alike. Nothing to do with example inputs, or once the trace has run."""
        if self.example is None and (False, True) not in self._traces:
            self.traced()

    def twins(self, mixed: bool = True, purpose: str = "dry run") -> Twins:
        """The model's twin layers (`tpkit.trace.fold.find_twins` over its blocks, as the
        trace reads them with ``mixed``); none where forwards of ``purpose`` run unfolded."""
        if not self.fold or purpose in self.unfolded:
            return Twins()
        key = (mixed, self.distinguishing)
        if key not in self._twins:
            found = find_twins(blocks(self.model, mixed), self.distinguishing)
            self._twins[key] = dataclasses.replace(found, tally=self.tally)
        return self._twins[key]

    def folding(self, run: Callable[[Twins], T], mixed: bool = True, purpose: str = "") -> T:
        """``run(twins)``: a fake forward (a ``purpose``: "trace", "dry run") folded onto the
        model's twins. Where the fold broke (`tpkit.trace.fold.FoldBroken`) it runs again:
        with the index a layer read telling layers apart from now on, else unfolded, as every
        later forward of that purpose."""
        while True:
            twins = self.twins(mixed, purpose)
            try:
                return run(twins)
            except FoldBroken as broke:
                if not twins:
                    raise  # an unfolded run cannot break a fold: a bug, not a model's
                self.broke = str(broke)
                if broke.index and broke.index not in self.distinguishing:
                    self.distinguishing |= {broke.index}
                else:
                    self.unfolded.add(purpose)

    def resolve(self, plan: Plan) -> list[Target]:
        """``plan.resolve(model)``, once per plan content."""
        key = plan_key(plan)
        if key not in self._resolved:
            self._resolved[key] = plan.resolve(self.model)
        return self._resolved[key]
