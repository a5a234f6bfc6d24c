"""Resend requests are honoured only from known peers (the server: joined agents, verified when
signing is on; an agent: the server), for transfers sent to them, for indices those transfers
have, and within a per-peer budget of resent bytes; every refused request is a ``rejected``
ledger row with its reason, and nothing is published for it."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from protocol import topics
from protocol.channel import Channel, Rejected
from protocol.ledger import Ledger
from protocol.messages import Chunk, Envelope, Global, Kind, Resend, Update, decode, encode
from protocol.transport_base import Incoming

FED = "fed-resend"


class _Recorder:
    """A transport that keeps what is published and delivers nothing by itself."""

    client_id = "x"

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    def subscribe(self, filters, qos=1):
        pass

    def publish(self, topic, payload, *, qos=1, retain=False, wait_s=None):
        self.published.append((topic, bytes(payload)))

    def get(self, timeout_s):
        return None

    def close(self):
        pass


def _server(tmp_path: Path, **opts) -> tuple[Channel, _Recorder, Ledger]:
    tr, ledger = _Recorder(), Ledger(tmp_path / "ledger.sqlite")
    ch = Channel(tr, node_id="server", side="server", federation=FED, ledger=ledger, chunk_bytes=1000,
                 transfer_filter=lambda s: s in {"client-001", "client-002"}, **opts)
    return ch, tr, ledger


def _global() -> Global:
    return Global((np.arange(1000, dtype=np.float32),), {"manifest_hash": "0" * 16})  # 4,000 raw bytes


def _request(sender: str, tid: bytes, indices, *, seq: int = 1) -> Incoming:
    payload = encode(Envelope(round=0, sender=sender, seq=seq, body=Resend(tid, tuple(indices)))).payload
    return Incoming(topics.up(FED, sender, Kind.RESEND), payload, 1, False, time.monotonic())


def _broadcast(ch: Channel, tr: _Recorder) -> tuple[bytes, list[Chunk]]:
    ch.send(topics.down(FED, Kind.GLOBAL), _global(), round=1)
    chunks = [decode(p).envelope.body for _, p in tr.published]
    assert all(isinstance(c, Chunk) for c in chunks) and len(chunks) == 5  # ceil(4,0xx / 1000)
    tr.published.clear()
    return chunks[0].transfer_id, chunks


def _rows(ledger: Ledger, event: str) -> list:
    ledger.flush()
    return [r for r in ledger.rows(f"event='{event}'") if r.topic.endswith("/resend")]


def test_a_request_from_a_client_that_never_joined_is_refused_and_nothing_is_sent(tmp_path: Path) -> None:
    ch, tr, ledger = _server(tmp_path)
    tid, _ = _broadcast(ch, tr)
    item = ch.accept(_request("intruder", tid, range(5)))
    assert isinstance(item, Rejected) and item.code == "resend_refused" and "never joined" in item.reason
    assert tr.published == [] and ch.resent_chunks == 0  # no amplification: 0 bytes answered
    rows = _rows(ledger, "rejected")
    assert len(rows) == 1 and "never joined" in rows[0].reason and not _rows(ledger, "received")


def test_a_request_for_an_unknown_transfer_is_refused(tmp_path: Path) -> None:
    ch, tr, ledger = _server(tmp_path)
    _broadcast(ch, tr)
    item = ch.accept(_request("client-001", bytes(16), [0]))
    assert isinstance(item, Rejected) and "not held here" in item.reason
    assert tr.published == [] and len(_rows(ledger, "rejected")) == 1


def test_a_request_for_indices_the_transfer_lacks_is_refused(tmp_path: Path) -> None:
    ch, tr, ledger = _server(tmp_path)
    tid, _ = _broadcast(ch, tr)
    item = ch.accept(_request("client-001", tid, [1, 5]))
    assert isinstance(item, Rejected) and "asks for chunk 5 of transfer" in item.reason and "(5 chunks)" in item.reason
    item = ch.accept(_request("client-001", tid, [], seq=2))
    assert isinstance(item, Rejected) and "asks for no chunk" in item.reason
    assert tr.published == [] and len(_rows(ledger, "rejected")) == 2


def test_a_request_for_a_transfer_sent_to_another_client_is_refused(tmp_path: Path) -> None:
    ch, tr, ledger = _server(tmp_path)
    ch.send(topics.down_to(FED, "client-002", Kind.GLOBAL), _global(), round=1, recipient="client-002")
    tid = decode(tr.published[0][1]).envelope.body.transfer_id
    tr.published.clear()
    item = ch.accept(_request("client-001", tid, [0]))
    assert isinstance(item, Rejected) and "was sent to 'client-002'" in item.reason
    assert tr.published == []
    assert ch.accept(_request("client-002", tid, [0])) is None  # its addressee may ask
    assert len(tr.published) == 1


def test_a_joined_client_gets_exactly_the_chunks_it_asked_for(tmp_path: Path) -> None:
    ch, tr, ledger = _server(tmp_path)
    tid, chunks = _broadcast(ch, tr)
    assert ch.accept(_request("client-001", tid, [3, 1, 3])) is None
    again = [decode(p).envelope.body for _, p in tr.published]
    assert [(c.index, c.data) for c in again] == [(3, chunks[3].data), (1, chunks[1].data)]
    assert ch.resent_chunks == 2 and len(_rows(ledger, "received")) == 1 and not _rows(ledger, "rejected")


def test_resends_beyond_the_peers_budget_are_refused(tmp_path: Path) -> None:
    # budget of 2,000 bytes of chunk data, never refilled: chunks 0 and 1 (1,000 bytes each) fit,
    # chunk 2 then does not; another peer has its own budget
    ch, tr, ledger = _server(tmp_path, resend_burst_bytes=2000, resend_rate_bytes_s=0.0)
    tid, chunks = _broadcast(ch, tr)
    assert [len(c.data) for c in chunks[:3]] == [1000, 1000, 1000]
    assert ch.accept(_request("client-001", tid, [0, 1])) is None and len(tr.published) == 2
    item = ch.accept(_request("client-001", tid, [2], seq=2))
    assert isinstance(item, Rejected) and "rate limit (1,000 bytes asked, 0 left of 2,000" in item.reason
    assert len(tr.published) == 2
    assert ch.accept(_request("client-002", tid, [2, 3])) is None and len(tr.published) == 4
    assert len(_rows(ledger, "rejected")) == 1


def test_an_agent_answers_only_the_server(tmp_path: Path) -> None:
    tr = _Recorder()
    agent = Channel(tr, node_id="client-001", side="agent", federation=FED, ledger=Ledger(tmp_path / "l.sqlite"),
                    chunk_bytes=1000)
    upd = Update((np.arange(1000, dtype=np.float32),), 5, 0.5)
    agent.send(topics.up(FED, "client-001", Kind.UPDATE), upd, round=1)
    tid = decode(tr.published[0][1]).envelope.body.transfer_id
    tr.published.clear()
    down = topics.down_to(FED, "client-001", Kind.RESEND)
    forged = encode(Envelope(round=0, sender="client-002", seq=1, body=Resend(tid, (0,)))).payload
    item = agent.accept(Incoming(down, forged, 1, False, time.monotonic()))
    assert isinstance(item, Rejected) and "only the server" in item.reason and tr.published == []
    real = encode(Envelope(round=0, sender="server", seq=1, body=Resend(tid, (0,)))).payload
    assert agent.accept(Incoming(down, real, 1, False, time.monotonic())) is None and len(tr.published) == 1


def test_with_signing_on_an_unsigned_request_from_a_joined_client_is_refused(tmp_path: Path) -> None:
    from protocol.security import ChannelSecurity, generate_identity

    srv, dev = generate_identity("server"), generate_identity("client-001")
    sec = ChannelSecurity(srv, side="server", peers={"client-001": dev.public}, epoch=1, replay_state=None)
    ch, tr, ledger = _server(tmp_path, security=sec)
    tid, _ = _broadcast(ch, tr)
    item = ch.accept(_request("client-001", tid, [0]))
    assert isinstance(item, Rejected) and item.code == "unsigned" and tr.published == []
    dev_sec = ChannelSecurity(dev, side="agent", peers={"server": srv.public}, epoch=1, replay_state=None)
    topic = topics.up(FED, "client-001", Kind.RESEND)
    sealed = dev_sec.seal(topic, _request("client-001", tid, [0], seq=2).payload).payload
    assert ch.accept(Incoming(topic, sealed, 1, False, time.monotonic())) is None and len(tr.published) == 1


@pytest.mark.parametrize("bad", [{"resend_burst_bytes": -1}, {"resend_rate_bytes_s": -0.5}])
def test_a_negative_resend_budget_is_a_clear_error(tmp_path: Path, bad: dict) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        _server(tmp_path, **bad)


def test_a_transfer_whose_message_arrived_by_another_copy_is_never_asked_for_again(tmp_path: Path) -> None:
    """A broker restart cut round 3's broadcast global after chunk 4 of 5; the device, back online
    without it, got its own copy (another transfer, on its own topic) whole. The broadcast's
    missing chunk is then never asked for (the server would answer on the broadcast topic, to
    every device), and its late chunk completes no second, stale copy. Found in a field trial
    (Mosquitto restarted as round 3's chunked global went out): the agent asked for chunk 7 of 7
    as it sent its update, the server re-sent it to all three devices after round 4 had opened,
    and the agent confirmed round 3's global a second time."""
    server, str_ = _server(tmp_path)[:2]
    server.send(topics.down(FED, Kind.GLOBAL), _global(), round=3)
    broadcast = list(str_.published)
    str_.published.clear()
    server.send(topics.down_to(FED, "client-001", Kind.GLOBAL), _global(), round=3, recipient="client-001")
    own = list(str_.published)
    assert len(broadcast) == len(own) == 5
    assert decode(broadcast[0][1]).envelope.body.transfer_id != decode(own[0][1]).envelope.body.transfer_id
    tr = _Recorder()
    agent = Channel(tr, node_id="client-001", side="agent", federation=FED, ledger=Ledger(tmp_path / "a.sqlite"),
                    chunk_bytes=1000, resend_after_s=0.0)
    got = [agent.accept(Incoming(t, p, 1, False, time.monotonic())) for t, p in broadcast[:4] + own]
    assert [type(g).__name__ for g in got] == ["NoneType"] * 8 + ["Received"]
    assert got[-1].envelope.round == 3 and got[-1].topic == topics.down_to(FED, "client-001", Kind.GLOBAL)
    agent._maintain()  # a stalled transfer would be asked for its missing chunks here
    assert tr.published == [] and agent.reassembler.pending() == []
    assert agent.superseded_copies == 1 and agent.incomplete_transfers == 0
    late = agent.accept(Incoming(broadcast[4][0], broadcast[4][1], 1, False, time.monotonic()))
    assert late is None and tr.published == []  # counted as received (its bytes came), nothing more


def test_a_partial_transfer_of_another_kind_or_a_later_round_is_kept(tmp_path: Path) -> None:
    """Only a global (or update) of the same or a later round supersedes a transfer: round 4's
    global cut mid-way is still asked for when round 3's arrives whole."""
    server, str_ = _server(tmp_path)[:2]
    server.send(topics.down(FED, Kind.GLOBAL), _global(), round=4)
    later = list(str_.published)
    str_.published.clear()
    server.send(topics.down_to(FED, "client-001", Kind.GLOBAL), _global(), round=3, recipient="client-001")
    older = list(str_.published)
    tr = _Recorder()
    agent = Channel(tr, node_id="client-001", side="agent", federation=FED, ledger=Ledger(tmp_path / "a.sqlite"),
                    chunk_bytes=1000, resend_after_s=0.0)
    for t, p in later[:4] + older:
        agent.accept(Incoming(t, p, 1, False, time.monotonic()))
    agent._maintain()
    asked = [decode(p).envelope.body for _, p in tr.published]
    assert [(type(b).__name__, b.indices) for b in asked] == [("Resend", (4,))]
    assert agent.superseded_copies == 0


# ---------------------------------------------------------------------------------------------
# A broadcast transfer's missing chunks go to the device that asked, on its own topic

DEVICES = ("client-001", "client-002", "client-003")


def _fleet(tmp_path: Path, *, signed: bool = False, devices: tuple[str, ...] = DEVICES, chunk_bytes: int = 1000,
           **server_opts):
    """A server channel (chunks of at most ``chunk_bytes`` data bytes) and the ``devices``'
    channels (by id) on one memory broker, each subscribed as it is in a federation
    (topics.server_filters / agent_filters), each with its own ledger."""
    from protocol.memory_transport import MemoryBroker

    broker = MemoryBroker()
    sec: dict[str, object] = {}
    if signed:
        from protocol.security import ChannelSecurity, generate_identity

        ids = {n: generate_identity(n) for n in ("server", *devices)}
        sec["server"] = ChannelSecurity(ids["server"], side="server", peers={d: ids[d].public for d in devices},
                                        epoch=1, replay_state=None)
        for d in devices:
            sec[d] = ChannelSecurity(ids[d], side="agent", peers={"server": ids["server"].public}, epoch=1,
                                     replay_state=None)
    st = broker.connect(topics.mqtt_client_id(FED, "server"))
    st.subscribe(topics.server_filters(FED))
    server = Channel(st, node_id="server", side="server", federation=FED, ledger=Ledger(tmp_path / "server.sqlite"),
                     chunk_bytes=chunk_bytes, transfer_filter=lambda s: s in devices, security=sec.get("server"),
                     **server_opts)
    channels = {}
    for d in devices:
        t = broker.connect(topics.mqtt_client_id(FED, d))
        t.subscribe(topics.agent_filters(FED, d))
        channels[d] = Channel(t, node_id=d, side="agent", federation=FED, ledger=Ledger(tmp_path / f"{d}.sqlite"),
                              chunk_bytes=1000, resend_after_s=0.0, security=sec.get(d))
    return server, channels


def _drain(ch: Channel, *, lose: tuple[int, ...] = ()) -> list:
    """Accept everything delivered to ``ch``, except the chunks whose index is in ``lose`` (lost
    on the way: never accepted, never ledgered); returns what accept returned."""
    got = []
    while (inc := ch.transport.get(0.0)) is not None:
        body = decode(inc.payload).envelope.body
        if isinstance(body, Chunk) and body.index in lose:
            continue
        got.append(ch.accept(inc))
    return got


def _chunk_rows_received(ch: Channel) -> list:
    return [r for r in ch.ledger.rows("event='received' AND chunk_index IS NOT NULL")]


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_a_broadcast_chunk_asked_for_again_reaches_only_the_device_that_asked(tmp_path: Path, signed: bool) -> None:
    """The server broadcasts round 1's global (5 chunks) to 3 devices; client-002 loses chunk 2
    and asks for it. The server publishes it again on client-002's own topic
    (``down/client-002/global``, sealed for that topic when signing is on), ledgered with
    ``client`` client-002: client-002 completes the global (reported on the broadcast topic it
    began on) and the other two devices receive nothing more. Before, the chunk went again on
    ``down/global``, and each of the 3 devices downloaded it (a field test: 5,933 B per device)."""
    server, devices = _fleet(tmp_path, signed=signed)
    bcast = topics.down(FED, Kind.GLOBAL)
    server.send(bcast, _global(), round=1)
    first = {d: _drain(ch, lose=(2,) if d == "client-002" else ()) for d, ch in devices.items()}
    assert [type(g).__name__ for g in first["client-001"]] == ["NoneType"] * 4 + ["Received"]
    assert first["client-002"] == [None] * 4
    before = {d: len(_chunk_rows_received(ch)) for d, ch in devices.items()}
    assert before == {"client-001": 5, "client-002": 4, "client-003": 5}

    devices["client-002"]._maintain()  # stalled: asks for chunk 2
    inc = server.transport.get(0.0)
    assert inc is not None and inc.topic == topics.up(FED, "client-002", Kind.RESEND)
    assert server.accept(inc) is None and server.resent_chunks == 1
    after = {d: _drain(ch) for d, ch in devices.items()}

    assert after["client-001"] == [] and after["client-003"] == []  # nothing more downloaded
    (done,) = after["client-002"]
    assert done.envelope.kind is Kind.GLOBAL and done.envelope.round == 1 and done.topic == bcast
    np.testing.assert_array_equal(done.envelope.body.tensors[0], _global().tensors[0])
    assert {d: len(_chunk_rows_received(ch)) - before[d] for d, ch in devices.items()} == \
        {"client-001": 0, "client-002": 1, "client-003": 0}
    own = topics.down_to(FED, "client-002", Kind.GLOBAL)
    (row,) = _chunk_rows_received(devices["client-002"])[4:]
    # the same chunk record as client-001's chunk 2 (a new envelope; its seq is one byte still),
    # sealed alike when signed: the same payload; the PUBLISH (MQTT 3.1.1, QoS 1): 1 byte of fixed
    # header, 2 of remaining length (a payload of ~1,100 bytes), 2 of topic length, the topic, 2 of
    # packet id, the payload
    ref = next(r for r in _chunk_rows_received(devices["client-001"]) if r.chunk_index == 2)
    assert (row.topic, row.chunk_index, row.client, row.payload_bytes) == (own, 2, "client-002", ref.payload_bytes)
    assert row.wire_bytes == 1 + 2 + 2 + len(own) + 2 + ref.payload_bytes
    assert row.wire_bytes - ref.wire_bytes == len("client-002/")  # the longer topic, nothing else
    (sent,) = [r for r in server.ledger.rows("event='sent' AND chunk_index IS NOT NULL")][5:]
    assert (sent.topic, sent.client, sent.chunk_index, sent.wire_bytes) == (own, "client-002", 2, row.wire_bytes)
    assert not any(r.event == "rejected" for ch in devices.values() for r in ch.ledger.rows())


def test_two_devices_missing_one_broadcast_chunk_each_get_their_own_copy(tmp_path: Path) -> None:
    """client-002 and client-003 both lose chunk 2 and ask for it within the same second: each
    gets one copy on its own topic (the once-a-second limit on a chunk asked for again is per
    requester), client-001 none; each requester's budget pays for its own copy only."""
    server, devices = _fleet(tmp_path, resend_burst_bytes=1000, resend_rate_bytes_s=0.0)
    server.send(topics.down(FED, Kind.GLOBAL), _global(), round=1)
    for d, ch in devices.items():
        _drain(ch, lose=(2,) if d != "client-001" else ())
    for d in ("client-002", "client-003"):
        devices[d]._maintain()
    while (inc := server.transport.get(0.0)) is not None:
        assert server.accept(inc) is None
    assert server.resent_chunks == 2
    after = {d: _drain(ch) for d, ch in devices.items()}
    assert after["client-001"] == []
    for d in ("client-002", "client-003"):
        (done,) = after[d]
        assert done.envelope.kind is Kind.GLOBAL
        rows = _chunk_rows_received(devices[d])
        assert len(rows) == 5 and rows[-1].topic == topics.down_to(FED, d, Kind.GLOBAL)
    # each requester's budget of 1,000 bytes paid for its own 1,000-byte chunk: both are spent now
    tid = bytes.fromhex(_chunk_rows_received(devices["client-002"])[-1].transfer_id)
    for n, d in enumerate(("client-002", "client-003"), start=10):
        item = server.accept(_request(d, tid, [4], seq=n))
        assert isinstance(item, Rejected) and "rate limit" in item.reason and "0 left of 1,000" in item.reason


def test_a_broadcast_chunk_too_large_for_the_requesters_own_topic_goes_on_the_broadcast_topic(
        tmp_path: Path) -> None:
    """A global broadcast under the devices' own packet limit (900 bytes) is cut so that its full
    chunks fill it; on a device's own topic, 28 bytes longer for a 27-character id, such a chunk
    would exceed it (and a packet above a device's limit never reaches it), so it goes again on
    the broadcast topic, to every device, as before; the short last chunk fits and goes to the
    device that asked alone."""
    ids = tuple(f"greenhouse-sensor-node-000{i}" for i in (1, 2, 3))
    server, devices = _fleet(tmp_path, devices=ids)
    bcast = topics.down(FED, Kind.GLOBAL)
    server.send(bcast, _global(), round=1, max_packet_bytes=900)
    sent = server.ledger.rows("event='sent' AND chunk_index IS NOT NULL")
    count = len(sent)
    # every PUBLISH within 900 bytes (MQTT 5 framing: 1 byte more than the 3.1.1 rows count), the
    # full ones within the 28 bytes the longer topic adds
    assert count == 6 and all(r.wire_bytes + 1 <= 900 for r in sent)
    assert all(r.wire_bytes + 1 + len(ids[1]) + 1 > 900 for r in sent[:-1])
    assert sent[-1].wire_bytes + 1 + len(ids[1]) + 1 <= 900
    asker = devices[ids[1]]
    for ch in devices.values():
        _drain(ch, lose=(1, count - 1) if ch is asker else ())
    asker._maintain()
    inc = server.transport.get(0.0)
    assert inc is not None and server.accept(inc) is None
    assert (server.resent_chunks, server.resent_on_broadcast) == (2, 1)
    after = {d: _drain(ch) for d, ch in devices.items()}
    assert after[ids[0]] == [None] and after[ids[2]] == [None]  # a duplicate of chunk 1 each
    rows = _chunk_rows_received(asker)[count - 2:]
    assert [(r.chunk_index, r.topic) for r in rows] == \
        [(count - 1, topics.down_to(FED, ids[1], Kind.GLOBAL)), (1, bcast)]  # those that fit go first
    assert [type(g).__name__ for g in after[ids[1]]] == ["NoneType", "Received"]
    assert after[ids[1]][1].topic == bcast


def test_a_transfer_sent_to_one_device_is_answered_on_its_own_topic_as_before(tmp_path: Path) -> None:
    ch, tr, ledger = _server(tmp_path)
    own = topics.down_to(FED, "client-002", Kind.GLOBAL)
    ch.send(own, _global(), round=1, recipient="client-002")
    tid = decode(tr.published[0][1]).envelope.body.transfer_id
    tr.published.clear()
    assert ch.accept(_request("client-002", tid, [0, 4])) is None
    assert [t for t, _ in tr.published] == [own, own] and ch.resent_on_broadcast == 0
    resent = ledger.rows("event='sent' AND chunk_index IS NOT NULL")[5:]
    assert [(r.topic, r.client, r.chunk_index) for r in resent] == [(own, "client-002", 0), (own, "client-002", 4)]


def test_a_chunk_on_a_topic_of_another_kind_than_its_transfer_is_refused(tmp_path: Path) -> None:
    """Chunks of one transfer may come on the broadcast topic and on the device's own topic of
    the same kind; one on a topic of another kind is a ``rejected`` chunk (its bytes were
    received), and the transfer still completes from the right chunks."""
    server, str_ = _server(tmp_path)[:2]
    server.send(topics.down(FED, Kind.GLOBAL), _global(), round=1)
    chunks = list(str_.published)
    agent = Channel(_Recorder(), node_id="client-001", side="agent", federation=FED,
                    ledger=Ledger(tmp_path / "a.sqlite"), chunk_bytes=1000)
    now = time.monotonic()
    assert agent.accept(Incoming(chunks[0][0], chunks[0][1], 1, False, now)) is None
    wrong = agent.accept(Incoming(topics.down_to(FED, "client-001", Kind.ROUND_START), chunks[1][1], 1, False, now))
    assert isinstance(wrong, Rejected) and "a topic of another kind" in wrong.reason
    got = [agent.accept(Incoming(t, p, 1, False, now)) for t, p in chunks[1:]]
    assert got[-1].envelope.kind is Kind.GLOBAL and got[-1].topic == topics.down(FED, Kind.GLOBAL)


# ---------------------------------------------------------------------------------------------
# A broadcast cut with room for the devices' own topics (Channel.send's budget_topic), at the
# rpi4 profile's limit (firmware_profiles/rpi4.toml: max_packet_bytes = chunk_bytes = 131,072)

RPI4_LIMIT = 131_072
IDS20 = tuple(f"rpi4-field-unit-{i:04d}" for i in (1, 2, 3))  # 20 characters each


def _big_global() -> Global:
    return Global((np.arange(100_000, dtype=np.float32),), {"manifest_hash": "0" * 16})  # 400,000 raw bytes


# By hand, from the chunk budget formula (PROTOCOL.md §5; the probe's seq and timestamp_ms uint64,
# index, count, offset, total_bytes uint32): sender "server" (str 7 bytes), round 1 (1 byte), data
# D ≥ 65,536 (bin32: D + 5), body(D) = 73 + D + 5 (bin32 again: + 5), so payload(D) = 1 + 1 + 1
# + 1 + 7 + 9 + 9 + (D + 83) = D + 112; the PUBLISH under a recipient's limit is sized for MQTT 5
# (QoS 1: 2 bytes topic length, 2 packet id, 1 properties length; remaining length ≥ 16,384: 3
# bytes): packet(D) = 1 + 3 + 2 + len(topic) + 2 + 1 + payload(D) = D + 121 + len(topic).
BCAST_TOPIC_BYTES = len("fedfleet/v1/fed-resend/down/global")  # 34
OWN_TOPIC_BYTES = BCAST_TOPIC_BYTES + len("/rpi4-field-unit-0002")  # 55
D_ROOM = RPI4_LIMIT - 121 - OWN_TOPIC_BYTES  # 130,896: cut for down/{20-character id}/global
D_BCAST = RPI4_LIMIT - 121 - BCAST_TOPIC_BYTES  # 130,917: cut for down/global alone (no room)


def _bin(n: int) -> int:
    """msgpack ``bin`` of ``n`` bytes: bin8, bin16 or bin32 header and the bytes."""
    return n + 2 if n < 256 else n + 3 if n < 65_536 else n + 5


def _real_packet(d: int, index: int, topic_bytes: int) -> int:
    """The ledger's ``wire_bytes`` (MQTT 3.1.1 framing, as the memory transport counts: the limit
    is checked for MQTT 5, 1 byte more) of a real chunk with ``d`` bytes of data at ``index`` of a
    4-chunk transfer of round 1 from "server" (seq < 128: 1 byte; timestamp_ms uint64: 9), offset
    0 (1 byte) or ≥ 65,536 (uint32: 5), total_bytes uint32: by hand, as above."""
    body = 1 + 18 + 1 + 1 + (1 if index == 0 else 5) + 5 + 34 + _bin(d)
    payload = 1 + 1 + 1 + 1 + 7 + 1 + 9 + _bin(body)
    remaining = 2 + topic_bytes + 2 + payload
    return 1 + (2 if remaining < 16_384 else 3) + remaining


@pytest.mark.parametrize("room", [True, False], ids=["room", "no-room"])
def test_a_broadcast_cut_with_room_for_20_character_ids_is_answered_on_the_askers_topic(
        tmp_path: Path, room: bool) -> None:
    """The server broadcasts a 400,074-byte global under the rpi4 limit to three devices whose ids
    have 20 characters; the second loses chunks 0, 1 and 3 and asks for them. Cut with room for
    ``down/{id}/global`` (``budget_topic``), every full chunk carries 21 bytes less data
    (130,896, not 130,917: still 4 chunks) and every chunk asked for goes to the device alone, on
    its own topic, each PUBLISH within the limit: nothing on the broadcast topic. Cut without the
    room (as before), the full chunks' PUBLISH on the 21-byte longer topic would exceed the limit
    by 5 (chunk 1) and 1 byte (chunk 0, whose offset 0 is 4 bytes shorter): they go on the broadcast
    topic again, to every device (``resent_on_broadcast``); only the short last chunk fits."""
    server, devices = _fleet(tmp_path, devices=IDS20, chunk_bytes=RPI4_LIMIT)
    bcast, own = topics.down(FED, Kind.GLOBAL), topics.down_to(FED, IDS20[1], Kind.GLOBAL)
    assert (len(bcast), len(own)) == (BCAST_TOPIC_BYTES, OWN_TOPIC_BYTES)
    room_topic = topics.down_to(FED, max(IDS20, key=len), Kind.GLOBAL) if room else ""
    server.send(bcast, _big_global(), round=1, max_packet_bytes=RPI4_LIMIT, chunk_bytes=RPI4_LIMIT,
                budget_topic=room_topic)
    d = D_ROOM if room else D_BCAST
    sent = server.ledger.rows("event='sent' AND chunk_index IS NOT NULL")
    total = 400_074  # the envelope of the global (its timestamp_ms: uint64) and 400,000 raw bytes
    assert len(sent) == -(-total // d) == 4
    assert [r.body_bytes for r in sent] == [d, d, d, total - 3 * d]  # 7,386 or 7,323 in the last
    assert [r.wire_bytes for r in sent] == [_real_packet(r.body_bytes, i, BCAST_TOPIC_BYTES)
                                            for i, r in enumerate(sent)]
    assert all(r.wire_bytes + 1 <= RPI4_LIMIT for r in sent)

    asker = devices[IDS20[1]]
    for ch in devices.values():
        _drain(ch, lose=(0, 1, 3) if ch is asker else ())
    asker._maintain()
    inc = server.transport.get(0.0)
    assert inc is not None and decode(inc.payload).envelope.body.indices == (0, 1, 3)
    assert server.accept(inc) is None
    after = {dev: _drain(ch) for dev, ch in devices.items()}
    rows = _chunk_rows_received(asker)[1:]  # after chunk 2 of the broadcast
    on_own = [(r.chunk_index, r.wire_bytes) for r in rows if r.topic == own]
    own_packets = {i: _real_packet(d if i < 3 else total - 3 * d, i, OWN_TOPIC_BYTES) for i in (0, 1, 3)}
    if room:
        # 131,051 / 131,055 / 7,540 bytes (MQTT 5: 1 more), all within 131,072; nobody else downloads
        assert server.resent_on_broadcast == 0 and server.resent_chunks == 3
        assert on_own == [(i, own_packets[i]) for i in (0, 1, 3)] == [(0, 131_051), (1, 131_055), (3, 7_540)]
        assert all(n + 1 <= RPI4_LIMIT for _, n in on_own)
        assert after[IDS20[0]] == [] and after[IDS20[2]] == []
    else:
        # on its own topic, chunks 0 and 1 would be 131,073 and 131,077 bytes (MQTT 5): above the limit
        assert (own_packets[0] + 1, own_packets[1] + 1) == (131_073, 131_077)
        assert server.resent_on_broadcast == 2 and server.resent_chunks == 3
        assert on_own == [(3, own_packets[3])]
        assert [(r.chunk_index, r.topic) for r in rows if r.topic != own] == [(0, bcast), (1, bcast)]
        assert after[IDS20[0]] == after[IDS20[2]] == [None, None]  # a duplicate of chunks 0 and 1 each
    assert [type(g).__name__ for g in after[IDS20[1]]][-1] == "Received"
    assert after[IDS20[1]][-1].envelope.body.tensors[0].shape == (100_000,)


def test_a_device_whose_id_is_longer_than_the_room_still_gets_its_chunks_on_the_broadcast_topic(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The broadcast was cut with room for 20-character ids (the devices joined when it went out);
    a device with a 45-character id (one that joined later) asks for chunks 0 and 1: on its own
    topic, 25 bytes longer than the room, their PUBLISH would be 131,077 and 131,081 bytes (MQTT 5),
    above the 131,072-byte limit, so they go on the broadcast topic as before, counted and said at
    INFO; the short last chunk fits and goes to it alone."""
    late = "greenhouse-sensor-node-with-a-long-name-00004"
    assert len(late) == 45
    server, devices = _fleet(tmp_path, devices=(*IDS20, late), chunk_bytes=RPI4_LIMIT)
    bcast, own = topics.down(FED, Kind.GLOBAL), topics.down_to(FED, late, Kind.GLOBAL)
    server.send(bcast, _big_global(), round=1, max_packet_bytes=RPI4_LIMIT, chunk_bytes=RPI4_LIMIT,
                budget_topic=topics.down_to(FED, IDS20[0], Kind.GLOBAL))
    assert [r.body_bytes for r in server.ledger.rows("event='sent' AND chunk_index IS NOT NULL")][0] == D_ROOM
    total = 400_074  # the envelope of the global (its timestamp_ms: uint64) and 400,000 raw bytes
    assert [_real_packet(D_ROOM, i, len(own)) + 1 for i in (0, 1)] == [131_077, 131_081]
    assert _real_packet(total - 3 * D_ROOM, 3, len(own)) + 1 <= RPI4_LIMIT
    asker = devices[late]
    for ch in devices.values():
        _drain(ch, lose=(0, 1, 3) if ch is asker else ())
    asker._maintain()
    inc = server.transport.get(0.0)
    with caplog.at_level("INFO", logger="protocol.channel"):
        assert server.accept(inc) is None
    assert (server.resent_chunks, server.resent_on_broadcast) == (3, 2)
    assert any("chunks 1-2 of 4" in r.getMessage() and late in r.getMessage() and r.levelname == "INFO"
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    after = {dev: _drain(ch) for dev, ch in devices.items()}
    assert all(after[dev] == [None, None] for dev in IDS20)  # chunks 0 and 1 again, at every device
    rows = _chunk_rows_received(asker)[1:]
    assert [(r.chunk_index, r.topic) for r in rows] == [(3, own), (0, bcast), (1, bcast)]
    assert after[late][-1].envelope.kind is Kind.GLOBAL
