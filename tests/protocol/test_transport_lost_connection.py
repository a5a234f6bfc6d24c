"""What MqttTransport reports of QoS 1 PUBLISH packets when the connection is lost with some of
them still unwritten in paho's queue: paho re-sends them all with the DUP flag after the
reconnect, but only a packet the socket had taken a byte of was ever on the wire before. The
ledger counts a PUBLISH-DUP row per packet event reported with ``dup=True``, so the packet events
must say DUP only for real retransmissions; a relay counts what was on the wire."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from helpers.waiting import wait_for

from broker_server.embedded_broker import EmbeddedBroker
from protocol.transport import MqttTransport
from protocol.transport_base import PacketEvent
from tools.counting_relay import CountingRelay


def test_a_publish_dropped_unwritten_is_a_first_transmission_after_the_reconnect(tmp_path: Path) -> None:
    """Three 1 MB PUBLISHes on a connection whose relay stops reading: the client's socket (send
    buffer set to 16 KiB) takes part of the first, the other two stay in paho's queue. The
    broker side is then closed. After the reconnect all three go out with DUP set; by hand:
    the wire carries 4 PUBLISH packets (the cut first one, then 3 with DUP), and the packet events
    say DUP once (the first), so ledger rows (3 messages + 1 retransmission) = 4 = the wire."""
    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        tr = MqttTransport("lost-pub", "127.0.0.1", relay.port, mqtt_version="3.1.1", keepalive_s=30)
        events: list[PacketEvent] = []
        outcomes: list[str] = []
        try:
            tr.set_packet_listener(events.append)
            tr.set_delivery_listener(lambda handle, outcome, reason: outcomes.append(outcome))
            tr.connect(timeout_s=10.0)
            first = relay.connections - 1
            tr._client.socket().setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16_384)
            relay.hold(first)
            for i in range(3):
                tr.publish("t/lost", bytes([i]) * 1_000_000, qos=1)
            assert wait_for(lambda: len(tr._client.unwritten_mids()) == 2, 10.0)
            time.sleep(0.3)  # the socket is full: still two unwritten
            assert len(tr._client.unwritten_mids()) == 2
            relay.cut(first)
            assert wait_for(lambda: outcomes.count("acked") == 3, 30.0), outcomes
        finally:
            tr.close()
            relay.close()
    assert outcomes == ["acked"] * 3
    publishes = [e for e in events if e.direction == "out" and e.packet_type == "PUBLISH"]
    assert sum(e.dup for e in publishes) == 1  # only the first was on the wire before
    assert len(publishes) == 6  # 3 first sends + 3 after the reconnect (2 of them first transmissions)
    cut, again = relay.packets(first), relay.packets(first + 1)
    assert cut["PUBLISH"] == 0 and cut["partial"] == 1  # the first one, cut off
    assert again["PUBLISH-DUP"] == 3 and again["PUBLISH"] == 0  # paho sets DUP on all three
    ledger_rows = 3 + sum(e.dup for e in publishes)
    assert ledger_rows == cut["partial"] + again["PUBLISH-DUP"] == 4
