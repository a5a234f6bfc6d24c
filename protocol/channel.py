"""A channel = transport + codec + byte ledger, for one side (the server or one agent).

:meth:`Channel.send` encodes a body in an envelope with the next sequence number, publishes it
and writes the ``sent`` ledger row. :meth:`Channel.receive` takes the next incoming payload,
decodes it and writes a ``received`` row, or a ``rejected`` row with the reason when the bytes
are not a valid message: a malformed message is logged and returned as :class:`Rejected`,
never raised, so a peer cannot crash the receiver.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import topics
from .chunking import DEFAULT_CHUNK_BYTES, Reassembler, TransferCache, chunk_data_budget, needs_chunking, split
from .errors import (
    FedfleetProtocolError,
    FieldError,
    LedgerError,
    ProtocolError,
    PublishDropped,
    PublishRefused,
    TransportError,
)
from .ledger import Ledger, LedgerRow
from .lifecycle import atomic
from .messages import (
    SERVER_ID,
    Body,
    Chunk,
    Decoded,
    Encoded,
    Envelope,
    Global,
    Kind,
    Resend,
    Update,
    decode,
    encode,
    now_ms,
    payload_sha256,
    read_header,
)
from .mqtt_bytes import MQTT_V5, MQTT_V311, publish_size
from .tensors import DEFAULT_LIMITS, TensorLimits, raw_nbytes
from .transport_base import Incoming, PacketEvent, Transport

if TYPE_CHECKING:
    from .security import ChannelSecurity, Opened

log = logging.getLogger(__name__)


class ResendRefused(FieldError):
    """A well-formed ``resend`` request this side does not honour (unknown peer, a transfer it
    was not sent, indices the transfer lacks, or over the peer's resend budget)."""

    code = "resend_refused"


@dataclass(frozen=True, slots=True)
class Received:
    """A valid message.

    Attributes:
        topic: where it arrived.
        topic_info: the parsed topic.
        decoded: the envelope and its byte split.
        retain: delivered as a retained message.
        sha256: digest of the payload (for receipts).
        received_at: ``time.monotonic()`` when its (last) bytes arrived from the broker, seconds:
            deadlines are judged by arrival, not by when the receiver got round to it.
    """

    topic: str
    topic_info: topics.TopicInfo
    decoded: Decoded
    retain: bool
    sha256: bytes
    received_at: float = 0.0

    @property
    def envelope(self) -> Envelope:
        return self.decoded.envelope


@dataclass(frozen=True, slots=True)
class Rejected:
    """A payload that was not a valid message (already logged and written to the ledger).

    Attributes:
        topic: where it arrived.
        reason: the decoder's message.
        field: the offending field, when known.
        payload_bytes: its length.
        code: a :data:`protocol.security.REASONS` code for a security rejection,
            ``"resend_refused"`` for a ``resend`` request not honoured (:class:`ResendRefused`),
            else ``"invalid"`` (the bytes are not a valid message).
        kind, round, sender, seq: the refused message's header, only when it can be answered
            (``None`` otherwise; see :meth:`answerable`): its envelope header decoded although
            its body (or a later check) did not, its sender is the topic's client, its kind the
            topic's, and the payload passed the security checks when signing is on.
        sha256: digest of the refused payload (as a receipt carries it), with the header.
    """

    topic: str
    reason: str
    field: str | None
    payload_bytes: int
    code: str = "invalid"
    kind: Kind | None = None
    round: int | None = None
    sender: str | None = None
    seq: int | None = None
    sha256: bytes = b""

    @property
    def answerable(self) -> bool:
        """Whether the receiver may answer the refusal with a receipt to ``sender`` for ``seq``.

        Only when the header is as trustworthy as an accepted message's would be: read from a
        payload that passed the security checks (signature, replay) — or, with signing off, from
        a topic the broker's ACL ties to its client, as every unsigned message is — and naming
        that topic's client. A payload refused *by* the security checks (bad signature, unsigned,
        replayed …) is never answered: its sender id and seq are whatever a forger wrote, and a
        refusal receipt for another device's real ``seq`` would make that device drop an update
        the server may yet count."""
        return self.sender is not None and self.seq is not None and self.kind is not None


@dataclass(eq=False, slots=True)
class _Outgoing:
    """A message this side sent, kept until the broker took all its packets (so that a refused
    one can be sent again in smaller chunks)."""

    topic: str
    payload: bytes
    kind: str
    round: int
    sender: str
    seq: int
    client: str
    codec: str
    fields: str
    body_bytes: int
    raw_bytes: int
    retain: bool
    max_packet_bytes: int
    chunk_bytes: int
    budget_topic: str = ""
    generation: int = 0
    pending: int = 0
    tries: int = 0
    packet_bytes: int = 0
    force_chunks: bool = False
    refusal_queued: bool = False
    transfer_id: bytes | None = None
    connection: int = 0
    sent: _Sent | None = None
    dropped_gen: int = 0  # the generation said undeliverable after a packet of it was dropped unsent


@dataclass(eq=False, slots=True)
class _Sent:
    """What a caller may ask about a message sent lately (:meth:`Channel.in_flight`,
    :meth:`Channel.handed_on`, :meth:`Channel.suspect_dropped`), without its payload: ``out`` is
    held only while the message may still be sent again (packets await the broker's answer, or
    a refusal waits), so the payloads of messages long delivered are not kept."""

    topic: str
    kind: str
    round: int
    out: _Outgoing | None = None
    packet_bytes: int = 0
    connection: int = 0

    def settle(self) -> None:
        """Keep what is asked about, let the payload go (caller holds the delivery lock)."""
        out = self.out
        if out is not None and out.pending <= 0 and not out.refusal_queued:
            self.packet_bytes, self.connection, self.out = out.packet_bytes, out.connection, None


@dataclass(frozen=True, slots=True)
class _ChunkPacket:
    """One chunk in its envelope, as its PUBLISH carries it (``wire``: sealed when security is on,
    ``sig_bytes`` and ``enc_bytes`` of it added by the sealing), and the MQTT protocol level its
    ledger row is sized for (the transport's when it was made)."""

    env: Envelope
    chunk: Chunk
    wire: bytes
    sig_bytes: int
    enc_bytes: int
    protocol: int


class Channel:
    """Messages over one transport, with sequence numbers and ledger rows.

    Args:
        transport: a connected :class:`~protocol.transport_base.Transport`.
        node_id: this side's id (``"server"`` or the client id); used as envelope ``sender``.
        side: ``"server"`` or ``"agent"`` (ledger column).
        federation: federation id (topic level and ledger column).
        ledger: where rows go, or ``None`` to keep no ledger on this side.
        qos: QoS of every publish (1 by default: model traffic must not be lost).
        limits: tensor bounds applied when decoding.
        chunk_bytes: payloads longer than this (bytes) go as chunked transfers (1 MiB default).
        max_packet_bytes: the broker's maximum packet size (whole PUBLISH, bytes); 0 = no limit.
            paho does not enforce it; this channel does, by chunking.
        transfer_ttl_s: an incomplete incoming transfer without a new chunk for this long is
            dropped and reported.
        resend_after_s: a stalled incoming transfer is asked for its missing chunks after this.
        transfer_filter: senders whose chunked transfers are admitted (``None``: all). The server
            admits only joined clients and agents only the server, so chunks from made-up ids
            cannot occupy reassembly slots or memory.
        security: signing/encryption/replay state (:class:`protocol.security.ChannelSecurity`), or
            ``None``: messages go unsigned and signatures are not checked. With it, every payload
            sent is sealed (each chunk of a chunked transfer too) and every payload received is
            verified before its body is decoded; a refusal is a ``rejected`` row whose reason
            starts with its code.
        resend_burst_bytes, resend_rate_bytes_s: each peer's budget of chunk data this side
            resends on its requests (bytes; refilled at bytes per second). A ``resend`` request
            is honoured only from a known peer, for a transfer sent to it, for indices it has and
            within this budget; a refused one is a ``rejected`` row with the reason.

    Attributes:
        wire_bytes_sent, wire_bytes_received: PUBLISH packet bytes (header + topic + payload)
            this side handed to / got from MQTT; rejected payloads count as received; a packet
            the socket took only part of (the connection lost with it partly written) counts
            the part it took.
        control_bytes_sent, control_bytes_received: the same for the MQTT control packets and
            PUBLISH retransmissions (DUP) this side sent / received.
        acked, refused: PUBLISH packets the broker acknowledged / refused (QoS 1, over a
            transport that reports outcomes; the ledger's ``delivery`` column per row).
        resent_after_refusal: messages sent again in smaller chunks after a refusal.
        undeliverable: messages given up (refused and no smaller packets can help, or refused
            after :data:`MAX_REFUSAL_RESENDS` re-sends); ``undeliverable_reasons`` the last 20 why.
        learned_max_packet_bytes: the packet limit learnt from the broker's refusals, and from
            messages it acknowledged that never reached their recipient (:meth:`suspect_dropped`),
            bytes (0: none). Every later message on this channel is sized under it.
        delivered_max_packet_bytes, delivered_max_payload_bytes: the largest PUBLISH (packet,
            payload bytes) the broker delivered to this side: a size it takes from a client, so a
            message sent again after a refusal is never sized below it (see :meth:`_next_limit`).
        superseded_copies: transfers in progress dropped because another copy of their message
            (a ``global`` or ``update`` of the same sender and round, or of a later round) arrived
            whole: never asked for again (:meth:`_supersede_copies`).
        superseded_resend_requests: ``resend`` requests for a transfer this side replaced (sent
            the message again as a new transfer after a refusal): not answered, logged at debug.
        resent_chunks: chunks published again on ``resend`` requests (each copy counted).
        resent_on_broadcast: of them, chunks of a broadcast ``global`` published again on the
            broadcast topic, not on the requester's own, because their PUBLISH on the longer
            per-device topic would not fit the packet limit the transfer was cut for (cut without
            room for the requester's id: see ``budget_topic`` of :meth:`send` and
            :meth:`_publish_resend`).
        last_payload: the encoded (unsealed) payload of the last message sent.
    """

    def __init__(self, transport: Transport, *, node_id: str, side: str, federation: str,
                 ledger: Ledger | None, qos: int = 1, limits: TensorLimits = DEFAULT_LIMITS,
                 first_seq: int = 1, chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_packet_bytes: int = 0,
                 transfer_ttl_s: float = 120.0, resend_after_s: float = 5.0,
                 reassembler: Reassembler | None = None,
                 transfer_filter: Callable[[str], bool] | None = None,
                 security: ChannelSecurity | None = None,
                 resend_burst_bytes: int = 64 * 1024 * 1024, resend_rate_bytes_s: float = 16 * 1024 * 1024) -> None:
        if side not in ("server", "agent"):
            raise ValueError(f"side must be 'server' or 'agent', not {side!r}")
        self.transport = transport
        self.node_id = node_id
        self.side = side
        self.federation = federation
        self.ledger = ledger
        self.qos = qos
        self.limits = limits
        self._seq = first_seq - 1
        self._seq_lock = threading.Lock()
        self.rejected = 0
        self.wire_bytes_sent = 0
        self.wire_bytes_received = 0
        self._count_lock = threading.Lock()
        self.control_bytes_sent = 0
        self.control_bytes_received = 0
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be ≥ 1, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.max_packet_bytes = max_packet_bytes if max_packet_bytes > 0 else _NO_LIMIT
        self.resend_after_s = resend_after_s
        self.reassembler = reassembler or Reassembler(
            ttl_s=transfer_ttl_s, max_sender_transfers=4 if side == "server" else None,
            max_bytes=512 * 1024 * 1024 if side == "server" else 128 * 1024 * 1024)
        self.cache = TransferCache()
        self.transfer_filter = transfer_filter
        self.security = security
        # (packet bytes, "up"/"down", pays the round trip) -> seconds on the device's link
        self.link_time: Callable[[int, str, bool], float] | None = None
        self.resent_chunks = 0
        self.resent_on_broadcast = 0
        self.incomplete_transfers = 0
        self._resend_asked: dict[tuple[str, bytes], float] = {}
        # status topic -> (payload, what the security checks made of it) of the last message accepted
        # there: a retained copy of it handed to a renewed subscription is that message again
        self._status_opened: dict[str, tuple[bytes, Opened]] = {}
        # (sender, transfer_id) of a transfer in progress -> (kind label, round, topic) of its first chunk
        self._transfer_msgs: dict[tuple[str, bytes], tuple[str, int, str]] = {}
        self.superseded_copies = 0
        # (requester, transfer_id, chunk index) -> when that chunk was last published again for it
        self._resent_at: dict[tuple[str, bytes, int], float] = {}
        if resend_burst_bytes < 0 or resend_rate_bytes_s < 0:
            raise ValueError(f"resend_burst_bytes and resend_rate_bytes_s must be >= 0, got {resend_burst_bytes}, "
                             f"{resend_rate_bytes_s}")
        self.resend_burst_bytes = resend_burst_bytes
        self.resend_rate_bytes_s = resend_rate_bytes_s
        self._resend_budget: dict[str, tuple[float, float]] = {}  # requester -> (bytes left, when)
        self._last_maintain = 0.0
        self.acked = 0
        self.refused = 0
        self.resent_after_refusal = 0
        self.undeliverable = 0
        self.undeliverable_reasons: list[str] = []
        self.learned_max_packet_bytes = 0
        self.delivered_max_packet_bytes = 0
        self.delivered_max_payload_bytes = 0
        self.superseded_resend_requests = 0
        self.last_payload: bytes | None = None  # the unsealed payload of the last message sent
        #: whether :attr:`last_payload` is kept (an agent, which never reads it, sets it False: a
        #: model-sized payload would otherwise stay held until its next message)
        self.keep_last_payload = True
        self._delivery_lock = threading.Lock()
        # id(handle) -> (handle, ledger row, message, its generation, the row's packet bytes)
        self._handles: dict[int, tuple[object, int, _Outgoing | None, int, int]] = {}
        # the last handles acknowledged: a transport may still report one refused (a broker that closed
        # the connection right after acknowledging it, which it reports at once)
        self._acked_recently: collections.OrderedDict[int, tuple[object, int, _Outgoing | None, int, float]] = \
            collections.OrderedDict()
        # the last messages sent, by seq (what a caller may ask about: in_flight, suspect_dropped)
        self._sent: collections.OrderedDict[int, _Sent] = collections.OrderedDict()
        # transfers replaced by a smaller re-send: requests for their chunks are not answered
        self._superseded: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._early_outcomes: dict[int, tuple[object, str, str]] = {}
        self._early_sizes: dict[int, tuple[object, int]] = {}  # "resized" before the handle was tracked
        self._early_unsent: dict[int, tuple[object, int]] = {}  # "unsent" before the handle was tracked
        # (packet type, bytes) -> ids of the last control rows sent of it (a dropped one voids the last)
        self._control_rows: dict[tuple[str, int], collections.deque[int]] = {}
        # (message, its generation, why, a limit known before sending: 0 when the broker refused it)
        self._refusal_queue: collections.deque[tuple[_Outgoing, int, str, int]] = collections.deque()
        if hasattr(transport, "set_packet_listener"):
            transport.set_packet_listener(self._on_packet)
        if hasattr(transport, "set_delivery_listener"):
            transport.set_delivery_listener(self._on_delivery)

    def next_seq(self) -> int:
        """Reserve the next sequence number."""
        with self._seq_lock:
            self._seq += 1
            return self._seq

    # ------------------------------------------------------------------ sending

    @atomic
    def send(self, topic: str, body: Body, *, round: int, retain: bool = False,
             wait_s: float | None = None, recipient: str = "*", codec: Any = None,
             extra_codecs: Mapping[str, Any] | None = None, max_packet_bytes: int = 0,
             chunk_bytes: int = 0, budget_topic: str = "") -> Encoded:
        """Encode ``body``, publish it on ``topic`` (as a chunked transfer when it is larger than
        the chunk size or the packet limit) and record its ledger rows.

        The packet limit is the smallest of the channel's ``max_packet_bytes``, the broker's as
        the transport knows it (MQTT 5 CONNACK, or inferred from its disconnects), one learnt from
        the broker's refusals, and ``max_packet_bytes`` given here (a recipient's own limit: then
        the chunks are sized for MQTT 5 framing, the larger, whatever this side speaks). A QoS 1
        message the broker refuses (see :class:`~protocol.errors.PublishRefused`) is sent again
        as a chunked transfer with packets of at most half the refused packet's size, up to
        :data:`MAX_REFUSAL_RESENDS` times; a refusal that smaller packets cannot help (not
        authorised, say), or one after the last try, is logged as an error with the limit and
        counted in :attr:`undeliverable`; so is a QoS 0 message (or one of its chunks) sent while
        the link is down (:class:`~protocol.errors.PublishDropped`: MQTT keeps none for the
        reconnect), with no ``sent`` row for what never reached the socket, and one whose PUBLISH
        was handed over but still in the MQTT client's queue when the connection was lost (the
        transport reports it ``dropped``: its ``sent`` row becomes a ``message`` row with delivery
        ``dropped``, out of the wire totals; ``cut`` when the socket took part of it: the row stays
        ``sent``, with delivery ``dropped`` and the bytes the socket never took in its
        ``unsent_bytes``), or a message still unsent when the transport was closed. A QoS 1 PUBLISH
        the socket took part of before the connection was lost (``unsent``) keeps its ``sent`` row
        with those ``unsent_bytes``; paho sends it again after the reconnect (a ``PUBLISH-DUP``
        row, which gets its own ``unsent_bytes`` if it is cut too).

        A chunked message is never left half-sent without a word: when the wait for one of its
        chunks ends first (see ``wait_s``), the chunks after it are handed to the MQTT client all
        the same, without a wait (queued as that chunk is, they go out as the link moves); a chunk
        the transport does not take (it is closed, its offline buffer is full) and every chunk
        after it get ``message`` rows with delivery ``dropped`` (their sizes, out of the wire
        totals) and a WARNING naming them; they reach the recipient only if it asks for them
        again (a ``resend`` request, answered from the chunk cache). The error raised names the
        chunks handed over (:attr:`~protocol.errors.TransportError.chunks_handed` of
        ``chunk_count``, and the message text). An unchunked message the transport does not take
        gets the same: a ``message`` row with delivery ``dropped`` (its sizes, out of the wire
        totals; ``reason`` ``not handed to the MQTT client: …``) and a WARNING; the transport's
        error is raised as it is (``seq`` ``None``: nothing of it was handed over, nothing of it
        can arrive unless the caller sends it again).

        Args:
            topic: destination topic (see :mod:`protocol.topics`).
            body: the message record.
            round: round number for the envelope.
            retain: publish as retained (never for chunked transfers).
            wait_s: block until acknowledged (QoS 1) for at most this many seconds (each chunk, up
                to the first whose wait ends first: the chunks after it are handed over without a
                wait).
            recipient: ledger ``client`` for downloads (``"*"`` = broadcast).
            codec: tensor codec (:class:`protocol.tensors.Codec`) for ``global``/``update``;
                ``None`` = fp32.
            extra_codecs: codec per ``extras`` entry name (others use ``codec``).
            max_packet_bytes: the recipients' own packet limit (bytes, whole PUBLISH); 0 = none.
            chunk_bytes: the recipients' chunk size (bytes; the smaller of it and the channel's
                applies); 0 = the channel's.
            budget_topic: a longer topic a chunk of this message may be published on again
                (a broadcast ``global``'s ``down/{client}/global``, on a device's ``resend``
                request: :meth:`_publish_resend`); "" = none. When the message goes as a
                transfer under a packet limit, its chunk data budget
                (:func:`~protocol.chunking.chunk_data_budget`) is computed for the longer (in
                UTF-8 bytes) of ``topic`` and this one, so such a chunk's PUBLISH there fits the
                limit too: a few bytes less data per chunk (the topic's extra bytes), at times
                one chunk more. A message sent whole, or chunked with no packet limit, is
                unaffected; so is one under a limit that leaves less than :data:`MIN_CHUNK_DATA`
                bytes of data on the longer topic (cut for ``topic``: a resend then falls back to
                ``topic``).

        Raises:
            PublishRefused: with ``wait_s``, the broker refused it and no smaller packets can
                carry it (the message names the limit).
            PublishDropped: with ``wait_s``, a QoS 0 message while the link is down, or lost with
                the connection before the socket took it whole.
            PublishTimeout, TransportError: from the transport; one whose wait ended before the
                PUBLISH's outcome (``handle`` set) carries the message's ``seq``: its row is kept
                and it may yet reach its recipient. Of a chunked message, the first such error (or,
                when none came before, the transport's refusal to take a chunk) is raised once
                every chunk was handed over or the transport refused one, with ``chunks_handed``
                and ``chunk_count`` set.
            OfflineBufferFull, TransportError: without a ``handle``: the transport did not take
                the (unchunked) message: it is closed, its offline buffer is full (see above).
            FieldError, TensorError: the body cannot be encoded.
        """
        self._handle_refusals()
        env = Envelope(round=round, sender=self.node_id, seq=self.next_seq(), body=body, timestamp_ms=now_ms())
        enc = encode(env, codec, extra_codecs)
        client = self.node_id if self.side == "agent" else recipient
        codec_name = str(codec) if codec is not None else ("fp32" if hasattr(body, "tensors") else "")
        if extra_codecs and isinstance(body, (Global, Update)) and body.extras:  # the kinds with extras
            used = {n: str(extra_codecs.get(n, codec_name or "fp32")) for n in body.extras}
            if set(used.values()) != {codec_name}:
                codec_name = ",".join([codec_name] * bool(body.tensors) + [f"{n}={c}" for n, c in used.items()])
        fields = json.dumps(dict(enc.field_bytes), separators=(",", ":"))
        if self.security is not None:
            self.security.note_sent(env.kind, round)
        out = _Outgoing(topic=topic, payload=enc.payload, kind=env.kind.label, round=round, sender=env.sender,
                        seq=env.seq, client=client, codec=codec_name, fields=fields, body_bytes=enc.body_bytes,
                        raw_bytes=enc.raw_tensor_bytes, retain=retain,
                        max_packet_bytes=max_packet_bytes if max_packet_bytes > 0 else _NO_LIMIT,
                        chunk_bytes=min(chunk_bytes, self.chunk_bytes) if chunk_bytes > 0 else self.chunk_bytes,
                        budget_topic=budget_topic)
        self.last_payload = enc.payload if self.keep_last_payload else None
        out.sent = _Sent(topic, out.kind, round, out)
        with self._delivery_lock:
            self._sent[out.seq] = out.sent
            while len(self._sent) > _RECENT_SENT:
                self._sent.popitem(last=False)
        try:
            wire = self._deliver(out, wait_s)
        except TransportError as exc:
            if exc.handle is not None:  # the wait ended first: the message (or a chunk of it) went on, and may arrive
                exc.seq = env.seq
            raise
        with self._delivery_lock:
            out.sent.settle()  # delivered at once (no outcomes to wait for), or handed over
        # the payload as published (receipts carry its SHA-256)
        return enc if wire is None or wire is enc.payload else dataclasses.replace(enc, payload=wire)

    def _packet_limit(self, out: _Outgoing) -> tuple[int, int]:
        """(packet limit in bytes, MQTT protocol level to size packets with) for ``out``."""
        return self._limit_for(out.max_packet_bytes)

    def _limit_for(self, recipient_max_packet_bytes: int) -> tuple[int, int]:
        """(packet limit in bytes, MQTT protocol level to size packets with) for a message whose
        recipients' own limit is ``recipient_max_packet_bytes`` (:data:`_NO_LIMIT`: none), under
        the limits this side knows now."""
        limits = [self.max_packet_bytes, recipient_max_packet_bytes, self.learned_max_packet_bytes or _NO_LIMIT]
        known = getattr(self.transport, "max_packet_bytes", 0)
        if isinstance(known, int) and known > 0:
            limits.append(known)
        protocol = self._protocol()
        if recipient_max_packet_bytes < _NO_LIMIT:  # a recipient's own limit: it may speak MQTT 5, one byte more
            protocol = MQTT_V5
        return min(limits), protocol

    def _protocol(self) -> int:
        version = getattr(self.transport, "mqtt_version", MQTT_V311)
        return version if version in (MQTT_V311, MQTT_V5) else MQTT_V311

    @atomic
    def _deliver(self, out: _Outgoing, wait_s: float | None) -> bytes | None:
        """Publish ``out`` whole or chunked under its packet limit; returns the whole message's
        wire payload (``None`` when chunked). A refusal raised by the transport is handled here
        (sent again smaller, or failed loudly)."""
        limit, protocol = self._packet_limit(out)
        sec = self.security
        seal_max = sec.max_overhead if sec is not None else 0
        out.generation += 1
        gen = out.generation
        if out.sent is not None:
            with self._delivery_lock:
                out.sent.out = out  # being sent (again): in flight until its outcomes settle
        connects = getattr(self.transport, "connects", 0)
        if not isinstance(connects, int):
            connects = 0
        elif connects and not getattr(self.transport, "connected", True):
            connects += 1  # queued while the link is down: it goes out on the next connection
        out.connection = connects
        chunked = out.force_chunks or needs_chunking(out.topic, len(out.payload) + seal_max, max_packet_bytes=limit,
                                                     chunk_bytes=out.chunk_bytes, qos=self.qos, protocol=protocol)
        if not chunked:
            wire, sig_b, enc_b = out.payload, 0, 0
            if sec is not None:
                sealed = sec.seal(out.topic, out.payload)
                wire, sig_b, enc_b = sealed.payload, sealed.sig_bytes, sealed.enc_bytes
            proto = self._protocol()  # the row is sized as the packet is queued (a later move: "resized")
            try:
                handle, waited = self._hand_over(out.topic, wire, retain=out.retain, wait_s=wait_s)
            except PublishDropped as exc:
                if exc.on_wire:  # the socket took part of it: those bytes were sent
                    self._record(out.topic, "sent", out.kind, out.round, out.sender, out.seq, client=out.client,
                                 payload_bytes=len(wire), body_bytes=out.body_bytes, qos=self.qos, retain=out.retain,
                                 codec=out.codec, raw_bytes=out.raw_bytes, fields=out.fields, sig_bytes=sig_b,
                                 enc_bytes=enc_b, delivery="dropped", reason=str(exc)[:500], protocol=proto,
                                 unsent_bytes=exc.unsent_bytes)
                self._dropped(out, exc, wait_s)
                return wire
            except PublishRefused as exc:
                self._record(out.topic, "message", out.kind, out.round, out.sender, out.seq, client=out.client,
                             payload_bytes=len(wire), body_bytes=out.body_bytes, qos=self.qos, retain=out.retain,
                             codec=out.codec, raw_bytes=out.raw_bytes, fields=out.fields, reason=exc.reason[:500],
                             sig_bytes=sig_b, enc_bytes=enc_b, delivery="refused")
                self.refused += 1
                self._refused_again(out, gen, exc.packet_bytes or self._size(out.topic, len(wire)), exc.limit_bytes,
                                    exc.reason, wait_s, sent=False)
                return wire
            except TransportError as exc:  # not taken (closed, no room): never handed over, as a chunk can be
                self._not_handed_whole(out, wire, sig_b, enc_b, proto, exc)
                raise
            row = self._record(out.topic, "sent", out.kind, out.round, out.sender, out.seq, client=out.client,
                               payload_bytes=len(wire), body_bytes=out.body_bytes, qos=self.qos, retain=out.retain,
                               codec=out.codec, raw_bytes=out.raw_bytes, fields=out.fields, sig_bytes=sig_b,
                               enc_bytes=enc_b, delivery="handed", protocol=proto)
            out.packet_bytes = self._size(out.topic, len(wire), proto)
            self._track(handle, row, out, gen, out.packet_bytes)
            if waited is not None:
                raise waited
            return wire
        budget = out.chunk_bytes
        if limit < _NO_LIMIT:
            budget = min(budget, self._data_budget(out, limit, protocol, seal_max))
        if budget < (MIN_CHUNK_DATA if out.tries else 1):
            why = (f"{self.node_id}: {out.kind} of round {out.round} ({len(out.payload):,} bytes) on {out.topic} "
                   f"cannot be sent: max_packet_bytes {limit:,} leaves no room for chunk data "
                   f"({max(budget, 0)} bytes; at least {MIN_CHUNK_DATA} needed after a refusal)")
            if not out.tries:
                raise FieldError(why, field="max_packet_bytes")
            self._undeliverable(out, why)
            if wait_s is not None:
                raise PublishRefused(why, topic=out.topic, reason=why, limit_bytes=limit)
            return None
        chunks = split(out.payload, chunk_bytes=budget)
        tid = chunks[0].transfer_id
        if out.transfer_id is not None:
            self.cache.discard(out.transfer_id)  # replaced: its chunks are not sent again on resend requests
            self._superseded[out.transfer_id] = None
            while len(self._superseded) > 1024:
                self._superseded.popitem(last=False)
        out.transfer_id = tid
        self.cache.put(tid, chunks, meta=(out.topic, out.round, out.kind, out.client, out.max_packet_bytes))
        self._record(out.topic, "message", out.kind, out.round, out.sender, out.seq, client=out.client,
                     payload_bytes=len(out.payload), body_bytes=out.body_bytes, qos=self.qos, retain=False,
                     codec=out.codec, raw_bytes=out.raw_bytes, fields=out.fields, transfer_id=tid.hex(),
                     chunk_count=len(chunks))
        out.packet_bytes = 0
        try:
            self._publish_chunks(chunks, out.topic, out.round, out.kind, out.client, wait_s, track=(out, gen))
        except PublishDropped as exc:  # the chunks after it are not sent either: the message is lost whole
            self._dropped(out, exc, wait_s)
        except PublishRefused as exc:
            self.refused += 1
            self._refused_again(out, gen, exc.packet_bytes, exc.limit_bytes, exc.reason, wait_s, sent=False)
        return None

    def _data_budget(self, out: _Outgoing, limit: int, protocol: int, seal_max: int) -> int:
        """Chunk data bytes a PUBLISH of ``out``'s under ``limit`` may carry, after ``seal_max``
        bytes of seal: :func:`~protocol.chunking.chunk_data_budget` on the longer (UTF-8 bytes)
        of ``out.topic`` and ``out.budget_topic`` (:meth:`send`); on ``out.topic`` alone when the
        longer one leaves under :data:`MIN_CHUNK_DATA` bytes (≤ 0: no room at all)."""
        cut_on = [out.topic]
        if len(out.budget_topic.encode("utf-8")) > len(out.topic.encode("utf-8")):
            cut_on.insert(0, out.budget_topic)
        budget = 0
        for topic in cut_on:
            try:
                budget = chunk_data_budget(topic, limit, qos=self.qos, sender=self.node_id, round=out.round,
                                           protocol=protocol) - seal_max
            except ValueError:
                budget = 0
            if budget >= MIN_CHUNK_DATA:
                break
        return budget

    def encoded_size(self, body: Body, codec: Any = None, extra_codecs: Mapping[str, Any] | None = None) -> int:
        """Payload bytes ``body`` would take (for link emulation; encodes once, sends nothing)."""
        return len(encode(Envelope(round=0, sender=self.node_id, seq=1, body=body), codec, extra_codecs).payload)

    @atomic
    def _publish_chunks(self, chunks: list[Chunk], topic: str, round: int, kind_label: str, client: str,
                        wait_s: float | None, track: tuple[_Outgoing, int] | None = None,
                        packets: list[_ChunkPacket] | None = None) -> None:
        """Hand ``chunks`` (of one transfer, in order) to the transport, each sealed in an envelope
        of its own, with a ``sent`` ledger row (delivery ``handed``; ``track``: the message and its
        generation, whose delivery the chunks' outcomes count in, ``None`` for chunks asked for
        again of a message no longer held; ``packets``: the chunks' packets made already for
        ``topic`` by :meth:`_chunk_packet`, one per chunk, ``None``: made here).

        ``wait_s`` (seconds) bounds each chunk's wait for its acknowledgement until a wait ends
        before its chunk's outcome (:class:`~protocol.errors.PublishTimeout`, or the transport
        closed while it waited): the MQTT client took that chunk (it keeps its row and goes out as
        the link moves), and the chunks after it are handed over all the same, without a wait,
        queued as it is, so the message can complete; then that error is raised.

        A chunk the transport does not take (a :class:`~protocol.errors.TransportError` without a
        handle: the transport is closed, its offline buffer is full) ends the transfer there: it and
        every chunk after it are never offered again, each gets a ``message`` row with delivery
        ``dropped``, its whole sizes (out of the wire totals) and the reason, a WARNING names them,
        and the error is raised (the wait's, if one ended before). They reach the recipient only if
        it asks for them again (a ``resend`` request, answered from :attr:`cache`).

        Raises:
            PublishDropped: a chunk not sent (QoS 0 with the link down; its row: see :meth:`send`):
                the chunks after it are not offered, the caller says the message undeliverable.
            PublishRefused: a chunk above a limit the transport learnt since the chunks were cut (a
                ``message`` row, delivery ``refused``): the chunks after it are not offered, the
                caller sends the message again smaller.
            PublishTimeout, TransportError: as above; ``chunks_handed`` and ``chunk_count`` set
                and the message naming the chunks
                (:meth:`~protocol.errors.TransportError.note_chunks`).
        """
        out = track[0] if track is not None else None
        what = f"{kind_label} of round {round}" + (f" (seq {out.seq})" if out is not None else "")
        count = chunks[0].count if chunks else 0
        waited: TransportError | None = None  # the first wait that ended before its chunk's outcome
        waited_at = 0
        for i, c in enumerate(chunks):
            pkt = packets[i] if packets is not None else self._chunk_packet(topic, round, c)
            wait = wait_s if waited is None else None  # after a wait that ended first: queued without one
            try:
                handle, ended = self._hand_over(topic, pkt.wire, retain=False, wait_s=wait)
            except PublishDropped as exc:
                if exc.on_wire:  # the socket took part of it: those bytes were sent
                    self._record_chunk(topic, kind_label, client, pkt, "sent", "dropped", str(exc), exc.unsent_bytes)
                raise
            except PublishRefused as exc:  # above a limit the transport learnt since the chunks were cut
                self._record_chunk(topic, kind_label, client, pkt, "message", "refused", exc.reason)
                raise
            except TransportError as exc:  # not taken (closed, no room): nor are the chunks after it offered
                handed, note = self._not_handed(topic, kind_label, client, what, chunks[:i], pkt, chunks[i + 1:], exc,
                                                say_why=waited is not None)
                if waited is None:
                    exc.note_chunks(handed, count, f"{what} in {count} chunks: {note}")
                    raise
                waited.note_chunks(handed, count, f"{what} in {count} chunks: the wait for chunk "
                                                  f"{chunks[waited_at].index + 1} ended first; {note}")
                raise waited from exc
            row = self._record_chunk(topic, kind_label, client, pkt, "sent", "handed")
            size = self._size(topic, len(pkt.wire), pkt.protocol)
            if out is not None:
                out.packet_bytes = max(out.packet_bytes, size)
            self._track(handle, row, out, track[1] if track is not None else 0, size)
            if ended is not None and waited is None:
                waited, waited_at = ended, i
        if waited is not None:  # every chunk handed over
            span = f"all {count}" if len(chunks) == count else _chunk_span([c.index for c in chunks], count)
            waited.note_chunks(len(chunks), count, f"{what} in {count} chunks: the wait for chunk "
                                                   f"{chunks[waited_at].index + 1} ended first; {span} handed to the "
                                                   "MQTT client (queued: they go out as the link moves)")
            raise waited

    def _not_handed(self, topic: str, kind_label: str, client: str, what: str, handed: list[Chunk],
                    first: _ChunkPacket, rest: list[Chunk], exc: TransportError, *, say_why: bool) -> tuple[int, str]:
        """The transport did not take the chunk of ``first`` (``exc``, without a handle), after the
        ``handed`` chunks; it and the ``rest`` (never offered) each get a ``message`` row with
        delivery ``dropped``, their whole sizes and the reason, and a WARNING names them (``what``:
        the message). Returns how many chunks were handed over and a note naming the chunks that
        were not (and why, with ``say_why``) and those that were."""
        reason = f"not handed to the MQTT client: {exc}"
        self._record_chunk(topic, kind_label, client, first, "message", "dropped", reason)
        for c in rest:  # one sealed packet at a time: a model-sized transfer is not held twice
            self._record_chunk(topic, kind_label, client, self._chunk_packet(topic, first.env.round, c), "message",
                               "dropped", reason)
        count = first.chunk.count
        missing = _chunk_span([first.chunk.index] + [c.index for c in rest], count)
        indices = [c.index for c in handed]
        were = f"{_chunk_span(indices)} {'was' if len(indices) == 1 else 'were'}" if indices else "none of them were"
        log.warning("%s: %s: %s (transfer %s) not handed to the MQTT client: %s; %s; they reach the recipient only if "
                    "it asks for them again (a resend request, answered from the chunk cache)", self.node_id, what,
                    missing, first.chunk.transfer_id.hex(), exc, were)
        return len(indices), f"{missing} not handed to the MQTT client{f' ({exc})' if say_why else ''}; {were}"

    def _not_handed_whole(self, out: _Outgoing, wire: bytes, sig_bytes: int, enc_bytes: int, protocol: int,
                          exc: TransportError) -> None:
        """The transport did not take the PUBLISH of unchunked ``out`` (``wire``, its payload as it
        would have gone out: ``sig_bytes`` and ``enc_bytes`` of it added by the sealing; sized for
        MQTT ``protocol``): ``exc``, without a handle (the transport is closed, its offline buffer
        is full). Its ``message`` row gets delivery ``dropped``, the whole sizes (out of the wire
        totals: no byte of it reached the MQTT client) and the reason ``not handed to the MQTT
        client: …``, as a chunk's does (:meth:`_not_handed`), and a WARNING names it. The message
        is not said undeliverable: the caller gets ``exc`` and may send it again."""
        reason = f"not handed to the MQTT client: {exc}"
        self._record(out.topic, "message", out.kind, out.round, out.sender, out.seq, client=out.client,
                     payload_bytes=len(wire), body_bytes=out.body_bytes, qos=self.qos, retain=out.retain,
                     codec=out.codec, raw_bytes=out.raw_bytes, fields=out.fields, sig_bytes=sig_bytes,
                     enc_bytes=enc_bytes, reason=reason[:500], delivery="dropped", protocol=protocol)
        log.warning("%s: %s of round %d (seq %d, %s bytes) on %s not handed to the MQTT client: %s; it reaches its "
                    "recipient only if it is sent again", self.node_id, out.kind, out.round, out.seq,
                    f"{len(wire):,}", out.topic, exc)

    def _chunk_packet(self, topic: str, round: int, chunk: Chunk) -> _ChunkPacket:
        """``chunk`` in an envelope of its own (the next seq), sealed on its own (protocol.security)."""
        env = Envelope(round=round, sender=self.node_id, seq=self.next_seq(), body=chunk, timestamp_ms=now_ms())
        wire, sig_b, enc_b = encode(env).payload, 0, 0
        if self.security is not None:
            sealed = self.security.seal(topic, wire)
            wire, sig_b, enc_b = sealed.payload, sealed.sig_bytes, sealed.enc_bytes
        return _ChunkPacket(env, chunk, wire, sig_b, enc_b, self._protocol())

    def _record_chunk(self, topic: str, kind_label: str, client: str, pkt: _ChunkPacket, event: str, delivery: str,
                      reason: str = "", unsent_bytes: int = 0) -> int:
        """The ledger row of the PUBLISH of one chunk (see :meth:`_record`); returns its id."""
        c = pkt.chunk
        return self._record(topic, event, kind_label, pkt.env.round, pkt.env.sender, pkt.env.seq, client=client,
                            payload_bytes=len(pkt.wire), body_bytes=len(c.data), qos=self.qos, retain=False,
                            transfer_id=c.transfer_id.hex(), chunk_index=c.index, chunk_count=c.count,
                            sig_bytes=pkt.sig_bytes, enc_bytes=pkt.enc_bytes, reason=reason[:500], delivery=delivery,
                            protocol=pkt.protocol, unsent_bytes=unsent_bytes)

    def _hand_over(self, topic: str, wire: bytes, *, retain: bool,
                   wait_s: float | None) -> tuple[object | None, TransportError | None]:
        """Publish one PUBLISH: ``(handle, None)``, or ``(handle, error)`` when its wait ended before
        its outcome (:class:`~protocol.errors.PublishTimeout`, the transport closed while it waited:
        the MQTT client took it, the error's ``handle``): the caller writes its row and tracks the
        handle like any other, then raises the error.

        Raises:
            TransportError: any other (nothing of it was handed over, ``handle`` ``None``).
        """
        try:
            return self.transport.publish(topic, wire, qos=self.qos, retain=retain, wait_s=wait_s), None
        except TransportError as exc:
            if exc.handle is None:
                raise
            return exc.handle, exc

    # ------------------------------------------------------------------ delivery outcomes

    def _size(self, topic: str, payload_bytes: int, protocol: int | None = None) -> int:
        return publish_size(topic, payload_bytes, self.qos,
                            protocol=self._protocol() if protocol is None else protocol).packet_bytes

    def _track(self, handle: object, row: int, out: _Outgoing | None, gen: int, packet_bytes: int) -> None:
        """Remember which ledger row (of ``packet_bytes``), and outgoing message, a transport
        handle belongs to, and apply what arrived before this call (a fast PUBACK, a QoS 0 packet
        written at once, a size change, a packet the socket took part of). QoS 0 handles are
        tracked only over a transport that reports their outcomes (``qos0_outcomes``: ``written``,
        or ``dropped`` / ``cut`` when the connection was lost before the socket took them whole)."""
        if handle is None or not hasattr(self.transport, "set_delivery_listener"):
            return
        if self.qos == 0 and getattr(self.transport, "qos0_outcomes", False) is not True:
            return
        with self._delivery_lock:
            sized = self._early_sizes.pop(id(handle), None)
            resize = sized[1] if sized is not None and sized[0] is handle and sized[1] != packet_bytes else 0
            cut = self._early_unsent.pop(id(handle), None)
            unsent = cut[1] if cut is not None and cut[0] is handle else 0
            early = self._early_outcomes.pop(id(handle), None)
            if early is not None and early[0] is handle:
                outcome, reason = early[1], early[2]
            else:
                outcome = reason = ""
                if out is not None:
                    out.pending += 1
                self._handles[id(handle)] = (handle, row, out, gen, resize or packet_bytes)
        if resize:
            self._resized(row, out, packet_bytes, resize)
            packet_bytes = resize
        if unsent:
            self._unsent(row, unsent)
        if outcome:
            self._outcome(handle, row, out, gen, outcome, reason, counted=False, packet_bytes=packet_bytes)

    def _resized(self, row: int, out: _Outgoing | None, was: int, now: int) -> None:
        """The PUBLISH of ledger row ``row`` goes out as ``now`` bytes, not the ``was`` it was
        recorded with (moved to a client of another MQTT protocol level): the row and the wire
        count follow."""
        with self._count_lock:
            self.wire_bytes_sent += now - was
        if out is not None:
            with self._delivery_lock:
                if out.packet_bytes == was:
                    out.packet_bytes = now
        if self.ledger is not None and row:
            try:
                self.ledger.resize(row, now)
            except LedgerError as exc:  # never break the caller's thread
                log.warning("%s: size of ledger row %d not corrected: %s", self.node_id, row, exc)

    def _unsent(self, row: int, unsent_bytes: int) -> None:
        """The socket never took ``unsent_bytes`` of the PUBLISH of ledger row ``row`` (the
        connection was lost, or the transport closed, with the packet partly written): the row's
        ``unsent_bytes`` and the wire count follow."""
        with self._count_lock:
            self.wire_bytes_sent -= unsent_bytes
        if self.ledger is not None and row:
            try:
                self.ledger.set_unsent(row, unsent_bytes)
            except LedgerError as exc:  # never break the caller's thread
                log.warning("%s: unsent bytes of ledger row %d not recorded: %s", self.node_id, row, exc)

    def _on_delivery(self, handle: object, outcome: str, reason: str) -> None:
        """The transport's delivery listener (network thread): note the outcome on the row. A
        refusal of a handle already acknowledged (the broker closed the connection right after its
        PUBACK) turns its row to ``refused`` and sends the message again smaller; so does
        ``withdrawn`` (a refusal of a message none of whose PUBLISH packets reached the socket,
        whose row then leaves the wire totals). ``resized``
        (a size change, not an outcome) corrects the row's size and keeps the handle; so does
        ``unsent`` (the bytes of the PUBLISH the socket never took, ``reason``) for the row's
        ``unsent_bytes``."""
        if outcome == "unsent":
            try:
                unsent = int(reason)
            except ValueError:
                log.warning("%s: %r unsent bytes not understood", self.node_id, reason)
                return
            with self._delivery_lock:
                entry = self._handles.get(id(handle))
                if entry is None or entry[0] is not handle:
                    if len(self._early_unsent) > 10_000:
                        self._early_unsent.clear()
                    self._early_unsent[id(handle)] = (handle, unsent)
                    return
            self._unsent(entry[1], unsent)
            return
        if outcome == "resized":
            try:
                size = int(reason)
            except ValueError:
                log.warning("%s: a resize to %r bytes not understood", self.node_id, reason)
                return
            with self._delivery_lock:
                entry = self._handles.get(id(handle))
                if entry is None or entry[0] is not handle:
                    if len(self._early_sizes) > 10_000:
                        self._early_sizes.clear()
                    self._early_sizes[id(handle)] = (handle, size)
                    return
                self._handles[id(handle)] = (*entry[:4], size)
            if size != entry[4]:
                self._resized(entry[1], entry[2], entry[4], size)
            return
        packet_bytes = 0
        with self._delivery_lock:
            entry = self._handles.pop(id(handle), None)
            if entry is None or entry[0] is not handle:
                if entry is not None:  # another handle with a reused id: keep it
                    self._handles[id(handle)] = entry
                late = self._acked_recently.pop(id(handle), None) if outcome == "refused" else None
                if late is not None and late[0] is handle:
                    self.acked -= 1  # counted again below, as refused
                    _, row, out, gen, _ = late
                    if out is not None:
                        out.pending += 1  # taken back below
                else:
                    if late is not None:
                        self._acked_recently[id(handle)] = late
                    if len(self._early_outcomes) > 10_000:
                        self._early_outcomes.clear()
                    self._early_outcomes[id(handle)] = (handle, outcome, reason)
                    return
            else:
                _, row, out, gen, packet_bytes = entry
        self._outcome(handle, row, out, gen, outcome, reason, counted=True, packet_bytes=packet_bytes)

    def _outcome(self, handle: object, row: int, out: _Outgoing | None, gen: int, outcome: str, reason: str, *,
                 counted: bool, packet_bytes: int = 0) -> None:
        """Apply the final ``outcome`` of ``handle`` (ledger row ``row`` of ``packet_bytes``, of
        ``out``'s generation ``gen``; ``counted``: the handle was tracked, its message's pending count
        holds it): ``written`` and ``acked`` keep the row on the wire; ``dropped`` / ``cut`` see
        :meth:`_lost`; ``refused`` and ``withdrawn`` (refused before any PUBLISH of it reached the
        socket: the row leaves the wire totals, ``event`` ``message``) queue the message to be sent
        again smaller."""
        if outcome == "written":  # a QoS 0 PUBLISH the socket took whole: its row stays "handed"
            if out is not None:
                with self._delivery_lock:
                    if counted:
                        out.pending -= 1
                    if out.sent is not None:
                        out.sent.settle()
            return
        if outcome in ("dropped", "cut"):
            self._lost(row, out, gen, outcome == "cut", reason, counted=counted, packet_bytes=packet_bytes)
            return
        if outcome == "acked":
            self.acked += 1
            with self._delivery_lock:
                # the message itself only while the transport may still report it refused
                held = out if self._ack_hold_s() > 0 else None
                self._acked_recently[id(handle)] = (handle, row, held, gen, time.monotonic())
                while len(self._acked_recently) > _ACKED_RECENTLY:
                    _, (_, _, gone, _, _) = self._acked_recently.popitem(last=False)
                    if gone is not None and gone.sent is not None:
                        gone.sent.settle()
        else:
            self.refused += 1
        on_wire = outcome != "withdrawn"  # refused before a byte of it was written: its row leaves the wire totals
        if not on_wire:
            with self._count_lock:
                self.wire_bytes_sent -= packet_bytes
        if self.ledger is not None and row:
            try:
                self.ledger.set_delivery(row, "acked" if outcome == "acked" else "refused", reason, on_wire=on_wire)
            except LedgerError as exc:  # never break the network thread; the row keeps "handed"
                log.warning("%s: delivery of ledger row %d not recorded: %s", self.node_id, row, exc)
        if out is None:
            return
        connects = getattr(self.transport, "connects", 0) if outcome == "acked" else 0
        with self._delivery_lock:
            if counted:
                out.pending -= 1
            if isinstance(connects, int) and connects > out.connection:
                # the broker took it on this connection: one handed before a link broke went out again after
                out.connection = connects
            if outcome != "acked" and gen == out.generation and not out.refusal_queued:
                out.refusal_queued = True
                self._refusal_queue.append((out, gen, reason, 0))
            if out.sent is not None and not any(e[2] is out for e in self._acked_recently.values()):
                out.sent.settle()

    def _lost(self, row: int, out: _Outgoing | None, gen: int, on_wire: bool, reason: str, *, counted: bool,
              packet_bytes: int) -> None:
        """A PUBLISH of ``out`` (generation ``gen``) that will never be sent (a QoS 0 one the lost
        connection took out of the MQTT client's queue, anything unsent at the transport's close):
        its ``sent`` row says ``dropped``, and leaves the wire totals (``event`` ``message``) unless
        the socket took part of it (``on_wire``); the message is said undeliverable (once per
        generation: the other chunks of a transfer add no more)."""
        if not on_wire:
            with self._count_lock:
                self.wire_bytes_sent -= packet_bytes
        if self.ledger is not None and row:
            try:
                self.ledger.set_delivery(row, "dropped", reason, on_wire=on_wire)
            except LedgerError as exc:  # never break the network thread; the row keeps "handed"
                log.warning("%s: loss of ledger row %d not recorded: %s", self.node_id, row, exc)
        if out is None:  # a chunk asked for again of a message no longer held
            self.undeliverable += 1
            self.undeliverable_reasons.append(f"a PUBLISH not sent: {reason}")
            del self.undeliverable_reasons[:-20]
            log.error("%s: a PUBLISH (ledger row %d) not sent: %s", self.node_id, row, reason)
            return
        with self._delivery_lock:
            if counted:
                out.pending -= 1
            say = gen == out.generation and out.dropped_gen != gen
            if say:
                out.dropped_gen = gen
            if out.sent is not None:
                out.sent.settle()
        if say:
            self._undeliverable(out, f"{self.node_id}: {out.kind} of round {out.round} ({len(out.payload):,} bytes) "
                                     f"on {out.topic} not sent: {reason}", not_sent=True)

    def _ack_hold_s(self) -> float:
        """Seconds an acknowledged message is held for a refusal its transport may report after
        the acknowledgement: the transport's ``ack_refusal_window_s`` (MQTT 5: 0, a PUBACK there
        carries its own reason code) or :data:`_ACKED_HOLD_S` for a transport that says nothing."""
        window = getattr(self.transport, "ack_refusal_window_s", _ACKED_HOLD_S)
        return float(window) if isinstance(window, (int, float)) else _ACKED_HOLD_S

    def _release_acked(self, now: float) -> None:
        """Keep the row of each acknowledged handle, but not its message once it was acknowledged
        :meth:`_ack_hold_s` ago: a refusal after the acknowledgement comes within
        :data:`protocol.transport.ACK_CLOSE_S` of it or not at all, and an agent's update would
        otherwise stay held (payload and all) until eight more of its messages were acknowledged,
        a round or more later."""
        hold = self._ack_hold_s()
        with self._delivery_lock:
            for key, (handle, row, out, gen, at) in list(self._acked_recently.items()):
                if out is not None and now - at > hold:
                    self._acked_recently[key] = (handle, row, None, gen, at)
                    if out.sent is not None and not any(e[2] is out for e in self._acked_recently.values()):
                        out.sent.settle()

    def _handle_refusals(self) -> None:
        """Send again (smaller) every message refused since the last call (caller's thread)."""
        while self._refusal_queue:
            with self._delivery_lock:
                if not self._refusal_queue:
                    return
                out, gen, reason, limit = self._refusal_queue.popleft()
                out.refusal_queued = False
            if gen == out.generation:
                self._refused_again(out, gen, out.packet_bytes, limit, reason, None, sent=not limit)
            with self._delivery_lock:
                if out.sent is not None:
                    out.sent.settle()

    def _next_limit(self, topic: str, packet_bytes: int, step: int = 2) -> int:
        """Packet limit (bytes) to send a message on ``topic`` again under after packets of
        ``packet_bytes`` were refused (``step`` 2: half) or lost without a word (``step`` 4: a
        quarter, as each further try waits for another timeout), or the largest packet the
        broker was seen to deliver (:meth:`delivered_packet_bytes`) when that is smaller than
        ``packet_bytes`` but at least an eighth of it (a size the broker is known to take: the
        next try cannot fail for its size, where halving might take three more tries)."""
        proven = self.delivered_packet_bytes(topic)
        return proven if packet_bytes // 8 <= proven < packet_bytes else max(1, packet_bytes // step)

    def delivered_packet_bytes(self, topic: str) -> int:
        """The largest PUBLISH packet (bytes) on ``topic`` that is known to fit the broker's limits:
        one no larger than the largest packet it delivered to this side, carrying no more payload
        than the largest payload it delivered (a limit on the whole packet, such as
        ``max_packet_size``, and one on the payload, such as Mosquitto's ``message_size_limit``,
        both hold). 0 before anything was delivered."""
        if not self.delivered_max_packet_bytes:
            return 0
        return min(self.delivered_max_packet_bytes, self._size(topic, self.delivered_max_payload_bytes))

    def in_flight(self, seq: int) -> bool:
        """Whether the message this side sent with envelope ``seq`` (one of its last few hundred)
        is still being delivered: a packet of it awaits the broker's acknowledgement, or a refusal
        of it waits to be sent again smaller."""
        with self._delivery_lock:
            sent = self._sent.get(seq)
            out = sent.out if sent is not None else None
            return out is not None and (out.pending > 0 or out.refusal_queued)

    def handed_on(self, seq: int) -> int:
        """The transport connection (its ``connects`` count, 1 = the first) on which the last copy
        of the message with envelope ``seq`` went out (a re-send after a refusal counts; one handed
        while the link was down goes out on the next connection; one the broker acknowledged on a
        later connection than it was handed on, as the MQTT client sends it again after a
        reconnect, went out on that one), 0 when unknown (not one of the last messages sent, or a
        transport that does not count its connections)."""
        with self._delivery_lock:
            sent = self._sent.get(seq)
            if sent is None:
                return 0
            return sent.out.connection if sent.out is not None else sent.connection

    def suspect_dropped(self, seq: int) -> int:
        """The message this side sent with envelope ``seq`` was acknowledged by the broker (or never
        refused) but its recipient never confirmed it (a receipt that did not come): a broker that
        drops messages above a size limit it does not announce (Mosquitto's ``message_size_limit``
        over MQTT 3.1.1 acknowledges them all the same) may have taken it.

        When its packets were larger than the broker is known to take
        (:meth:`delivered_packet_bytes`) by more than :data:`NEAR_DELIVERED_FRACTION` (at least
        :data:`MIN_SUSPECTED_PACKET` bytes more), and larger than :data:`MIN_SUSPECTED_PACKET`, the
        limit is taken to be below them: the packet limit to
        send it again under (:meth:`_next_limit`: a quarter of them, or the largest size the
        broker delivered when that is at least an eighth) becomes the learned limit of this channel
        (:attr:`learned_max_packet_bytes`, logged), which every later message is sized under. When
        they were not, the size was not the cause and nothing is learned: a limit set in the few
        bytes between a size the broker delivered and one just above it is far less likely than a
        recipient too busy to answer in time (seen under CPU load: a 423,704-byte update taken for
        dropped because the 423,672-byte global had been delivered, and every later packet capped
        at 423,672 bytes).

        Over MQTT 5 nothing is learned: such a broker refuses a PUBLISH it will not forward in its
        PUBACK (Mosquitto 2.0 answers 0x95 for one over ``message_size_limit``; one over the
        Maximum Packet Size its CONNACK announced is a DISCONNECT), both refusals of their own
        (:meth:`_refused_again`); a message it acknowledged and no recipient confirmed was lost
        some other way (the recipient's link or process down, as a server killed and resumed).

        Returns:
            The packet limit (bytes, at least :data:`MIN_SUSPECTED_PACKET`) to send the message
            again under, 0 when ``seq`` is not one of the last messages sent or nothing smaller is
            called for (send it as before).
        """
        with self._delivery_lock:
            sent = self._sent.get(seq)
            if sent is None:
                return 0
            packet = sent.out.packet_bytes if sent.out is not None else sent.packet_bytes
        if packet <= MIN_SUSPECTED_PACKET or self._protocol() == MQTT_V5:
            return 0
        proven = self.delivered_packet_bytes(sent.topic)
        if proven and packet - proven <= max(MIN_SUSPECTED_PACKET, int(packet * NEAR_DELIVERED_FRACTION)):
            return 0
        limit = max(self._next_limit(sent.topic, packet, step=4), MIN_SUSPECTED_PACKET)
        prev = self.learned_max_packet_bytes
        if not prev or limit < prev:
            self.learned_max_packet_bytes = limit
            log.warning("%s: the %s of round %d (%d-byte packets) was not confirmed by its recipient: taken for a "
                        "message the broker dropped above a size limit it does not announce; packets of at most %d "
                        "bytes from now on (the largest the broker delivered here: %d bytes)", self.node_id,
                        sent.kind, sent.round, packet, limit, proven)
        return limit

    def _refused_again(self, out: _Outgoing, gen: int, packet_bytes: int, limit_bytes: int, reason: str,
                       wait_s: float | None, *, sent: bool) -> None:
        """``out`` (its generation ``gen``) was refused: send it again as chunks of packets of at
        most half of ``packet_bytes`` (or of a size the broker is known to take,
        :meth:`_next_limit`; and under ``limit_bytes`` when known), or fail loudly."""
        helps = not any(code in reason for code in _FINAL_REFUSALS)
        if not helps or out.tries >= MAX_REFUSAL_RESENDS:
            why = (f"{self.node_id}: {out.kind} of round {out.round} ({len(out.payload):,} bytes) on {out.topic} "
                   f"refused by the broker{' again' if out.tries else ''}: {reason}; "
                   + ("smaller packets cannot help" if not helps else
                      f"not sent again after {out.tries} chunked re-sends (last packets ≤ {packet_bytes:,} bytes)"))
            self._undeliverable(out, why)
            if wait_s is not None:
                raise PublishRefused(why, topic=out.topic, reason=reason, packet_bytes=packet_bytes,
                                     limit_bytes=limit_bytes)
            return
        new_limit = self._next_limit(out.topic, packet_bytes)
        if limit_bytes and not sent:  # not sent: above a limit already known, which is all it must fit
            new_limit = limit_bytes
        elif limit_bytes:
            new_limit = min(new_limit, limit_bytes)
        prev = self.learned_max_packet_bytes
        self.learned_max_packet_bytes = new_limit if not prev else min(prev, new_limit)
        out.tries += 1
        out.force_chunks = True
        out.max_packet_bytes = min(out.max_packet_bytes, new_limit)
        self.resent_after_refusal += 1
        log.warning("%s: %s of round %d (%d bytes) %s by the broker (%s): sending it again in packets of at most "
                    "%d bytes (%d/%d)", self.node_id, out.kind, out.round, len(out.payload),
                    "refused" if sent else "not taken", reason, out.max_packet_bytes, out.tries, MAX_REFUSAL_RESENDS)
        self._deliver(out, wait_s)

    def _dropped(self, out: _Outgoing, exc: PublishDropped, wait_s: float | None) -> None:
        """``out`` (or one of its chunks) was not sent: QoS 0 while the link was down
        (:class:`~protocol.errors.PublishDropped`). Said as undeliverable (a ledger row, the
        error log, :attr:`undeliverable`); raised again with ``wait_s``."""
        self._undeliverable(out, f"{out.kind} of round {out.round} ({len(out.payload):,} bytes) not sent: {exc}",
                            not_sent=True)
        if wait_s is not None:
            raise exc

    def _undeliverable(self, out: _Outgoing, why: str, *, not_sent: bool = False) -> None:
        """Give ``out`` up: counted, logged, and an ``undeliverable`` ledger row. ``not_sent``: the
        broker never saw it (QoS 0 while the link was down, or still queued when the connection
        or the transport closed): the row's delivery is ``dropped``, which the audit tells apart
        from a message given up after the broker's refusals."""
        self.undeliverable += 1
        self.undeliverable_reasons.append(why)
        del self.undeliverable_reasons[:-20]
        log.error("%s", why)
        self._record(out.topic, "message", "undeliverable", out.round, out.sender, out.seq, client=out.client,
                     payload_bytes=0, body_bytes=0, qos=self.qos, retain=False, reason=why[:500],
                     delivery="dropped" if not_sent else "")

    # ------------------------------------------------------------------ receiving

    def receive(self, timeout_s: float | None) -> Received | Rejected | None:
        """Next whole message, decoded; ``None`` after ``timeout_s`` seconds.

        Chunks are reassembled here (a transfer returns one :class:`Received` when complete);
        stalled transfers are asked for their missing chunks and dropped after their TTL.
        An empty payload on a ``status`` topic (a cleared retained presence) is skipped; on any
        other topic it is a :class:`Rejected` with a ``rejected`` ledger row.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._maintain()
            if deadline is None:
                wait = self.resend_after_s
            else:
                wait = max(0.0, min(deadline - time.monotonic(), self.resend_after_s))
            inc = self.transport.get(wait)
            if inc is None:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            if not inc.payload and "/status/" in inc.topic:
                continue  # a cleared retained presence (an empty retained publish): no message
            item = self.accept(inc)
            if item is not None:
                return item

    @atomic
    def accept(self, inc: Incoming) -> Received | Rejected | None:
        """Decode one incoming payload and write its ledger row (never raises on bad bytes).

        With security on, a ``status`` delivered retained that is byte for byte the last message
        accepted on its topic (the broker's retained copy, handed again to a renewed
        subscription: the server's presence after an agent's reconnect, an agent's after the
        server's) is that message again: taken as the security checks took it then, not refused
        as a replay (its ``seq`` was seen).

        Returns:
            the message, a :class:`Rejected` record, or ``None`` for a chunk that did not
            complete its transfer (or a handled ``resend`` request).
        """
        if inc.payload:  # the broker took a PUBLISH this large from a client (a size it is known to take)
            n = len(inc.payload)
            if n > self.delivered_max_payload_bytes:
                self.delivered_max_payload_bytes = n
            size = publish_size(inc.topic, n, inc.qos, protocol=self._protocol()).packet_bytes
            if size > self.delivered_max_packet_bytes:
                self.delivered_max_packet_bytes = size
        try:
            info = topics.parse(inc.topic)
            if info.federation != self.federation:
                raise FieldError(f"topic {inc.topic!r} belongs to federation {info.federation!r}", field="topic")
            if not inc.payload:
                raise FieldError(f"empty payload on a {info.kind_label} topic: no message to decode", field="payload")
            opened = None
            if self.security is not None:  # verified (and decrypted) before the body is decoded
                kept = self._status_opened.get(inc.topic) if inc.retain else None
                if kept is not None and kept[0] == inc.payload:
                    # the broker's retained copy of the very message accepted last on this status topic
                    # (handed again to a renewed subscription): verified then, not a replay to refuse
                    opened = kept[1]
                else:
                    opened = self.security.open(inc.topic, info.client_id, info.direction, inc.payload)
                    if info.kind_label == Kind.STATUS.label:
                        self._status_opened[inc.topic] = (bytes(inc.payload), opened)
            plain = opened.payload if opened is not None else inc.payload
        except ProtocolError as exc:
            return self._reject(inc, exc)
        try:
            dec = decode(plain, limits=self.limits)
            if info.direction in ("up", "status") and dec.envelope.sender != info.client_id:
                raise FieldError(f"sender {dec.envelope.sender!r} does not match topic client {info.client_id!r}",
                                 field="envelope.sender")
            kind = dec.envelope.kind
            if kind is not Kind.CHUNK and info.kind_label != kind.label:
                raise FieldError(f"a {kind.label} message on a {info.kind_label} topic", field="envelope.kind")
        except ProtocolError as exc:  # past the security checks: the header may name what was refused
            return self._reject(inc, exc, header=_answerable_header(plain, info, info.client_id))
        env = dec.envelope
        client = info.client_id or (self.node_id if self.side == "agent" else "*")
        sig_b, enc_b = (opened.sig_bytes, opened.enc_bytes) if opened is not None else (0, 0)
        if isinstance(env.body, Chunk) and self.transfer_filter is not None and not self.transfer_filter(env.sender):
            return self._reject(inc, FieldError(f"chunked transfer from {env.sender!r} refused: not a member of "
                                                f"this federation", field="envelope.sender"))
        if isinstance(env.body, Chunk):
            c = env.body
            self._record(inc.topic, "received", info.kind_label, env.round, env.sender, env.seq, client=client,
                         payload_bytes=len(inc.payload), body_bytes=len(c.data), qos=inc.qos, retain=inc.retain,
                         transfer_id=c.transfer_id.hex(), chunk_index=c.index, chunk_count=c.count,
                         sig_bytes=sig_b, enc_bytes=enc_b)
            key = (env.sender, bytes(c.transfer_id))
            # a transfer's chunks may come on more than one topic of its kind: a broadcast global's
            # chunks asked for again come on this device's own topic (_publish_resend); the message
            # is the first chunk's topic's (a broadcast stays a broadcast to its consumer)
            first = self._transfer_msgs.setdefault(key, (info.kind_label, env.round, inc.topic))
            if first[2] != inc.topic:
                first_info = topics.parse(first[2])
                if (first_info.direction, first_info.kind_label) != (info.direction, info.kind_label):
                    return self._reject(inc, FieldError(
                        f"chunk {c.index} of transfer {c.transfer_id.hex()} on {inc.topic!r}: its transfer began on "
                        f"{first[2]!r}, a topic of another kind", field="topic"), recorded=True)
                info = first_info
            try:
                whole = self.reassembler.add(env.sender, c)
            except ProtocolError as exc:
                self._transfer_msgs.pop(key, None)
                return self._reject(inc, exc, recorded=True)
            if whole is None:
                return None
            self._transfer_msgs.pop(key, None)
            topic = first[2]
            client = info.client_id or (self.node_id if self.side == "agent" else "*")
            try:
                inner = decode(whole, limits=self.limits)
                if inner.envelope.sender != env.sender:
                    raise FieldError(f"transfer from {env.sender!r} holds a message of {inner.envelope.sender!r}",
                                     field="envelope.sender")
                if inner.envelope.round != env.round:
                    raise FieldError(f"transfer of round {env.round} holds a message of round {inner.envelope.round}",
                                     field="envelope.round")
                if inner.envelope.kind.label != info.kind_label:
                    raise FieldError(f"a {inner.envelope.kind.label} message on a {info.kind_label} topic",
                                     field="envelope.kind")
            except ProtocolError as exc:  # every chunk passed the security checks: its sender is known
                return self._reject(Incoming(topic, whole, inc.qos, False, inc.received_at), exc, recorded=True,
                                    header=_answerable_header(whole, info, env.sender))
            ienv = inner.envelope
            self._record(topic, "message", ienv.kind.label, ienv.round, ienv.sender, ienv.seq, client=client,
                         payload_bytes=inner.payload_bytes, body_bytes=inner.body_bytes, qos=inc.qos, retain=False,
                         raw_bytes=_raw(ienv.body), fields=_fields_json(inner), codec=inner.codec,
                         transfer_id=c.transfer_id.hex(), chunk_count=c.count)
            self._supersede_copies(ienv.sender, ienv.kind.label, ienv.round)
            return Received(topic, info, inner, False, payload_sha256(whole), inc.received_at)
        resend_plan: tuple | None = None  # set for a resend request only
        if isinstance(env.body, Resend):
            # decided before the row is written: a refused request is a ``rejected`` row, not a received one
            plan = self._plan_resend(env.sender, info, env.body)
            if isinstance(plan, str):
                return self._reject(inc, ResendRefused(plan, field="body"))
            resend_plan = plan
        self._record(inc.topic, "received", env.kind.label, env.round, env.sender, env.seq, client=client,
                     payload_bytes=len(inc.payload), body_bytes=dec.body_bytes, qos=inc.qos, retain=inc.retain,
                     raw_bytes=_raw(env.body), fields=_fields_json(dec), codec=dec.codec, sig_bytes=sig_b,
                     enc_bytes=enc_b)
        if resend_plan is not None:
            self._publish_resend(resend_plan)
            return None
        self._supersede_copies(env.sender, env.kind.label, env.round)
        return Received(inc.topic, info, dec, inc.retain, payload_sha256(inc.payload), inc.received_at)

    def _supersede_copies(self, sender: str, kind_label: str, round: int) -> None:
        """A ``global`` or ``update`` of ``sender`` and ``round`` arrived whole: drop that
        sender's transfers still in progress of the same kind and of this round or an earlier
        one (the broadcast global a broker restart cut, when the device's own copy came after its
        reconnect; an update's first copy cut, when its copy sent again arrived), so that their
        missing chunks are never asked for (the message is here: a ``resend`` request would cost
        the sender's link and this device's for nothing) and a late chunk completes no stale
        copy. Transfers of another payload only: one of the same payload is superseded by the
        reassembler itself."""
        if kind_label not in ("global", "update") or not self._transfer_msgs:
            return
        for key, (k, r, _topic) in list(self._transfer_msgs.items()):
            if key[0] != sender or k != kind_label or r > round:
                continue
            del self._transfer_msgs[key]
            if self.reassembler.drop(*key):
                self.superseded_copies += 1
                log.debug("%s: transfer %s from %s (%s of round %d) dropped: a copy of the %s of round %d arrived "
                          "whole", self.node_id, key[1].hex(), sender, k, r, kind_label, round)

    def close(self) -> None:
        """Close the transport (DISCONNECT), then decode and ledger every message that had already
        arrived, so the ledger holds everything the broker delivered on this connection."""
        self.transport.close()
        for _ in range(1_000_000):
            inc = self.transport.get(0.0)
            if inc is None:
                break
            if inc.payload or "/status/" not in inc.topic:
                try:
                    self.accept(inc)
                except FedfleetProtocolError as exc:  # e.g. a resend request it can no longer answer
                    log.info("%s: after close: %s", self.node_id, exc)
        if self.security is not None:  # a clean close: the replay journal needs no margin at the next start
            self.security.close()
        if self.ledger is not None:
            self.ledger.flush()

    def _reject(self, inc: Incoming, exc: ProtocolError, *, recorded: bool = False,
                header: tuple[Kind, int, str, int] | None = None) -> Rejected:
        """Log and ledger a refused payload (a ``rejected`` row, or a logical ``message`` row
        when its chunks were already recorded) and return its :class:`Rejected`; ``header``: the
        answerable header (:func:`_answerable_header`), which then also fills the row's kind,
        round, sender and seq."""
        self.rejected += 1
        log.warning("%s: rejected message on %s (%d bytes): %s", self.node_id, inc.topic, len(inc.payload), exc)
        client = "?"
        try:
            client = topics.parse(inc.topic).client_id or "*"
        except ProtocolError:
            pass
        kind_label, rnd, sender, seq = ("invalid", None, None, None) if header is None else \
            (header[0].label, header[1], header[2], header[3])
        if recorded:  # the bytes were already counted as received chunks: a logical row only
            self._record(inc.topic, "message", kind_label, rnd, sender, seq, client=client,
                         payload_bytes=len(inc.payload), body_bytes=0, qos=inc.qos, retain=False,
                         reason=str(exc)[:500])
        else:
            self._record(inc.topic, "rejected", kind_label, rnd, sender, seq, client=client,
                         payload_bytes=len(inc.payload), body_bytes=0, qos=inc.qos, retain=inc.retain,
                         reason=str(exc)[:500])
        rejected = Rejected(inc.topic, str(exc), exc.field, len(inc.payload), getattr(exc, "code", "invalid"))
        if header is None:
            return rejected
        return dataclasses.replace(rejected, kind=header[0], round=header[1], sender=header[2], seq=header[3],
                                   sha256=payload_sha256(inc.payload))

    def record_refusal(self, rec: Received, reason: str) -> None:
        """Record that a decoded message was refused by its consumer (an update that does not fit
        the model, a join of another model …): its ``received`` ledger row becomes a ``rejected``
        row with ``reason`` (a chunked transfer's logical ``message`` row gets the reason; its
        chunk rows stay ``received``: their bytes were taken off the wire). A no-op without a
        ledger."""
        env = rec.envelope
        if self.ledger is not None:
            self.ledger.mark_refused(node=self.node_id, sender=env.sender, seq=env.seq, kind=env.kind.label,
                                     reason=reason[:500])

    # ------------------------------------------------------------------ transfers

    def _resend_topic(self, peer: str) -> str:
        if self.side == "server":
            return topics.down_to(self.federation, peer, Kind.RESEND)
        return topics.up(self.federation, self.node_id, Kind.RESEND)

    def _plan_resend(self, requester: str, info: topics.TopicInfo, req: Resend) -> tuple | str:
        """What to publish again for a ``resend`` request, or why the request is refused.

        Honoured only from a known peer (an agent: the server, on a ``down`` topic; the server: a
        member admitted by ``transfer_filter``, i.e. a joined agent; with signing on the request
        was verified before it got here), for a transfer this side still holds and sent to that
        peer (a broadcast, or one addressed to it), for indices the transfer has, and within the
        requester's budget of resent bytes (``resend_burst_bytes``, refilled at
        ``resend_rate_bytes_s``). A chunk already resent less than a second ago is not sent again
        (the request is still honoured).

        The once-a-second limit and the budget are the requester's own: two devices missing one
        chunk of a broadcast each get it (on its own topic, :meth:`_publish_resend`).

        Returns:
            ``(chunks, meta, requester)`` to hand to :meth:`_publish_resend` (``chunks`` may be
            empty), or the reason of the refusal (a sentence naming the requester and the transfer).
        """
        tid = req.transfer_id.hex()
        if self.side == "agent":
            if requester != SERVER_ID or info.direction != "down":
                return f"resend request from {requester!r} refused: only the server may ask an agent for chunks"
        elif self.transfer_filter is not None and not self.transfer_filter(requester):
            return f"resend request from {requester!r} refused: not a member of this federation (never joined)"
        meta = self.cache.meta(req.transfer_id)
        held = self.cache.get(req.transfer_id, [0]) if meta is not None else []
        if not held and bytes(req.transfer_id) in self._superseded:
            # the message went again as a new transfer (smaller chunks after a refusal): nothing to answer
            self.superseded_resend_requests += 1
            log.debug("%s: resend request from %s for transfer %s not answered: replaced by a smaller re-send of "
                      "its message", self.node_id, requester, tid)
            return [], None, requester
        if not held:
            return f"resend request from {requester!r} refused: transfer {tid} is not held here (unknown or expired)"
        client = meta[3]
        if self.side == "server" and client not in ("*", requester):
            return f"resend request from {requester!r} refused: transfer {tid} was sent to {client!r}, not to it"
        count = held[0].count
        bad = [i for i in req.indices if i >= count]
        if not req.indices or bad:
            what = f"chunk {bad[0]}" if bad else "no chunk"
            return f"resend request from {requester!r} refused: asks for {what} of transfer {tid} ({count} chunks)"
        now = time.monotonic()
        chunks = [c for c in self.cache.get(req.transfer_id, list(req.indices))
                  if now - self._resent_at.get((requester, c.transfer_id, c.index), -1e9) >= 1.0]
        cost = sum(len(c.data) for c in chunks)
        tokens, last = self._resend_budget.get(requester, (float(self.resend_burst_bytes), now))
        tokens = min(float(self.resend_burst_bytes), tokens + (now - last) * self.resend_rate_bytes_s)
        if cost > tokens:
            self._resend_budget[requester] = (tokens, now)
            return (f"resend request from {requester!r} refused: rate limit ({cost:,} bytes asked, {int(tokens):,} "
                    f"left of {self.resend_burst_bytes:,}, refilled at {self.resend_rate_bytes_s:,.0f} B/s)")
        if len(self._resend_budget) > 100_000:
            self._resend_budget.clear()
        self._resend_budget[requester] = (tokens - cost, now)
        for c in chunks:
            self._resent_at[(requester, c.transfer_id, c.index)] = now
        if len(self._resent_at) > 100_000:
            self._resent_at.clear()
        return chunks, meta, requester

    def _publish_resend(self, plan: tuple) -> None:
        """Publish the chunks a ``resend`` request asked for, on the topic the transfer went on;
        but a broadcast ``global``'s (``down/global``) go to the device that asked alone, on its
        own topic (``down/{requester}/global``, which every agent subscribes to; sealed for that
        topic when signing is on; ledger ``client`` the requester): answered on the broadcast
        topic, every online device would download them again. The longer topic adds the
        requester's id and a ``/``: a broadcast sent with ``budget_topic`` (:meth:`send`; the
        server passes its longest joined device's ``down/{id}/global``) was cut with that room, so
        its chunks fit there for every device whose id is no longer. A chunk whose PUBLISH on the
        requester's topic would still not fit the packet limit the transfer was cut for (cut to
        the limit without that room, or a device that joined later with a longer id) goes on the
        broadcast topic as before (counted in :attr:`resent_on_broadcast`, said at INFO): a packet
        above a device's limit never reaches it. Chunks cut before the broker's limit became
        known may be above it now: the transport refuses them unsent
        (:class:`~protocol.errors.PublishRefused`), and the message they belong to, when it is
        one of the last sent, is sent again smaller (as after a refusal); never raised to the
        receiver of the request."""
        chunks, meta, requester = plan
        if not chunks:
            return
        topic, round, kind_label, client, max_packet = meta
        self.resent_chunks += len(chunks)
        tid = chunks[0].transfer_id
        with self._delivery_lock:  # the message, while it may still be sent again
            held = [s.out for s in self._sent.values() if s.out is not None]
            held += [e[2] for e in self._acked_recently.values() if e[2] is not None]
            out = next((o for o in reversed(held) if o.transfer_id == tid), None)
        track = (out, out.generation) if out is not None else None
        groups: list[tuple[str, str, list[Chunk], list[_ChunkPacket] | None]] = [(topic, client, chunks, None)]
        own = self._own_resend_topic(topic, kind_label, requester)
        if own is not None:
            limit, protocol = self._limit_for(max_packet)
            fit: list[Chunk] = []
            packets: list[_ChunkPacket] = []
            rest: list[Chunk] = []
            for c in chunks:
                pkt = self._chunk_packet(own, round, c)
                if self._size(own, len(pkt.wire), protocol) <= limit:
                    fit.append(c)
                    packets.append(pkt)
                else:  # its seq goes unused: receivers never expect consecutive numbers
                    rest.append(c)
            groups = [(own, requester, fit, packets)] if fit else []
            if rest:
                groups.append((topic, client, rest, None))
                self.resent_on_broadcast += len(rest)
                log.info("%s: %s of transfer %s asked for by %s go again on %s: on its own topic their packets "
                         "would exceed the %s-byte limit the transfer was cut for", self.node_id,
                         _chunk_span([c.index for c in rest], rest[0].count), tid.hex(), requester, topic,
                         f"{limit:,}")
        try:
            for to, who, these, pkts in groups:
                self._publish_chunks(these, to, round, kind_label, who, None, track=track, packets=pkts)
        except PublishRefused as exc:
            self.refused += 1
            if out is None:
                log.warning("%s: chunks of transfer %s not sent again: %s (the message is no longer held here)",
                            self.node_id, tid.hex(), exc.reason)
                return
            log.info("%s: chunks of transfer %s asked for again are above the broker's limit now (%s): the %s of "
                     "round %d is sent again smaller", self.node_id, tid.hex(), exc.reason, out.kind, out.round)
            with self._delivery_lock:
                if out.refusal_queued:
                    return
                out.refusal_queued = True
                self._refusal_queue.append((out, out.generation, exc.reason, exc.limit_bytes or 0))

    def _own_resend_topic(self, topic: str, kind_label: str, requester: str) -> str | None:
        """The topic to answer ``requester``'s ``resend`` request for a transfer sent on ``topic``
        on instead of ``topic``: its own ``down/{requester}/global`` for a broadcast ``global``
        (server side); ``None`` for every other transfer (addressed to one peer already, or a
        ``round_start``/``finish`` broadcast, whose chunks stay on the broadcast topic: an agent
        that reads a ``round_start`` on its own topic as a copy meant for it alone would take a
        broadcast's for one)."""
        if self.side != "server" or kind_label != Kind.GLOBAL.label:
            return None
        try:
            info = topics.parse(topic)
        except ProtocolError:
            return None
        if info.direction != "down" or info.client_id is not None:
            return None
        return topics.down_to(self.federation, requester, Kind.GLOBAL)

    def _maintain(self) -> None:
        """Send refused messages again; let go of acknowledged messages past :data:`_ACKED_HOLD_S`;
        ask for missing chunks of stalled transfers; drop and report expired ones."""
        self._handle_refusals()
        now = time.monotonic()
        if now - self._last_maintain < 0.2:
            return
        self._last_maintain = now
        self._release_acked(now)
        for gone in self.reassembler.expire():
            self.incomplete_transfers += 1
            log.warning("%s: transfer %s from %s incomplete after %.0f s (%d/%d chunks); dropped",
                        self.node_id, gone.transfer_id.hex(), gone.sender, gone.age_s, gone.received, gone.count)
            if self.ledger is not None:
                self._record("", "message", "incomplete", None, gone.sender, None, client=gone.sender, payload_bytes=0,
                             body_bytes=0, qos=self.qos, retain=False, transfer_id=gone.transfer_id.hex(),
                             chunk_count=gone.count, reason=f"incomplete transfer: {gone.received}/{gone.count} chunks")
        for t in self.reassembler.pending():
            if t.age_s < self.resend_after_s:
                continue
            key = (t.sender, t.transfer_id)
            last = self._resend_asked.get(key, 0.0)
            if now - last < self.resend_after_s:
                continue
            self._resend_asked[key] = now
            missing = self.reassembler.missing(t.sender, t.transfer_id)
            if not missing:
                continue
            try:
                self.send(self._resend_topic(t.sender), Resend(t.transfer_id, tuple(missing[:MAX_RESEND])), round=0,
                          recipient=t.sender)
            except (ProtocolError, FedfleetProtocolError) as exc:
                log.warning("%s: cannot ask %s for missing chunks: %s", self.node_id, t.sender, exc)
        if len(self._resend_asked) > 4096:
            self._resend_asked.clear()
        if len(self._transfer_msgs) > 256:  # transfers expired or refused since: forget them
            live = {(t.sender, t.transfer_id) for t in self.reassembler.pending()}
            self._transfer_msgs = {k: v for k, v in self._transfer_msgs.items() if k in live}

    def _on_packet(self, ev: PacketEvent) -> int | None:
        """Ledger row for an MQTT packet that is not an application PUBLISH (control packets, and
        PUBLISH retransmissions with DUP set, which the application did not send twice); returns
        its row id (0 without a ledger), ``None`` when no row was written. A ``dropped`` event (a
        control packet, or a PUBLISH retransmission, the socket never took, :class:`PacketEvent`)
        turns the row its ``ref`` names (else the last row of a control packet of its type and
        size) into a ``message`` row with delivery ``dropped``: its bytes leave the wire totals.
        An event with ``unsent_bytes`` (the socket took only part of that packet) sets
        them on the row its ``ref`` names: the row this method returned for the packet."""
        if ev.dropped:
            self._void_control(ev)
            return None
        if ev.unsent_bytes:
            self._cut_control(ev)
            return None
        if ev.packet_type == "PUBLISH" and not ev.dup:
            return None
        sent = ev.direction == "out"
        with self._count_lock:
            if sent:
                self.control_bytes_sent += ev.packet_bytes
            else:
                self.control_bytes_received += ev.packet_bytes
        if self.ledger is None:
            return 0
        to_server = (self.side == "agent") == sent
        kind = "PUBLISH-DUP" if ev.packet_type == "PUBLISH" else ev.packet_type
        row = self.ledger.record(LedgerRow(
            federation=self.federation, side=self.side, node=self.node_id, event="sent" if sent else "received",
            direction="up" if to_server else "down", kind=kind, round=None,
            client=self.node_id if self.side == "agent" else "*", sender=None, seq=None, topic="",
            topic_bytes=0, mqtt_header_bytes=ev.packet_bytes, envelope_bytes=0, body_bytes=0, payload_bytes=0,
            qos=0, retained=False, codec="", reason="control"))
        if sent and kind != "PUBLISH-DUP":
            with self._count_lock:
                rows = self._control_rows.setdefault((kind, ev.packet_bytes), collections.deque(maxlen=64))
                rows.append(row)
        return row

    def _cut_control(self, ev: PacketEvent) -> None:
        """A control packet (or a PUBLISH retransmission) recorded as sent of which the socket
        took only part (see :meth:`_on_packet`): its row keeps ``sent``, with ``unsent_bytes``; it
        is never taken for one dropped unwritten."""
        row = ev.ref if isinstance(ev.ref, int) and not isinstance(ev.ref, bool) else 0
        kind = "PUBLISH-DUP" if ev.packet_type == "PUBLISH" else ev.packet_type
        with self._count_lock:
            self.control_bytes_sent -= ev.unsent_bytes
            rows = self._control_rows.get((kind, ev.packet_bytes))
            if rows is not None and row in rows:
                rows.remove(row)
        if self.ledger is None:
            return
        if not row:
            log.warning("%s: %d unsent bytes of a %d-byte %s not recorded: its ledger row is not known",
                        self.node_id, ev.unsent_bytes, ev.packet_bytes, kind)
            return
        try:
            self.ledger.set_unsent(row, ev.unsent_bytes)
        except LedgerError as exc:  # never break the network thread
            log.warning("%s: unsent bytes of %s (ledger row %d) not recorded: %s", self.node_id, kind, row, exc)

    def _void_control(self, ev: PacketEvent) -> None:
        """A control packet (or a PUBLISH retransmission) recorded as sent that the socket never
        took (see :meth:`_on_packet`): the row its ``ref`` names (the row this method returned
        for its queueing), else the last control row of its type and size, turns into a
        ``message`` row with delivery ``dropped``."""
        kind = "PUBLISH-DUP" if ev.packet_type == "PUBLISH" else ev.packet_type
        ref = ev.ref if isinstance(ev.ref, int) and not isinstance(ev.ref, bool) else 0
        with self._count_lock:
            self.control_bytes_sent -= ev.packet_bytes
            rows = self._control_rows.get((kind, ev.packet_bytes))
            if ref:
                row = ref
                if rows is not None and row in rows:
                    rows.remove(row)
            else:
                row = rows.pop() if rows else 0
        if self.ledger is not None and row:
            try:  # the row's reason stays "control"
                self.ledger.set_delivery(row, "dropped", on_wire=False)
            except LedgerError as exc:  # never break the network thread
                log.warning("%s: unsent %s (ledger row %d) not recorded: %s", self.node_id, kind, row, exc)
        elif self.ledger is not None:
            log.warning("%s: a %d-byte %s never written not recorded: its ledger row is not known", self.node_id,
                        ev.packet_bytes, kind)

    def _record(self, topic: str, event: str, kind: str, round: int | None, sender: str | None,
                seq: int | None, *, client: str, payload_bytes: int, body_bytes: int, qos: int,
                retain: bool, codec: str = "", reason: str = "", raw_bytes: int = 0, fields: str = "",
                transfer_id: str | None = None, chunk_index: int | None = None,
                chunk_count: int | None = None, sig_bytes: int = 0, enc_bytes: int = 0,
                delivery: str = "", protocol: int | None = None, unsent_bytes: int = 0) -> int:
        """Write one ledger row (and count its wire bytes); return its row id (0 without a ledger).
        ``protocol``: the MQTT protocol level its packet is sized for (default: the transport's now);
        ``unsent_bytes``: bytes of the packet the socket never took (a ``sent`` row's)."""
        size = publish_size(topic, payload_bytes, qos, protocol=self._protocol() if protocol is None else protocol)
        direction = "down" if "/down/" in topic else "up"
        # a chunked transfer is pipelined (QoS 1 in flight): one round trip per transfer, not per chunk
        link_s = (self.link_time(size.packet_bytes, direction, chunk_index in (None, 0))
                  if self.link_time and event != "message" else 0.0)
        with self._count_lock:
            if event == "sent":
                self.wire_bytes_sent += size.packet_bytes - unsent_bytes
            elif event != "message":
                self.wire_bytes_received += size.packet_bytes
        if self.ledger is None:
            return 0
        return self.ledger.record(LedgerRow(
            federation=self.federation, side=self.side, node=self.node_id, event=event, direction=direction,
            kind=kind, round=round, client=client, sender=sender, seq=seq, topic=topic,
            topic_bytes=size.topic_bytes, mqtt_header_bytes=size.header_bytes,
            envelope_bytes=payload_bytes - body_bytes - sig_bytes - enc_bytes, body_bytes=body_bytes,
            payload_bytes=payload_bytes, qos=qos, retained=retain, codec=codec, reason=reason, raw_bytes=raw_bytes,
            fields=fields, transfer_id=transfer_id, chunk_index=chunk_index, chunk_count=chunk_count, link_s=link_s,
            sig_bytes=sig_bytes, enc_bytes=enc_bytes, delivery=delivery, unsent_bytes=unsent_bytes))


def _answerable_header(payload: bytes, info: topics.TopicInfo, sender: str | None) -> tuple[Kind, int, str, int] | None:
    """The header of a payload refused after the security checks (:func:`protocol.messages.read_header`),
    when it names ``sender`` (the topic's client, or the verified sender of a chunked transfer)
    and the topic's kind on an upload topic: then the refusal can be answered (:attr:`Rejected.answerable`)."""
    if info.direction != "up" or sender is None:
        return None
    header = read_header(payload)
    if header is None or header[2] != sender or header[0].label != info.kind_label:
        return None
    return header


_NO_LIMIT = 1 << 62
MAX_REFUSAL_RESENDS = 6
"""Chunked re-sends of one refused message (each with packets of at most half the refused size)."""
MIN_CHUNK_DATA = 64
"""Smallest chunk data (bytes) a re-send after a refusal uses; below it the message fails loudly."""
_FINAL_REFUSALS = ("0x87", "0x90", "0x91", "0x99")
"""PUBACK reason codes that smaller packets cannot help (not authorised, bad topic, packet id, payload format)."""
MAX_RESEND = 4096
"""Most chunk indices asked for in one ``resend``."""
MIN_SUSPECTED_PACKET = 1024
"""Smallest packet limit (bytes) learnt from a message that was not confirmed (:meth:`Channel.suspect_dropped`):
a recipient that stays silent may be slow or gone, and no broker limit worth federating under is smaller."""
NEAR_DELIVERED_FRACTION = 0.01
"""A message not confirmed whose packets exceed the largest size the broker delivered by at most
this share of their size (or :data:`MIN_SUSPECTED_PACKET` bytes) is not taken for one dropped
above a size limit (:meth:`Channel.suspect_dropped`)."""
_RECENT_SENT = 512
"""Messages sent that :meth:`Channel.in_flight` and :meth:`Channel.suspect_dropped` can answer for."""
_ACKED_RECENTLY = 8
"""Acknowledged PUBLISH handles kept (with their message) so that a refusal the transport reports right
after the acknowledgement (the close that followed it) still finds its row and can send the message again."""
_ACKED_HOLD_S = 5.0
"""Seconds an acknowledged message stays held for such a refusal (ten times
:data:`protocol.transport.ACK_CLOSE_S`, the window in which the transport reports one); its row stays known."""


def _chunk_span(indices: list[int], count: int = 0) -> str:
    """Chunk indices as a reader counts them, from 1: ``[2, 3, 4]`` → ``"chunks 3-5"``, ``[0, 2]`` →
    ``"chunks 1, 3"``, ``[4]`` → ``"chunk 5"``; with ``count``, ``" of {count}"`` after them."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(f"{a + 1}" if a == b else f"{a + 1}-{b + 1}" for a, b in runs)
    many = len(indices) != 1
    return f"chunk{'s' if many else ''} {text}" + (f" of {count}" if count else "")


def _raw(body: Body) -> int:
    return (sum(raw_nbytes(t) for t in getattr(body, "tensors", ()))
            + sum(raw_nbytes(t) for t in (getattr(body, "extras", None) or {}).values()))


def _fields_json(dec: Decoded) -> str:
    return json.dumps(dict(dec.field_bytes), separators=(",", ":"))
