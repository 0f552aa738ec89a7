"""Decode: greedy ``generate`` with the KV cache. Time-to-first-token and decode tokens/s."""

from __future__ import annotations

import torch

from benchmarks.common import error_text, make_inputs, median, paired_ratio, time_interleaved
from benchmarks.suites import Suite, failed_rows, ok


def _generate(model, prompt, n):
    return model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        num_beams=1,
        use_cache=True,
        pad_token_id=0,
    )


def run(ctx, systems):
    spec = ctx.spec
    rows = failed_rows(ctx, systems)
    n = spec["new_tokens"]
    prompt = make_inputs(ctx.cfg["vocab_size"], spec["gen_batch"], spec["prompt_len"], seed=2)
    fns, tokens = {}, {}
    with torch.no_grad():
        for name, s in ok(systems).items():
            if s.no_generate:
                rows.append({**ctx.base_row(name), "status": s.no_generate})
                continue
            try:
                tokens[name] = _generate(s.model, prompt, n)
                fns[(name, "first")] = lambda m=s.model: _generate(m, prompt, 1)
                fns[(name, "all")] = lambda m=s.model: _generate(m, prompt, n)
            except Exception as e:  # noqa: BLE001 - recorded in the row
                rows.append({**ctx.base_row(name), "status": error_text(e)})
        times = time_interleaved(fns, spec["gen_repeats"], spec["gen_warmup"], ctx.sync)
    med = {k: median(v) for k, v in times.items()}
    tps, rounds = {}, {}
    for name in tokens:
        rounds[name] = [
            prompt.shape[0] * (n - 1) / (b - a) if b > a else float("nan")
            for a, b in zip(times[(name, "first")], times[(name, "all")])
        ]
        first, full = med[(name, "first")], med[(name, "all")]
        tps[name] = prompt.shape[0] * (n - 1) / (full - first) if full > first else None
    for name in tokens:
        same = bool(torch.equal(tokens[name], tokens["plain"])) if "plain" in tokens else None
        rows.append(
            {
                **ctx.base_row(name),
                "ttft_ms": med[(name, "first")] * 1e3,
                "total_ms": med[(name, "all")] * 1e3,
                "decode_tok_s": tps[name],
                "decode_vs_plain": paired_ratio(rounds[name], rounds.get("plain")),
                "decode_vs_transformers": paired_ratio(rounds[name], rounds.get("transformers")),
                "ttft_vs_transformers": paired_ratio(
                    times[(name, "first")], times.get(("transformers", "first"))
                ),
                "same_tokens_as_plain": same,
                "repeats": len(times[(name, "all")]),
            }
        )
    return rows


def goals(rows):
    return [
        dict(
            goal="decode tokens/s, tpkit / transformers TP at tp=2 (issue 5)",
            dtype=r["dtype"],
            figure=r["decode_vs_transformers"],
            target=">= 1.20",
            met=r["decode_vs_transformers"] >= 1.20,
        )
        for r in rows
        if r["system"] == "tpkit"
        and r["tp"] == 2
        and r["status"] == "ok"
        and r.get("decode_vs_transformers") is not None
    ]


SUITE = Suite(
    name="generate",
    title="Greedy decode with KV cache",
    run=run,
    goals=goals,
    columns=[
        ("ttft_ms", "TTFT ms", "ms"),
        ("total_ms", "total ms", "ms"),
        ("decode_tok_s", "decode tok/s", "f1"),
        ("decode_vs_plain", "tok/s ÷ unsharded", "x"),
        ("decode_vs_transformers", "tok/s ÷ transformers TP", "x"),
        ("same_tokens_as_plain", "same tokens", "bool"),
    ],
    explain=(
        "`generate(prompt, max_new_tokens=N, min_new_tokens=N, do_sample=False)` with the KV "
        "cache. TTFT is the median time of a 1-token generate (prefill + first token); decode "
        "tok/s = batch·(N−1) / (median N-token time − TTFT). Ratios of tok/s (medians of per-round "
        "ratios) are higher-is-better. "
        "`same tokens` compares the greedy sequences with the unsharded model's."
    ),
)
