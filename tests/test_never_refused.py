"""Any model that runs unsharded is split, never refused (issue 28).

Models whose forward reads something other than ``input_ids`` trace on inputs made up from the
model (`tpkit.trace.inputs`): ViT / ResNet / ConvNeXt (``pixel_values``), CLIP (both towers),
Wav2Vec2 (``input_values``), Whisper (``input_features`` + decoder ids), a bare Llama layer
(rotary embeddings) and Bloom block (alibi and mask), with no ``example_inputs``. A model the
trace cannot run, or where it finds nothing to pair, gets the per-layer fallback
(`tpkit.sources.fallback`), named in the plan's notes. Each split is checked against the unsharded
model at tp=2: every output tensor and every gradient within 1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

TOL = 1e-5


def vit():
    import transformers as T

    config = T.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
        num_labels=10,
    )
    return T.ViTForImageClassification(config)


def clip():
    import transformers as T

    tower = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    tower["intermediate_size"] = 64
    text = {**tower, "vocab_size": 99, "max_position_embeddings": 16}
    text.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = {**tower, "image_size": 16, "patch_size": 4}
    return T.CLIPModel(T.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))


def resnet():
    import transformers as T

    config = T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10)
    return T.ResNetForImageClassification(config)


def convnext():
    import transformers as T

    config = T.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10)
    return T.ConvNextForImageClassification(config)


def wav2vec2():
    import transformers as T

    config = T.Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(8, 8),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        vocab_size=20,
        do_stable_layer_norm=True,
        feat_extract_norm="layer",
    )
    return T.Wav2Vec2ForCTC(config)


def whisper():
    import transformers as T

    config = T.WhisperConfig(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=99,
        num_mel_bins=8,
        max_source_positions=16,
        max_target_positions=16,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return T.WhisperForConditionalGeneration(config)


def llama_layer():
    import transformers as T
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = T.LlamaConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64
    )
    return LlamaDecoderLayer(config, 0)


def bloom_block():
    import transformers as T
    from transformers.models.bloom.modeling_bloom import BloomBlock

    return BloomBlock(T.BloomConfig(hidden_size=32, n_head=4))


def conv_seq():
    """The old package's convolution cases: nothing tpkit's dataflow pairs."""
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))


def bag_seq():
    """An EmbeddingBag first: the trace used to feed it the first Linear's 3-D input."""
    return nn.Sequential(nn.EmbeddingBag(100, 16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def conv_net(dims: int, bias: bool) -> nn.Sequential:
    """Convolutions the fallback splits by output channels (6, then 5: uneven at tp=2), a
    grouped one too (rows padded to whole groups), then a Linear."""
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    return nn.Sequential(
        conv(3, 6, 3, bias=bias),
        nn.ReLU(),
        conv(6, 6, 1, groups=2, bias=bias),
        conv(6, 5, 3, padding=1, bias=bias),
        nn.Flatten(),
        nn.Linear(5 * 3**dims, 4),
    )


class Normed(nn.Linear):
    """Its own forward reads the whole weight (its norm): a shard would give other numbers."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight / self.weight.norm(), self.bias)


class Untraceable(nn.Module):
    """A forward whose input (a dict of tensors) no made-up input can match: the fallback."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.fc = nn.Linear(16, 12)
        self.normed = Normed(12, 12)  # overrides forward: stays whole
        self.tiny = nn.Linear(12, 3)  # 1.5 features per rank: stays whole

    def forward(self, batch):
        return self.tiny(self.normed(torch.relu(self.fc(self.emb(batch["ids"])))))


MODELS = {
    "vit": vit,
    "clip": clip,
    "resnet": resnet,
    "convnext": convnext,
    "wav2vec2": wav2vec2,
    "whisper": whisper,
    "llama_layer": llama_layer,
    "bloom_block": bloom_block,
    "conv_seq": conv_seq,
    "bag_seq": bag_seq,
    "untraceable": Untraceable,
}
CONVS = [f"conv{d}d_{'bias' if b else 'nobias'}" for d in (1, 2, 3) for b in (True, False)]
MODELS.update({n: (lambda n=n: conv_net(int(n[4]), n.endswith("_bias"))) for n in CONVS})


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().float().eval()


def _inputs(name: str) -> tuple[tuple, dict]:
    """Real inputs, as a user would call the model (not the trace's made-up ones)."""
    g = torch.Generator().manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    ids = lambda vocab, *shape: torch.randint(1, vocab, shape, generator=g)  # noqa: E731
    if name in ("vit", "convnext"):
        return (), {"pixel_values": rand(2, 3, 16 if name == "vit" else 32, 16)}
    if name == "resnet":
        return (), {"pixel_values": rand(2, 3, 32, 32)}
    if name == "clip":
        return (), {"input_ids": ids(99, 2, 7), "pixel_values": rand(2, 3, 16, 16)}
    if name == "wav2vec2":
        return (), {"input_values": rand(2, 400)}
    if name == "whisper":
        return (), {"input_features": rand(2, 8, 32), "decoder_input_ids": ids(99, 2, 5)}
    if name == "llama_layer":
        return (rand(2, 5, 32),), {"position_embeddings": (rand(2, 5, 8), rand(2, 5, 8))}
    if name == "bloom_block":
        mask = torch.triu(torch.full((5, 5), -1e4), 1).expand(2, 1, 5, 5)
        return (rand(2, 5, 32), rand(8, 1, 5), mask), {}
    if name == "conv_seq":
        return (rand(2, 3, 8, 8),), {}
    if name in CONVS:
        return (rand(2, 3, *[5] * int(name[4])),), {}
    if name == "bag_seq":
        return (ids(100, 2, 6),), {}
    batch = ids(50, 2, 6)
    batch[0, 0] = 0  # the padding row
    return ({"ids": batch},), {}


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def parity(name: str) -> dict:
    """Run on every rank: ``tensor_parallel`` with no ``example_inputs`` vs the unsharded
    model; max |diff| over every floating output and every gradient, what was split, notes."""
    import tpkit
    from tpkit.state import tp_state

    ref = _build(name)
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    args, kwargs = _inputs(name)
    outs = []
    for m in (ref, model):
        got = _tensors(m(*args, **kwargs))
        got = got[:1] if name in BLOCKS else got  # a block's attention weights are per rank
        g = torch.Generator().manual_seed(2)
        loss = sum((t * torch.randn(t.shape, generator=g)).sum() for t in got)
        loss.backward()
        outs.append([t.detach() for t in got])
    assert len(outs[0]) == len(outs[1])
    out = max((a - b).abs().max().item() for a, b in zip(*outs, strict=True))
    want = dict(ref.named_parameters())
    grad, scale, worst, missing = 0.0, 0.0, "", []
    for n, p in model.named_parameters():
        if (p.grad is None) != (want[n].grad is None):
            missing.append(n)
        elif p.grad is not None:
            full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            diff = (full - want[n].grad).abs().max().item()
            worst = n if diff > grad else worst
            grad, scale = max(grad, diff), max(scale, want[n].grad.abs().max().item())
    split = sorted(
        n
        for n, p in model.named_parameters()
        if hasattr(p, "placements") and p.placements[0].is_shard()
    )
    plan = tp_state(model).plan
    return {
        "out": out,
        "grad": grad,
        "grad_scale": scale,
        "worst": worst,
        "missing": missing,
        "split": split,
        "notes": plan.notes,
    }


BLOCKS = ("llama_layer", "bloom_block")
TRACED = ["vit", "clip", "resnet", "convnext", "wav2vec2", "whisper", "llama_layer", "bloom_block"]


@pytest.mark.parametrize("name", TRACED)
def test_traced_without_example_inputs(name):
    """The trace runs on inputs made up from the model (no fallback because of a failed
    trace), and the derived plan splits something."""
    from tpkit.plan.checks import validate
    from tpkit.plan.derive import derive_plan
    from tpkit.sources.fallback import splits_anything

    model = _build(name)
    plan = derive_plan(model, "auto", 2)
    validate(model, plan, 2)
    assert splits_anything(model, plan)
    assert not any("could not be traced" in note for note in plan.notes.values()), plan.notes


def test_made_up_inputs():
    """The inputs each model is traced with: both CLIP towers, Whisper's 3000-frame rule
    (positions x stride), Wav2Vec2's waveform long enough for its extractor, a Bloom block's
    alibi [b * heads, 1, s], a Llama layer's (cos, sin)."""
    from tpkit.trace.fake import TRACE_BATCH as B
    from tpkit.trace.fake import TRACE_SEQ as S
    from tpkit.trace.fake import example_inputs

    _, kw = example_inputs(_build("clip"))
    assert kw["input_ids"].shape == (B, S) and kw["pixel_values"].shape == (B, 3, 16, 16)
    _, kw = example_inputs(_build("whisper"))
    assert kw["input_features"].shape == (B, 8, 32) and kw["decoder_input_ids"].shape == (B, S)
    _, kw = example_inputs(_build("wav2vec2"))
    assert kw["input_values"].shape[0] == B and kw["input_values"].shape[1] >= 10 + 5 * 2
    args, kw = example_inputs(_build("bloom_block"))
    assert args[0].shape == (B, S, 32) and kw["alibi"].shape == (B * 4, 1, S)
    args, kw = example_inputs(_build("llama_layer"))
    assert [t.shape for t in kw["position_embeddings"]] == [(B, S, 8)] * 2


def test_fallback_when_untraceable():
    """A forward the trace cannot run: every layer split on its own, the reason in the notes;
    a layer with fewer than 2 features per rank stays whole. "infer" still refuses."""
    from tpkit.plan.checks import validate
    from tpkit.plan.derive import derive_plan

    model = _build("untraceable")
    plan = derive_plan(model, "auto", 2)
    validate(model, plan, 2)
    assert plan["emb"] == "vocab_parallel" and plan["fc"] == "colwise_gather_output"
    assert "tiny" not in plan and "normed" not in plan
    assert "overrides forward" in plan.notes["normed"]
    assert plan.notes["fc"].startswith("per-layer fallback: the dataflow could not be traced (")
    assert "IndexError" in plan.notes["fc"]
    with pytest.raises(ValueError, match="Could not trace"):
        derive_plan(model, "infer", 2)


def test_fallback_when_nothing_paired():
    """Conv2d + ReLU + Flatten + Linear traces, but has no pair: each layer takes the fallback;
    a grouped convolution is gathered too."""
    from tpkit.plan.checks import validate
    from tpkit.plan.derive import derive_plan

    model = _build("conv_seq")
    plan = derive_plan(model, "auto", 2)
    assert plan["0"] == "conv_colwise_gather" and plan["3"] == "colwise_gather_output"
    assert plan.notes["3"].startswith("per-layer fallback:")
    for name in ("conv_seq", "resnet"):  # the dry run at tp=4 gathers the channels too
        model = _build(name)
        validate(model, derive_plan(model, "auto", 4), 4)
    model = _build("conv2d_bias")
    plan = derive_plan(model, "auto", 2)
    assert plan["0"] == plan["2"] == plan["3"] == "conv_colwise_gather"  # 2: grouped, padded


class ReadsWeight(nn.Module):
    """A linear whose weight its parent also reads directly: no pair, and it must stay whole."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.head = nn.Linear(8, 6)

    def forward(self, x):
        return self.head(self.fc(x) @ self.fc.weight)


def test_fallback_keeps_weights_read_outside_whole():
    from tpkit.plan.derive import derive_plan

    model = ReadsWeight()
    plan = derive_plan(model, "auto", 2)
    assert plan["head"] == "colwise_gather_output" and "fc" not in plan
    assert "read outside its forward" in plan.notes["fc"]


class TiedMaxNorm(nn.Module):
    """A table tied to the head, looked up with ``max_norm`` (each row renormalised)."""

    def __init__(self, max_norm: float | None):
        super().__init__()
        self.emb = nn.Embedding(40, 8, max_norm=max_norm)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 40, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.emb(ids))))


@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_fallback_lays_a_tied_table_out_one_way(max_norm):
    """The per-layer fallback splits a table tied between a plain Embedding and Linear by its
    rows in both, or keeps it whole in both: an Embedding that stays whole (``max_norm``) no
    longer leaves its head splitting the shared weight (validation refused the plan)."""
    from tpkit.plan.checks import validate
    from tpkit.plan.layout import param_layouts
    from tpkit.sources.fallback import fallback_plan

    model = TiedMaxNorm(max_norm)
    plan = fallback_plan(model, "test", 2)
    layouts = param_layouts(model, plan)
    assert layouts["emb.weight"][1] == layouts["head.weight"][1], layouts
    assert layouts["emb.weight"][1].sharded == (max_norm is None), plan
    validate(model, plan, 2)


def test_no_input_embeddings():
    """ResNet's get_input_embeddings raises NotImplementedError: read as 'none'."""
    from tpkit.trace.inputs import input_embeddings, output_embeddings

    model = _build("resnet")
    assert input_embeddings(model) is None and output_embeddings(model) is None
    assert isinstance(input_embeddings(_build("whisper")), nn.Embedding)


PARITY = ["vit", "clip", "whisper", "wav2vec2", "resnet", "convnext", "llama_layer", "bloom_block"]
PARITY += ["conv_seq", "bag_seq", "untraceable", *CONVS]


@pytest.mark.parametrize("name", PARITY)
def test_parity_tp2(ranks2, name):
    results = ranks2.run(parity, name)
    for r in results:
        assert r["out"] <= TOL, r
        assert r["grad"] <= TOL * max(1.0, r["grad_scale"]), r  # float32 sums in another order
        assert not r["missing"], r
        assert r["split"], r
    notes = results[0]["notes"]
    if name in CONVS:  # the convolutions themselves split, the grouped one too
        split = results[0]["split"]
        assert {"0.weight", "2.weight", "3.weight"} <= set(split), split
    if name in ("conv_seq", "untraceable", *CONVS):
        assert any(n.startswith("per-layer fallback") for n in notes.values()), notes
