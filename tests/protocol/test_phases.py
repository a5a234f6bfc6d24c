"""protocol.phases.PhaseClock: seconds per phase, from laps, wrapped calls and added durations."""

from __future__ import annotations

import pytest

from protocol import phases
from protocol.phases import PhaseClock


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_laps_wrapped_calls_and_take(monkeypatch: pytest.MonkeyPatch) -> None:
    t = FakeTime()
    monkeypatch.setattr(phases, "time", t)
    clock = PhaseClock()
    mark = clock.lap()
    t.now += 1.5
    assert mark("select") == 1.5
    t.now += 0.25
    mark("publish")
    t.now += 2.0
    mark("select")

    def work(x: int) -> int:
        t.now += 0.5
        if x < 0:
            raise ValueError("negative")
        return 2 * x

    timed = clock.timed("receive", work)
    assert timed(3) == 6
    with pytest.raises(ValueError):
        timed(-1)  # a call that raises is charged too
    clock.add("ledger", 0.125)
    clock.add("ledger", -1.0)  # a negative duration counts as 0
    assert clock.snapshot() == {"select": 3.5, "publish": 0.25, "receive": 1.0, "ledger": 0.125}
    assert clock.calls() == {"select": 2, "publish": 1, "receive": 2, "ledger": 2}
    assert clock.take() == {"select": 3.5, "publish": 0.25, "receive": 1.0, "ledger": 0.125}
    assert clock.take() == {} and clock.calls() == {}
