"""Inferred plans: parity with the unsharded model on architectures that ship no TP plan."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as tf
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from tests.models import build as build_planned
from tests.models import forward_backward_diffs, full
from tpkit.plan import Plan, derive_plan, hf_plan, infer_plan, validate
from tpkit.trace.trace import blocks as _blocks

TOL = 1e-5
V = 101  # odd vocabulary: uneven vocab shards

FACTORIES = {
    "gpt2": lambda: tf.GPT2LMHeadModel(
        tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=V, n_positions=16)
    ),
    "opt": lambda: tf.OPTForCausalLM(
        tf.OPTConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=128,
            vocab_size=V,
            max_position_embeddings=16,
            word_embed_proj_dim=64,
        )
    ),
    "bloom": lambda: tf.BloomForCausalLM(
        tf.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=V)
    ),
    "falcon": lambda: tf.FalconForCausalLM(
        tf.FalconConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            new_decoder_architecture=True,
            vocab_size=V,
        )
    ),
    "gpt_neox": lambda: tf.GPTNeoXForCausalLM(
        tf.GPTNeoXConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=V,
            max_position_embeddings=16,
        )
    ),
    "gpt_neo": lambda: tf.GPTNeoForCausalLM(
        tf.GPTNeoConfig(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            vocab_size=V,
            max_position_embeddings=16,
            window_size=4,
        )
    ),
    "bert": lambda: tf.BertForMaskedLM(
        tf.BertConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=V,
            max_position_embeddings=16,
        )
    ),
    "roberta": lambda: tf.RobertaForMaskedLM(
        tf.RobertaConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=V,
            max_position_embeddings=16,
            pad_token_id=1,
        )
    ),
    "t5": lambda: tf.T5ForConditionalGeneration(
        tf.T5Config(
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            vocab_size=V,
            decoder_start_token_id=0,
        )
    ),
    "bart": lambda: tf.BartForConditionalGeneration(
        tf.BartConfig(
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            vocab_size=V,
            max_position_embeddings=16,
        )
    ),
}
SEQ2SEQ = {"t5", "bart"}


class MyAttention(nn.Module):
    """A user's own attention: fused qkv chunked in 3, heads read from ``self.num_heads``."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.embed_dim = heads, dim // heads, dim
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, self.embed_dim))


class MyBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = MyAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class MyModel(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(MyBlock(dim, heads) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


PLAIN = {
    "mlp": lambda: nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)),
    "my_attention": MyModel,
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {**FACTORIES, **PLAIN}[name]().float().eval()


# ---- checks (run on every rank) --------------------------------------------------------------
def _sharded_share(model: nn.Module) -> float:
    """Share of parameters outside norms and biases (all 1-D) that are sharded."""
    total = sharded = 0
    for p in model.parameters():
        if p.ndim < 2:
            continue
        total += p.numel()
        if isinstance(p, DTensor) and p.placements[0] != Replicate():
            sharded += p.numel()
    return sharded / total


def _count_block_collectives(model: nn.Module, run) -> dict[str, int]:
    """Collectives issued inside each repeated block during ``run()`` (all-gathers count as one
    all-reduce-equivalent each)."""
    counts: dict[str, int] = {}
    current: list[str] = []
    names = dict(_blocks(model)) or {"model": model}  # no repeated block: the model is one
    hooks = []
    for name, block in names.items():
        hooks.append(block.register_forward_pre_hook(lambda m, a, n=name: current.append(n)))
        hooks.append(block.register_forward_hook(lambda m, a, o: current.pop() and None))
    real = {k: getattr(dist, k) for k in ("all_reduce", "all_gather")}

    def counting(fn):
        def wrapper(*args, **kwargs):
            if current:
                counts[current[-1]] = counts.get(current[-1], 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    try:
        for k, fn in real.items():
            setattr(dist, k, counting(fn))
        with torch.no_grad():
            run()
    finally:
        for k, fn in real.items():
            setattr(dist, k, fn)
        for h in hooks:
            h.remove()
    return counts


def check_inferred(name: str) -> dict:
    import tpkit

    ref = build(name)
    model = tpkit.tensor_parallel(copy.deepcopy(ref), plan="infer")
    plan = model._tpkit.plan
    out: dict = {
        "sources": sorted({plan.source(p) for p in plan}),
        "not_dtensor": [n for n, p in model.named_parameters() if not isinstance(p, DTensor)],
        "share": _sharded_share(model),
    }
    if name in PLAIN:
        g = torch.Generator().manual_seed(1)
        width = 16 if name == "mlp" else 32
        x = torch.randn(2, 5, width, generator=g)
        y_r, y = ref(x), model(x)
        y_r.pow(2).sum().backward()
        y.pow(2).sum().backward()
        ref_params = dict(ref.named_parameters())
        grad = max(
            (full(p.grad) - ref_params[n].grad).abs().max().item()
            for n, p in model.named_parameters()
        )
        out.update(logits=(y - y_r).abs().max().item(), loss=0.0, grad=grad)
        out["per_block"] = _count_block_collectives(model, lambda: model(x))
        return out
    g = torch.Generator().manual_seed(1)
    x = torch.randint(2, V, (2, 9), generator=g)
    out.update(forward_backward_diffs(ref, model, x))
    out["per_block"] = _count_block_collectives(model, lambda: model(input_ids=x, labels=x))
    return out


# ---- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [*FACTORIES, *PLAIN])
def test_inferred_plan_matches_unsharded_model(ranks2, name):
    r = ranks2.run(check_inferred, name)[0]
    assert r["sources"] == ["inferred"], r["sources"]
    assert r["not_dtensor"] == []
    assert r["logits"] <= TOL and r["loss"] <= TOL and r["grad"] <= TOL, r
    assert r["share"] >= 0.9, f"only {r['share']:.1%} of non-norm, non-bias parameters sharded"
    # Megatron's bound: one all-reduce per residual sublayer, so 2 per block, and 3 in a
    # decoder block that also cross-attends.
    limit = 3 if name in SEQ2SEQ else 2
    assert r["per_block"] and max(r["per_block"].values()) <= limit, r["per_block"]


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
def test_inferred_plan_agrees_with_transformers_plan(name):
    model = build_planned(name)
    theirs, ours = hf_plan(model), infer_plan(model)
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            t, o = theirs.style_for(mod_name), ours.style_for(mod_name)
            assert (t and t[0]) == (o and o[0]), (mod_name, t, o)


def test_qwen3_per_head_norms_get_their_gradient_all_reduced():
    plan = infer_plan(build_planned("qwen3"))
    assert plan.style_for("model.layers.0.self_attn.q_norm")[0] == "replicated_with_grad_allreduce"


def test_packed_qkv_and_head_fixups_for_gpt2():
    plan = infer_plan(build("gpt2"))
    assert plan["transformer.h.*.attn.c_attn"] == "packed_qkv_colwise"
    assert plan["transformer.h.*.attn.c_proj"] == "rowwise"
    assert plan["transformer.h.*.mlp.c_fc"] == "colwise"
    assert plan["transformer.wte"] == "vocab_parallel"
    assert set(plan.fixups["transformer.h.*.attn"]["divide"]) >= {"num_heads", "split_size"}


def test_interleaved_qkv_is_plain_colwise_and_alibi_is_sliced():
    plan = infer_plan(build("bloom"))
    assert plan["transformer.h.*.self_attention.query_key_value"] == "colwise"
    assert plan.fixups["transformer.h.*.self_attention"]["head_inputs"] == {"kw:alibi": 0}


def test_t5_relative_bias_is_split_by_heads():
    plan = infer_plan(build("t5"))
    name = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias"
    assert plan.style_for(name)[0] == "colwise_embedding"


def test_falcon_multi_query_is_gathered_with_a_note():
    """One KV head packed after the query heads, cut unevenly by the code: the pair keeps its
    weights split, its output gathered (`tpkit.settle.gathered`); the MLP stays split."""
    torch.manual_seed(0)
    model = tf.FalconForCausalLM(
        tf.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=V)
    )
    plan = infer_plan(model)
    qkv = "transformer.h.0.self_attention.query_key_value"
    assert plan.style_for(qkv)[0] == "colwise_gather_output"
    assert plan.style_for("transformer.h.0.self_attention.dense")[0] == "rowwise_split_input"
    assert "gathered" in plan.notes["transformer.h.*.self_attention.query_key_value"]
    assert plan.style_for("transformer.h.0.mlp.dense_4h_to_h")[0] == "rowwise"


def test_pairs_tp_does_not_divide_stay_replicated_with_a_note():
    model = MyModel(dim=48, heads=3)
    plan = derive_plan(model, "auto", 2)  # 3 heads at tp=2: the attention pair falls back
    validate(model, plan, 2)  # ... so the plan is valid, and the MLP stays split
    assert plan.style_for("blocks.0.attn.qkv")[0] == "replicate"
    assert "does not divide" in plan.notes["blocks.*.attn.qkv"]
    assert plan.style_for("blocks.0.mlp.0")[0] == "colwise"


def test_user_plan_overrides_inference_entry_by_entry():
    model = build("gpt2")
    plan = derive_plan(model, {"transformer.h.*.mlp.c_fc": "replicate"})
    assert plan["transformer.h.*.mlp.c_fc"] == "replicate"
    assert plan.source("transformer.h.*.mlp.c_fc") == "user"
    assert plan["transformer.h.*.attn.c_attn"] == "packed_qkv_colwise"


def test_plan_yaml_round_trip_keeps_fixups():
    plan = infer_plan(build("gpt2"))
    back = Plan.from_yaml(plan.to_yaml())
    assert back.to_dict() == plan.to_dict() and back.fixups == plan.fixups


@pytest.mark.parametrize("name", ["gpt2", "bloom", "falcon", "t5", "bert"])
def test_shipped_yaml_plans_name_real_modules(name):
    from pathlib import Path

    path = Path(__file__).parents[1] / "configs" / f"{name}.yaml"
    model = build(name)
    plan = derive_plan(model, str(path))
    validate(model, plan, 2)  # raises on a pattern that matches nothing
    assert plan.fixups, "the YAML carries the head-count fix-ups"
    assert {plan.source(p) for p in Plan.from_yaml(path)} == {"user"}


def test_cli_plan_explains_an_inferred_plan(tmp_path, capsys):
    from tpkit.cli.main import main

    tf.GPT2Config(n_embd=48, n_layer=2, n_head=3, vocab_size=V, n_positions=16).save_pretrained(
        tmp_path
    )
    assert main(["plan", str(tmp_path), "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "inferred" in out and "mlp.c_fc" in out
    assert "tp_size=2 does not divide transformer.h.*.attn.num_heads = 3" in out


def test_a_models_own_conv_subclass_is_not_read_as_experts():
    """Pure: a leaf whose weight is 3-D is read as experts (JetMoE's ``ParallelExperts``) unless
    it is a convolution. Moonshine-Streaming's causal conv stem subclasses ``nn.Conv1d`` in
    transformers' own module: it was read as experts, split by a linear style, and the tp=2
    forward failed adding its bias on the time dim."""
    from torch import nn

    from tests.tiny_family import build_family
    from tpkit.plan import derive_plan
    from tpkit.plan.layout import kind_of

    class CausalConv1d(nn.Conv1d):
        pass

    CausalConv1d.__module__ = "somewhere.modeling_x"
    assert kind_of(CausalConv1d(4, 8, 3)) is None
    model = build_family(
        "moonshine_streaming", "MoonshineStreamingForConditionalGeneration", device="meta"
    )
    plan = derive_plan(model, "auto", 2)
    for name in ("model.encoder.embedder.conv1", "model.encoder.embedder.conv2"):
        hit = plan.style_for(name)
        assert hit is None or hit[0].startswith("conv_"), (name, hit)
