"""The GPU check: tpkit on CUDA with NCCL, next to the unsharded model and transformers' TP.

``bash benchmarks/gpu_check.sh`` runs it unattended on whatever CUDA devices exist: tp=1, and
tp=2 when there are two GPUs (``torchrun --nproc-per-node N -m benchmarks.gpu``). Each run, in one
process group:

- parity: bfloat16 logits of tpkit (``tensor_parallel`` of the loaded model, and
  ``tpkit.from_pretrained``) against the unsharded model, and the greedy tokens;
- decode tokens/s (greedy ``generate`` with the KV cache) and training-step time, systems
  interleaved round by round, with the per-round ratio's median and IQR against transformers' TP
  (tp=2) or the unsharded model (tp=1) and a "within noise" verdict;
- ``torch.compile`` of the sharded model: does it run, does it match eager, how fast;
- peak CUDA memory per rank after each load.

Rank 0 writes ``gpu-tp<N>.json`` and ``gpu-tp<N>.md`` to ``--out``. ``--cpu`` runs the same code
on CPU with gloo and a tiny model: the dry run for machines without a GPU (timings meaningless).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import (
    PRESETS,
    ensure_checkpoint,
    error_text,
    make_inputs,
    median,
    model_config,
    noise_verdict,
    paired_ratio,
    ratio_spread,
    time_interleaved,
)

__all__ = ["main"]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--size", default="base", choices=list(PRESETS))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cpu", action="store_true", help="dry run: CPU, gloo (no CUDA needed)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="training-step and forward batch")
    p.add_argument("--seq", type=int, default=256, help="training-step and forward sequence")
    p.add_argument("--no-compile", action="store_true")
    return p.parse_args(argv)


class Run:
    """The process group, the device and how to wait for it."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cpu = args.cpu or not torch.cuda.is_available()
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if self.cpu:
            self.device = torch.device("cpu")
        else:
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        backend = "gloo" if self.cpu else "nccl"
        kwargs = {} if self.cpu else {"device_id": self.device}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600), **kwargs)
        self.rank = dist.get_rank()
        self.dtype = getattr(torch, args.dtype)

    def sync(self) -> None:
        if not self.cpu:
            torch.cuda.synchronize()
        dist.barrier()

    def peak_mib(self) -> float | None:
        """Peak CUDA memory allocated since `reset_peak`, over what was allocated then."""
        if self.cpu:
            return None
        return (torch.cuda.max_memory_allocated() - self.before) / 2**20

    def reset_peak(self) -> None:
        if not self.cpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()


def _hf(run: Run, path: Path, **kwargs):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=run.dtype, **kwargs)
    model.generation_config.pad_token_id = 0
    return model.eval()


def load_systems(run: Run, path: Path) -> tuple[dict[str, Any], dict[str, dict]]:
    """{name: model or error text}, {name: load figures}; each loaded after the last's peak."""
    import tpkit

    def plain():
        return _hf(run, path).to(run.device)

    def tpkit_split():
        return tpkit.tensor_parallel(_hf(run, path).to(run.device))

    def tpkit_load():
        return tpkit.from_pretrained(str(path), dtype=run.dtype).eval()

    def transformers_tp():
        from transformers.distributed import DistributedConfig

        return _hf(run, path, distributed_config=DistributedConfig(tp_size=run.world))

    loaders = {"plain": plain, "tpkit": tpkit_split, "tpkit_load": tpkit_load}
    if run.world > 1:
        loaders["transformers"] = transformers_tp
    systems, figures = {}, {}
    for name, load in loaders.items():
        run.reset_peak()
        t0 = time.perf_counter()
        try:
            systems[name] = load()
        except Exception as e:  # noqa: BLE001 - recorded in the results
            systems[name] = "load failed: " + error_text(e)
        run.sync()
        figures[name] = {"load_s": time.perf_counter() - t0, "load_peak_mib": run.peak_mib()}
        if not run.cpu:
            figures[name]["resident_mib"] = torch.cuda.memory_allocated() / 2**20
    return systems, figures


def _generate(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    return model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
    )


def parity(run: Run, models: dict[str, Any], vocab: int) -> dict[str, dict]:
    """Max |Δlogits| against the unsharded model, and whether the greedy tokens agree."""
    x = make_inputs(vocab, 2, run.args.prompt_len).to(run.device)
    out: dict[str, dict] = {}
    with torch.no_grad():
        ref = models["plain"](input_ids=x).logits.float()
        ref_tokens = _generate(models["plain"], x[:1], run.args.new_tokens)
        for name, m in models.items():
            if name == "plain":
                continue
            try:
                logits = m(input_ids=x).logits.float()
                tokens = _generate(m, x[:1], run.args.new_tokens)
                out[name] = {
                    "max_abs_diff": (logits - ref).abs().max().item(),
                    "ref_abs_max": ref.abs().max().item(),
                    "same_tokens": bool(torch.equal(tokens, ref_tokens)),
                }
            except Exception as e:  # noqa: BLE001 - recorded in the results
                out[name] = {"status": error_text(e)}
    return out


def _ratios(times: dict, name: str, other: str, higher: bool) -> dict[str, Any]:
    if name == other or other not in times:
        return {}
    r = paired_ratio(times[name], times[other])
    iqr = ratio_spread(times[name], times[other])
    if higher and r is not None and iqr is not None:  # tokens/s: the inverse of the time ratio
        r, iqr = 1 / r, [1 / iqr[1], 1 / iqr[0]]
    return {f"vs_{other}": r, f"vs_{other}_iqr": iqr, f"vs_{other}_verdict": _verdict(iqr, higher)}


def _verdict(iqr, higher: bool) -> str:
    return noise_verdict(iqr, 1.0, below_is_good=not higher)


def decode(run: Run, models: dict[str, Any], vocab: int) -> dict[str, dict]:
    """Decode tokens/s per round: (N−1) / (N-token generate − 1-token generate)."""
    n = run.args.new_tokens
    prompt = make_inputs(vocab, 1, run.args.prompt_len, seed=2).to(run.device)
    fns = {}
    for name, m in models.items():
        fns[(name, 1)] = lambda m=m: _generate(m, prompt, 1)
        fns[(name, n)] = lambda m=m: _generate(m, prompt, n)
    with torch.no_grad():
        t = time_interleaved(fns, run.args.repeats, 1, run.sync)
    per_token = {k: [(b - a) / (n - 1) for a, b in zip(t[(k, 1)], t[(k, n)])] for k in models}
    other = "transformers" if "transformers" in models else "plain"
    return {
        k: {
            "decode_tok_s": 1 / median(v) if median(v) else None,
            "ttft_ms": median(t[(k, 1)]) * 1e3,
            **_ratios(per_token, k, other, higher=True),
        }
        for k, v in per_token.items()
    }


@contextlib.contextmanager
def _optimizer(model):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    model.train()
    try:
        yield opt
    finally:
        opt.zero_grad(set_to_none=True)
        model.eval()


def step_times(run: Run, models: dict[str, Any], vocab: int) -> dict[str, dict]:
    """Training step (zero_grad, forward with labels, backward, AdamW) per round, interleaved."""
    x = make_inputs(vocab, run.args.batch, run.args.seq).to(run.device)
    fns, losses, stack = {}, {}, contextlib.ExitStack()
    with stack:
        for name, m in models.items():
            opt = stack.enter_context(_optimizer(m))

            def step(m=m, opt=opt, name=name):
                opt.zero_grad(set_to_none=True)
                loss = m(input_ids=x, labels=x).loss
                loss.backward()
                opt.step()
                losses[name] = loss.detach()

            step()  # allocates the AdamW state: untimed
            fns[name] = step
        t = time_interleaved(fns, run.args.repeats, 1, run.sync)
    other = "transformers" if "transformers" in models else "plain"
    return {
        k: {
            "step_ms": median(v) * 1e3,
            "loss": float(losses[k]),
            **_ratios(t, k, other, higher=False),
        }
        for k, v in t.items()
    }


def compile_check(run: Run, model, vocab: int) -> dict[str, Any]:
    """torch.compile of the sharded model's no-grad forward: runs, matches eager, time ratio."""
    x = make_inputs(vocab, run.args.batch, run.args.seq).to(run.device)
    with torch.no_grad():
        eager = model(input_ids=x, use_cache=False).logits.float()
        t0 = time.perf_counter()
        compiled = torch.compile(model)
        logits = compiled(input_ids=x, use_cache=False).logits.float()
        run.sync()
        first_s = time.perf_counter() - t0
        fns = {
            "eager": lambda: model(input_ids=x, use_cache=False),
            "compiled": lambda: compiled(input_ids=x, use_cache=False),
        }
        t = time_interleaved(fns, run.args.repeats, 1, run.sync)
    return {
        "max_abs_diff_vs_eager": (logits - eager).abs().max().item(),
        "compile_and_first_s": first_s,
        "eager_ms": median(t["eager"]) * 1e3,
        "compiled_ms": median(t["compiled"]) * 1e3,
        **_ratios(t, "compiled", "eager", higher=False),
    }


def _guarded(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - recorded in the results
        return {"status": error_text(e)}


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    torch.manual_seed(0)
    run = Run(args)
    cfg = model_config(args.size)
    if run.rank == 0:
        ensure_checkpoint(cfg)  # rank 0 writes it once; the others wait
    dist.barrier()
    path = ensure_checkpoint(cfg)
    systems, loads = load_systems(run, path)
    models = {k: v for k, v in systems.items() if not isinstance(v, str)}
    vocab = cfg["vocab_size"]
    doc: dict[str, Any] = {
        "load": loads,
        "failed": {k: v for k, v in systems.items() if k not in models},
    }
    if "plain" in models:
        doc["parity"] = _guarded(parity, run, models, vocab)
    doc["decode"] = _guarded(decode, run, models, vocab)
    if not args.no_compile and "tpkit" in models:
        doc["compile"] = _guarded(compile_check, run, models["tpkit"], vocab)
    doc["step"] = _guarded(step_times, run, models, vocab)
    if run.rank == 0:
        from benchmarks.gpu_report import write

        write(args.out, doc, _meta(run, cfg))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _meta(run: Run, cfg: dict) -> dict[str, Any]:
    import transformers

    gpu = "cpu (dry run)" if run.cpu else torch.cuda.get_device_name(run.device)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": gpu,
        "world": run.world,
        "backend": dist.get_backend(),
        "dtype": run.args.dtype,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "model": cfg,
        "settings": {k: v for k, v in vars(run.args).items() if k != "out"},
    }


if __name__ == "__main__":
    sys.exit(main())
