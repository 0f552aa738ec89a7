"""One module per parallelism, applied by `split` in mesh order.

expert.py       expert parallelism: whole experts per rank, tokens sent to them
expert_comm.py  its collectives: tokens to their experts' ranks and back (autograd)
"""

__all__: list[str] = []
