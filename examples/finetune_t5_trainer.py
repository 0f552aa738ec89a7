"""Fine-tune a tiny T5 with Hugging Face Trainer at tp=2: the FLAN-T5 notebook, on CPU, offline.

    launch/torchrun.sh --nproc 2 examples/finetune_t5_trainer.py [--steps 200] [--out runs/t5]
    launch/torchrun.sh --nproc 4 examples/finetune_t5_trainer.py --tp 2   # dp=2 x tp=2 (FSDP2)

The model is a randomly initialised T5 built from a small ``T5Config`` (no download). T5 ships no
tensor-parallel plan; tpkit infers one (q/k/v/wi column-parallel, o/wo row-parallel, the relative
attention bias split by head). The task is a toy "summary": the input is <s> and 12 random tokens,
the target is the first 4 of them, sorted. Trainer is the stock ``transformers.Trainer`` with
``ParallelismConfig(tp_size=2)``: no tpkit line beyond ``tensor_parallel`` (see
``tpkit/integrations/trainer.py`` for what tpkit adapts). The loss printed every 10 steps falls from about 3.6 to about
1.6 in 200 steps (a minute on 2 CPU cores; held-out token accuracy ~33%, chance 3%). At the end
rank 0 prints greedy ``generate`` outputs of the tensor-parallel model and checks that the
checkpoint written by ``trainer.save_model`` loads in plain transformers with the same logits.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import ParallelismConfig
from transformers import T5Config, T5ForConditionalGeneration, Trainer, TrainingArguments

import tpkit

PAD, EOS, BOS, FIRST_TOKEN, VOCAB = 0, 1, 2, 3, 32
SOURCE_LEN, SUMMARY_LEN = 12, 4


class SortFirstK(torch.utils.data.Dataset):
    """input: <s> + 12 random tokens + </s>; target: the first 4 of them, sorted, + </s>."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        body = torch.randint(FIRST_TOKEN, VOCAB, (n, SOURCE_LEN), generator=g)
        bos, eos = torch.full((n, 1), BOS), torch.full((n, 1), EOS)
        self.inputs = torch.cat([bos, body, eos], dim=1)
        self.labels = torch.cat([body[:, :SUMMARY_LEN].sort(dim=1).values, eos], dim=1)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i):
        return {
            "input_ids": self.inputs[i],
            "attention_mask": torch.ones_like(self.inputs[i]),
            "labels": self.labels[i],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32, help="per TP group (global at dp=1)")
    parser.add_argument("--tp", type=int, default=None, help="default: all ranks; dp = ranks / tp")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="runs/finetune_t5_trainer")
    args = parser.parse_args()

    torch.manual_seed(0)  # every rank builds the same weights
    config = T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=256,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=PAD,
    )
    model = T5ForConditionalGeneration(config)
    # T5 takes **kwargs but computes its own mean loss, ignoring Trainer's num_items_in_batch;
    # saying so keeps Trainer from scaling the loss by the dp size (as it would under DDP too).
    model.accepts_loss_kwargs = False
    model = tpkit.tensor_parallel(model, tp_size=args.tp)  # unchanged outside torchrun
    state = getattr(model, "_tpkit", None)
    tp, dp = (state.tp_size, state.dp_size) if state is not None else (1, 1)
    rank0 = int(os.environ.get("RANK", "0")) == 0

    training_args = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=args.lr,
        warmup_steps=10,
        lr_scheduler_type="cosine",
        weight_decay=0.01,
        max_grad_norm=1.0,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        parallelism_config=ParallelismConfig(tp_size=tp, dp_shard_size=dp) if state else None,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=SortFirstK(n=4096, seed=1))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if rank0:
        print(f"loss: {losses[0]:.3f} at step 10 -> {losses[-1]:.3f} at step {args.steps}")

    final = os.path.join(args.out, "final")
    trainer.save_model(final)  # every rank: gathers; rank 0 writes a plain checkpoint

    test = SortFirstK(n=64, seed=2)
    x = test.inputs.to(trainer.args.device)
    model.eval()
    with torch.no_grad():
        generated = model.generate(input_ids=x, max_new_tokens=SUMMARY_LEN + 1, do_sample=False)
        logits = model(input_ids=x, labels=test.labels.to(x.device)).logits
    if rank0:
        summaries = generated[:, 1 : SUMMARY_LEN + 1].cpu()
        target = test.labels[:, :SUMMARY_LEN]
        for i in range(3):
            first = test.inputs[i, 1 : SUMMARY_LEN + 1].tolist()
            print(
                f"source {first} ... target {target[i].tolist()} generated {summaries[i].tolist()}"
            )
        accuracy = (summaries == target).float().mean().item()
        print(f"held-out token accuracy {accuracy:.0%} (chance {1 / (VOCAB - FIRST_TOKEN):.0%})")

        plain = T5ForConditionalGeneration.from_pretrained(final).eval()  # no tpkit involved
        with torch.no_grad():
            plain_logits = plain(input_ids=test.inputs, labels=test.labels).logits
        diff = (plain_logits - logits.cpu()).abs().max().item()
        print(f"{final}: plain transformers vs dp={dp} x tp={tp} logits, max diff {diff:.1e}")


if __name__ == "__main__":
    main()
