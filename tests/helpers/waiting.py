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


def subscribed(transport: object, topic: str, bound_s: float = 10.0) -> None:
    """Subscribe ``transport`` (a :class:`protocol.transport.MqttTransport`, connected) to
    ``topic`` and return once the subscription is in place: it publishes a marker there and
    waits for it to come back. ``subscribe`` does not wait for the SUBACK, so another client's
    publish can reach the broker first on a busy machine and be lost to this one.

    Raises:
        AssertionError: the marker did not come back within ``bound_s`` seconds, or something
            else arrived first.
    """
    marker = b"subscribed " + topic.encode()
    transport.subscribe([topic])  # type: ignore[attr-defined]
    transport.publish(topic, marker, wait_s=bound_s)  # type: ignore[attr-defined]
    got = transport.get(bound_s)  # type: ignore[attr-defined]
    assert got is not None and got.payload == marker, f"{topic}: the subscription's marker came back as {got}"
