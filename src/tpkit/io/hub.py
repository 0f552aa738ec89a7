"""A checkpoint's weight files on this machine: from a local directory or a Hugging Face hub id.

``tpkit.from_pretrained("Qwen/Qwen3-0.6B")`` must find the same files transformers'
``from_pretrained`` would. Each file is resolved with ``transformers.utils.cached_file``,
transformers' own resolution: it takes a local directory or a hub id and honours ``cache_dir``,
``revision`` (a branch, tag or commit, resolved once to the commit so config and weights come from
the same state), ``subfolder``, ``token``, ``proxies``, ``force_download``, ``local_files_only``
and ``HF_HUB_OFFLINE`` / ``HF_HOME`` (a file already in the hub cache is used offline). The files
are looked for in transformers' order, safetensors first: ``model{.variant}.safetensors.index.json``,
``model{.variant}.safetensors``, then ``pytorch_model{.variant}.bin.index.json`` and
``pytorch_model{.variant}.bin`` (``use_safetensors`` True / False keeps one format). Only the
chosen format's files are fetched: the index first, then exactly the shard files it names (with
tensor parallelism every rank holds a slice of nearly every tensor, so each shard holds some of
each rank's slices); never the other format, other variants or unrelated files. Ranks resolve
at the same time; the hub cache's file locks let one of them download a file and the others
wait for it.

A local directory with none of those names keeps tpkit's older rule: its ``*.safetensors``
files (never a ``*.bin`` glob: ``training_args.bin`` is a pickle too).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpkit.io.pickle_safe import BinCheckpointIndex
from tpkit.io.safetensors import CheckpointIndex, read_weight_map

__all__ = ["DOWNLOAD_KEYS", "Checkpoint", "resolve_checkpoint", "resolve_folder"]

#: transformers' ``from_pretrained`` keywords that say where files come from
DOWNLOAD_KEYS = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "token",
    "revision",
    "subfolder",
    "proxies",
)


@dataclass
class Checkpoint:
    """Where a checkpoint's files are: ``folder`` holds config.json (a hub id: its snapshot,
    subfolder included), ``files`` the weights of ``format`` (``"safetensors"`` or ``"bin"``),
    ``index`` the sharded index if there is one; ``download`` the keywords (revision resolved to
    the commit) that reach the same files again (config, generation config, transformers)."""

    source: str
    folder: Path
    files: list[Path] | None  # None: the directory's own safetensors files (tpkit's older rule)
    format: str
    index: Path | None = None
    download: dict[str, Any] = field(default_factory=dict)

    def open(self) -> CheckpointIndex:
        """The tensors' index: headers read (safetensors) or files mapped without running code
        (``.bin``); every check that can fail, before any collective."""
        if self.format == "bin":
            return BinCheckpointIndex(self.folder, self.files or [], self.index)
        return CheckpointIndex(self.folder, self.files, self.index)


def _names(variant: str | None, use_safetensors: bool | None) -> list[tuple[str, str, bool]]:
    """(file name, format, is an index) in transformers' order of preference."""
    v = f".{variant}" if variant else ""
    out = []
    if use_safetensors is not False:
        out += [
            (f"model{v}.safetensors.index.json", "safetensors", True),
            (f"model{v}.safetensors", "safetensors", False),
        ]
    if use_safetensors is not True:
        out += [
            (f"pytorch_model{v}.bin.index.json", "bin", True),
            (f"pytorch_model{v}.bin", "bin", False),
        ]
    return out


def _download_kwargs(source: str, download: dict[str, Any]) -> dict[str, Any]:
    """``download`` with the revision resolved once to a commit (a hub id) and offline mode
    honoured, as transformers' ``from_pretrained`` does."""
    from transformers.utils.hub import is_offline_mode, resolve_revision

    out = {k: v for k, v in download.items() if v is not None}
    if is_offline_mode():
        out["local_files_only"] = True
    if not os.path.isdir(source):
        revision = resolve_revision(
            source,
            out.get("revision"),
            token=out.get("token"),
            local_files_only=out.get("local_files_only", False),
            cache_dir=out.get("cache_dir"),
        )
        if revision is not None:
            out["revision"] = revision
    return out


def _cached(source: str, name: str, download: dict[str, Any]) -> Path | None:
    from transformers.utils.hub import cached_file

    found = cached_file(
        source,
        name,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
        **download,
    )
    return Path(found) if found else None


def _where(source: str, download: dict[str, Any]) -> str:
    if os.path.isdir(source):
        sub = download.get("subfolder")
        return f"the directory {os.path.join(source, sub) if sub else source}"
    what = f"the hub repository {source!r}"
    if download.get("revision"):
        what += f" at revision {download['revision']}"
    if download.get("subfolder"):
        what += f", subfolder {download['subfolder']!r}"
    if download.get("local_files_only"):
        what += " (offline: the hub cache only" + (
            f", cache_dir={download['cache_dir']})" if download.get("cache_dir") else ")"
        )
    return what


def resolve_checkpoint(
    source: str | os.PathLike,
    variant: str | None = None,
    use_safetensors: bool | None = None,
    **download: Any,
) -> Checkpoint:
    """The weight files ``source`` (a local directory or file, or a hub id) means, fetched if
    needed and allowed; FileNotFoundError naming what was looked for and where otherwise."""
    source = str(source)
    if os.path.isfile(source):  # one weights file given directly
        fmt = "bin" if source.endswith(".bin") else "safetensors"
        return Checkpoint(source, Path(source).parent, [Path(source)], fmt)
    unknown = set(download) - set(DOWNLOAD_KEYS)
    if unknown:
        raise TypeError(f"resolve_checkpoint: unknown keyword(s) {sorted(unknown)}")
    download = _download_kwargs(source, download)
    names = _names(variant, use_safetensors)
    for name, fmt, is_index in names:
        found = _cached(source, name, download)
        if found is None:
            continue
        if not is_index:
            return Checkpoint(source, found.parent, [found], fmt, None, download)
        files = []
        for shard in sorted(set(read_weight_map(found).values())):
            got = _cached(source, shard, download)
            if got is None:
                raise FileNotFoundError(
                    f"{found} names the shard {shard}, which {_where(source, download)} does "
                    "not hold (or it could not be fetched); the checkpoint is incomplete."
                )
            files.append(got)
        return Checkpoint(source, found.parent, files, fmt, found, download)
    local = Path(source, download.get("subfolder") or "")
    if local.is_dir() and use_safetensors is not False and any(local.glob("*.safetensors")):
        return Checkpoint(source, local, None, "safetensors", None, download)
    looked = ", ".join(n for n, _, _ in names)
    raise FileNotFoundError(
        f"No checkpoint weights in {_where(source, download)}: looked for {looked}. "
        "Give a directory saved with save_pretrained, or a hub id that is in the hub cache "
        "(offline) or can be downloaded (unset HF_HUB_OFFLINE / local_files_only)."
    )


def resolve_folder(source: str | os.PathLike, **download: Any) -> Path:
    """The local directory holding ``source``'s config.json (a hub id: its snapshot in the hub
    cache, fetched if needed and allowed). FileNotFoundError / OSError when it cannot be had."""
    from transformers.utils.hub import cached_file

    source = str(source)
    download = _download_kwargs(source, download)
    return Path(cached_file(source, "config.json", **download)).parent
