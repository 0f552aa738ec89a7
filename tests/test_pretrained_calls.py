"""The calls transformers users type, on tpkit.from_pretrained and the CLI: hub ids from the hub
cache, transformers' keywords, and pytorch_model*.bin checkpoints (read without running code).

Nothing can be downloaded here, so each test builds a hub cache itself (``models--org--name/
snapshots/<sha>/...`` with ``refs/main``) and loads from it offline, checking first that
transformers itself loads the same id from it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.models import batch, build, full

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
SHA = "a" * 40
OTHER = "b" * 40


# ---- building checkpoints and a hub cache (in the test process) ------------------------------
def _save(name: str, folder: Path, seed: int = 0, fmt: str = "safetensors", shards: int = 1):
    """``build(name, seed)`` saved to ``folder`` as safetensors (save_pretrained) or as
    ``pytorch_model.bin`` (``shards`` > 1: a sharded set with its index)."""
    model = build(name, seed)
    if fmt == "safetensors":
        model.save_pretrained(folder)
        return model
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if shards == 1:
        torch.save(sd, folder / "pytorch_model.bin")
        return model
    keys = list(sd)
    weight_map = {}
    for i in range(shards):
        fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = keys[i::shards]
        torch.save({k: sd[k] for k in part}, folder / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return model


def _hub_cache(cache: Path, repo: str, snapshots: dict[str, Path], main: str = SHA) -> None:
    """``snapshots`` (commit -> a saved folder) placed in ``cache`` in the hub cache layout,
    ``refs/main`` pointing at ``main``."""
    root = cache / f"models--{repo.replace('/', '--')}"
    for sha, src in snapshots.items():
        shutil.copytree(src, root / "snapshots" / sha, dirs_exist_ok=True)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(main)


# ---- checks (every rank) ---------------------------------------------------------------------
def _logits(model, vocab: int) -> torch.Tensor:
    x = batch(vocab)
    with torch.no_grad():
        return model(input_ids=x).logits


def check_hub_id(repo: str, **kw) -> dict:
    """transformers' own unsharded load of the id, then tpkit's: the same logits."""
    from transformers import AutoModelForCausalLM

    import tpkit

    ref = AutoModelForCausalLM.from_pretrained(repo, **kw).eval()
    model = tpkit.from_pretrained(repo, tp_size=2, **kw)
    v = ref.config.vocab_size
    return {
        "diff": (_logits(model, v) - _logits(ref, v)).abs().max().item(),
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "ref_sum": ref.lm_head.weight.sum().item(),
    }


def check_keywords(repo: str, cache: str) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import tpkit

    out = {}
    default = tpkit.from_pretrained(repo, cache_dir=cache)
    eager = tpkit.from_pretrained(repo, cache_dir=cache, attn_implementation="eager")
    out["attn"] = (default.config._attn_implementation, eager.config._attn_implementation)
    ref = AutoModelForCausalLM.from_pretrained(repo, cache_dir=cache).eval()
    v = ref.config.vocab_size
    out["eager_diff"] = (_logits(eager, v) - _logits(ref, v)).abs().max().item()

    bf16 = tpkit.from_pretrained(repo, cache_dir=cache, torch_dtype=torch.bfloat16)
    ref_sd = ref.state_dict()
    out["bf16"] = all(p.dtype == torch.bfloat16 for p in bf16.parameters()) and all(
        torch.equal(full(p), ref_sd[n].to(torch.bfloat16)) for n, p in bf16.named_parameters()
    )

    dc = tpkit.from_pretrained(
        repo, cache_dir=cache, distributed_config=DistributedConfig(tp_size=2)
    )
    out["dc_tp"] = dc._tpkit.tp_size
    out["dc_diff"] = (_logits(dc, v) - _logits(ref, v)).abs().max().item()

    one = tpkit.from_pretrained(repo, cache_dir=cache, num_hidden_layers=1)
    ref1 = AutoModelForCausalLM.from_pretrained(repo, cache_dir=cache, num_hidden_layers=1).eval()
    out["layers"] = (one.config.num_hidden_layers, len(one.model.layers))
    out["layers_diff"] = (_logits(one, v) - _logits(ref1, v)).abs().max().item()

    trusted = tpkit.from_pretrained(repo, cache_dir=cache, trust_remote_code=False)
    out["trust_diff"] = (_logits(trusted, v) - _logits(ref, v)).abs().max().item()

    for name, kwargs, error in [
        ("device_map", {"device_map": "auto"}, ValueError),
        ("not_a_keyword", {"not_a_keyword": 1}, TypeError),
        ("pp_size", {"distributed_config": DistributedConfig(tp_size=2, pp_size=2)}, ValueError),
    ]:
        try:
            tpkit.from_pretrained(repo, cache_dir=cache, **kwargs)
            out[name] = "accepted"
        except error as exc:
            out[name] = str(exc)
    return out


def check_experts_implementation(path: str) -> dict:
    from transformers import AutoModelForCausalLM

    import tpkit

    model = tpkit.from_pretrained(path, experts_implementation="eager")
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()
    v = ref.config.vocab_size
    return {
        "impl": model.config._experts_implementation,
        "diff": (_logits(model, v) - _logits(ref, v)).abs().max().item(),
    }


def check_local(path: str, ref_path: str, **kw) -> dict:
    """tpkit's load of ``path`` against tpkit's and transformers' loads of ``ref_path``."""
    from transformers import AutoModelForCausalLM

    import tpkit

    model = tpkit.from_pretrained(path, **kw)
    ref = AutoModelForCausalLM.from_pretrained(ref_path).eval()
    v = ref.config.vocab_size
    return {
        "diff": (_logits(model, v) - _logits(ref, v)).abs().max().item(),
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
    }


def check_unsafe(path: str, marker: str) -> dict:
    import tpkit

    try:
        tpkit.from_pretrained(path)
        outcome = "loaded"
    except tpkit.UnsafeCheckpointError as exc:
        outcome = str(exc)
    dist.barrier()  # both ranks refused on their own: no collective was pending
    return {"outcome": outcome, "ran": os.path.exists(marker)}


class _Payload:
    """Unpickled by a plain pickle.load, this would create ``marker`` (runs a shell command)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ---- tests -----------------------------------------------------------------------------------
def test_hub_id_from_the_cache_matches_transformers(ranks2, tmp_path):
    _save("llama", tmp_path / "src")
    _hub_cache(tmp_path / "hub", "org/tiny", {SHA: tmp_path / "src"})
    (r0, r1) = ranks2.run(check_hub_id, "org/tiny", cache_dir=str(tmp_path / "hub"))
    assert r0["diff"] <= TOL and r1["diff"] <= TOL, (r0, r1)
    assert r0["all_dtensor"]


def test_revision_and_subfolder(ranks2, tmp_path):
    _save("llama", tmp_path / "main")
    _save("llama", tmp_path / "other" / "ckpt", seed=3)
    _hub_cache(tmp_path / "hub", "org/tiny", {SHA: tmp_path / "main", OTHER: tmp_path / "other"})
    cache = str(tmp_path / "hub")
    main = ranks2.run(check_hub_id, "org/tiny", cache_dir=cache)
    other = ranks2.run(check_hub_id, "org/tiny", cache_dir=cache, revision=OTHER, subfolder="ckpt")
    assert all(r["diff"] <= TOL for r in main + other), (main, other)
    assert abs(main[0]["ref_sum"] - other[0]["ref_sum"]) > 1e-3  # really another checkpoint


def test_transformers_keywords(ranks2, tmp_path):
    _save("llama", tmp_path / "src")
    _hub_cache(tmp_path / "hub", "org/tiny", {SHA: tmp_path / "src"})
    r = ranks2.run(check_keywords, "org/tiny", str(tmp_path / "hub"))[0]
    assert r["attn"] == ("sdpa", "eager")
    assert r["eager_diff"] <= TOL
    assert r["bf16"]
    assert r["dc_tp"] == 2 and r["dc_diff"] <= TOL
    assert r["layers"] == (1, 1) and r["layers_diff"] <= TOL
    assert r["trust_diff"] <= TOL
    assert "device_map" in r["device_map"] and "tpkit places" in r["device_map"]
    assert "not_a_keyword" in r["not_a_keyword"]
    assert "pp_size=2" in r["pp_size"]


def test_experts_implementation(ranks2, tmp_path):
    _save("qwen3_moe", tmp_path / "m")
    r = ranks2.run(check_experts_implementation, str(tmp_path / "m"))
    assert all(x["impl"] == "eager" and x["diff"] <= TOL for x in r), r


@pytest.mark.parametrize("shards", [1, 3])
def test_bin_checkpoints(ranks2, tmp_path, shards):
    _save("llama", tmp_path / "st")
    _save("llama", tmp_path / "bin", fmt="bin", shards=shards)
    assert not list((tmp_path / "bin").glob("*.safetensors"))
    r = ranks2.run(check_local, str(tmp_path / "bin"), str(tmp_path / "st"), tp_size=2)
    assert all(x["diff"] <= TOL and x["all_dtensor"] for x in r), r


def test_crafted_pickle_is_refused_without_running(ranks2, tmp_path):
    folder = tmp_path / "evil"
    folder.mkdir()
    build("llama").config.save_pretrained(folder)
    marker = tmp_path / "pwned"
    torch.save({"model.embed_tokens.weight": _Payload(str(marker))}, folder / "pytorch_model.bin")
    r = ranks2.run(check_unsafe, str(folder), str(marker))
    assert all("refused" in x["outcome"] and "pytorch_model.bin" in x["outcome"] for x in r), r
    assert not marker.exists() and not any(x["ran"] for x in r)


def test_safetensors_preferred_over_bin(ranks2, tmp_path):
    _save("llama", tmp_path / "both")  # model.safetensors: seed 0
    other = _save("llama", tmp_path / "binonly", seed=5, fmt="bin")
    shutil.copy(tmp_path / "binonly" / "pytorch_model.bin", tmp_path / "both")
    r = ranks2.run(check_local, str(tmp_path / "both"), str(tmp_path / "both"))
    assert all(x["diff"] <= TOL for x in r), r
    (tmp_path / "binref").mkdir()
    other.save_pretrained(tmp_path / "binref")
    r = ranks2.run(
        check_local, str(tmp_path / "both"), str(tmp_path / "binref"), use_safetensors=False
    )
    assert all(x["diff"] <= TOL for x in r), r


def test_cli_plan_takes_a_hub_id(tmp_path):
    _save("llama", tmp_path / "src")
    _hub_cache(tmp_path / "hf" / "hub", "org/tiny", {SHA: tmp_path / "src"})
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tpkit.cli", "plan", "org/tiny", "--tp", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tp_size=2: valid" in proc.stdout
