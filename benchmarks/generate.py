"""Decode: greedy ``generate`` with the KV cache. Time-to-first-token and decode tokens/s."""

from __future__ import annotations

import torch

from benchmarks.common import (
    error_text,
    goal_row,
    make_inputs,
    median,
    noise_verdict,
    paired_ratio,
    ratio_spread,
    time_interleaved,
)
from benchmarks.suites import Suite, failed_rows, ok
from benchmarks.systems import GLOO, PLAIN_ALL, all_cores, on_all_cores, without_shm


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
        if "tpkit" in tokens and ctx.tp > 1:  # the same model with the shm fast path off
            m = ok(systems)["tpkit"].model
            tokens[GLOO] = without_shm(lambda: _generate(m, prompt, n))
            fns[(GLOO, "first")] = lambda: without_shm(lambda: _generate(m, prompt, 1))
            fns[(GLOO, "all")] = lambda: without_shm(lambda: _generate(m, prompt, n))
        if "plain" in tokens and ctx.tp > 1:  # the limit: one process on all cores
            m = ok(systems)["plain"].model
            got = on_all_cores(ctx, lambda: _generate(m, prompt, n))
            tokens[PLAIN_ALL] = got if got is not None else tokens["plain"]
            fns[(PLAIN_ALL, "first")] = lambda: on_all_cores(ctx, lambda: _generate(m, prompt, 1))
            fns[(PLAIN_ALL, "all")] = lambda: on_all_cores(ctx, lambda: _generate(m, prompt, n))
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
                "decode_vs_plain_all": paired_ratio(rounds[name], rounds.get(PLAIN_ALL)),
                "decode_vs_plain_all_iqr": ratio_spread(rounds[name], rounds.get(PLAIN_ALL))
                if name != PLAIN_ALL
                else None,
                "decode_vs_transformers": paired_ratio(rounds[name], rounds.get("transformers")),
                **_spread(rounds, name),
                "ttft_vs_transformers": paired_ratio(
                    times[(name, "first")], times.get(("transformers", "first"))
                ),
                "same_tokens_as_plain": same,
                "note": f"one process, {all_cores()} threads (rank 0; the other ranks idle)"
                if name == PLAIN_ALL
                else "",
                "repeats": len(times[(name, "all")]),
            }
        )
    return rows


def _spread(rounds: dict[str, list[float]], name: str) -> dict:
    """The per-round IQR of tok/s ÷ transformers' and whether it clears 1 (higher is better)."""
    if name == "transformers" or "transformers" not in rounds:
        return {}
    iqr = ratio_spread(rounds[name], rounds["transformers"])
    return {
        "decode_vs_transformers_iqr": iqr,
        "decode_vs_transformers_verdict": noise_verdict(iqr, 1.0, below_is_good=False),
    }


def goals(rows):
    limit = [
        goal_row(
            "decode tokens/s, tpkit tp=2 / plain on all cores (issue 30)",
            r["dtype"],
            r["decode_vs_plain_all"],
            0.90,
            below=False,
            spread=r.get("decode_vs_plain_all_iqr"),
        )
        for r in rows
        if r["system"] == "tpkit"
        and r["tp"] == 2
        and r["status"] == "ok"
        and r.get("decode_vs_plain_all") is not None
    ]
    return limit + [
        goal_row(
            "decode tokens/s, tpkit / transformers TP at tp=2 (issue 5)",
            r["dtype"],
            r["decode_vs_transformers"],
            1.20,
            below=False,
            spread=r.get("decode_vs_transformers_iqr"),
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
        ("decode_vs_plain_all", "tok/s ÷ plain, all cores", "x"),
        ("decode_vs_plain_all_iqr", "÷ plain, all cores, IQR", "range"),
        ("decode_vs_transformers", "tok/s ÷ transformers TP", "x"),
        ("decode_vs_transformers_iqr", "IQR of rounds", "range"),
        ("decode_vs_transformers_verdict", "vs transformers TP", "str"),
        ("same_tokens_as_plain", "same tokens", "bool"),
    ],
    explain=(
        "`generate(prompt, max_new_tokens=N, min_new_tokens=N, do_sample=False)` with the KV "
        "cache. TTFT is the median time of a 1-token generate (prefill + first token); decode "
        "tok/s = batch·(N−1) / (median N-token time − TTFT). Ratios of tok/s (medians of per-round "
        "ratios) are higher-is-better; `IQR of rounds` is their interquartile range and `vs "
        "transformers TP` says `better`/`worse` only when it lies wholly above/below 1.00. tpkit's "
        "collectives take the same-host shared-memory path by default (`tpkit.parallel.shm`); "
        "`tpkit, shm off` is the same model with it off (every collective on gloo), in the same "
        "rounds. `plain, all cores`: the unsharded model in one process with one thread per core "
        "(rank 0, the other ranks idle), the limit on one host. `same tokens` compares the greedy "
        "sequences with the unsharded model's."
    ),
)
