"""Waiting on a condition another thread makes true (an agent's loop, a broker's delivery)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], object], bound_s: float = 60.0, step_s: float = 0.02) -> bool:
    """Poll ``cond`` every ``step_s`` seconds until it is true or ``bound_s`` seconds have
    passed; return its last value as a bool. The bound only keeps a broken test from hanging:
    callers assert the result, never the time it took."""
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step_s)
    return bool(cond())
