"""Ready in a blink (issue 44): ``from_pretrained`` until a first forward has run, side by side.

Each measurement is a fresh process (torchrun at tp, plain ``python`` for one process) that
imports torch, transformers, the Llama modeling code and tpkit and brings the process group up
BEFORE the clock; the clock then runs from the call until a first 1 x 8 no-grad forward has
finished on every rank (transformers returns weights that are still file-mapped and pays for
them at that forward, so the load alone would flatter it). Systems:

- ``tpkit, plan cached``: ``tpkit.from_pretrained(path)`` with a plan cache that holds the plan
  (``TPKIT_PLAN_CACHE``, filled by one untimed run first): no planning at all;
- ``tpkit, first run``: the same with an empty plan cache (a new folder per run): plans, stores;
- ``tpkit, cache off``: ``TPKIT_PLAN_CACHE=off``, planning every run (tpkit before the cache);
- ``tpkit @ base`` (with ``--base-src DIR``): another tpkit tree, e.g. ``git archive`` of main;
- ``transformers TP``: ``AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")``;
- ``one process``: ``AutoModelForCausalLM.from_pretrained(path)``, one process, all cores.

A second table times ``tpkit.tensor_parallel(model, plan="infer")`` of a model already in memory
(loaded by transformers before the clock, ``TPKIT_PLAN_CACHE=off``: the plan is inferred from
the model's dataflow, nothing read from a cache) against one forward of the split model over
``FORWARD_SHAPE`` tokens (the ``make bench`` forward's batch x seq; median of 3 after one
warm-up): the issue's "splitting costs no more than one forward".

Rounds are interleaved (each round runs every system once, back to back, the order rotating);
a system's figure is its best round (the least disturbed on a shared machine), and the ratios
are of best times. tpkit's rows also say where its time went (the slowest rank's phases).

    python -m benchmarks.ready                       # 57M and 300M Llama, tp=2, best of 3
    python -m benchmarks.ready --sizes 57m 300m 1b   # and a 1.1B (TinyLlama-shaped) one
    python -m benchmarks.ready --sizes 57m --repeats 5 --base-src /tmp/main-src

Writes ``benchmarks/results/ready.json`` and ``ready.md`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    "57m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4),
    "300m": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=8),
    # TinyLlama-1.1B's shape: a mid-sized model for the tensor_parallel-vs-forward row
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4),
}  # fmt: skip
TPKIT = ("tpkit, plan cached", "tpkit, first run", "tpkit, cache off")
OTHERS = ("transformers TP", "one process")
INFERRED = "tensor_parallel, inferred plan"
FORWARD_SHAPE = (2, 64)
PHASES = ("config", "plan", "split", "read", "forward")


def _config(size: str) -> dict:
    return {
        **SIZES[size],
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }


# ---- one measurement, in its own process --------------------------------------------------------
def _timed(module, name: str, phases: dict, phase: str) -> None:
    """Wrap ``module.name`` so that its time adds to ``phases[phase]``."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - start

    setattr(module, name, wrapper)


def child(system: str, path: str) -> None:
    import importlib

    import torch
    import torch.distributed as dist
    import transformers

    for name in (
        "transformers.models.llama.modeling_llama",
        "transformers.integrations.tensor_parallel",
        "transformers.models.auto.modeling_auto",
        "tpkit.pretrained",
        "tpkit.plan.derive",
    ):
        importlib.import_module(name)
    import tpkit
    import tpkit.pretrained as pre

    distributed = system != "one process"
    if distributed:
        from tpkit.parallel.gloo_exit import install_exit_fence

        dist.init_process_group("gloo")
        install_exit_fence()  # transformers' runs too: no SIGABRT at exit (torch's gloo bug)
        dist.barrier()
    phases: dict[str, float] = {}
    if system == INFERRED:
        _inferred(path)
        return
    if system.startswith("tpkit"):
        import tpkit.parallelize as par

        _timed(pre, "_load_config", phases, "config")
        plan_fn = "plan_for" if hasattr(par, "plan_for") else "derive_plan"
        _timed(par, plan_fn, phases, "plan")
        _timed(par, "apply_tensor_parallel", phases, "split")
        _timed(pre, "stream_params", phases, "read")
    start, cpu = time.perf_counter(), time.process_time()
    if system.startswith("tpkit"):
        model = tpkit.from_pretrained(path)
    elif system == "transformers TP":
        model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
    loaded = time.perf_counter()
    with torch.no_grad():
        model(input_ids=torch.arange(3, 11)[None])
    phases["forward"] = time.perf_counter() - loaded
    if distributed:
        dist.barrier()
    ready = time.perf_counter() - start
    figures = {
        "ready_s": ready,
        "load_s": loaded - start,
        "cpu_s": time.process_time() - cpu,
        **{f"{k}_s": v for k, v in phases.items()},
    }
    if distributed:  # the slowest rank's figures
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, figures)
        figures = {k: max(f.get(k, 0.0) for f in every) for k in figures}
        dist.destroy_process_group()
    if not distributed or int(os.environ.get("RANK", "0")) == 0:
        print("READY " + json.dumps(figures), flush=True)


def _inferred(path: str) -> None:
    """`INFERRED`: the split of a model in memory with an inferred plan, then forwards."""
    import torch
    import torch.distributed as dist
    import transformers

    import tpkit

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    for p in model.parameters():  # every page touched before the clock, as a trained model's
        p.data.add_(0)
    dist.barrier()
    start = time.perf_counter()
    model = tpkit.tensor_parallel(model, plan="infer")
    split = time.perf_counter() - start
    torch.manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, FORWARD_SHAPE)
    times = []
    with torch.no_grad():
        for _ in range(4):
            dist.barrier()
            t = time.perf_counter()
            model(input_ids=x, use_cache=False)
            dist.barrier()
            times.append(time.perf_counter() - t)
    figures = {"ready_s": split, "split_call_s": split, "forward_s": sorted(times[1:])[1]}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, figures)
    figures = {k: max(f[k] for f in every) for k in figures}
    dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print("READY " + json.dumps(figures), flush=True)


# ---- the rounds ---------------------------------------------------------------------------------
def _run(system: str, path: Path, tp: int, env: dict, src: Path) -> dict:
    python = sys.executable
    args = ["-m", "benchmarks.ready", "--child", system, str(path)]
    if system == "one process":
        cmd = [python, *args]
        threads = str(len(os.sched_getaffinity(0)))
    else:
        cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"]
        cmd += args
        threads = "1"
    env = {
        **os.environ,
        **env,
        "OMP_NUM_THREADS": threads,
        "PYTHONPATH": f"{src}:{ROOT}",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if "READY " in ln]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{system} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].split("READY ", 1)[1])


def measure(args) -> dict:
    from benchmarks.common import count_params, ensure_checkpoint

    work = Path(tempfile.mkdtemp(prefix="tpkit-ready-"))
    src = ROOT / "src"
    systems = list(TPKIT)
    if args.base_src:
        systems.append("tpkit @ base")
    systems += [*OTHERS, INFERRED]
    if args.systems:
        systems = [s for s in systems if s in args.systems]
    out: dict = {"sizes": {}, "systems": systems}
    try:
        for size in args.sizes:
            cfg = _config(size)
            path = ensure_checkpoint(cfg)
            warm = work / f"warm-{size}"
            _run("tpkit, first run", path, args.tp, {"TPKIT_PLAN_CACHE": str(warm)}, src)
            runs: dict[str, list[dict]] = {s: [] for s in systems}
            for r in range(args.repeats):
                order = systems[r % len(systems) :] + systems[: r % len(systems)]
                for system in order:
                    env, tree = {}, src
                    if system == "tpkit, plan cached":
                        env["TPKIT_PLAN_CACHE"] = str(warm)
                    elif system == "tpkit, first run":
                        env["TPKIT_PLAN_CACHE"] = str(work / f"miss-{size}-{r}")
                    elif system in ("tpkit, cache off", "tpkit @ base", INFERRED):
                        env["TPKIT_PLAN_CACHE"] = "off"
                        tree = Path(args.base_src) if system == "tpkit @ base" else src
                    figures = _run(system, path, args.tp, env, tree)
                    runs[system].append(figures)
                    print(f"{size} round {r + 1} {system}: {figures['ready_s']:.3f} s", flush=True)
            out["sizes"][size] = {"n_params": count_params(cfg), "config": cfg, "runs": runs}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def summarise(result: dict) -> list[dict]:
    rows = []
    for size, data in result["sizes"].items():
        best = {s: min(data["runs"][s], key=lambda f: f["ready_s"]) for s in result["systems"]}
        hf = best["transformers TP"]["ready_s"] if "transformers TP" in best else float("nan")
        plain = best["one process"]["ready_s"] if "one process" in best else float("nan")
        for system in result["systems"]:
            f = best[system]
            if system == INFERRED:
                rows.append(
                    {
                        "size": size,
                        "n_params": data["n_params"],
                        "system": system,
                        "split_call_s": f["split_call_s"],
                        "forward_s": f["forward_s"],
                        "vs_forward": f["split_call_s"] / f["forward_s"],
                        "rounds_s": [r["split_call_s"] for r in data["runs"][system]],
                    }
                )
                continue
            rows.append(
                {
                    "size": size,
                    "n_params": data["n_params"],
                    "system": system,
                    "ready_s": f["ready_s"],
                    "cpu_s": f.get("cpu_s"),
                    "rounds_s": [r["ready_s"] for r in data["runs"][system]],
                    "vs_transformers": f["ready_s"] / hf,
                    "vs_one_process": f["ready_s"] / plain,
                    **{p: f.get(f"{p}_s") for p in PHASES},
                }
            )
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    head = (
        "| model | system | ready s (best) | rounds s | ÷ transformers TP | ÷ one process | CPU s | "
        + " | ".join(f"{p} s" for p in PHASES)
        + " |"
    )
    lines = [head, "|" + "---|" * (7 + len(PHASES))]
    split = [
        f'`tpkit.tensor_parallel(model, plan="infer")` of a model in memory (plan cache off) '
        f"÷ one forward of the split model over {FORWARD_SHAPE[0]} × {FORWARD_SHAPE[1]} tokens "
        "(the slowest rank; best of the rounds; forward: median of 3 after a warm-up)",
        "",
        "| model | tensor_parallel s (best) | rounds s | forward s | ÷ one forward |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["system"] == INFERRED:
            rounds = ", ".join(f"{x:.2f}" for x in r["rounds_s"])
            split.append(
                f"| {r['size']} ({r['n_params'] / 1e6:.0f}M) | {r['split_call_s']:.3f} | {rounds} "
                f"| {r['forward_s']:.3f} | {r['vs_forward']:.2f}× |"
            )
            continue
        phases = " | ".join("—" if r[p] is None else f"{r[p]:.3f}" for p in PHASES)
        rounds = ", ".join(f"{x:.2f}" for x in r["rounds_s"])
        lines.append(
            f"| {r['size']} ({r['n_params'] / 1e6:.0f}M) | {r['system']} | {r['ready_s']:.3f} | "
            f"{rounds} | {r['vs_transformers']:.2f}× | {r['vs_one_process']:.2f}× | "
            f"{r['cpu_s'] or 0:.3f} | {phases} |"
        )
    goals = ["", "| goal | model | figure | target | met |", "|---|---|---|---|---|"]
    for r in rows:
        if r["system"] == INFERRED:
            met = "yes" if r["vs_forward"] <= 1.0 else "**no**"
            goals.append(
                f"| tensor_parallel (inferred) ÷ one forward | {r['size']} | "
                f"{r['vs_forward']:.2f} | <= 1.0 | {met} |"
            )
        if r["system"] != "tpkit, plan cached":
            continue
        for what, value, target in (
            ("ready ÷ transformers TP", r["vs_transformers"], 1.0),
            ("ready ÷ one process", r["vs_one_process"], 1.5),
        ):
            met = "yes" if value <= target else "**no**"
            goals.append(f"| {what} | {r['size']} | {value:.2f} | <= {target} | {met} |")
    return "\n".join(
        [
            "# Ready in a blink: `from_pretrained` until a first forward (`ready`)",
            f"{meta['date']} · {meta['machine']} · tp={meta['tp']}, best of {meta['repeats']} "
            f"interleaved rounds, each a fresh process (imports and the process group before the "
            "clock) · rank 0 plans, the other ranks receive its plan",
            "\n\n".join(__doc__.split("\n\n")[1:5]),
            "Phases (tpkit, the slowest rank): `config` reading config.json, `plan` the plan "
            "(read from the cache, or derived), `split` the styles applied on meta, `read` the "
            "rank's slices read into its shards, `forward` the first 1 × 8 forward.",
            "\n".join(lines),
            *(["\n".join(split)] if len(split) > 4 else []),
            "\n".join(goals),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", nargs=2, metavar=("SYSTEM", "PATH"), help=argparse.SUPPRESS)
    p.add_argument("--sizes", nargs="+", default=["57m", "300m"], choices=list(SIZES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--systems", nargs="+", help="run only these systems (names as in the table)")
    p.add_argument("--base-src", help="another tpkit tree's src/ for a 'tpkit @ base' row")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    import platform

    import torch
    import transformers

    result = measure(args)
    rows = summarise(result)
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores · torch {torch.__version__}, "
        f"transformers {transformers.__version__} · tpkit {commit}",
        "tp": args.tp,
        "repeats": args.repeats,
        "load_average": os.getloadavg(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "ready"
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows, **result}, indent=1))
    text = markdown(rows, meta)
    (out / f"{name}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
