"""Plain calls just work on tpkit models: peft and the HF Trainer, with no patch call.

``import tpkit`` installs `Integrations` as a split extension, second in the one ordered list
of `tpkit.extensions` (after the quantization extension). It

- splits a PEFT model handed to ``tpkit.tensor_parallel`` itself (`tpkit.integrations.peft`:
  the base with the base model's plan, then the adapters laid out);
- after every split, makes ``peft.get_peft_model`` / ``PeftModel.from_pretrained`` /
  ``save_pretrained`` / ``get_peft_model_state_dict`` and ``transformers.Trainer`` right on
  tpkit models (`patch_peft`, `patch_trainer`): at once when those libraries are imported
  already, else the moment they are (a post-import hook), so that neither costs an import
  nobody asked for. Models tpkit did not split go through every patched call untouched.
- the same for accelerate's ``set_module_tensor_to_device``, which ``load_checkpoint_in_model``
  uses (`tpkit.integrations.accelerate_loading`): DTensor targets get this rank's slice.

Every patch goes through `tpkit.integrations.patching` (``unpatch_all()`` undoes them all).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from tpkit.extensions import SplitExtension
from tpkit.plan import Plan
from tpkit.state import TPOptions

__all__ = ["Integrations", "ensure_patched"]


def _patch_peft() -> None:
    from tpkit.integrations.peft import patch_peft

    patch_peft()


def _patch_trainer() -> None:
    from tpkit.integrations.trainer import patch_trainer

    patch_trainer()


def _patch_accelerate() -> None:
    from tpkit.integrations.accelerate_loading import patch_accelerate

    patch_accelerate()


#: module whose import makes a patch needed -> the patch
_PATCHES: dict[str, Callable[[], None]] = {
    "peft": _patch_peft,
    "transformers.trainer": _patch_trainer,
    "accelerate.utils.modeling": _patch_accelerate,
}


class _PostImport(importlib.abc.MetaPathFinder):
    """Runs a callback right after a module finishes importing (Python has no public
    post-import hook): it finds the module's spec with the other finders and wraps the
    loader's ``exec_module``."""

    def __init__(self) -> None:
        self.waiting: dict[str, Callable[[], None]] = {}

    def find_spec(self, name: str, path: Any = None, target: Any = None):
        callback = self.waiting.pop(name, None)
        if callback is None:
            return None
        spec = importlib.util.find_spec(name) if path is None else _find(name, path, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def run(module: Any) -> None:
            exec_module(module)
            callback()

        spec.loader.exec_module = run
        return spec


def _find(name: str, path: Any, skip: importlib.abc.MetaPathFinder):
    for finder in sys.meta_path:
        if finder is not skip and hasattr(finder, "find_spec"):
            spec = finder.find_spec(name, path)
            if spec is not None:
                return spec
    return None


_HOOK = _PostImport()


def ensure_patched() -> None:
    """Patch peft and the Trainer for tpkit models now if they are imported, else on import."""
    for module, patch in _PATCHES.items():
        if module in sys.modules:
            patch()
        elif module not in _HOOK.waiting:
            _HOOK.waiting[module] = patch
            if _HOOK not in sys.meta_path:
                sys.meta_path.insert(0, _HOOK)


class Integrations(SplitExtension):
    """The split extension ``import tpkit`` registers (see the module docstring)."""

    def handle(
        self, model: nn.Module, device_ids: Sequence | None, options: TPOptions
    ) -> nn.Module | None:
        peft = sys.modules.get("peft")
        if peft is None or not isinstance(model, peft.PeftModel):
            return None
        from tpkit.integrations.peft import split_peft_model

        ensure_patched()
        return split_peft_model(model, device_ids, options)

    def prepare(
        self, model: nn.Module, plan: Plan, tp: int, options: TPOptions, adapted: Any
    ) -> Any:
        """Always something to finish: the libraries patched once a model is split."""
        return True

    def finish(self, model: nn.Module, context: Any, tp_mesh: Any) -> None:
        ensure_patched()
