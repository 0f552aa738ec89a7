"""The ``tensor-parallel`` package (PyPI 2.0.0, last release 2023) in its own virtualenv.

It needs ``setuptools<81`` (it imports ``pkg_resources``), so it lives in
``benchmarks/.venv-tp`` (git-ignored), which sees the main venv's torch and transformers through a
``.pth`` file: the same libraries, only the package and an old setuptools added. It runs in one
process with one thread per "device" (``["cpu", "cpu"]`` for tp=2), so it is driven here in a
single process rather than under torchrun: ``.venv-tp/bin/python -m benchmarks.tp_package SPEC``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

VENV = Path(__file__).resolve().parent / ".venv-tp"
REQUIREMENTS = ["tensor-parallel==2.0.0", "setuptools<81"]


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_venv() -> tuple[Path | None, str]:
    """Create the venv if needed; return (its python, "") or (None, why it cannot be used)."""
    py = venv_python()
    probe = [str(py), "-W", "ignore", "-c", "import tensor_parallel, transformers, torch"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return py, ""
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(VENV)],
            check=True,
            capture_output=True,
        )
        out = subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        )
        site = Path(out.stdout.strip())
        main_paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
        (site / "_tpkit_main_venv.pth").write_text("\n".join(sorted(main_paths)) + "\n")
        pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps"]
        res = subprocess.run(pip + REQUIREMENTS, capture_output=True, text=True)
        if res.returncode != 0:
            return None, "pip install failed: " + (res.stderr.strip().splitlines() or ["?"])[-1]
        res = subprocess.run(probe, capture_output=True, text=True)
        if res.returncode != 0:
            return None, "import failed: " + (res.stderr.strip().splitlines() or ["?"])[-1]
    except (OSError, subprocess.CalledProcessError) as e:
        return None, f"could not create {VENV}: {e}"
    return py, ""


# -- inside the venv --------------------------------------------------------------------------


def _counter(log):
    """Wrap the package's in-process AllReduce / AllGather; record shard 0's calls."""
    from tensor_parallel import communications as c

    from benchmarks.common import _tensor_bytes

    inside = threading.local()
    orig_ar, orig_ag = c.AllReduce.__call__, c.AllGather.__call__

    def all_reduce(self, x, rank):
        if rank == 0:
            log.record("all_reduce", _tensor_bytes(x))
        inside.on = True
        try:
            return orig_ar(self, x, rank)
        finally:
            inside.on = False

    def all_gather(self, x, rank):
        if rank == 0 and not getattr(inside, "on", False):
            log.record("all_gather", _tensor_bytes(x))
        return orig_ag(self, x, rank)

    @contextlib.contextmanager
    def patched():
        c.AllReduce.__call__, c.AllGather.__call__ = all_reduce, all_gather
        try:
            yield
        finally:
            c.AllReduce.__call__, c.AllGather.__call__ = orig_ar, orig_ag

    return patched()


def build_package(ctx, path):
    import tensor_parallel as tpp

    from benchmarks.common import error_text, find_blocks
    from benchmarks.systems import System, _load_hf

    devices = ["cpu"] * ctx.tp
    no_generate = None
    try:  # the documented entry point, which keeps generate(); fails on transformers 5
        model = tpp.tensor_parallel(_load_hf(path, ctx.dtype), devices)
        if not hasattr(model, "generate"):
            no_generate = "no generate() on the returned model"
        note = "tensor_parallel.tensor_parallel()"
    except Exception as e:  # noqa: BLE001 - recorded
        reason = error_text(e, 200)
        no_generate = f"tensor_parallel() fails on transformers 5 ({reason}); TensorParallel has no generate()"
        model = tpp.TensorParallel(_load_hf(path, ctx.dtype), devices)
        note = (
            "TensorParallel(model, ['cpu']*t), automatic config; tensor_parallel() fails: " + reason
        )
    shard0 = model.module_shards[0] if hasattr(model, "module_shards") else model
    if hasattr(shard0, "wrapped_model"):
        shard0 = shard0.wrapped_model.module_shards[0]
    return System(
        name="tensor_parallel",
        model=model,
        params=list(model.parameters()),
        blocks=find_blocks(shard0, ctx.cfg["num_hidden_layers"]),
        count=_counter,
        no_generate=no_generate,
        note=note + f"; one process, {ctx.tp} thread(s)",
        rank_params=list(shard0.parameters()),
    )


def main(argv: list[str]) -> int:
    import torch

    from benchmarks.common import DTYPES, error_text
    from benchmarks.memory import measure
    from benchmarks.suites import all_suites
    from benchmarks.systems import Ctx, load_plain

    spec = json.loads(Path(argv[0]).read_text())
    torch.set_num_threads(1)  # one thread per shard, as one OMP thread per torchrun rank
    ctx = Ctx(spec, spec["tp"], 0, DTYPES[spec["dtype"]], spec["dtype"], lambda: None)
    path = Path(spec["checkpoint"])
    suites = all_suites()
    results: dict[str, list] = {}
    if spec["isolated"]:
        (name,) = spec["suites"]
        try:
            results[name] = measure(ctx, "tensor_parallel", lambda p: build_package(ctx, p), path)
        except Exception as e:  # noqa: BLE001 - recorded
            results[name] = [{**ctx.base_row("tensor_parallel"), "status": error_text(e)}]
    else:
        systems: dict = {}
        try:
            systems["plain"] = load_plain(ctx, path)
        except Exception as e:  # noqa: BLE001 - recorded
            systems["plain"] = "load failed: " + error_text(e)
        try:
            systems["tensor_parallel"] = build_package(ctx, path)
        except Exception as e:  # noqa: BLE001 - recorded
            systems["tensor_parallel"] = "load failed: " + error_text(e)
        for name in spec["suites"]:
            try:
                results[name] = suites[name].run(ctx, systems)
            except Exception as e:  # noqa: BLE001 - recorded
                results[name] = [
                    {**ctx.base_row("tensor_parallel"), "status": "suite failed: " + error_text(e)}
                ]
    Path(spec["out"]).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    sys.exit(main(sys.argv[1:]))
