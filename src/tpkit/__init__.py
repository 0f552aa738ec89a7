"""tpkit: one-line tensor parallelism for any PyTorch or Hugging Face model, on DTensor.

import tpkit                                   # torchrun --nproc-per-node 2 script.py
model = tpkit.tensor_parallel(model)           # every rank holds ~1/N of the weights
"""

from tpkit.checkpoint import (
    export_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_tensor_parallel,
)
from tpkit.clip import clip_grad_norm_
from tpkit.dcp_io import UnsafeCheckpointError
from tpkit.launch import launch
from tpkit.load import (
    convert_state_dict,
    from_pretrained,
    infer_sharded_device_map,
    load_local_state_dict,
)
from tpkit.mesh import build_mesh, dist_env, init_distributed
from tpkit.parallelize import TPState, apply_plan, tensor_parallel
from tpkit.plan import STYLES, Plan, derive_plan, validate

__version__ = "0.1.0"

__all__ = [
    "STYLES",
    "Plan",
    "TPState",
    "UnsafeCheckpointError",
    "apply_plan",
    "build_mesh",
    "clip_grad_norm_",
    "convert_state_dict",
    "export_checkpoint",
    "from_pretrained",
    "infer_sharded_device_map",
    "load_checkpoint",
    "load_local_state_dict",
    "save_checkpoint",
    "save_tensor_parallel",
    "derive_plan",
    "dist_env",
    "init_distributed",
    "launch",
    "tensor_parallel",
    "validate",
]
