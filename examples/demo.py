"""tpkit demo: a tiny Llama-style model, split over the ranks, checked against the unsharded one.

    make demo                                   # or: launch/torchrun.sh --nproc 2 examples/demo.py

Rank 0 builds the model from a config with a fixed seed and saves it with save_pretrained; every
rank loads it, keeps an unsharded copy as the reference, applies tpkit.tensor_parallel, and compares
logits and generated tokens.
"""

from __future__ import annotations

import copy
import os
import tempfile

import torch
import torch.distributed as dist
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import tpkit


def make_model(path: str) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=512,
        max_position_embeddings=128,
        initializer_range=0.2,  # livelier tokens than the default init
    )
    LlamaForCausalLM(config).save_pretrained(path)


def main() -> None:
    env = tpkit.init_distributed()
    path = os.environ.get("TPKIT_DEMO_DIR", os.path.join(tempfile.gettempdir(), "tpkit-demo-llama"))
    if env.rank != 0:
        transformers.utils.logging.disable_progress_bar()
    if env.rank == 0:
        make_model(path)
    if env.is_distributed:
        dist.barrier()

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = tpkit.tensor_parallel(copy.deepcopy(reference))

    torch.manual_seed(1)
    prompt = torch.randint(0, reference.config.vocab_size, (1, 12))
    with torch.no_grad():
        want = reference(prompt).logits
        diff = (model(prompt).logits - want).abs().max().item()
        tol = 1e-5 * max(1.0, want.abs().max().item())  # float32 sums in another order
        tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
        ref_tokens = reference.generate(prompt, max_new_tokens=8, do_sample=False)

    total = sum(p.numel() for p in reference.parameters())
    local = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()
    )
    if env.rank == 0:
        if env.is_distributed:  # the plan's summary: what each rank holds, what it sends
            report = tpkit.explain(model._tpkit.plan, reference, tp_size=env.world_size)
            print("plan:", *report.strip().splitlines()[-3:], sep="\n  ")
        print(f"generated tokens: {tokens[0, prompt.shape[1] :].tolist()}")
        print(f"same tokens as the unsharded model: {torch.equal(tokens, ref_tokens)}")
        print(
            f"summary: world={env.world_size} params per rank {local:,} of {total:,} "
            f"({local / total:.1%}); max |logits - unsharded| = {diff:.2e} "
            f"(tolerance 1e-5 x max |logits| = {tol:.1e}: {'ok' if diff <= tol else 'EXCEEDED'})"
        )
        print(
            f"next, try: .venv/bin/tpkit plan {path} --tp 4   (the full plan, no ranks), or "
            f"tpkit.tensor_parallel(your_model) in a script run with "
            f"`launch/torchrun.sh --nproc 2 script.py`"
        )


if __name__ == "__main__":
    main()
