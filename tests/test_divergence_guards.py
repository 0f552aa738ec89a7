"""Silent divergences an outside sweep found, and the guard that catches the kind.

- T5Gemma-2: its embedding (an ``nn.Embedding`` subclass) writes ``eoi_embedding`` where
  ``input_ids == eoi_token_index`` after the lookup. Vocab-parallel, it was handed shifted,
  masked ids, so the end-of-image rows kept the table's row on no rank: logits off by ~1.2.
- ShieldGemma-2: wraps Gemma-3, names no output head, and its ``lm_head`` is tied to the
  vocab-parallel embedding: the head computed with the rank's half of the vocabulary and was
  never gathered, so rank 0 returned the right yes/no logits and rank 1 others, no error.
- The output guard (`tpkit.guards.debug.check_outputs`): outputs that differ across the TP group while
  the inputs agree raise on every rank, naming the model and the output.

Tiny multimodal configs are built here: `tests.tiny` shrinks text configs only.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from tests.models import batch, build
from tests.parity import assert_parity

TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=101,  # odd: uneven vocab shards (51 + 50 rows)
    max_position_embeddings=64,
    query_pre_attn_scalar=16,
    sliding_window=4,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    image_size=16, patch_size=4,
)  # fmt: skip
SPECIAL = dict(mm_tokens_per_image=4, boi_token_index=97, eoi_token_index=98)
EOI, IMAGE = 98, 99
YES, NO = 10, 40  # both in rank 0's half (51 of 101 rows at tp=2): the reported silent case


def _randomize(model: nn.Module) -> nn.Module:
    """Every parameter drawn at random (a deterministic reference): the checkpoint-free init
    leaves ``eoi_embedding`` and the (1 + w) norms at zero, which would hide a wrong row."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim < 2 else 0.05))
    return model


def t5gemma2() -> nn.Module:
    import transformers

    config = transformers.T5Gemma2Config(
        encoder=dict(text_config=dict(TEXT), vision_config=dict(VISION), **SPECIAL),
        decoder=dict(TEXT),
        image_token_index=IMAGE,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.T5Gemma2ForConditionalGeneration(config)
    return _randomize(model).float().eval()


def shieldgemma2() -> nn.Module:
    import transformers

    config = transformers.ShieldGemma2Config(
        text_config=dict(TEXT), vision_config=dict(VISION), image_token_index=IMAGE, **SPECIAL
    )
    config.yes_token_index, config.no_token_index = YES, NO
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.ShieldGemma2ForImageClassification(config)
    return _randomize(model).float().eval()


def _inputs(seq2seq: bool) -> dict:
    ids = batch(97, (2, 9))
    ids[:, 3] = EOI  # the end-of-image token: T5Gemma-2 writes its own row for it
    return (
        {"input_ids": ids, "decoder_input_ids": ids[:, :5].clone()}
        if seq2seq
        else {"input_ids": ids}
    )


def check_parity(factory: str) -> dict:
    """tp=2 vs the unsharded model: logits and every gradient (as `tests.parity.tiny_parity`),
    the probabilities where the model returns them, and this rank's logits."""
    import tpkit

    ref = globals()[factory]()
    x = _inputs(factory == "t5gemma2")
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    w = None
    outs = []
    for m in (ref, model):
        out = m(**x)
        if w is None:
            w = torch.randn(out.logits.shape, generator=torch.Generator().manual_seed(2))
        (out.logits * w).sum().backward()
        outs.append(out)
    ref_params = dict(ref.named_parameters())
    grad, top, missing = 0.0, 0.0, []
    for name, p in model.named_parameters():
        g, want = p.grad, ref_params[name].grad
        if (g is None) != (want is None):
            missing.append(name)
        elif g is not None:
            g = g.full_tensor() if hasattr(g, "full_tensor") else g
            grad, top = max(grad, (g - want).abs().max().item()), max(top, want.abs().max().item())
    probs = getattr(outs[0], "probabilities", None)
    return {
        "logits": (outs[1].logits - outs[0].logits).abs().max().item(),
        "probabilities": 0.0
        if probs is None
        else (outs[1].probabilities - probs).abs().max().item(),
        "grad": grad,
        "grad_scale": top,
        "missing": missing,
        "local": outs[1].logits.detach(),
        "plan": {p: model._tpkit.plan[p] for p in model._tpkit.plan},
    }


def test_t5gemma2_end_of_image_row_matches_the_unsharded_model(ranks2):
    results = ranks2.run(check_parity, "t5gemma2")
    assert_parity(results)
    plan = results[0]["plan"]
    assert plan["model.encoder.text_model.embed_tokens"] == "vocab_parallel", plan


def test_shieldgemma2_ranks_agree_and_match_the_unsharded_model(ranks2):
    results = ranks2.run(check_parity, "shieldgemma2")
    assert torch.equal(results[0]["local"], results[1]["local"]), results
    assert_parity(results)
    assert all(r["probabilities"] <= 1e-5 for r in results), results
    # the head tied to the vocab-parallel table computes with its split: gathered
    assert results[0]["plan"]["model.lm_head"] == "colwise_gather_output", results[0]["plan"]


def test_a_tied_head_left_whole_takes_the_split_of_its_weight():
    """Pure plan: ShieldGemma-2's inner head (which ``get_output_embeddings`` does not name)
    is tied to the vocab-parallel embedding, so it is gathered rather than left whole."""
    from tpkit.plan import derive_plan, param_layouts

    model = shieldgemma2()
    plan = derive_plan(model, "auto", 2)
    # transformers' own class plan of the inner causal LM names it now (joined under its path,
    # `tpkit.sources.hf`); before, the tied-layer completion did: either way it is gathered
    assert plan.style_for("model.lm_head")[0] == "colwise_gather_output"
    layouts = param_layouts(model, plan)
    embed = layouts["model.model.language_model.embed_tokens.weight"][1]
    assert layouts["model.lm_head.weight"][1] == embed and embed.dim == 0


class IdsReadingEmbedding(nn.Embedding):
    """Reads its ids after the lookup, as T5Gemma-2's does: the marked token's row is replaced
    by a parameter of its own, every row then scaled."""

    def __init__(self) -> None:
        super().__init__(11, 8)
        self.marked = nn.Parameter(torch.randn(8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(ids) * 2.0
        rows[ids == 9] = self.marked
        return rows


class IndexingEmbedding(nn.Embedding):
    """Never calls F.embedding: rows read by indexing the weight."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class Tagger(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embed = embedding
        self.out = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids))


def check_embedding_subclass(kind: str) -> dict:
    """A vocab-parallel embedding subclass at tp=2 (plan named by the user) vs unsharded."""
    import tpkit

    torch.manual_seed(0)
    ref = Tagger(IdsReadingEmbedding() if kind == "ids" else IndexingEmbedding(11, 8)).eval()
    ids = torch.tensor([[1, 9, 4, 10, 9, 0], [6, 2, 9, 3, 8, 5]])
    model = tpkit.tensor_parallel(
        copy.deepcopy(ref), plan={"embed": "vocab_parallel", "out": "replicate"}
    )
    try:
        got = model(ids)
    except RuntimeError as exc:
        return {"error": str(exc)}
    want = ref(ids)
    got.sum().backward()
    want.sum().backward()
    return {
        "diff": (got - want).abs().max().item(),
        "marked grad": (model.embed.marked.grad.full_tensor() - ref.embed.marked.grad)
        .abs()
        .max()
        .item(),
        "table grad": (model.embed.weight.grad.full_tensor() - ref.embed.weight.grad)
        .abs()
        .max()
        .item(),
    }


def test_an_embedding_subclass_reading_its_ids_is_exact_vocab_parallel(ranks2):
    for r in ranks2.run(check_embedding_subclass, "ids"):
        assert r.get("diff", 1) <= 1e-6, r
        assert r["marked grad"] <= 1e-6 and r["table grad"] <= 1e-6, r


def test_an_embedding_subclass_that_never_looks_up_is_refused_on_every_rank(ranks2):
    for r in ranks2.run(check_embedding_subclass, "indexing"):
        assert "__getitem__ on its weight" in r.get("error", ""), r
        assert "'embed': 'replicate'" in r["error"], r


def check_output_guard(debug: bool, inject: bool, attentions: bool = False) -> dict:
    """A tiny Llama at tp=2; with ``inject`` its (gathered) head adds a tenth of the rank to
    its output (a module whose output depends on the rank, inputs agreeing). Three forwards."""
    import torch.distributed as dist

    import tpkit

    old = os.environ.get("TPKIT_DEBUG")
    os.environ["TPKIT_DEBUG"] = "1" if debug else "0"
    try:
        model = tpkit.tensor_parallel(build("llama"))
    finally:
        if old is None:
            os.environ.pop("TPKIT_DEBUG")
        else:
            os.environ["TPKIT_DEBUG"] = old
    if inject:
        rank = dist.get_rank()
        model.lm_head.register_forward_hook(lambda m, a, out: out + 0.1 * rank)
    x = batch(101)
    errors = []
    with torch.no_grad():
        for _ in range(3):
            try:
                model(input_ids=x, output_attentions=attentions)
            except RuntimeError as exc:
                errors.append(str(exc))
    return {"errors": errors}


@pytest.mark.parametrize("debug", [True, False])
def test_outputs_that_differ_across_ranks_raise_on_every_rank(ranks2, debug):
    results = ranks2.run(check_output_guard, debug, True)
    for r in results:
        # every forward under TPKIT_DEBUG=1; the first two (then the hook is gone) otherwise
        assert len(r["errors"]) == (3 if debug else 2), r
        msg = r["errors"][0]
        assert "LlamaForCausalLM" in msg and "'logits'" in msg, msg
        assert "differs across the TP group" in msg and "inputs agree" in msg, msg
        assert "rank 0:" in msg and "rank 1:" in msg, msg


@pytest.mark.parametrize("debug", [True, False])
def test_the_output_guard_is_silent_on_a_correct_split(ranks2, debug):
    # per-head attention weights are each rank's own heads: not compared
    for r in ranks2.run(check_output_guard, debug, False, attentions=True):
        assert r["errors"] == [], r
