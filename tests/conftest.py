"""Shared pytest helpers and fixtures for the fedfleet test suite.

- ``require_mosquitto()``: skip a test when the ``mosquitto`` binary is missing, but FAIL it when
  the environment variable ``CI`` is ``"true"`` (Mosquitto is required in CI, DESIGN.md §8).
- ``broker_kind``: parametrized over ``"mosquitto"`` (marked ``mosquitto``) and ``"amqtt"``.
- ``embedded_broker``: a running ``EmbeddedBroker`` of ``broker_kind``, logging under ``tmp_path``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_server.embedded_broker import EmbeddedBroker, mosquitto_available

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
