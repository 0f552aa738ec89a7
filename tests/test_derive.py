"""plan="auto" checks transformers' plan before trusting it, and inference copes with the
architectures the coverage report found hard (tiny models from `benchmarks.coverage`'s shrinker,
built from each architecture's default config)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from torch.distributed.tensor import DTensor, Replicate

from tests.models import full
from tests.tiny import build as build_tiny
from tests.tiny import inputs
from tpkit.plan import Plan, derive_plan, hf_plan, infer_plan, param_layouts, validate

TOL = 1e-5

# model_type -> (class, share of 2-D parameters the plan must shard, what makes it hard)
HARD = {
    "doge": ("DogeForCausalLM", 0.6, "transformers' plan fails a dry run: dt_proj rowwise"),
    "diffllama": ("DiffLlamaForCausalLM", 0.6, "transformers' plan names only the embedding"),
    # the tiny model is mostly attention, whose relative logits need r_proj whole; the routed
    # experts and the shared ones (3-D weights applied with bmm, recognised by their shapes)
    # split by inference (transformers 5.24's plan named them, 5.25's does not)
    "inkling_text": (
        "InklingForCausalLM",
        0.05,
        "fused experts; embed_norm inside the embedding; relative logits",
    ),
    "longcat_flash": ("LongcatFlashForCausalLM", 0.9, "moe_identity_expert, MLA"),
    # fused experts whose subclass normalises each route's output inside the module (a
    # per-expert RMSNorm): split, the norm read partial sums (logits off by 0.1); then whole;
    # now split with the norm's input all-reduced first (moe_reduced_input)
    "ergo": ("ErgoForCausalLM", 0.99, "a norm with parameters inside fused experts"),
    # its ALiBi table [heads, 1, max_seq_len] enters each block as wide as the stream (tiny: 64
    # and 64; default: 2048 and 2048): read as the stream, it left attention whole (69% sharded)
    "mpt": ("MptForCausalLM", 0.99, "a per-head block input as wide as the stream"),
    # attention that merges heads to a width read off its input (merge_heads fix-up)
    "trocr": ("TrOCRForCausalLM", 0.9, "bsz, tgt_len, embed_dim = hidden_states.size()"),
    # one lightning-attention layer: per-head buffers made at init (head_buffers fix-up)
    "minimax": ("MiniMaxForCausalLM", 0.9, "per-head slopes and decays"),
    # a position table (an nn.Embedding) broadcast over the heads of q and k: kept whole on
    # every rank like q_norm, not a column of the attention's output linear
    "roformer": ("RoFormerForCausalLM", 0.9, "rotary table looked up by an nn.Embedding"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", 0.9, "fused experts traced on meta in float32"),
    # transformers' plan names only the embedding; inferred: per-head attention sinks, fused
    # experts stored transposed, gate|up interleaved, with biases (the down bias enters / tp)
    "gpt_oss": ("GptOssForCausalLM", 0.9, "sinks, transposed interleaved experts with biases"),
    # transformers' plan leaves the xIELU activation's scalars (on split activations) unnamed
    "apertus": ("ApertusForCausalLM", 0.9, "parameterised activation between colwise and rowwise"),
    # the short convolution: in_proj's B, C, x parts colwise, the depthwise conv per channel
    # (its weight read by causal_conv1d_fn, unseen by the trace); it stayed whole before
    "lfm2_moe": ("Lfm2MoeForCausalLM", 0.99, "a short conv read through its weight"),
    # per-layer configs refuse global reads of head counts; MLA's rope width is per layer
    "dots3_note_text": ("Dots3NoteForCausalLM", 0.5, "heterogeneous per-layer config, MLA"),
}


def _meta_qwen3(heads: int, kv_heads: int):
    """A one-layer Qwen3 on the meta device with ``heads`` heads of 16."""
    config = tf.Qwen3Config(
        hidden_size=16 * heads,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=101,
    )
    with torch.device("meta"):
        return tf.Qwen3ForCausalLM(config)


def check_parity(model_type: str) -> dict:
    """tp=2 plan="auto" vs the unsharded model: logits, loss and every gradient."""
    import tpkit

    ref = build_tiny(model_type, HARD[model_type][0]).train()
    ref.config.use_cache = False
    for m in ref.modules():  # training mode without dropout: masks are drawn per shape
        for attr in ("dropout", "activation_dropout", "attention_dropout"):
            if isinstance(m.__dict__.get(attr), float):
                setattr(m, attr, 0.0)
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    x = inputs(ref, "causal-lm")["input_ids"]
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    plan = model._tpkit.plan
    out_r = ref(input_ids=x, labels=x)
    out_r.loss.backward()
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    ref_params = dict(ref.named_parameters())
    grad = max(
        (full(p.grad) - ref_params[n].grad).abs().max().item()
        for n, p in model.named_parameters()
        if p.grad is not None
    )
    sharded = sum(
        p.numel()
        for p in model.parameters()
        if isinstance(p, DTensor) and p.placements[0] != Replicate() and p.ndim >= 2
    )
    return {
        "sources": sorted({plan.source(p) for p in plan}),
        "logits": (out.logits - out_r.logits).abs().max().item(),
        "loss": abs(out.loss.item() - out_r.loss.item()),
        "grad": grad,
        "sharded": sharded / sum(p.numel() for p in model.parameters() if p.ndim >= 2),
        "note": plan.notes.get(type(model).__name__, ""),
        "expert_note": plan.notes.get("model.layers.*.mlp.experts", ""),
    }


@pytest.mark.parametrize("model_type", list(HARD))
def test_hard_architectures_match_the_unsharded_model(ranks2, model_type):
    r = ranks2.run(check_parity, model_type, timeout=180)[0]
    assert r["logits"] <= TOL and r["loss"] <= TOL and r["grad"] <= TOL, r
    assert r["sharded"] >= HARD[model_type][1], f"{r['sharded']:.1%} of 2-D params sharded: {r}"
    not_used = "base_model_tp_plan is not used" in r["note"]
    if model_type in ("doge", "diffllama", "gpt_oss"):
        assert r["sources"] == ["inferred"] and not_used, r
    elif model_type in ("ergo", "mpt", "trocr", "roformer"):  # no shipped plan
        assert r["sources"] == ["inferred"], r
        assert model_type != "ergo" or not r["expert_note"], r  # experts split (moe_reduced_input)
    elif model_type in ("inkling_text", "lfm2_moe"):
        # their shipped plans changed in transformers 5.25 (LFM2-MoE's now names attention,
        # Inkling's MLP entries match no module): kept, or replaced with the reason said
        assert ("config" in r["sources"]) != not_used, r
    else:
        assert "config" in r["sources"] and not not_used, r


def test_auto_keeps_transformers_plan_when_it_runs_and_config_forces_it():
    doge = build_tiny("doge", "DogeForCausalLM", device="meta")
    auto = derive_plan(doge)
    assert "dry run" in auto.notes["DogeForCausalLM"]
    forced = derive_plan(doge, "config")
    assert forced.style_for("model.layers.0.self_attn.dt_proj")[0] == "rowwise"
    llama = build_tiny("llama", "LlamaForCausalLM", device="meta")
    assert dict(derive_plan(llama)) == dict(hf_plan(llama))


def test_heads_cut_into_groups_are_gathered_with_a_note():
    """DiffLlama pairs head i with head i + H/2: contiguous head shards would pair others, so
    its attention runs on whole heads, its weights split and its outputs gathered."""
    plan = infer_plan(build_tiny("diffllama", "DiffLlamaForCausalLM", device="meta"))
    assert plan.style_for("model.layers.0.self_attn.v_proj")[0] == "colwise_gather_output"
    assert plan.style_for("model.layers.0.self_attn.o_proj")[0] == "rowwise_split_input"
    assert "cut into groups" in plan.notes["model.layers.*.self_attn.v_proj"]
    assert plan.style_for("model.layers.0.mlp.down_proj")[0] == "rowwise"


def test_fused_expert_gate_up_named_colwise_is_packed():
    """transformers 5.24 shipped Inkling's concatenated [gate; up] experts as plain 'colwise'
    (rank 0 would get only gate rows); the plan is set here so the check outlives the release."""
    model = build_tiny("inkling_text", "InklingForCausalLM", device="meta")
    model.config.base_model_tp_plan = {
        "layers.*.mlp.experts.gate_up_proj": "colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
    }
    plan = hf_plan(model)
    assert plan.style_for("model.layers.0.mlp.experts.gate_up_proj")[0] == "packed_colwise"
    model.model.layers[0].mlp.experts.is_concatenated = False  # interleaved: colwise is right
    plan = hf_plan(model)
    assert plan.style_for("model.layers.0.mlp.experts.gate_up_proj")[0] == "colwise"


def test_fused_moe_experts_trace_on_meta_in_float32():
    model = build_tiny("qwen3_moe", "Qwen3MoeForCausalLM", device="meta")
    assert model.config._experts_implementation == "grouped_mm"
    plan = infer_plan(model)  # grouped_mm's meta kernel takes only bfloat16
    assert plan.style_for("model.layers.0.self_attn.o_proj")[0] == "rowwise"
    assert model.config._experts_implementation == "grouped_mm"  # restored
    assert torch.get_default_dtype() == torch.float32


def test_parameters_inside_a_vocab_parallel_embedding_stay_plainly_replicated():
    """Inkling normalises inside its embedding's forward: the style looks the rows up whole
    before that code runs, so embed_norm sees every token on every rank and its gradient is
    whole (summing it would multiply it by tp)."""
    plan = derive_plan(build_tiny("inkling_text", "InklingForCausalLM", device="meta"))
    assert plan.style_for("model.embed_tokens")[0] == "vocab_parallel"
    assert plan.style_for("model.embed_tokens.embed_norm") is None


def test_musicgen_traces_with_its_codebooks_stacked_in_the_batch():
    plan = infer_plan(build_tiny("musicgen", "MusicgenForCausalLM", device="meta"))
    assert plan.style_for("model.decoder.layers.0.self_attn.q_proj")[0] == "colwise"
    assert plan.style_for("model.decoder.layers.0.fc2")[0] == "rowwise"


@pytest.mark.parametrize(
    "model_type,cls",
    [
        ("deepseek_v2", "DeepseekV2ForCausalLM"),  # MLA: KV heads = query heads
        ("mamba2", "Mamba2ForCausalLM"),  # heads x head_dim == expand x hidden
        ("zamba", "ZambaForCausalLM"),  # doubled attention width, tied shared block
        ("blt", "BltForCausalLM"),  # sub-configs held as dicts
        ("xmod", "XmodForCausalLM"),  # per-language adapters
    ],
)
def test_the_coverage_shrinker_builds_runnable_tiny_models(model_type, cls):
    model = build_tiny(model_type, cls)
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    with torch.no_grad():
        out = model(**inputs(model, "causal-lm"))
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize(
    "model_type,cls", [("qwen3_moe", "Qwen3MoeForCausalLM"), ("mixtral", "MixtralForCausalLM")]
)
def test_inferred_fused_experts_match_what_transformers_shipped(model_type, cls):
    """The styles transformers' plans named for these experts up to 5.24 (5.25 moved experts
    to its expert-parallel plan): inference alone must find them, and agree with a shipped
    plan that still names them."""
    model = build_tiny(model_type, cls, device="meta")
    inferred, shipped = infer_plan(model), hf_plan(model)
    expected = {
        "experts": "moe_tp_experts",
        "experts.gate_up_proj": "packed_colwise",
        "experts.down_proj": "rowwise",
    }
    for name, style in expected.items():
        full_name = f"model.layers.0.mlp.{name}"
        assert inferred.style_for(full_name)[0] == style, full_name
        if shipped.style_for(full_name) is not None:
            assert shipped.style_for(full_name)[0] == style, full_name
    assert derive_plan(model).style_for("model.layers.0.mlp.experts")[0] == "moe_tp_experts"


def test_transposed_experts_split_their_output_dim():
    """GPT-OSS stores gate_up as [E, hidden, 2 x inter] (is_transposed): the split is dim 2."""
    model = build_tiny("gpt_oss", "GptOssForCausalLM", device="meta")
    layouts = param_layouts(model, infer_plan(model))
    assert layouts["model.layers.0.mlp.experts.gate_up_proj"][1].dim == 2
    assert layouts["model.layers.0.mlp.experts.down_proj"][1].dim == 1
    assert layouts["model.layers.0.mlp.experts.gate_up_proj_bias"][1].dim == 1
    assert not layouts["model.layers.0.mlp.experts.down_proj_bias"][1].sharded
    assert layouts["model.layers.0.self_attn.sinks"][1].dim == 0


def test_transformers_plan_gets_grad_allreduce_for_parameters_on_split_activations():
    model = build_tiny("apertus", "ApertusForCausalLM", device="meta")
    assert hf_plan(model).style_for("model.layers.0.mlp.act_fn") is None
    plan = derive_plan(model)
    assert plan.style_for("model.layers.0.mlp.act_fn")[0] == "replicated_with_grad_allreduce"


def test_a_failing_dry_run_gathers_only_the_groups_it_must():
    """OLMo-Hybrid's gated delta rule cannot run on split projections: the linear attention's
    weights stay split with their outputs gathered (`tpkit.settle.gathered`), noted with the
    dry run's error, and the MLPs stay split as before."""
    plan = infer_plan(build_tiny("olmo_hybrid", "OlmoHybridForCausalLM", device="meta"))
    assert plan.style_for("model.layers.0.linear_attn.q_proj")[0] == "colwise_gather_output"
    assert plan.style_for("model.layers.0.linear_attn.o_proj")[0] == "rowwise_split_input"
    # q|k|v are concatenated into the short conv's channels: the trace sees the join (issue 28)
    # before the dry run fails on it
    note = plan.notes["model.layers.*.linear_attn.q_proj"]
    assert "dry run" in note or "joined with others by cat()" in note, note
    assert plan.style_for("model.layers.0.mlp.gate_proj")[0] == "colwise"
    assert plan.style_for("model.layers.1.mlp.down_proj")[0] == "rowwise"


def test_a_whole_group_takes_its_per_head_norms_along():
    """3 heads at tp=2: the attention runs on whole heads (its weights split, outputs
    gathered), and so must q_norm's gradient stay whole (an all-reduce would double it)."""
    model = _meta_qwen3(heads=3, kv_heads=3)
    plan = infer_plan(model)
    attention = [g for g in plan.groups if "model.layers.*.self_attn.o_proj" in g.modules]
    assert "model.layers.*.self_attn.q_norm" in attention[0].modules
    validate(model, plan, 2)
    # its split heads fail the tp=2 dry run: gathered, the norm sees whole heads
    assert plan.style_for("model.layers.0.self_attn.q_proj")[0] == "colwise_gather_output"
    assert plan.style_for("model.layers.0.self_attn.q_norm")[0] == "replicate"
    assert plan.style_for("model.layers.0.mlp.down_proj")[0] == "rowwise"


class _IdentityExperts(torch.nn.Module):
    """LongCat-Flash's experts up to transformers 5.24: a zero-computation expert inside."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.identity_expert = torch.nn.Identity()

    def forward(self, x):
        return self.proj(x) + self.identity_expert(x)


def test_an_identity_expert_outside_sharded_experts_is_refused():
    model = torch.nn.Sequential()
    model.add_module("experts", _IdentityExperts())
    plan = Plan.from_dict(
        {"experts.identity_expert": "moe_identity_expert", "experts": "replicate"}
    )
    with pytest.raises(ValueError, match="no module above it is moe_tp_experts"):
        validate(model, plan, 2)
    validate(
        model,
        Plan.from_dict(
            {"experts.identity_expert": "moe_identity_expert", "experts": "moe_tp_experts"}
        ),
        2,
    )


def test_transformers_plan_for_transposed_experts_keeps_its_raw_dims():
    """Aria's experts are stored [E, in, out]; its shipped plan says packed_rowwise / colwise,
    naming raw dims as every transformers plan does."""
    model = build_tiny("aria_text", "AriaTextForCausalLM", device="meta")
    plan = derive_plan(model)
    assert "config" in {plan.source(p) for p in plan}
    layouts = param_layouts(model, plan)
    gate_up = layouts["model.layers.0.mlp.experts.gate_up_proj"][1]
    assert (gate_up.dim, gate_up.split_factor) == (2, 2)
    assert layouts["model.layers.0.mlp.experts.down_proj"][1].dim == 1


def test_replicating_an_inferred_column_drops_its_norms_gradient_all_reduce():
    """Qwen3's q_norm acts per head on q_proj's split output; with q_proj replicated by the
    user, its gradient is whole on every rank and must not be summed."""
    model = _meta_qwen3(heads=4, kv_heads=2)
    q_norm = "model.layers.0.self_attn.q_norm"
    assert derive_plan(model, "infer").style_for(q_norm)[0] == "replicated_with_grad_allreduce"
    user = {"model.layers.*.self_attn.q_proj": "replicate"}
    plan = derive_plan(model, Plan().merged(infer_plan(model)).merged(user))
    assert plan.style_for(q_norm)[0] == "replicate"
    assert plan.style_for("model.layers.0.self_attn.k_norm")[0] == "replicated_with_grad_allreduce"
    # the same over transformers' plan, which names q_norm itself
    assert hf_plan(model).style_for(q_norm)[0] == "replicated_with_grad_allreduce"
    assert derive_plan(model, user).style_for(q_norm)[0] == "replicate"


def test_transformers_unit_styles_read_as_colwise_and_rowwise():
    from tpkit.plan.catalogue import canonical_style

    assert canonical_style("unit_colwise") == "colwise"
    assert canonical_style("unit_rowwise") == "rowwise"
    model = _meta_qwen3(8, 2)  # 2 KV heads: at tp=4 each is kept whole on 2 ranks
    entries = {
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "unit_colwise",
        "model.layers.*.self_attn.v_proj": "unit_colwise",
        "model.layers.*.self_attn.o_proj": "unit_rowwise",
    }
    plan = derive_plan(model, entries, 4)
    validate(model, plan, 4)
    assert plan.style_for("model.layers.0.self_attn.k_proj")[0] == "colwise_replicated_heads"
    assert plan.style_for("model.layers.0.self_attn.o_proj")[0] == "rowwise"
    with pytest.raises(ValueError, match="sequence_parallel=True"):
        canonical_style("sequence_parallel")


def test_dbrx_plans_on_meta_where_a_routed_scalar_indexes_a_large_weight():
    from tests.parity import full_size_report

    # DBRX's experts index ``w1.view(E, F, H)[expert]`` with a routed 0-d tensor: too large to
    # compute for real, the fake op gets the shadow's value (it could not be traced before).
    # Full width, 2 of its 24 identical layers: each layer indexes the same full-size weight,
    # and tracing all 24 took 7x the time (43 s of CPU) for nothing more
    r = full_size_report("DbrxForCausalLM", model_type="dbrx", n_layers=2)
    assert 0 < r["share"] < 1, r


def test_a_head_tied_to_the_embedding_that_no_accessor_names_is_gathered():
    """Pure, on meta: BLIP's text decoder head (``cls.predictions.decoder``, tied to the text
    embedding, its bias tied to ``cls.predictions.bias``) is not the model's output embedding.
    Before, inference laid its weight out vocab-parallel by a parameter entry while the module
    computed as if whole: every dry run failed, every group was kept whole, and the tied bias,
    split under one name and whole under the other, got the plan refused. Now the head computes
    with the split table (gathered), both names of its bias alike, and the towers split."""
    from tests.tiny_family import build_family
    from tpkit.plan import derive_plan
    from tpkit.plan.layout import param_styles

    model = build_family("blip", "BlipForConditionalGeneration", device="meta")
    plan = derive_plan(model, "auto", 2)
    assert plan.style_for("text_decoder.cls.predictions.decoder")[0] == "colwise_gather_output"
    styles = param_styles(model, plan)
    assert styles["text_decoder.cls.predictions.bias"][0] == "colwise_gather_output"
    assert styles["text_decoder.cls.predictions.decoder.bias"][0] == "colwise_gather_output"
    attn = "text_decoder.bert.encoder.layer.0.attention.self.query"
    assert plan.style_for(attn)[0] == "colwise"
    assert plan.style_for("vision_model.encoder.layers.0.mlp.fc1")[0] == "colwise"
