"""What MqttTransport reports of QoS 1 PUBLISH packets when the connection is lost with some of
them still unwritten in paho's queue: paho re-sends them all with the DUP flag after the
reconnect, but only a packet the socket had taken a byte of was ever on the wire before. The
ledger counts a PUBLISH-DUP row per packet event reported with ``dup=True``, so the packet events
must say DUP only for real retransmissions; a relay counts what was on the wire."""

from __future__ import annotations

import socket
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from helpers.waiting import wait_for

from broker_server.audit._queries import deliveries
from broker_server.embedded_broker import EmbeddedBroker
from protocol.transport import MqttTransport, _CountingClient
from protocol.transport_base import PacketEvent
from tools.counting_relay import CountingRelay


def test_a_publish_dropped_unwritten_is_a_first_transmission_after_the_reconnect(tmp_path: Path) -> None:
    """Three 1 MB PUBLISHes on a connection whose relay stops reading: the client's socket (send
    buffer set to 16 KiB) takes part of the first, the other two stay in paho's queue. The
    broker side is then closed, and the relay reads again only once the client has closed its
    socket: a client writes on until it sees the close, and a relay reading meanwhile let it put
    the rest of the first and part of the second on the wire once in a loaded suite (then the
    second was a real retransmission). After the reconnect all three go out with DUP set; by hand:
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
            relay.cut(first, keep_held=True)
            assert wait_for(lambda: not tr.connected, 10.0)  # paho closed the socket, then said so
            assert len(tr._client.unwritten_mids()) == 2  # the queue as the lost connection left it
            relay.release(first)
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


def test_the_note_of_an_unwritten_publish_covers_one_re_send_and_not_a_reused_message_id() -> None:
    """Packets queued by hand (no socket: nothing is written), then a reconnect to a closed port.
    Message 7: its re-send with DUP is its first transmission, a second re-send a retransmission.
    Message 9 is withdrawn instead (never re-sent) and a new message reuses id 9: the note ends
    there, so the new message's re-send with DUP is a retransmission. By hand: dup = F, F, T, F, F, T."""
    with socket.socket() as s:  # a loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    events: list[PacketEvent] = []
    client = _CountingClient(mqtt.CallbackAPIVersion.VERSION2, client_id="note", on_packet=events.append)
    client.connect_async("127.0.0.1", port)
    topic = b"\x00\x01t"

    def publish(mid: int, dup: bool = False) -> None:  # QoS 1, payload "x"
        packet = bytes([0x32 | (0x08 if dup else 0), len(topic) + 3]) + topic + mid.to_bytes(2, "big") + b"x"
        client._packet_queue(0x30, packet, mid, 1)

    publish(7)
    assert client.unwritten_mids() == {7}
    with pytest.raises(ConnectionRefusedError):
        client.reconnect()  # notes mid 7, then paho empties its queue and fails to connect
    assert client.unwritten_mids() == set()
    publish(7, dup=True)  # paho's re-send: the first time on the wire
    publish(7, dup=True)  # a retransmission of that
    publish(9)
    with pytest.raises(ConnectionRefusedError):
        client.reconnect()  # notes mid 9
    publish(9)  # a new message reusing mid 9 (the old one was withdrawn)
    publish(9, dup=True)  # its retransmission
    assert [e.dup for e in events] == [False, False, True, False, False, True]
    assert {e.packet_type for e in events} == {"PUBLISH"}


def test_a_qos0_message_while_the_link_is_down_is_said_undeliverable_not_counted_sent(tmp_path: Path) -> None:
    """``[protocol] qos = 0``: paho keeps no QoS 0 PUBLISH for the reconnect (MQTT's at most
    once), so one made while the link is down never reaches the socket. The transport raises
    PublishDropped; the channel says the message undeliverable (error log, a ledger row of kind
    ``undeliverable``, :attr:`undeliverable`) and writes no ``sent`` row, so the ledger's sent bytes
    stay the socket's: the relay sees no PUBLISH on either connection. A QoS 1 publish on the same
    down link is queued and arrives after the reconnect (paho's queue), as before."""
    from protocol.channel import Channel
    from protocol.errors import PublishDropped
    from protocol.ledger import Ledger
    from protocol.messages import Update

    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        tr = MqttTransport("q0-dev", "127.0.0.1", relay.port, mqtt_version="3.1.1", keepalive_s=30)
        ledger = Ledger(tmp_path / "ledger.sqlite")
        ch = Channel(tr, node_id="q0-dev", side="agent", federation="fed", ledger=ledger, qos=0)
        try:
            tr.connect(timeout_s=10.0)
            first = relay.connections - 1
            relay.cut(first)
            assert wait_for(lambda: not tr.connected, 10.0)
            topic = "fedfleet/v1/fed/up/q0-dev/update"
            update = Update(tensors=(np.arange(8, dtype=np.float32),), num_samples=10, train_loss=0.5, metrics={})
            with pytest.raises(PublishDropped, match="QoS 0 PUBLISH to .* not sent: the link is down"):
                tr.publish(topic, b"x", qos=0)
            ch.send(topic, update, round=1)  # no raise without wait_s: said, not thrown
            assert ch.undeliverable == 1 and "not sent" in ch.undeliverable_reasons[-1]
            with pytest.raises(PublishDropped):
                ch.send(topic, update, round=1, wait_s=1.0)
            assert ch.undeliverable == 2
            tr.publish("t/queued", b"q1", qos=1)  # QoS 1 on the same down link: queued
            assert wait_for(lambda: tr.connected, 20.0)
            again = first + 1
            assert wait_for(lambda: relay.packets(again)["PUBLISH"] + relay.packets(again)["PUBLISH-DUP"] == 1, 10.0)
            ledger.flush()
            rows = ledger.rows()
            # the CONNECTs are the channel's control rows; no message row is "sent"
            assert [r.kind for r in rows if r.event == "sent" and r.reason != "control"] == []
            assert [r.kind for r in rows if r.event == "message"] == ["undeliverable", "undeliverable"]
            assert relay.packets(first)["PUBLISH"] == 0
            # the audit tells them apart from messages the broker refused: not sent, the link down
            told = deliveries([asdict(r) for r in rows])
            assert (told["not_sent"], told["undeliverable"], told["refused"]) == (2, 0, 0)
        finally:
            tr.close()
            relay.close()
            ledger.close()
