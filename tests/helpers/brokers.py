"""Broker availability for the tests that need a real one."""

from __future__ import annotations

import os

import pytest

from broker_server.embedded_broker import mosquitto_available

#: Broker implementations the integration tests run against.
BROKER_KINDS = ("mosquitto", "amqtt")


def require_mosquitto() -> None:
    """Skip the calling test when no ``mosquitto`` binary is installed; fail it when CI == "true"
    (Mosquitto is required in CI, DESIGN.md §8)."""
    if mosquitto_available():
        return
    reason = "mosquitto binary not found on PATH or in /usr/sbin (apt-get install mosquitto)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; Mosquitto is required when CI=true", pytrace=False)
    pytest.skip(reason=reason)
