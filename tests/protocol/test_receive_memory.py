"""The memory of receiving a chunked transfer: the reassembler writes each chunk into the
``bytes`` object it hands over, so a whole 20 MB payload costs one payload-sized allocation
(``tracemalloc``, beyond the chunks already received); where bytes cannot be built in place it
fills a ``bytearray`` and copies it once, two payloads at the peak. Either way the payload is
``bytes`` equal to the sender's."""

from __future__ import annotations

import numpy as np
import pytest

import protocol.chunking as chunking
from protocol import topics
from protocol._join import fillable_bytes
from protocol.channel import Channel
from protocol.chunking import Reassembler
from protocol.messages import Chunk, Kind, decode
from tests.protocol.test_send_memory import KeepingTransport, big_update, traced_peak

CLIENT = "client-007"


def _chunks() -> tuple[bytes, list[Chunk]]:
    tr = KeepingTransport()
    ch = Channel(tr, node_id=CLIENT, side="agent", federation="fed-a", ledger=None, chunk_bytes=1 << 20)
    enc = ch.send(topics.up("fed-a", CLIENT, Kind.UPDATE), big_update().body, round=3)
    chunks = [decode(p).envelope.body for p in tr.payloads]
    assert len(chunks) > 15 and all(isinstance(c, Chunk) for c in chunks)
    return enc.payload, chunks  # type: ignore[return-value]


def _reassemble(chunks: list[Chunk]) -> bytes | None:
    r = Reassembler()
    out = None
    for c in chunks[::-1]:  # any order: the last chunk first
        out = r.add(CLIENT, c)
    return out


@pytest.mark.skipif(fillable_bytes(1) is None, reason="bytes cannot be built in place here (not CPython)")
def test_a_20mb_transfer_is_reassembled_in_the_bytes_it_hands_over() -> None:
    payload, chunks = _chunks()
    peak, whole = traced_peak(lambda: _reassemble(chunks))
    assert type(whole) is bytes and whole == payload
    assert peak <= 1.1 * len(payload), f"peak {peak:,} B for a {len(payload):,} B payload"
    e = decode(whole).envelope  # the tensors decode as read-only views on it
    assert not e.body.tensors[0].flags.writeable and np.shares_memory(e.body.tensors[0],
                                                                      np.frombuffer(whole, np.uint8))


def test_without_in_place_bytes_the_bytearray_is_copied_once(monkeypatch: pytest.MonkeyPatch) -> None:
    payload, chunks = _chunks()
    monkeypatch.setattr(chunking, "fillable_bytes", lambda n: None)
    peak, whole = traced_peak(lambda: _reassemble(chunks))
    assert type(whole) is bytes and whole == payload
    assert 1.9 * len(payload) <= peak <= 2.1 * len(payload), f"peak {peak:,} B for {len(payload):,} B"


@pytest.mark.skipif(fillable_bytes(1) is None, reason="bytes cannot be built in place here (not CPython)")
def test_fillable_bytes_is_written_in_place() -> None:
    got = fillable_bytes(10)
    assert got is not None
    out, view = got
    view[:] = b"0123456789"
    view.release()
    assert type(out) is bytes and out == b"0123456789" and fillable_bytes(0) is None
