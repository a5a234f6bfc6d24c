"""What a channel keeps of a message the broker acknowledged: under MQTT 5 nothing of its payload
(a PUBACK there carries its own reason code); under MQTT 3.1.1 the message for the transport's
refusal-after-acknowledgement window (10 x ACK_CLOSE_S), then only its row; and an agent's channel
keeps no last payload."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from broker_server.embedded_broker import EmbeddedBroker
from protocol.channel import Channel
from protocol.messages import Status
from protocol.transport import ACK_CLOSE_S, MqttTransport
from tests.helpers.brokers import require_mosquitto


@pytest.mark.parametrize(("version", "window"), [("5", 0.0), ("3.1.1", 10 * ACK_CLOSE_S)])
def test_an_acknowledged_message_is_let_go_after_the_refusal_window(tmp_path: Path, version: str,
                                                                   window: float) -> None:
    require_mosquitto()
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "broker") as broker:
        tr = MqttTransport(f"hold-{version}", broker.host, broker.port, mqtt_version=version)
        tr.connect(timeout_s=10.0)
        ch = Channel(tr, node_id="dev-a", side="agent", federation="fed", ledger=None)
        ch.keep_last_payload = False
        try:
            assert tr.ack_refusal_window_s == window
            enc = ch.send("fedfleet/v1/fed/up/dev-a/status", Status("online", "x" * 50_000), round=0, wait_s=10.0)
            deadline = time.monotonic() + 10.0
            while ch.acked < 1 and time.monotonic() < deadline:  # the delivery listener runs on paho's thread
                time.sleep(0.01)
            assert ch.acked == 1 and ch.last_payload is None
            held = [e[2] for e in ch._acked_recently.values()]
            assert len(held) == 1  # the row of the acknowledged handle is known either way
            if window == 0.0:
                assert held == [None] and ch._sent[enc.seq].out is None  # nothing of the payload kept
            else:
                assert held[0] is not None and held[0].payload == enc.payload  # may still be refused
                ch._release_acked(time.monotonic() + window + 0.1)
                assert [e[2] for e in ch._acked_recently.values()] == [None] and ch._sent[enc.seq].out is None
        finally:
            ch.close()
