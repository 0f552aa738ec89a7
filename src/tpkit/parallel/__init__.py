"""Every parallelism on the mesh, one module each, over the runtime they share.

The runtime (nothing here knows about plans or models; the floor everything else stands on):

    dims.py      ParallelDims: the run's sizes on named axes, checked once, from every spelling
    mesh.py      process group and DeviceMesh (one dimension per axis); get_mesh; RNG sync
    timeouts.py  TPKIT_TIMEOUT on every group, and a report naming the rank that never came
    comm.py      Megatron's f / g / gather as autograd functions on local tensors
    shm.py       the same-host shared-memory all-reduce and all-gather behind comm.py on CPU
    expert/comm.py  expert parallelism's collectives: pairs to their experts' ranks and back

Each parallelism, applied in mesh order by `tpkit.parallelize.split`:

    tensor.py    tensor parallelism: the plan's styles on the TP mesh, with what rides on it
    expert/      expert parallelism: whole experts per rank of the EP mesh, tokens sent to them
                 (a folder of its own: apply, comm)
    context/     context parallelism: a model's batch split along the sequence over "cp"
                 (a folder of its own: apply, batch, layout, attention, ring, checks)
    sequence.py  sequence parallelism: norms and dropout split along the sequence (Megatron-SP)
    fsdp.py      FSDP2 / HSDP over the data axes, after TP (torchtitan's order)
"""

__all__: list[str] = []
