"""What training adds on top of the split: sequence parallelism, dropout streams, the
vocab-parallel loss, FSDP2 over dp, gradient clipping, and random init that draws the
unsharded values.

    sequence_parallel.py  Megatron-SP block and region hooks
    rng.py                per-rank dropout inside TP regions, one synced stream outside
    loss.py               vocab-parallel cross-entropy
    fsdp.py               fully_shard over "dp" after TP (torchtitan's order)
    clip.py               one global gradient norm over any mix of meshes
    init.py               in-place random ops on split DTensors draw the unsharded tensor
"""

__all__: list[str] = []
