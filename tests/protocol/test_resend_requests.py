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
