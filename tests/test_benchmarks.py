"""Smoke test of the benchmark harness (keeps `make bench` from rotting): one suite, a tiny model,
tp=2 under torchrun, in well under a minute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

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


class _Killed(BaseException):
    """Stands for the sweep's process being killed (not an ``Exception``: nothing catches it)."""


def test_coverage_sweep_writes_each_row_and_resumes(tmp_path, monkeypatch):
    """The families sweep (`benchmarks.coverage`, issue 29) writes its report after every
    architecture, so a run killed on the third keeps the first two; a rank group that does not
    answer makes a "timeout" row and the sweep goes on; ``resume`` runs only what is missing
    (``retry``: and the statuses named) and keeps rows outside its selection. The rank-group
    checks are replaced by local stubs (no ranks: fast)."""
    import benchmarks.coverage as cov
    import tests.harness

    class LocalGroup:  # the rank group's interface, run in this process
        alive = True

        def __init__(self, world: int, env=None):
            pass

        def run(self, fn, *args, timeout: float = 0, **kwargs):
            return [fn(*args, **kwargs)]

        def close(self):
            pass

    calls: list[str] = []
    kill_at, hang = {"wav2vec2"}, {"sew"}

    def parity(model_type: str, class_name: str, kind: str) -> dict:
        calls.append(model_type)
        if model_type in kill_at:
            raise _Killed
        if model_type in hang:  # what RankGroup.run raises when ranks do not answer
            raise tests.harness.RankError(
                "ranks [0, 1] did not finish check_parity within 1s (a collective reached by "
                "only some ranks?); the group was killed."
            )
        return {
            "source": "inferred",
            "max_diff": 0.0,
            "parity": True,
            "grad_diff": 0.0,
            "grad_parity": True,
            "grads_missing": [],
            "share_sharded": 1.0,
            "notes": {},
        }

    full = {"full_size_share": 0.95}
    monkeypatch.setattr(tests.harness, "RankGroup", LocalGroup)
    monkeypatch.setattr(cov, "check_parity", parity)
    monkeypatch.setattr(cov, "meta_checks", lambda *a: dict(full), raising=False)
    monkeypatch.setattr(cov, "full_size", lambda *a: dict(full))  # the parent's, before
    monkeypatch.setattr(cov, "infer_share", lambda *a: {})
    monkeypatch.setattr(cov, "build", lambda *a, **k: None)
    monkeypatch.setattr(cov, "tiny_family_config", lambda *a: types.SimpleNamespace())
    every = [(t, f"{t.capitalize()}ForCTC", "ctc") for t in ("data2vec", "hubert", "sew")]
    every += [("wav2vec2", "Wav2Vec2ForCTC", "ctc"), ("vit", "ViTModel", "vision-encoder")]
    monkeypatch.setattr(
        cov, "family_architectures", lambda names=None: [a for a in every if a[2] in (names or ())]
    )  # transformers' mappings read in 10-20 s; the enumeration is not what is tested here
    monkeypatch.setattr(cov, "_every_family_architecture", lambda: every, raising=False)

    only = ["hubert", "sew", "wav2vec2"]
    report = tmp_path / "coverage_families.json"
    with pytest.raises(_Killed):
        cov.run(only, tmp_path, ["ctc"])
    assert report.exists(), "nothing written before the kill"
    rows = {r["architecture"]: r for r in json.loads(report.read_text())["rows"]}
    assert set(rows) == {"hubert", "sew"}, rows
    assert rows["hubert"]["status"] == "ok"
    assert rows["sew"]["status"] == "timeout" and "timed out" in rows["sew"]["why"], rows["sew"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "coverage_families.json",
        "coverage_families.md",
    ]  # no temporary file left behind
    n_ctc = 4
    assert f"| ctc | 2 of {n_ctc} | 1 | 2 | 1 |" in (tmp_path / "coverage_families.md").read_text()

    kill_at.clear()
    calls.clear()
    cov.run(only, tmp_path, ["ctc"], resume=True)
    assert calls == ["wav2vec2"], calls  # the two rows written are kept, not run again
    rows = {r["architecture"]: r for r in json.loads(report.read_text())["rows"]}
    assert [rows[a]["status"] for a in only] == ["ok", "timeout", "ok"]

    hang.clear()  # sew answers this time
    calls.clear()
    cov.run(["hubert", "sew"], tmp_path, ["ctc"], resume=True, retry=("timeout",))
    assert calls == ["sew"], calls
    doc = json.loads(report.read_text())
    assert [r["architecture"] for r in doc["rows"]] == only  # wav2vec2 kept, outside selection
    assert all(r["status"] == "ok" for r in doc["rows"])
    assert doc["summary"]["families"]["ctc"]["parity_and_full_size_90"] == 3

    (tmp_path / "coverage_families.md").unlink()
    assert cov.main(["--markdown-only", "--families", "ctc", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "coverage_families.md").read_text()
    assert f"| ctc | 3 of {n_ctc} | 3 | 3 | 3 |" in text


def test_coverage_compares_gradients_in_training_mode_where_the_backward_needs_it(ranks2):
    """Reformer's reversible layers assert training mode in their backward: its gradients went
    unchecked ("no reference backward"). With no dropout and its full axial length as the tiny
    inputs' length, its training forward repeats the evaluation one and the gradients are
    compared there."""
    from benchmarks.coverage import check_parity

    for r in ranks2.run(check_parity, "reformer", "ReformerForMaskedLM", "masked-lm"):
        assert r["parity"] and r["grad_parity"] is True, r
        assert not r["grads_missing"] and r["grad_scale"] > 0, r
