"""Replace a directory with a new version so that no crash, at any point, loses the last good copy.

A directory ``d`` is written as ``d.tmp``, marked complete, and swapped in with two renames:
``d -> d.old``, ``d.tmp -> d``, then ``d.old`` is removed. Why each piece is there:

- **fsync before each rename.** A rename is durable only after the directory holding it is
  fsynced, and it only publishes data that already reached the disk: without fsyncing every file
  (and ``d.tmp`` itself) a power cut after the rename can leave ``d`` with empty or missing files.
- **A completion marker written last** (`COMPLETE_MARKER`, listing every file and its size), so a
  finished ``d.tmp`` is told from a partial one, and a half-deleted copy from a whole one.
- **Recovery instead of deletion.** Killed between the two renames, ``d`` is missing while
  ``d.old`` and ``d.tmp`` are both good. `find_complete` (for loading) then answers the complete
  ``d.tmp`` (newest) or ``d.old``, and `recover` (before writing) promotes it back to ``d``; no
  function here deletes a complete copy while ``d`` is missing or incomplete.

Only one process may call these for a given directory at a time (tpkit: rank 0, between barriers).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tpkit.log import get_logger

__all__ = [
    "COMPLETE_MARKER",
    "find_complete",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "is_complete",
    "mark_complete",
    "old_sibling",
    "prepare_tmp",
    "recover",
    "swap_in",
    "tmp_sibling",
]

log = get_logger(__name__)

#: Written last into a finished directory: ``{"files": {relative path: size in bytes}}``.
COMPLETE_MARKER = ".tpkit_complete.json"


def tmp_sibling(directory: str | os.PathLike) -> Path:
    """``<directory>.tmp``: where the next version is written."""
    directory = Path(directory)
    return directory.with_name(directory.name + ".tmp")


def old_sibling(directory: str | os.PathLike) -> Path:
    """``<directory>.old``: the previous version, for the moment between the two renames."""
    directory = Path(directory)
    return directory.with_name(directory.name + ".old")


def _incomplete_sibling(directory: Path) -> Path:
    return directory.with_name(directory.name + ".incomplete")


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
            fsync_file(os.path.join(here, name))
        dirs.append(here)
    for here in reversed(dirs):
        fsync_dir(here)


def _listing(directory: Path) -> dict[str, int]:
    out = {}
    for here, _, files in os.walk(directory):
        for name in files:
            path = Path(here) / name
            rel = path.relative_to(directory).as_posix()
            if rel != COMPLETE_MARKER:
                out[rel] = path.stat().st_size
    return dict(sorted(out.items()))


def mark_complete(directory: str | os.PathLike) -> None:
    """Declare ``directory`` finished: fsync all its files, then write the marker (listing each
    file and its size) last, fsync it and the directory. Call once every writer has finished."""
    directory = Path(directory)
    fsync_tree(directory)
    marker = directory / COMPLETE_MARKER
    with open(marker, "w") as f:
        json.dump({"files": _listing(directory)}, f)
        f.flush()
        os.fsync(f.fileno())
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
        return all((directory / rel).stat().st_size == size for rel, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _candidates(directory: Path, legacy_file: str | None) -> list[Path]:
    """The complete copies of ``directory``: itself when complete, then its fallbacks, newest
    first."""
    out = [directory] if is_complete(directory, legacy_file=legacy_file) else []
    if is_complete(tmp_sibling(directory)):
        out.append(tmp_sibling(directory))
    if is_complete(old_sibling(directory), legacy_file=legacy_file):
        out.append(old_sibling(directory))
    return out


def find_complete(directory: str | os.PathLike, *, legacy_file: str | None = None) -> Path | None:
    """The copy to read: ``directory`` if complete, else a complete ``.tmp`` (newer), else a
    complete ``.old`` (a warning says which), else None. Changes nothing on disk."""
    directory = Path(directory)
    candidates = _candidates(directory, legacy_file)
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


def recover(directory: str | os.PathLike, *, legacy_file: str | None = None) -> Path | None:
    """Make ``directory`` the complete copy again after an interrupted swap, before anything
    else is written: promote a complete ``.tmp`` (newer) or ``.old``. An incomplete
    ``directory`` in the way is moved to ``<directory>.incomplete``, not deleted. Returns
    ``directory`` when it is complete afterwards, None when no complete copy exists."""
    directory = Path(directory)
    candidates = _candidates(directory, legacy_file)
    if not candidates or candidates[0] == directory:
        return candidates[0] if candidates else None
    if directory.exists():
        aside = _incomplete_sibling(directory)
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(directory, aside)
        log.warning("%s is incomplete; moved it to %s.", directory, aside)
    os.replace(candidates[0], directory)
    fsync_dir(directory.parent)
    log.warning("recovered %s from %s (an interrupted save).", directory, candidates[0])
    return directory


def prepare_tmp(directory: str | os.PathLike, *, legacy_file: str | None = None) -> Path:
    """Recover ``directory`` (`recover`), then give a fresh, empty ``<directory>.tmp`` to write
    the next version into. Any ``.tmp`` left is deleted only after recovery, so it is either stale
    (``directory`` is complete) or partial (no complete copy exists at all)."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"{directory} exists and is not a directory.")
    recover(directory, legacy_file=legacy_file)
    tmp = tmp_sibling(directory)
    if tmp.exists() or tmp.is_symlink():
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp)
        else:
            tmp.unlink()
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    fsync_dir(directory.parent)
    return tmp


def swap_in(directory: str | os.PathLike, *, legacy_file: str | None = None) -> None:
    """Replace ``directory`` with the complete ``<directory>.tmp``: ``directory -> .old``,
    ``.tmp -> directory`` (the parent fsynced after each), then remove ``.old``. A crash between
    the renames leaves both copies complete, for `find_complete` / `recover`."""
    directory = Path(directory)
    tmp, old = tmp_sibling(directory), old_sibling(directory)
    if not is_complete(tmp):
        raise RuntimeError(f"{tmp} is not marked complete; refusing to swap it in.")
    if directory.exists():
        if old.exists():
            if is_complete(old, legacy_file=legacy_file) and not is_complete(
                directory, legacy_file=legacy_file
            ):
                raise RuntimeError(
                    f"{old} is the only other complete copy and {directory} is incomplete; "
                    "refusing to delete it (call recover first)."
                )
            shutil.rmtree(old)
        os.replace(directory, old)
        fsync_dir(directory.parent)
    os.replace(tmp, directory)
    fsync_dir(directory.parent)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(directory.parent)
