"""Whole-file writes that a reader, a crash or a full disk never sees half done.

One helper for every file fedfleet replaces in place: an exported ONNX model, a FedDO policy, a
results file, the broker child's port file, the security folder's keys, epoch and replay state.
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

__all__ = ["fsync_dir", "remove_partial_files", "remove_stale_temporaries", "write_atomically", "write_private"]

#: the temporary files being written now (removed by :func:`remove_partial_files` when a process
#: must exit at once, as after a second stop signal)
_in_flight: set[Path] = set()


def write_atomically(path: str | Path, data: bytes, *, mode: int = 0o666, fsync: bool = False) -> None:
    """Replace ``path``'s contents with ``data`` at once: ``data`` is written to a hidden file
    beside it (``.NAME.PID.HEX.tmp``, created exclusively with ``mode`` less the umask, so a
    private file is never readable by others, not even briefly) and renamed onto ``path``
    (``os.replace``: atomic within one file system). A reader sees the old file or the new one;
    a failed write (a full disk, a file-size limit) leaves the old file as it was and removes
    the temporary one.

    Args:
        path: the file to write; its folder must exist.
        data: the whole new contents.
        mode: permission bits of a new file (``0o600`` for keys and replay state); the umask
            applies.
        fsync: flush the data to the device before the rename, so that after a power cut the
            path holds one whole version (the folder entry itself: :func:`fsync_dir`).

    Raises:
        IsADirectoryError: ``path`` names no file (``"."``, ``"/"``, ``""``).
        OSError: the write or the rename failed (``path`` untouched).
    """
    path = Path(path)
    if not path.name:
        raise IsADirectoryError(errno.EISDIR, "not a file's path", str(path))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    _in_flight.add(tmp)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except BaseException:
        _in_flight.discard(tmp)
        raise
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        _in_flight.discard(tmp)


def remove_partial_files() -> None:
    """Remove the temporary files of :func:`write_atomically` calls still under way (the process
    is about to exit without unwinding them: :mod:`protocol.lifecycle`'s second stop signal).
    Never raises."""
    for tmp in list(_in_flight):
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Remove the temporary files :func:`write_atomically` left beside ``path`` when its process
    was killed between writing one and renaming it (``.NAME.PID.HEX.tmp`` of a process that no
    longer runs); those of a running process are left. Returns the files removed. Never raises."""
    path = Path(path)
    removed: list[Path] = []
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid_text = tmp.name[len(path.name) + 2:].split(".")[0]
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # its process runs: its write may be under way
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):  # another user's process, or not a pid at all
            continue
        try:
            tmp.unlink()
            removed.append(tmp)
        except OSError:
            pass
    return removed


def write_private(path: str | Path, data: bytes) -> None:
    """:func:`write_atomically` for a secret or a state that must survive a power cut (keys, key
    epoch, replay state): mode 0600 from the start, flushed to the device before the rename.

    Raises:
        OSError: as :func:`write_atomically`.
    """
    write_atomically(path, data, mode=0o600, fsync=True)


def fsync_dir(directory: str | Path) -> None:
    """Flush ``directory``'s entries to the device (a rename in it survives a power cut); a no-op
    where folders cannot be opened (not POSIX).

    Raises:
        OSError: the folder cannot be opened or flushed.
    """
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
