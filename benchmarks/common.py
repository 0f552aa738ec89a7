"""Shared pieces of the benchmark harness: model presets and checkpoints, interleaved timing,
memory probes and a collective counter. Imports torch and transformers only (never tpkit), so the
``tensor-parallel`` package's own virtualenv can use it too."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Llama-style presets built from a config (never downloaded). "base" is ~100M parameters.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8000,
    ),
    "base": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_config(preset: str, overrides: dict[str, int] | None = None) -> dict[str, Any]:
    cfg = dict(PRESETS[preset])
    cfg.update({k: v for k, v in (overrides or {}).items() if v is not None})
    cfg.setdefault("max_position_embeddings", 2048)
    cfg["tie_word_embeddings"] = False
    return cfg


def count_params(cfg: dict[str, Any]) -> int:
    """Parameter count of a LlamaForCausalLM with this config, computed on the meta device."""
    import transformers as tf

    with torch.device("meta"):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**cfg))
    return sum(p.numel() for p in model.parameters())


def cache_root() -> Path:
    return Path(os.environ.get("TPKIT_BENCH_CACHE", Path(tempfile.gettempdir()) / "tpkit-bench"))


def ensure_checkpoint(cfg: dict[str, Any], seed: int = 0) -> Path:
    """Save a randomly initialised Llama with ``cfg`` once (float32 safetensors) and return its dir.

    Every system loads this same directory, so all of them hold identical weights."""
    import transformers as tf

    key = hashlib.sha1(json.dumps({"cfg": cfg, "seed": seed}, sort_keys=True).encode()).hexdigest()
    path = cache_root() / f"llama-{key[:12]}"
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**cfg)).float()
    model.generation_config.pad_token_id = 0
    model.save_pretrained(tmp)
    tmp.rename(path)
    return path


def make_inputs(vocab: int, batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    """Identical on every rank (TP requires the same inputs across a group)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, seq), generator=g)


# -- timing ---------------------------------------------------------------------------------------


NOISE = (
    "`IQR of rounds` is the interquartile range of the per-round ratios (each round runs every "
    "system back to back); `vs transformers TP` says `better` or `worse` only when that whole "
    "range lies on one side of 1.00, else `within noise`."
)


def round_ratios(a: list[float] | None, b: list[float] | None) -> list[float]:
    """Per-round ratios a_i / b_i (the two systems of a round ran back to back)."""
    # a round whose figure is not finite (decode tok/s when the N-token run was not slower than
    # the 1-token one, on a loaded machine) says nothing: left out, not sorted as a number
    return [x / y for x, y in zip(a or [], b or []) if y and math.isfinite(x) and math.isfinite(y)]


def paired_ratio(a: list[float] | None, b: list[float] | None) -> float | None:
    """Median of per-round ratios a_i / b_i. Systems of one round run back to back, so this
    cancels the slow drifts of a shared machine better than a ratio of medians."""
    rs = round_ratios(a, b)
    return statistics.median(rs) if rs else None


def ratio_spread(a: list[float] | None, b: list[float] | None) -> list[float] | None:
    """The spread of the per-round ratios: their interquartile range ``[q1, q3]`` (inclusive
    quartiles; min and max with 2 rounds), the figure that says whether a ratio is noise."""
    rs = sorted(round_ratios(a, b))
    if not rs:
        return None
    if len(rs) < 3:
        return [rs[0], rs[-1]]
    q = statistics.quantiles(rs, n=4, method="inclusive")
    return [q[0], q[2]]


def noise_verdict(spread: list[float] | None, pivot: float, below_is_good: bool) -> str:
    """ "better" / "worse" than ``pivot`` when the whole spread lies on one side of it, else
    "within noise": a ratio whose rounds straddle the line says nothing either way."""
    if not spread:
        return "—"
    lo, hi = spread
    if hi < pivot if below_is_good else lo > pivot:
        return "better"
    if lo > pivot if below_is_good else hi < pivot:
        return "worse"
    return "within noise"


def goal_row(
    goal: str,
    dtype: str,
    figure: float,
    limit: float,
    *,
    below: bool = True,
    spread: list[float] | None = None,
) -> dict[str, Any]:
    """One acceptance figure: ``met`` compares the median with the limit; with a ``spread`` (the
    per-round IQR) ``verdict`` says "yes", "no" or "within noise" (the spread crosses the limit)."""
    met = figure <= limit if below else figure >= limit
    row = dict(
        goal=goal, dtype=dtype, figure=figure, target=f"{'<=' if below else '>='} {limit:.2f}"
    )
    row["met"] = met
    if spread is not None:
        v = noise_verdict(spread, limit, below)
        row["spread"] = spread
        row["verdict"] = {"better": "yes", "worse": "no"}.get(v, v)
    return row


def time_goals(rows: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
    """The two timing goals of a suite: tpkit ÷ transformers TP at tp=2 (≤ 0.90) and tpkit at
    tp=1 ÷ unsharded (≤ 1.02), one row per dtype measured, each with its per-round spread."""
    out = []
    for r in rows:
        if r["system"] != "tpkit" or r["status"] != "ok":
            continue
        wanted = []
        if r["tp"] == 2 and r.get("vs_transformers") is not None:
            wanted.append(
                (f"{what} time, tpkit / transformers TP at tp=2", "vs_transformers", 0.90)
            )
        if r["tp"] == 2 and r.get("vs_plain_all") is not None:
            wanted.append(
                (f"{what} time, tpkit tp=2 / plain on all cores (issue 30)", "vs_plain_all", 1.05)
            )
        if r["tp"] == 1 and r.get("vs_plain") is not None:
            wanted.append((f"{what} overhead, tpkit tp=1 / unsharded", "vs_plain", 1.02))
        for goal, key, limit in wanted:
            out.append(goal_row(goal, r["dtype"], r[key], limit, spread=r.get(key + "_iqr")))
    return out


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def timing_figures(times: dict[str, list[float]], name: str) -> dict[str, Any]:
    """The ratio figures of system ``name`` against the unsharded model and transformers' TP:
    paired medians, their per-round IQR and whether each is within noise of 1."""
    t = times[name]
    out: dict[str, Any] = {}
    pairs = (
        ("plain", "vs_plain"),
        ("plain_all", "vs_plain_all"),
        ("transformers", "vs_transformers"),
    )
    for other, key in pairs:
        out[key] = paired_ratio(t, times.get(other))
        out[key + "_iqr"] = ratio_spread(t, times.get(other)) if other != name else None
        out[key + "_verdict"] = noise_verdict(out[key + "_iqr"], 1.0, below_is_good=True)
    best = min(times.get("transformers") or [0])
    out["vs_transformers_min"] = min(t) / best if best else None
    return out


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    repeats: int,
    warmup: int,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, list[float]]:
    """Time every ``fn`` ``repeats`` times, interleaved (a round runs each system once, the order
    rotating each round), after ``warmup`` untimed rounds. ``sync`` (a barrier across ranks) runs
    before and after each timed call, so a time is the slowest rank's."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for i in range(len(names)):
            n = names[(i + r) % len(names)]
            sync()
            t0 = time.perf_counter()
            fns[n]()
            sync()
            times[n].append(time.perf_counter() - t0)
    return times


# -- memory ---------------------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    if kib is None:
        import psutil

        return psutil.Process().memory_info().rss
    return kib * 1024


def peak_rss_bytes() -> int:
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return kib * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def param_bytes(params) -> int:
    """Bytes of the parameters this rank holds (a DTensor counts its local shard; ties once)."""
    seen, total = set(), 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        local = getattr(p, "_local_tensor", p)
        total += local.numel() * local.element_size()
    return total


# -- collectives ----------------------------------------------------------------------------------

# Per call: (kind, index of the argument holding this rank's input). Functional collectives take the
# input first; c10d in-place ops take lists (output lists first for gather/scatter).
_C10D = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 1),
    "_allgather_base_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "allgather_coalesced_": ("all_gather", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "alltoall_": ("all_to_all", 1),
    "alltoall_base_": ("all_to_all", 1),
    "reduce_": ("reduce", 0),
    "gather_": ("gather", 1),
    "scatter_": ("scatter", 1),
}
_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}
# All-reduce equivalents: an all-reduce is a reduce-scatter plus an all-gather.
AR_EQUIV = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5}


def _tensor_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(v) for v in x)
    return 0


def ring_bytes(kind: str, nbytes: int, t: int, emulated_rs: bool = False) -> float:
    """Bytes each rank sends with the bandwidth-optimal (ring) algorithm.

    ``nbytes`` is this rank's input: the full tensor for all-reduce / reduce-scatter, the local
    part for all-gather. gloo emulates reduce-scatter with an all-reduce (``emulated_rs``)."""
    if t <= 1:
        return 0.0
    if kind == "all_reduce" or (kind == "reduce_scatter" and emulated_rs):
        return 2 * (t - 1) / t * nbytes
    if kind == "all_gather":
        return (t - 1) * nbytes
    if kind in ("reduce_scatter", "all_to_all"):
        return (t - 1) / t * nbytes
    return float(nbytes)


class CollectiveLog:
    """Collectives seen, each as (scope, kind, input bytes). ``scope`` is set by `block_scope`
    hooks: "block" inside a transformer block's forward, "other" elsewhere (embedding, head,
    backward)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self._local = threading.local()

    @property
    def scope(self) -> str:
        return getattr(self._local, "scope", "other")

    @scope.setter
    def scope(self, value: str) -> None:
        self._local.scope = value

    def record(self, kind: str, nbytes: int) -> None:
        self.calls.append((self.scope, kind, nbytes))

    def clear(self) -> None:
        self.calls.clear()

    def summary(self, t: int, layers: int, tokens: int, emulated_rs: bool) -> dict[str, Any]:
        """Per-block forward figures: counts by kind, all-reduce equivalents, ring bytes/token."""
        block = [c for c in self.calls if c[0] == "block"]
        other = [c for c in self.calls if c[0] != "block"]
        kinds: dict[str, float] = {}
        for _, k, _ in block:
            kinds[k] = kinds.get(k, 0) + 1 / layers
        equiv = sum(AR_EQUIV.get(k, 1.0) for _, k, _ in block) / layers
        if emulated_rs:
            equiv += 0.5 * sum(1 for _, k, _ in block if k == "reduce_scatter") / layers
        moved = sum(ring_bytes(k, n, t, emulated_rs) for _, k, n in block)
        return {
            "per_block": {k: round(v, 3) for k, v in sorted(kinds.items())},
            "ar_equiv_per_block": round(equiv, 3),
            "bytes_per_token_per_block": moved / layers / tokens,
            "outside_blocks": len(other),
            "outside_bytes_per_token": sum(ring_bytes(k, n, t, emulated_rs) for _, k, n in other)
            / tokens,
            "total": len(self.calls),
        }


class CountCollectives(torch.utils._python_dispatch.TorchDispatchMode):
    """Record every c10d / functional collective that reaches the dispatcher.

    Catches direct ``torch.distributed.all_reduce`` calls (c10d ops, as tpkit's styles issue
    them), DTensor redistributions and functional collectives (as transformers' TP issues them).
    Used only for counting passes, never while timing."""

    def __init__(self, log: CollectiveLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = getattr(func, "namespace", "")
        name = func._opname if hasattr(func, "_opname") else str(func).split(".")[1]
        if ns == "c10d" and name in _C10D:
            kind, idx = _C10D[name]
            self.log.record(kind, _tensor_bytes(args[idx] if len(args) > idx else args))
        elif ns in ("_c10d_functional", "c10d_functional") and name in _FUNCTIONAL:
            self.log.record(_FUNCTIONAL[name], _tensor_bytes(args[0]))
        return func(*args, **(kwargs or {}))


def find_blocks(model: nn.Module, n_layers: int) -> nn.ModuleList | None:
    """The ModuleList of transformer blocks (the first with ``n_layers`` entries)."""
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) == n_layers:
            return m
    return None


@contextlib.contextmanager
def block_scope(blocks: nn.ModuleList, log: CollectiveLog):
    """Mark collectives issued inside a block's forward as scope "block"."""

    def pre(_m, _a):
        log.scope = "block"

    def post(_m, _a, _o):
        log.scope = "other"

    handles = []
    for b in blocks:
        handles.append(b.register_forward_pre_hook(pre))
        handles.append(b.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        log.scope = "other"


def megatron_limit(t: int, hidden: int, elem_bytes: int) -> float:
    """Bytes per token per block each rank sends for Megatron TP forward: 2 all-reduces of h."""
    return 4 * (t - 1) / t * hidden * elem_bytes if t > 1 else 0.0


def error_text(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
