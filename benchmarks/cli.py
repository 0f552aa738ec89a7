"""``python -m benchmarks [suite ...] [--tp 1 2] [--dtype float32 bfloat16] [--size base]``.

Runs every suite under torchrun itself (one OpenMP thread per rank), the tensor-parallel package
in its own venv, and writes ``benchmarks/results/<suite>.{json,md}`` plus ``summary.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import report, tp_package
from benchmarks.common import PRESETS, cache_root, count_params, ensure_checkpoint, model_config
from benchmarks.suites import all_suites
from benchmarks.systems import ALL_SYSTEMS, PACKAGE_SYSTEM, TORCHRUN_SYSTEMS

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def parse(argv: list[str] | None) -> argparse.Namespace:
    suites = all_suites()
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("suites", nargs="*", help=f"suites to run (default: all of {list(suites)})")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes (default 1 2)")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--systems", nargs="+", default=list(ALL_SYSTEMS), choices=ALL_SYSTEMS)
    p.add_argument("--size", default="base", choices=list(PRESETS), help="model preset")
    for flag, key in [
        ("--hidden", "hidden_size"),
        ("--intermediate", "intermediate_size"),
        ("--layers", "num_hidden_layers"),
        ("--heads", "num_attention_heads"),
        ("--kv-heads", "num_key_value_heads"),
        ("--vocab", "vocab_size"),
    ]:
        p.add_argument(flag, dest=key, type=int, help=f"override the preset's {key}")
    p.add_argument("--batch", type=int, default=2, help="forward/step batch")
    p.add_argument("--seq", type=int, default=64, help="forward/step sequence length")
    p.add_argument("--gen-batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="forward repeats (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--step-repeats", type=int, default=3)
    p.add_argument("--step-warmup", type=int, default=0, help="beyond the untimed first step")
    p.add_argument("--gen-repeats", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=3, help="timed steps of the train suite")
    p.add_argument(
        "--train-size",
        default="small",
        choices=[*PRESETS, "same"],
        help="model preset of the train suite (default small, to finish in ~3 min; 'same': --size "
        "with its overrides)",
    )
    p.add_argument(
        "--gen-warmup", type=int, default=0, help="beyond the untimed token-check generate"
    )
    p.add_argument(
        "--isolated-dtype",
        nargs="+",
        default=["float32"],
        help="dtypes for the one-process-per-system suites (memory, load); default float32",
    )
    p.add_argument(
        "--tp1-all",
        action="store_true",
        help="also run transformers TP and tensor-parallel at tp=1 (both are the plain model there)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    p.add_argument("--timeout", type=int, default=900, help="seconds per launched run")
    p.add_argument("--no-readme", action="store_true", help="leave benchmarks/README.md as is")
    args = p.parse_args(argv)
    unknown = [s for s in args.suites if s not in suites]
    if unknown:
        p.error(f"unknown suite(s) {unknown}; choose from {list(suites)}")
    return args


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    return env


def _launch(cmd: list[str], spec: dict, timeout: int, label: str) -> dict[str, list]:
    """Run one worker command with ``spec``; return its ``{suite: rows}`` or raise with why."""
    work = Path(tempfile.mkdtemp(prefix="run-", dir=cache_root()))
    spec = {**spec, "out": str(work / "out.json")}
    (work / "spec.json").write_text(json.dumps(spec))
    log = work / "log.txt"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [*cmd, str(work / "spec.json")],
            cwd=ROOT,
            env=_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # this run's own process group only
            proc.wait()
            rc = "timeout"
    print(f"[bench] {label}: {time.perf_counter() - t0:.0f} s", flush=True)
    out = Path(spec["out"])
    if rc == 0 and out.exists():
        return json.loads(out.read_text())
    tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-3:]
    raise RuntimeError(f"run failed (rc={rc}, log {log}): " + " / ".join(tail)[-400:])


def _torchrun(tp: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={tp}",
        "-m",
        "benchmarks.worker",
    ]


def _machine() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except OSError:
        mem = float("nan")
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": round(mem),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": commit or "?",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    suites = all_suites()
    skipped: dict[str, str] = {}
    names = args.suites or [n for n, s in suites.items() if s.default]
    for n in list(names):
        reason = suites[n].available()
        if reason:
            skipped[n] = reason
            names.remove(n)
    overrides = {
        k: getattr(args, k)
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        )
    }
    cfg = model_config(args.size, overrides)
    cache_root().mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    ckpt = ensure_checkpoint(cfg)
    warm = ensure_checkpoint(model_config("tiny"))
    n_params = count_params(cfg)
    settings = {
        k: getattr(args, k)
        for k in (
            "size",
            "batch",
            "seq",
            "gen_batch",
            "prompt_len",
            "new_tokens",
            "repeats",
            "warmup",
            "step_repeats",
            "step_warmup",
            "gen_repeats",
            "gen_warmup",
            "train_steps",
            "train_size",
        )
    }
    settings.update(
        tp=args.tp, dtype=args.dtype, systems=args.systems, isolated_dtype=args.isolated_dtype
    )
    base_spec = {
        **settings,
        "model": cfg,
        "n_params": n_params,
        "checkpoint": str(ckpt),
        "warm_checkpoint": str(warm),
    }
    print(f"[bench] {n_params / 1e6:.1f}M-parameter model at {ckpt}; suites {names}", flush=True)

    pkg_py, pkg_reason = None, ""
    if PACKAGE_SYSTEM in args.systems and any(suites[n].package for n in names):
        pkg_py, pkg_reason = tp_package.ensure_venv()
    pkg_cmd = [str(pkg_py), "-m", "benchmarks.tp_package"] if pkg_py else None

    results: dict[str, list] = {n: [] for n in names}
    shared = [n for n in names if not suites[n].isolated]
    isolated = [n for n in names if suites[n].isolated and not suites[n].launches]
    launched = [n for n in names if suites[n].launches]
    tr_systems = [s for s in TORCHRUN_SYSTEMS if s in args.systems]

    def fail(suite_names, systems, tp, dtype, why):
        for n in suite_names:
            results[n] += [{"system": s, "tp": tp, "dtype": dtype, "status": why} for s in systems]

    def collect(got: dict[str, list], only: str | None = None):
        for n, rows in got.items():
            results[n] += [r for r in rows if only is None or r["system"] == only]

    for dtype in args.dtype:
        for tp in args.tp:
            spec = {**base_spec, "dtype": dtype, "tp": tp}
            # At tp=1 transformers' TP and the package are the plain model: skip unless asked.
            skip = set() if (tp > 1 or args.tp1_all) else {"transformers", PACKAGE_SYSTEM}
            tr_run = [s for s in tr_systems if s not in skip]
            if shared and tr_run:
                label = f"{','.join(shared)} tp={tp} {dtype}"
                try:
                    collect(
                        _launch(
                            _torchrun(tp),
                            {**spec, "suites": shared, "systems": tr_run, "isolated": False},
                            args.timeout,
                            label,
                        )
                    )
                except RuntimeError as e:
                    fail(shared, tr_run, tp, dtype, str(e))
            pkg_shared = [n for n in shared if suites[n].package]
            if PACKAGE_SYSTEM in args.systems and PACKAGE_SYSTEM not in skip and pkg_shared:
                if pkg_cmd is None:
                    fail(pkg_shared, [PACKAGE_SYSTEM], tp, dtype, pkg_reason)
                else:
                    try:
                        got = _launch(
                            pkg_cmd,
                            {**spec, "suites": pkg_shared, "isolated": False},
                            args.timeout,
                            f"{','.join(pkg_shared)} tensor-parallel tp={tp} {dtype}",
                        )
                        collect(got, only=PACKAGE_SYSTEM)
                    except RuntimeError as e:
                        fail(pkg_shared, [PACKAGE_SYSTEM], tp, dtype, str(e))
            for n in isolated if dtype in args.isolated_dtype else ():
                # the unsharded model is the same at every tp: measure it once, at tp=1
                systems = [s for s in tr_run if not (s == "plain" and tp > 1)]
                if (
                    suites[n].package
                    and PACKAGE_SYSTEM in args.systems
                    and PACKAGE_SYSTEM not in skip
                ):
                    systems.append(PACKAGE_SYSTEM)
                for s in systems:
                    one = {**spec, "suites": [n], "systems": [s], "isolated": True}
                    if s == PACKAGE_SYSTEM and pkg_cmd is None:
                        fail([n], [s], tp, dtype, pkg_reason)
                        continue
                    cmd = pkg_cmd if s == PACKAGE_SYSTEM else _torchrun(tp)
                    try:
                        collect(_launch(cmd, one, args.timeout, f"{n} {s} tp={tp} {dtype}"))
                    except RuntimeError as e:
                        fail([n], [s], tp, dtype, str(e))

    if launched and args.train_size != "same":
        tcfg = model_config(args.train_size)
        train_spec = {
            **base_spec,
            "model": tcfg,
            "n_params": count_params(tcfg),
            "checkpoint": str(ensure_checkpoint(tcfg)),
        }
    else:
        train_spec = base_spec
    train_meta = {"preset": args.train_size if args.train_size != "same" else args.size}
    train_meta["n_params"] = train_spec["n_params"]
    for n in launched:  # the suite picks its runs and their world sizes (train: dp x tp)
        model_spec = train_spec if suites[n].train_model else base_spec
        for dtype in args.isolated_dtype:
            spec = {**model_spec, "dtype": dtype, "suites": [n], "isolated": True}
            for run_name, nproc in suites[n].launches(spec):
                try:
                    collect(
                        _launch(
                            _torchrun(nproc),
                            {**spec, "tp": nproc, "systems": [run_name]},
                            args.timeout,
                            f"{n} {run_name} ({nproc} ranks) {dtype}",
                        )
                    )
                except RuntimeError as e:
                    fail([n], [run_name], nproc, dtype, str(e))
        if suites[n].finish:
            results[n] = suites[n].finish(results[n])

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "model": cfg,
        "n_params": n_params,
        "settings": settings,
        "wall_s": round(time.perf_counter() - t_start),
    }
    if any(suites[n].train_model for n in launched):
        meta["train_model"] = train_meta
    summary = report.write_all(args.out, suites, results, meta, skipped)
    if not args.no_readme and args.out.resolve() == DEFAULT_OUT:
        report.update_readme(Path(__file__).resolve().parent / "README.md", summary)
    print(f"[bench] done in {meta['wall_s']} s; results in {args.out}", flush=True)
    print((args.out / "summary.md").read_text(), flush=True)
    return 0
