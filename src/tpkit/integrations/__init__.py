"""Fit tpkit models into other libraries: peft, the Hugging Face ``Trainer``, accelerate.

- `tpkit.integrations.autopatch`: what ``import tpkit`` registers so that plain calls of those
  libraries work on tpkit models (no patch call needed; it imports none of them itself).
- `tpkit.integrations.peft` / `tpkit.integrations.lora`: LoRA adapters on sharded bases.
- `tpkit.integrations.trainer`: ``Trainer`` / accelerate (``patch_trainer()``, applied for you).
- `tpkit.integrations.accelerate_loading`: ``load_checkpoint_in_model`` on tpkit models.

- `tpkit.integrations.patching`: the one door every patch of another library goes through
  (original recorded, tested versions checked, ``unpatch_all()``).

The core (`tpkit.parallelize` and below) never imports this package; it reaches the core only
as a split extension (`tpkit.extensions`), installed by the package ``__init__``.
"""

from tpkit.integrations.patching import unpatch_all
from tpkit.integrations.trainer import patch_trainer, unpatch_trainer

__all__ = ["patch_trainer", "unpatch_all", "unpatch_trainer"]
