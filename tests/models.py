"""Tiny models built from configs (no downloads), and comparisons against the unsharded model.

Every rank calls the same factory with the same seed, so all ranks hold identical weights, as
tpkit requires.
"""

from __future__ import annotations

import copy

import torch
import transformers as tf
from torch import nn
from torch.distributed.tensor import DTensor

ATTN = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=101,  # odd on purpose: uneven vocab shards
    max_position_embeddings=64,
)

FACTORIES = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**ATTN)),
    "llama_tied": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**ATTN, tie_word_embeddings=True)),
    "mistral": lambda: tf.MistralForCausalLM(
        tf.MistralConfig(**{**ATTN, "num_key_value_heads": 2})
    ),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**ATTN, head_dim=16)),
    "gpt2": lambda: tf.GPT2LMHeadModel(
        tf.GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=4,
            vocab_size=101,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    ),
    "opt": lambda: tf.OPTForCausalLM(
        tf.OPTConfig(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=101,
            word_embed_proj_dim=64,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            pad_token_id=1,
            bos_token_id=2,
            eos_token_id=2,
        )
    ),
    "t5": lambda: tf.T5ForConditionalGeneration(
        tf.T5Config(
            d_model=64,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            d_kv=16,
            vocab_size=101,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    ),
    "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(
        tf.Qwen3MoeConfig(
            **ATTN, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
        )
    ),
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return FACTORIES[name]().float().eval()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def batch(vocab: int, shape=(2, 9), seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=g)


def pair(name: str, **tp_kwargs):
    """(reference, tensor-parallel copy) of the same freshly built model."""
    import tpkit

    ref = build(name)
    return ref, tpkit.tensor_parallel(copy.deepcopy(ref), **tp_kwargs)


def forward_backward_diffs(ref: nn.Module, model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """Max-abs differences of logits, loss and every parameter gradient vs the reference."""
    out_r = ref(input_ids=x, labels=x)
    out_r.loss.backward()
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    ref_params = dict(ref.named_parameters())
    grad = 0.0
    for n, p in model.named_parameters():
        grad = max(grad, (full(p.grad) - ref_params[n].grad).abs().max().item())
    return {
        "logits": (out.logits - out_r.logits).abs().max().item(),
        "loss": abs(out.loss.item() - out_r.loss.item()),
        "grad": grad,
    }
