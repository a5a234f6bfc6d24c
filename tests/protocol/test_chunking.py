"""protocol.chunking: split / reassemble, exact chunk budgets, bounds, expiry, the resend cache."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import topics
from protocol.channel import Channel, Received, Rejected
from protocol.chunking import (
    DEFAULT_CHUNK_BYTES,
    ChunkError,
    IncompleteTransfer,
    Reassembler,
    TransferCache,
    chunk_data_budget,
    needs_chunking,
    split,
)
from protocol.errors import ProtocolError
from protocol.memory_transport import MemoryBroker, MemoryTransport
from protocol.messages import (
    MAX_CHUNKS,
    MAX_PAYLOAD_BYTES,
    Chunk,
    Envelope,
    Kind,
    Update,
    decode,
    encode,
)
from protocol.mqtt_bytes import MQTT_V5, max_payload_for, publish_size

TOPIC = "fedfleet/v1/fed-a/up/client-007/update"
SENDER = "client-007"
CB = 1000
TID = bytes(range(16))


def payload_of(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def feed(r: Reassembler, sender: str, chunks: list[Chunk]) -> list[bytes]:
    """Add every chunk; return the payloads that came out (in order)."""
    return [out for c in chunks if (out := r.add(sender, c)) is not None]


# --------------------------------------------------------------------------------------------
# split


@pytest.mark.parametrize("n", [0, 1, CB - 1, CB, CB + 1, 10 * CB + 3])
def test_split_layout(n: int) -> None:
    p = payload_of(n)
    chunks = split(p, chunk_bytes=CB, transfer_id=TID)
    assert len(chunks) == max(1, -(-n // CB))
    assert b"".join(c.data for c in chunks) == p
    for i, c in enumerate(chunks):
        assert (c.transfer_id, c.index, c.count, c.total_bytes) == (TID, i, len(chunks), n)
        assert c.offset == i * CB
        assert c.sha256 == hashlib.sha256(p).digest()
        # no copy: one chunk carries the payload itself, several carry read-only views on it
        assert c.data is p if len(chunks) == 1 else (type(c.data) is memoryview and c.data.obj is p)
        assert memoryview(c.data).readonly
        assert len(c.data) == (CB if i < len(chunks) - 1 else n - i * CB)


def test_split_copies_a_mutable_payload_once() -> None:
    p = bytearray(payload_of(3 * CB))
    chunks = split(p, chunk_bytes=CB, transfer_id=TID)
    p[0] ^= 0xFF  # a later write to the caller's buffer never reaches the chunks
    assert bytes(chunks[0].data) == payload_of(3 * CB)[:CB]


def test_empty_payload_is_one_chunk_of_zero_bytes() -> None:
    (c,) = split(b"", chunk_bytes=CB, transfer_id=TID)
    assert (c.index, c.count, c.offset, c.total_bytes, c.data) == (0, 1, 0, 0, b"")
    r = Reassembler()
    assert r.add(SENDER, c) == b""
    assert r.completed == 1 and r.buffered_bytes == 0


def test_split_draws_a_random_transfer_id_and_accepts_any_bytes_like() -> None:
    a, b = split(b"xy", chunk_bytes=1), split(b"xy", chunk_bytes=1)
    assert len(a[0].transfer_id) == 16 and a[0].transfer_id == a[1].transfer_id
    assert a[0].transfer_id != b[0].transfer_id
    p = payload_of(2500)
    ref = split(p, chunk_bytes=CB, transfer_id=TID)
    assert split(bytearray(p), chunk_bytes=CB, transfer_id=TID) == ref
    assert split(memoryview(p), chunk_bytes=CB, transfer_id=TID) == ref
    assert split(np.frombuffer(p, dtype=np.uint8), chunk_bytes=CB, transfer_id=TID) == ref


@pytest.mark.parametrize("kwargs", [
    pytest.param({"chunk_bytes": 0}, id="chunk_bytes-0"),
    pytest.param({"chunk_bytes": -5}, id="chunk_bytes-negative"),
    pytest.param({"chunk_bytes": 1.5}, id="chunk_bytes-float"),
    pytest.param({"chunk_bytes": 10, "transfer_id": b"short"}, id="transfer_id-5-bytes"),
])
def test_split_refuses_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        split(b"abc", **kwargs)


def test_split_refuses_more_than_max_chunks() -> None:
    with pytest.raises(ValueError, match="chunks"):
        split(bytes(MAX_CHUNKS + 1), chunk_bytes=1)


# --------------------------------------------------------------------------------------------
# Reassembly round trips


def _orders(chunks: list[Chunk]) -> dict[str, list[Chunk]]:
    shuffled = list(chunks)
    random.Random(7).shuffle(shuffled)
    return {
        "in-order": list(chunks),
        "reversed": list(reversed(chunks)),
        "shuffled": shuffled,
        "each-twice": [c for c in chunks for _ in range(2)],
        "all-then-all-again": list(chunks) + list(chunks),
    }


@pytest.mark.parametrize("order", ["in-order", "reversed", "shuffled", "each-twice", "all-then-all-again"])
@pytest.mark.parametrize("n", [0, 1, CB - 1, CB, CB + 1, 10 * CB + 3])
def test_round_trip(n: int, order: str) -> None:
    p = payload_of(n, seed=n)
    chunks = split(p, chunk_bytes=CB, transfer_id=TID)
    sequence = _orders(chunks)[order]
    r = Reassembler()
    outs = []
    for k, c in enumerate(sequence):
        out = r.add(SENDER, c)
        if out is not None:
            outs.append(out)
            # completes on the chunk that brings the last missing index, never earlier
            assert len({x.index for x in sequence[:k + 1]}) == len(chunks)
    assert outs == [p]
    assert type(outs[0]) is bytes
    assert r.completed == 1
    assert r.duplicates == len(sequence) - len(chunks)
    assert r.rejected == 0
    assert r.buffered_bytes == 0 and r.pending() == []


def test_duplicates_after_completion_are_ignored() -> None:
    p = payload_of(5 * CB + 1)
    chunks = split(p, chunk_bytes=CB, transfer_id=TID)
    r = Reassembler()
    assert feed(r, SENDER, chunks) == [p]
    for c in (chunks[0], chunks[3], chunks[-1]):
        assert r.add(SENDER, c) is None  # QoS 1 redelivery after the transfer finished
    assert r.duplicates == 3 and r.completed == 1
    assert r.buffered_bytes == 0 and r.pending() == []


def test_recently_completed_set_is_bounded() -> None:
    r = Reassembler(recent_completed=1)
    a = split(payload_of(3 * CB, 1), chunk_bytes=CB, transfer_id=b"a" * 16)
    b = split(payload_of(3 * CB, 2), chunk_bytes=CB, transfer_id=b"b" * 16)
    feed(r, SENDER, a)
    feed(r, SENDER, b)
    assert r.add(SENDER, b[0]) is None and r.duplicates == 1 and r.pending() == []
    # ``a`` fell out of the set: its late duplicate opens a new transfer, which will expire
    assert r.add(SENDER, a[0]) is None
    assert [t.transfer_id for t in r.pending()] == [b"a" * 16]


def test_two_senders_with_the_same_transfer_id_do_not_mix() -> None:
    pa, pb = payload_of(4 * CB + 5, 1), payload_of(4 * CB + 5, 2)
    ca = split(pa, chunk_bytes=CB, transfer_id=TID)
    cb = split(pb, chunk_bytes=CB, transfer_id=TID)
    r = Reassembler()
    outs = []
    for x, y in zip(ca, reversed(cb)):
        for sender, c in (("client-a", x), ("client-b", y)):
            out = r.add(sender, c)
            if out is not None:
                outs.append((sender, out))
    assert sorted(outs) == [("client-a", pa), ("client-b", pb)]
    assert r.rejected == 0 and r.duplicates == 0


def test_two_senders_same_transfer_id_different_sizes() -> None:
    pa, pb = payload_of(3 * CB, 1), payload_of(7 * CB + 1, 2)
    r = Reassembler()
    ca, cb = split(pa, chunk_bytes=CB, transfer_id=TID), split(pb, chunk_bytes=CB, transfer_id=TID)
    assert feed(r, "client-b", cb[:2]) == []
    assert feed(r, "client-a", ca) == [pa]
    assert feed(r, "client-b", cb[2:]) == [pb]


def test_missing_lists_exactly_the_absent_indices() -> None:
    chunks = split(payload_of(10 * CB + 3), chunk_bytes=CB, transfer_id=TID)
    r = Reassembler()
    got = [0, 2, 3, 7, 10]
    feed(r, SENDER, [chunks[i] for i in got])
    assert r.missing(SENDER, TID) == [1, 4, 5, 6, 8, 9]
    assert r.missing("someone-else", TID) == []
    assert r.missing(SENDER, b"z" * 16) == []
    feed(r, SENDER, [chunks[i] for i in (1, 4, 5, 6, 8)])
    assert r.missing(SENDER, TID) == [9]
    (rec,) = r.pending()
    assert (rec.received, rec.count, rec.total_bytes) == (10, 11, 10 * CB + 3)
    assert rec.bytes_received == 10 * CB + 3 - CB
    feed(r, SENDER, [chunks[9]])
    assert r.missing(SENDER, TID) == []


# --------------------------------------------------------------------------------------------
# Time


def test_expire_reports_the_incomplete_transfer_and_frees_memory() -> None:
    clock = FakeClock()
    r = Reassembler(ttl_s=120.0, clock=clock)
    chunks = split(payload_of(10 * CB + 3), chunk_bytes=CB, transfer_id=TID)
    feed(r, SENDER, chunks[:4])
    assert r.buffered_bytes == 10 * CB + 3
    clock.now_s += 120.0
    assert r.expire() == []  # exactly ttl_s old: not yet
    clock.now_s += 0.5
    (rec,) = r.expire()
    assert rec == IncompleteTransfer(sender=SENDER, transfer_id=TID, received=4, count=11, bytes_received=4 * CB,
                                     total_bytes=10 * CB + 3, age_s=120.5)
    assert r.buffered_bytes == 0 and r.pending() == [] and r.missing(SENDER, TID) == []
    assert r.expired == 1
    assert r.expire() == []


def test_ttl_counts_from_the_last_chunk() -> None:
    clock = FakeClock()
    r = Reassembler(ttl_s=120.0, clock=clock)
    chunks = split(payload_of(3 * CB), chunk_bytes=CB, transfer_id=TID)
    r.add(SENDER, chunks[0])
    clock.now_s += 100
    r.add(SENDER, chunks[1])
    clock.now_s += 100
    assert r.expire() == []
    (rec,) = r.pending()
    assert rec.age_s == 100 and rec.received == 2
    assert feed(r, SENDER, chunks[2:]) == [payload_of(3 * CB)]


def test_pending_lists_the_most_idle_first() -> None:
    clock = FakeClock()
    r = Reassembler(clock=clock)
    a = split(payload_of(2 * CB, 1), chunk_bytes=CB, transfer_id=b"a" * 16)
    b = split(payload_of(2 * CB, 2), chunk_bytes=CB, transfer_id=b"b" * 16)
    r.add(SENDER, b[0])
    clock.now_s += 5
    r.add(SENDER, a[0])
    clock.now_s += 1
    assert [(t.transfer_id, t.age_s) for t in r.pending()] == [(b"b" * 16, 6), (b"a" * 16, 1)]


def test_a_transfer_of_the_same_payload_supersedes_one_in_progress() -> None:
    """The sender sent the payload again as a new transfer (smaller chunks after a refusal): the
    old transfer is dropped without a report and its late chunks are ignored; a third transfer of
    the payload after it completed is ignored as well. Other payloads are not touched."""
    clock = FakeClock()
    r = Reassembler(clock=clock)
    payload = payload_of(4 * CB, 7)
    old = split(payload, chunk_bytes=2 * CB, transfer_id=b"o" * 16)
    new = split(payload, chunk_bytes=CB, transfer_id=b"n" * 16)
    other = split(payload_of(2 * CB, 8), chunk_bytes=CB, transfer_id=b"x" * 16)
    r.add(SENDER, old[1])
    r.add(SENDER, other[0])
    r.add("someone-else", split(payload, chunk_bytes=CB, transfer_id=b"s" * 16)[0])  # another sender's own
    assert r.add(SENDER, new[0]) is None
    assert sorted((t.sender, t.transfer_id) for t in r.pending()) == sorted([
        ("someone-else", b"s" * 16), (SENDER, b"n" * 16), (SENDER, b"x" * 16)])
    assert r.superseded == 1 and r.buffered_bytes == 4 * CB + 2 * CB + 4 * CB
    assert r.add(SENDER, old[0]) is None and r.duplicates == 1  # a late chunk of the old one
    assert feed(r, SENDER, new[1:]) == [payload]
    assert feed(r, SENDER, split(payload, chunk_bytes=CB, transfer_id=b"t" * 16)) == []  # arrived already
    assert r.superseded == 2
    clock.now_s += 1000
    assert {t.transfer_id for t in r.expire()} == {b"x" * 16, b"s" * 16}  # the superseded one is no loss


# --------------------------------------------------------------------------------------------
# Bounds


def _claim(total_bytes: int, *, tid: bytes = TID, count: int = 2) -> Chunk:
    """First chunk of a (fake) transfer of ``total_bytes`` in ``count`` equal slices; its claimed
    ``sha256`` is the transfer id's (distinct transfers carry distinct payloads: one of the same
    payload would supersede it)."""
    slice_bytes = -(-total_bytes // count)
    return Chunk(transfer_id=tid, index=0, count=count, offset=0, total_bytes=total_bytes,
                 sha256=hashlib.sha256(tid).digest(), data=bytes(slice_bytes))


def test_total_above_max_transfer_bytes_is_refused_before_allocating() -> None:
    r = Reassembler(max_transfer_bytes=1024 * 1024)
    claim = Chunk(transfer_id=TID, index=0, count=MAX_CHUNKS, offset=0, total_bytes=MAX_PAYLOAD_BYTES,
                  sha256=bytes(32), data=bytes(256))
    tracemalloc.start()
    try:
        with pytest.raises(ChunkError) as info:
            r.add(SENDER, claim)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024  # the 256 MiB buffer was never allocated
    assert info.value.field == "body.total_bytes"
    assert (info.value.sender, info.value.transfer_id) == (SENDER, TID)
    assert r.rejected == 1 and r.buffered_bytes == 0 and r.pending() == []


def test_too_many_concurrent_transfers_are_refused() -> None:
    r = Reassembler(max_transfers=2)
    c1, c2, c3 = (split(payload_of(2 * CB, i), chunk_bytes=CB, transfer_id=bytes([i]) * 16) for i in (1, 2, 3))
    r.add(SENDER, c1[0])
    r.add("other", c2[0])
    with pytest.raises(ChunkError, match="max_transfers"):
        r.add(SENDER, c3[0])
    assert r.rejected == 1 and len(r.pending()) == 2
    assert feed(r, SENDER, c1[1:]) == [payload_of(2 * CB, 1)]  # room again
    assert feed(r, SENDER, c3) == [payload_of(2 * CB, 3)]


def test_transfers_per_sender_are_bounded() -> None:
    r = Reassembler(max_sender_transfers=2)
    for i in (1, 2):
        r.add("greedy", _claim(1000, tid=bytes([i]) * 16))
    # a third from the same sender drops its stalest (the first): it only ever holds its own slots
    r.add("greedy", _claim(1000, tid=b"\x03" * 16))
    assert sorted(t.transfer_id[0] for t in r.pending() if t.sender == "greedy") == [2, 3]
    assert [(t.sender, t.transfer_id[0]) for t in r.expire()] == [("greedy", 1)]  # reported as incomplete
    r.add("modest", _claim(1000, tid=b"\x03" * 16))  # other senders are not affected
    assert len(r.pending()) == 3


def test_total_buffered_bytes_are_bounded() -> None:
    r = Reassembler(max_bytes=10_000)
    r.add(SENDER, _claim(6_000, tid=b"a" * 16))
    with pytest.raises(ChunkError, match="max_bytes"):
        r.add(SENDER, _claim(4_001, tid=b"b" * 16))
    r.add(SENDER, _claim(4_000, tid=b"c" * 16))
    assert r.buffered_bytes == 10_000


def test_expired_transfers_make_room_and_are_still_reported() -> None:
    clock = FakeClock()
    r = Reassembler(max_transfers=1, ttl_s=10, clock=clock)
    r.add(SENDER, _claim(5_000, tid=b"a" * 16))
    clock.now_s += 11
    r.add(SENDER, _claim(3_000, tid=b"b" * 16))  # ``a`` is dropped to make room
    assert r.buffered_bytes == 3_000
    (rec,) = r.expire()
    assert (rec.transfer_id, rec.total_bytes, rec.age_s) == (b"a" * 16, 5_000, 11)
    assert [t.transfer_id for t in r.pending()] == [b"b" * 16]


# --------------------------------------------------------------------------------------------
# Inconsistent and tampered chunks


@pytest.mark.parametrize("change, field", [
    pytest.param({"count": 12}, "body.count", id="count"),
    pytest.param({"sha256": bytes(32)}, "body.sha256", id="sha256"),
    pytest.param({"total_bytes": 11 * CB}, "body.total_bytes", id="total_bytes"),
])
def test_chunks_disagreeing_with_their_transfer_drop_it(change: dict, field: str) -> None:
    p = payload_of(10 * CB + 3)
    chunks = split(p, chunk_bytes=CB, transfer_id=TID)
    r = Reassembler()
    feed(r, SENDER, chunks[:3])
    bad = dataclasses.replace(chunks[3], **change)
    with pytest.raises(ChunkError) as info:
        r.add(SENDER, bad)
    assert isinstance(info.value, ProtocolError)
    assert info.value.field == field
    assert r.rejected == 1 and r.buffered_bytes == 0 and r.pending() == []


def test_different_slice_length_is_refused() -> None:
    p = payload_of(12 * CB)
    r = Reassembler()
    r.add(SENDER, split(p, chunk_bytes=CB, transfer_id=TID)[0])
    other = split(p, chunk_bytes=1200, transfer_id=TID)  # count 10 vs 12: change the count too
    bad = dataclasses.replace(other[1], count=12)
    with pytest.raises(ChunkError):
        r.add(SENDER, bad)
    assert r.pending() == []


def test_tampered_data_fails_the_digest() -> None:
    p = payload_of(5 * CB + 7)
    chunks = split(p, chunk_bytes=CB, transfer_id=TID)
    chunks[2] = dataclasses.replace(chunks[2], data=bytes(len(chunks[2].data)))
    r = Reassembler()
    with pytest.raises(ChunkError) as info:
        feed(r, SENDER, chunks)
    assert info.value.field == "body.sha256"
    assert r.completed == 0 and r.rejected == 1 and r.buffered_bytes == 0 and r.pending() == []


def test_duplicate_index_with_different_bytes_is_refused() -> None:
    chunks = split(payload_of(3 * CB), chunk_bytes=CB, transfer_id=TID)
    r = Reassembler()
    r.add(SENDER, chunks[1])
    with pytest.raises(ChunkError, match="twice"):
        r.add(SENDER, dataclasses.replace(chunks[1], data=bytes(CB)))
    assert r.pending() == [] and r.buffered_bytes == 0


def _good() -> list[Chunk]:
    return split(payload_of(3 * CB + 10), chunk_bytes=CB, transfer_id=TID)  # 4 chunks, last of 10 bytes


@pytest.mark.parametrize("make", [
    pytest.param(lambda: dataclasses.replace(_good()[1], offset=CB + 1), id="offset-off-by-one"),
    pytest.param(lambda: dataclasses.replace(_good()[1], data=bytes(CB - 1)), id="short-middle-chunk"),
    pytest.param(lambda: dataclasses.replace(_good()[0], data=b""), id="empty-middle-chunk"),
    pytest.param(lambda: dataclasses.replace(_good()[3], data=bytes(11)), id="last-chunk-overruns"),
    pytest.param(lambda: dataclasses.replace(_good()[3], offset=3 * CB + 1, data=bytes(9)), id="last-offset-odd"),
    pytest.param(lambda: dataclasses.replace(_good()[3], offset=2 * CB, data=bytes(CB)),
                 id="last-chunk-at-wrong-slice"),
    pytest.param(lambda: dataclasses.replace(_good()[1], index=4), id="index-beyond-count"),
    pytest.param(lambda: dataclasses.replace(_good()[1], count=0), id="count-0"),
    pytest.param(lambda: dataclasses.replace(_good()[1], count=9), id="count-too-large-for-total"),
    pytest.param(lambda: dataclasses.replace(_good()[1], total_bytes=CB), id="total-below-slices"),
    pytest.param(lambda: dataclasses.replace(_good()[1], sha256=b"short"), id="sha256-5-bytes"),
    pytest.param(lambda: dataclasses.replace(_good()[1], transfer_id=b"x"), id="transfer_id-1-byte"),
    pytest.param(lambda: Chunk(TID, 0, 1, 0, 10, bytes(32), bytes(9)), id="single-chunk-short"),
    pytest.param(lambda: Chunk(TID, 0, 1, 1, 10, bytes(32), bytes(9)), id="single-chunk-offset"),
], )
def test_layout_violations_are_refused(make) -> None:
    r = Reassembler()
    with pytest.raises(ChunkError):
        r.add(SENDER, make())
    assert r.rejected == 1 and r.pending() == [] and r.buffered_bytes == 0


def test_layout_violation_drops_a_transfer_in_progress() -> None:
    good = _good()
    r = Reassembler()
    r.add(SENDER, good[0])
    with pytest.raises(ChunkError):
        r.add(SENDER, dataclasses.replace(good[2], offset=2 * CB + 1))
    assert r.pending() == [] and r.buffered_bytes == 0


def test_chunk_error_is_a_protocol_error_with_context() -> None:
    exc = ChunkError("x", field="body.count", sender="a", transfer_id=TID)
    assert isinstance(exc, ProtocolError)
    assert (exc.field, exc.sender, exc.transfer_id) == ("body.count", "a", TID)


# --------------------------------------------------------------------------------------------
# The real wire path


def test_chunks_through_encode_and_decode_reassemble_a_real_message() -> None:
    rng = np.random.default_rng(0)
    tensors = (rng.standard_normal((300, 200)).astype(np.float32), rng.standard_normal(17).astype(np.float32))
    inner = encode(Envelope(round=3, sender=SENDER, seq=41, body=Update(tensors, 120, 0.25, {"k": 1}),
                            timestamp_ms=1_700_000_000_000)).payload
    limit = 64 * 1024
    budget = chunk_data_budget(TOPIC, limit, qos=1, sender=SENDER, round=3)
    assert needs_chunking(TOPIC, len(inner), max_packet_bytes=limit, chunk_bytes=DEFAULT_CHUNK_BYTES, qos=1)
    chunks = split(inner, chunk_bytes=min(budget, DEFAULT_CHUNK_BYTES))
    wire = [encode(Envelope(round=3, sender=SENDER, seq=100 + i, body=c, timestamp_ms=1_700_000_000_001 + i))
            for i, c in enumerate(chunks)]
    for w in wire:
        assert publish_size(TOPIC, len(w.payload), 1).packet_bytes <= limit
    random.Random(3).shuffle(wire)
    r = Reassembler()
    outs = []
    for w in wire + wire[:5]:  # with QoS 1 redeliveries
        dec = decode(w.payload)
        assert dec.envelope.kind is Kind.CHUNK
        out = r.add(dec.envelope.sender, dec.envelope.body)
        if out is not None:
            outs.append(out)
    assert outs == [inner]
    env = decode(outs[0]).envelope
    assert env.sender == SENDER and env.seq == 41 and isinstance(env.body, Update)
    np.testing.assert_array_equal(env.body.tensors[0], tensors[0])


# --------------------------------------------------------------------------------------------
# chunk_data_budget: exact


def _max_width_packet(data_bytes: int, *, qos: int = 1, round: int = 5, protocol: int = 4,
                      sender: str = SENDER, topic: str = TOPIC) -> int:
    """PUBLISH size of a chunk message with every free integer at its widest (the budget's probe)."""
    c = Chunk(transfer_id=TID, index=MAX_CHUNKS - 1, count=MAX_CHUNKS, offset=(1 << 28) - 1,
              total_bytes=MAX_PAYLOAD_BYTES, sha256=b"\xff" * 32, data=b"\xab" * data_bytes)
    enc = encode(Envelope(round=round, sender=sender, seq=(1 << 63) - 1, body=c, timestamp_ms=(1 << 63) - 1))
    return publish_size(topic, len(enc.payload), qos, protocol=protocol).packet_bytes


def _typical_packet(data_bytes: int, *, qos: int = 1, round: int = 5, protocol: int = 4) -> int:
    """PUBLISH size of a realistic chunk message (small seq, current timestamp)."""
    c = split(bytes(data_bytes) + bytes(5), chunk_bytes=max(1, data_bytes), transfer_id=TID)[0]
    enc = encode(Envelope(round=round, sender=SENDER, seq=1, body=c, timestamp_ms=1_700_000_000_000))
    return publish_size(TOPIC, len(enc.payload), qos, protocol=protocol).packet_bytes


def _assert_exact(limit: int, **kw) -> int:
    b = chunk_data_budget(TOPIC, limit, qos=kw.get("qos", 1), sender=SENDER, round=kw.get("round", 5),
                          protocol=kw.get("protocol", 4))
    assert _max_width_packet(b, **kw) <= limit, (limit, b)
    assert _max_width_packet(b + 1, **kw) > limit, (limit, b)
    return b


@pytest.mark.parametrize("limit", [1024 * 1024, 65_536 + 300, 4096, 300, 2 * 1024 * 1024 + 200, 16_384 + 170])
def test_chunk_data_budget_is_exact(limit: int) -> None:
    b = _assert_exact(limit)
    assert _typical_packet(b) <= limit
    assert 0 < limit - b < 200  # sanity: the framing is some 160 bytes


def test_chunk_data_budget_is_exact_across_msgpack_and_varint_size_classes() -> None:
    # every limit where data crosses bin8 → bin16 (256), the body crosses bin8/bin16/bin32, and
    # the MQTT remaining length gains a byte (16,384 and 2,097,152)
    ranges = [range(156, 700), range(16_200, 16_700), range(65_300, 65_900), range(2_097_000, 2_097_400, 3)]
    budgets = [_assert_exact(limit) for r in ranges for limit in r]
    assert budgets == sorted(budgets)


@pytest.mark.parametrize("qos, protocol", [(0, 4), (2, 4), (1, MQTT_V5)])
def test_chunk_data_budget_other_qos_and_protocol(qos: int, protocol: int) -> None:
    for limit in (300, 65_536 + 300, 1024 * 1024):
        _assert_exact(limit, qos=qos, protocol=protocol)


def test_chunk_data_budget_holds_for_smaller_rounds() -> None:
    limit = 4096
    b = chunk_data_budget(TOPIC, limit, qos=1, sender=SENDER, round=70_000)
    for rnd in (0, 1, 127, 128, 255, 256, 65_535, 65_536, 70_000):
        assert _max_width_packet(b, round=rnd) <= limit


def test_chunk_data_budget_at_the_mqtt_maximum() -> None:
    b = chunk_data_budget(TOPIC, 1 + 4 + 268_435_455, qos=1, sender=SENDER, round=1)
    assert b == chunk_data_budget(TOPIC, 10**12, qos=1, sender=SENDER, round=1)
    assert 268_435_455 - 200 < b < 268_435_455


def test_chunk_data_budget_too_small_limit() -> None:
    with pytest.raises(ValueError):
        chunk_data_budget(TOPIC, 100, qos=1, sender=SENDER, round=1)
    with pytest.raises(ValueError):
        chunk_data_budget(TOPIC, 4096, qos=3, sender=SENDER, round=1)


# --------------------------------------------------------------------------------------------
# needs_chunking


@pytest.mark.parametrize("qos", [0, 1])
@pytest.mark.parametrize("limit", [300, 16_384 + 50, 65_536, 1024 * 1024])
def test_needs_chunking_boundary(limit: int, qos: int) -> None:
    p = next(n for n in range(limit, -1, -1) if publish_size(TOPIC, n, qos).packet_bytes <= limit)
    exact = publish_size(TOPIC, p, qos).packet_bytes == limit
    kw = {"max_packet_bytes": limit, "chunk_bytes": 10 * limit, "qos": qos}
    assert needs_chunking(TOPIC, p, **kw) is False
    assert needs_chunking(TOPIC, p + 1, **kw) is True
    if limit != 16_384 + 50:  # here the remaining length gains a byte: no payload lands exactly on it
        assert exact


def test_needs_chunking_packet_exactly_at_limit() -> None:
    limit = 4096
    p = max_payload_for(TOPIC, limit, 1)
    assert publish_size(TOPIC, p, 1).packet_bytes == limit
    assert not needs_chunking(TOPIC, p, max_packet_bytes=limit, chunk_bytes=DEFAULT_CHUNK_BYTES, qos=1)
    assert needs_chunking(TOPIC, p + 1, max_packet_bytes=limit, chunk_bytes=DEFAULT_CHUNK_BYTES, qos=1)


def test_needs_chunking_by_chunk_size() -> None:
    big = 1 << 30
    assert not needs_chunking(TOPIC, 1000, max_packet_bytes=big, chunk_bytes=1000, qos=1)
    assert needs_chunking(TOPIC, 1001, max_packet_bytes=big, chunk_bytes=1000, qos=1)
    assert needs_chunking(TOPIC, 300_000_000, max_packet_bytes=big, chunk_bytes=1 << 30, qos=1)  # above MQTT max
    with pytest.raises(ValueError):
        needs_chunking(TOPIC, 10, max_packet_bytes=big, chunk_bytes=0, qos=1)


# --------------------------------------------------------------------------------------------
# TransferCache


def _transfer(tag: int, n: int = 3 * CB) -> tuple[bytes, list[Chunk]]:
    tid = bytes([tag]) * 16
    return tid, split(payload_of(n, tag), chunk_bytes=CB, transfer_id=tid)


def test_transfer_cache_get() -> None:
    cache = TransferCache()
    tid, chunks = _transfer(1)
    assert cache.put(tid, chunks, meta=("topic", 3))
    assert cache.get(tid, [2, 0, 2, 7, 0]) == [chunks[2], chunks[0]]
    assert cache.get(tid, []) == []
    assert cache.get(b"\x09" * 16, [0]) == []
    assert cache.meta(tid) == ("topic", 3) and cache.meta(b"\x09" * 16) is None
    assert tid in cache and len(cache) == 1 and cache.cached_bytes == 3 * CB


def test_transfer_cache_evicts_oldest_by_count() -> None:
    cache = TransferCache(max_transfers=2)
    items = [_transfer(i) for i in (1, 2, 3)]
    for tid, chunks in items:
        cache.put(tid, chunks)
    assert cache.get(items[0][0], [0]) == []
    assert cache.get(items[1][0], [0]) == [items[1][1][0]]
    assert cache.get(items[2][0], [1]) == [items[2][1][1]]
    assert len(cache) == 2 and cache.cached_bytes == 6 * CB


def test_transfer_cache_evicts_oldest_by_bytes() -> None:
    cache = TransferCache(max_transfers=10, max_bytes=7 * CB)
    a, b, c = _transfer(1, 3 * CB), _transfer(2, 3 * CB), _transfer(3, 2 * CB)
    for tid, chunks in (a, b, c):
        assert cache.put(tid, chunks)
    assert a[0] not in cache and b[0] in cache and c[0] in cache
    assert cache.cached_bytes == 5 * CB
    big = _transfer(4, 8 * CB)
    assert cache.put(*big) is False  # alone above the bound: not kept, nothing evicted
    assert big[0] not in cache and len(cache) == 2


def test_transfer_cache_put_replaces() -> None:
    cache = TransferCache(max_transfers=2)
    tid, chunks = _transfer(1)
    cache.put(tid, chunks)
    cache.put(tid, chunks[:1])
    assert len(cache) == 1 and cache.cached_bytes == CB
    with pytest.raises(ValueError):
        cache.put(b"\x02" * 16, chunks)


# --------------------------------------------------------------------------------------------
# Property


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(0, 200_000), chunk_bytes=st.integers(1, 70_000), seed=st.integers(0, 2**32 - 1),
       dup_fraction=st.floats(0.0, 1.0))
def test_property_any_order_with_duplicates_reassembles(size: int, chunk_bytes: int, seed: int,
                                                        dup_fraction: float) -> None:
    rng = random.Random(seed)
    p = rng.randbytes(size)
    chunks = split(p, chunk_bytes=chunk_bytes)
    sequence = chunks + [c for c in chunks if rng.random() < dup_fraction]
    rng.shuffle(sequence)
    r = Reassembler()
    assert feed(r, "client-x", sequence) == [p]
    assert r.completed == 1 and r.duplicates == len(sequence) - len(chunks)
    assert r.buffered_bytes == 0 and r.pending() == []


# --------------------------------------------------------------------------------------------
# The server's channel under forged chunks (configured as AggregationServer configures its own)

SERVER_FED = "fed-chunks"


def _server_channel() -> tuple[Channel, MemoryTransport]:
    """A server channel on a memory broker: transfers admitted only from joined clients (here
    client-000) and bounded by the model size (16 MiB), at most 4 open per sender."""
    broker = MemoryBroker()
    tr = broker.connect("server")
    tr.subscribe(topics.server_filters(SERVER_FED))
    ch = Channel(tr, node_id="server", side="server", federation=SERVER_FED, ledger=None,
                 transfer_filter=lambda sender: sender == "client-000",
                 reassembler=Reassembler(max_transfer_bytes=16 * 1024 * 1024, max_sender_transfers=4))
    return ch, broker.connect("anyone")


def _publish_update(client: MemoryTransport, sender: str, body, seq: int = 1) -> None:
    payload = encode(Envelope(round=1, sender=sender, seq=seq, body=body)).payload
    client.publish(topics.up(SERVER_FED, sender, Kind.UPDATE), payload)


def _legit_update_arrives(ch: Channel, client: MemoryTransport) -> bool:
    """client-000 sends a 3.2 MB update in 1 MiB chunks; True when the server channel reassembles
    it and refuses none of its chunks."""
    upd = Update(tensors=(np.ones(800_000, np.float32),), num_samples=10, train_loss=0.1)
    whole = encode(Envelope(round=1, sender="client-000", seq=1, body=upd)).payload
    chunks = split(whole, chunk_bytes=1024 * 1024)
    for i, c in enumerate(chunks):
        _publish_update(client, "client-000", c, seq=2 + i)
    results = list(iter(lambda: ch.receive(0.0), None))  # chunks are taken in; whole messages come out
    return len(results) == 1 and isinstance(results[0], Received)


def test_server_channel_reassembles_a_chunked_update_of_a_joined_client() -> None:
    assert _legit_update_arrives(*_server_channel())


def test_chunks_from_senders_outside_the_federation_hold_no_reassembly_slot() -> None:
    """64 one-byte chunks from 64 made-up ids (enough to fill every slot of an unfiltered
    reassembler) are each refused, and a joined client's chunked update still gets through."""
    ch, client = _server_channel()
    for i in range(64):
        forged = Chunk(transfer_id=os.urandom(16), index=0, count=2, offset=0, total_bytes=2, sha256=bytes(32),
                       data=b"x")
        _publish_update(client, f"made-up-{i}", forged)
        assert isinstance(ch.receive(0.0), Rejected)
    assert ch.reassembler.pending() == []
    assert _legit_update_arrives(ch, client)


def test_declared_transfer_sizes_reserve_no_memory_before_the_bytes_arrive() -> None:
    """Two 1 MiB chunks declaring 256 MiB transfers each leave at most 64 MiB buffered (not the
    512 MiB declared), and a joined client's chunked update still gets through."""
    ch, client = _server_channel()
    for s in ("made-up-1", "made-up-2"):
        forged = Chunk(transfer_id=os.urandom(16), index=0, count=256, offset=0, total_bytes=256 * 1024 * 1024,
                       sha256=bytes(32), data=b"x" * (1024 * 1024))
        _publish_update(client, s, forged)
        ch.receive(0.0)
    assert ch.reassembler.buffered_bytes <= 64 * 1024 * 1024
    assert _legit_update_arrives(ch, client)
