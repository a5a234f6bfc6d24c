"""What MqttTransport reports of QoS 1 PUBLISH packets when the connection is lost with some of
them still unwritten in paho's queue: paho re-sends them all with the DUP flag after the
reconnect, but only a packet the socket had taken a byte of was ever on the wire before. The
ledger counts a PUBLISH-DUP row per packet event reported with ``dup=True``, so the packet events
must say DUP only for real retransmissions; a relay counts what was on the wire.

The later tests follow the rows of packets that are never written at all (messages withdrawn as
refused above a limit inferred from the broker's closes, retransmissions and control packets left
unwritten by a close or an abort): through a Channel into a Ledger, the audit's wire sum equals
the bytes the socket wrote and the relay counted, worked out by hand in each docstring."""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from helpers.waiting import wait_for

from broker_server.audit._queries import deliveries, totals
from broker_server.embedded_broker import EmbeddedBroker
from protocol.messages import Update
from protocol.transport import OVERSIZE_STRIKES, MqttTransport, _close_socket, _CountingClient
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
    say DUP once (the first), so ledger rows (3 messages + 1 retransmission) = 4 = the wire. The
    first one's cut is told to the delivery listener (``unsent``) before the three PUBACKs."""
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
    assert outcomes == ["unsent"] + ["acked"] * 3
    publishes = [e for e in events if e.direction == "out" and e.packet_type == "PUBLISH"]
    assert sum(e.dup for e in publishes) == 1  # only the first was on the wire before
    assert len(publishes) == 6  # 3 first sends + 3 after the reconnect (2 of them first transmissions)
    cut, again = relay.packets(first), relay.packets(first + 1)
    assert cut["PUBLISH"] == 0 and cut["partial"] == 1  # the first one, cut off
    assert again["PUBLISH-DUP"] == 3 and again["PUBLISH"] == 0  # paho sets DUP on all three
    ledger_rows = 3 + sum(e.dup for e in publishes)
    assert ledger_rows == cut["partial"] + again["PUBLISH-DUP"] == 4


def _update(i: int, values: int) -> Update:
    return Update(tensors=(np.full(values, i, dtype=np.float32),), num_samples=10, train_loss=0.5, metrics={})


@pytest.mark.parametrize("cuts", [1, 2])
def test_a_qos1_publish_cut_mid_packet_counts_in_the_ledger_as_the_socket_wrote_it(tmp_path: Path, cuts: int) -> None:
    """Three 800 KB QoS 1 updates through a Channel into a real Ledger, on a connection whose
    relay stops reading (every socket's send buffer set to 16 KiB as it opens): the socket takes
    x1 bytes of the first PUBLISH (P bytes: header + topic + payload), the other two stay in
    paho's queue. The broker side is then closed (the relay reads what the client wrote once the
    client has closed its socket, as in the test above). With ``cuts=2`` the next connection is
    held too right after its CONNECT, so its first packet, the first message's PUBLISH again
    (with DUP: x1 bytes of it were on the wire), is cut as well after x2 bytes; its broker side
    is closed the same way. The connection after that carries all three whole.

    By hand (c: a CONNECT, d: the DISCONNECT of the close; PINGREQs, if any, on both sides
    alike). The socket writes c + x1 | c (+ x2 | c) | 3P + d. The ledger's device rows: one
    CONNECT row per connection, 3 ``sent`` rows of P (the two never written went out first
    after a reconnect: no DUP row), one ``PUBLISH-DUP`` row of P per retransmission (``cuts``
    of them: after the first cut, and after the second) and the DISCONNECT: (1 + cuts)·c + 3P +
    cuts·P + d. Those equal the socket's bytes only if the cut rows keep their unsent parts out:
    the first message's ``sent`` row P − x1, the cut DUP row P − x2. Before the fix nothing was
    subtracted and the ledger was above the socket by (P − x1) (+ (P − x2)): 589,664 bytes for
    one cut (1,214,144 for two) in a run here. The broker kept packets of P bytes before (the
    transport is told so): the two closes are the link's, not taken for a size limit."""
    from protocol.channel import Channel
    from protocol.ledger import Ledger, read_rows

    topic = "fedfleet/v1/fed/up/cut-dev/update"
    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        tr = MqttTransport("fed:cut-dev", "127.0.0.1", relay.port, mqtt_version="3.1.1", keepalive_s=30)
        client = tr._client
        opened = client._call_socket_open

        def small_buffer(sock) -> None:  # paho's thread, each new socket before its CONNECT
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16_384)
            opened(sock)

        client._call_socket_open = small_buffer
        ledger = Ledger(tmp_path / "ledger.sqlite")
        ch = Channel(tr, node_id="cut-dev", side="agent", federation="fed", ledger=ledger, qos=1)
        try:
            tr.connect(timeout_s=10.0)
            first = relay.connections - 1  # the one before is connect()'s TCP probe
            relay.hold(first)
            if cuts == 2:
                relay.hold(first + 1, after_bytes=1)  # its CONNECT goes through (alone, before the CONNACK)
            for i in range(3):
                ch.send(topic, _update(i, 200_000), round=1)
            size = ledger.rows("kind = 'update'")[0].wire_bytes
            tr.kept_packet_bytes = size  # a broker that took P-byte packets: closes are the link's
            assert wait_for(lambda: len(client.unwritten_mids()) == 2, 10.0)
            time.sleep(0.3)  # the socket is full: still two unwritten
            assert len(client.unwritten_mids()) == 2
            relay.cut(first, keep_held=True)
            assert wait_for(lambda: not tr.connected, 10.0)
            relay.release(first)
            if cuts == 2:
                def dup_cut_short() -> bool:
                    queue = tuple(client._out_packet)
                    return (tr.connected and bool(queue) and bool(queue[0]["packet"][0] & 0x08)
                            and queue[0]["pos"] > 0 and len(client.unwritten_mids()) == 2)

                assert wait_for(dup_cut_short, 30.0)
                time.sleep(0.3)
                relay.cut(first + 1, keep_held=True)
                assert wait_for(lambda: not tr.connected, 10.0)
                relay.release(first + 1)
            assert wait_for(lambda: ch.acked == 3, 60.0), (ch.acked, ch.refused)
        finally:
            ch.close()
            relay.close()
            ledger.close()
    assert ch.refused == 0 and tr.inferred_max_packet_bytes == 0
    socket_out = tr.socket_bytes[0]
    assert relay.total_bytes("up") == socket_out  # the relay counted what the socket wrote
    for n in range(first, first + cuts):  # cut off mid-PUBLISH
        assert relay.packets(n)["partial"] == 1 and relay.packets(n)["CONNECT"] == 1
    last = relay.packets(first + cuts)
    assert last["PUBLISH-DUP"] == 3 and last["partial"] == 0
    rows = [r for r in read_rows(tmp_path / "ledger.sqlite") if r["side"] == "agent" and r["event"] == "sent"]
    kinds = [r["kind"] for r in rows]
    assert kinds.count("update") == 3 and kinds.count("PUBLISH-DUP") == cuts and kinds.count("CONNECT") == 1 + cuts
    connect = next(r["mqtt_header_bytes"] for r in rows if r["kind"] == "CONNECT")
    publishes = [r for r in rows if r["kind"] in ("update", "PUBLISH-DUP")]
    on_wire = [relay.parsers[(n, "up")].bytes - connect for n in range(first, first + cuts)]  # x1 (, x2)
    assert [r["unsent_bytes"] for r in publishes] == [size - on_wire[0], 0, 0] + [size - x for x in on_wire[1:]] + [0]
    assert all(0 < x < size for x in on_wire)
    ledger_wire = totals(rows, "device")["up"]["wire_bytes"]  # the audit's sum: whole packets less unsent
    assert ledger_wire == sum(r["mqtt_header_bytes"] + r["topic_bytes"] + r["payload_bytes"] - r["unsent_bytes"]
                              for r in rows)
    assert ledger_wire == socket_out  # (1 + cuts)·c + x1 (+ x2) + 3P + d, as the socket wrote
    assert ch.wire_bytes_sent + ch.control_bytes_sent == socket_out


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


def test_qos0_publishes_lost_in_paho_queue_with_the_connection_are_dropped_not_counted_sent(tmp_path: Path) -> None:
    """``[protocol] qos = 0``, the link breaks with QoS 0 PUBLISHes handed to paho (rc SUCCESS)
    but not yet written: paho's reconnect empties its queue and never sends them (it marks them
    published with rc CONN_LOST). The socket's writes are held by a gate: message A's PUBLISH gets
    100 bytes onto the wire, then the next write breaks the link; B (no wait) and C (``wait_s``)
    sit in paho's queue behind it, unwritten. By hand: A is ``cut`` (its ``sent`` row stays, with
    delivery ``dropped``: the socket took part of it), B ``dropped`` (its ``sent`` row becomes a
    ``message`` row, out of the wire totals), C's send raises PublishDropped and leaves no
    ``sent`` row; all three are undeliverable. After the reconnect D goes out whole (``written``).
    By hand: the socket wrote c + 100 | c + D + d (c: a CONNECT, d: the DISCONNECT) and the
    ledger's sent rows are c, A, c, D, d with A's ``unsent_bytes`` = A − 100, so their wire
    bytes (whole packets less unsent) are the relay's to the byte. Before the fix B stayed
    ``sent``/``handed`` (ledger > wire by its size) and C's send returned as if written; later
    A counted whole (ledger > wire by A − 100)."""
    from protocol.channel import Channel
    from protocol.errors import PublishDropped
    from protocol.ledger import Ledger
    from protocol.messages import Update

    topic = "fedfleet/v1/fed/up/q0-lost/update"

    def update(i: int) -> Update:
        return Update(tensors=(np.full(1000, i, dtype=np.float32),), num_samples=10, train_loss=0.5, metrics={})

    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        tr = MqttTransport("q0-lost", "127.0.0.1", relay.port, mqtt_version="3.1.1", keepalive_s=30)
        ledger = Ledger(tmp_path / "ledger.sqlite")
        ch = Channel(tr, node_id="q0-lost", side="agent", federation="fed", ledger=ledger, qos=0)
        inside, release = threading.Event(), threading.Event()
        state = {"broken": False}
        caught: list[BaseException] = []
        try:
            tr.connect(timeout_s=10.0)
            client = tr._client
            real_send = client._sock_send  # counts socket_bytes

            def gated(buf):  # paho's thread: the first PUBLISH gets 100 bytes out, the next write breaks the link
                if state["broken"]:
                    return real_send(buf)
                if inside.is_set():  # the rest of that PUBLISH
                    assert release.wait(30.0)
                    state["broken"] = True
                    raise ConnectionResetError("the link broke (test)")
                if len(buf) and buf[0] >> 4 == 3:
                    inside.set()
                    return real_send(bytes(buf[:100]))
                return real_send(buf)

            client._sock_send = gated  # type: ignore[method-assign]
            ch.send(topic, update(1), round=1)  # A
            assert inside.wait(10.0)
            ch.send(topic, update(2), round=1)  # B: queued behind A

            def send_c() -> None:
                try:
                    ch.send(topic, update(3), round=1, wait_s=30.0)
                except BaseException as exc:  # noqa: BLE001 (the test looks at it)
                    caught.append(exc)

            waiter = threading.Thread(target=send_c)
            waiter.start()
            # A is being written (out of paho's queue meanwhile); B and C wait behind it
            assert wait_for(lambda: sum(p["command"] & 0xF0 == mqtt.PUBLISH for p in tuple(client._out_packet)) == 2,
                            10.0)
            release.set()
            waiter.join(30.0)
            assert not waiter.is_alive()
            assert len(caught) == 1 and isinstance(caught[0], PublishDropped) and not caught[0].on_wire, caught
            # the words the undeliverable row and the log give (the audit reads its delivery, "dropped")
            assert "not sent: the link is down: the connection was lost with this" in str(caught[0])
            assert "still in the MQTT client's queue" in str(caught[0])
            assert wait_for(lambda: ch.undeliverable == 3, 10.0), ch.undeliverable_reasons
            assert wait_for(lambda: tr.connected and tr.connects == 2, 30.0)  # paho reconnects
            d = ch.send(topic, update(4), round=1, wait_s=10.0)  # D: written whole
            assert wait_for(lambda: not ch.in_flight(d.seq), 10.0)
            assert ch._handles == {}  # every QoS 0 handle had its outcome: none held
        finally:
            release.set()
            ch.close()
            relay.close()
        ledger.flush()
        rows = [r for r in ledger.rows() if r.kind == "update"]
        ledger.close()
    assert [(r.event, r.delivery) for r in rows] == [("sent", "dropped"), ("message", "dropped"),
                                                     ("sent", "handed")]  # A cut, B dropped, D; C: no row
    assert "after the socket took 100 of the" in rows[0].reason and "none of it written" in rows[1].reason
    a_size = rows[0].mqtt_header_bytes + rows[0].topic_bytes + rows[0].payload_bytes
    assert [r.unsent_bytes for r in rows] == [a_size - 100, 0, 0]  # A's part the socket never took
    sent_rows = [asdict(r) for r in Ledger(tmp_path / "ledger.sqlite").rows() if r.event == "sent"]
    assert [r["kind"] for r in sent_rows if r["kind"] != "PINGREQ"] == ["CONNECT", "update", "CONNECT", "update",
                                                                          "DISCONNECT"]
    wire = relay.bytes_per_node()[("q0-lost", "up")]
    assert wire == tr.socket_bytes[0]
    assert sum(r["mqtt_header_bytes"] + r["topic_bytes"] + r["payload_bytes"] - r["unsent_bytes"]
               for r in sent_rows) == wire
    assert totals(sent_rows, "device")["up"]["wire_bytes"] == wire  # the audit's sum
    assert ch.wire_bytes_sent + ch.control_bytes_sent == wire


def test_the_reconnect_reports_the_qos0_and_control_packets_it_drops_from_paho_queue() -> None:
    """Packets queued by hand (no socket: nothing written), one QoS 0 PUBLISH said partly written,
    one not, and a SUBSCRIBE; then paho's reconnect to a closed port, which empties the queue. The
    two QoS 0 handles go to ``on_lost`` with what the socket took of each (5, 0) and carry paho's
    rc CONN_LOST; the SUBSCRIBE, whose queueing was reported, is reported again as ``dropped``
    (never on the wire). A QoS 1 PUBLISH is not reported (its message is sent again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    events: list[PacketEvent] = []
    lost: list[tuple[list, str]] = []
    client = _CountingClient(mqtt.CallbackAPIVersion.VERSION2, client_id="lost0", on_packet=events.append,
                             on_lost=lambda items, why: lost.append((items, why)))
    client.connect_async("127.0.0.1", port)
    topic = b"\x00\x01t"
    infos = [mqtt.MQTTMessageInfo(mid) for mid in (1, 2)]
    for info in infos:  # QoS 0, payload "x"
        client._packet_queue(0x30, bytes([0x30, len(topic) + 1]) + topic + b"x", info.mid, 0, info)
    client._packet_queue(0x30, bytes([0x32, len(topic) + 3]) + topic + b"\x00\x03x", 3, 1)  # QoS 1
    client._packet_queue(0x82, b"\x82\x06\x00\x04\x00\x01t\x01", 4, 1)  # SUBSCRIBE
    client._out_packet[0]["pos"] = 5
    with pytest.raises(ConnectionRefusedError):
        client.reconnect()
    assert len(lost) == 1 and lost[0][1] == "the link is down: the connection was lost"
    assert [(i, n, taken) for i, n, taken in lost[0][0]] == [(infos[0], 6, 5), (infos[1], 6, 0)]
    assert all(i.rc == mqtt.MQTT_ERR_CONN_LOST for i in infos)
    assert [(e.packet_type, e.packet_bytes) for e in events if e.dropped] == [("SUBSCRIBE", 8)]
    assert client.take_lost_qos0() == []  # reported once


def test_the_packet_the_socket_took_part_of_is_reported_once_with_its_row_or_its_message() -> None:
    """Packets queued by hand (no socket: nothing written), the packet listener answering each
    event with its index (a channel answers with its ledger row, and nothing for a PUBLISH without
    DUP). Only the head of paho's queue can be partly written (``pos`` set by hand). By hand:

    1. a SUBSCRIBE (8 bytes) at the head, 3 bytes written, a PINGREQ behind it: ``report_cut``
       names the SUBSCRIBE's event, answer 0, no handle and 5 bytes never written; a second call
       says nothing, and paho's reconnect (to a closed port) only drops the PINGREQ;
    2. a QoS 1 PUBLISH (8 bytes; its message in paho's out-messages), its first transmission, 4
       bytes written: named by the message's handle (the channel's row is the message's);
    3. the same message again with DUP, 2 bytes written: a retransmission, named by the answer
       for its event (the channel's ``PUBLISH-DUP`` row), no handle;
    4. again with DUP, none of it written when the connection is lost; then its re-send in place
       of it (reported without DUP: no row of its own), 5 bytes written: named as the packet it
       replaces, by 4's event and answer (that ``PUBLISH-DUP`` row stands for this one);
    5. a new message reusing an id whose last packet was dropped unwritten (no DUP flag): named
       by its own handle, not by the note of the old one.
    A QoS 0 PUBLISH is left to ``on_lost`` (the test above): ``report_cut`` says nothing of it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    events: list[PacketEvent] = []
    cuts: list[tuple[PacketEvent, object, object, int]] = []

    def answer(ev: PacketEvent) -> int:
        events.append(ev)
        return len(events) - 1

    client = _CountingClient(mqtt.CallbackAPIVersion.VERSION2, client_id="cut", on_packet=answer,
                             on_cut=lambda ev, ref, handle, unsent: cuts.append((ev, ref, handle, unsent)))
    client.connect_async("127.0.0.1", port)

    def lose_connection() -> None:
        with pytest.raises(ConnectionRefusedError):
            client.reconnect()  # reports, notes, then paho empties its queue and fails to connect

    def queue(packet: bytes, mid: int, qos: int, pos: int, info=None) -> None:
        client._packet_queue(packet[0] & 0xF0, packet, mid, qos, info)
        client._out_packet[-1]["pos"] = pos

    topic = b"\x00\x01t"
    queue(b"\x82\x06\x00\x04\x00\x01t\x01", 4, 1, 3)  # 1. SUBSCRIBE, 8 bytes
    queue(b"\xc0\x00", 0, 0, 0)  # PINGREQ
    client.report_cut()
    client.report_cut()  # reported once
    assert cuts == [(events[0], 0, None, 5)]
    lose_connection()
    assert len(cuts) == 1 and [(e.packet_type, e.packet_bytes) for e in events if e.dropped] == [("PINGREQ", 2)]

    msg = mqtt.MQTTMessage(mid=5, topic=b"t")
    msg.qos = 1
    client._out_messages[5] = msg
    publish = bytes([0x32, len(topic) + 3]) + topic + b"\x00\x05x"  # QoS 1, payload "x": 8 bytes
    dup = bytes([publish[0] | 0x08]) + publish[1:]
    queue(publish, 5, 1, 4)  # 2.
    lose_connection()
    assert cuts[1] == (events[-1], len(events) - 1, msg.info, 4) and not events[-1].dup
    queue(dup, 5, 1, 2)  # 3.
    lose_connection()
    assert cuts[2] == (events[-1], len(events) - 1, None, 6) and events[-1].dup
    queue(dup, 5, 1, 0)  # 4. dropped unwritten: its row stands for the next send
    replaced = (events[-1], len(events) - 1)
    lose_connection()
    assert len(cuts) == 3 and client._never_written == {5}
    queue(dup, 5, 1, 3)  # its re-send in place, cut
    assert not events[-1].dup  # no row of its own
    lose_connection()
    assert cuts[3] == (*replaced, None, 5) and replaced[0].dup

    queue(publish, 5, 1, 0)  # 5. unwritten, then a new message under id 5
    lose_connection()
    new = mqtt.MQTTMessage(mid=5, topic=b"t")
    new.qos = 1
    client._out_messages[5] = new
    queue(publish, 5, 1, 1)
    lose_connection()
    assert cuts[4] == (events[-1], len(events) - 1, new.info, 7)

    qos0 = mqtt.MQTTMessageInfo(6)
    queue(bytes([0x30, len(topic) + 1]) + topic + b"x", 6, 0, 1, qos0)
    client.report_cut()
    assert len(cuts) == 5


def test_a_flapping_link_is_not_taken_for_a_packet_limit_below_what_the_broker_kept() -> None:
    """Two closes while a 103-byte-class PUBLISH awaits its PUBACK used to make the limit 51 bytes,
    though the broker had acknowledged a 5,012-byte PUBLISH and kept the connection: its limit is
    at least that, so the closes are the link's. A PUBLISH larger than any kept one still strikes,
    and the limit it leads to is never below the largest kept one (hand-worked: a 20,011-byte
    packet → 10,005, above 5,012; a 9,010-byte one → max(4,505, 5,012) = 5,012)."""
    tr = MqttTransport("flap", "127.0.0.1", 1, mqtt_version="3.1.1")
    small = mqtt.MQTTMessage(mid=1, topic=b"t/s")
    small.payload, small.qos = b"x" * 96, 1
    tr.kept_packet_bytes = 5_012

    class Client:
        def __init__(self, msgs: list) -> None:
            self.msgs = msgs

        def written_awaiting_puback(self) -> list:
            return self.msgs

    for _ in range(3):
        tr._strike(Client([small]), "link lost")
    assert tr.inferred_max_packet_bytes == 0 and tr._withdraw is None
    size = tr._packet_size(small)
    assert size < 5_012  # the small one is no larger than a kept one
    big = mqtt.MQTTMessage(mid=2, topic=b"t/b")
    big.payload, big.qos = b"x" * 20_000, 1
    # payload + topic "t/b" and its length (5) + packet id (2) + fixed header (1) and a 3-byte length
    assert tr._packet_size(big) == 20_000 + 5 + 2 + 1 + 3
    for _ in range(OVERSIZE_STRIKES):
        tr._strike(Client([big]), "link lost")
    assert tr.inferred_max_packet_bytes == 20_011 // 2
    mid = mqtt.MQTTMessage(mid=3, topic=b"t/b")
    mid.payload, mid.qos = b"x" * 9_000, 1
    assert tr._packet_size(mid) == 9_000 + 5 + 2 + 1 + 2  # half of 9,010, 4,505, is below the kept 5,012
    tr.inferred_max_packet_bytes = 0
    for _ in range(OVERSIZE_STRIKES):
        tr._strike(Client([mid]), "link lost")
    assert tr.inferred_max_packet_bytes == 5_012


@pytest.mark.mosquitto
def test_mqtt5_a_flapping_link_is_not_taken_for_a_packet_limit_below_an_acknowledged_publish(tmp_path: Path) -> None:
    """MQTT 5, through a relay to Mosquitto: an 80,000-byte PUBLISH acknowledged with success (the
    broker took the whole packet: above a limit it declared it would have closed unacknowledged,
    above its message size limit answered a refusal code), then the link closes twice while a
    47,000-byte PUBLISH, written whole, awaits its PUBACK. Those closes are the link's: no limit
    is inferred and the message is delivered on the third connection. Before, MQTT 5 PUBACKs
    never raised the kept size, so the two closes set the limit to half the 47,0xx-byte packet
    and withdrew it as refused."""
    from helpers.brokers import require_mosquitto

    from protocol.mqtt_bytes import publish_size

    require_mosquitto()
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        tr = MqttTransport("flap-v5", "127.0.0.1", relay.port, mqtt_version="5", keepalive_s=30)
        outcomes: list[tuple[object, str]] = []
        tr.set_delivery_listener(lambda handle, outcome, reason: outcomes.append((handle, outcome)))
        try:
            tr.connect(timeout_s=10.0)
            first = relay.connections - 1
            acked = tr.publish("t/acked", b"a" * 80_000, qos=1)
            assert wait_for(lambda: (acked, "acked") in outcomes, 10.0), outcomes
            assert tr.kept_packet_bytes == publish_size("t/acked", 80_000, 1, protocol=5).packet_bytes
            # held after its next read (a QoS 0 PUBLISH for it): a plain hold() raced the relay's thread, which
            # may not yet have gone back to its read after the CONNECT when the CONNACK had already come back
            relay.hold(first, after_bytes=relay.parsers[(first, "up")].bytes + 1)
            before = relay.packets(first)["PUBLISH"]
            tr.publish("t/read", b"r", qos=0)
            assert wait_for(lambda: relay.packets(first)["PUBLISH"] == before + 1, 10.0)
            for n in (first, first + 1):  # two closes while the 47 KB PUBLISH awaits its PUBACK
                relay.hold(n + 1, after_bytes=1)  # the next connection's CONNECT goes through, then it is held
                if n == first:
                    flapped = tr.publish("t/flap", b"f" * 47_000, qos=1)
                assert wait_for(lambda: tr.connected and len(tr._client.written_awaiting_puback()) == 1, 20.0)
                relay.cut(n)
                assert wait_for(lambda n=n: tr.connected and tr.connects == n - first + 2, 30.0)  # on connection n + 1
            relay.release(first + 2)
            assert wait_for(lambda: (flapped, "acked") in outcomes, 30.0), outcomes
            assert tr.connects == 3 and tr.disconnects == 2
        finally:
            tr.close()
            relay.close()
    assert [o for h, o in outcomes if h in (acked, flapped)] == ["acked", "acked"]
    assert tr.inferred_max_packet_bytes == 0 and tr.refusal(flapped) is None


def test_close_on_a_stalled_link_closes_without_the_disconnect_and_the_will_is_published(tmp_path: Path,
                                                                                        caplog) -> None:
    """A link whose broker side reads nothing (the relay holds it; the client's send buffer set to
    16 KiB), three 1 MB QoS 1 PUBLISHes queued, keepalive 600 s: close(timeout_s=0.5) cannot
    write its DISCONNECT behind them. It returns once the socket has taken no byte for 0.5 s (it
    used to wait for the keepalive to give up: about 900 s), says so in the log, and closes the
    connection without a DISCONNECT, so the broker publishes the last will (a subscriber gets it)
    and the relay counts no DISCONNECT; the three messages are reported (none acked)."""
    from protocol.transport_base import Will

    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        watcher = MqttTransport("will-watcher", "127.0.0.1", broker.port, mqtt_version="3.1.1")
        watcher.connect(timeout_s=10.0)
        watcher.subscribe(["status/#"], qos=1)
        relay = CountingRelay(broker.port)
        tr = MqttTransport("stalled", "127.0.0.1", relay.port, mqtt_version="3.1.1", keepalive_s=600,
                           will=Will("status/stalled", b"gone", qos=1, retain=False))
        outcomes: list[str] = []
        tr.set_delivery_listener(lambda handle, outcome, reason: outcomes.append(outcome))
        closer = threading.Thread(target=tr.close, kwargs={"timeout_s": 0.5})
        try:
            tr.connect(timeout_s=10.0)
            first = relay.connections - 1
            tr._client.socket().setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16_384)
            # held after its next read (a QoS 0 PUBLISH for it): a plain hold() raced the relay's thread, which
            # may not yet have gone back to its read after the CONNECT when the CONNACK had already come back
            relay.hold(first, after_bytes=relay.parsers[(first, "up")].bytes + 1)
            tr.publish("t/read", b"r", qos=0)
            assert wait_for(lambda: relay.packets(first)["PUBLISH"] == 1, 10.0)
            for i in range(3):
                tr.publish("t/stalled", bytes([i]) * 1_000_000, qos=1)
            assert wait_for(lambda: len(tr._client.unwritten_mids()) == 2, 10.0)
            caplog.set_level(logging.WARNING, logger="protocol.transport")
            closer.start()
            closer.join(120.0)  # a bound for a failure only: the keepalive would take 600 s and more
            assert not closer.is_alive()
            assert "stalled: the DISCONNECT could not be written (the socket took no byte in 0.5 s" in caplog.text
            relay.release(first)
            got = watcher.get(30.0)
            assert got is not None and (got.topic, got.payload) == ("status/stalled", b"gone")
        finally:
            if closer.is_alive():
                tr.abort()
            tr.close()
            watcher.close()
            relay.close(timeout_s=30.0)
    assert relay.packets(first)["DISCONNECT"] == 0 and relay.packets(first)["partial"] == 1
    # the QoS 0 one written; the first 1 MB one cut (its unsent rest, then the socket never took it whole), the
    # other two never written
    assert outcomes == ["written", "unsent", "cut", "dropped", "dropped"]


class _SlowRelay:
    """A TCP relay 127.0.0.1:``port`` → the broker whose client → broker direction goes at about
    ``rate`` bytes per second (4 KiB reads, a small receive buffer: the relay's kernel takes a
    little at a time, as a slow link does); it keeps the bytes it forwarded that way (``up``)."""

    def __init__(self, target_port: int, rate: int) -> None:
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4_096)  # the accepted sockets inherit it
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen()
        self.port = self.srv.getsockname()[1]
        self.target, self.rate, self.up = target_port, rate, bytearray()
        self.threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self.target))
            for src, dst, up in ((c, b, True), (b, c, False)):
                t = threading.Thread(target=self._pump, args=(src, dst, up), daemon=True)
                t.start()
                self.threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(4_096 if up else 65_536):
                if up:
                    self.up += data
                    time.sleep(len(data) / self.rate)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self, timeout_s: float = 30.0) -> None:
        self.srv.close()
        for t in self.threads:
            t.join(timeout_s)


def test_close_waits_for_a_slow_link_whose_peer_still_acknowledges_bytes(tmp_path: Path, caplog) -> None:
    """A link of about 100 KB/s, the client's send buffer 256 KiB: a 600,000-byte QoS 1 PUBLISH
    queued, then close(timeout_s=0.5). The kernel takes a third of the send buffer at a time, so
    the socket takes no byte for more than a second at a stretch (1.3 s measured here) while the
    link drains it, the peer acknowledging bytes all along. That link is slow, not stalled: close
    waits, the DISCONNECT goes out after the PUBLISH, and the relay forwards every byte the socket
    wrote, ending with it (0xE0 0x00). Before, close took the first silent half second for a
    stall, closed the socket without the DISCONNECT and the broker published the last will."""
    from protocol.transport_base import Will

    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        relay = _SlowRelay(broker.port, 100_000)
        tr = MqttTransport("slow", "127.0.0.1", relay.port, mqtt_version="3.1.1", keepalive_s=60,
                           will=Will("status/slow", b"gone", qos=1, retain=False))
        outcomes: list[str] = []
        tr.set_delivery_listener(lambda handle, outcome, reason: outcomes.append(outcome))
        try:
            tr.connect(timeout_s=10.0)
            tr._client.socket().setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 262_144)
            tr.publish("t/slow", b"s" * 600_000, qos=1)
            caplog.set_level(logging.WARNING, logger="protocol.transport")
            tr.close(timeout_s=0.5)
        finally:
            tr.close()
            relay.close()
    assert "DISCONNECT could not be written" not in caplog.text
    assert "cut" not in outcomes and "dropped" not in outcomes, outcomes
    assert len(relay.up) == tr.socket_bytes[0] and bytes(relay.up[-2:]) == b"\xe0\x00"


def test_close_waits_for_a_network_thread_busy_in_a_listener_not_taken_for_a_stalled_link(tmp_path: Path,
                                                                                          caplog) -> None:
    """The delivery listener (paho's network thread) is still busy with a PUBACK (a ledger write
    waiting on SQLite's lock, say) when close(timeout_s=0.2) queues the DISCONNECT: nothing is
    written while it is, but the link has taken and the broker acknowledged every byte: the thread
    is slow, not the link. close waits for it; once the listener returns the DISCONNECT goes out
    (the relay counts 1) and no warning is logged. Before, close closed the socket without the
    DISCONNECT after 0.2 s (the broker published the last will) and said the link was stalled."""
    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        tr = MqttTransport("busy", "127.0.0.1", relay.port, mqtt_version="3.1.1", keepalive_s=60)
        busy, release = threading.Event(), threading.Event()

        def listener(handle, outcome, reason) -> None:
            busy.set()
            release.wait(60.0)

        tr.set_delivery_listener(listener)
        closer = threading.Thread(target=tr.close, kwargs={"timeout_s": 0.2})
        try:
            tr.connect(timeout_s=10.0)
            first = relay.connections - 1
            tr.publish("t/busy", b"b", qos=1)
            assert busy.wait(10.0)
            caplog.set_level(logging.WARNING, logger="protocol.transport")
            closer.start()
            closer.join(1.0)  # five times its timeout_s: the listener still holds the thread
            assert closer.is_alive()
            release.set()
            closer.join(30.0)
            assert not closer.is_alive()
        finally:
            release.set()
            tr.close()
            relay.close(timeout_s=30.0)
    assert "DISCONNECT could not be written" not in caplog.text
    assert relay.packets(first)["DISCONNECT"] == 1 and relay.total_bytes("up") == tr.socket_bytes[0]


def test_close_from_the_delivery_listener_sends_the_disconnect_once_the_listener_returns(tmp_path: Path) -> None:
    """close() called in the delivery listener, on paho's network thread (an application that
    stops at its last PUBACK): that thread cannot be waited for from itself, so the close is
    finished on another one: the DISCONNECT goes out once the listener returns (the relay counts
    1, and every byte the socket wrote), the broker publishes no last will, and the thread ends.
    Before, close() closed the socket at once, as abort() does: no DISCONNECT, and the broker
    published the will of a device that had closed on purpose."""
    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        tr = MqttTransport("in-listener", "127.0.0.1", relay.port, mqtt_version="3.1.1", keepalive_s=60)
        outcomes: list[str] = []

        def listener(handle, outcome, reason) -> None:
            outcomes.append(outcome)
            if outcome == "acked":
                tr.close()

        tr.set_delivery_listener(listener)
        try:
            tr.connect(timeout_s=10.0)
            first = relay.connections - 1
            client = tr._client
            tr.publish("t/last", b"bye", qos=1)
            assert wait_for(lambda: client._thread is None or not client._thread.is_alive(), 30.0)
        finally:
            tr.close()
            relay.close(timeout_s=30.0)
    assert outcomes == ["acked"]
    assert relay.packets(first)["DISCONNECT"] == 1 and relay.total_bytes("up") == tr.socket_bytes[0]


def test_publish_after_close_and_a_wait_cut_by_close_raise() -> None:
    """A publish after close() is refused at once (nothing sent, no ledger row: the channel
    records a row only for what the transport took), and a publish(wait_s) whose PUBACK never
    comes (a broker that answers CONNECT and nothing else) is released by close() with a
    TransportError that says so, not a PublishTimeout at the end of its wait."""
    import threading

    from protocol.errors import PublishTimeout, TransportError

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    conns: list[socket.socket] = []
    got_publish = threading.Event()

    def silent_broker() -> None:  # CONNACK (MQTT 3.1.1, accepted), then reads and answers nothing
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conns.append(conn)
            conn.recv(1024)
            conn.sendall(b"\x20\x02\x00\x00")
            while (data := conn.recv(1024)):
                if data[0] >> 4 == 3:  # PUBLISH
                    got_publish.set()

    threading.Thread(target=silent_broker, daemon=True).start()
    tr = MqttTransport("closing", "127.0.0.1", port, mqtt_version="3.1.1", keepalive_s=30)
    errors: list[BaseException] = []
    try:
        tr.connect(timeout_s=10.0)

        def wait_for_puback() -> None:
            try:
                tr.publish("t/w", b"w", qos=1, wait_s=60.0)
            except BaseException as exc:  # noqa: BLE001 - the test looks at it
                errors.append(exc)

        waiter = threading.Thread(target=wait_for_puback)
        waiter.start()
        assert got_publish.wait(10.0)
        tr.close()
        waiter.join(30.0)
        assert not waiter.is_alive()
        assert len(errors) == 1 and not isinstance(errors[0], PublishTimeout), errors
        assert isinstance(errors[0], TransportError) and "closed while it waited" in str(errors[0])
        with pytest.raises(TransportError, match="not sent: the transport is closed"):
            tr.publish("t/after", b"late", qos=1)
    finally:
        tr.close()
        server.close()
        for c in conns:
            c.close()


def test_a_publish_in_the_reconnects_gap_before_connect_goes_out_after_it(tmp_path: Path) -> None:
    """paho's reconnect sets its new socket, calls on_socket_open, then queues CONNECT. A QoS 1
    publish from another thread in that gap (made there on purpose: the hook publishes and waits
    for it) used to be queued ahead of CONNECT, and the broker closed the connection. It now waits
    in paho's queue: the new connection's first packet is CONNECT, the PUBLISH follows the
    CONNACK, the broker acknowledges it on the MQTT 5 connection it kept, and a subscriber gets
    the payload once."""
    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        sub = MqttTransport("gap-sub", "127.0.0.1", broker.port, keepalive_s=30)
        tr = MqttTransport("gap-pub", "127.0.0.1", broker.port, keepalive_s=30)
        events: list[PacketEvent] = []
        outcomes: list[str] = []
        try:
            sub.connect(timeout_s=10.0)
            sub.subscribe(["t/gap"], qos=1)
            tr.set_packet_listener(events.append)
            tr.set_delivery_listener(lambda handle, outcome, reason: outcomes.append(outcome))
            tr.connect(timeout_s=10.0)
            client = tr._client
            assert isinstance(client, _CountingClient) and client._protocol == mqtt.MQTTv5
            opened = client._call_socket_open
            published: list[object] = []

            def in_the_gap(sock) -> None:  # paho's thread, between the new socket and CONNECT
                opened(sock)
                if not published:
                    publisher = threading.Thread(target=lambda: published.append(tr.publish("t/gap", b"gap", qos=1)))
                    publisher.start()
                    publisher.join(10.0)
                    assert published

            client._call_socket_open = in_the_gap
            mark = len(events)
            _close_socket(client)  # the connection is lost: paho reconnects
            assert wait_for(lambda: outcomes == ["acked"], 20.0), outcomes
            incoming = sub.get(10.0)
            assert incoming is not None and incoming.payload == b"gap" and sub.get(0.5) is None
            after = [e.packet_type for e in events[mark:] if e.direction == "out"]
            assert after[0] == "CONNECT" and "PUBLISH" in after, after
            assert after.index("PUBLISH") > after.index("CONNECT")
            assert tr._client is client and client._protocol == mqtt.MQTTv5 and tr.connected
        finally:
            tr.close()
            sub.close()


def _small_send_buffers(tr: MqttTransport, *sizes: int) -> None:
    """Set the send buffer of each socket ``tr``'s client opens, before its CONNECT (paho's
    thread): the n-th socket gets ``sizes[n]`` bytes (the last size for the sockets after; none
    given: 16 KiB each). A relay that stops reading then leaves what does not fit in the sockets'
    buffers unwritten in paho's queue (here a held loopback connection took about 177 KB with
    16 KiB, about 1.2 MB with 512 KiB)."""
    client = tr._client
    opened = client._call_socket_open
    sizes = sizes or (16_384,)
    count = [0]

    def small_buffer(sock) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sizes[min(count[0], len(sizes) - 1)])
        count[0] += 1
        opened(sock)

    client._call_socket_open = small_buffer


def _first_update_cut(path: Path, tr: MqttTransport, relay: CountingRelay, first: int
                      ) -> tuple[int, list[dict], int, list[dict]]:
    """After a transport ended (closed or aborted) on relay connection ``first`` holding three
    updates, the socket having taken part of the first and none of the two others: checks that
    the relay saw what the socket wrote (one connection, its CONNECT, one cut PUBLISH) and that
    the ledger's three update rows say so (the first ``sent`` with the x1 bytes that went out
    subtracted as ``unsent_bytes``, the two others ``message`` rows, all ``dropped``); returns
    (socket bytes out, the device's rows, their wire sum as the audit makes it, the update rows)."""
    socket_out = tr.socket_bytes[0]
    assert relay.total_bytes("up") == socket_out and relay.connections == first + 1
    assert relay.packets(first)["partial"] == 1 and relay.packets(first)["CONNECT"] == 1
    rows, ledger_wire = _device_wire(path)
    updates = [r for r in rows if r["kind"] == "update"]
    size = updates[0]["mqtt_header_bytes"] + updates[0]["topic_bytes"] + updates[0]["payload_bytes"]
    connect = next(r["mqtt_header_bytes"] for r in rows if r["kind"] == "CONNECT")
    x1 = relay.parsers[(first, "up")].bytes - connect
    assert 0 < x1 < size
    assert [(r["event"], r["delivery"], r["unsent_bytes"]) for r in updates] == [
        ("sent", "dropped", size - x1), ("message", "dropped", 0), ("message", "dropped", 0)]
    return socket_out, rows, ledger_wire, updates


def _device_wire(path: Path) -> tuple[list[dict], int]:
    """The device's ledger rows of ``path`` and their wire sum as the audit makes it (its ``WIRE``:
    whole packets less ``unsent_bytes``, over ``sent`` / ``received`` / ``rejected`` rows)."""
    from protocol.ledger import read_rows

    rows = [r for r in read_rows(path) if r["side"] == "agent"]
    return rows, totals(rows, "device")["up"]["wire_bytes"]


def test_a_send_whose_wait_ends_first_keeps_its_row_and_the_ledger_equals_the_socket(tmp_path: Path) -> None:
    """A broker that answers CONNECT and then reads without a PUBACK: one update sent with
    ``wait_s=0.5`` raises PublishTimeout, a second sent with ``wait_s=60`` raises TransportError
    when the transport is closed meanwhile. Both PUBLISH packets were on the wire: each keeps a
    ``sent`` row (``handed``: no PUBACK came, the broker may have it), so the audit's wire sum
    equals the bytes the socket wrote and the broker read (CONNECT + 2 PUBLISH + DISCONNECT).
    Before, neither wait wrote a row: the ledger was 2 packets below the socket."""
    from protocol.channel import Channel
    from protocol.errors import PublishTimeout, TransportError
    from protocol.ledger import Ledger

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    read = [0]

    def silent_broker() -> None:  # CONNACK (MQTT 3.1.1, accepted), then reads and answers nothing
        while True:  # the first connection is connect()'s TCP probe: it sends nothing
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                if not (connect := conn.recv(1024)):  # CONNECT, sent alone before the CONNACK
                    continue
                read[0] += len(connect)
                conn.sendall(b"\x20\x02\x00\x00")
                while (data := conn.recv(65536)):
                    read[0] += len(data)
                return

    broker = threading.Thread(target=silent_broker, daemon=True)
    broker.start()
    topic = "fedfleet/v1/fed/up/wait-dev/update"
    tr = MqttTransport("fed:wait-dev", "127.0.0.1", port, mqtt_version="3.1.1", keepalive_s=30)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ch = Channel(tr, node_id="wait-dev", side="agent", federation="fed", ledger=ledger, qos=1)
    errors: list[BaseException] = []
    try:
        tr.connect(timeout_s=10.0)
        with pytest.raises(PublishTimeout, match="not acknowledged within 0.5 s"):
            ch.send(topic, _update(1, 2_000), round=1, wait_s=0.5)

        def wait_long() -> None:
            try:
                ch.send(topic, _update(2, 2_000), round=1, wait_s=60.0)
            except BaseException as exc:  # noqa: BLE001 - the test looks at it
                errors.append(exc)

        waiter = threading.Thread(target=wait_long)
        waiter.start()
        # both PUBLISH packets written whole, awaiting PUBACKs that never come
        assert wait_for(lambda: len(tr._client.written_awaiting_puback()) == 2 and not tr._client._out_packet, 10.0)
        tr.close()
        waiter.join(30.0)
        assert not waiter.is_alive()
    finally:
        ch.close()
        ledger.close()
        broker.join(10.0)
        server.close()
    assert len(errors) == 1 and type(errors[0]) is TransportError and "closed while it waited" in str(errors[0])
    rows, ledger_wire = _device_wire(tmp_path / "ledger.sqlite")
    updates = [r for r in rows if r["kind"] == "update"]
    assert [(r["event"], r["delivery"], r["unsent_bytes"]) for r in updates] == [("sent", "handed", 0)] * 2
    # the second update's row is written once its wait has ended: after the close's DISCONNECT row
    assert [(r["kind"], r["event"]) for r in rows] == [("CONNECT", "sent"), ("CONNACK", "received"),
                                                       ("update", "sent"), ("DISCONNECT", "sent"), ("update", "sent")]
    assert ledger_wire == tr.socket_bytes[0] == read[0]


class _AcksThenSilence:
    """A broker on a loopback port for one MqttTransport (MQTT 3.1.1): it accepts connect()'s TCP
    probe and forgets it, CONNACKs the next connection, PUBACKs its first ``acks`` PUBLISH packets,
    then reads what comes and answers nothing. ``read``: bytes read from that connection;
    ``publishes``: its PUBLISH packets read whole."""

    def __init__(self, acks: int) -> None:
        self.acks = acks
        self.read = 0
        self.publishes = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                buf = bytearray()
                while (data := conn.recv(65536)):
                    self.read += len(data)
                    buf += data
                    while (packet := _take_packet(buf)) is not None:
                        first, body = packet
                        if first >> 4 == 1:  # CONNECT
                            conn.sendall(b"\x20\x02\x00\x00")
                        elif first >> 4 == 3:  # PUBLISH, QoS 1: topic length, topic, packet id
                            self.publishes += 1
                            if self.publishes <= self.acks:
                                end = 2 + int.from_bytes(body[:2], "big")
                                conn.sendall(b"\x40\x02" + body[end:end + 2])
                if self.read:  # the transport's connection ended (not the probe)
                    return

    def close(self) -> None:
        self.server.close()
        self.thread.join(10.0)


def _take_packet(buf: bytearray) -> tuple[int, bytes] | None:
    """The first whole MQTT packet of ``buf`` (its first byte and what follows its remaining
    length), taken off ``buf``; ``None`` while it is incomplete."""
    n, shift, i = 0, 0, 1
    while True:
        if i >= len(buf):
            return None
        n |= (buf[i] & 0x7F) << shift
        shift += 7
        i += 1
        if not buf[i - 1] & 0x80:
            break
    if len(buf) < i + n:
        return None
    first, body = buf[0], bytes(buf[i:i + n])
    del buf[:i + n]
    return first, body


def test_a_chunked_send_whose_wait_ends_at_a_middle_chunk_still_writes_the_chunks_after_it(tmp_path: Path) -> None:
    """An update in 5 chunks (1,000 bytes of payload each but the last) sent with ``wait_s=3``
    to a broker that PUBACKs the first 2 PUBLISH packets and then reads without answering: the
    wait for chunk 3 ends first (PublishTimeout), and chunks 4 and 5 are still handed to paho,
    which writes them: the broker reads 5 PUBLISH packets. The error names all 5 chunks handed
    over. Ledger: chunks 1-2 ``acked``, 3-5 ``handed`` (no PUBACK came); after the close the
    audit's wire sum equals the bytes the socket wrote and the broker read (CONNECT + 5 PUBLISH +
    DISCONNECT). Before, chunks 4 and 5 were never handed over: 3 PUBLISH packets, the message
    incomplete and nothing saying so."""
    from protocol.channel import Channel
    from protocol.errors import PublishTimeout
    from protocol.ledger import Ledger

    broker = _AcksThenSilence(acks=2)
    topic = "fedfleet/v1/fed/up/chunk-dev/update"
    tr = MqttTransport("fed:chunk-dev", "127.0.0.1", broker.port, mqtt_version="3.1.1", keepalive_s=30)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ch = Channel(tr, node_id="chunk-dev", side="agent", federation="fed", ledger=ledger, qos=1)
    try:
        tr.connect(timeout_s=10.0)
        with pytest.raises(PublishTimeout) as raised:
            ch.send(topic, _update(1, 1_000), round=1, wait_s=3.0, chunk_bytes=1_000)
        assert (raised.value.chunks_handed, raised.value.chunk_count) == (5, 5)
        assert "the wait for chunk 3 ended first; all 5 handed to the MQTT client" in str(raised.value)
        assert wait_for(lambda: broker.publishes == 5 and not tr._client._out_packet, 10.0), broker.publishes
    finally:
        ch.close()
        ledger.close()
        broker.close()
    rows, ledger_wire = _device_wire(tmp_path / "ledger.sqlite")
    chunks = [r for r in rows if r["kind"] == "update" and r["chunk_index"] is not None]
    assert [(r["event"], r["delivery"], r["chunk_index"]) for r in chunks] == \
        [("sent", "acked", 0), ("sent", "acked", 1), ("sent", "handed", 2), ("sent", "handed", 3),
         ("sent", "handed", 4)]
    assert ledger_wire == tr.socket_bytes[0] == broker.read


def test_chunks_after_a_wait_the_close_ended_are_ledgered_as_never_handed_over(tmp_path: Path) -> None:
    """The same update sent with ``wait_s=60`` on a thread; the transport is closed while chunk 3
    awaits its PUBACK (written whole, the broker silent after 2 PUBACKs): the send raises the
    wait's TransportError naming chunks 4-5 of 5 not handed over. The broker read 3 PUBLISH
    packets; chunk 3 keeps its ``sent`` row (``handed``), chunks 4 and 5, which the closed
    transport never took, are ``message`` rows with delivery ``dropped``: out of the wire sum,
    which equals the bytes the socket wrote and the broker read (CONNECT + 3 PUBLISH +
    DISCONNECT). Before, chunks 4 and 5 had no row at all."""
    from protocol.channel import Channel
    from protocol.errors import TransportError
    from protocol.ledger import Ledger

    broker = _AcksThenSilence(acks=2)
    topic = "fedfleet/v1/fed/up/chunk-dev/update"
    tr = MqttTransport("fed:chunk-dev", "127.0.0.1", broker.port, mqtt_version="3.1.1", keepalive_s=30)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ch = Channel(tr, node_id="chunk-dev", side="agent", federation="fed", ledger=ledger, qos=1)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            ch.send(topic, _update(1, 1_000), round=1, wait_s=60.0, chunk_bytes=1_000)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            errors.append(exc)

    try:
        tr.connect(timeout_s=10.0)
        sender = threading.Thread(target=send)
        sender.start()
        assert wait_for(lambda: broker.publishes == 3 and len(tr._client.written_awaiting_puback()) == 1
                        and not tr._client._out_packet, 10.0), broker.publishes
        tr.close()
        sender.join(30.0)
        assert not sender.is_alive()
    finally:
        ch.close()
        ledger.close()
        broker.close()
    assert len(errors) == 1 and type(errors[0]) is TransportError, errors
    exc = errors[0]
    assert "closed while it waited" in str(exc) and (exc.chunks_handed, exc.chunk_count) == (3, 5)
    assert "the wait for chunk 3 ended first; chunks 4-5 of 5 not handed to the MQTT client" in str(exc)
    rows, ledger_wire = _device_wire(tmp_path / "ledger.sqlite")
    chunks = [r for r in rows if r["kind"] == "update" and r["chunk_index"] is not None]
    assert [(r["event"], r["delivery"], r["chunk_index"]) for r in chunks] == \
        [("sent", "acked", 0), ("sent", "acked", 1), ("sent", "handed", 2), ("message", "dropped", 3),
         ("message", "dropped", 4)]
    assert broker.publishes == 3
    assert ledger_wire == tr.socket_bytes[0] == broker.read


def test_messages_withdrawn_above_an_inferred_limit_before_the_socket_took_them_count_no_wire_bytes(
        tmp_path: Path) -> None:
    """Three 800 KB QoS 1 updates (P bytes each) through a Channel into a Ledger, and the broker
    closes the connection twice while the first awaits its PUBACK (the relay, as in the cut tests
    above): the transport takes it for a packet above a size limit (:data:`OVERSIZE_STRIKES`) and,
    at the third CONNACK, withdraws all three (each above the inferred P/2) as refused.

    On the wire (16 KiB send buffers, the relay holding what the client writes): connection 1
    carries c (CONNECT) + x1 bytes of the first PUBLISH, the other two unwritten in paho's queue;
    connection 2 c + x2 bytes of the first one's re-send with DUP (the two others again unwritten:
    their re-sends were their first transmissions); connection 3 c, then, at the close, d
    (DISCONNECT). By hand the socket wrote 3c + x1 + x2 + d.

    The ledger's device rows: 3 CONNECT, the first message's ``sent`` row (P, unsent P − x1, now
    ``refused``), its ``PUBLISH-DUP`` row (P, unsent P − x2), the DISCONNECT, and the ``sent`` rows
    of the two messages withdrawn before a byte of them was written: those must leave the wire
    totals (``event='message'``, delivery ``refused``, sizes kept), so the audit's wire sum is
    3c + x1 + x2 + d too. Before the fix they stayed ``sent``: the ledger was 2P = 1,600,192 bytes
    above the socket."""
    from protocol.channel import Channel
    from protocol.ledger import Ledger

    topic = "fedfleet/v1/fed/up/wd-dev/update"
    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        tr = MqttTransport("fed:wd-dev", "127.0.0.1", relay.port, mqtt_version="3.1.1", keepalive_s=30)
        client = tr._client
        _small_send_buffers(tr)
        ledger = Ledger(tmp_path / "ledger.sqlite")
        ch = Channel(tr, node_id="wd-dev", side="agent", federation="fed", ledger=ledger, qos=1)
        try:
            tr.connect(timeout_s=10.0)
            first = relay.connections - 1  # the one before is connect()'s TCP probe
            relay.hold(first)
            relay.hold(first + 1, after_bytes=1)  # its CONNECT goes through, then it is held
            for i in range(3):
                ch.send(topic, _update(i, 200_000), round=1)
            assert wait_for(lambda: len(client.unwritten_mids()) == 2, 10.0)
            time.sleep(0.3)  # the socket is full: still two unwritten
            assert len(client.unwritten_mids()) == 2
            relay.cut(first, keep_held=True)
            assert wait_for(lambda: not tr.connected, 10.0)
            relay.release(first)

            def dup_cut_short() -> bool:
                queue = tuple(client._out_packet)
                return (tr.connected and bool(queue) and bool(queue[0]["packet"][0] & 0x08)
                        and queue[0]["pos"] > 0 and len(client.unwritten_mids()) == 2)

            assert wait_for(dup_cut_short, 30.0)
            time.sleep(0.3)
            relay.cut(first + 1, keep_held=True)
            assert wait_for(lambda: not tr.connected, 10.0)
            relay.release(first + 1)
            assert wait_for(lambda: ch.refused == 3 and tr.connected, 30.0), (ch.refused, ch.acked)
        finally:
            ch.close()
            relay.close()
            ledger.close()
    assert tr.inferred_max_packet_bytes > 0 and ch.acked == 0
    socket_out = tr.socket_bytes[0]
    assert relay.total_bytes("up") == socket_out
    for n in (first, first + 1):
        assert relay.packets(n)["partial"] == 1 and relay.packets(n)["CONNECT"] == 1
    last = relay.packets(first + 2)
    assert last["PUBLISH"] == last["PUBLISH-DUP"] == last["partial"] == 0 and last["DISCONNECT"] == 1
    rows, ledger_wire = _device_wire(tmp_path / "ledger.sqlite")
    updates = [r for r in rows if r["kind"] == "update"]
    size = updates[0]["mqtt_header_bytes"] + updates[0]["topic_bytes"] + updates[0]["payload_bytes"]
    connect = next(r["mqtt_header_bytes"] for r in rows if r["kind"] == "CONNECT")
    x1, x2 = (relay.parsers[(n, "up")].bytes - connect for n in (first, first + 1))
    assert [(r["event"], r["delivery"], r["unsent_bytes"]) for r in updates] == [
        ("sent", "refused", size - x1), ("message", "refused", 0), ("message", "refused", 0)]
    dups = [r for r in rows if r["kind"] == "PUBLISH-DUP"]
    assert [(r["event"], r["unsent_bytes"]) for r in dups] == [("sent", size - x2)]
    d = next(r["mqtt_header_bytes"] for r in rows if r["kind"] == "DISCONNECT")
    assert socket_out == 3 * connect + x1 + x2 + d
    assert ledger_wire == socket_out, ledger_wire - socket_out
    assert ch.wire_bytes_sent + ch.control_bytes_sent == socket_out


def _stalled(client: _CountingClient, unwritten: int) -> bool:
    """Whether the head of ``client``'s queue is a QoS 1 PUBLISH the socket took part of, with
    ``unwritten`` QoS 1 PUBLISH packets behind it of which it took no byte (the socket is full)."""
    queue = tuple(client._out_packet)
    return (bool(queue) and queue[0]["command"] & 0xF0 == mqtt.PUBLISH and 0 < queue[0]["pos"]
            and len(client.unwritten_mids()) == unwritten)


def test_a_qos1_message_the_socket_took_part_of_ends_dropped_when_the_transport_is_closed(tmp_path: Path) -> None:
    """Three 800 KB QoS 1 updates (P bytes each) through a Channel into a Ledger on a connection
    whose relay stops reading: the socket takes x1 bytes of the first, the others stay unwritten
    in paho's queue. The broker side is closed, paho waits (its reconnect delay set to a minute)
    and the transport is closed meanwhile: nothing more is ever sent.

    By hand the socket wrote c + x1 (c: the CONNECT; no DISCONNECT: the link was down). The
    ledger: the CONNECT, the first update's ``sent`` row with ``unsent_bytes`` P − x1, the two
    others ``message`` rows (never written): c + x1, the socket's. Each update is said
    undeliverable, and each row's delivery is ``dropped`` with the reason: the first one too (the
    broker got no whole PUBLISH of it), which before the fix kept ``handed`` (only its
    ``unsent_bytes`` was set)."""
    from protocol.channel import Channel
    from protocol.ledger import Ledger

    topic = "fedfleet/v1/fed/up/cl-dev/update"
    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        tr = MqttTransport("fed:cl-dev", "127.0.0.1", relay.port, mqtt_version="3.1.1", keepalive_s=30)
        client = tr._client
        _small_send_buffers(tr)
        ledger = Ledger(tmp_path / "ledger.sqlite")
        ch = Channel(tr, node_id="cl-dev", side="agent", federation="fed", ledger=ledger, qos=1)
        try:
            tr.connect(timeout_s=10.0)
            first = relay.connections - 1
            relay.hold(first)
            for i in range(3):
                ch.send(topic, _update(i, 200_000), round=1)
            assert wait_for(lambda: _stalled(client, 2), 10.0)
            time.sleep(0.3)  # the socket is full: still two unwritten
            assert _stalled(client, 2)
            client.reconnect_delay_set(min_delay=60, max_delay=60)  # no reconnect before the close
            relay.cut(first, keep_held=True)
            assert wait_for(lambda: not tr.connected, 10.0)
            relay.release(first)
            ch.close()  # the transport's close: what it settles is the test
        finally:
            ch.close()
            relay.close()
            ledger.close()
    socket_out, rows, ledger_wire, updates = _first_update_cut(tmp_path / "ledger.sqlite", tr, relay, first)
    assert "the transport was closed before the socket took a whole PUBLISH of it" in updates[0]["reason"]
    assert all("the transport was closed before the socket took a byte of it" in r["reason"] for r in updates[1:])
    assert ch.undeliverable == 3
    assert ledger_wire == socket_out, ledger_wire - socket_out  # c + x1
    assert ch.wire_bytes_sent + ch.control_bytes_sent == socket_out


def _a_retransmission_behind_a_cut(tr: MqttTransport, ch, relay: CountingRelay, topic: str) -> tuple[int, int, int]:
    """Drive two connections so that message D's retransmission (a ``PUBLISH-DUP`` row) is never
    written: A (200,000 floats) and D (190,000) are sent on connection 1, whose socket (512 KiB
    send buffer) takes A whole and part of D before the relay holds it (it stops reading); the
    broker side is closed. Connection 2 (16 KiB) is held right after its CONNECT: paho re-sends
    both with DUP (each was on the wire), the socket takes part of A's, and D's stays unwritten in
    paho's queue. Returns (connection 1's number, A's and D's message ids); connection 2 is held,
    its broker side still open, when this returns (the caller cuts it or not)."""
    client = tr._client
    _small_send_buffers(tr, 524_288, 16_384)
    tr.connect(timeout_s=10.0)
    first = relay.connections - 1  # the one before is connect()'s TCP probe
    relay.hold(first)
    relay.hold(first + 1, after_bytes=1)  # its CONNECT goes through (alone, before the CONNACK), then held
    ch.send(topic, _update(0, 200_000), round=1)
    ch.send(topic, _update(1, 190_000), round=1)
    a, d = sorted(client._out_messages)

    def a_whole_d_in_part() -> bool:
        queue = tuple(client._out_packet)
        return len(queue) == 1 and queue[0]["mid"] == d and queue[0]["pos"] > 0

    assert wait_for(a_whole_d_in_part, 10.0)
    time.sleep(0.3)  # the socket is full
    assert a_whole_d_in_part()
    relay.cut(first, keep_held=True)
    assert wait_for(lambda: not tr.connected, 10.0)
    relay.release(first)

    def a_dup_in_part_d_dup_unwritten() -> bool:
        queue = tuple(client._out_packet)
        return (tr.connected and len(queue) >= 2 and queue[0]["mid"] == a and bool(queue[0]["packet"][0] & 0x08)
                and queue[0]["pos"] > 0 and client.unwritten_mids() == {d} and bool(queue[1]["packet"][0] & 0x08))

    assert wait_for(a_dup_in_part_d_dup_unwritten, 30.0)
    time.sleep(0.3)
    assert a_dup_in_part_d_dup_unwritten()
    return first, a, d


def _sizes(rows: list[dict], relay: CountingRelay, first: int) -> tuple[int, int, int, int, int]:
    """(c, P_A, P_D, x_D, x_A2): the CONNECT's size, A's and D's PUBLISH sizes (their ``sent``
    rows), the bytes of D the socket took on connection ``first`` (after c + P_A) and of A's
    retransmission on the next one (after c), from the relay's counts."""
    updates = [r for r in rows if r["kind"] == "update"]
    p_a, p_d = (r["mqtt_header_bytes"] + r["topic_bytes"] + r["payload_bytes"] for r in updates)
    c = next(r["mqtt_header_bytes"] for r in rows if r["kind"] == "CONNECT")
    x_d = relay.parsers[(first, "up")].bytes - c - p_a
    x_a2 = relay.parsers[(first + 1, "up")].bytes - c
    assert 0 < x_d < p_d and 0 < x_a2 < p_a
    return c, p_a, p_d, x_d, x_a2


def test_a_message_withdrawn_with_its_retransmission_unwritten_voids_that_publish_dup_row(tmp_path: Path) -> None:
    """As above (:func:`_a_retransmission_behind_a_cut`): A whole and D in part on connection 1,
    A's retransmission in part and D's unwritten on connection 2. The broker closed both while A
    awaited its PUBACK (a 1.2 MB write taken whole the first time): the transport takes A for a
    packet above a size limit of P_A / 2 and withdraws A and D (D is larger than that) at the
    third CONNACK, as refused. D's ``PUBLISH-DUP`` row stands for a packet the socket never took
    and never will: it is voided (``message``, delivery ``dropped``); D's ``sent`` row (the socket
    took x_D bytes of it) stays ``sent``, ``refused``.

    By hand the socket wrote c + P_A + x_D | c + x_A2 | c + d (d: the DISCONNECT of the close); the
    ledger: 3c, A's row (P_A), D's (P_D less unsent P_D − x_D), A's retransmission (P_A less unsent
    P_A − x_A2), D's voided retransmission (0) and d: the same. Before the fix D's ``PUBLISH-DUP``
    row stayed ``sent``: the ledger was P_D (760,094 bytes) above the socket."""
    from protocol.channel import Channel
    from protocol.ledger import Ledger

    topic = "fedfleet/v1/fed/up/wdd-dev/update"
    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        tr = MqttTransport("fed:wdd-dev", "127.0.0.1", relay.port, mqtt_version="3.1.1", keepalive_s=30)
        ledger = Ledger(tmp_path / "ledger.sqlite")
        ch = Channel(tr, node_id="wdd-dev", side="agent", federation="fed", ledger=ledger, qos=1)
        try:
            first, _, _ = _a_retransmission_behind_a_cut(tr, ch, relay, topic)
            relay.cut(first + 1, keep_held=True)
            assert wait_for(lambda: not tr.connected, 10.0)
            relay.release(first + 1)
            assert wait_for(lambda: ch.refused == 2 and tr.connected, 30.0), (ch.refused, ch.acked)
        finally:
            ch.close()
            relay.close()
            ledger.close()
    assert tr.inferred_max_packet_bytes > 0 and ch.acked == 0
    socket_out = tr.socket_bytes[0]
    assert relay.total_bytes("up") == socket_out
    last = relay.packets(first + 2)
    assert last["PUBLISH"] == last["PUBLISH-DUP"] == last["partial"] == 0 and last["DISCONNECT"] == 1
    rows, ledger_wire = _device_wire(tmp_path / "ledger.sqlite")
    c, p_a, p_d, x_d, x_a2 = _sizes(rows, relay, first)
    assert [(r["event"], r["delivery"], r["unsent_bytes"]) for r in rows if r["kind"] == "update"] == [
        ("sent", "refused", 0), ("sent", "refused", p_d - x_d)]
    assert [(r["event"], r["delivery"], r["unsent_bytes"], r["mqtt_header_bytes"]) for r in rows
            if r["kind"] == "PUBLISH-DUP"] == [("sent", "", p_a - x_a2, p_a), ("message", "dropped", 0, p_d)]
    d = next(r["mqtt_header_bytes"] for r in rows if r["kind"] == "DISCONNECT")
    assert socket_out == 3 * c + p_a + x_d + x_a2 + d
    assert ledger_wire == socket_out, ledger_wire - socket_out
    assert ch.wire_bytes_sent + ch.control_bytes_sent == socket_out


@pytest.mark.parametrize("when", ["queued", "dropped"])
def test_a_retransmission_never_written_at_close_voids_its_publish_dup_row_not_the_message_row(
        tmp_path: Path, when: str) -> None:
    """As above (:func:`_a_retransmission_behind_a_cut`), but the broker is known to keep packets
    of A's size (no size limit is inferred). Connection 2's broker side is closed too, then the
    transport is closed before the next connection is up, with D's retransmission never written:

    * ``queued``: paho waits before reconnecting (its delay set to a minute): D's retransmission
      is still in paho's queue at the close;
    * ``dropped``: the next connection is held from its start (no CONNACK comes): paho's reconnect
      dropped D's retransmission from its queue, and its re-send in place (after a CONNACK) would
      have been that packet's (the ``PUBLISH-DUP`` row stands for it).

    Either way D's ``PUBLISH-DUP`` row is voided (``message``, ``dropped``) and D's ``sent`` row
    stays ``sent`` (the socket took x_D bytes of it), with delivery ``dropped`` (the socket never
    took a PUBLISH of D whole: the broker got none); A's stays ``handed`` (the socket took it whole
    on connection 1: the broker may have it) and A's retransmission keeps its unsent part.

    By hand the socket wrote c + P_A + x_D | c + x_A2 (| c) and no DISCONNECT (the link was down);
    the ledger: 2c (3c), P_A, P_D less P_D − x_D, P_A less P_A − x_A2, and 0 for D's voided
    retransmission: the same. Before the fix D's retransmission row stayed ``sent`` (P_D) and,
    with ``dropped``, D's ``sent`` row was voided instead (the x_D bytes the socket took gone)."""
    from protocol.channel import Channel
    from protocol.ledger import Ledger

    topic = "fedfleet/v1/fed/up/dc-dev/update"
    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        tr = MqttTransport("fed:dc-dev", "127.0.0.1", relay.port, mqtt_version="3.1.1", keepalive_s=30)
        client = tr._client
        ledger = Ledger(tmp_path / "ledger.sqlite")
        ch = Channel(tr, node_id="dc-dev", side="agent", federation="fed", ledger=ledger, qos=1)
        tr.kept_packet_bytes = 10_000_000  # a broker that took larger packets: the closes are the link's
        try:
            first, a, d = _a_retransmission_behind_a_cut(tr, ch, relay, topic)
            if when == "queued":
                client.reconnect_delay_set(min_delay=60, max_delay=60)
            else:
                relay.hold(first + 2)
            relay.cut(first + 1, keep_held=True)
            assert wait_for(lambda: not tr.connected, 10.0)
            relay.release(first + 1)
            if when == "queued":
                assert d in client.unwritten_mids()
            else:
                assert wait_for(lambda: relay.connections == first + 3 and not client._out_packet
                                and client._never_written == {d}, 30.0)
            ch.close()
        finally:
            ch.close()
            # the held connection released, its last bytes read (5 s, the default, was short on a loaded machine)
            relay.close(timeout_s=30.0)
            ledger.close()
    assert ch.refused == ch.acked == 0 and ch.undeliverable == 1
    socket_out = tr.socket_bytes[0]
    assert relay.total_bytes("up") == socket_out
    rows, ledger_wire = _device_wire(tmp_path / "ledger.sqlite")
    c, p_a, p_d, x_d, x_a2 = _sizes(rows, relay, first)
    assert [(r["event"], r["delivery"], r["unsent_bytes"]) for r in rows if r["kind"] == "update"] == [
        ("sent", "handed", 0), ("sent", "dropped", p_d - x_d)]
    assert "the transport was closed before the socket took a whole PUBLISH of it" in \
        [r for r in rows if r["kind"] == "update"][1]["reason"]
    assert [(r["event"], r["delivery"], r["unsent_bytes"], r["mqtt_header_bytes"]) for r in rows
            if r["kind"] == "PUBLISH-DUP"] == [("sent", "", p_a - x_a2, p_a), ("message", "dropped", 0, p_d)]
    connects = 2 if when == "queued" else 3
    assert [r["kind"] for r in rows if r["event"] == "sent" and r["reason"] == "control"].count("CONNECT") == connects
    assert socket_out == connects * c + p_a + x_d + x_a2
    assert ledger_wire == socket_out, ledger_wire - socket_out
    assert ch.wire_bytes_sent + ch.control_bytes_sent == socket_out


@pytest.mark.parametrize("qos", [0, 1])
def test_abort_voids_what_it_leaves_unwritten_as_close_does(tmp_path: Path, qos: int) -> None:
    """Three 800 KB updates (P bytes each) at ``qos`` through a Channel into a Ledger on a
    connection whose relay stops reading: the socket takes x1 bytes of the first, the two others
    and then a SUBSCRIBE stay unwritten in paho's queue. The device then vanishes
    (:meth:`MqttTransport.abort`): nothing more is ever written.

    By hand the socket wrote c + x1 (no DISCONNECT: abort sends none). The ledger: the CONNECT,
    the first update's ``sent`` row with ``unsent_bytes`` P − x1 (delivery ``dropped``: the
    broker got no whole packet), the two others ``message`` rows and the SUBSCRIBE a ``message``
    row (never written, each ``dropped``): c + x1, the socket's. Before the fix abort reported the
    cut only, after waiting for paho's loop, which runs on while its queue holds packets (QoS 1:
    or messages await PUBACKs) until the keepalive gives up on the stalled link, queueing a
    PINGREQ: the SUBSCRIBE, the PINGREQ and (QoS 1) the two unwritten updates stayed ``sent``."""
    from protocol.channel import Channel
    from protocol.ledger import Ledger

    topic = "fedfleet/v1/fed/up/ab-dev/update"
    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        tr = MqttTransport("fed:ab-dev", "127.0.0.1", relay.port, mqtt_version="3.1.1", keepalive_s=30)
        client = tr._client
        _small_send_buffers(tr)
        ledger = Ledger(tmp_path / "ledger.sqlite")
        ch = Channel(tr, node_id="ab-dev", side="agent", federation="fed", ledger=ledger, qos=qos)
        try:
            tr.connect(timeout_s=10.0)
            first = relay.connections - 1
            relay.hold(first)
            for i in range(3):
                ch.send(topic, _update(i, 200_000), round=1)
            queued = lambda n: (len(client._out_packet) == n and 0 < client._out_packet[0]["pos"]  # noqa: E731
                                and all(p["pos"] == 0 for p in tuple(client._out_packet)[1:]))
            assert wait_for(lambda: queued(3), 10.0)
            time.sleep(0.3)  # the socket is full: two unwritten behind the first
            tr.subscribe(["fedfleet/v1/fed/down/ab-dev/#"], qos=1)
            assert queued(4)
            tr.abort()
            assert not tr.connected and client._thread is None
            relay.release(first)
        finally:
            ch.close()
            relay.close()
            ledger.close()
    socket_out, rows, ledger_wire, updates = _first_update_cut(tmp_path / "ledger.sqlite", tr, relay, first)
    assert all("the transport was aborted (the device vanished)" in r["reason"] for r in updates)
    assert [(r["kind"], r["event"], r["delivery"]) for r in rows if r["reason"] == "control" and r["side"] == "agent"
            and r["direction"] == "up"] == [("CONNECT", "sent", ""), ("SUBSCRIBE", "message", "dropped")]
    assert ch.undeliverable == 3
    # c + x1: the CONNECT and the part of the first update the socket took, all of the connection's bytes
    assert ledger_wire == socket_out == relay.parsers[(first, "up")].bytes, ledger_wire - socket_out
    assert ch.wire_bytes_sent + ch.control_bytes_sent == socket_out


def test_a_message_paho_counts_in_flight_with_no_packet_is_a_first_transmission_after_the_reconnect(
        tmp_path: Path) -> None:
    """Two QoS 1 updates sent while the link is down wait in paho for the CONNACK; the new
    connection is closed just before paho handles that CONNACK. paho then re-sends both: the first
    gets a packet, whose write fails on the closed socket (paho clears it), the second none (no
    socket: ``MQTT_ERR_NO_CONN``), yet paho counts it in flight and sends it with DUP after the next
    reconnect. Neither was on the wire before: each goes out once, so the ledger has the two
    updates' ``sent`` rows and no ``PUBLISH-DUP`` row, and its wire sum (the audit's) equals the
    bytes the socket wrote (it was one whole packet above it)."""
    from protocol.channel import Channel
    from protocol.ledger import Ledger

    with EmbeddedBroker(workdir=tmp_path / "broker") as broker:
        tr = MqttTransport("fed:inflight", "127.0.0.1", broker.port, keepalive_s=30)
        ledger = Ledger(tmp_path / "ledger.sqlite")
        ch = Channel(tr, node_id="inflight", side="agent", federation="fed", ledger=ledger, qos=1)
        try:
            tr.connect(timeout_s=10.0)
            tr.kept_packet_bytes = 10**9  # the closes are the link's, not a packet limit
            client = tr._client
            _close_socket(client)  # the link is lost
            assert wait_for(lambda: client._sock is None, 10.0)
            topic = "fedfleet/v1/fed/up/inflight/update"
            for i in range(2):
                ch.send(topic, Update(tensors=(np.full(10_000, i, np.float32),), num_samples=1, train_loss=0.1,
                                      metrics={}), round=1)
            handle = client._handle_connack
            armed = [True]

            def connack_on_a_lost_link():  # the new connection dies just as its CONNACK is handled
                if armed[0]:
                    armed[0] = False
                    _close_socket(client)
                return handle()

            client._handle_connack = connack_on_a_lost_link
            assert wait_for(lambda: ch.acked == 2, 30.0), ch.acked
            assert not armed[0] and tr.connects >= 3
        finally:
            ch.close()
            ledger.close()
            tr.close()
    rows, wire = _device_wire(tmp_path / "ledger.sqlite")
    assert [r["kind"] for r in rows if r["event"] == "sent" and r["kind"] == "update"] == ["update", "update"]
    assert [r for r in rows if r["kind"] == "PUBLISH-DUP"] == []
    assert wire == tr.socket_bytes[0]
