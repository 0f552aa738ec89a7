"""tpkit: one-line tensor parallelism for any PyTorch or Hugging Face model, on DTensor.

import tpkit                                   # torchrun --nproc-per-node 2 script.py
model = tpkit.tensor_parallel(model)           # every rank holds ~1/N of the weights
"""

from tpkit.mesh import build_mesh, dist_env, init_distributed
from tpkit.parallelize import TPState, apply_plan, tensor_parallel
from tpkit.plan import STYLES, Plan, derive_plan, validate

__version__ = "0.1.0"

__all__ = [
    "STYLES",
    "Plan",
    "TPState",
    "apply_plan",
    "build_mesh",
    "derive_plan",
    "dist_env",
    "init_distributed",
    "tensor_parallel",
    "validate",
]
