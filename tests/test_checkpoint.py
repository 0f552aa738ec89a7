"""Checkpoints you can trust: nothing from a checkpoint directory runs, packed (strided) shards
save in their global layout, no crash window loses the last checkpoint, export writes a clean
directory, and a checkpoint that does not fit the model fails early, clearly, on every rank."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers as tf
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.tensor import DTensor

from tests.models import ATTN, batch, build, full

STEP_TOL = 1e-3  # one AdamW step in another layout: float reductions differ, not the state


# ---- helpers ------------------------------------------------------------------------------------
class _Payload:
    """Unpickled, this runs ``exec`` and creates ``marker``: what a planted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def _tiny(seed: int = 0, hidden: int = 4, layers: int = 2):
    torch.manual_seed(seed)
    mods = [torch.nn.Linear(4, hidden)] + [
        torch.nn.Linear(hidden, hidden) for _ in range(layers - 1)
    ]
    model = torch.nn.Sequential(*mods)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _save_tiny(path: Path, step: int = 1, seed: int = 0) -> None:
    import tpkit

    model, opt = _tiny(seed)
    tpkit.save_checkpoint(path, model, opt, step=step)


def _load_tiny(path: Path) -> dict:
    import tpkit

    model, opt = _tiny(seed=123)
    return tpkit.load_checkpoint(path, model, opt)


def _plant_metadata(ck: Path, marker: Path) -> None:
    from tpkit.io import atomic

    (ck / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    atomic.mark_complete(ck)  # an attacker can write the marker too: it is no signature


def _plant_bytes_item(ck: Path, marker: Path) -> str:
    """Point a non-tensor item (an optimizer's lr) at a torch.save of the payload; return the data
    file it is in. The metadata itself stays legitimate."""
    from tpkit.io import atomic
    from tpkit.io.dcp import read_metadata

    md = read_metadata(ck)
    key = next(
        k
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, BytesStorageMetadata) and k.endswith(".lr")
    )
    index = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[index]
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    data_file = ck / info.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(buf.getvalue())
    md.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buf.getvalue()))
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    atomic.mark_complete(ck)
    return info.relative_path


def _train_step(model, opt, seed):
    x = batch(model.config.vocab_size, seed=seed)
    opt.zero_grad()
    model(input_ids=x, labels=x).loss.backward()
    opt.step()


def _fresh(name: str, tp: int | None, seed: int, **tp_kwargs):
    import tpkit

    model = build(name, seed=seed)
    if tp is not None:
        model = tpkit.tensor_parallel(model, tp_size=tp, **tp_kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _optim_state(model, opt) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                out[f"{name}.{k}"] = full(v).detach().clone()
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ---- 2. strided (packed) shards: checks ---------------------------------------------------------
def check_strided_round_trip(
    name: str, path: str, save_tp: int, load_tp: int | None, load_kwargs: dict | None = None
) -> dict:
    """Train a step at save_tp, save; load at load_tp (None = unsharded) into a differently
    initialised model: parameters and optimizer state must be identical, and the next step too
    (same layout) or within float noise (another layout)."""
    import tpkit

    model, opt = _fresh(name, save_tp, seed=0)
    _train_step(model, opt, seed=1)
    tpkit.save_checkpoint(path, model, opt, step=1)
    saved_params = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    saved_state = _optim_state(model, opt)
    _train_step(model, opt, seed=2)  # the continuation to reproduce

    other, other_opt = _fresh(name, load_tp, seed=99, **(load_kwargs or {}))
    extra = tpkit.load_checkpoint(path, other, other_opt)
    params = {n: full(p).detach().clone() for n, p in other.named_parameters()}
    state = _optim_state(other, other_opt)
    _train_step(other, other_opt, seed=2)
    after = {n: full(p) for n, p in model.named_parameters()}
    return {
        "extra": extra,
        "params": _max_diff(params, saved_params),
        "state": _max_diff(state, saved_state),
        "n_state": len(state),
        "step": max((full(p) - after[n]).abs().max().item() for n, p in other.named_parameters()),
        "strided": sorted(
            n
            for n, p in model.named_parameters()
            if isinstance(p, DTensor) and any("_StridedShard" in repr(q) for q in p.placements)
        ),
    }


def check_save_for_export(name: str, path: str, tp: int) -> None:
    import tpkit

    tpkit.save_checkpoint(path, tpkit.tensor_parallel(build(name), tp_size=tp))


# ---- 2. strided (packed) shards: tests ----------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt2", "qwen3_moe"])  # packed q|k|v (3 parts), gate|up (2)
def test_packed_shards_round_trip_at_tp2(ranks2, tmp_path, name):
    for r in ranks2.run(check_strided_round_trip, name, str(tmp_path / "ck"), 2, 2):
        assert r["strided"], r  # the case under test: packed parameters are _StridedShard
        assert r["params"] == 0.0 and r["state"] == 0.0 and r["n_state"] > 0, r
        assert r["step"] == 0.0 and r["extra"] == {"step": 1}, r


@pytest.mark.parametrize("name", ["gpt2", "qwen3_moe"])
def test_packed_shards_tp2_to_unsharded(ranks2, tmp_path, name):
    for r in ranks2.run(check_strided_round_trip, name, str(tmp_path / "ck"), 2, None):
        assert r["params"] == 0.0 and r["state"] == 0.0 and r["step"] <= STEP_TOL, r


@pytest.mark.parametrize(
    ("name", "load_tp", "load_kwargs"),
    [("gpt2", 4, None), ("gpt2", 2, {"sharded": False}), ("qwen3_moe", 4, None)],
)
def test_packed_shards_dp2_tp2_fsdp_reshard(ranks4, tmp_path, name, load_tp, load_kwargs):
    """Saved on dp2 x tp2 with FSDP2 (2-D DTensors (Shard(0), _StridedShard)), loaded at tp=4 or
    at tp=2 with replicated dp."""
    path = str(tmp_path / "ck")
    for r in ranks4.run(check_strided_round_trip, name, path, 2, load_tp, load_kwargs):
        assert r["params"] == 0.0 and r["state"] == 0.0 and r["step"] <= STEP_TOL, r


def test_gpt2_tp2_checkpoint_exports_to_plain_transformers(ranks2, tmp_path):
    import tpkit

    ranks2.run(check_save_for_export, "gpt2", str(tmp_path / "ck"), 2)
    out = tpkit.export_checkpoint(tmp_path / "ck", tmp_path / "hf")
    plain = tf.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ref = build("gpt2")
    x = batch(ref.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(plain(input_ids=x).logits, ref(input_ids=x).logits)


def check_pieces_of_packed_qkv() -> dict:
    import tpkit
    from tpkit.io.dcp import local_pieces

    model = tpkit.tensor_parallel(build("gpt2"))
    w = model.transformer.h[0].attn.c_attn.weight  # (64, 192): q|k|v, _StridedShard(1, sf=3)
    whole = w.full_tensor()
    pieces = list(local_pieces("c_attn.weight", w))
    return {
        "pieces": [(tuple(o), tuple(v.shape)) for o, v in pieces],
        "values": all(
            torch.equal(whole[o[0] : o[0] + v.shape[0], o[1] : o[1] + v.shape[1]], v)
            for o, v in pieces
        ),
    }


def test_a_packed_shard_is_one_piece_per_part_at_its_global_offset(ranks2):
    """Rank r of 2 holds columns [k*64 + r*32, k*64 + (r+1)*32) of each part k of q|k|v."""
    for rank, r in enumerate(ranks2.run(check_pieces_of_packed_qkv)):
        assert r["pieces"] == [((0, k * 64 + rank * 32), (64, 32)) for k in range(3)], r
        assert r["values"], r


# ---- 1. nothing from a checkpoint runs ----------------------------------------------------------
def test_load_refuses_a_planted_metadata_pickle(tmp_path):
    import tpkit
    from tpkit.io.dcp import UnsafeCheckpointError

    ck, marker = tmp_path / "ck", tmp_path / "pwned"
    _save_tiny(ck)
    _plant_metadata(ck, marker)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*builtins\.exec") as info:
        _load_tiny(ck)
    assert isinstance(info.value, ValueError) and isinstance(info.value, pickle.UnpicklingError)
    assert str(ck) in str(info.value)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError):
        tpkit.load_checkpoint(ck, _tiny()[0])  # model only (the Trainer's first resume call)
    assert not marker.exists()


def test_load_refuses_a_planted_bytes_item(tmp_path):
    from tpkit.io.dcp import UnsafeCheckpointError

    ck, marker = tmp_path / "ck", tmp_path / "pwned"
    _save_tiny(ck)
    data_file = _plant_bytes_item(ck, marker)
    with pytest.raises(UnsafeCheckpointError, match=r"the global exec") as info:
        _load_tiny(ck)
    assert str(ck / data_file) in str(info.value) and ".lr" in str(info.value)
    assert not marker.exists()


def _plant_model_bytes_item(ck: Path, marker: Path) -> None:
    """Add a non-tensor model item whose bytes are the payload (a module's ``_extra_state``):
    export reads model items only."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from tpkit.compat import StorageInfo as _StorageInfo
    from tpkit.io import atomic
    from tpkit.io.dcp import read_metadata

    md = read_metadata(ck)
    key = "model.model.norm._extra_state"
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    name = "__planted.distcp"
    (ck / name).write_bytes(buf.getvalue())
    md.state_dict_metadata[key] = BytesStorageMetadata()
    md.planner_data[key] = ("model", "model.norm._extra_state")
    md.storage_data[MetadataIndex(key)] = _StorageInfo(name, 0, len(buf.getvalue()))
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    atomic.mark_complete(ck)


@pytest.mark.parametrize("plant", [_plant_metadata, _plant_model_bytes_item])
def test_export_refuses_planted_pickles(tmp_path, plant):
    import tpkit
    from tpkit.cli.main import main
    from tpkit.io.dcp import UnsafeCheckpointError

    ck, marker = tmp_path / "ck", tmp_path / "pwned"
    model = build("llama")
    tpkit.save_checkpoint(ck, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    plant(ck, marker)
    with pytest.raises(UnsafeCheckpointError, match=r"global (builtins\.)?exec"):
        main(["export", str(ck), str(tmp_path / "hf")])
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_a_checkpoint_round_trip_unpickles_nothing_but_data(tmp_path, monkeypatch):
    """Save and load model + AdamW: every torch.load is weights_only=True, no plain pickle.load."""
    violations = []
    real_load = torch.load

    def guarded_load(*args, **kwargs):
        if kwargs.get("weights_only") is not True:
            violations.append(f"torch.load(weights_only={kwargs.get('weights_only')})")
        return real_load(*args, **kwargs)

    def forbidden(*args, **kwargs):
        violations.append("pickle.load")
        raise AssertionError("pickle.load of checkpoint data")

    _save_tiny(tmp_path / "ck", step=7)
    monkeypatch.setattr(torch, "load", guarded_load)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    try:
        extra = _load_tiny(tmp_path / "ck")
    except BaseException as exc:  # noqa: BLE001 - DCP wraps failures in a BaseException
        pytest.fail(f"{violations}: {exc}")
    assert violations == [] and extra == {"step": 7}


def check_planted_metadata_refused_on_every_rank(path: str, marker: str) -> str:
    import tpkit
    from tpkit.io.dcp import UnsafeCheckpointError

    model = tpkit.tensor_parallel(build("llama"))
    tpkit.save_checkpoint(path, model)
    if dist.get_rank() == 0:
        _plant_metadata(Path(path), Path(marker))
    dist.barrier()
    try:
        tpkit.load_checkpoint(path, model)
    except UnsafeCheckpointError as exc:
        return str(exc)
    return "loaded"


def test_planted_metadata_is_refused_on_every_rank_without_a_hang(ranks2, tmp_path):
    marker = tmp_path / "pwned"
    r0, r1 = ranks2.run(
        check_planted_metadata_refused_on_every_rank, str(tmp_path / "ck"), str(marker), timeout=120
    )
    assert r0 == r1 and "builtins.exec" in r0 and ".metadata" in r0, (r0, r1)
    assert not marker.exists()


# ---- 3. no crash window loses a checkpoint ------------------------------------------------------
class _Crash(OSError):
    pass


def _crash_on_replace(monkeypatch, n: int) -> None:
    """Make the n-th ``os.replace`` (1-based) raise, as if the process were killed there."""
    real, calls = os.replace, [0]

    def replace(src, dst):
        calls[0] += 1
        if calls[0] == n:
            raise _Crash(f"killed at os.replace #{n}")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("n", [1, 2])  # before the first rename; between the two renames
def test_a_crash_in_the_swap_keeps_a_loadable_checkpoint(tmp_path, monkeypatch, n):
    ck = tmp_path / "ck"
    _save_tiny(ck, step=1)
    with monkeypatch.context() as m:
        _crash_on_replace(m, n)
        with pytest.raises(_Crash):
            _save_tiny(ck, step=2, seed=1)
    assert ck.exists() == (n == 1)
    # n=1: the new copy never went in (the save failed), ck is still step 1; n=2: ck is missing
    # and both ck.old (step 1) and the complete ck.tmp (step 2, newest) are good.
    expected = 1 if n == 1 else 2
    assert _load_tiny(ck) == {"step": expected}
    # the next save first recovers: a crash mid-write must leave the good copy loadable
    import torch.distributed.checkpoint as dcp

    with monkeypatch.context() as m:
        m.setattr(dcp.FileSystemWriter, "write_data", _raise_write)
        with pytest.raises(RuntimeError, match="injected crash mid-write"):
            _save_tiny(ck, step=3)
    assert _load_tiny(ck) == {"step": expected}
    assert ck.exists()  # recovered into place before anything was deleted
    _save_tiny(ck, step=4)
    assert _load_tiny(ck) == {"step": 4}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def _raise_write(self, plan, planner):
    raise RuntimeError("injected crash mid-write")


def test_a_crash_while_removing_old_keeps_the_new_checkpoint(tmp_path, monkeypatch):
    import shutil

    from tpkit.io import atomic

    ck = tmp_path / "ck"
    _save_tiny(ck, step=1)
    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path).name == "ck.old":
            raise _Crash("killed while removing ck.old")
        real(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(atomic.shutil, "rmtree", rmtree)
        with pytest.raises(_Crash):
            _save_tiny(ck, step=2)
    assert _load_tiny(ck) == {"step": 2}
    _save_tiny(ck, step=3)
    assert _load_tiny(ck) == {"step": 3} and not (tmp_path / "ck.old").exists()


def test_load_falls_back_to_old_when_the_directory_is_missing(tmp_path):
    ck = tmp_path / "ck"
    _save_tiny(ck, step=1)
    os.replace(ck, tmp_path / "ck.old")  # killed after the first rename ...
    (tmp_path / "ck.tmp").mkdir()  # ... of a save whose tmp was still being written
    (tmp_path / "ck.tmp" / "__0_0.distcp").write_bytes(b"partial")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("tpkit.io.atomic")
    logger.addHandler(handler)
    try:
        assert _load_tiny(ck) == {"step": 1}
    finally:
        logger.removeHandler(handler)
    assert any("ck.old" in r.getMessage() and "missing" in r.getMessage() for r in records)
    _save_tiny(ck, step=2)  # recovers ck from ck.old first, then replaces it
    assert _load_tiny(ck) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_partial_tmp_is_never_taken_for_a_checkpoint(tmp_path):
    from tpkit.io import atomic

    ck = tmp_path / "ck"
    _save_tiny(ck, step=1)
    os.replace(ck, tmp_path / "ck.tmp")  # a finished tmp, ...
    os.remove(tmp_path / "ck.tmp" / "tpkit_extra.json")  # ... then half deleted: the marker stays
    assert not atomic.is_complete(tmp_path / "ck.tmp")
    with pytest.raises(FileNotFoundError, match="not a tpkit/DCP checkpoint"):
        _load_tiny(ck)


def test_an_unmarked_checkpoint_from_before_markers_still_loads(tmp_path):
    from tpkit.io import atomic

    ck = tmp_path / "ck"
    _save_tiny(ck, step=5)
    os.remove(ck / atomic.COMPLETE_MARKER)
    assert _load_tiny(ck) == {"step": 5}
    _save_tiny(ck, step=6)
    assert _load_tiny(ck) == {"step": 6}


def test_save_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="notes.txt"):
        _save_tiny(ck)
    assert (ck / "notes.txt").read_text() == "mine"


def check_crash_between_renames(path: str) -> dict:
    import tpkit

    model = tpkit.tensor_parallel(build("llama"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tpkit.save_checkpoint(path, model, opt, step=1)
    real, calls = os.replace, [0]

    def replace(src, dst):  # only rank 0 renames
        calls[0] += 1
        if calls[0] == 2:
            raise OSError("injected: killed between the renames")
        real(src, dst)

    os.replace = replace
    try:
        tpkit.save_checkpoint(path, model, opt, step=2)
        raised = None
    except Exception as exc:
        raised = type(exc).__name__
    finally:
        os.replace = real
    dist.barrier()
    missing = not os.path.exists(path)
    after_crash = tpkit.load_checkpoint(path, model, opt)
    tpkit.save_checkpoint(path, model, opt, step=3)
    return {
        "raised": raised,
        "missing": missing,
        "after_crash": after_crash,
        "after_next_save": tpkit.load_checkpoint(path, model, opt),
        "left": sorted(os.listdir(os.path.dirname(path))),
    }


def test_crash_between_renames_on_two_ranks(ranks2, tmp_path):
    r0, r1 = ranks2.run(check_crash_between_renames, str(tmp_path / "ck"), timeout=180)
    assert r0["raised"] == "OSError" and r1["raised"] == "RuntimeError", (r0, r1)
    for r in (r0, r1):
        assert r["missing"] and r["after_crash"] == {"step": 2}, r
        assert r["after_next_save"] == {"step": 3} and r["left"] == ["ck"], r


def check_slow_reader_then_save(path: str) -> dict:
    """Rank 1 still reading the fallback copy (``.tmp``, after an interrupted swap) when rank 0,
    done with its own reads, starts the next save, whose first act is to move that copy back
    to ``path``: the save must wait for every rank's load to finish."""
    import time

    import tpkit
    import tpkit.io.checkpoint as ck
    from tpkit.io import atomic

    model = tpkit.tensor_parallel(build("llama"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tpkit.save_checkpoint(path, model, opt, step=1)
    dist.barrier()
    if dist.get_rank() == 0:  # the state a kill between the two renames leaves
        os.replace(path, atomic.old_sibling(path))
        import shutil

        shutil.copytree(atomic.old_sibling(path), atomic.tmp_sibling(path))
    dist.barrier()
    real = ck.set_state_dict  # after DCP's last collective, before the extra state is read

    def slow(*args, **kwargs):
        time.sleep(2.0)
        return real(*args, **kwargs)

    if dist.get_rank() == 1:
        ck.set_state_dict = slow
    try:
        loaded = tpkit.load_checkpoint(path, model, opt)
    finally:
        ck.set_state_dict = real
    tpkit.save_checkpoint(path, model, opt, step=2)
    return {"loaded": loaded, "after": tpkit.load_checkpoint(path, model, opt)}


def test_a_save_waits_for_every_rank_to_finish_loading(ranks2, tmp_path):
    for r in ranks2.run(check_slow_reader_then_save, str(tmp_path / "ck"), timeout=180):
        assert r == {"loaded": {"step": 1}, "after": {"step": 2}}, r


# ---- 4. export writes a clean directory ---------------------------------------------------------
@pytest.fixture
def llama_checkpoint(tmp_path) -> Path:
    import tpkit

    tpkit.save_checkpoint(tmp_path / "ck", build("llama"))
    return tmp_path / "ck"


def test_export_onto_a_file_is_refused(tmp_path, llama_checkpoint):
    from tpkit.cli.main import main

    target = tmp_path / "model.bin"
    target.write_bytes(b"keep")
    with pytest.raises(FileExistsError, match="not a directory"):
        main(["export", str(llama_checkpoint), str(target)])
    assert target.read_bytes() == b"keep"


def test_export_replaces_a_stale_sharded_checkpoint(tmp_path, llama_checkpoint):
    import tpkit

    out = tmp_path / "hf"
    build("llama", seed=5).save_pretrained(out, max_shard_size="40KB")  # an older, sharded export
    assert (out / "model.safetensors.index.json").exists()
    tpkit.export_checkpoint(llama_checkpoint, out)
    assert not (out / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    plain = tf.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ref = build("llama")
    x = batch(ref.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(plain(input_ids=x).logits, ref(input_ids=x).logits)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "hf"]


def test_export_refuses_a_directory_that_is_not_a_checkpoint(tmp_path, llama_checkpoint):
    import tpkit

    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="notes.txt"):
        tpkit.export_checkpoint(llama_checkpoint, out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_export_into_an_empty_directory(tmp_path, llama_checkpoint):
    import tpkit

    out = tmp_path / "hf"
    out.mkdir()
    tpkit.export_checkpoint(llama_checkpoint, out)
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()


# ---- 5. a checkpoint that does not fit fails early and clearly ----------------------------------
def _llama(**overrides):
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**{**ATTN, **overrides})).float()


def check_mismatch(path: str, save: dict, load: dict, with_optimizer: bool) -> str:
    import tpkit

    model = tpkit.tensor_parallel(_llama(**save))
    tpkit.save_checkpoint(path, model, torch.optim.AdamW(model.parameters()))
    other = tpkit.tensor_parallel(_llama(**load))
    opt = torch.optim.AdamW(other.parameters()) if with_optimizer else None
    try:
        tpkit.load_checkpoint(path, other, opt)
    except ValueError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.parametrize(
    ("save", "load", "with_optimizer", "expected"),
    [
        # extra layers in the checkpoint: loaded silently before
        ({"num_hidden_layers": 3}, {}, False, ["9 keys in the checkpoint but not in the model"]),
        # the model has layers the checkpoint lacks (model and optimizer keys)
        ({}, {"num_hidden_layers": 3}, True, ["keys in the model and optimizer but not in"]),
        # a shape mismatch: DCP's CheckpointException (a BaseException) before
        ({}, {"intermediate_size": 96}, True, ["with a different shape", "(128, 64)", "(96, 64)"]),
    ],
)
def test_a_mismatched_checkpoint_raises_one_value_error_on_every_rank(
    ranks2, tmp_path, save, load, with_optimizer, expected
):
    r0, r1 = ranks2.run(
        check_mismatch, str(tmp_path / "ck"), save, load, with_optimizer, timeout=120
    )
    assert r0 == r1, (r0, r1)
    for text in [*expected, "does not match", "hf_config"]:
        assert text in r0, r0


def test_mismatch_message_lists_the_first_ten_with_counts(tmp_path):
    import tpkit

    ck = tmp_path / "ck"
    model, _ = _tiny(layers=8)
    tpkit.save_checkpoint(ck, model)
    small, _ = _tiny(layers=1)
    with pytest.raises(ValueError) as info:
        tpkit.load_checkpoint(ck, small)
    text = str(info.value)
    assert "14 keys in the checkpoint but not in the model" in text
    assert "... (4 more)" in text and text.count("\n    model.") == 10


def test_a_model_only_checkpoint_loaded_with_an_optimizer_says_what_to_do(tmp_path):
    import tpkit

    model, opt = _tiny()
    tpkit.save_checkpoint(tmp_path / "ck", model)
    with pytest.raises(ValueError, match="optimizer=None"):
        tpkit.load_checkpoint(tmp_path / "ck", model, opt)


def test_a_remaining_dcp_failure_is_a_chained_runtime_error(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import CheckpointException

    from tpkit.io.dcp import SafeFileSystemReader

    _save_tiny(tmp_path / "ck")

    def broken(self, plan, planner):
        raise OSError("disk on fire")

    monkeypatch.setattr(SafeFileSystemReader, "read_data", broken)
    with pytest.raises(RuntimeError, match="disk on fire") as info:
        _load_tiny(tmp_path / "ck")
    assert isinstance(info.value.__cause__, CheckpointException)
