"""Where plan entries come from. Pure: no process group, meta is fine.

experts.py    experts held as 3-D (or packed 2-D) parameters
ssm.py        Mamba-1 mixers by channels
attention.py  nn.MultiheadAttention (and calls of its function) by heads
convs.py      convolution pairs by channels
hf.py         transformers' own plans, merged as transformers merges them
infer.py      a plan inferred from the traced dataflow
fallback.py   the per-layer fallback: each layer split on its own, gathered
untraced.py   what the trace never ran (towers, conditional layers)
"""

__all__: list[str] = []
