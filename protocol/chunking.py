"""Chunked transfers: cutting a payload into ``chunk`` messages and putting it back together.

Sans-I/O: bytes and records in, bytes and records out. Nothing here touches a socket; the only
clock read goes through an injectable ``clock`` callable (``time.monotonic`` by default).

Chunking (normative, protocol version 1)
----------------------------------------

**When.** A message whose encoded payload (the whole envelope, :func:`protocol.messages.encode`)
is longer than the sender's chunk size (1 MiB by default, :data:`DEFAULT_CHUNK_BYTES`), or whose
PUBLISH packet would exceed the broker's maximum packet size, is sent as a **transfer** of
``chunk`` messages (kind 8) instead (:func:`needs_chunking`). A packet exactly at the maximum
is sent whole. Every other message is sent whole.

**Layout.** A transfer has a 16-byte random ``transfer_id``, the ``total_bytes`` and the
SHA-256 digest of the whole payload, and ``count`` ≥ 1 chunks. With a slice length ``L`` ≥ 1
(the same for the whole transfer), chunk ``index`` = *i* carries ``data`` = payload[*i*·L :
min((*i*+1)·L, total_bytes)] at ``offset`` = *i*·L, and ``count`` = ⌈total_bytes / L⌉. So every
chunk but the last carries exactly L bytes, the last carries 1..L bytes, and the slices cover
[0, total_bytes) without gap or overlap. An empty payload is one chunk (``count`` = 1) of 0 bytes.
``count`` ≤ 2²⁰ and ``total_bytes`` ≤ 256 MiB (the decoder's bounds). :func:`split` produces
exactly this layout; a receiver refuses any other (every chunk is checked on its own, in O(1),
and against the first chunk of its transfer).

**Envelopes.** Each chunk is a message of its own: envelope ``sender`` and ``round`` of the
chunked message, a fresh ``seq`` per chunk, published on the chunked message's topic with the
same QoS. The data size per chunk is chosen so that the PUBLISH packet of a chunk fits the
broker's maximum packet size: at most :func:`chunk_data_budget` bytes (and at most the chunk size).

**Reassembly.** The receiver keys a transfer by (envelope ``sender``, ``transfer_id``), so two
senders never mix even with equal ids. It preallocates ``total_bytes`` on the first chunk, after
checking its bounds (total buffered bytes, concurrent transfers, bytes per transfer), and copies
each chunk to its offset. A chunk index that arrives again is a **duplicate** (MQTT QoS 1
delivers at least once: a lost PUBACK or a reconnect re-sends, study §3 T4/T5/T9) and is ignored
if its bytes are identical; a chunk of a transfer completed recently is ignored too. When every
index has arrived, the SHA-256 digest of the buffer must equal ``sha256``; the buffer is then
decoded as an ordinary payload (:func:`protocol.messages.decode`), whose own envelope ``sender``
must equal the chunks' sender. The topic a chunk came on plays no part here: a transfer's
chunks may come on more than one topic (a broadcast ``global``'s chunks asked for again come on
the device's own topic; :class:`protocol.channel.Channel` checks that they are of one kind). A
chunk that disagrees with its transfer (``count``,
``total_bytes``, ``sha256``, slice length, different bytes at a seen index) or a digest
mismatch drops the whole transfer. A transfer that received no chunk for ``ttl_s`` seconds
(120 s by default) is dropped and reported, never waited on forever.

**Superseded transfers.** A sender whose transfer the broker refused sends the same payload again
as a new transfer in smaller chunks, and the chunks of the first that the broker did take can no
longer be completed (the sender forgets them). A transfer whose first chunk carries the ``sha256``
and ``total_bytes`` of a transfer of the same sender still in progress, or completed recently,
**supersedes** it: the older one is dropped without a report (it is not lost: the newer one
carries the same bytes) and its late chunks are ignored; one that arrives after a transfer of the
same payload completed is ignored as a duplicate. Both are counted (``superseded``).

**Resend.** While a transfer stalls, the receiver may send ``resend`` (kind 9) with the
``transfer_id`` and the missing indices to the transfer's sender; the sender answers from a
bounded cache of its recent transfers (:class:`TransferCache`) by publishing the same chunk
records again (new envelopes, fresh ``seq``). It honours a request only from a known peer (the
server: a joined agent, verified when signing is on; an agent: the server), for a transfer sent
to that peer, for indices the transfer has, and within a per-peer budget of resent bytes; a
refused request (a sender that no longer holds the transfer included) is a ``rejected`` ledger
row with its reason, and the receiver's transfer then expires. A broadcast ``global``'s chunks go
again to the device that asked alone, on its own topic (``down/{client}/global``), unless their
PUBLISH would not fit there (:meth:`protocol.channel.Channel._publish_resend`); the server cuts
such a broadcast with :func:`chunk_data_budget` on its longest joined device's own topic
(``budget_topic`` of :meth:`protocol.channel.Channel.send`), so that they do. Resent chunks are
ordinary chunks to the receiver (duplicates included).

Units: bytes for every size, seconds for every duration.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ._join import fillable_bytes
from .errors import ChunkError  # noqa: F401  (re-exported for callers of this module)
from .messages import (
    MAX_CHUNKS,
    MAX_PAYLOAD_BYTES,
    TRANSFER_ID_BYTES,
    Chunk,
    Envelope,
    encode,
)
from .mqtt_bytes import MAX_REMAINING_LENGTH, MQTT_V311, publish_size

DEFAULT_CHUNK_BYTES = 1024 * 1024
"""Default chunk size: 1 MiB of payload per chunk (study §7: 256 KiB–4 MiB performed alike)."""

SHA256_BYTES = 32

_MAX_PACKET_BYTES = 1 + 4 + MAX_REMAINING_LENGTH  # largest MQTT packet (fixed header + remaining)

MiB = 1024 * 1024

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ChunkError",
    "IncompleteTransfer",
    "Reassembler",
    "TransferCache",
    "chunk_data_budget",
    "needs_chunking",
    "split",
]


# --------------------------------------------------------------------------------------------
# Sender side


def split(payload: bytes | bytearray | memoryview, *, chunk_bytes: int,
          transfer_id: bytes | None = None) -> list[Chunk]:
    """Cut ``payload`` into the chunks of one transfer (layout in the module docstring).

    Args:
        payload: the whole payload (normally an encoded envelope), any bytes-like object.
        chunk_bytes: slice length L in bytes, ≥ 1 (every chunk but the last carries exactly this).
        transfer_id: 16 bytes naming the transfer; ``None`` draws ``os.urandom(16)``.

    Returns:
        ``max(1, ⌈len(payload) / chunk_bytes⌉)`` chunks in index order; an empty payload gives one
        chunk of 0 bytes. ``data`` is a read-only ``memoryview`` slice of the payload (no copy;
        a one-chunk transfer of a ``bytes`` payload carries the payload itself), so the chunks
        keep the payload alive and cost no memory of their own; a mutable payload (``bytearray``)
        is copied once first, so later changes to it cannot reach chunks already cut.

    Raises:
        ValueError: ``chunk_bytes`` < 1, ``transfer_id`` not 16 bytes, a payload above
            256 MiB, or more than 2²⁰ chunks (the receiver's bounds).
    """
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be an int ≥ 1, not {chunk_bytes!r}")
    if transfer_id is None:
        transfer_id = os.urandom(TRANSFER_ID_BYTES)
    transfer_id = bytes(transfer_id)
    if len(transfer_id) != TRANSFER_ID_BYTES:
        raise ValueError(f"transfer_id must be {TRANSFER_ID_BYTES} bytes, got {len(transfer_id)}")
    view = memoryview(payload).cast("B")
    if not view.readonly:  # never let the caller's later writes change chunks (or a cached resend)
        view = memoryview(view.tobytes())
    total = view.nbytes
    if total > MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload of {total} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte maximum")
    count = max(1, -(-total // chunk_bytes))
    if count > MAX_CHUNKS:
        raise ValueError(f"{total} bytes in chunks of {chunk_bytes} make {count} chunks, at most {MAX_CHUNKS}")
    digest = hashlib.sha256(view).digest()
    if count == 1:
        data: bytes | memoryview = payload if type(payload) is bytes else view
        return [Chunk(transfer_id=transfer_id, index=0, count=1, offset=0, total_bytes=total,
                      sha256=digest, data=data)]
    return [Chunk(transfer_id=transfer_id, index=i, count=count, offset=i * chunk_bytes, total_bytes=total,
                  sha256=digest, data=view[i * chunk_bytes:(i + 1) * chunk_bytes])
            for i in range(count)]


def _packet_bytes(topic: str, payload_bytes: int, qos: int, protocol: int) -> int | None:
    """PUBLISH packet size, or ``None`` when it is above the MQTT maximum remaining length."""
    topic_bytes = len(topic.encode("utf-8"))
    if payload_bytes + topic_bytes > MAX_REMAINING_LENGTH:
        return None
    try:
        return publish_size(topic, payload_bytes, qos, protocol=protocol).packet_bytes
    except ValueError:
        return None  # remaining length above 268,435,455 once the variable header is added


def _check_qos(qos: int, protocol: int) -> None:
    publish_size("", 0, qos, protocol=protocol)  # raises ValueError on a bad QoS or protocol


def needs_chunking(topic: str, payload_bytes: int, *, max_packet_bytes: int, chunk_bytes: int,
                   qos: int, protocol: int = MQTT_V311) -> bool:
    """Whether a payload of ``payload_bytes`` bytes must be sent as a chunked transfer.

    True when its PUBLISH packet on ``topic`` (fixed header + topic + packet id + payload, see
    :func:`protocol.mqtt_bytes.publish_size`) would exceed ``max_packet_bytes``, or when the
    payload is longer than ``chunk_bytes``. A packet of exactly ``max_packet_bytes`` is sent whole.

    Args:
        topic: the message's topic.
        payload_bytes: length of the encoded payload (bytes).
        max_packet_bytes: the broker's maximum packet size (whole PUBLISH packet, bytes).
        chunk_bytes: the sender's chunk size (bytes, ≥ 1).
        qos: 0, 1 or 2.
        protocol: MQTT protocol level (4 = 3.1.1, 5 = MQTT 5 without properties).

    Raises:
        ValueError: negative ``payload_bytes``, ``chunk_bytes`` < 1, bad QoS or protocol.
    """
    if payload_bytes < 0:
        raise ValueError(f"payload_bytes must be ≥ 0, not {payload_bytes}")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be ≥ 1, not {chunk_bytes}")
    _check_qos(qos, protocol)
    if payload_bytes > chunk_bytes:
        return True
    size = _packet_bytes(topic, payload_bytes, qos, protocol)
    return size is None or size > max_packet_bytes


def chunk_data_budget(topic: str, max_packet_bytes: int, *, qos: int, sender: str, round: int,
                      protocol: int = MQTT_V311) -> int:
    """Largest ``data`` length (bytes) of a chunk whose whole PUBLISH packet fits ``max_packet_bytes``.

    Counted exactly, not estimated: a probe chunk message is encoded with
    :func:`protocol.messages.encode` and measured with :func:`protocol.mqtt_bytes.publish_size`
    (MQTT fixed header + topic + packet id + envelope + body framing + data), searching the data
    length by bisection, so msgpack's ``bin8``/``bin16``/``bin32`` headers (for ``data`` and for
    the nested body, at 256 and 65,536 bytes) and the MQTT remaining-length bytes are included
    wherever they change.

    The probe puts every integer whose value the caller does not fix at its widest msgpack form:
    ``seq`` = 2³² and ``timestamp_ms`` = 2⁶³−1 (``uint64``, 9 bytes, as wide as any valid value),
    ``index`` = 2²⁰−1, ``count`` = 2²⁰, ``offset`` = ``total_bytes`` = 256 MiB (``uint32``,
    5 bytes, the widest the decoder allows). msgpack's encoding of a non-negative integer never
    gets longer as the value gets smaller, so a real chunk of the same data length, ``sender``,
    and any ``round`` ≤ the one given, is never longer than the probe: its packet is ≤ the
    limit. The answer is maximal for the probe: one more byte of data exceeds the limit.

    Args:
        topic: the chunked message's topic (the chunks are published there), or a longer topic
            they may also be published on (a broadcast's per-device topic, for resends): the
            budget holds on every topic no longer than this one, in UTF-8 bytes.
        max_packet_bytes: the broker's maximum packet size (whole PUBLISH packet, bytes).
        qos: 0, 1 or 2.
        sender: envelope sender of the chunks (its UTF-8 length counts).
        round: envelope round (the budget also holds for every smaller round).
        protocol: MQTT protocol level (4 = 3.1.1, 5 = MQTT 5 without properties).

    Returns:
        The data budget in bytes (≥ 0). Results are cached per argument tuple.

    Raises:
        ValueError: not even a chunk with 0 bytes of data fits, or a bad QoS/protocol.
        FieldError: ``sender`` is not a valid client id, ``round`` out of range.
    """
    return _chunk_data_budget(topic, max_packet_bytes, qos, sender, round, protocol)


_PROBE_TID = bytes(TRANSFER_ID_BYTES)
_PROBE_SHA = bytes(SHA256_BYTES)


_LINEAR_FROM = 1 << 17
"""From this data length on, the probe's payload grows byte for byte (see :func:`_probe_payload_bytes`)."""


def _probe_payload_bytes(data_bytes: int, sender: str, round: int) -> int:
    """Exact length of the probe chunk's encoded payload with ``data_bytes`` bytes of data.

    Encoded for real up to :data:`_LINEAR_FROM` (128 KiB). Above it, both msgpack headers that
    depend on the length (``data`` and the nested body) are ``bin32`` (5 bytes) for every length
    up to 4 GiB and nothing else changes, so the length is that at 128 KiB plus the extra bytes;
    this saves encoding hundreds of MiB per bisection step (tests check it against real encodes).
    """
    n = min(data_bytes, _LINEAR_FROM)
    probe = Chunk(transfer_id=_PROBE_TID, index=MAX_CHUNKS - 1, count=MAX_CHUNKS, offset=MAX_PAYLOAD_BYTES,
                  total_bytes=MAX_PAYLOAD_BYTES, sha256=_PROBE_SHA, data=bytes(n))
    enc = encode(Envelope(round=round, sender=sender, seq=2**32, body=probe, timestamp_ms=2**63 - 1))
    return len(enc.payload) + (data_bytes - n)


@functools.lru_cache(maxsize=256)
def _chunk_data_budget(topic: str, max_packet_bytes: int, qos: int, sender: str, round: int,
                       protocol: int) -> int:
    _check_qos(qos, protocol)

    def packet(n: int) -> int | None:
        return _packet_bytes(topic, _probe_payload_bytes(n, sender, round), qos, protocol)

    def fits(n: int) -> bool:
        size = packet(n)
        return size is not None and size <= max_packet_bytes

    overhead0 = packet(0)
    if overhead0 is None or overhead0 > max_packet_bytes:
        raise ValueError(f"max packet size {max_packet_bytes} is too small for a chunk on {topic!r}")
    # packet(n) = n + overhead(n) with overhead non-decreasing in n, so the answer is at most
    # max_packet_bytes - overhead(0); overhead grows by a few bytes at most (bin and varint
    # headers), so start the bisection just below and fall back to 0 if that does not fit.
    hi = min(min(max_packet_bytes, _MAX_PACKET_BYTES) - overhead0, MAX_PAYLOAD_BYTES)
    lo = max(0, hi - 64)
    if not fits(lo):
        lo = 0
    while lo < hi:  # invariant: fits(lo); the answer lies in [lo, hi]
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


# --------------------------------------------------------------------------------------------
# Receiver side


@dataclass(frozen=True, slots=True)
class IncompleteTransfer:
    """A transfer still being reassembled, or dropped before it completed.

    Attributes:
        sender: envelope sender of its chunks.
        transfer_id: the transfer's 16-byte id.
        received: distinct chunks received.
        count: chunks in the transfer.
        bytes_received: payload bytes received (distinct chunks).
        total_bytes: length of the whole payload (bytes).
        age_s: seconds since its last chunk arrived (at the time of the report).
    """

    sender: str
    transfer_id: bytes
    received: int
    count: int
    bytes_received: int
    total_bytes: int
    age_s: float


class _Transfer:
    """One transfer being reassembled: the payload is written chunk by chunk into the ``bytes``
    object that is handed over when it is whole (:func:`protocol._join.fillable_bytes`: one
    payload-sized buffer, no copy at the end), or into a ``bytearray`` copied once at the end where
    bytes cannot be built in place."""

    __slots__ = ("count", "total_bytes", "sha256", "slice_bytes", "buf", "out", "seen", "received",
                 "bytes_received", "last_s")

    def __init__(self, chunk: Chunk, slice_bytes: int, now_s: float) -> None:
        self.count = chunk.count
        self.total_bytes = chunk.total_bytes
        self.sha256 = bytes(chunk.sha256)
        self.slice_bytes = slice_bytes
        fillable = fillable_bytes(chunk.total_bytes)
        self.out: bytes | None
        self.buf: bytearray | memoryview
        if fillable is None:
            self.out, self.buf = None, bytearray(chunk.total_bytes)
        else:
            self.out, self.buf = fillable
        self.seen = bytearray((chunk.count + 7) // 8)  # bitmap of received indices
        self.received = 0
        self.bytes_received = 0
        self.last_s = now_s

    def payload(self) -> bytes:
        """The whole payload (every chunk written): the filled object itself, its view released
        first, or a copy of the ``bytearray``."""
        if self.out is None:
            return bytes(self.buf)
        assert isinstance(self.buf, memoryview)
        self.buf.release()
        return self.out

    def has(self, index: int) -> bool:
        return bool(self.seen[index >> 3] >> (index & 7) & 1)

    def mark(self, index: int) -> None:
        self.seen[index >> 3] |= 1 << (index & 7)

    def record(self, sender: str, tid: bytes, now_s: float) -> IncompleteTransfer:
        return IncompleteTransfer(sender=sender, transfer_id=tid, received=self.received, count=self.count,
                                  bytes_received=self.bytes_received, total_bytes=self.total_bytes,
                                  age_s=max(0.0, now_s - self.last_s))


def _slice_bytes(chunk: Chunk) -> int:
    """Check ``chunk`` against the layout on its own; return the transfer's slice length L.

    For ``count`` = 1 the slice length is the whole payload (L = ``total_bytes``, may be 0).

    Raises:
        ChunkError: the chunk cannot belong to any valid transfer.
    """
    if not isinstance(chunk.sha256, (bytes, bytearray)) or len(chunk.sha256) != SHA256_BYTES:
        raise ChunkError("sha256 must be 32 bytes", field="body.sha256")
    count, index, offset, total, n = chunk.count, chunk.index, chunk.offset, chunk.total_bytes, len(chunk.data)
    if not 1 <= count <= MAX_CHUNKS:
        raise ChunkError(f"count {count} out of range 1..{MAX_CHUNKS}", field="body.count")
    if not 0 <= index < count:
        raise ChunkError(f"index {index} out of range 0..{count - 1}", field="body.index")
    if not 0 <= total <= MAX_PAYLOAD_BYTES:
        raise ChunkError(f"total_bytes {total} out of range 0..{MAX_PAYLOAD_BYTES}", field="body.total_bytes")
    if offset < 0 or offset + n > total:
        raise ChunkError(f"{n} bytes at offset {offset} overrun total_bytes {total}", field="body.offset")
    if count == 1:
        if offset != 0 or n != total:
            raise ChunkError(f"a single chunk must carry all {total} bytes at offset 0, got {n} at {offset}",
                             field="body.data")
        return total
    if index < count - 1:
        slice_bytes = n
        if slice_bytes < 1 or offset != index * slice_bytes:
            raise ChunkError(f"chunk {index} of {count}: {n} bytes at offset {offset} is not slice {index} of an "
                             f"equal-slice layout", field="body.offset")
    else:
        slice_bytes, rem = divmod(offset, count - 1)
        if rem or not 1 <= n <= slice_bytes:
            raise ChunkError(f"last chunk {index}: {n} bytes at offset {offset} does not end an equal-slice layout",
                             field="body.offset")
    if not (count - 1) * slice_bytes < total <= count * slice_bytes:
        raise ChunkError(f"{count} chunks of {slice_bytes} bytes cannot make total_bytes {total}",
                         field="body.count")
    return slice_bytes


class Reassembler:
    """Receiver side of chunked transfers, bounded in memory and in time.

    Transfers are keyed by (envelope sender, ``transfer_id``). Thread-safe (one lock).

    Args:
        max_bytes: payload bytes buffered over all transfers in progress (512 MiB).
        max_transfers: transfers in progress at once (64).
        max_transfer_bytes: largest ``total_bytes`` of one transfer (256 MiB).
        ttl_s: a transfer with no chunk for longer than this (seconds) is dropped (120 s).
        clock: monotonic clock in seconds (``time.monotonic``; inject a fake in tests).
        recent_completed: how many completed (sender, transfer_id) keys are remembered so that
            late duplicates of a finished transfer are ignored (1024).
        max_sender_transfers: transfers in progress at once from one sender, so that one peer
            cannot hold all of ``max_transfers``/``max_bytes`` until its transfers expire
            (``None``: no per-sender bound). A new transfer from a sender at its bound drops that
            sender's stalest one (reported by :meth:`expire` as incomplete).

    Attributes:
        completed: transfers reassembled and verified.
        duplicates: chunks ignored as duplicates (seen index, or transfer already complete).
        superseded: transfers dropped or ignored because another transfer of the same sender
            carries the same payload (same ``sha256`` and ``total_bytes``; module docstring).
        rejected: chunks refused with :class:`ChunkError`.
        expired: transfers dropped for inactivity.
    """

    def __init__(self, *, max_bytes: int = 512 * MiB, max_transfers: int = 64, max_transfer_bytes: int = 256 * MiB,
                 ttl_s: float = 120.0, clock: Callable[[], float] = time.monotonic,
                 recent_completed: int = 1024, max_sender_transfers: int | None = None) -> None:
        if max_bytes < 0 or max_transfers < 1 or max_transfer_bytes < 0 or ttl_s <= 0 or recent_completed < 0:
            raise ValueError("Reassembler bounds must be positive")
        if max_sender_transfers is not None and max_sender_transfers < 1:
            raise ValueError("max_sender_transfers must be ≥ 1 or None")
        self.max_sender_transfers = max_sender_transfers
        self.max_bytes = max_bytes
        self.max_transfers = max_transfers
        self.max_transfer_bytes = max_transfer_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._transfers: dict[tuple[str, bytes], _Transfer] = {}
        self._done: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        # (sender, sha256, total_bytes) of recently completed transfers: a later transfer of the same payload
        self._done_payloads: OrderedDict[tuple[str, bytes, int], None] = OrderedDict()
        self._recent_completed = recent_completed
        self._dropped: deque[IncompleteTransfer] = deque(maxlen=1024)  # expired inside add(), not yet reported
        self._buffered = 0
        self._lock = threading.Lock()
        self.completed = 0
        self.duplicates = 0
        self.rejected = 0
        self.expired = 0
        self.superseded = 0

    @property
    def buffered_bytes(self) -> int:
        """Payload bytes allocated for transfers in progress (sum of their ``total_bytes``)."""
        return self._buffered

    def add(self, sender: str, chunk: Chunk) -> bytes | None:
        """Take one chunk received from ``sender`` (its envelope sender).

        Returns:
            The whole payload (``bytes``, digest verified) when this chunk completes its transfer,
            which is then forgotten; ``None`` otherwise (more chunks needed, or a duplicate).

        Raises:
            ChunkError: the chunk breaks the layout, contradicts its transfer (``count``,
                ``total_bytes``, ``sha256``, slice length, different bytes at a seen index) or
                completes it with a wrong digest (the transfer is dropped in all these cases); or,
                for a transfer's first chunk, it would exceed ``max_transfer_bytes``,
                ``max_transfers``, ``max_sender_transfers`` or ``max_bytes`` (refused before
                allocating; expired transfers are dropped first).
        """
        with self._lock:
            tid = chunk.transfer_id
            if not isinstance(tid, (bytes, bytearray)) or len(tid) != TRANSFER_ID_BYTES:
                self.rejected += 1
                raise ChunkError(f"transfer_id must be {TRANSFER_ID_BYTES} bytes", field="body.transfer_id",
                                 sender=sender)
            key = (sender, bytes(tid))
            try:
                slice_bytes = _slice_bytes(chunk)
            except ChunkError as exc:
                self.rejected += 1
                dropped = self._transfers.pop(key, None)
                if dropped is not None:
                    self._buffered -= dropped.total_bytes
                exc.sender, exc.transfer_id = key
                raise
            now = self._clock()
            t = self._transfers.get(key)
            if t is None:
                if key in self._done:
                    self.duplicates += 1
                    return None
                payload = (sender, bytes(chunk.sha256), chunk.total_bytes)
                if payload in self._done_payloads:  # the payload already arrived by another transfer
                    self.superseded += 1
                    self._remember_done(key)
                    log.debug("transfer %s from %s ignored: the same payload already arrived by another transfer",
                              key[1].hex(), sender)
                    return None
                t = self._open(key, chunk, slice_bytes, now)
            else:
                self._check_agrees(key, t, chunk, slice_bytes)
            t.last_s = now
            index, data, start = chunk.index, chunk.data, chunk.offset
            end = start + len(data)
            if t.has(index):
                with memoryview(t.buf) as view:
                    same = view[start:end] == data
                if not same:
                    self._fail(key, t, f"chunk {index} arrived twice with different bytes", "body.data")
                self.duplicates += 1
                return None
            t.buf[start:end] = data
            t.mark(index)
            t.received += 1
            t.bytes_received += len(data)
            if t.received < t.count:
                return None
            del self._transfers[key]
            self._buffered -= t.total_bytes
            if t.bytes_received != t.total_bytes or hashlib.sha256(t.buf).digest() != t.sha256:
                self._refuse(key, f"reassembled {t.total_bytes} bytes do not match the transfer's sha256",
                             "body.sha256")
            self.completed += 1
            self._remember_done(key)
            if self._recent_completed:
                self._done_payloads[(sender, t.sha256, t.total_bytes)] = None
                while len(self._done_payloads) > self._recent_completed:
                    self._done_payloads.popitem(last=False)
            return t.payload()

    def _remember_done(self, key: tuple[str, bytes]) -> None:
        """Ignore later chunks of transfer ``key`` (completed or superseded); caller holds the lock."""
        if self._recent_completed:
            self._done[key] = None
            while len(self._done) > self._recent_completed:
                self._done.popitem(last=False)

    def _open(self, key: tuple[str, bytes], chunk: Chunk, slice_bytes: int, now: float) -> _Transfer:
        total = chunk.total_bytes
        if total > self.max_transfer_bytes:
            self._refuse(key, f"transfer of {total} bytes exceeds max_transfer_bytes {self.max_transfer_bytes}",
                         "body.total_bytes")
        self._expire_locked(now, keep=self._dropped)
        sha = bytes(chunk.sha256)
        for old_key, old in list(self._transfers.items()):
            if old_key[0] == key[0] and old.sha256 == sha and old.total_bytes == total:
                # the sender sent the same payload again as a new transfer (smaller chunks after a
                # refusal): the old one can no longer be completed and is not lost
                del self._transfers[old_key]
                self._buffered -= old.total_bytes
                self.superseded += 1
                self._remember_done(old_key)
                log.debug("transfer %s from %s (%d/%d chunks) superseded by transfer %s of the same payload",
                          old_key[1].hex(), key[0], old.received, old.count, key[1].hex())
        if len(self._transfers) >= self.max_transfers:
            self._refuse(key, f"{len(self._transfers)} transfers already in progress (max_transfers "
                              f"{self.max_transfers})", None)
        if self.max_sender_transfers is not None:
            mine = [(t.last_s, k) for k, t in self._transfers.items() if k[0] == key[0]]
            if len(mine) >= self.max_sender_transfers:
                # the sender's stalest transfer gives way (it only ever holds its own slots): a sender
                # that replaced a transfer (sent it again in smaller chunks after a broker refused
                # it) must not be locked out until the abandoned one expires
                _, stale = min(mine)
                old = self._transfers.pop(stale)
                self._buffered -= old.total_bytes
                self.expired += 1
                self._dropped.append(old.record(stale[0], stale[1], now))
        if self._buffered + total > self.max_bytes:
            self._refuse(key, f"transfer of {total} bytes would exceed max_bytes {self.max_bytes} "
                              f"({self._buffered} buffered)", "body.total_bytes")
        t = _Transfer(chunk, slice_bytes, now)
        self._transfers[key] = t
        self._buffered += total
        return t

    def _check_agrees(self, key: tuple[str, bytes], t: _Transfer, chunk: Chunk, slice_bytes: int) -> None:
        if chunk.count != t.count:
            self._fail(key, t, f"count {chunk.count} differs from the transfer's {t.count}", "body.count")
        if chunk.total_bytes != t.total_bytes:
            self._fail(key, t, f"total_bytes {chunk.total_bytes} differs from the transfer's {t.total_bytes}",
                       "body.total_bytes")
        if bytes(chunk.sha256) != t.sha256:
            self._fail(key, t, "sha256 differs from the transfer's", "body.sha256")
        if slice_bytes != t.slice_bytes:
            self._fail(key, t, f"slice length {slice_bytes} differs from the transfer's {t.slice_bytes}",
                       "body.offset")

    def _refuse(self, key: tuple[str, bytes], message: str, field: str | None) -> None:
        self.rejected += 1
        raise ChunkError(message, field=field, sender=key[0], transfer_id=key[1])

    def _fail(self, key: tuple[str, bytes], t: _Transfer, message: str, field: str) -> None:
        del self._transfers[key]
        self._buffered -= t.total_bytes
        self._refuse(key, message, field)

    def drop(self, sender: str, transfer_id: bytes) -> bool:
        """Drop a transfer in progress whose message arrived by another copy (a receiver's
        decision: :meth:`protocol.channel.Channel.accept`) and ignore its later chunks, as a
        superseded transfer (counted in ``superseded``, not reported as incomplete).

        Returns:
            whether such a transfer was in progress.
        """
        with self._lock:
            key = (sender, bytes(transfer_id))
            t = self._transfers.pop(key, None)
            if t is None:
                return False
            self._buffered -= t.total_bytes
            self.superseded += 1
            self._remember_done(key)
            return True

    def missing(self, sender: str, transfer_id: bytes) -> list[int]:
        """Indices (ascending) not yet received for a transfer in progress; ``[]`` when the
        transfer is unknown, completed or dropped."""
        with self._lock:
            t = self._transfers.get((sender, bytes(transfer_id)))
            if t is None:
                return []
            return [i for i in range(t.count) if not t.has(i)]

    def pending(self) -> list[IncompleteTransfer]:
        """Transfers in progress, oldest activity first (``age_s`` = seconds since their last chunk).

        A caller asks for resends (``Resend`` with :meth:`missing`) for those idle for a while,
        before ``ttl_s`` drops them.
        """
        with self._lock:
            now = self._clock()
            recs = [t.record(s, tid, now) for (s, tid), t in self._transfers.items()]
        return sorted(recs, key=lambda r: -r.age_s)

    def expire(self) -> list[IncompleteTransfer]:
        """Drop transfers with no chunk for more than ``ttl_s`` seconds and free their memory.

        Returns:
            The dropped transfers (also those dropped while :meth:`add` made room since the last
            call), so the caller can log them, write ledger rows or ask for the whole transfer
            again instead of waiting forever.
        """
        with self._lock:
            out = list(self._dropped)
            self._dropped.clear()
            self._expire_locked(self._clock(), keep=out)
            return out

    def _expire_locked(self, now: float, *, keep: list[IncompleteTransfer] | deque[IncompleteTransfer]) -> None:
        for key, t in list(self._transfers.items()):
            if now - t.last_s > self.ttl_s:
                del self._transfers[key]
                self._buffered -= t.total_bytes
                self.expired += 1
                keep.append(t.record(key[0], key[1], now))


# --------------------------------------------------------------------------------------------
# Sender-side cache for resends


@dataclass(frozen=True, slots=True)
class _Cached:
    chunks: dict[int, Chunk]
    data_bytes: int
    meta: Any


class TransferCache:
    """The chunks of the sender's last few transfers, to answer ``resend`` requests.

    Bounded by transfer count and by data bytes (the sum of ``len(chunk.data)``); the oldest
    transfer is evicted first. Thread-safe (one lock).

    Args:
        max_transfers: transfers kept (4).
        max_bytes: chunk data bytes kept over all transfers (256 MiB).
    """

    def __init__(self, *, max_transfers: int = 4, max_bytes: int = 256 * MiB) -> None:
        if max_transfers < 1 or max_bytes < 0:
            raise ValueError("TransferCache bounds must be positive")
        self.max_transfers = max_transfers
        self.max_bytes = max_bytes
        self._items: OrderedDict[bytes, _Cached] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def cached_bytes(self) -> int:
        """Chunk data bytes held now."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, transfer_id: object) -> bool:
        return isinstance(transfer_id, (bytes, bytearray)) and bytes(transfer_id) in self._items

    def put(self, transfer_id: bytes, chunks: Iterable[Chunk], *, meta: Any = None) -> bool:
        """Keep the chunks of a transfer (replacing an entry with the same id), evicting the
        oldest transfers until both bounds hold.

        Args:
            transfer_id: the transfer's id.
            chunks: its chunks (all of them, normally the output of :func:`split`).
            meta: anything the caller needs to re-publish (topic, round); see :meth:`meta`.

        Returns:
            ``True`` when cached; ``False`` when the transfer alone exceeds ``max_bytes`` (then
            nothing is kept for it).

        Raises:
            ValueError: a chunk of another transfer.
        """
        tid = bytes(transfer_id)
        by_index: dict[int, Chunk] = {}
        for c in chunks:
            if bytes(c.transfer_id) != tid:
                raise ValueError("a chunk of another transfer")
            by_index[c.index] = c
        size = sum(len(c.data) for c in by_index.values())
        with self._lock:
            old = self._items.pop(tid, None)
            if old is not None:
                self._bytes -= old.data_bytes
            if size > self.max_bytes:
                return False
            while self._items and (len(self._items) >= self.max_transfers or self._bytes + size > self.max_bytes):
                _, evicted = self._items.popitem(last=False)
                self._bytes -= evicted.data_bytes
            self._items[tid] = _Cached(by_index, size, meta)
            self._bytes += size
            return True

    def get(self, transfer_id: bytes, indices: Sequence[int]) -> list[Chunk]:
        """The cached chunks at ``indices``, in request order, each at most once.

        Unknown transfers give ``[]``; indices not cached (out of range) are skipped.
        """
        with self._lock:
            item = self._items.get(bytes(transfer_id))
            if item is None:
                return []
            out: list[Chunk] = []
            taken: set[int] = set()
            for i in indices:
                c = item.chunks.get(i)
                if c is not None and i not in taken:
                    taken.add(i)
                    out.append(c)
            return out

    def discard(self, transfer_id: bytes) -> None:
        """Forget a transfer (one the sender replaced, say); unknown ids are ignored."""
        with self._lock:
            old = self._items.pop(bytes(transfer_id), None)
            if old is not None:
                self._bytes -= old.data_bytes

    def meta(self, transfer_id: bytes) -> Any:
        """The ``meta`` given to :meth:`put` for a cached transfer (``None`` when unknown)."""
        with self._lock:
            item = self._items.get(bytes(transfer_id))
            return None if item is None else item.meta
