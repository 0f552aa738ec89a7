"""Fit tpkit models into other libraries' training loops.

- `tpkit.integrations.trainer`: Hugging Face ``Trainer`` / accelerate: ``patch_trainer()``.

Core tpkit never imports this package; it imports the core.
"""

from tpkit.integrations.trainer import patch_trainer, unpatch_trainer

__all__ = ["patch_trainer", "unpatch_trainer"]
