"""A chunked message whose send stops before its last chunk: what happens to the chunks after the
one that stopped it, and what the ledger says of them.

A transport double stands in for paho: each publish hands its PUBLISH over (a handle) unless told
otherwise, and one wait ends before its PUBACK (:class:`~protocol.errors.PublishTimeout`, or a
:class:`~protocol.errors.TransportError` for a transport closed while it waited, its ``handle``
set: the MQTT client took the chunk), as :class:`protocol.transport.MqttTransport` does. From a
given publish on it may take nothing (a closed transport, a full offline buffer: no handle).

The message throughout: ``update_of(1000)`` from ``client-001`` in round 1, seq 1: a 4,052-byte
payload (a 28-byte envelope, its timestamp a 9-byte uint64, around a 4,024-byte body), cut into
chunks of 1,000 bytes: 5 chunks carrying 1,000, 1,000, 1,000, 1,000 and 52 bytes, sent with
seqs 2 … 6. A chunk's framing (``envelope_bytes``: the chunk envelope and record around the
slice) is 90 bytes at offset 0, 92 at offsets 1,000 … 3,000 (the offset takes a 3-byte uint16
instead of a 1-byte fixint) and 90 at offset 4,000 (a uint16 offset, but its 52-byte slice takes a
2-byte bin8 header instead of a 3-byte bin16 one). Each PUBLISH adds 7 bytes of MQTT 3.1.1 header
(QoS 1) and 36 of topic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest
from helpers.stub_transport import StubTransport, update_of

from protocol import topics
from protocol.channel import Channel
from protocol.errors import OfflineBufferFull, PublishTimeout, TransportError
from protocol.ledger import Ledger
from protocol.messages import Chunk, Envelope, Kind, Resend, decode, encode
from protocol.transport_base import Incoming

FED = "fed"
TOPIC = topics.up(FED, "client-001", Kind.UPDATE)  # 36 bytes
SLICES = [1000, 1000, 1000, 1000, 52]
FRAMING = [90, 92, 92, 92, 90]
PAYLOADS = [s + f for s, f in zip(SLICES, FRAMING, strict=True)]  # 1,090, 1,092, 1,092, 1,092, 142
PACKET_OVERHEAD = 7 + 36


class StallingTransport(StubTransport):
    """Hands each PUBLISH over (a new handle; its payload and ``wait_s`` kept in :attr:`published`).

    Attributes:
        wait_ends_at: the publish (0-based, of all tried) whose wait ends once the packet is
            handed over: it raises ``ending(message, topic=…, handle=…)``.
        takes_none_from: from this publish on (0-based) nothing is taken: ``refusal(topic)`` is
            raised, without a handle.
    """

    def __init__(self) -> None:
        super().__init__()
        self.published: list[tuple[bytes, float | None]] = []
        self.handles: list[object] = []
        self.tries = 0
        self.wait_ends_at: int | None = None
        self.ending: type[TransportError] = PublishTimeout
        self.takes_none_from: int | None = None
        self.refusal: Callable[[str], TransportError] = lambda topic: TransportError(
            f"client-001: PUBLISH to {topic} not sent: the transport is closed", topic=topic)

    def publish(self, topic, payload, *, qos=1, retain=False, wait_s=None):
        n = self.tries
        self.tries += 1
        if self.takes_none_from is not None and n >= self.takes_none_from:
            raise self.refusal(topic)
        handle = object()
        self.handles.append(handle)
        self.published.append((bytes(payload), wait_s))
        if n == self.wait_ends_at:
            raise self.ending(f"client-001: PUBLISH to {topic}: its wait ended first", topic=topic, handle=handle)
        return handle


def _channel(tmp_path) -> tuple[Channel, StallingTransport, Ledger]:
    tr = StallingTransport()
    ledger = Ledger(tmp_path / "ledger.sqlite")
    return Channel(tr, node_id="client-001", side="agent", federation=FED, ledger=ledger, qos=1), tr, ledger


def _chunk_rows(ledger: Ledger) -> list:
    ledger.flush()
    return [r for r in ledger.rows() if r.kind == "update" and r.chunk_index is not None]


def _wire(rows) -> int:
    return sum(r.mqtt_header_bytes + r.topic_bytes + r.payload_bytes - r.unsent_bytes for r in rows
               if r.event == "sent")


def test_a_wait_that_ends_at_a_middle_chunk_hands_the_chunks_after_it_over_without_waiting(tmp_path) -> None:
    """The wait for chunk 2 of 5 ends first (PublishTimeout): chunks 3, 4, 5 are still handed to
    the MQTT client, without a wait of their own (queued as chunk 2 is), each with its ``sent``
    row (``handed``); then the PublishTimeout is raised, naming the chunks: all 5 handed over.
    As the link moves, their PUBACKs land on their rows. Before, chunks 3-5 were never handed
    over and no row said so: the message stayed half-sent."""
    ch, tr, ledger = _channel(tmp_path)
    tr.wait_ends_at = 1
    with pytest.raises(PublishTimeout) as raised:
        ch.send(TOPIC, update_of(1000), round=1, wait_s=5.0, chunk_bytes=1000)
    exc = raised.value
    assert exc.handle is tr.handles[1] and exc.seq == 1
    assert (exc.chunks_handed, exc.chunk_count) == (5, 5)
    assert "update of round 1 (seq 1) in 5 chunks: the wait for chunk 2 ended first; all 5 handed" in str(exc)
    assert [w for _, w in tr.published] == [5.0, 5.0, None, None, None]
    chunks = [decode(p).envelope for p, _ in tr.published]
    assert [(e.seq, e.body.index, len(e.body.data)) for e in chunks] == [(2 + i, i, s) for i, s in enumerate(SLICES)]
    rows = _chunk_rows(ledger)
    assert [(r.event, r.delivery, r.chunk_index, r.seq, r.body_bytes, r.envelope_bytes) for r in rows] == \
        [("sent", "handed", i, 2 + i, SLICES[i], FRAMING[i]) for i in range(5)]
    assert ch.wire_bytes_sent == _wire(rows) == sum(PAYLOADS) + 5 * PACKET_OVERHEAD == 4_723
    assert ch.in_flight(1)
    for h in tr.handles:
        tr.listener(h, "acked", "")
    assert [r.delivery for r in _chunk_rows(ledger)] == ["acked"] * 5
    assert not ch.in_flight(1) and ch.undeliverable == 0
    ledger.close()


def test_a_transport_closed_while_a_middle_chunk_waited_leaves_rows_for_the_chunks_it_never_took(
        tmp_path, caplog) -> None:
    """The transport is closed while chunk 2 of 5 waits for its PUBACK (TransportError, its
    handle set): chunk 2 keeps its ``sent`` row; chunk 3 is offered once and not taken (the
    transport is closed), nor are 4 and 5 offered. Chunks 3, 4, 5 get ``message`` rows with
    delivery ``dropped`` and their whole sizes (1,092 + 1,092 + 142 payload bytes), out of the
    wire totals; a WARNING names the message and the chunks; the error raised is the wait's,
    naming 2 of 5 chunks handed over. The close then reports chunk 2 dropped unsent: the message
    is said undeliverable, once. Before, chunks 3-5 had no row: the ledger did not say the
    message was incomplete."""
    ch, tr, ledger = _channel(tmp_path)
    tr.wait_ends_at, tr.ending = 1, TransportError
    tr.takes_none_from = 2
    with caplog.at_level(logging.WARNING, logger="protocol.channel"), pytest.raises(TransportError) as raised:
        ch.send(TOPIC, update_of(1000), round=1, wait_s=60.0, chunk_bytes=1000)
    exc = raised.value
    assert type(exc) is TransportError and exc.handle is tr.handles[1] and exc.seq == 1
    assert (exc.chunks_handed, exc.chunk_count) == (2, 5)
    assert "the wait for chunk 2 ended first; chunks 3-5 of 5 not handed to the MQTT client" in str(exc)
    assert "the transport is closed" in str(exc)
    assert tr.tries == 3 and len(tr.published) == 2
    rows = _chunk_rows(ledger)
    assert [(r.event, r.delivery, r.chunk_index, r.seq, r.body_bytes, r.payload_bytes) for r in rows] == [
        ("sent", "handed", 0, 2, 1000, 1090), ("sent", "handed", 1, 3, 1000, 1092),
        ("message", "dropped", 2, 4, 1000, 1092), ("message", "dropped", 3, 5, 1000, 1092),
        ("message", "dropped", 4, 6, 52, 142)]
    assert all(r.reason.startswith("not handed to the MQTT client: client-001: PUBLISH to") for r in rows[2:])
    assert ch.wire_bytes_sent == _wire(rows) == 1090 + 1092 + 2 * PACKET_OVERHEAD == 2_268
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "update of round 1 (seq 1): chunks 3-5 of 5" in warned[0], warned
    tr.listener(tr.handles[0], "acked", "")
    tr.listener(tr.handles[1], "dropped", "the transport was closed")
    assert ch.undeliverable == 1 and not ch.in_flight(1)
    rows = _chunk_rows(ledger)
    assert [(r.event, r.delivery) for r in rows[:2]] == [("sent", "acked"), ("message", "dropped")]
    assert ch.wire_bytes_sent == _wire(rows) == 1090 + PACKET_OVERHEAD
    ledger.close()


@pytest.mark.parametrize("first_refused", [0, 3])
def test_chunks_the_transport_never_took_get_rows_and_a_resend_request_still_gets_them(
        tmp_path, first_refused: int) -> None:
    """No wait: the offline buffer is full from chunk ``first_refused`` + 1 on (OfflineBufferFull,
    nothing taken): that chunk and the ones after it get ``message`` rows (delivery ``dropped``),
    and the OfflineBufferFull raised names how many of the 5 chunks were handed over. The chunk
    cache still holds the whole transfer: the server's resend request for the missing chunks is
    answered once the buffer has room, each chunk with a ``sent`` row of its own."""
    ch, tr, ledger = _channel(tmp_path)
    tr.takes_none_from = first_refused
    tr.refusal = lambda topic: OfflineBufferFull("client-001: no room for a 1,092-byte message", topic=topic)
    with pytest.raises(OfflineBufferFull) as raised:
        ch.send(TOPIC, update_of(1000), round=1, chunk_bytes=1000)
    exc = raised.value
    assert (exc.chunks_handed, exc.chunk_count) == (first_refused, 5) and exc.seq is None
    missing = list(range(first_refused, 5))
    what = f"chunks {first_refused + 1}-5 of 5 not handed to the MQTT client"
    assert what in str(exc) and ("none of them" in str(exc) if first_refused == 0 else "chunks 1-3 were" in str(exc))
    assert tr.tries == first_refused + 1
    rows = _chunk_rows(ledger)
    assert [(r.event, r.delivery, r.chunk_index, r.payload_bytes) for r in rows] == \
        [("sent", "handed", i, PAYLOADS[i]) for i in range(first_refused)] + \
        [("message", "dropped", i, PAYLOADS[i]) for i in missing]
    assert ch.wire_bytes_sent == _wire(rows) == sum(PAYLOADS[:first_refused]) + first_refused * PACKET_OVERHEAD

    tid = bytes.fromhex(rows[0].transfer_id)
    tr.takes_none_from = None  # room again
    request = encode(Envelope(round=0, sender="server", seq=1, body=Resend(tid, tuple(missing)))).payload
    assert ch.accept(Incoming(topics.down_to(FED, "client-001", Kind.RESEND), request, 1, False,
                              time.monotonic())) is None
    resent = [decode(p).envelope.body for p, _ in tr.published[first_refused:]]
    assert all(isinstance(c, Chunk) and c.transfer_id == tid for c in resent)
    assert [c.index for c in resent] == missing and ch.resent_chunks == len(missing)
    rows = _chunk_rows(ledger)[5:]
    assert [(r.event, r.delivery, r.chunk_index, r.payload_bytes) for r in rows] == \
        [("sent", "handed", i, PAYLOADS[i]) for i in missing]
    assert ch.wire_bytes_sent == _wire(_chunk_rows(ledger)) == sum(PAYLOADS) + 5 * PACKET_OVERHEAD
    ledger.close()


@pytest.mark.parametrize("refusal", ["closed", "buffer full"])
def test_an_unchunked_message_the_transport_does_not_take_gets_a_dropped_message_row_and_a_warning(
        tmp_path, caplog, refusal: str) -> None:
    """The same update unchunked (its 4,052-byte payload under the channel's 1 MiB chunk size),
    offered once and not taken: the transport is closed, or its offline buffer is full (no
    handle). It gets one ``message`` row with delivery ``dropped``, its whole sizes (7 + 36 MQTT
    bytes, 28 envelope + 4,024 body = 4,052 payload bytes; 4,000 raw tensor bytes) out of the wire
    totals, the reason ``not handed to the MQTT client: …``; a WARNING names the message; the
    transport's error is raised as it was (no ``seq``: nothing of it may arrive). Before, the
    ledger had no row of it: only the caller's log said so."""
    ch, tr, ledger = _channel(tmp_path)
    tr.takes_none_from = 0
    if refusal == "buffer full":
        tr.refusal = lambda topic: OfflineBufferFull("client-001: no room for a 4,052-byte message", topic=topic)
    with caplog.at_level(logging.WARNING, logger="protocol.channel"), pytest.raises(TransportError) as raised:
        ch.send(TOPIC, update_of(1000), round=1, wait_s=5.0)
    exc = raised.value
    assert type(exc) is (OfflineBufferFull if refusal == "buffer full" else TransportError)
    assert exc.handle is None and exc.seq is None and exc.chunks_handed is None
    assert tr.tries == 1 and tr.published == []
    ledger.flush()
    rows = [r for r in ledger.rows() if r.kind == "update"]
    assert [(r.event, r.delivery, r.seq, r.chunk_index, r.transfer_id, r.mqtt_header_bytes, r.topic_bytes,
             r.envelope_bytes, r.body_bytes, r.payload_bytes, r.raw_bytes, r.codec, r.unsent_bytes)
            for r in rows] == [("message", "dropped", 1, None, None, 7, 36, 28, 4_024, 4_052, 4_000, "fp32", 0)]
    assert rows[0].reason == f"not handed to the MQTT client: {exc}"
    assert ch.wire_bytes_sent == _wire(rows) == 0
    assert not ch.in_flight(1) and ch.undeliverable == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [f"client-001: update of round 1 (seq 1, 4,052 bytes) on {TOPIC} not handed to the MQTT "
                      f"client: {exc}; it reaches its recipient only if it is sent again"], warned
    ledger.close()
