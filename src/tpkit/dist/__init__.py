"""The distributed runtime: the run's sizes, the process group and mesh, collective timeouts,
and the collectives tpkit's layers call.

    parallel_dims.py  ParallelDims: tp x dp = world and this rank's device, checked when made
    mesh.py           process group and DeviceMesh from torchrun's environment; RNG sync
    timeouts.py       TPKIT_TIMEOUT on every group, and a report naming the rank that never came
    comm.py           Megatron's f / g / gather as autograd functions on local tensors
    shm.py            the same-host shared-memory all-reduce and all-gather behind comm.py on CPU

Nothing here knows about plans or models: it is the floor everything else stands on.
"""

__all__: list[str] = []
