"""Files are never lost: ``export`` refuses to write over the checkpoint it reads and keeps a user's
files beside an old export; ``save_pretrained`` and ``save_checkpoint`` replace only checkpoint
files, atomically, so a crash at any moment leaves a directory that plain transformers loads as
the old model or the new one (never a mix), and unrelated files in it survive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers as tf

from tests.models import batch, build

OLD, NEW = 0, 7  # seeds of the model on disk before the save, and of the one being saved
SHARD = "40KB"  # a tiny llama in ~10 shards


# ---- helpers ------------------------------------------------------------------------------------
def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (symlinks as their target) with its bytes: what "nothing
    changed" compares."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = b"-> " + os.readlink(path).encode()
        elif path.is_file():
            out[rel] = path.read_bytes()
    return out


def _assert_loads_as(directory: Path, seed: int) -> None:
    """Plain transformers loads ``directory`` as exactly the model built with ``seed``."""
    loaded = tf.AutoModelForCausalLM.from_pretrained(str(directory)).float().eval()
    ref = build("llama", seed=seed)
    mine, theirs = loaded.state_dict(), ref.state_dict()
    assert mine.keys() == theirs.keys()
    differ = [k for k in theirs if not torch.equal(mine[k], theirs[k])]
    assert not differ, f"{len(differ)} tensors differ from seed {seed}, e.g. {differ[:3]}"
    x = batch(ref.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, ref(input_ids=x).logits)


def _user_files(directory: Path) -> dict[str, str]:
    """A user's files beside a checkpoint: notes, a tokenizer saved separately, a folder."""
    files = {
        "README.md": "my notes",
        "tokenizer_config.json": '{"model_max_length": 64}',
        "runs/events.log": "step 1",
        "model.ema.safetensors": "a variant the user keeps",
    }
    for rel, text in files.items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_text(text)
    return files


def _assert_user_files(directory: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        assert (directory / rel).read_text() == text, rel


def _siblings(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.parent.iterdir() if p.name != directory.name)


@pytest.fixture
def llama_checkpoint(tmp_path) -> Path:
    """A DCP training checkpoint (``save_checkpoint``) of the seed-NEW llama."""
    import tpkit

    tpkit.save_checkpoint(tmp_path / "ck", build("llama", seed=NEW))
    return tmp_path / "ck"


# ---- item 3: export never deletes a file it did not write ---------------------------------------
@pytest.mark.parametrize("where", ["same", "inside", "contains", "symlink", "its_old_copy"])
def test_export_onto_its_source_is_refused_and_nothing_changes(tmp_path, llama_checkpoint, where):
    from tpkit.cli.main import main

    ck = llama_checkpoint
    out = {
        "same": ck,
        "inside": ck / "hf",
        "contains": tmp_path,
        "symlink": tmp_path / "link",
        "its_old_copy": ck,  # out's fallback copy out.old is the checkpoint read
    }[where]
    if where == "symlink":
        out.symlink_to(ck, target_is_directory=True)
    if where == "its_old_copy":
        ck = tmp_path / "ck.old"
        os.replace(out, ck)
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="would replace or delete the training checkpoint"):
        main(["export", str(ck), str(out)])
    assert _tree(tmp_path) == before


def test_export_cli_onto_its_source_is_one_error_line(tmp_path, llama_checkpoint, monkeypatch):
    from tpkit.cli.main import main

    before = _tree(tmp_path)
    monkeypatch.setattr(
        sys, "argv", ["tpkit", "export", str(llama_checkpoint), str(llama_checkpoint)]
    )
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 1
    assert _tree(tmp_path) == before


def test_export_into_another_training_checkpoint_is_refused(tmp_path, llama_checkpoint):
    import tpkit

    other = tmp_path / "other"
    tpkit.save_checkpoint(other, build("llama", seed=OLD))
    before = _tree(other)
    with pytest.raises(ValueError, match="training checkpoint"):
        tpkit.export_checkpoint(llama_checkpoint, other)
    assert _tree(other) == before


def test_export_over_an_old_export_keeps_the_users_files(tmp_path, llama_checkpoint):
    import tpkit

    out = tmp_path / "hf"
    build("llama", seed=OLD).save_pretrained(out, max_shard_size=SHARD)  # an older, sharded export
    files = _user_files(out)
    tpkit.export_checkpoint(llama_checkpoint, out)
    _assert_user_files(out, files)
    _assert_loads_as(out, NEW)
    assert not (out / "model.safetensors.index.json").exists()  # stale checkpoint files: gone
    assert sorted(p.name for p in out.glob("*.safetensors")) == [
        "model.ema.safetensors",  # the user's variant: kept
        "model.safetensors",
    ]
    assert _siblings(out) == ["ck"]


def test_export_never_takes_a_users_own_old_folder(tmp_path, llama_checkpoint):
    """``mv hf hf.old`` by hand, then export to ``hf``: the backup is the user's, not a copy an
    interrupted save left; it is neither promoted nor deleted."""
    import tpkit

    out = tmp_path / "hf"
    build("llama", seed=OLD).save_pretrained(tmp_path / "hf.old")
    before = _tree(tmp_path / "hf.old")
    tpkit.export_checkpoint(llama_checkpoint, out)
    assert _tree(tmp_path / "hf.old") == before
    _assert_loads_as(out, NEW)


def test_save_checkpoint_over_a_checkpoint_keeps_the_users_files(tmp_path):
    import tpkit

    ck = tmp_path / "ck"
    tpkit.save_checkpoint(ck, build("llama", seed=OLD), step=1)
    files = _user_files(ck)
    tpkit.save_checkpoint(ck, build("llama", seed=NEW), step=2)
    _assert_user_files(ck, files)
    model = build("llama", seed=OLD)
    assert tpkit.load_checkpoint(ck, model) == {"step": 2}
    ref = build("llama", seed=NEW)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    assert _siblings(ck) == []


# ---- item 9: save_pretrained is atomic and keeps unrelated files --------------------------------
class _Killed(RuntimeError):
    """Stands for the process dying at this point."""


def _crash_in_writes(monkeypatch, at: str) -> None:
    """Make transformers' save die part-way: in the n-th weights file it writes (after half of
    it is on disk), or in the middle of config.json."""
    import transformers.modeling_utils as mu

    if at == "config":

        def to_json_file(self, path, *args, **kwargs):
            Path(path).write_text('{"model_type": "lla')  # a truncated config
            raise _Killed("killed while writing config.json")

        monkeypatch.setattr(tf.PretrainedConfig, "to_json_file", to_json_file)
        return
    n, real, calls = int(at.split("_")[1]), mu.safe_save_file, [0]

    def safe_save_file(tensors, filename, *args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            Path(filename).write_bytes(b"\0" * 100)  # half a file
            raise _Killed(f"killed in weights file #{n}")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(mu, "safe_save_file", safe_save_file)


@pytest.mark.parametrize(
    ("shard", "at"),
    [(None, "config"), (None, "weights_1"), (SHARD, "weights_1"), (SHARD, "weights_5")],
)
@pytest.mark.parametrize("old_sharded", [False, True])
def test_a_crash_mid_save_pretrained_leaves_the_old_model(
    tmp_path, monkeypatch, shard, at, old_sharded
):
    from tpkit.io.save import install_save_pretrained

    out = tmp_path / "hf"
    build("llama", seed=OLD).save_pretrained(out, max_shard_size=SHARD if old_sharded else "5GB")
    files = _user_files(out)
    model = build("llama", seed=NEW)
    install_save_pretrained(model)  # what tpkit puts on every split model (no process group here)
    kwargs = {"max_shard_size": shard} if shard else {}
    with monkeypatch.context() as m:
        _crash_in_writes(m, at)
        with pytest.raises(_Killed):
            model.save_pretrained(out, **kwargs)
    _assert_loads_as(out, OLD)
    _assert_user_files(out, files)
    model.save_pretrained(out, **kwargs)  # the next save clears the partial copy
    _assert_loads_as(out, NEW)
    _assert_user_files(out, files)
    shards = sorted(p.name for p in out.glob("model*.safetensors") if p.name not in files)
    assert (len(shards) > 1) == bool(shard), shards  # no stale shard or single file of the old
    assert (out / "model.safetensors.index.json").exists() == bool(shard)
    assert _siblings(out) == []


def test_save_pretrained_without_an_atomic_exchange_still_keeps_files(tmp_path, monkeypatch):
    """Where the OS has no atomic exchange: two renames; killed between them the directory is
    missing (never mixed) and the next save restores it before writing."""
    from tpkit.io import atomic
    from tpkit.io.save import save_pretrained_atomic

    out = tmp_path / "hf"
    build("llama", seed=OLD).save_pretrained(out, max_shard_size=SHARD)
    files = _user_files(out)
    monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    real, calls = os.replace, [0]

    def replace(src, dst):
        calls[0] += 1
        if calls[0] == 2:
            raise _Killed("killed between the renames")
        real(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", replace)
        with pytest.raises(_Killed):
            save_pretrained_atomic(build("llama", seed=NEW), out)
    assert not out.exists()
    assert atomic.is_complete(atomic.tmp_sibling(out))  # the new copy, user files carried in
    _assert_user_files(atomic.tmp_sibling(out), files)
    save_pretrained_atomic(build("llama", seed=NEW), out)
    _assert_loads_as(out, NEW)
    _assert_user_files(out, files)
    assert _siblings(out) == []


# ---- SIGKILL at a random moment, in a real process ----------------------------------------------
_KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import transformers.modeling_utils as mu
    sys.path.insert(0, {root!r})
    from tests.models import build
    from tpkit.io.save import install_save_pretrained

    model = build("llama", seed={new})
    install_save_pretrained(model)  # what tpkit puts on every split model
    real = mu.safe_save_file
    calls = [0]

    def safe_save_file(tensors, filename, *args, **kwargs):
        calls[0] += 1
        if calls[0] == {kill_at}:
            with open(filename, "wb") as f:
                f.write(b"\\0" * 100)
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return real(tensors, filename, *args, **kwargs)

    mu.safe_save_file = safe_save_file
    model.save_pretrained({out!r}, max_shard_size={shard!r})
    print("SAVED")
    """
)


@pytest.mark.parametrize("kill_at", [3, 99])  # mid-write of the 3rd shard; never (completes)
def test_sigkill_mid_save_pretrained_leaves_a_loadable_directory(tmp_path, kill_at):
    out = tmp_path / "hf"
    build("llama", seed=OLD).save_pretrained(out, max_shard_size=SHARD)
    files = _user_files(out)
    root = str(Path(__file__).resolve().parents[1])
    script = _KILL_SCRIPT.format(root=root, new=NEW, kill_at=kill_at, out=str(out), shard=SHARD)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    if kill_at == 99:
        assert proc.returncode == 0 and "SAVED" in proc.stdout, proc.stderr[-3000:]
        _assert_loads_as(out, NEW)
    else:
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        _assert_loads_as(out, OLD)
    _assert_user_files(out, files)


# ---- two ranks: the gathered save, a failure on rank 0 raises everywhere ------------------------
def check_gathered_save_with_a_crash(out: str, crash: bool) -> str | None:
    import torch.distributed as dist
    import transformers.modeling_utils as mu

    import tpkit

    model = tpkit.tensor_parallel(build("llama", seed=NEW))
    real = mu.safe_save_file

    def safe_save_file(tensors, filename, *args, **kwargs):
        if os.path.basename(filename).startswith("model-00003"):
            Path(filename).write_bytes(b"\0" * 100)
            raise OSError("disk full (injected)")
        return real(tensors, filename, *args, **kwargs)

    if crash and dist.get_rank() == 0:
        mu.safe_save_file = safe_save_file
    try:
        model.save_pretrained(out, max_shard_size=SHARD)
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        mu.safe_save_file = real


def test_gathered_save_pretrained_is_atomic_on_two_ranks(ranks2, tmp_path):
    out = tmp_path / "hf"
    build("llama", seed=OLD).save_pretrained(out)
    files = _user_files(out)
    r0, r1 = ranks2.run(check_gathered_save_with_a_crash, str(out), True, timeout=180)
    assert r0 and "disk full" in r0 and r1 and "disk full" in r1, (r0, r1)  # every rank raised
    _assert_loads_as(out, OLD)
    _assert_user_files(out, files)
    assert ranks2.run(check_gathered_save_with_a_crash, str(out), False, timeout=180) == [
        None,
        None,
    ]
    _assert_loads_as(out, NEW)
    _assert_user_files(out, files)
    assert _siblings(out) == []
