"""Reading a run's checkpoint store from outside the server (while it may be writing)."""

from __future__ import annotations

import sqlite3
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
