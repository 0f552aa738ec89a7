"""Masked-LM and speech encoders split at full size (issue 29): tp=2 against the unsharded model,
output and every gradient, on tiny models built from their configs.

- I-BERT's layers are ``QuantLinear`` / ``QuantEmbedding``: no ``nn.Linear``, but outside quant
  mode their forward is ``F.linear(x, self.weight, self.bias)`` (returning ``(y, None)``). The
  trace takes a module that applies ``F.linear`` / ``F.embedding`` to its own weight as a layer
  (share 0.5% -> 99%).
- NeoMME's exclusive self-attention scales each head by its own ``alpha`` [heads]: replicated,
  the split forward broadcast all heads' values against the rank's and the attention stayed
  whole (63% -> 99.9%); ``alpha`` is now split with the heads.
- MRA's attention without its CUDA kernel returns zeros shaped like the queries: its key and
  value reach nothing and stayed whole (88% -> 99%); they are split with the queries.
- Funnel's layers sit in a list of lists (``encoder.blocks[i][j]``), which the trace did not
  take as blocks (no residual stream: only the decoder and feed-forward pairs were split), and
  its attention mask, made ``type_as`` the embeddings, carried the embedding's tag into every
  attention (no row partner). Its attention reads the head count from the shared config, so
  it is split gathered (``colwise_gather_output`` / ``rowwise_split_input``): 68% -> 94%.
- SpeechT5 merges the heads into the batch ([B * H, T, d]) before multiplying the queries by
  its relative position table: the trace lost the heads there, split the table by columns and
  the dry run kept the attention whole (78% -> 97%); the table is read by every head (whole,
  its gradient all-reduced).
"""

from __future__ import annotations

import traceback

import pytest

from tests.test_families import check_parity


def parity_and_plan(model_type: str, class_name: str, family: str) -> dict:
    """Run on every rank: `tests.test_families.family_parity` and the plan's styles."""
    try:
        from tests.test_families import family_parity
        from tests.tiny_family import build_family
        from tpkit.plan import derive_plan

        r = family_parity(model_type, class_name, family)
        model = build_family(model_type, class_name, device="meta")
        r["styles"] = dict(derive_plan(model, "auto", 2).items())
        return r
    except Exception:  # noqa: BLE001 - shown by the test
        return {"error": traceback.format_exc()}


CASES = {
    "ibert": (
        ("ibert", "IBertForMaskedLM", "masked-lm"),
        {
            "ibert.encoder.layer.*.attention.self.query": "colwise",
            "ibert.encoder.layer.*.attention.output.dense": "rowwise",
            "ibert.encoder.layer.*.intermediate.dense": "colwise",
            "ibert.encoder.layer.*.output.dense": "rowwise",
            "ibert.embeddings.word_embeddings": "vocab_parallel",
        },
    ),
    "neomme": (
        ("neomme", "NeoMMEForMaskedLM", "masked-lm"),
        {
            "model.layers.*.self_attn.q_proj": "colwise",
            "model.layers.*.self_attn.exclusive_self_attention.alpha": "colwise",
            "model.layers.*.self_attn.output_projection.o_proj": "rowwise",
        },
    ),
    "mra": (
        ("mra", "MraForMaskedLM", "masked-lm"),
        {
            "mra.encoder.layer.*.attention.self.query": "colwise",
            "mra.encoder.layer.*.attention.self.key": "colwise",
            "mra.encoder.layer.*.attention.self.value": "colwise",
        },
    ),
    "funnel": (
        ("funnel", "FunnelForMaskedLM", "masked-lm"),
        {
            # split by heads where the dry run runs it (tiny), else gathered (full size)
            "funnel.encoder.blocks.*.*.attention.q_head": ("colwise", "colwise_gather_output"),
            "funnel.encoder.blocks.*.*.attention.post_proj": ("rowwise", "rowwise_split_input"),
            "funnel.encoder.blocks.*.*.ffn.linear_1": "colwise",
            "funnel.encoder.blocks.*.*.ffn.linear_2": "rowwise",
        },
    ),
    "speecht5": (
        ("speecht5", "SpeechT5ForSpeechToText", "speech-seq2seq"),
        {
            "speecht5.encoder.wrapped_encoder.layers.*.attention.q_proj": "colwise",
            "speecht5.encoder.wrapped_encoder.layers.*.attention.out_proj": "rowwise",
            "speecht5.encoder.wrapped_encoder.embed_positions.pe_k": (
                "replicated_with_grad_allreduce"
            ),
        },
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_split_with_parity(ranks2, case):
    args, want = CASES[case]
    for r in check_parity(ranks2.run(parity_and_plan, *args, timeout=600)):
        styles = r["styles"]
        for pattern, style in want.items():
            assert styles.get(pattern) in (style if isinstance(style, tuple) else (style,)), (
                pattern,
                styles,
            )


def test_functional_layer_only_when_it_applies_its_own_weight():
    """A module with a 2-D weight is a layer of the trace only when its forward hands that very
    weight to ``F.linear``: one that scales it first (as quant mode's integer weight) is not."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    from tpkit.plan.trace import trace

    class Plain(nn.Module):
        def __init__(self, i: int, o: int):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(o, i))

        def forward(self, x):
            return F.linear(x, self.weight), None

    class Scaled(Plain):
        def forward(self, x):
            return F.linear(x, self.weight * 2), None

    class Block(nn.Module):
        def __init__(self, up: type):
            super().__init__()
            self.up, self.down = up(8, 16), Plain(16, 8)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)[0]))[0]

    class Net(nn.Module):
        def __init__(self, up: type):
            super().__init__()
            self.layers = nn.ModuleList([Block(up), Block(up)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    nodes = trace(Net(Plain), (torch.randn(2, 3, 8),))["nodes"]
    assert nodes["layers.0.up"].consumers == {"layers.0.down"}, nodes
    assert nodes["layers.0.down"].writer, nodes
    nodes = trace(Net(Scaled), (torch.randn(2, 3, 8),))["nodes"]
    assert "layers.0.up" not in nodes and "layers.0.down" in nodes, nodes
