"""Shared pytest helpers and fixtures for the fedfleet test suite.

- ``require_mosquitto()``: skip a test when the ``mosquitto`` binary is missing, but FAIL it when
  the environment variable ``CI`` is ``"true"`` (Mosquitto is required in CI, DESIGN.md §8).
- ``broker_kind``: parametrized over ``"mosquitto"`` (marked ``mosquitto``) and ``"amqtt"``.
- ``embedded_broker``: a running ``EmbeddedBroker`` of ``broker_kind``, logging under ``tmp_path``.
- ``memory_hub``: an in-memory broker (:class:`MemoryHub`) for a whole federation in one process
  (topic filters matched as MQTT does, no retained messages, QoS ignored).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_server.embedded_broker import EmbeddedBroker, mosquitto_available
from protocol.transport import Incoming

#: Broker implementations the integration tests run against.
BROKER_KINDS = ("mosquitto", "amqtt")


def require_mosquitto() -> None:
    """Skip the calling test when no ``mosquitto`` binary is installed; fail it when CI == "true"."""
    if mosquitto_available():
        return
    reason = "mosquitto binary not found on PATH or in /usr/sbin (apt-get install mosquitto)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; Mosquitto is required when CI=true", pytrace=False)
    pytest.skip(reason=reason)


@pytest.fixture(
    params=[pytest.param("mosquitto", marks=pytest.mark.mosquitto), "amqtt"],
    ids=list(BROKER_KINDS),
)
def broker_kind(request: pytest.FixtureRequest) -> str:
    """Name of a broker implementation; the Mosquitto case goes through ``require_mosquitto()``."""
    if request.param == "mosquitto":
        require_mosquitto()
    return request.param


@pytest.fixture
def embedded_broker(broker_kind: str, tmp_path: Path) -> Iterator[EmbeddedBroker]:
    """A started ``EmbeddedBroker(kind=broker_kind)``; stopped after the test. Log in ``tmp_path``."""
    with EmbeddedBroker(kind=broker_kind, workdir=tmp_path / f"broker-{broker_kind}") as broker:
        yield broker


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never download: torchvision downloads are disabled for every test."""
    monkeypatch.setenv("FEDFLEET_OFFLINE", "1")


# ------------------------------------------------------------------ in-memory broker


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
