"""The GPU check's results as JSON and a markdown page (`benchmarks.gpu` calls `write` on rank 0)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.report import fmt

__all__ = ["write"]

LABELS = {
    "plain": "unsharded model",
    "tpkit": "tpkit (tensor_parallel)",
    "tpkit_load": "tpkit (from_pretrained)",
    "transformers": "transformers TP",
}


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _table(heads: list[str], rows: list[list[str]]) -> str:
    return "\n".join([_row(heads), "|" + "---|" * len(heads), *map(_row, rows)])


def _status(section: Any) -> str | None:
    return section.get("status") if isinstance(section, dict) else None


def _systems_table(doc: dict[str, Any], other: str) -> str:
    parity, dec, step = doc.get("parity", {}), doc.get("decode", {}), doc.get("step", {})
    heads = [
        "system",
        "load s",
        "CUDA load peak MiB (over before)",
        "max |Δlogits| vs unsharded",
        "same tokens",
        "decode tok/s",
        f"tok/s ÷ {LABELS[other]}",
        "IQR",
        "verdict",
        "step ms",
        f"step ÷ {LABELS[other]}",
        "IQR",
        "verdict",
        "loss",
    ]
    rows = []
    for name, load in doc["load"].items():
        if name in doc["failed"]:
            rows.append([LABELS.get(name, name), *["—"] * 12, doc["failed"][name]])
            continue
        p, d, s = parity.get(name, {}), dec.get(name, {}), step.get(name, {})
        rows.append(
            [
                LABELS.get(name, name),
                fmt(load.get("load_s"), "f1"),
                fmt(load.get("load_peak_mib"), "f1"),
                fmt(p.get("max_abs_diff"), "e"),
                fmt(p.get("same_tokens"), "bool") if "same_tokens" in p else "—",
                fmt(d.get("decode_tok_s"), "f1"),
                fmt(d.get(f"vs_{other}"), "x"),
                fmt(d.get(f"vs_{other}_iqr"), "range"),
                d.get(f"vs_{other}_verdict", "—"),
                fmt(s.get("step_ms"), "ms"),
                fmt(s.get(f"vs_{other}"), "x"),
                fmt(s.get(f"vs_{other}_iqr"), "range"),
                s.get(f"vs_{other}_verdict", "—"),
                fmt(s.get("loss"), "f3"),
            ]
        )
    return _table(heads, rows)


def markdown(doc: dict[str, Any], meta: dict[str, Any]) -> str:
    other = "transformers" if meta["world"] > 1 else "plain"
    m = meta["model"]
    lines = [
        f"# GPU check, tp={meta['world']} ({meta['backend']})",
        f"{meta['date']} · {meta['device']} × {meta['world']} · torch {meta['torch']} (CUDA "
        f"{meta['cuda']}), transformers {meta['transformers']} · {meta['dtype']}",
        f"Model: Llama-style, hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, vocab "
        f"{m['vocab_size']}. Settings: {json.dumps(meta['settings'])}.",
        "Ratios are medians of per-round ratios (systems interleaved round by round); IQR is "
        "their interquartile range; the verdict is `better`/`worse` only when the whole IQR lies "
        "on one side of 1.00, else `within noise`.",
        _systems_table(doc, other),
    ]
    for key in ("parity", "decode", "step"):
        if _status(doc.get(key)):
            lines.append(f"- {key} failed: {doc[key]['status']}")
    c = doc.get("compile")
    if c is not None:
        if _status(c):
            lines.append(f"## torch.compile of the sharded model\n\nfailed: {c['status']}")
        else:
            lines.append(
                "## torch.compile of the sharded model (no-grad forward)\n\n"
                + _table(
                    [
                        "max |Δlogits| vs eager",
                        "compile + first s",
                        "eager ms",
                        "compiled ms",
                        "compiled ÷ eager",
                        "IQR",
                        "verdict",
                    ],
                    [
                        [
                            fmt(c["max_abs_diff_vs_eager"], "e"),
                            fmt(c["compile_and_first_s"], "f1"),
                            fmt(c["eager_ms"], "ms"),
                            fmt(c["compiled_ms"], "ms"),
                            fmt(c.get("vs_eager"), "x"),
                            fmt(c.get("vs_eager_iqr"), "range"),
                            c.get("vs_eager_verdict", "—"),
                        ]
                    ],
                )
            )
    return "\n\n".join(lines) + "\n"


def write(out: Path, doc: dict[str, Any], meta: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu-tp{meta['world']}"
    (out / f"{stem}.json").write_text(json.dumps({**meta, **doc}, indent=1, default=str) + "\n")
    (out / f"{stem}.md").write_text(markdown(doc, meta))
