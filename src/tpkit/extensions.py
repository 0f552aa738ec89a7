"""Split extensions: what takes part in every `tpkit.parallelize.split` without the core knowing it.

Two ship with tpkit: `tpkit.quant.extension.QuantExtension` (bitsandbytes weights sliced) and
`tpkit.integrations.autopatch.Integrations` (PEFT models split, other libraries patched). They
are installed in ONE call, in ONE order, by the package ``__init__`` (`set_builtin_extensions`):
the core never imports ``integrations/``, and no module registers anything as a side effect of
being imported. So the order every split consults them in never depends on which module a
script happened to import first (it used to: the quantized-base-under-PEFT refusal of
``QuantExtension.handle`` only worked while ``tpkit.quant`` was imported before the PEFT
integration registered itself). Extensions a user registers (`register_split_extension`) come
after the built-ins, in the order they were registered.

The order matters where two extensions could both act: ``handle`` is asked in order and the
first that splits the model wins, so the quantization extension (which refuses a PEFT model on
a bitsandbytes base) must come before the integrations (which split PEFT models).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:  # type hints only: parallelize imports this module
    from torch.distributed.device_mesh import DeviceMesh

    from tpkit.plan import Plan
    from tpkit.state import TPOptions

__all__ = [
    "SplitExtension",
    "register_split_extension",
    "set_builtin_extensions",
    "split_extensions",
]


class SplitExtension:
    """One participant in every split (all methods run on every rank alike, in the order of
    `split_extensions`):

    - ``handle``: may split a kind of model itself (a PEFT wrapper: its base is split, then its
      adapters laid out); the first extension that returns a model ends the split.
    - ``adapt`` (before the plan is derived): make the model plannable and return what
      ``prepare`` needs (None: nothing to adapt). Must not derive a plan.
    - ``prepare`` (after the plan is derived once, before validation and any collective): check
      the derived plan against what the extension needs and return what ``finish`` needs
      (None: nothing to finish for this model). A ValueError here is a refusal.
    - ``undo``: the split failed before any collective; put back what ``adapt`` changed.
    - ``finish`` (styles applied, before the guards): complete the split.
    """

    def handle(
        self, model: nn.Module, device_ids: Sequence | None, options: TPOptions
    ) -> nn.Module | None:
        """The split model, when this extension splits models like ``model`` itself."""
        return None

    def adapt(self, model: nn.Module, options: TPOptions) -> Any:
        """Change ``model`` so the plan can be derived on it (before the plan)."""
        return None

    def prepare(
        self, model: nn.Module, plan: Plan, tp: int, options: TPOptions, adapted: Any
    ) -> Any:
        """What ``finish`` needs, checked against the one derived ``plan`` at ``tp``."""
        return None

    def undo(self, model: nn.Module, adapted: Any) -> None:
        """Put back what ``adapt`` changed (``adapted`` is what it returned, never None)."""

    def finish(self, model: nn.Module, context: Any, tp_mesh: DeviceMesh) -> None:
        """Complete the split (``context`` is what `prepare` returned, never None here)."""


_builtin: list[SplitExtension] = []
_user: list[SplitExtension] = []


def set_builtin_extensions(*extensions: SplitExtension) -> None:
    """Install tpkit's own extensions, in the order given (called once, by the package
    ``__init__``; calling it again replaces them, so the order is always this one call's)."""
    _builtin[:] = extensions


def register_split_extension(extension: SplitExtension) -> None:
    """Add ``extension`` to every later split, after tpkit's own and those registered before it
    (registering it again is a no-op)."""
    if extension not in _user and extension not in _builtin:
        _user.append(extension)


def split_extensions() -> tuple[SplitExtension, ...]:
    """Every extension a split consults, in order: the built-ins, then the user's."""
    return (*_builtin, *_user)
