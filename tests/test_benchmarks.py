"""Smoke test of the benchmark harness (keeps `make bench` from rotting): one suite, a tiny model,
tp=2 under torchrun, in well under a minute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_comm_suite_tiny(tmp_path):
    out = tmp_path / "results"
    env = {**os.environ, "TPKIT_BENCH_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "benchmarks", "comm", "--size", "tiny", "--tp", "2"]
    cmd += ["--dtype", "float32", "--systems", "plain", "tpkit", "transformers"]
    cmd += ["--out", str(out), "--no-readme"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    doc = json.loads((out / "comm.json").read_text())
    for key in ("suite", "date", "machine", "model", "n_params", "settings", "goals", "rows"):
        assert key in doc, key
    rows = {(r["system"], r["tp"]): r for r in doc["rows"]}
    assert set(rows) == {("plain", 2), ("tpkit", 2), ("transformers", 2)}
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["dtype"] == "float32"
    tpkit = rows[("tpkit", 2)]
    assert tpkit["fwd_ar_equiv_per_block"] == 2  # Megatron: 2 all-reduces per block forward
    assert abs(tpkit["vs_limit"] - 1.0) < 1e-9
    assert rows[("plain", 2)]["fwd_ar_equiv_per_block"] == 0
    assert {g["goal"] for g in doc["goals"]} >= {
        "all-reduce equivalents per block, forward, tpkit tp=2"
    }
    assert "| tpkit | 2 | float32 |" in (out / "comm.md").read_text()
    assert (out / "summary.md").exists() and (out / "summary.json").exists()


def test_gpu_check_dry_run_on_cpu(tmp_path):
    """benchmarks/gpu.py (what gpu_check.sh runs on CUDA) end to end on CPU with gloo at tp=2:
    every system loads, parity and the timing sections produce figures, rank 0 writes both files.
    """
    env = {**os.environ, "TPKIT_BENCH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "benchmarks.gpu", "--cpu", "--size", "tiny", "--no-compile", "--repeats", "2"]
    cmd += ["--new-tokens", "4", "--batch", "1", "--seq", "8", "--out", str(tmp_path / "gpu")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "gpu" / "gpu-tp2.json").read_text())
    assert doc["failed"] == {}, doc["failed"]
    assert set(doc["decode"]) == {"plain", "tpkit", "tpkit_load", "transformers"}, doc["decode"]
    for name in ("tpkit", "tpkit_load"):
        assert doc["parity"][name]["same_tokens"], doc["parity"]
        assert doc["decode"][name]["vs_transformers_iqr"] is not None, doc["decode"]
        assert doc["step"][name]["step_ms"] > 0, doc["step"]
    assert "| tpkit (from_pretrained) |" in (tmp_path / "gpu" / "gpu-tp2.md").read_text()
