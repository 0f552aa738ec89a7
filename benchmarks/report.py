"""JSON and markdown output: one file pair per suite, a combined summary, and the README table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks.systems import ALL_SYSTEMS, LABELS

README_START = "<!-- bench:results:start -->"
README_END = "<!-- bench:results:end -->"


def fmt(value: Any, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if kind == "bool":
        return "yes" if value else "**no**"
    if kind == "str":
        return str(value)
    if kind == "range":
        return f"{value[0]:.2f}–{value[1]:.2f}"
    v = float(value)
    return {
        "ms": f"{v:.1f}",
        "x": f"{v:.2f}×",
        "int": f"{v:,.0f}",
        "f1": f"{v:.1f}",
        "f2": f"{v:.2f}",
        "f3": f"{v:.3f}",
        "e": f"{v:.1e}",
    }.get(kind, str(value))


def _order(row: dict[str, Any]) -> tuple:
    order = [ALL_SYSTEMS[0], "plain_all", ALL_SYSTEMS[1], "tpkit_gloo", *ALL_SYSTEMS[2:]]
    sys_rank = order.index(row["system"]) if row["system"] in order else 99
    return (row["dtype"], row["tp"], sys_rank)


def table(suite, rows: list[dict[str, Any]]) -> str:
    heads = ["system", "tp", "dtype", *[c[1] for c in suite.columns], "status / note"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in sorted(rows, key=_order):
        good = r.get("status") == "ok"
        cells = [LABELS.get(r["system"], r["system"]), str(r["tp"]), r["dtype"]]
        cells += [fmt(r.get(k), kind) if good else "—" for k, _, kind in suite.columns]
        cells.append((r.get("note") or "") if good else str(r.get("status")))
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def settings_line(meta: dict[str, Any]) -> str:
    s, m = meta["settings"], meta["model"]
    return (
        f"Model: Llama-style, {meta['n_params'] / 1e6:.1f}M parameters (hidden {m['hidden_size']}, "
        f"{m['num_hidden_layers']} layers, {m['num_attention_heads']} heads / "
        f"{m['num_key_value_heads']} KV heads, FFN {m['intermediate_size']}, vocab {m['vocab_size']}), "
        f"built from a config (preset `{s['size']}`). Forward/step: batch {s['batch']} × seq "
        f"{s['seq']}; generate: batch {s['gen_batch']}, prompt {s['prompt_len']}, "
        f"{s['new_tokens']} new tokens. Repeats (median): forward {s['repeats']}, step "
        f"{s['step_repeats']}, generate {s['gen_repeats']}."
    ) + _train_line(meta)


def _train_line(meta: dict[str, Any]) -> str:
    t = meta.get("train_model")
    if not t:
        return ""
    return (
        f" Train suite: preset `{t['preset']}` ({t['n_params'] / 1e6:.1f}M parameters), batch "
        f"{meta['settings']['batch']} × seq {meta['settings']['seq']} per dp replica, "
        f"{meta['settings'].get('train_steps')} timed steps."
    )


def machine_line(meta: dict[str, Any]) -> str:
    m = meta["machine"]
    return (
        f"{meta['date']} · {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, one OpenMP thread "
        f"per rank, gloo · torch {m['torch']}, transformers {m['transformers']} · tpkit "
        f"{m['commit']}"
    )


def suite_markdown(suite, rows, meta) -> str:
    return "\n\n".join(
        [
            f"# {suite.title} (`{suite.name}`)",
            machine_line(meta),
            settings_line(meta),
            suite.explain,
            table(suite, rows),
        ]
    )


def goals_table(goals: list[dict[str, Any]]) -> str:
    if not goals:
        return "_No goal figures in this run._"
    lines = [
        "| goal | dtype | figure | IQR of rounds | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for g in goals:
        fig = "—" if g["figure"] is None else f"{g['figure']:.3g}"
        spread = fmt(g["spread"], "range") if g.get("spread") else "—"
        met = g.get("verdict") or ("yes" if g["met"] else "no")
        met = {
            "no": "**no**",
            "within noise": f"within noise ({'yes' if g['met'] else 'no'} at the median)",
        }.get(met, met)
        lines.append(f"| {g['goal']} | {g['dtype']} | {fig} | {spread} | {g['target']} | {met} |")
    return "\n".join(lines)


def write_all(out: Path, suites, results: dict[str, list], meta: dict[str, Any], skipped):
    out.mkdir(parents=True, exist_ok=True)
    goals: list[dict[str, Any]] = []
    sections = []
    for name, rows in results.items():
        suite = suites[name]
        g = suite.goals(rows) if suite.goals else []
        goals += g
        doc = {"suite": name, "title": suite.title, **meta, "goals": g, "rows": rows}
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        (out / f"{name}.md").write_text(suite_markdown(suite, rows, meta) + "\n")
        sections.append(f"### {suite.title} (`{name}`)\n\n{table(suite, rows)}")
    skipped_md = "".join(f"\n- `{k}` not run: {v}" for k, v in skipped.items())
    summary = "\n\n".join(
        [
            machine_line(meta),
            settings_line(meta),
            "### Goals (tp=2 unless stated; ratios measured within one run)",
            "`within noise`: the interquartile range of the per-round ratios crosses the target, "
            "so this run cannot say; counted figures (collectives, bytes, RSS) have no spread.",
            goals_table(goals),
            *sections,
        ]
    )
    summary += ("\n\n" + skipped_md.strip()) if skipped_md else ""
    (out / "summary.md").write_text("# tpkit benchmarks\n\n" + summary + "\n")
    (out / "summary.json").write_text(
        json.dumps({**meta, "goals": goals, "skipped": skipped}, indent=1, default=str) + "\n"
    )
    return summary


def update_readme(readme: Path, summary: str) -> None:
    if not readme.exists():
        return
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        return
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_START}\n{summary}\n{README_END}{tail}")
