"""Torchvision downloads, made safe: into a fresh temporary folder, validated, then moved into
place one atomic rename per entry, so a failed download never leaves anything behind."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from edge_agent.data._records import DatasetInfo
from edge_agent.data._torchvision import read_torchvision
from edge_agent.errors import DataError


def download_root(user_dir: Path | None, cache: Path) -> Path:
    """Where a successful download is placed: the user's data folder if it is an existing,
    writable folder, else ``cache``, the torchvision cache (a missing data folder is never
    created)."""
    if user_dir is not None and user_dir.is_dir() and os.access(user_dir, os.W_OK | os.X_OK):
        return user_dir
    return cache


def download_torchvision(info: DatasetInfo, user_dir: Path | None, cache: Path) -> str:
    """Download ``info.torchvision`` into a fresh temporary folder, then move it into place.

    Args:
        info: a registry entry with ``torchvision`` set.
        user_dir: the data folder of step 1 of the resolution order, or None.
        cache: the torchvision cache folder (``~/.cache/fedfleet/torchvision``, expanded).

    The temporary folder lies under ``cache`` (falling back to the system temporary
    folder when the cache cannot be created) and is removed whatever happens, so a failed
    download leaves nothing behind and never touches the user's data folder. Only after
    torchvision has downloaded and both splits have been read and validated are the files moved
    into :func:`download_root` (one ``os.replace`` per entry, merging into folders that already
    exist there).

    Returns:
        The resolved folder the files were moved into (a torchvision root for ``_folders.locate``).

    Raises:
        DataError: the download or its validation failed (the message is the reason, without
            the temporary folder's path); or the downloaded files could not be moved into place.
    """
    final_root = download_root(user_dir, cache)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp_parent: str | None = str(cache)
    except OSError:
        tmp_parent = None  # e.g. read-only home: use the system temporary folder
    tmp = Path(tempfile.mkdtemp(prefix=f".download-{info.name}-", dir=tmp_parent))
    try:
        try:
            read_torchvision(info, tmp, download=True)
        except DataError as exc:
            cause = exc.__cause__
            reason = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
            raise DataError(
                f"torchvision {info.torchvision}: {reason.strip()}", dataset=info.name
            ) from exc
        try:
            _install_tree(tmp, final_root)
        except OSError as exc:
            raise DataError(
                f"torchvision {info.torchvision} was downloaded but could not be moved into "
                f"{final_root} ({type(exc).__name__}: {exc})",
                dataset=info.name,
                path=str(final_root),
            ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final_root.resolve())


def _install_tree(src: Path, dst_dir: Path) -> None:
    """Move every entry of folder ``src`` into ``dst_dir``, which must exist (never created).

    A folder that already exists at the destination is merged into (entry by entry); anything
    else is moved with one atomic ``os.replace`` (across file systems: copied to a hidden staging
    folder beside the destination first, then renamed), so no half-written file ever appears
    under ``dst_dir``.
    """
    for entry in sorted(src.iterdir()):
        target = dst_dir / entry.name
        if entry.is_dir() and not entry.is_symlink() and target.is_dir():
            _install_tree(entry, target)
        else:
            _atomic_move(entry, target)


def _atomic_move(src: Path, dst: Path) -> None:
    try:
        os.replace(src, dst)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    staging = Path(tempfile.mkdtemp(prefix=".fedfleet-partial-", dir=dst.parent))
    try:
        staged = staging / src.name
        if src.is_dir():
            shutil.copytree(src, staged, symlinks=True)
        else:
            shutil.copy2(src, staged)
        os.replace(staged, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
