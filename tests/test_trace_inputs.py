"""Plans for models whose inputs are not a batch of token ids: an ``nn.EmbeddingBag`` table
(split by columns, exact for every bag mode), a bare transformer block whose forward needs
arguments (``example_inputs=``), and a forward that refuses more than one row (GPT-2's
sequence classifier without a pad token: the trace retries with one), and a second token table
(vocab-parallel like the input embedding; a position table that looks up arange stays whole).
Each checked against the unsharded module: output and every gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

TOL = 1e-5


class Tables(nn.Module):
    """A recommender's shape: two bag tables (one with padding_idx), concatenated, an MLP."""

    def __init__(self, mode: str, max_norm: float | None = None):
        super().__init__()
        self.big = nn.EmbeddingBag(1001, 64, mode=mode, padding_idx=3, max_norm=max_norm)
        self.small = nn.EmbeddingBag(50, 30, mode=mode)  # 15 or 8,8,8,6 columns per rank
        self.fc1 = nn.Linear(94, 128)
        self.fc2 = nn.Linear(128, 4)

    def forward(self, ids, offsets=None, per_sample_weights=None):
        rows = [self.big(ids, offsets, per_sample_weights), self.small(ids % 50, offsets)]
        return self.fc2(torch.relu(self.fc1(torch.cat(rows, -1))))


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1001, (12,), generator=g)
    ids[[0, 5]] = 3  # padding rows, excluded from their bags
    return ids, torch.tensor([0, 3, 3, 7])  # bag 1 is empty


def _compare(ref: nn.Module, model: nn.Module, run) -> dict:
    outs = []
    for m in (ref, model):
        out = run(m)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append(out.detach())
    want = dict(ref.named_parameters())
    grads = [
        (p.grad.full_tensor() - want[n].grad).abs().max().item()
        for n, p in model.named_parameters()
    ]
    local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    return {"out": (outs[0] - outs[1]).abs().max().item(), "grad": max(grads), "local": local}


def bag_parity(mode: str) -> dict:
    import tpkit

    torch.manual_seed(0)
    ref = Tables(mode)
    ids, offsets = _inputs()
    weights = torch.rand(12, generator=torch.Generator().manual_seed(2)) if mode == "sum" else None
    model = tpkit.tensor_parallel(copy.deepcopy(ref), example_inputs=(ids, offsets))
    psw = {}

    def run(m):
        w = None if weights is None else weights.clone().requires_grad_()
        psw[id(m)] = w
        return m(ids, offsets, w)

    result = _compare(ref, model, run)
    if weights is not None:
        a, b = (psw[id(m)].grad for m in (ref, model))
        result["psw_grad"] = (a - b).abs().max().item()
    return result


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_split_by_columns_tp2(ranks2, mode):
    for r in ranks2.run(bag_parity, mode):
        assert r["out"] <= TOL and r["grad"] <= TOL, r
        assert r["local"]["big.weight"] == (1001, 32) and r["local"]["small.weight"] == (50, 15), r
        assert r["local"]["fc1.weight"] == (64, 94), r  # the MLP after the tables is paired too
        assert r.get("psw_grad", 0.0) <= TOL, r


def test_embedding_bag_uneven_tp4(ranks4):
    results = ranks4.run(bag_parity, "mean")
    for r in results:
        assert r["out"] <= TOL and r["grad"] <= TOL, r
    assert [r["local"]["small.weight"] for r in results] == [(50, 8)] * 3 + [(50, 6)]


def test_embedding_bag_with_max_norm_stays_whole_or_is_refused():
    from tpkit.plan import derive_plan, validate

    model = Tables("sum", max_norm=1.0)
    plan = derive_plan(model, "auto", 2, example_inputs=_inputs())
    assert plan.style_for("big") is None  # no entry: replicated
    assert "max_norm=1.0 renormalises each row" in plan.notes["big"]
    assert plan.style_for("small")[0] == "colwise_embedding_gather"
    with pytest.raises(ValueError, match=r"big \(EmbeddingBag, max_norm=1.0\) cannot be split"):
        validate(model, derive_plan(model, {"big": "colwise_embedding_gather"}, 2), 2)


def bloom_block_parity() -> dict:
    import transformers

    import tpkit

    config = transformers.BloomConfig(hidden_size=64, n_head=4, n_layer=1, vocab_size=101)
    torch.manual_seed(0)
    ref = transformers.BloomModel(config).h[0].eval()
    g = torch.Generator().manual_seed(1)
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    x = {
        "hidden_states": torch.randn(2, 7, 64, generator=g),
        "alibi": build_alibi_tensor(torch.ones(2, 7), 4, torch.float32),
        "attention_mask": torch.triu(torch.ones(7, 7, dtype=torch.bool), 1).expand(2, 1, 7, 7),
    }
    model = tpkit.tensor_parallel(copy.deepcopy(ref), example_inputs=x)

    def run(m):
        out = m(**x)
        return out[0] if isinstance(out, tuple) else out

    return _compare(ref, model, run)


def test_bare_bloom_block_with_example_inputs(ranks2):
    for r in ranks2.run(bloom_block_parity):
        assert r["out"] <= TOL and r["grad"] <= TOL, r
        local = r["local"]
        assert local["self_attention.query_key_value.weight"] == (96, 64), local
        assert local["self_attention.dense.weight"] == (64, 32), local
        assert local["mlp.dense_h_to_4h.weight"] == (128, 64), local


def gpt2_classifier_parity() -> dict:
    import transformers

    import tpkit

    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=101, num_labels=3)
    config.pad_token_id = None  # then GPT-2 refuses batches of more than one row
    torch.manual_seed(0)
    ref = transformers.GPT2ForSequenceClassification(config).eval()
    ids = torch.randint(0, 101, (1, 9), generator=torch.Generator().manual_seed(1))
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    return _compare(ref, model, lambda m: m(input_ids=ids).logits)


def test_gpt2_classifier_without_pad_token_traces_one_row(ranks2):
    for r in ranks2.run(gpt2_classifier_parity):
        assert r["out"] <= TOL and r["grad"] <= TOL, r
        assert r["local"]["transformer.h.0.attn.c_attn.weight"] == (64, 96), r["local"]
        assert r["local"]["transformer.h.0.mlp.c_fc.weight"] == (64, 128), r["local"]


def test_one_row_trace_is_remembered_for_the_dry_run_only_when_it_worked():
    import transformers

    from tpkit.trace.fake import TRACE_BATCH, trace_batch
    from tpkit.trace.trace import trace

    config = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=101)
    config.pad_token_id = None
    with torch.device("meta"):
        model = transformers.GPT2ForSequenceClassification(config)
    assert trace(model)["batch"] == 1 == trace_batch(model)
    broken = nn.Sequential(nn.Linear(4, 8), nn.Linear(5, 2))  # fails with any batch
    with pytest.raises(RuntimeError):
        trace(broken)
    assert trace_batch(broken) == TRACE_BATCH


class _Positions(nn.Embedding):
    """BART's kind of position table: called with the ids, looks up ``arange(seq)``."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.arange(ids.shape[-1], device=ids.device))


class TwoTables(nn.Module):
    """Token ids into two tables (Gemma-3n's per-layer one, FSMT's second vocabulary), a
    position table and an MLP."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(101, 64)
        self.per_layer = nn.Embedding(101, 96)  # 51 and 50 rows at tp=2
        self.positions = _Positions(16, 64)
        self.fc1 = nn.Linear(160, 128)
        self.fc2 = nn.Linear(128, 64)
        self.head = nn.Linear(64, 101)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.positions(ids)
        h = torch.cat([x, self.per_layer(ids)], -1)
        return self.head(x + self.fc2(torch.relu(self.fc1(h))))


def tables_parity() -> dict:
    import tpkit

    torch.manual_seed(0)
    ref = TwoTables()
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1))
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    return _compare(ref, model, lambda m: m(ids))


def test_a_second_token_table_is_vocab_parallel_and_a_position_table_split_by_columns(ranks2):
    for r in ranks2.run(tables_parity):
        assert r["out"] <= TOL and r["grad"] <= TOL, r
        local = r["local"]
        assert local["per_layer.weight"][0] in (51, 50) and local["per_layer.weight"][1] == 96
        # it looks up arange, not its input: masking the ids would mask the wrong tensor, so
        # its columns are split and gathered (LED's 16384-row table: 4% of the model)
        assert local["positions.weight"] == (16, 32), local


def test_naflex_models_get_flattened_patches_and_their_grid():
    """Pure, on meta: SigLIP-2 reads each image as flattened patches [images, patches, channels
    * patch * patch] with its patch grid (``spatial_shapes``, whose values resize its position
    table) and, for the vision model, a required ``pixel_attention_mask``. Before, the made-up
    [images, channels, height, width] image failed the patch embedding, the trace fell to the
    per-layer fallback, and the split position table (read whole by the resize) failed the
    split forward with "mixed torch.Tensor and DTensor". Now the plan is traced: attention and
    MLP pairs, the position table whole."""
    from tests.tiny_family import build_family
    from tpkit.plan import derive_plan
    from tpkit.trace.inputs import synthesize_inputs

    model = build_family("siglip2", "Siglip2VisionModel", device="meta")
    _, kwargs = synthesize_inputs(model, 2, 9)
    patch, channels = model.config.patch_size, model.config.num_channels
    assert kwargs["pixel_values"].shape[-1] == channels * patch * patch
    assert (kwargs["spatial_shapes"].prod(-1) == kwargs["pixel_values"].shape[1]).all()
    assert kwargs["pixel_attention_mask"].shape == kwargs["pixel_values"].shape[:2]
    plan = derive_plan(model, "auto", 2)
    assert plan.style_for("encoder.layers.0.self_attn.q_proj")[0] == "colwise"
    assert plan.style_for("embeddings.position_embedding") is None
