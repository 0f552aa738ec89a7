"""What training adds on top of the split: dropout streams, the vocab-parallel loss, gradient
clipping, and random init that draws the unsharded values. (Sequence parallelism and FSDP2 are
parallelisms: `tpkit.parallel.sequence`, `tpkit.parallel.fsdp`.)

    rng.py    per-rank dropout inside TP regions, one synced stream outside
    loss.py   vocab-parallel cross-entropy
    clip.py   one global gradient norm over any mix of meshes
    init.py   in-place random ops on split DTensors draw the unsharded tensor
"""

__all__: list[str] = []
