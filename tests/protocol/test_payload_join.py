"""protocol._join: the one copy of an encode, built in place on huge pages from 4 MiB.

Every payload is compared with ``b"".join`` of the same segments (the encoder's join before the
in-place path) and, for whole messages, with msgpack's own packing of the nested values: the bytes
on the wire are the same whichever path built them. Whether the kernel actually backs the payload
with huge pages depends on its settings and free memory, so it is not asserted here (the codec
part of ``tools/bench_round.py`` measures the speed)."""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import numpy as np
import pytest

from protocol import _join, topics
from protocol.channel import Channel, Received
from protocol.memory_transport import MemoryBroker
from protocol.messages import Envelope, Kind, Status, Update, encode, payload_sha256
from protocol.tensors import encode_tensor

CLIENT = "client-007"
FED = "fed-join"

needs_in_place = pytest.mark.skipif(_join._API is None, reason="needs CPython, ctypes and MADV_HUGEPAGE (Linux)")


def segments_of(total: int, seed: int) -> list[bytes | memoryview]:
    """Segments of random lengths (1 B .. 1.5 MiB) summing to ``total`` bytes: bytes and views on
    a uint8 array, alternating, so that segment edges fall anywhere across 2 MiB boundaries."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, total, dtype=np.uint8)
    out: list[bytes | memoryview] = []
    at = 0
    while at < total:
        n = min(int(rng.integers(1, 3 << 19)), total - at)
        piece = memoryview(data[at:at + n]).cast("B")
        out.append(piece if len(out) % 2 else piece.tobytes())
        at += n
    return out


@needs_in_place
@pytest.mark.parametrize("total", [0, 1, 4095, 2 << 20, (2 << 20) + 1, _join.HUGE_FROM - 1, _join.HUGE_FROM,
                                   _join.HUGE_FROM + 1, 9_000_001])
def test_in_place_join_equals_bytes_join(total: int) -> None:
    segs = segments_of(total, seed=total)
    out = _join.join_in_place(segs, total)
    assert type(out) is bytes and len(out) == total
    assert out == b"".join(segs)


@pytest.mark.parametrize("total", [_join.HUGE_FROM - 1, _join.HUGE_FROM, 6_000_000])
def test_join_segments_equals_bytes_join_each_side_of_the_threshold(total: int) -> None:
    segs = segments_of(total, seed=7)
    out = _join.join_segments(segs, total)
    assert type(out) is bytes and out == b"".join(segs)


@needs_in_place
@pytest.mark.parametrize("claimed", [99, 101])
def test_a_total_that_is_not_the_segments_length_is_refused(claimed: int) -> None:
    segs: list[bytes | memoryview] = [b"x" * 40, memoryview(np.zeros(60, np.uint8)).cast("B")]  # 100 bytes
    with pytest.raises(ValueError, match="total"):
        _join.join_in_place(segs, claimed)


def test_without_the_platform_pieces_payloads_are_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_join, "_API", None)
    segs = segments_of(_join.HUGE_FROM + 10, seed=3)
    assert _join.join_segments(segs, _join.HUGE_FROM + 10) == b"".join(segs)
    with pytest.raises(RuntimeError, match="MADV_HUGEPAGE"):
        _join.join_in_place(segs, _join.HUGE_FROM + 10)


@needs_in_place
def test_a_madvise_failure_is_logged_once_and_later_payloads_are_joined(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    assert _join._API is not None
    new, address, _madvise, advice = _join._API
    calls: list[tuple[int, int, int]] = []

    def failing(start: int, length: int, adv: int) -> int:
        calls.append((start, length, adv))
        return -1

    monkeypatch.setattr(_join, "_API", (new, address, failing, advice))
    segs = segments_of(6_000_000, seed=5)
    with caplog.at_level(logging.WARNING, logger="protocol._join"):
        first = _join.join_segments(segs, 6_000_000)
        second = _join.join_segments(segs, 6_000_000)
    assert first == second == b"".join(segs)
    assert len(calls) == 1 and calls[0][2] == advice and calls[0][0] % (2 << 20) == 0
    assert _join._API is None
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "4 KiB pages" in caplog.records[0].message


def reference_update_payload(env: Envelope) -> bytes:
    """msgpack's packing of an update's nested values: the body packed whole, then the envelope."""
    b = env.body
    assert isinstance(b, Update)
    body = msgpack.packb([[encode_tensor(t) for t in b.tensors], b.num_samples, float(b.train_loss),
                          dict(b.metrics), bool(b.delta)], use_bin_type=True)
    return msgpack.packb([env.version, int(env.kind), env.round, env.sender, env.seq, env.timestamp_ms, body],
                         use_bin_type=True)


def update_env(n_values: int) -> Envelope:
    rng = np.random.default_rng(n_values)
    body = Update(tensors=(rng.standard_normal(n_values, dtype=np.float32), np.arange(7, dtype=np.int64)),
                  num_samples=12, train_loss=0.25, metrics={"train_seconds": 1.5})
    return Envelope(round=3, sender=CLIENT, seq=9, body=body, timestamp_ms=1_700_000_000_123)


@needs_in_place
@pytest.mark.parametrize("n_values", [10_000, 1_600_000])  # 40 KB and 6.4 MB: each side of HUGE_FROM
def test_encode_writes_the_same_bytes_by_join_and_in_place(n_values: int, monkeypatch: pytest.MonkeyPatch) -> None:
    env = update_env(n_values)
    default = encode(env).payload
    monkeypatch.setattr(_join, "HUGE_FROM", 0)  # every payload in place
    in_place = encode(env).payload
    monkeypatch.setattr(_join, "HUGE_FROM", 1 << 62)  # every payload by b"".join
    joined = encode(env).payload
    assert type(in_place) is bytes and type(joined) is bytes and type(default) is bytes
    assert in_place == joined == default == reference_update_payload(env)


def test_a_small_message_is_unchanged_by_the_in_place_path(monkeypatch: pytest.MonkeyPatch) -> None:
    env = Envelope(round=0, sender=CLIENT, seq=1, body=Status("online", "x"), timestamp_ms=5)
    want = msgpack.packb([1, int(Kind.STATUS), 0, CLIENT, 1, 5, msgpack.packb(["online", "x"], use_bin_type=True)],
                         use_bin_type=True)
    if _join._API is not None:
        monkeypatch.setattr(_join, "HUGE_FROM", 0)
    assert encode(env).payload == want


def channel_pair(chunk_bytes: int) -> tuple[Channel, Channel, Any]:
    broker = MemoryBroker()
    agent_tr, server_tr = broker.connect(CLIENT), broker.connect("server")
    server_tr.subscribe(topics.server_filters(FED))
    agent_tr.subscribe(topics.agent_filters(FED, CLIENT))
    agent = Channel(agent_tr, node_id=CLIENT, side="agent", federation=FED, ledger=None, chunk_bytes=chunk_bytes)
    server = Channel(server_tr, node_id="server", side="server", federation=FED, ledger=None)
    return agent, server, agent_tr


def test_an_update_above_the_threshold_round_trips_through_chunks_over_the_memory_broker() -> None:
    env = update_env(1_600_000)
    agent, server, agent_tr = channel_pair(chunk_bytes=1 << 20)
    enc = agent.send(topics.up(FED, CLIENT, Kind.UPDATE), env.body, round=3)
    assert len(enc.payload) > _join.HUGE_FROM and type(enc.payload) is bytes
    count = -(-len(enc.payload) // (1 << 20))
    assert agent_tr.sent_count == count
    got = [server.receive(0.0) for _ in range(count + 1)]
    received = [g for g in got if g is not None]
    assert len(received) == 1 and isinstance(received[0], Received)  # one message out of the chunks
    whole = received[0]
    assert whole.sha256 == payload_sha256(enc.payload)  # the reassembled payload is the sent one
    sent = whole.decoded.envelope
    assert enc.payload == reference_update_payload(Envelope(round=3, sender=CLIENT, seq=sent.seq, body=env.body,
                                                            timestamp_ms=sent.timestamp_ms))
    body = sent.body
    assert isinstance(body, Update) and isinstance(env.body, Update)
    for a, b in zip(body.tensors, env.body.tensors, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert (body.num_samples, body.train_loss, dict(body.metrics)) == (12, 0.25, {"train_seconds": 1.5})
