"""A live tensor-parallel model in a process that is not a rank (a notebook, a REPL, a plain
``python script.py``): one worker process per device, joined by torch.distributed, each
holding its shards, driven through a `ModelHandle` that is used like the model.

``tpkit.tensor_parallel(model, ["cuda:0", "cuda:1"])`` (or ``tp_size=2``) and
``tpkit.from_pretrained(path, tp_size=2)`` return one there; under torchrun nothing changes.

    workers.py   the processes, their lifeline, requests and errors (caller's side)
    worker.py    one worker: build the shards, answer requests (worker's side)
    protocol.py  what crosses and how: tensors as CPU copies, per-rank objects as refs
    handle.py    ModelHandle, RemoteObject, RemoteOptimizer, remote backward
    entry.py     when a call starts a pool, the argument checks, how the model is sent
"""

from tpkit.pool.handle import ModelHandle, RemoteObject, RemoteOptimizer, optim
from tpkit.pool.workers import PoolError, WorkerTraceback

__all__ = [
    "ModelHandle",
    "PoolError",
    "RemoteObject",
    "RemoteOptimizer",
    "WorkerTraceback",
    "optim",
]
