"""Private-file helpers shared by the key folder (:mod:`.keys`) and the replay store (:mod:`.replay`)."""

from __future__ import annotations

import os
from pathlib import Path


def _write_private(path: Path, data: bytes) -> None:
    """Create ``path`` with mode 0600 from the start (never readable by others, not even briefly)."""
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _fsync_dir(directory: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
