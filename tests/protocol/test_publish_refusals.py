"""A PUBLISH the broker refuses (size limits): the channel sends the message again in
chunks of at most half the refused packet's size, or gives up loudly when smaller packets cannot
help; the ledger's ``delivery`` says handed / acked / refused. A transport double stands in for
paho: it refuses every packet above ``limit`` (as Mosquitto's PUBACK 0x95 does) when ``answer()``
is called, so each step is explicit."""

from __future__ import annotations

import pytest
from helpers.stub_transport import StubTransport, update_of

from broker_server.registry import DeviceRegistry, announced_limit
from protocol.channel import Channel
from protocol.chunking import Reassembler
from protocol.ledger import Ledger
from protocol.messages import Chunk, Join, decode
from protocol.mqtt_bytes import publish_size
from protocol.transport import parse_mqtt_version

TOPIC = "fedfleet/v1/fed/up/client-001/update"


class RefusingTransport(StubTransport):
    mqtt_version = 4

    def __init__(self, limit: int, reason: str = "PUBACK reason code 0x95 (Packet too large)") -> None:
        super().__init__()
        self.limit, self.reason = limit, reason
        self.sent: list[tuple[str, bytes, int]] = []
        self._pending: list[tuple[object, int]] = []

    def publish(self, topic, payload, *, qos=1, retain=False, wait_s=None):
        handle = object()
        size = publish_size(topic, len(payload), qos).packet_bytes
        self.sent.append((topic, bytes(payload), size))
        self._pending.append((handle, size))
        return handle

    def answer(self) -> None:
        pending, self._pending = self._pending, []
        for handle, size in pending:
            self.listener(handle, "refused" if size > self.limit else "acked", self.reason if size > self.limit else "")




def _channel(tmp_path, transport) -> tuple[Channel, Ledger]:
    ledger = Ledger(tmp_path / "ledger.sqlite")
    return Channel(transport, node_id="client-001", side="agent", federation="fed", ledger=ledger), ledger


def test_refused_message_is_sent_again_in_half_size_chunks(tmp_path) -> None:
    tr = RefusingTransport(limit=20_000)
    ch, ledger = _channel(tmp_path, tr)
    enc = ch.send(TOPIC, update_of(12_000), round=1)  # ~48 KB: one whole PUBLISH
    assert len(tr.sent) == 1 and tr.sent[0][2] > 20_000
    first = tr.sent[0][2]
    for _ in range(4):  # the broker answers; the channel's own thread handles refusals
        tr.answer()
        ch.receive(0.0)
    # 48 KB refused -> chunks of <= 24 KB, refused again -> chunks of <= 12 KB, acknowledged
    sizes = [size for _, _, size in tr.sent]
    assert max(sizes[1:]) <= first // 2 and any(first // 4 < x <= first // 2 for x in sizes)
    last_tid = decode(tr.sent[-1][1]).envelope.body.transfer_id
    final = [p for _, p, _ in tr.sent[1:] if decode(p).envelope.body.transfer_id == last_tid]
    assert all(size <= first // 4 for _, p, size in tr.sent if p in final)
    r = Reassembler()
    whole = None
    for payload in final:
        body = decode(payload).envelope.body
        assert isinstance(body, Chunk)
        whole = r.add("client-001", body) or whole
    assert whole == enc.payload  # the receiver reassembles the very message that was refused
    rows = ledger.rows("event = 'sent'")
    assert rows[0].delivery == "refused" and "0x95" in rows[0].reason
    by_size = {(row.mqtt_header_bytes + row.topic_bytes + row.payload_bytes > 20_000): set() for row in rows}
    for row in rows:
        by_size[row.mqtt_header_bytes + row.topic_bytes + row.payload_bytes > 20_000].add(row.delivery)
    assert by_size == {True: {"refused"}, False: {"acked"}}  # every row says what the broker did
    assert ch.resent_after_refusal == 2 and ch.undeliverable == 0
    assert ch.acked == sum(row.delivery == "acked" for row in rows) >= len(final)
    assert ch.learned_max_packet_bytes <= first // 4
    n = len(tr.sent)
    ch.send(TOPIC, update_of(12_000), round=2)  # the next message is chunked below the learnt limit at once
    assert len(tr.sent) > n + 1 and max(size for _, _, size in tr.sent[n:]) <= 20_000
    ledger.close()


def test_refusal_smaller_packets_cannot_help_fails_loudly(tmp_path, caplog) -> None:
    tr = RefusingTransport(limit=100, reason="PUBACK reason code 0x87 (Not authorized)")
    ch, ledger = _channel(tmp_path, tr)
    ch.send(TOPIC, update_of(1_000), round=1)
    tr.answer()
    ch.receive(0.0)
    assert len(tr.sent) == 1  # not sent again
    assert ch.undeliverable == 1 and "0x87" in ch.undeliverable_reasons[0]
    assert "smaller packets cannot help" in caplog.text
    (row,) = ledger.rows("kind = 'undeliverable'")
    assert "0x87" in row.reason and row.event == "message"
    ledger.close()


def test_refusals_stop_after_the_last_resend_with_the_limit_in_the_message(tmp_path) -> None:
    tr = RefusingTransport(limit=10)  # nothing fits: every try is refused
    ch, ledger = _channel(tmp_path, tr)
    ch.send(TOPIC, update_of(2_000), round=1)
    for _ in range(20):
        tr.answer()
        ch.receive(0.0)
    assert ch.undeliverable == 1 and ch.resent_after_refusal <= 6
    assert "bytes" in ch.undeliverable_reasons[0]
    ledger.close()


class AckThenCloseTransport(RefusingTransport):
    """Acknowledges every packet (as Mosquitto's ``message_size_limit`` over MQTT 3.1.1 does), then
    reports the one above ``limit`` refused after its acknowledgement (the close that followed it),
    as :class:`~protocol.transport.MqttTransport` does."""

    def answer(self) -> None:
        pending, self._pending = self._pending, []
        for handle, _ in pending:
            self.listener(handle, "acked", "")
        for handle, size in pending:
            if size > self.limit:
                self.listener(handle, "refused", "the broker closed the connection right after acknowledging it")


def test_refusal_after_the_acknowledgement_turns_the_row_refused_and_sends_it_again(tmp_path) -> None:
    tr = AckThenCloseTransport(limit=20_000)
    ch, ledger = _channel(tmp_path, tr)
    ch.send(TOPIC, update_of(12_000), round=1)  # 48,0xx bytes whole
    first = tr.sent[0][2]
    for _ in range(4):
        tr.answer()
        ch.receive(0.0)
    rows = ledger.rows("event = 'sent'")
    assert rows[0].delivery == "refused" and "right after acknowledging" in rows[0].reason
    # 48 KB -> chunks of <= 24 KB (refused after their PUBACK too) -> <= 12 KB: acknowledged
    assert ch.resent_after_refusal == 2 and ch.learned_max_packet_bytes <= first // 4
    for row in rows:
        size = row.mqtt_header_bytes + row.topic_bytes + row.payload_bytes
        assert row.delivery == ("refused" if size > 20_000 else "acked")
    assert ch.acked == sum(r.delivery == "acked" for r in rows)  # an ack taken back is not counted
    assert ch.refused == sum(r.delivery == "refused" for r in rows)
    ledger.close()


def _delivered(ch: Channel, payload_bytes: int) -> None:
    """The broker delivers a ``payload_bytes`` PUBLISH to ``ch`` (a chunk of a global, say)."""
    from protocol.transport_base import Incoming

    ch.accept(Incoming("fedfleet/v1/fed/down/global", bytes(payload_bytes), 1, False, 0.0))


def test_a_refused_message_goes_again_at_the_largest_size_the_broker_delivered(tmp_path) -> None:
    tr = RefusingTransport(limit=20_000)
    ch, ledger = _channel(tmp_path, tr)
    _delivered(ch, 13_000)  # not a valid message (a rejected row), but the broker took 13,000 bytes
    proven = publish_size("fedfleet/v1/fed/down/global", 13_000, 1).packet_bytes
    assert (ch.delivered_max_payload_bytes, ch.delivered_max_packet_bytes) == (13_000, proven)
    # on the update topic (9 bytes longer) no more payload than 13,000 bytes: the packet is the smaller
    assert ch.delivered_packet_bytes(TOPIC) == min(proven, publish_size(TOPIC, 13_000, 1).packet_bytes)
    ch.send(TOPIC, update_of(12_000), round=1)
    first = tr.sent[0][2]
    assert first // 8 <= proven < first // 2  # by hand: 48 KB refused; half would still be refused
    for _ in range(3):
        tr.answer()
        ch.receive(0.0)
    # one re-send, straight at the delivered size (halving would take two)
    assert ch.resent_after_refusal == 1 and ch.learned_max_packet_bytes == ch.delivered_packet_bytes(TOPIC)
    assert max(size for _, _, size in tr.sent[1:]) <= ch.delivered_packet_bytes(TOPIC)
    ledger.close()


def test_suspect_dropped_learns_a_quarter_and_never_below_what_was_delivered(tmp_path) -> None:
    tr = RefusingTransport(limit=1 << 30)
    ch, ledger = _channel(tmp_path, tr)
    enc = ch.send(TOPIC, update_of(12_000), round=1)
    first = tr.sent[0][2]
    assert ch.in_flight(enc.seq)
    tr.answer()
    ch.receive(0.0)
    assert not ch.in_flight(enc.seq)
    # acknowledged, never confirmed, nothing delivered: a quarter of the packet (each try costs a timeout)
    assert ch.suspect_dropped(enc.seq) == first // 4 == ch.learned_max_packet_bytes
    assert ch.suspect_dropped(10**6) == 0  # not a message sent here
    # a second channel that was delivered a packet as large as its update's: the size was not the cause
    ch2, ledger2 = _channel(tmp_path / "2", RefusingTransport(limit=1 << 30))
    _delivered(ch2, 60_000)
    enc2 = ch2.send(TOPIC, update_of(12_000), round=1)
    assert ch2.in_flight(enc2.seq)  # its PUBLISH awaits the broker's answer
    assert ch2.suspect_dropped(enc2.seq) == 0 and ch2.learned_max_packet_bytes == 0
    ledger.close()
    ledger2.close()


def test_over_mqtt_5_an_unconfirmed_message_is_not_taken_for_a_size_drop(tmp_path, caplog) -> None:
    """Over MQTT 5 a broker refuses a PUBLISH it will not forward in its PUBACK (Mosquitto 2.0:
    0x95 for a message over message_size_limit; a packet over the Maximum Packet Size its CONNACK
    announced is a DISCONNECT), so a message it acknowledged and whose recipient never confirmed it
    was lost some other way: nothing is learned, the copy goes again as before. Found in a field
    trial (Mosquitto, max_packet_size 16384, MQTT 5): the server was killed and resumed; an agent's
    update sent meanwhile got no receipt, and the agent logged that the broker had dropped its
    16,364-byte packets "above a size limit it does not announce" and sent every later update in
    packets of at most 8,315 bytes (7 chunks instead of 4)."""
    class Mqtt5(RefusingTransport):
        mqtt_version = 5

    tr = Mqtt5(limit=1 << 30)
    ch, ledger = _channel(tmp_path, tr)
    enc = ch.send(TOPIC, update_of(12_000), round=1)
    tr.answer()
    ch.receive(0.0)
    assert not ch.in_flight(enc.seq)
    with caplog.at_level("WARNING"):
        assert ch.suspect_dropped(enc.seq) == 0
    assert ch.learned_max_packet_bytes == 0 and "size limit" not in caplog.text
    ledger.close()


def test_a_packet_just_above_a_delivered_size_is_not_taken_for_dropped(tmp_path) -> None:
    """The broker delivered what proves packets 32 bytes smaller than the update's fit (a global
    of the same model, as when a loaded server's receipt came late): the update's silence is not
    blamed on a size limit (nothing learned, sent again as before). 2,000 bytes smaller (more than
    1 % and 1,024 bytes) it is: the packet limit becomes the proven size (the largest delivered,
    being above an eighth of the packet)."""
    def channel_proving(gap: int, where: str) -> tuple[Channel, Ledger, int]:
        ch, ledger = _channel(tmp_path / where, RefusingTransport(limit=1 << 30))
        probe, probe_ledger = _channel(tmp_path / f"{where}-probe", RefusingTransport(limit=1 << 30))
        enc = probe.send(TOPIC, update_of(12_000), round=1)
        packet = probe.transport.sent[0][2]  # type: ignore[attr-defined]
        _delivered(probe, packet - gap - 100)  # same framing length as the target's
        offset = probe.delivered_packet_bytes(TOPIC) - (packet - gap - 100)  # framing of a payload, on TOPIC
        probe_ledger.close()
        assert enc.seq
        _delivered(ch, packet - gap - offset)
        assert ch.delivered_packet_bytes(TOPIC) == packet - gap
        return ch, ledger, packet

    near, ledger, packet = channel_proving(32, "near")
    enc = near.send(TOPIC, update_of(12_000), round=1)
    assert near.suspect_dropped(enc.seq) == 0 and near.learned_max_packet_bytes == 0
    far, ledger2, _ = channel_proving(2000, "far")
    enc2 = far.send(TOPIC, update_of(12_000), round=1)
    assert far.suspect_dropped(enc2.seq) == far.learned_max_packet_bytes == packet - 2000
    ledger.close()
    ledger2.close()


def test_a_request_for_chunks_of_a_replaced_transfer_is_not_answered_and_not_a_rejection(tmp_path, caplog) -> None:
    """A receiver that got some chunks of a transfer the broker then refused asks for the rest;
    the sender sent the message again as a new transfer: the request is ledgered as received,
    counted, logged at debug only, and nothing is sent for it. An unknown transfer is still refused."""
    import logging
    import time

    from protocol import topics
    from protocol.channel import Rejected
    from protocol.messages import Envelope, Kind, Resend, encode
    from protocol.transport_base import Incoming

    tr = RefusingTransport(limit=20_000)
    ch, ledger = _channel(tmp_path, tr)
    ch.send(TOPIC, update_of(12_000), round=1)
    for _ in range(4):
        tr.answer()
        ch.receive(0.0)
    tids = []
    for _, payload, _ in tr.sent[1:]:
        tid = decode(payload).envelope.body.transfer_id
        if tid not in tids:
            tids.append(tid)
    assert len(tids) == 2  # the refused transfer (chunks of <= 24 KB) and the one that replaced it
    n = len(tr.sent)

    def request(tid: bytes, seq: int) -> Incoming:
        env = Envelope(round=0, sender="server", seq=seq, body=Resend(tid, (0, 1)))
        return Incoming(topics.down_to("fed", "client-001", Kind.RESEND), encode(env).payload, 1, False,
                        time.monotonic())

    with caplog.at_level(logging.DEBUG, logger="protocol.channel"):
        assert ch.accept(request(tids[0], 1)) is None
    assert len(tr.sent) == n and ch.superseded_resend_requests == 1 and ch.rejected == 0
    assert [r.levelname for r in caplog.records if "not answered" in r.getMessage()] == ["DEBUG"]
    item = ch.accept(request(bytes(16), 2))  # a transfer this side never sent
    assert isinstance(item, Rejected) and "not held here" in item.reason
    assert [r.event for r in ledger.rows("topic LIKE '%/resend'")] == ["received", "rejected"]
    ledger.close()


@pytest.mark.parametrize(("text", "want"), [("auto", "auto"), ("5", "5"), ("v5", "5"), (5, "5"), ("3.1.1", "3.1.1"),
                                            ("311", "3.1.1"), (4, "3.1.1")])
def test_mqtt_version_spellings(text, want) -> None:
    assert parse_mqtt_version(text) == want


def test_unknown_mqtt_version_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="auto, 5, 3.1.1"):
        parse_mqtt_version("3.1")


def test_device_limits_from_joins_take_the_smallest() -> None:
    reg = DeviceRegistry()
    for cid, limit in (("a", 20_000), ("b", 131_072), ("c", None)):
        info = {} if limit is None else {"max_packet_bytes": limit, "chunk_bytes": limit // 2}
        reg.admit(cid, Join(profile="p", manifest_hash="0" * 16, num_samples=1, class_histogram=(1,), info=info),
                  round=0, now=0.0)
    assert reg.limits() == (20_000, 10_000)
    assert reg.limits(["b"]) == (131_072, 65_536)
    assert reg.limits(["c"]) == (0, 0)  # announced nothing: no limit of its own
    assert announced_limit({"max_packet_bytes": "4096"}, "max_packet_bytes") == 4096
    assert "max_packet_bytes = 10" in str(announced_limit({"max_packet_bytes": 10}, "max_packet_bytes"))
