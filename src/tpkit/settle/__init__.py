"""What a plan becomes so that it runs at one tp size. Pure: no process group, meta is fine.

gathered.py  the gathered form: a group split, its activations gathered
kvheads.py   KV heads fewer than tp kept whole per rank
settle.py    every "what runs at this tp" decision for a plan's groups, asking a dry run
fits.py      what else fits at a tp: transformers' plan or the inferred one; too narrow layers
dryrun.py    one fake forward with rank 0's shard shapes: does a plan run at tp?
complete.py  what a derived plan leaves out (gradient all-reduces, ties)
"""

__all__: list[str] = []
