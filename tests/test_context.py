"""Context parallelism: a 256-token batch split over cp ranks matches one process on the whole
sequence (loss, logits and every gradient), and each rank's attention sees only its queries."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from tests.models import full

T = 256
REL = 1e-5


def cp_model(name: str, attn: str = "sdpa"):
    """Tiny models for CP: GQA Llama, Qwen3 with a sliding-window layer, MQA Llama, GPT-2
    (learned positions), Falcon (ALiBi), BERT (encoder, bidirectional)."""
    torch.manual_seed(0)
    common = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=101, max_position_embeddings=512,
    )  # fmt: skip
    if name in ("llama", "llama_mqa"):
        kv = 1 if name == "llama_mqa" else 2
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**common, "num_key_value_heads": kv}))
    elif name == "qwen3":
        cfg = tf.Qwen3Config(
            **common, head_dim=16, use_sliding_window=True, sliding_window=48,
            max_window_layers=1, layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
        model = tf.Qwen3ForCausalLM(cfg)
    elif name == "gpt2":
        cfg = tf.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=512, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM",
        )  # fmt: skip
        model = tf.GPT2LMHeadModel(cfg)
    elif name == "falcon":
        cfg = tf.FalconConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=101,
            alibi=True, new_decoder_architecture=False, multi_query=False, parallel_attn=False,
            bias=True, hidden_dropout=0.0, attention_dropout=0.0,
        )  # fmt: skip
        model = tf.FalconForCausalLM(cfg)
    else:
        cfg = tf.BertConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=101, max_position_embeddings=512, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        model = tf.BertForMaskedLM(cfg)
    model.set_attn_implementation(attn)
    return model.float()


def cp_batch(name: str, length: int = T):
    """Two rows; the second right-padded by 37 tokens (labels -100 there); BERT masks 70% of its
    targets as a masked LM does."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, -37:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if name == "bert":
        labels = labels.masked_fill(torch.rand(2, length, generator=g) > 0.3, -100)
    return ids, mask, labels


def _mesh(cp: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (cp, tp), mesh_dim_names=("dp", "tp"))


def check_parity(name: str, attention: str, tp: int = 1, attn: str = "sdpa") -> dict:
    """Loss, logits and every gradient of a cp (x tp) split against one process."""
    import tpkit
    from tpkit.parallel.context import average_over_cp, context_parallel

    cp = dist.get_world_size() // tp
    ref = cp_model(name, attn)
    model = copy.deepcopy(ref)
    mesh = _mesh(cp, tp)
    if tp > 1:
        model = tpkit.tensor_parallel(model, mesh=mesh, sharded=False)
    ctx = context_parallel(model, mesh["dp"], attention=attention)
    ids, mask, labels = cp_batch(name)
    out_r = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out_r.loss.backward()
    queries = []
    for m in model.modules():
        if type(m).__name__.endswith("Attention"):
            m.register_forward_pre_hook(
                lambda m, a, k: queries.append((a[0] if a else k["hidden_states"]).shape[1]),
                with_kwargs=True,
            )
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    average_over_cp(model, mesh["dp"].get_group())
    logits = ctx.gather(full(out.logits))
    grad_rel = grad_abs = 0.0
    refs = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        g, r = full(p.grad), refs[n].grad
        grad_abs = max(grad_abs, (g - r).abs().max().item())
        grad_rel = max(grad_rel, ((g - r).norm() / r.norm().clamp(min=1e-6)).item())
    return {
        "loss_rel": abs(out.loss.item() - out_r.loss.item()) / out_r.loss.item(),
        "logits": (logits - out_r.logits)[mask.bool()].abs().max().item(),
        "grad_rel": grad_rel,
        "grad_abs": grad_abs,
        "queries": sorted(set(queries)),
        "local": T // cp,
    }


CP2 = [
    ("llama", "allgather", "sdpa"),
    ("llama", "ring", "sdpa"),
    ("llama", "ulysses", "sdpa"),
    ("llama", "allgather", "eager"),
    ("llama", "ring", "eager"),
    ("llama_mqa", "ring", "sdpa"),
    ("qwen3", "allgather", "sdpa"),
    ("qwen3", "ring", "sdpa"),
    ("qwen3", "ulysses", "eager"),
    ("gpt2", "ring", "sdpa"),
    ("falcon", "auto", "eager"),
    ("bert", "allgather", "sdpa"),
    ("bert", "ring", "sdpa"),
]


def _assert_parity(r: dict) -> None:
    assert r["queries"] == [r["local"]], r  # measured: each attention saw T/cp queries
    assert r["loss_rel"] <= REL, r
    assert r["logits"] <= 1e-5, r
    assert r["grad_rel"] <= REL and r["grad_abs"] <= 1e-5, r


@pytest.mark.parametrize(("name", "attention", "attn"), CP2)
def test_cp2_matches_one_process(ranks2, name, attention, attn):
    for r in ranks2.run(check_parity, name, attention, 1, attn):
        _assert_parity(r)


CP2_TP2 = [
    ("llama", "allgather"),
    ("llama", "ring"),
    ("qwen3", "ring"),
    ("gpt2", "allgather"),
    ("bert", "allgather"),
]


@pytest.mark.parametrize(("name", "attention"), CP2_TP2)
def test_cp2_tp2_matches_one_process(ranks4, name, attention):
    for r in ranks4.run(check_parity, name, attention, 2):
        _assert_parity(r)
