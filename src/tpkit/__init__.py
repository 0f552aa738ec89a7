"""tpkit: one-line tensor parallelism for any PyTorch or Hugging Face model, on DTensor.

import tpkit                                   # torchrun --nproc-per-node 2 script.py
model = tpkit.tensor_parallel(model)           # every rank holds ~1/N of the weights
"""

from tpkit.cli.launch import launch
from tpkit.dist.mesh import build_mesh, dist_env, init_distributed
from tpkit.dist.parallel_dims import ParallelDims
from tpkit.extensions import set_builtin_extensions as _set_builtin_extensions

# plain peft / Trainer calls on tpkit models, and tensor_parallel of a PEFT model (no imports of
# either library happen here: see tpkit.integrations.autopatch)
from tpkit.integrations.autopatch import Integrations as _Integrations
from tpkit.io.checkpoint import (
    export_checkpoint,
    load_checkpoint,
    save_checkpoint,
    wait_for_checkpoint,
)
from tpkit.io.dcp import UnsafeCheckpointError
from tpkit.io.resume import resume
from tpkit.io.save import save_tensor_parallel
from tpkit.io.shards import convert_state_dict, infer_sharded_device_map, load_local_state_dict
from tpkit.parallelize import TPState, tensor_parallel
from tpkit.plan import Plan, StyleSpec, derive_plan, validate
from tpkit.pool import ModelHandle, PoolError, optim
from tpkit.pool.entry import explain
from tpkit.pretrained import from_pretrained
from tpkit.quant.extension import QuantExtension as _QuantExtension
from tpkit.styles import TPStyle, register_style
from tpkit.training.clip import clip_grad_norm_

# tpkit's own split extensions, in the one order every split consults them (tpkit.extensions),
# installed here and nowhere else: the quantized base first (a PEFT model on a bitsandbytes base
# is refused before the PEFT integration would split it), then the library integrations.
_set_builtin_extensions(_QuantExtension(), _Integrations())

__version__ = "0.1.0"

__all__ = [
    "ModelHandle",
    "ParallelDims",
    "Plan",
    "PoolError",
    "StyleSpec",
    "TPState",
    "TPStyle",
    "UnsafeCheckpointError",
    "build_mesh",
    "clip_grad_norm_",
    "convert_state_dict",
    "derive_plan",
    "dist_env",
    "explain",
    "export_checkpoint",
    "from_pretrained",
    "infer_sharded_device_map",
    "init_distributed",
    "launch",
    "load_checkpoint",
    "load_local_state_dict",
    "optim",
    "register_style",
    "resume",
    "save_checkpoint",
    "save_tensor_parallel",
    "tensor_parallel",
    "validate",
    "wait_for_checkpoint",
]
