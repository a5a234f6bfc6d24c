"""Reading a run's checkpoint store from outside the server (while it may be writing), and
killing a run's process at a chosen point of it."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def checkpoint_round(path: Path) -> int:
    """The newest round in the checkpoint store ``path`` (read-only), or -1 when the file is
    missing, empty or not readable yet."""
    if not path.exists():
        return -1
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)
        try:
            row = db.execute("SELECT MAX(round) FROM checkpoints").fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        return -1
    return -1 if row is None or row[0] is None else int(row[0])


def kill_when(proc: subprocess.Popen, ready: Callable[[], bool], log: Path) -> None:
    """SIGKILL ``proc`` as soon as ``ready()`` holds (polled every 20 ms); it must still be
    running then (the assertion shows the end of its ``log``). The process is killed and reaped
    whatever happens, so no test leaves it behind."""
    try:
        while proc.poll() is None and not ready():
            time.sleep(0.02)
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
