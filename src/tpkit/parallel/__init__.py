"""One module per parallelism over the world mesh.

context.py            context parallelism: a model's batch split along the sequence over "cp"
context_layout.py     which sequence chunks a cp rank holds (zigzag or contiguous)
context_attention.py  the attention and mask functions registered with transformers under CP
context_ring.py       ring attention: K/V passed around the cp ring, an online softmax
"""

__all__: list[str] = []
