"""Checkpoints in and out: finding a checkpoint's files, streaming each rank's slices in without
running code, saving whole checkpoints atomically, and reshardable training state (DCP).

    hub.py           a hub id or a local directory to weight files (transformers' own resolution)
    build.py         a transformers model from its config, on meta, without weights
    load_kwargs.py   transformers' from_pretrained keywords, sorted for tpkit's
    loading_info.py  which checkpoint tensor fills which weight; missing / unexpected keys
    safetensors.py   one rank's slice of a tensor from safetensors files
    pickle_safe.py   one rank's slice from pytorch_model*.bin, unpickled without running code
    shards.py        where a rank's slice lives; putting slices in place
    stream.py        a rank's slices streamed into its (meta) shards
    atomic.py        a directory replaced so no crash loses the last good copy
    save.py          save_pretrained that gathers; save_tensor_parallel
    dcp.py           torch.distributed.checkpoint made safe and strided-aware
    checkpoint.py    save_checkpoint / load_checkpoint / export_checkpoint

`tpkit.pretrained.from_pretrained` sits above this package and `tpkit.parallelize`.
"""

__all__: list[str] = []
