"""Causal-LM pre-training with a plain loop on a 2D (dp x tp) mesh.

    launch/torchrun.sh --nproc 4 examples/pretrain_2d.py            # dp=2 x tp=2, FSDP2 over dp
    launch/torchrun.sh --nproc 2 examples/pretrain_2d.py --tp 2     # tp only
    launch/torchrun.sh --nproc 4 examples/pretrain_2d.py --sequence-parallel --loss-parallel

A tiny Llama-style model made from a config learns a synthetic language (each sequence counts up
from a random start, modulo the vocabulary), so the loss visibly falls within a minute on CPU.
What the loop shows: ranks of one TP group read the same batch, dp groups different ones; one
global gradient norm (`tpkit.clip_grad_norm_`); a reshardable DCP checkpoint at the end.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tpkit


def batch_for(step: int, dp_rank: int, dp: int, per_dp: int, seq: int, vocab: int) -> torch.Tensor:
    """This dp group's rows of the global batch of ``step`` (the same on every TP rank)."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, vocab, (per_dp * dp, 1), generator=g)
    rows = (starts + torch.arange(seq)) % vocab
    return rows[dp_rank * per_dp : (dp_rank + 1) * per_dp]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--per-dp-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--loss-parallel", action="store_true")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "tpkit-pretrain-ckpt"))
    args = parser.parse_args()

    env = tpkit.init_distributed()
    torch.manual_seed(0)  # same initial weights on every rank
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=128,
    )
    model = tpkit.tensor_parallel(
        LlamaForCausalLM(config),
        tp_size=args.tp,
        sequence_parallel=args.sequence_parallel,
        loss_parallel=args.loss_parallel,
    ).train()
    state = model._tpkit
    dp_mesh = tpkit.get_mesh(state.mesh, "dp")  # None when dp = 1
    dp_rank, dp = (dp_mesh.get_local_rank() if dp_mesh is not None else 0), state.dp_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    for step in range(args.steps):
        x = batch_for(step, dp_rank, dp, args.per_dp_batch, args.seq, config.vocab_size)
        optimizer.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        norm = tpkit.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            if env.rank == 0:
                print(
                    f"step {step:3d}  loss {mean.item() / env.world_size:.4f}  "
                    f"grad-norm {norm.item():.3f}  (dp={dp} x tp={state.tp_size})"
                )
    tpkit.save_checkpoint(args.out, model, optimizer, step=args.steps)
    if env.rank == 0:
        print(f"checkpoint: {args.out} (reshardable: tpkit.load_checkpoint at any dp x tp)")


if __name__ == "__main__":
    main()
