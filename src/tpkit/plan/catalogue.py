"""The style catalogue: one record per tensor-parallel style, which every other part asks.

A `StyleSpec` says what a style *is*, as data: its role (how it splits input and output), which
dimension of each parameter it shards (`shard`), how many packed parts it splits separately,
the collective it issues in forward, whether uneven splits are exact, the names other libraries
use for it, and its math in one line. Validation, inference, explanation, loading, sequence
parallelism and PEFT all read these records instead of keeping their own lists of "column
styles". The classes that run a style live in `tpkit.styles` and are bound to these names there;
`tpkit.register_style` adds a user style (spec and class) to both.

Pure data: no process group, no torch.distributed (plan/ must run on a laptop, on meta).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "ROLES",
    "SHARDS",
    "StyleSpec",
    "all_specs",
    "bind",
    "canonical_style",
    "implementation",
    "packed_style",
    "register_spec",
    "style_spec",
]

#: How a style treats its module's input and output (``role``):
#: - ``column``: whole input, output split by features (Y_i = X W_i);
#: - ``row``: input split by features, output summed by one all-reduce (Y = sum_i X_i W_i);
#: - ``whole``: whole input and whole output, sharded parameters inside (vocab-parallel lookup,
#:   gathered head, a row layer that slices its own input, experts whose entries shard them);
#: - ``replicate``: replicated parameters (some with their gradient all-reduced);
#: - ``channel``: input and output split alike by channels, no collective (a depthwise conv or
#:   a per-channel projection on a column layer's split output: Mamba's conv1d, dt_proj).
ROLES = ("column", "row", "whole", "replicate", "channel")
#: Which dimension a style splits (``shard``), by parameter kind: ``out`` = output features
#: (Linear dim -2, Conv1D -1, 3-D experts -2; 1-D biases split with it), ``in`` = input features
#: (Linear -1, Conv1D 0), ``vocab`` = an embedding's rows, ``cols`` = an embedding's columns;
#: None = nothing (parameters replicated, or sharded by their own entries).
SHARDS = ("out", "in", "vocab", "cols", None)


@dataclass(frozen=True)
class StyleSpec:
    """What one style is; see the module docstring. ``own_entries``: applied to a module, the
    style leaves its parameters to their own plan entries (``experts.gate_up_proj: colwise``)."""

    name: str
    role: str
    math: str
    shard: str | None = None
    packed_parts: int = 1
    collective: str = ""
    uneven_ok: bool = False
    own_entries: bool = False
    #: the module is one region, whole input in and whole output out (``nn.MultiheadAttention``
    #: by heads): the dry run runs it on whole weights, settling keeps its group as one
    self_contained: bool = False
    aliases: tuple[str, ...] = ()
    #: the mesh axis whose step applies it: "tp" (the tensor step, on the TP mesh) or "ep" (the
    #: expert step, on the expert-parallel mesh: whole experts per rank; the tensor step leaves
    #: the module and everything under it alone)
    axis: str = "tp"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"style {self.name!r}: role must be one of {ROLES}, got {self.role!r}")
        if self.shard not in SHARDS:
            raise ValueError(f"style {self.name!r}: shard must be one of {SHARDS}")
        if self.packed_parts < 1:
            raise ValueError(f"style {self.name!r}: packed_parts must be >= 1")

    @property
    def splits_output(self) -> bool:
        """The output leaves this layer split by features (a column layer)."""
        return self.role == "column"

    @property
    def splits_input(self) -> bool:
        """The layer expects its input split by features (a row layer)."""
        return self.role == "row"


_BUILTIN = (
    StyleSpec(
        "colwise",
        "column",
        "Y_i = X W_i: output features split, output stays sharded",
        shard="out",
        uneven_ok=True,  # torch.chunk sizes; heads that tp does not divide are refused apart
        # transformers' "unit_colwise" (k/v split by whole heads, replicated where KV heads < tp):
        # colwise already splits by heads, and settle/kvheads.py replicates KV heads fewer than tp
        aliases=("local_colwise", "unit_colwise"),
    ),
    StyleSpec(
        "packed_colwise",
        "column",
        "fused [gate; up]: each of the 2 parts split like colwise (strided)",
        shard="out",
        packed_parts=2,
        # each part in torch.chunk sizes: rank r's [gate_r; up_r] still pairs under chunk(2),
        # and the row layer it feeds takes the same chunks of the intermediate width
        uneven_ok=True,
        aliases=("local_packed_colwise",),
    ),
    StyleSpec(
        "packed_qkv_colwise",
        "column",
        "fused [q; k; v]: each of the 3 parts split like colwise (strided)",
        shard="out",
        packed_parts=3,
    ),
    StyleSpec(
        "colwise_replicated_heads",
        "column",
        "K_r = X W[head r*kv/tp]: KV heads fewer than tp, each rank computes the one its query "
        "heads read; weight replicated, gradient all-reduced (ranks sharing a head add up)",
        # the weight is kept whole on every rank (shard None): its layout is replicated
    ),
    StyleSpec(
        "colwise_embedding",
        "column",
        "E_i = E[:, cols_i]: embedding columns split (a per-head bias table), output sharded",
        shard="cols",
        aliases=("embedding_colwise",),
    ),
    StyleSpec(
        "rowwise",
        "row",
        "Y = sum_i X_i W_i + b: input features split, output all-reduced, bias added once",
        shard="in",
        collective="all_reduce",
        uneven_ok=True,  # the same chunks as the column layer feeding it: sum_i X_i W_i exact
        aliases=("local_rowwise", "unit_rowwise"),
    ),
    StyleSpec(
        "packed_rowwise",
        "row",
        "input features split per packed part (2, strided), output all-reduced",
        shard="in",
        packed_parts=2,
        collective="all_reduce",
        uneven_ok=True,  # transposed fused [gate | up]: as packed_colwise, by raw dims
    ),
    StyleSpec(
        "rowwise_feeds_split",
        "row",
        "Y = f(sum_i X_i W_i): rowwise, its whole output then read by every rank's channels "
        "(Mamba's x_proj -> dt, B, C): f sums those partial gradients",
        shard="in",
        collective="all_reduce",
    ),
    StyleSpec(
        "channelwise",
        "channel",
        "Y_c = f_c(X_c): this rank's channels in, the same channels out (depthwise conv, "
        "per-channel projection), no collective; its parent may read its weight directly",
        shard="out",
    ),
    StyleSpec(
        "rowwise_split_input",
        "whole",
        "rowwise on a replicated input: each rank takes its slice of the input first",
        shard="in",
        collective="all_reduce",
        uneven_ok=True,  # the slice is the rank's torch.chunk of the input, as its weight's rows
        aliases=("rowwise_rep",),
    ),
    StyleSpec(
        "colwise_gather_output",
        "whole",
        "Y = [X W_0, ..., X W_t-1]: output features split, then all-gathered (lm_head)",
        shard="out",
        collective="all_gather",
        uneven_ok=True,
        aliases=("gather_output", "colwise_rep"),
    ),
    StyleSpec(
        "conv_colwise_gather",
        "whole",
        "Y = [conv(X, W_0), ..., conv(X, W_t-1)]: a convolution's output channels split (a "
        "grouped one's rows padded to whole groups, its input narrowed to them), then "
        "all-gathered on the channel dim",
        shard="out",
        collective="all_gather",
        uneven_ok=True,
    ),
    StyleSpec(
        "conv_colwise",
        "column",
        "Y_i = conv(X, W_i) + b_i: a groups=1 convolution's (or transposed one's) output "
        "channels split, output stays split on the channel dim",
        shard="out",
        uneven_ok=True,  # the rowwise conv it feeds takes the same torch.chunk of its inputs
    ),
    StyleSpec(
        "conv_packed_colwise",
        "column",
        "Y_i = [conv(X, Wa_i) | conv(X, Wb_i)]: conv_colwise on output channels packed as two "
        "halves (a | b, read by a GLU over the channels), each half split separately",
        shard="out",
        packed_parts=2,
        uneven_ok=True,  # each half in torch.chunk sizes: the row conv takes the same chunks
    ),
    StyleSpec(
        "conv_rowwise",
        "row",
        "Y = sum_i conv(X_i, W_i) + b: input channels split, partial sums all-reduced, bias "
        "added once",
        shard="in",
        collective="all_reduce",
        uneven_ok=True,
    ),
    StyleSpec(
        "norm_channelwise",
        "channel",
        "BatchNorm / GroupNorm on this rank's channels: weight, bias and running statistics "
        "split by channel (whole groups per rank), no collective",
        shard="out",
        uneven_ok=True,  # BatchNorm: per channel; GroupNorm: paired only when tp divides groups
    ),
    StyleSpec(
        "colwise_embedding_gather",
        "whole",
        "E_i = E[:, cols_i]: an EmbeddingBag's columns split, bags reduced per column (exact in "
        "every mode), columns all-gathered",
        shard="cols",
        collective="all_gather",
        uneven_ok=True,
        aliases=("embedding_bag_colwise",),
    ),
    StyleSpec(
        "mha_heads",
        "whole",
        "nn.MultiheadAttention by heads: [q; k; v] each split by output rows (whole heads), "
        "this rank's heads attend, out_proj (rowwise) all-reduced",
        shard="out",
        packed_parts=3,  # in_proj_weight / in_proj_bias; q/k/v_proj_weight and bias_k/v: 1
        collective="all_reduce",
        self_contained=True,
    ),
    StyleSpec(
        "mha_functional",
        "whole",
        "a module calling torch's multi_head_attention_forward on its child linears (q, k, v "
        "colwise, out rowwise; never called): the call run on this rank's heads, its per-head "
        "mask sliced, output all-reduced",
        collective="all_reduce",
        self_contained=True,
    ),
    StyleSpec(
        "vocab_parallel",
        "whole",
        "E[x] = sum_i E_i[x - off_i], masked to rank i's rows: rows split by vocab, all-reduced",
        shard="vocab",
        collective="all_reduce",
        uneven_ok=True,
        aliases=("embedding_rowwise",),
    ),
    StyleSpec(
        "ep_experts",
        "whole",
        "whole experts per EP rank: each routed (token, expert) pair computed on its expert's "
        "rank (all-to-all, or all-reduce where the EP group holds one batch), summed per token",
        collective="all_to_all",
        axis="ep",
    ),
    StyleSpec(
        "ep_grouped_experts",
        "whole",
        "whole experts per EP rank, their rows grouped by expert (JetMoE's grouped linears, "
        "Llama-4's per-expert blocks): each expert's rows to its rank and back, or all-gathered",
        collective="all_to_all",
        axis="ep",
    ),
    StyleSpec(
        "moe_tp_experts",
        "whole",
        "experts run their own shards (f on inputs), outputs summed by one all-reduce (g)",
        collective="all_reduce",
        own_entries=True,
    ),
    StyleSpec(
        "all_reduce",
        "whole",
        "parameters as their own entries say; input gradients and output all-reduced",
        collective="all_reduce",
        own_entries=True,
    ),
    StyleSpec(
        "moe_reduced_input",
        "replicate",
        "a module with parameters inside moe_tp_experts that reads the experts' summed output "
        "(Ergo's per-expert norm): its input all-reduced first, its gradient all-reduced",
        collective="all_reduce",
    ),
    StyleSpec(
        "moe_identity_expert",
        "replicate",
        "an identity expert inside moe_tp_experts: input / tp (the experts' sum adds tp copies)",
        own_entries=True,
    ),
    StyleSpec(
        "tail_grad_allreduce",
        "replicate",
        "replicated; the gradient of its output's last `tail` features all-reduced (MLA's rope "
        "key, which goes straight into the rank's heads)",
        aliases=("mla_kv_a_proj",),
    ),
    StyleSpec(
        "replicate",
        "replicate",
        "parameters replicated, compute on local tensors",
        aliases=("replicated", "local", "local_params"),
        # transformers' "local_params": a module whose parameters are sharded by their own entries
        # runs on local tensors, which every tpkit style does; "replicate" leaves those entries be
    ),
    StyleSpec(
        "replicated_with_grad_allreduce",
        "replicate",
        "replicated, acts on sharded activations (Qwen3 q_norm): gradient all-reduced",
    ),
)

_SPECS: dict[str, StyleSpec] = {}
_ALIASES: dict[str, str] = {}
_IMPLS: dict[str, Any] = {}
#: a packed style with its own number of parts: ``packed_colwise_x16`` (`packed_style`)
_PARTS = re.compile(r"^(?P<base>\w+?)_x(?P<parts>\d+)$")
_DERIVED: dict[str, str] = {}  # derived name -> the packed style it counts other parts of


def packed_style(base: str, parts: int) -> str:
    """The name of packed style ``base`` (``packed_colwise``, ``packed_rowwise``) with ``parts``
    packed parts instead of its own: ``packed_colwise_x16``. One entry's split factor, carried by
    its style name so that everything that reads a layout from a style (loading, checkpoints,
    validation, the dry run, `tpkit plan`) agrees without another field: 2-D experts stored as
    ``[E * F, H]`` and viewed per expert (DBRX) are ``E`` parts, each split like a column."""
    spec = style_spec(base)
    if spec.packed_parts < 2 or parts < 2:
        raise ValueError(f"packed_style: {base!r} is not a packed style or parts={parts} < 2.")
    name = spec.name if parts == spec.packed_parts else f"{spec.name}_x{parts}"
    return canonical_style(name)


def _derive(name: str) -> bool:
    """Register ``<packed style>_x<parts>`` on first use (a plan read back from YAML names it
    before any derivation ran); False for any other unknown name."""
    m = _PARTS.match(name)
    base = _ALIASES.get(m["base"], m["base"]) if m else ""
    spec = _SPECS.get(base)
    if spec is None or spec.packed_parts < 2 or int(m["parts"]) < 2:
        return False
    parts = int(m["parts"])
    math = f"{base} with {parts} packed parts (experts stored [E * F, H]), each split separately"
    register_spec(replace(spec, name=name, packed_parts=parts, aliases=(), math=math))
    _DERIVED[name] = base
    return True


def register_spec(style: StyleSpec, implementation: Any = None, *, replace: bool = False) -> None:
    """Add ``style`` to the catalogue (and the class that runs it, when given). A name or alias
    already taken is an error unless ``replace``: two meanings for one plan string would make
    plans ambiguous."""
    taken = {style.name, *style.aliases} & (_SPECS.keys() | _ALIASES.keys())
    if taken and not replace:
        raise ValueError(
            f"style name(s) {sorted(taken)} are already in the catalogue; pass replace=True to "
            "redefine them or choose another name."
        )
    _SPECS[style.name] = style
    for alias in style.aliases:
        _ALIASES[alias] = style.name
    if implementation is not None:
        _IMPLS[style.name] = implementation


def canonical_style(name: str) -> str:
    """Map an alias to its catalogue name; a ValueError listing the known names otherwise."""
    name = _ALIASES.get(name, name)
    if name == "sequence_parallel":
        raise ValueError(
            "'sequence_parallel' is not a per-module style in tpkit: pass "
            "tensor_parallel(model, sequence_parallel=True), which shards the norms and residual "
            "stream between blocks by sequence (tpkit.parallel.sequence)."
        )
    if name not in _SPECS and not _derive(name):
        raise ValueError(
            f"Unknown tensor-parallel style {name!r}; known styles: {', '.join(sorted(_SPECS))} "
            f"(aliases: {', '.join(sorted(_ALIASES))})."
        )
    return name


def style_spec(name: str) -> StyleSpec:
    """The record of a style (aliases accepted)."""
    return _SPECS[canonical_style(name)]


def all_specs(*, derived: bool = True) -> list[StyleSpec]:
    """Every style in the catalogue. ``derived=False`` leaves out the ``<packed>_x<parts>``
    styles registered on first use: a function of their base, so a plan cache's key (which
    holds the catalogue) stays the same before and after a derivation that named one."""
    return [s for s in _SPECS.values() if derived or s.name not in _DERIVED]


def implementation(name: str) -> Any:
    """The class bound to a style name (`tpkit.styles` binds the built-in ones on import)."""
    name = canonical_style(name)
    if name not in _IMPLS and _DERIVED.get(name) in _IMPLS:
        # the base's class, laying its parameters out as the derived spec says (its name)
        base = _IMPLS[_DERIVED[name]]
        attrs = {"name": name, "__module__": base.__module__}
        _IMPLS[name] = type(f"{base.__name__}_x{_SPECS[name].packed_parts}", (base,), attrs)
    if name not in _IMPLS:
        raise ValueError(f"style {name!r} has no implementation registered (import tpkit.styles).")
    return _IMPLS[name]


def bind(name: str, implementation: Any) -> None:
    """Attach the class that runs a catalogued style (used by `tpkit.styles`)."""
    _IMPLS[canonical_style(name)] = implementation


for _style in _BUILTIN:
    register_spec(_style)
