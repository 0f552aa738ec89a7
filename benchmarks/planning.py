"""Planning speed: how long `tpkit plan --tp 8` takes on every default (full-size) config.

For each architecture the coverage sweeps know (`tests.tiny.architectures`, every family's of
`tests.tiny_family`), a fresh Python process builds its default config on the meta device as
`tests.tiny.full_config` repairs it (as the coverage sweep's full-size row does), derives the
"auto" plan at ``--tp`` and validates it: what ``tpkit plan --tp 8`` does before it prints. The
parent measures the child's wall time (imports included: a user's first plan pays them too) and
its peak resident memory (the child's own ``ru_maxrss``); the child reports how the time
split (build, derive, validate). Each row is one process so that nothing one plan cached or
leaked reaches the next, and a hang or a crash costs its own row only (``--timeout``).

The child also writes the derived plan whole (`benchmarks.plan_snapshot.plan_record`, mode
"auto", this tp) to ``--plans``, so ``python -m benchmarks.plan_snapshot --compare`` proves a
speed-up changed no full-size plan. ``--src`` runs another tree's tpkit (a baseline worktree)
with this tree's tests and benchmarks.

    python -m benchmarks.planning                              # every row, hours on 2 cores
    python -m benchmarks.planning --only llama glm_moe_dsa     # model types or class names
    python -m benchmarks.planning --src /tmp/base/src --out /tmp/plan-base --plans /tmp/b.jsonl
    python -m benchmarks.planning --only kolibri1_1 zamba2 --ab /tmp/base/src --repeats 3

``--ab`` times a base tree and this one on the same rows, interleaved, and writes
``planning_ab.md`` beside ``planning.md``.

Writes ``planning.json`` (every row) and ``planning.md`` (the ten slowest, then every row) to
``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
#: the goal of issue 44: every default config planned within these
GOAL_SECONDS, GOAL_BYTES = 10.0, 1 << 30


def child(model_type: str, class_name: str, tp: int, plans: str | None) -> dict:
    """In a fresh process: build the default config on meta, derive at ``tp``, validate."""
    t0 = time.perf_counter()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    import transformers

    torch.set_num_threads(1)
    from benchmarks.plan_snapshot import plan_record
    from tests.tiny import full_config
    from tpkit.plan import derive_plan, validate

    out: dict = {"imports": round(time.perf_counter() - t0, 3)}
    rec: dict = {"arch": f"{model_type}/{class_name}", "mode": "auto", "tp": tp}
    t = time.perf_counter()
    try:
        config = full_config(model_type, class_name)
        with torch.device("meta"):
            model = getattr(transformers, class_name)(config).float().eval()
        if hasattr(model, "set_default_language"):  # as the coverage sweep's full-size row
            model.set_default_language(next(iter(config.languages)))
    except Exception as exc:  # noqa: BLE001 - a default config that does not build
        out.update(status="build error", error=_why(exc))
        return out
    out["build"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    shared = _analysis(model)  # as `tpkit plan` does: validation reuses derivation's dry runs
    try:
        plan = derive_plan(model, "auto", tp, **shared)
    except Exception as exc:  # noqa: BLE001 - a refusal is part of the record
        rec["error"] = _why(exc)
        out.update(status="derive error", error=_why(exc))
    out["derive"] = round(time.perf_counter() - t, 3)
    if "error" not in rec:
        rec["plan"] = plan_record(plan)
        t = time.perf_counter()
        try:
            validate(model, plan, tp, **shared)
            out["status"] = "ok"
        except ValueError as exc:  # what `tpkit plan` prints instead of the table
            out.update(status="invalid", error=_why(exc))
        out["validate"] = round(time.perf_counter() - t, 3)
    if plans:
        with open(plans, "a") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
    return out


def _analysis(model) -> dict:
    """``{"analysis": one Analysis}`` where the tree timed has them (`tpkit.trace.analysis`),
    else nothing: a baseline tree from before them (``--src``) derives and validates apart."""
    try:
        from tpkit.trace.analysis import Analysis
    except ImportError:
        return {}
    return {"analysis": Analysis(model)}


def _why(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def rows(only: list[str] | None, families: bool) -> list[tuple[str, str]]:
    from tests.tiny import architectures

    found = [(t, c) for t, c, _ in architectures()]
    if families:
        from tests.tiny_family import family_architectures

        found += [(t, c) for t, c, _ in family_architectures()]
    found = list(dict.fromkeys(found))
    return [r for r in found if not only or r[0] in only or r[1] in only]


def measure(row: tuple[str, str], tp: int, src: Path, plans: Path | None, timeout: int) -> dict:
    """One row in a fresh process: its wall time and peak RSS, and what it reported."""
    env = dict(os.environ, PYTHONPATH=f"{src}:{ROOT}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "benchmarks.planning", "--child", *row, "--tp", str(tp)]
    cmd += ["--plans", str(plans)] if plans else []
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
        status = None
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, _ = proc.communicate()
        status = "timeout"
    wall = time.perf_counter() - start
    out = {"architecture": row[0], "class": row[1], "wall": round(wall, 2)}
    last = (stdout or "").strip().splitlines()[-1:] or [""]
    try:
        out.update(json.loads(last[0]))
    except json.JSONDecodeError:
        out["status"] = status or f"crashed (exit {proc.returncode})"
    if status:
        out["status"] = status
    return out


def run(args: argparse.Namespace) -> list[dict]:
    todo = rows(args.only, args.families)
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    done: list[dict] = []
    if args.resume and (out_dir / "planning.json").exists():  # the rows a stopped run wrote
        done = json.loads((out_dir / "planning.json").read_text())["rows"]
        seen = {(r["architecture"], r["class"]) for r in done}
        todo = [r for r in todo if r not in seen]
    start = time.perf_counter()
    for i, row in enumerate(todo, 1):
        runs = [measure(row, args.tp, args.src, args.plans, args.timeout)]
        while len(runs) < args.repeats and runs[-1].get("status") == "ok":
            runs.append(measure(row, args.tp, args.src, None, args.timeout))
        r = min(runs, key=lambda x: x["wall"])  # the least disturbed run on a shared machine
        if len(runs) > 1:
            r["runs"] = [x["wall"] for x in runs]
        done.append(r)
        mb = (r.get("peak_rss") or 0) / 2**20
        print(f"{i}/{len(todo)} {row[1]}: {r['wall']:.1f} s, {mb:.0f} MB, {r.get('status')}",
              file=sys.stderr, flush=True)  # fmt: skip
        write(out_dir, done, args, time.perf_counter() - start)
    return done


def write(out_dir: Path, rows_: list[dict], args: argparse.Namespace, seconds: float) -> None:
    slow = sorted(rows_, key=lambda r: -r["wall"])
    meta = {
        "tp": args.tp,
        "src": str(args.src),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "python": platform.python_version(),
        "rows": len(rows_),
        "repeats": getattr(args, "repeats", 1),
        "seconds": round(seconds, 1),
        "goal": {"wall_s": GOAL_SECONDS, "peak_rss_bytes": GOAL_BYTES},
        "over_goal": [
            r["class"]
            for r in rows_
            if r["wall"] > GOAL_SECONDS or (r.get("peak_rss") or 0) > GOAL_BYTES
        ],
    }
    data = {"summary": meta, "slowest": [r["class"] for r in slow[:10]], "rows": rows_}
    (out_dir / "planning.json").write_text(json.dumps(data, indent=1) + "\n")
    (out_dir / "planning.md").write_text(markdown(meta, slow))


def markdown(meta: dict, slow: list[dict]) -> str:
    head = (
        "| architecture | class | wall s | peak MB | imports | build | derive | validate | status |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )

    def line(r: dict) -> str:
        mb = (r.get("peak_rss") or 0) / 2**20
        cells = [r.get(k, "") for k in ("imports", "build", "derive", "validate")]
        status = r.get("status", "")
        if r.get("error"):
            status += f" ({r['error'][:80]})"
        return (
            f"| {r['architecture']} | {r['class']} | {r['wall']:.1f} | {mb:.0f} | "
            + " | ".join(str(c) for c in cells)
            + f" | {status} |\n"
        )

    over = meta["over_goal"]
    again = sum(1 for r in slow if r.get("runs"))
    repeated = (
        f" {again} rows ran more than once (`--repeats`): the fastest run is shown, every run's"
        " wall time is in planning.json (`runs`)."
        if again
        else ""
    )
    text = (
        f"# Planning speed: `tpkit plan --tp {meta['tp']}` on every default config (meta)\n\n"
        f"{meta['rows']} rows, each in a fresh process ({meta['machine']}; wall time includes "
        f"the imports). Goal: <= {GOAL_SECONDS:.0f} s and <= 1 GiB peak RSS each; "
        f"{len(over)} over it{': ' + ', '.join(over[:20]) if over else ''}.{repeated}\n\n"
        "## The ten slowest\n\n" + head + "".join(line(r) for r in slow[:10])
    )
    return text + "\n## Every row\n\n" + head + "".join(line(r) for r in slow)


def run_ab(args: argparse.Namespace) -> list[dict]:
    """``--ab BASE_SRC``: each row planned by the base tree and by this one, interleaved
    (base, now, base, now ...: a shared machine's slow minutes fall on both), the fastest of
    ``--repeats`` runs of each kept; the plans of both trees go to ``--plans`` (``.base`` and
    this tree's) for `benchmarks.plan_snapshot` ``--compare``. Writes ``planning_ab.json`` and
    ``planning_ab.md`` to ``--out``."""
    out: list[dict] = []
    trees = {"base": args.ab, "now": args.src}
    plans = {"base": None, "now": None}
    if args.plans:
        plans = {"base": args.plans.with_suffix(".base.jsonl"), "now": args.plans}
    for i, row in enumerate(rows(args.only, args.families), 1):
        runs: dict[str, list[dict]] = {"base": [], "now": []}
        for rep in range(args.repeats):
            for tree, src in trees.items():
                runs[tree].append(measure(row, args.tp, src, plans[tree] if not rep else None,
                                          args.timeout))  # fmt: skip
        best = {t: min(r, key=lambda x: x["wall"]) for t, r in runs.items()}
        for t, r in runs.items():
            best[t]["runs"] = [x["wall"] for x in r]
        out.append({"architecture": row[0], "class": row[1], **best})
        print(f"{i} {row[1]}: base {best['base']['wall']:.1f} s, now {best['now']['wall']:.1f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    meta = {
        "what": f"tpkit plan --tp {args.tp} (benchmarks.planning --ab), base tree and this one",
        "base": args.base_label or str(args.ab),
        "now": str(args.src),
        "tp": args.tp,
        "repeats": args.repeats,
        "interleaved": True,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "goal": {"wall_s": GOAL_SECONDS, "peak_rss_bytes": GOAL_BYTES},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "rows": out}
    (args.out / "planning_ab.json").write_text(json.dumps(data, indent=1) + "\n")
    (args.out / "planning_ab.md").write_text(markdown_ab(meta, out))
    return out


def markdown_ab(meta: dict, rows_: list[dict]) -> str:
    head = (
        "| architecture | class | base wall s | now wall s | now ÷ base | base derive s "
        "| now derive s | now <= 10 s |\n|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in sorted(rows_, key=lambda r: -r["base"]["wall"]):
        b, n = r["base"], r["now"]
        ok = "yes" if n["wall"] <= GOAL_SECONDS and n.get("status") == "ok" else "**no**"
        lines.append(
            f"| {r['architecture']} | {r['class']} | {b['wall']:.1f} | {n['wall']:.1f} | "
            f"{n['wall'] / b['wall']:.2f}x | {b.get('derive', 0):.2f} | {n.get('derive', 0):.2f} "
            f"| {ok} |\n"
        )
    return (
        f"# Planning, base tree and this one: `tpkit plan --tp {meta['tp']}`\n\n"
        f"Each row in a fresh process per run, the two trees interleaved, the fastest of "
        f"{meta['repeats']} runs each ({meta['machine']}; wall time includes the imports). "
        f"Base: `{meta['base']}`.\n\n" + head + "".join(lines)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=2, metavar=("MODEL_TYPE", "CLASS"), help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--only", nargs="*", help="model types or class names (default: all)")
    ap.add_argument("--families", action="store_true", help="every family's rows too")
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="the tpkit tree to time")
    ap.add_argument("--plans", type=Path, help="append each derived plan here (JSONL)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per row")
    ap.add_argument("--resume", action="store_true", help="keep the rows --out has, run the rest")
    ap.add_argument("--repeats", type=int, default=1, help="runs per row, the fastest kept")
    ap.add_argument("--ab", type=Path, help="a base tree's src: time both, interleaved")
    ap.add_argument("--base-label", help="what the base tree is (a commit), for the tables")
    args = ap.parse_args(argv)
    if args.child:
        plans = str(args.plans) if args.plans else None
        out = child(*args.child, args.tp, plans)
        # the whole process's peak: this child is nothing but the one plan (KiB on Linux)
        out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps(out), flush=True)
        gc.freeze()  # as `tpkit plan` ends (tpkit.trace.gc_quiet.freeze_before_exit)
        return 0
    run_ab(args) if args.ab else run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
