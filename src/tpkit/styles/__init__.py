"""Tensor-parallel styles: the classes that run the catalogue's styles (`tpkit.plan.catalogue`).

    base.py       TPStyle (DTensor parameters, local compute, the module's record), replicate
    linear.py     colwise, packed colwise, gathered head, rowwise and its variants
    embedding.py  vocab-parallel embedding, per-head (column) embedding
    combined.py   modules split by their own entries (experts, all_reduce), partial gradients
    expert.py     expert parallelism: whole experts per EP rank, tokens sent to them
    attention.py  nn.MultiheadAttention split by heads (its projections are bare parameters)
    conv.py       convolutions by channels: gathered, or paired colwise -> rowwise with the
                  BatchNorm / GroupNorm between them on the rank's channels

Each class that runs a built-in style is decorated `implements` where it is defined (binding it
to its catalogue name), so importing this package binds them all; `make_style` builds the style
object for one module from its catalogue name and options; `register_style` adds a user style: its `StyleSpec` (what it is, for plans, validation and
loading) and its class (what it does).
"""

from __future__ import annotations

from typing import Any

from tpkit.plan.catalogue import StyleSpec, canonical_style, implementation, register_spec
from tpkit.styles.attention import FunctionalAttentionStyle, MultiheadAttentionStyle
from tpkit.styles.base import (
    ParentSwap,
    ReplicateGradAllReduceStyle,
    ReplicateStyle,
    TPStyle,
    distribute_param,
    placement_for,
    read_directly,
    style_of,
)
from tpkit.styles.combined import (
    AllReduceStyle,
    MoeExpertsStyle,
    MoeIdentityExpertStyle,
    MoeReducedInputStyle,
    TailGradAllReduceStyle,
)
from tpkit.styles.conv import (
    ConvColwiseStyle,
    ConvGatherStyle,
    ConvPackedColwiseStyle,
    ConvRowwiseStyle,
    NormChannelStyle,
)
from tpkit.styles.embedding import (
    ColwiseEmbeddingStyle,
    GatherColumnsEmbeddingStyle,
    VocabParallelStyle,
)
from tpkit.styles.expert import ExpertParallelStyle, GroupedExpertsStyle
from tpkit.styles.linear import (
    ChannelwiseStyle,
    ColwiseStyle,
    GatherOutputStyle,
    PackedColwiseStyle,
    PackedQKVColwiseStyle,
    PackedRowwiseStyle,
    ReplicatedHeadsColwiseStyle,
    RowwiseFeedsSplitStyle,
    RowwiseSplitInputStyle,
    RowwiseStyle,
)

__all__ = [
    "ExpertParallelStyle",
    "GroupedExpertsStyle",
    "AllReduceStyle",
    "ChannelwiseStyle",
    "ColwiseEmbeddingStyle",
    "ColwiseStyle",
    "ConvColwiseStyle",
    "ConvGatherStyle",
    "ConvPackedColwiseStyle",
    "ConvRowwiseStyle",
    "FunctionalAttentionStyle",
    "NormChannelStyle",
    "GatherColumnsEmbeddingStyle",
    "GatherOutputStyle",
    "MoeExpertsStyle",
    "MoeIdentityExpertStyle",
    "MoeReducedInputStyle",
    "MultiheadAttentionStyle",
    "PackedColwiseStyle",
    "PackedQKVColwiseStyle",
    "PackedRowwiseStyle",
    "ParentSwap",
    "ReplicateGradAllReduceStyle",
    "ReplicateStyle",
    "ReplicatedHeadsColwiseStyle",
    "RowwiseFeedsSplitStyle",
    "RowwiseSplitInputStyle",
    "RowwiseStyle",
    "TPStyle",
    "TailGradAllReduceStyle",
    "VocabParallelStyle",
    "distribute_param",
    "make_style",
    "placement_for",
    "read_directly",
    "register_style",
    "style_of",
]


def make_style(name: str, **options: Any) -> TPStyle:
    """A fresh style object for one module: the class bound to ``name`` (aliases accepted) built
    with ``options`` (the plan entry's arguments and tpkit's: ``sp``, ``compute_dtype``, ...)."""
    return implementation(canonical_style(name))(**options)


def register_style(style: StyleSpec, cls: type[TPStyle], *, replace: bool = False) -> None:
    """Add a style users can name in plans: ``style`` says what it is (role, which dim it
    shards, its collective, ...), ``cls`` (a `TPStyle` subclass with ``name = style.name``) runs
    it. Validation, loading, checkpoints and `tpkit plan` then treat it like a built-in."""
    if not (isinstance(cls, type) and issubclass(cls, TPStyle)):
        raise TypeError(f"register_style needs a TPStyle subclass, got {cls!r}.")
    if cls.name != style.name:
        raise ValueError(f"{cls.__name__}.name is {cls.name!r} but the spec says {style.name!r}.")
    register_spec(style, cls, replace=replace)
