"""Cheap per-phase wall-time accounting (two ``time.perf_counter`` reads a phase), for the
per-round breakdown in ``metrics.jsonl`` (``phase_s``) and ``tools/bench_round.py``.

A :class:`PhaseClock` sums seconds by phase name, from any thread. Code is timed three ways,
none of which re-indents it: :meth:`PhaseClock.lap` (consecutive sections of one function: each
``mark(name)`` charges the time since the previous mark), :meth:`PhaseClock.timed` (every call
of a function), :meth:`PhaseClock.add` (a duration measured elsewhere).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["PhaseClock"]


class PhaseClock:
    """Seconds (and calls) per phase name; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}
        self._calls: dict[str, int] = {}

    def add(self, name: str, seconds: float) -> None:
        """Charge ``seconds`` (>= 0) to phase ``name``."""
        with self._lock:
            self._seconds[name] = self._seconds.get(name, 0.0) + max(0.0, seconds)
            self._calls[name] = self._calls.get(name, 0) + 1

    def lap(self) -> Callable[[str], float]:
        """A marker for consecutive sections: each ``mark(name)`` charges the seconds since the
        previous mark (or since :meth:`lap`) to ``name`` and returns them."""
        last = [time.perf_counter()]

        def mark(name: str) -> float:
            now = time.perf_counter()
            seconds = now - last[0]
            last[0] = now
            self.add(name, seconds)
            return seconds

        return mark

    def timed(self, name: str, fn: F) -> F:
        """``fn`` wrapped so that every call's duration is charged to ``name`` (exceptions too)."""

        @functools.wraps(fn)
        def wrapper(*args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.add(name, time.perf_counter() - t)

        return wrapper  # type: ignore[return-value]

    def snapshot(self) -> dict[str, float]:
        """Seconds per phase so far."""
        with self._lock:
            return dict(self._seconds)

    def calls(self) -> dict[str, int]:
        """Charges per phase so far."""
        with self._lock:
            return dict(self._calls)

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last :meth:`take` (the clock restarts from zero)."""
        with self._lock:
            out, self._seconds, self._calls = self._seconds, {}, {}
            return out
