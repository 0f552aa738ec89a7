"""Every derived plan as data, to prove a refactor or a speed-up changes no plan.

For each tiny architecture (every text architecture of `tests.tiny`, every family's of
`tests.tiny_family`), each plan mode (``auto``, ``infer``) and each tp (1-4), derive the plan
single-process (pure analysis, no ranks) and write its whole content: entries in order with
their source and arguments, fix-ups, notes and groups (or the error, when derivation refuses).

    python -m benchmarks.plan_snapshot --out /tmp/before.jsonl           # ~30 min on 2 cores
    python -m benchmarks.plan_snapshot --out /tmp/after.jsonl --jobs 2
    python -m benchmarks.plan_snapshot --out /tmp/quick.jsonl --tp 2 3  # half the time
    python -m benchmarks.plan_snapshot --compare /tmp/before.jsonl /tmp/after.jsonl

``--compare`` prints each (architecture, mode, tp) whose plan differs and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

MODES = ("auto", "infer")
SIZES = (1, 2, 3, 4)


def plan_record(plan) -> dict:
    """A plan's whole content as plain, comparable data."""
    return {
        "entries": [[p, plan[p], str(plan.source(p)), plan.args.get(p) or {}] for p in plan],
        "fixups": {k: _plain(v) for k, v in plan.fixups.items()},
        "notes": dict(plan.notes),
        "groups": [g.to_dict() for g in plan.groups],
    }


def _plain(value):
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


def rows() -> list[tuple[str, str, str]]:
    from tests.tiny import architectures
    from tests.tiny_family import family_architectures

    seen, out = set(), []
    for t, c, kind in [*architectures(), *family_architectures()]:
        if (t, c) not in seen:
            seen.add((t, c))
            out.append((t, c, kind))
    return out


def snapshot(row: tuple[str, str, str], tps: tuple[int, ...] = SIZES) -> list[dict]:
    """Every (mode, tp) plan of one architecture's tiny model."""
    import torch

    torch.set_num_threads(1)
    from tests.tiny import NotText, build
    from tests.tiny_family import build_family
    from tpkit.plan import derive_plan

    model_type, class_name, kind = row
    out = []
    try:
        try:
            model = build(model_type, class_name)
        except NotText:
            model = build_family(model_type, class_name)
    except Exception as exc:  # noqa: BLE001 - a row whose tiny model does not build
        return [{"arch": f"{model_type}/{class_name}", "build": _why(exc)}]
    for mode in MODES:
        for tp in tps:
            rec: dict = {"arch": f"{model_type}/{class_name}", "mode": mode, "tp": tp}
            start = time.perf_counter()
            try:
                rec["plan"] = plan_record(derive_plan(model, mode, tp))
            except Exception as exc:  # noqa: BLE001 - a refusal is part of the snapshot
                rec["error"] = _why(exc)
            rec["seconds"] = round(time.perf_counter() - start, 3)
            out.append(rec)
    return out


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def run(out: Path, jobs: int, only: list[str] | None, tps: tuple[int, ...] = SIZES) -> None:
    todo = [r for r in rows() if not only or r[0] in only or r[1] in only]
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            done.add(json.loads(line)["arch"])
    todo = [r for r in todo if f"{r[0]}/{r[1]}" not in done]
    ctx = mp.get_context("spawn")
    with ctx.Pool(jobs, maxtasksperchild=8) as pool, out.open("a") as f:
        one = functools.partial(snapshot, tps=tps)
        for i, recs in enumerate(pool.imap_unordered(one, todo), 1):
            for rec in recs:
                f.write(json.dumps(rec, sort_keys=True) + "\n")
            f.flush()
            print(f"{i}/{len(todo)} {recs[0]['arch']}", file=sys.stderr, flush=True)


def _key(rec: dict) -> tuple:
    return (rec["arch"], rec.get("mode"), rec.get("tp"))


def compare(before: Path, after: Path) -> int:
    def load(p: Path) -> dict:
        out = {}
        for line in p.read_text().splitlines():
            rec = json.loads(line)
            rec.pop("seconds", None)
            out[_key(rec)] = rec
        return out

    a, b = load(before), load(after)
    differ = [k for k in sorted(set(a) | set(b), key=str) if a.get(k) != b.get(k)]
    for k in differ:
        print(f"differs: {k}")
        x, y = a.get(k), b.get(k)
        if x is None or y is None:
            print("   only in", "after" if x is None else "before")
            continue
        for field in sorted(set(x) | set(y)):
            if x.get(field) != y.get(field):
                print(f"   {field}: {str(x.get(field))[:400]}\n      -> {str(y.get(field))[:400]}")
    print(f"{len(a)} before, {len(b)} after, {len(differ)} differ")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--compare", nargs=2, type=Path)
    ap.add_argument("--tp", nargs="*", type=int, default=list(SIZES), help="the sizes derived")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    run(args.out, args.jobs, args.only, tuple(args.tp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
