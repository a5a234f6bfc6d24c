"""Shared fixtures of the broker_server tests: an in-memory broker for a whole federation in one
process (topic filters as MQTT matches them, no retained messages, QoS ignored)."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from protocol.transport import Incoming


def _matches(filt: str, topic: str) -> bool:
    """MQTT topic-filter match (``+`` one level, ``#`` the rest)."""
    f, t = filt.split("/"), topic.split("/")
    for i, part in enumerate(f):
        if part == "#":
            return True
        if i >= len(t) or (part != "+" and part != t[i]):
            return False
    return len(f) == len(t)


class MemoryHub:
    """Routes every publish to the transports whose filters match its topic."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.transports: list[HubTransport] = []
        self.published: list[tuple[str, str, bytes]] = []  # (publisher, topic, payload)

    def transport(self, name: str) -> HubTransport:
        t = HubTransport(self, name)
        with self.lock:
            self.transports.append(t)
        return t

    def route(self, sender: str, topic: str, payload: bytes) -> None:
        with self.lock:
            self.published.append((sender, topic, payload))
            targets = [t for t in self.transports if any(_matches(f, topic) for f in t.filters)]
        for t in targets:
            t.inbox.put(Incoming(topic, payload, 1, False, time.monotonic()))


class HubTransport:
    """One node's side of a :class:`MemoryHub` (the transport interface the channel uses)."""

    def __init__(self, hub: MemoryHub, name: str) -> None:
        self.hub, self.name = hub, name
        self.filters: list[str] = []
        self.inbox: queue.Queue[Incoming] = queue.Queue()

    def subscribe(self, filters: list[str], qos: int = 1) -> None:
        self.filters += list(filters)

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                wait_s: float | None = None) -> None:
        self.hub.route(self.name, topic, payload)

    def get(self, timeout_s: float | None) -> Incoming | None:
        try:
            return self.inbox.get(timeout=timeout_s or 0.001)
        except queue.Empty:
            return None

    def close(self) -> None:
        pass


@pytest.fixture
def memory_hub() -> MemoryHub:
    """A fresh in-memory broker."""
    return MemoryHub()
