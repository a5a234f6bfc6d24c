"""What the channel does with the transport's reports of PUBLISH packets that never (wholly) reached
the socket, and of packets whose size changed after their row was written: a transport double
stands in for paho and reports each outcome by hand (some inside ``publish``, before the channel
tracks the handle, as a fast network thread does), so each step is explicit.

The rule is the ledger's: the ``sent`` rows' bytes are the socket's. A QoS 0 PUBLISH dropped from
the MQTT client's queue unwritten (``dropped``) leaves the wire totals (its row becomes a
``message`` row, delivery ``dropped``); one the socket took part of (``cut``) stays ``sent``; both
make their message undeliverable, once per message. A ``resized`` report corrects the row's size.
An ``unsent`` report (a PUBLISH the socket took part of, by its handle) and a packet event with
``unsent_bytes`` (a control packet or a retransmission, by the row the channel answered for it)
set the row's ``unsent_bytes``: its wire bytes are the whole packet's less those."""

from __future__ import annotations

from helpers.stub_transport import StubTransport, update_of

from protocol.channel import Channel
from protocol.ledger import Ledger
from protocol.mqtt_bytes import MQTT_V5, publish_size
from protocol.transport_base import PacketEvent

TOPIC = "fedfleet/v1/fed/up/client-001/update"


class ReportingTransport(StubTransport):
    """A transport that reports delivery outcomes (QoS 0 ones too) only when told to."""

    qos0_outcomes = True

    def __init__(self, mqtt_version: int = 4) -> None:
        super().__init__()
        self.mqtt_version = mqtt_version
        self.handles: list[object] = []
        self.inside: list[tuple[str, str]] = []  # outcomes to report inside the next publish

    def publish(self, topic, payload, *, qos=1, retain=False, wait_s=None):
        handle = object()
        self.handles.append(handle)
        for outcome, reason in self.inside:
            self.listener(handle, outcome, reason)
        self.inside = []
        return handle

    def tell(self, handle: object, outcome: str, reason: str = "") -> None:
        self.listener(handle, outcome, reason)




def _wire(rows) -> int:
    return sum(r.mqtt_header_bytes + r.topic_bytes + r.payload_bytes - r.unsent_bytes  # less what never went out
               for r in rows if r.event == "sent")


def test_qos0_outcomes_written_dropped_cut_correct_the_rows_and_say_the_message_undeliverable(tmp_path) -> None:
    """Four QoS 0 messages, by hand: M1 ``written`` (its row stays ``handed``), M2 ``dropped``
    (its ``sent`` row turns into a ``message`` row with delivery ``dropped``: out of the wire
    totals), M3 ``cut`` reported inside ``publish`` before the row was tracked (stays ``sent``,
    delivery ``dropped``), M4 a chunked transfer of 3 chunks all ``dropped`` (3 rows out of the
    wire totals, one undeliverable message). Undeliverable: M2, M3, M4 = 3. The channel's
    ``wire_bytes_sent`` is the ledger's, and no handle is held after its outcome."""
    tr = ReportingTransport()
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ch = Channel(tr, node_id="client-001", side="agent", federation="fed", ledger=ledger, qos=0)
    lost = "the connection was lost with this QoS 0 PUBLISH still in the MQTT client's queue, none of it written"
    m1 = ch.send(TOPIC, update_of(100), round=1)
    tr.tell(tr.handles[-1], "written")
    ch.send(TOPIC, update_of(100), round=1)  # M2
    assert ch.in_flight(m1.seq) is False and len(ch._handles) == 1
    tr.tell(tr.handles[-1], "dropped", lost)
    tr.inside = [("cut", "the connection was lost after the socket took 10 of the bytes")]
    ch.send(TOPIC, update_of(100), round=1)  # M3: its outcome came before the channel tracked it
    ch.send(TOPIC, update_of(1000), round=1, chunk_bytes=1500)  # M4: 3 chunks
    chunks = tr.handles[-3:]
    for h in chunks:
        tr.tell(h, "dropped", lost)
    assert ch._handles == {} and ch._early_outcomes == {}
    assert ch.undeliverable == 3 and all("not sent" in r for r in ch.undeliverable_reasons)
    ledger.flush()
    rows = ledger.rows()
    updates = [(r.event, r.delivery, r.chunk_index) for r in rows if r.kind == "update"]
    assert updates == [("sent", "handed", None), ("message", "dropped", None), ("sent", "dropped", None),
                       ("message", "", None),  # M4's logical row
                       ("message", "dropped", 0), ("message", "dropped", 1), ("message", "dropped", 2)]
    assert [r.reason for r in rows if r.kind == "update" and r.delivery == "dropped"][0] == lost
    assert len([r for r in rows if r.kind == "undeliverable"]) == 3
    assert ch.wire_bytes_sent == _wire(rows)
    ledger.close()


def test_a_resized_report_corrects_the_row_before_or_after_the_channel_tracked_it(tmp_path) -> None:
    """QoS 1 over a transport speaking MQTT 5 (rows sized with the property length byte). M1's
    PUBLISH is then reported ``resized`` to its MQTT 3.1.1 size (moved to the fallback client)
    after it was tracked, M2's inside ``publish`` (before): both rows end at the 3.1.1 size, the
    wire count follows, and the later ``acked`` still lands on each row."""
    tr = ReportingTransport(mqtt_version=MQTT_V5)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ch = Channel(tr, node_id="client-001", side="agent", federation="fed", ledger=ledger, qos=1)
    payload = len(ch.send(TOPIC, update_of(100), round=1).payload)
    v5 = publish_size(TOPIC, payload, 1, protocol=MQTT_V5).packet_bytes
    v311 = publish_size(TOPIC, payload, 1).packet_bytes
    assert v5 == v311 + 1
    tr.tell(tr.handles[0], "resized", str(v311))
    tr.inside = [("resized", str(v311))]
    ch.send(TOPIC, update_of(100), round=1)
    for h in tr.handles:
        tr.tell(h, "acked")
    assert ch.acked == 2 and ch.refused == 0 and ch._handles == {} and ch._early_sizes == {}
    ledger.flush()
    rows = [r for r in ledger.rows() if r.kind == "update"]
    assert [(r.mqtt_header_bytes + r.topic_bytes + r.payload_bytes, r.delivery) for r in rows] == \
        [(v311, "acked"), (v311, "acked")]
    assert ch.wire_bytes_sent == 2 * v311
    ledger.close()


def test_a_control_packet_dropped_unwritten_voids_its_row(tmp_path) -> None:
    """Two SUBSCRIBEs and a PINGREQ recorded as sent (at their queueing); the transport then says
    one SUBSCRIBE was dropped unwritten: the last SUBSCRIBE row turns into a ``message`` row, its
    bytes out of the wire totals and of ``control_bytes_sent``."""
    tr = ReportingTransport()
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ch = Channel(tr, node_id="client-001", side="agent", federation="fed", ledger=ledger, qos=1)
    for ev in (PacketEvent("out", "SUBSCRIBE", 30), PacketEvent("out", "PINGREQ", 2),
               PacketEvent("out", "SUBSCRIBE", 30), PacketEvent("out", "SUBSCRIBE", 30, dropped=True)):
        ch._on_packet(ev)
    ledger.flush()
    rows = ledger.rows()
    assert [(r.kind, r.event, r.delivery) for r in rows] == [("SUBSCRIBE", "sent", ""), ("PINGREQ", "sent", ""),
                                                             ("SUBSCRIBE", "message", "dropped")]
    assert ch.control_bytes_sent == 32 == _wire(rows)
    ledger.close()


def test_unsent_bytes_of_a_cut_publish_land_on_its_row_before_or_after_it_is_tracked(tmp_path) -> None:
    """QoS 1: M1's PUBLISH is reported ``unsent`` (700 bytes never written) after the channel
    tracked it, M2's inside ``publish`` (before); both are then acknowledged (sent again whole
    after the reconnect: a ``PUBLISH-DUP`` row, not part of this test). QoS 0: M3 ``unsent`` (50)
    then ``cut``. Each row keeps its whole sizes, says its ``unsent_bytes``, and the channel's
    ``wire_bytes_sent`` is the ledger's wire sum (whole packets less unsent)."""
    tr = ReportingTransport()
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ch = Channel(tr, node_id="client-001", side="agent", federation="fed", ledger=ledger, qos=1)
    ch.send(TOPIC, update_of(1000), round=1)  # M1
    tr.tell(tr.handles[0], "unsent", "700")
    tr.inside = [("unsent", "900")]
    ch.send(TOPIC, update_of(1000), round=1)  # M2: its report came before the channel tracked it
    for h in tr.handles:
        tr.tell(h, "acked")
    assert ch.acked == 2 and ch._handles == {} and ch._early_unsent == {}
    q0 = Channel(tr, node_id="client-001", side="agent", federation="fed", ledger=ledger, qos=0)
    q0.send(TOPIC, update_of(100), round=1)  # M3
    tr.tell(tr.handles[-1], "unsent", "50")
    tr.tell(tr.handles[-1], "cut", "the connection was lost after the socket took part of it")
    assert q0.undeliverable == 1 and q0._handles == {}
    ledger.flush()
    rows = [r for r in ledger.rows() if r.kind == "update"]
    assert [(r.event, r.delivery, r.unsent_bytes) for r in rows] == [("sent", "acked", 700), ("sent", "acked", 900),
                                                                    ("sent", "dropped", 50)]
    whole = [r.mqtt_header_bytes + r.topic_bytes + r.payload_bytes for r in rows]
    assert [r.wire_bytes for r in rows] == [whole[0] - 700, whole[1] - 900, whole[2] - 50]
    assert ch.wire_bytes_sent == sum(whole[:2]) - 1600 and q0.wire_bytes_sent == whole[2] - 50
    assert ch.wire_bytes_sent + q0.wire_bytes_sent == _wire(rows)
    ledger.close()


def test_a_cut_control_packet_or_retransmission_keeps_its_row_sent_with_its_unsent_bytes(tmp_path) -> None:
    """Three SUBSCRIBEs (30 bytes) recorded as sent: the first written whole, the second (the head
    of the MQTT client's queue when the connection was lost) cut after 18 bytes, the third still
    unwritten. The transport says so as it does at a reconnect: the cut one first, by the row the
    channel answered for it (``ref``), then the unwritten one (``dropped``, by type and size). A
    retransmission (``PUBLISH-DUP``, 500 bytes) cut after 100 bytes the same way. By hand: rows
    SUBSCRIBE sent 0, sent 12, message (dropped); PUBLISH-DUP sent 400; control bytes sent
    30 + 18 + 100 = 148 = the ledger's wire sum."""
    tr = ReportingTransport()
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ch = Channel(tr, node_id="client-001", side="agent", federation="fed", ledger=ledger, qos=1)
    subs = [ch._on_packet(PacketEvent("out", "SUBSCRIBE", 30)) for _ in range(3)]
    dup = ch._on_packet(PacketEvent("out", "PUBLISH", 500, dup=True))
    assert all(isinstance(r, int) and r > 0 for r in [*subs, dup])
    assert ch._on_packet(PacketEvent("out", "SUBSCRIBE", 30, unsent_bytes=12, ref=subs[1])) is None
    ch._on_packet(PacketEvent("out", "SUBSCRIBE", 30, dropped=True))
    ch._on_packet(PacketEvent("out", "PUBLISH", 500, dup=True, unsent_bytes=400, ref=dup))
    ledger.flush()
    rows = ledger.rows()
    assert [(r.kind, r.event, r.delivery, r.unsent_bytes) for r in rows] == [
        ("SUBSCRIBE", "sent", "", 0), ("SUBSCRIBE", "sent", "", 12), ("SUBSCRIBE", "message", "dropped", 0),
        ("PUBLISH-DUP", "sent", "", 400)]
    assert ch.control_bytes_sent == 148 == _wire(rows)
    ledger.close()


def test_a_message_withdrawn_unsent_leaves_the_wire_totals_and_a_voided_retransmission_its_row(tmp_path) -> None:
    """QoS 1, by hand. M1 is reported ``withdrawn`` (refused above a limit the transport inferred,
    none of its PUBLISH packets having reached the socket): its ``sent`` row turns into a
    ``message`` row with delivery ``refused`` and leaves ``wire_bytes_sent``; the message is queued
    to be sent again smaller, as after ``refused``. M2 was on the wire (its row stays), and its
    retransmission (a ``PUBLISH-DUP`` row, 500 bytes) is voided by a ``dropped`` event naming
    that row (``ref``), never by type and size: a SUBSCRIBE of 500 bytes keeps its row. By hand:
    the wire sum is M2's packet + the SUBSCRIBE's 500 bytes."""
    tr = ReportingTransport()
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ch = Channel(tr, node_id="client-001", side="agent", federation="fed", ledger=ledger, qos=1)
    ch.send(TOPIC, update_of(1000), round=1)  # M1
    ch.send(TOPIC, update_of(1000), round=1)  # M2
    sub = ch._on_packet(PacketEvent("out", "SUBSCRIBE", 500))
    dup = ch._on_packet(PacketEvent("out", "PUBLISH", 500, dup=True))
    tr.tell(tr.handles[0], "withdrawn", "the broker closed the connection 2 times (test)")
    tr.tell(tr.handles[1], "refused", "the broker closed the connection 2 times (test)")
    assert ch._on_packet(PacketEvent("out", "PUBLISH", 500, dup=True, dropped=True, ref=dup)) is None
    assert ch.refused == 2 and len(ch._refusal_queue) == 2 and ch._handles == {}
    ledger.flush()
    rows = ledger.rows()
    updates = [r for r in rows if r.kind == "update"]
    assert [(r.event, r.delivery) for r in updates] == [("message", "refused"), ("sent", "refused")]
    assert all("closed the connection 2 times" in r.reason for r in updates)
    assert [(r.kind, r.event, r.delivery) for r in rows if r.reason == "control"] == [
        ("SUBSCRIBE", "sent", ""), ("PUBLISH-DUP", "message", "dropped")]
    assert sub and dup
    assert ch.wire_bytes_sent == updates[1].wire_bytes and ch.control_bytes_sent == 500
    assert ch.wire_bytes_sent + ch.control_bytes_sent == _wire(rows)
    ledger.close()
