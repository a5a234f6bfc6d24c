"""Chunked transfers over a real broker: the broker's maximum packet size is enforced by fedfleet,
lost chunks are asked for again, duplicates are idempotent, stalled transfers expire."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.federation import small_config

from broker_server.embedded_broker import EmbeddedBroker
from broker_server.simulate import simulate
from protocol import topics
from protocol.channel import Channel, Received
from protocol.ledger import Ledger
from protocol.messages import Chunk, Kind, Update, decode
from protocol.transport import MqttTransport

FED = "fed-xfer"


def _pair(broker: EmbeddedBroker, tmp_path: Path, **opts):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    a_tr = MqttTransport(f"{FED}-a-{time.time_ns()}", broker.host, broker.port)
    s_tr = MqttTransport(f"{FED}-s-{time.time_ns()}", broker.host, broker.port)
    a_tr.connect()
    s_tr.connect()
    agent = Channel(a_tr, node_id="client-001", side="agent", federation=FED, ledger=ledger, **opts)
    server = Channel(s_tr, node_id="server", side="server", federation=FED, ledger=ledger, **opts)
    s_tr.subscribe(topics.server_filters(FED))
    a_tr.subscribe(topics.agent_filters(FED, "client-001"))
    time.sleep(0.3)
    return agent, server, ledger


def _update(n: int = 50_000) -> Update:
    rng = np.random.default_rng(0)
    return Update(tensors=(rng.standard_normal(n).astype(np.float32),), num_samples=7, train_loss=0.5)


def test_lost_chunk_is_resent_and_duplicates_are_idempotent(tmp_path: Path) -> None:
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "b") as broker:
        agent, server, ledger = _pair(broker, tmp_path, chunk_bytes=30_000, resend_after_s=0.5)
        real_publish = agent.transport.publish
        dropped = []

        def lossy_publish(topic, payload, **kw):
            body = decode(payload).envelope.body
            if isinstance(body, Chunk) and body.index == 2 and not dropped:
                dropped.append(body.index)  # lost on the way: never reaches the broker
                return
            real_publish(topic, payload, **kw)
            if isinstance(body, Chunk) and body.index == 0:
                real_publish(topic, payload, **kw)  # a QoS 1 style duplicate

        agent.transport.publish = lossy_publish
        upd = _update()
        enc = agent.send(topics.up(FED, "client-001", Kind.UPDATE), upd, round=1)
        got = None
        deadline = time.monotonic() + 15
        while got is None and time.monotonic() < deadline:
            # the agent must keep receiving to answer the server's resend request
            item = server.receive(0.2)
            agent.receive(0.05)
            if isinstance(item, Received):
                got = item
        assert got is not None, "transfer did not complete"
        np.testing.assert_array_equal(got.envelope.body.tensors[0], upd.tensors[0])
        assert got.sha256 == __import__("hashlib").sha256(enc.payload).digest()
        assert dropped == [2] and agent.resent_chunks == 1
        assert server.reassembler.duplicates >= 1
        ledger.flush()
        kinds = [r.kind for r in ledger.rows("side='server' AND event='sent'")]
        assert "resend" in kinds
        logical = ledger.rows("event='message' AND side='server'")
        assert len(logical) == 1 and logical[0].payload_bytes == len(enc.payload)
        agent.transport.close()
        server.transport.close()
        ledger.close()


def test_stalled_transfer_expires_and_is_reported(tmp_path: Path) -> None:
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "b") as broker:
        agent, server, ledger = _pair(broker, tmp_path, chunk_bytes=30_000, resend_after_s=0.3,
                                      transfer_ttl_s=1.0)
        real_publish = agent.transport.publish

        def drop_last(topic, payload, **kw):
            body = decode(payload).envelope.body
            if isinstance(body, Chunk) and body.index == body.count - 1:
                return  # always lost, resends too
            real_publish(topic, payload, **kw)

        agent.transport.publish = drop_last
        agent.send(topics.up(FED, "client-001", Kind.UPDATE), _update(), round=1)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4:
            assert not isinstance(server.receive(0.2), Received)
            agent.receive(0.05)
        assert server.incomplete_transfers == 1
        assert server.reassembler.buffered_bytes == 0
        ledger.flush()
        rows = ledger.rows("reason LIKE 'incomplete transfer%'")
        assert len(rows) == 1 and rows[0].sender == "client-001"
        agent.transport.close()
        server.transport.close()
        ledger.close()


@pytest.mark.mosquitto
def test_broker_max_packet_size_is_enforced_by_chunking(tmp_path: Path) -> None:
    """Mosquitto drops any client that sends a packet above max_packet_size (paho ignores the
    limit). With [protocol] max_packet_bytes set, the 423 KB model goes in chunks whose PUBLISH
    packets all fit, and no client is ever disconnected (one CONNECT per connection)."""
    from helpers.brokers import require_mosquitto

    require_mosquitto()
    limit = 16_384  # the digits model is 54,824 bytes of float32: every global and update is chunked
    cfg = small_config(protocol={"max_packet_bytes": limit})
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "b", max_packet_size=limit) as broker:
        res = simulate(cfg, broker_url=broker.url, run_dir=tmp_path / "run")
    assert res.rounds_completed == 2
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["clients_reported"] == 3 for m in metrics)
    db = sqlite3.connect(tmp_path / "run" / "ledger.sqlite")
    sizes = db.execute("SELECT MAX(mqtt_header_bytes + topic_bytes + payload_bytes) FROM messages "
                       "WHERE event IN ('sent','received') AND reason != 'control'").fetchone()[0]
    chunked = db.execute("SELECT kind, COUNT(DISTINCT transfer_id) FROM messages WHERE chunk_index IS NOT NULL "
                         "AND event='sent' GROUP BY kind").fetchall()
    connects = db.execute("SELECT node, COUNT(*) FROM messages WHERE kind='CONNECT' GROUP BY node").fetchall()
    db.close()
    assert sizes <= limit
    assert dict(chunked) == {"global": 2, "update": 6}  # every broadcast and every update
    assert all(n == 1 for _, n in connects) and len(connects) == 4
