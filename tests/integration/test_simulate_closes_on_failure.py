"""A simulate run that fails mid-run closes every MQTT connection it opened before closing the
ledger, so no network thread writes into a closed ledger."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import broker_server.simulate as simulate_mod
from broker_server import config as config_mod
from protocol.ledger import ledger_closed_cleanly

pytestmark = pytest.mark.slow


def _config() -> config_mod.Config:
    return config_mod.from_dict({
        "run": {"name": "t", "seed": 1, "rounds": 3},
        "data": {"dataset": "digits", "partition": "iid", "clients": 2},
        "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "server": {"quorum": 2, "round_deadline_s": 60.0, "join_timeout_s": 60.0},
        "broker": {"kind": "amqtt"},
    }, "<test>")


class Boom(RuntimeError):
    pass


def test_a_failing_run_closes_the_server_connection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = []
    real_make_server = simulate_mod.make_server

    def spy(*args, **kwargs):
        made.append(real_make_server(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(simulate_mod, "make_server", spy)

    def fail_after_round(metrics: dict) -> None:
        raise Boom(f"round {metrics['round']} callback failed")

    with pytest.raises(Boom, match="round 1"):
        simulate_mod.simulate(_config(), run_dir=tmp_path / "run", on_round=fail_after_round)
    (server,) = made
    transport = server.channel.transport
    assert not transport.connected
    assert transport._closed
    end = time.monotonic() + 30  # paho's network threads end once their connections are closed
    while time.monotonic() < end and any(t.name.startswith("paho-mqtt-client-") for t in threading.enumerate()):
        time.sleep(0.05)
    assert [t.name for t in threading.enumerate() if t.name.startswith("paho-mqtt-client-")] == []
    assert ledger_closed_cleanly(tmp_path / "run" / "ledger.sqlite") is True
