"""Context parallelism (CP): a model's batch split along the sequence over the "cp" mesh axis,
attention still seeing the whole context. One folder, one concern per file:

    apply.py      the model's side: its batch split (zigzag), its loss over the global target
                  count, its outputs gathered back (`apply_context_parallel`, `gather_sequence`)
    batch.py      which inputs split along the sequence, and how
    layout.py     the zigzag chunks: which global positions a rank holds
    attention.py  attention over the whole context through transformers' AttentionInterface:
                  all-gather K/V or Ulysses (all-to-all to heads), masks from global positions
    ring.py       ring attention: K/V passed around the ring with an online softmax
    checks.py     what CP needs of a model, checked before any collective
"""

from tpkit.parallel.context.apply import (
    ContextParallel,
    apply_context_parallel,
    average_over_cp,
    context_of,
    context_parallel,
    gather_sequence,
)

__all__ = [
    "ContextParallel",
    "apply_context_parallel",
    "average_over_cp",
    "context_of",
    "context_parallel",
    "gather_sequence",
]
