"""Replace a directory with a new version so that no crash, at any point, loses the last good copy,
and no file tpkit did not write is ever deleted.

A directory ``d`` is written as ``d.tmp``, marked complete and swapped in. Why each piece is there:

- **fsync before each rename.** A rename is durable only after the directory holding it is
  fsynced, and it only publishes data that already reached the disk: without fsyncing every file
  (and ``d.tmp`` itself) a power cut after the rename can leave ``d`` with empty or missing files.
- **A completion marker written last** (`COMPLETE_MARKER`, listing every file the writer wrote and
  its size), so a finished ``d.tmp`` is told from a partial one, and a half-deleted copy from a
  whole one. A partial ``d.tmp`` carries `OWNER_TAG` from its creation, so a leftover is known to
  be tpkit's.
- **Unrelated files are carried, never deleted.** ``d`` may hold files that are not part of the
  checkpoint (a README, tokenizer files, a Trainer's ``checkpoint-N/`` folders): before the swap
  each is hard-linked (copied where links fail) into ``d.tmp`` at the same path, so it is in ``d``
  before and after. A `DirKind` names the checkpoint files of one kind (`HF_CHECKPOINT`, DCP's in
  `tpkit.io.checkpoint`): only those, and files the new version wrote, replace or drop their old
  namesakes. Afterwards the previous version is taken apart file by file (`retire`): checkpoint
  files and copies that ``d`` holds too are removed, anything else (a file written into ``d``
  during the swap) is moved into ``d``; a folder never goes with ``shutil.rmtree`` while a file
  is in it, and what cannot be placed stays in a ``d.kept`` folder, with a warning.
- **One atomic exchange where the OS has it** (``renameat2(RENAME_EXCHANGE)``, Linux; kinds with
  ``exchange``): ``d`` is the complete old copy until the instant it is the complete new one, so
  a plain reader (transformers' ``from_pretrained``) sees old or new at every instant. Elsewhere,
  two renames (``d -> d.old``, ``d.tmp -> d``): killed between them, ``d`` is missing while
  ``d.old`` and ``d.tmp`` are both complete; `find_complete` (for loading) answers the complete
  ``d.tmp`` (newest) or ``d.old``, and `recover` (before writing) promotes it back to ``d``; no
  function here deletes a complete copy while ``d`` is missing or incomplete.
- **Symlinks resolved.** A ``d`` that is a symlink is replaced at the directory it points to, so
  the link keeps working.

Only one process may call these for a given directory at a time (tpkit: rank 0, between barriers).
"""

from __future__ import annotations

import ctypes
import errno
import filecmp
import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tpkit.log import get_logger

__all__ = [
    "COMPLETE_MARKER",
    "HF_CHECKPOINT",
    "OWNER_TAG",
    "DirKind",
    "exchange",
    "find_complete",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "is_complete",
    "mark_complete",
    "old_sibling",
    "prepare_tmp",
    "recover",
    "replace_dir",
    "retire",
    "swap_in",
    "tmp_sibling",
]

log = get_logger(__name__)

#: Written last into a finished directory: ``{"files": {relative path: size in bytes}}``.
COMPLETE_MARKER = ".tpkit_complete.json"
#: Written first into a directory tpkit fills or moves aside: a leftover holding it is tpkit's.
OWNER_TAG = ".tpkit_owned"

T = TypeVar("T")


@dataclass(frozen=True)
class DirKind:
    """What one kind of checkpoint directory holds, and how it is swapped.

    ``patterns``: regular expressions (full match on the path relative to the directory, ``/``
    separated) of the files a writer of this kind produces; an old one of these is dropped when a
    new version replaces the directory (a stale shard), every other file is kept. ``legacy_file``:
    a file whose presence makes an unmarked ``d`` (or, with ``untagged_siblings``, ``d.old``)
    count as complete (written before markers existed). ``untagged_siblings``: whether a
    ``d.tmp`` / ``d.old`` without tpkit's tag or marker may still be tpkit's (written before
    tags existed: only its checkpoint files are ever removed); off, such a folder is the user's
    and tpkit refuses to touch it. ``exchange``: swap with one atomic exchange where the OS has
    it (readers other than tpkit, which cannot fall back to ``d.tmp`` / ``d.old``)."""

    name: str
    patterns: tuple[str, ...]
    legacy_file: str | None = None
    untagged_siblings: bool = False
    exchange: bool = False

    def owns(self, rel: str) -> bool:
        """Whether the file at ``rel`` is a checkpoint file of this kind (or tpkit's own)."""
        if rel in (COMPLETE_MARKER, OWNER_TAG):
            return True
        return any(re.fullmatch(p, rel) for p in self.patterns)


#: What transformers' ``save_pretrained`` writes for a model: config, generation config, weights
#: (safetensors or .bin, single or sharded), their index. Files of a ``variant`` (``model.fp16.
#: safetensors``, a user's ``model.ema.safetensors``) are replaced only by a save that writes them.
HF_CHECKPOINT = DirKind(
    name="Hugging Face checkpoint",
    patterns=(
        r"config\.json",
        r"generation_config\.json",
        r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)",
        r"(model\.safetensors|pytorch_model\.bin)\.index\.json",
    ),
    legacy_file="config.json",
    exchange=True,
)


def tmp_sibling(directory: str | os.PathLike) -> Path:
    """``<directory>.tmp``: where the next version is written."""
    directory = Path(directory)
    return directory.with_name(directory.name + ".tmp")


def old_sibling(directory: str | os.PathLike) -> Path:
    """``<directory>.old``: the previous version, for the moment between the two renames."""
    directory = Path(directory)
    return directory.with_name(directory.name + ".old")


def _free_sibling(directory: Path, suffix: str) -> Path:
    """``<directory><suffix>``, or with ``-1``, ``-2``, ... appended: a name nothing holds."""
    path, n = directory.with_name(directory.name + suffix), 0
    while path.exists() or path.is_symlink():
        n += 1
        path = directory.with_name(f"{directory.name}{suffix}-{n}")
    return path


def _real(directory: str | os.PathLike) -> Path:
    """The directory a write goes to: symlinks resolved, so a link to it keeps working."""
    return Path(os.path.realpath(directory))


def fsync_file(path: str | os.PathLike) -> None:
    """Flush one file's data to disk (its writer may have closed it without fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (created, renamed, removed names) to disk. A no-op where the
    platform cannot open directories (Windows), which orders renames on its own."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file under ``root``, then every directory, deepest first."""
    dirs = []
    for here, _, files in os.walk(root):
        for name in files:
            path = os.path.join(here, name)
            if not os.path.islink(path):
                fsync_file(path)
        dirs.append(here)
    for here in reversed(dirs):
        fsync_dir(here)


def _files(directory: Path) -> Iterator[str]:
    """Every file (and symlink) under ``directory``, as a ``/``-separated relative path."""
    for here, dirs, files in os.walk(directory):
        links = [d for d in dirs if os.path.islink(os.path.join(here, d))]
        for name in [*files, *links]:
            yield (Path(here) / name).relative_to(directory).as_posix()


def _listing(directory: Path) -> dict[str, int]:
    out = {}
    for rel in _files(directory):
        if rel not in (COMPLETE_MARKER, OWNER_TAG):
            out[rel] = (directory / rel).lstat().st_size
    return dict(sorted(out.items()))


def _marked_files(directory: Path) -> set[str]:
    """The files ``directory``'s marker lists (what its writer wrote); empty without one."""
    try:
        return set(json.loads((directory / COMPLETE_MARKER).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def mark_complete(directory: str | os.PathLike) -> None:
    """Declare ``directory`` finished: fsync all its files, then write the marker (listing each
    file and its size) last, fsync it and the directory. Call once every writer has finished,
    before `swap_in` carries unrelated files in (the marker lists what the writer wrote)."""
    directory = Path(directory)
    fsync_tree(directory)
    marker = directory / COMPLETE_MARKER
    with open(marker, "w") as f:
        json.dump({"files": _listing(directory)}, f)
        f.flush()
        os.fsync(f.fileno())
    (directory / OWNER_TAG).unlink(missing_ok=True)  # the marker says whose it is from now on
    fsync_dir(directory)


def is_complete(directory: str | os.PathLike, *, legacy_file: str | None = None) -> bool:
    """Whether ``directory`` holds a finished copy: its marker is there and every file it lists
    is there with its size. With ``legacy_file``, a directory without a marker that holds that
    file also counts (written before markers existed; give it only for paths a finished copy was
    renamed to, never for a ``.tmp``)."""
    directory = Path(directory)
    marker = directory / COMPLETE_MARKER
    if not marker.is_file():
        return legacy_file is not None and (directory / legacy_file).is_file()
    try:
        files = json.loads(marker.read_text())["files"]
        return all((directory / rel).lstat().st_size == size for rel, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


_NEW, _PREVIOUS = "new", "previous"  # what `OWNER_TAG` says: a version being written / replaced


def _tag(path: Path) -> str | None:
    try:
        return (path / OWNER_TAG).read_text().strip()
    except OSError:
        return None


def _write_tag(path: Path, what: str) -> None:
    with open(path / OWNER_TAG, "w") as f:
        f.write(what)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path)


def _is_tpkits(path: Path) -> bool:
    return _tag(path) is not None or (path / COMPLETE_MARKER).exists()


def _candidates(directory: Path, legacy_file: str | None, kind: DirKind | None) -> list[Path]:
    """The complete copies of ``directory``: itself when complete, then its fallbacks, newest
    first. A kind without ``untagged_siblings`` counts a ``.old`` only when tpkit moved it
    there (tagged): a user's own ``d.old`` is never promoted, nor deleted."""
    out = [directory] if is_complete(directory, legacy_file=legacy_file) else []
    tmp, old = tmp_sibling(directory), old_sibling(directory)
    if is_complete(tmp) and _tag(tmp) != _PREVIOUS:  # never the copy an exchange replaced
        out.append(tmp)
    trusted = kind is None or kind.untagged_siblings or _is_tpkits(old)
    if trusted and is_complete(old, legacy_file=legacy_file):
        out.append(old)
    return out


def find_complete(directory: str | os.PathLike, *, legacy_file: str | None = None) -> Path | None:
    """The copy to read: ``directory`` if complete, else a complete ``.tmp`` (newer), else a
    complete ``.old`` (a warning says which), else None. Changes nothing on disk."""
    directory = Path(directory)
    candidates = _candidates(directory, legacy_file, None)
    if not candidates or candidates[0] == directory:
        return candidates[0] if candidates else None
    state = "is incomplete" if directory.exists() else "is missing"
    log.warning(
        "%s %s (a save was interrupted); reading the complete copy %s instead.",
        directory,
        state,
        candidates[0],
    )
    return candidates[0]


def recover(directory: str | os.PathLike, *, kind: DirKind) -> Path | None:
    """Make ``directory`` the complete copy again after an interrupted swap, before anything
    else is written: promote a complete ``.tmp`` (newer) or ``.old``. An incomplete
    ``directory`` in the way is moved to ``<directory>.incomplete`` (a free name), not deleted.
    Returns ``directory`` when it is complete afterwards, None when no complete copy exists."""
    directory = _real(directory)
    candidates = _candidates(directory, kind.legacy_file, kind)
    if not candidates or candidates[0] == directory:
        return candidates[0] if candidates else None
    if directory.exists():
        aside = _free_sibling(directory, ".incomplete")
        os.replace(directory, aside)
        log.warning("%s is incomplete; moved it to %s.", directory, aside)
    os.replace(candidates[0], directory)
    fsync_dir(directory.parent)
    log.warning("recovered %s from %s (an interrupted save).", directory, candidates[0])
    return directory


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.is_symlink() or b.is_symlink():
            return a.is_symlink() and b.is_symlink() and os.readlink(a) == os.readlink(b)
        return os.path.samefile(a, b) or filecmp.cmp(a, b, shallow=False)
    except OSError:
        return False


def _remove_empty_dirs(root: Path) -> None:
    """Remove ``root`` and its folders, deepest first, only if no file is left in them."""
    if any(True for _ in _files(root)):
        return
    shutil.rmtree(root)  # only empty folders are left


def retire(previous: str | os.PathLike, directory: str | os.PathLike, *, kind: DirKind) -> None:
    """Take apart ``previous``, a copy that ``directory`` (complete) replaced: remove its checkpoint
    files (``kind``), the files either marker lists and copies ``directory`` holds too; move every
    other file into ``directory`` when ``directory`` lacks it (a file written into the old copy
    while it was being replaced). A file that cannot be placed stays, in ``<directory>.kept``
    (with a warning): nothing but tpkit's and the writer's own files is ever deleted."""
    previous, directory = Path(previous), Path(directory)
    written = _marked_files(directory) | _marked_files(previous)
    left = []
    # tpkit's marker and tag go last: a crash part-way leaves a folder still known to be tpkit's
    for rel in sorted(_files(previous), key=lambda r: (r in (COMPLETE_MARKER, OWNER_TAG), r)):
        src, dst = previous / rel, directory / rel
        if kind.owns(rel) or rel in written or _same_file(src, dst):
            src.unlink()
        elif not (dst.exists() or dst.is_symlink()):
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.rename(src, dst)
        else:
            left.append(rel)
    if left:
        kept = _free_sibling(directory, ".kept")
        os.replace(previous, kept)
        log.warning(
            "%s: %d file(s) of the previous version differ from the new one's and were kept in "
            "%s: %s",
            directory,
            len(left),
            kept,
            ", ".join(left[:10]),
        )
    else:
        _remove_empty_dirs(previous)
    fsync_dir(directory)
    fsync_dir(directory.parent)


def _clear_leftover(path: Path, directory: Path, kind: DirKind) -> None:
    """A ``.tmp`` / ``.old`` left by an interrupted save, once ``directory`` is settled: a partial
    new version (tagged, unmarked: nothing but the writer's output) is removed; another copy
    tpkit made or moved aside is retired into ``directory`` (`retire`); an untagged one, where
    the kind allows (``untagged_siblings``), loses only its checkpoint files and copies of
    ``directory``'s. Anything left raises: tpkit never deletes what it did not write."""
    if not (path.exists() or path.is_symlink()):
        return
    if not path.is_dir() or path.is_symlink():
        raise FileExistsError(
            f"{path} exists and is not a folder tpkit wrote; tpkit needs that name to replace "
            f"{directory} safely. Move it away."
        )
    marked = (path / COMPLETE_MARKER).exists()
    if _tag(path) == _NEW and not marked:
        shutil.rmtree(path)  # a partial write: every file in it is the writer's
        return
    if _is_tpkits(path) and directory.is_dir():
        retire(path, directory, kind=kind)
    elif _is_tpkits(path) or kind.untagged_siblings:
        listed = _marked_files(path)
        for rel in sorted(_files(path), key=lambda r: (r in (COMPLETE_MARKER, OWNER_TAG), r)):
            if kind.owns(rel) or rel in listed or _same_file(path / rel, directory / rel):
                (path / rel).unlink()
        _remove_empty_dirs(path)
    if path.exists():
        held = sorted(_files(path))
        raise FileExistsError(
            f"{path} exists and holds files tpkit did not write "
            f"({', '.join(held[:10]) or 'empty folders'}); tpkit needs that name to replace "
            f"{directory} safely. Move it away."
        )


def prepare_tmp(directory: str | os.PathLike, *, kind: DirKind) -> Path:
    """Recover ``directory`` (`recover`), then give a fresh, empty ``<directory>.tmp`` (tagged as
    tpkit's) to write the next version into. A ``.tmp`` or ``.old`` left is cleared only after
    recovery, so it is either stale (``directory`` is complete) or partial (no complete copy
    exists at all), and only of tpkit's files (`retire`)."""
    directory = _real(directory)
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"{directory} exists and is not a directory.")
    recover(directory, kind=kind)
    (directory / OWNER_TAG).unlink(missing_ok=True)  # from a swap that never happened
    _clear_leftover(tmp_sibling(directory), directory, kind)
    old = old_sibling(directory)
    if _is_tpkits(old) or kind.untagged_siblings:  # a user's own ``d.old`` is left alone
        _clear_leftover(old, directory, kind)
    tmp = tmp_sibling(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    _write_tag(tmp, _NEW)
    fsync_dir(directory.parent)
    return tmp


def _carry(directory: Path, tmp: Path, kind: DirKind) -> None:
    """Hard-link (copy where links fail) into ``tmp`` every file of ``directory`` that is not a
    checkpoint file and that ``tmp`` lacks: the user's files are in place before and after the
    swap, and a file still open for writing (a log) stays the same file."""
    carried = []
    for here, dirs, _ in os.walk(directory):  # folders too, empty ones included
        for name in dirs:
            if not os.path.islink(os.path.join(here, name)):
                rel = (Path(here) / name).relative_to(directory)
                (tmp / rel).mkdir(parents=True, exist_ok=True)
    for rel in _files(directory):
        src, dst = directory / rel, tmp / rel
        if kind.owns(rel) or dst.exists() or dst.is_symlink():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
            continue
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError:
            shutil.copy2(src, dst)
            fsync_file(dst)
        carried.append(dst)
    for folder in {p.parent for p in carried} | {tmp}:
        fsync_dir(folder)


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    OS or filesystem has no such call (nothing changed then). Python's ``os`` has no wrapper."""
    if sys.platform != "linux":
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def swap_in(directory: str | os.PathLike, *, kind: DirKind) -> None:
    """Replace ``directory`` with the complete ``<directory>.tmp``, keeping every file of
    ``directory`` that is not a checkpoint file of ``kind`` (carried in first). With
    ``kind.exchange`` and an OS that can, one atomic exchange; else ``directory -> .old``,
    ``.tmp -> directory`` (the parent fsynced after each): a crash between the renames leaves
    both copies complete, for `find_complete` / `recover`. The previous version is then taken
    apart by `retire`."""
    directory = _real(directory)
    tmp, old = tmp_sibling(directory), old_sibling(directory)
    if not is_complete(tmp):
        raise RuntimeError(f"{tmp} is not marked complete; refusing to swap it in.")
    if not directory.exists():
        os.replace(tmp, directory)
        fsync_dir(directory.parent)
        return
    _carry(directory, tmp, kind)
    _write_tag(directory, _PREVIOUS)  # the copy moved aside is known to be tpkit's
    if kind.exchange and exchange(tmp, directory):
        previous = tmp
        fsync_dir(directory.parent)
    else:
        if (old.exists() or old.is_symlink()) and not (_is_tpkits(old) or kind.untagged_siblings):
            old = _free_sibling(directory, ".old")  # the user's own d.old: another name
        if old.exists() or old.is_symlink():
            if is_complete(old, legacy_file=kind.legacy_file) and not is_complete(
                directory, legacy_file=kind.legacy_file
            ):
                raise RuntimeError(
                    f"{old} is the only other complete copy and {directory} is incomplete; "
                    "refusing to replace it (call recover first)."
                )
            _clear_leftover(old, directory, kind)
        os.replace(directory, old)
        fsync_dir(directory.parent)
        os.replace(tmp, directory)
        fsync_dir(directory.parent)
        previous = old
    retire(previous, directory, kind=kind)


def replace_dir(directory: str | os.PathLike, write: Callable[[Path], T], *, kind: DirKind) -> T:
    """``write(tmp)`` the next version of ``directory`` into a fresh ``<directory>.tmp``, mark it
    complete and swap it in (`prepare_tmp`, `mark_complete`, `swap_in`): one process, one call.
    If ``write`` raises, ``directory`` is untouched and the partial ``.tmp`` stays until the
    next call clears it."""
    tmp = prepare_tmp(directory, kind=kind)
    out = write(tmp)
    mark_complete(tmp)
    swap_in(directory, kind=kind)
    return out
