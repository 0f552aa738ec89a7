"""What a plan becomes so that it runs at one tp size. Pure: no process group, meta is fine.

gathered.py  the gathered form: a group split, its activations gathered
kvheads.py   KV heads fewer than tp kept whole per rank
settle.py    every "what runs at this tp" decision, asking a dry run
dryrun.py    one fake forward with rank 0's shard shapes: does a plan run at tp?
complete.py  what a derived plan leaves out (gradient all-reduces, ties)
"""

__all__: list[str] = []
