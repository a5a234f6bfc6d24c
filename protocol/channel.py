"""A channel = transport + codec + byte ledger, for one side (the server or one agent).

:meth:`Channel.send` encodes a body in an envelope with the next sequence number, publishes it
and writes the ``sent`` ledger row. :meth:`Channel.receive` takes the next incoming payload,
decodes it and writes a ``received`` row, or a ``rejected`` row with the reason when the bytes
are not a valid message: a malformed message is logged and returned as :class:`Rejected`,
never raised, so a peer cannot crash the receiver.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from . import topics
from .errors import FieldError, ProtocolError
from .ledger import Ledger, LedgerRow
from .messages import Body, Decoded, Encoded, Envelope, decode, encode, now_ms, payload_sha256
from .mqtt_bytes import publish_size
from .tensors import DEFAULT_LIMITS, TensorLimits
from .transport import Incoming, PacketEvent, Transport

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Received:
    """A valid message.

    Attributes:
        topic: where it arrived.
        topic_info: the parsed topic.
        decoded: the envelope and its byte split.
        retain: delivered as a retained message.
        sha256: digest of the payload (for receipts).
    """

    topic: str
    topic_info: topics.TopicInfo
    decoded: Decoded
    retain: bool
    sha256: bytes

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
    """

    topic: str
    reason: str
    field: str | None
    payload_bytes: int


class Channel:
    """Messages over one transport, with sequence numbers and ledger rows.

    Args:
        transport: a connected :class:`~protocol.transport.Transport`.
        node_id: this side's id (``"server"`` or the client id); used as envelope ``sender``.
        side: ``"server"`` or ``"agent"`` (ledger column).
        federation: federation id (topic level and ledger column).
        ledger: where rows go, or ``None`` to keep no ledger on this side.
        qos: QoS of every publish (1 by default: model traffic must not be lost).
        limits: tensor bounds applied when decoding.

    Attributes:
        wire_bytes_sent, wire_bytes_received: PUBLISH packet bytes (header + topic + payload)
            this side handed to / got from MQTT; rejected payloads count as received.
    """

    def __init__(self, transport: Transport, *, node_id: str, side: str, federation: str,
                 ledger: Ledger | None, qos: int = 1, limits: TensorLimits = DEFAULT_LIMITS,
                 first_seq: int = 1) -> None:
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
        if hasattr(transport, "set_packet_listener"):
            transport.set_packet_listener(self._on_packet)

    def next_seq(self) -> int:
        """Reserve the next sequence number."""
        with self._seq_lock:
            self._seq += 1
            return self._seq

    def send(self, topic: str, body: Body, *, round: int, retain: bool = False,
             wait_s: float | None = None, recipient: str = "*", codec: str = "fp32") -> Encoded:
        """Encode ``body``, publish it on ``topic`` and record the ``sent`` row.

        Args:
            topic: destination topic (see :mod:`protocol.topics`).
            body: the message record.
            round: round number for the envelope.
            retain: publish as retained.
            wait_s: block until acknowledged (QoS 1) for at most this many seconds.
            recipient: ledger ``client`` for downloads (``"*"`` = broadcast).
            codec: tensor codec name, for the ledger.

        Raises:
            PublishTimeout, TransportError: from the transport.
            FieldError, TensorError: the body cannot be encoded.
        """
        env = Envelope(round=round, sender=self.node_id, seq=self.next_seq(), body=body, timestamp_ms=now_ms())
        enc = encode(env)
        self.transport.publish(topic, enc.payload, qos=self.qos, retain=retain, wait_s=wait_s)
        self._record(topic, "sent", env.kind.label, round, env.sender, env.seq,
                     client=self.node_id if self.side == "agent" else recipient,
                     payload_bytes=len(enc.payload), body_bytes=enc.body_bytes, qos=self.qos,
                     retain=retain, codec=codec)
        return enc

    def receive(self, timeout_s: float | None) -> Received | Rejected | None:
        """Next message from the transport, decoded; ``None`` after ``timeout_s`` seconds.

        Empty retained payloads (a cleared retained topic) are skipped silently.
        """
        while True:
            inc = self.transport.get(timeout_s)
            if inc is None:
                return None
            if not inc.payload:
                continue
            return self.accept(inc)

    def accept(self, inc: Incoming) -> Received | Rejected:
        """Decode one incoming payload and write its ledger row (never raises on bad bytes)."""
        try:
            info = topics.parse(inc.topic)
            if info.federation != self.federation:
                raise FieldError(f"topic {inc.topic!r} belongs to federation {info.federation!r}", field="topic")
            dec = decode(inc.payload, limits=self.limits)
            if info.direction in ("up", "status") and dec.envelope.sender != info.client_id:
                raise FieldError(f"sender {dec.envelope.sender!r} does not match topic client {info.client_id!r}",
                                 field="envelope.sender")
            if info.kind_label != dec.envelope.kind.label:
                raise FieldError(f"a {dec.envelope.kind.label} message on a {info.kind_label} topic",
                                 field="envelope.kind")
        except ProtocolError as exc:
            self.rejected += 1
            log.warning("%s: rejected message on %s (%d bytes): %s", self.node_id, inc.topic, len(inc.payload), exc)
            client = "?"
            try:
                client = topics.parse(inc.topic).client_id or "*"
            except ProtocolError:
                pass
            self._record(inc.topic, "rejected", "invalid", None, None, None, client=client,
                         payload_bytes=len(inc.payload), body_bytes=0, qos=inc.qos, retain=inc.retain,
                         reason=str(exc)[:500])
            return Rejected(inc.topic, str(exc), exc.field, len(inc.payload))
        env = dec.envelope
        client = info.client_id or (self.node_id if self.side == "agent" else "*")
        self._record(inc.topic, "received", env.kind.label, env.round, env.sender, env.seq, client=client,
                     payload_bytes=dec.payload_bytes, body_bytes=dec.body_bytes, qos=inc.qos, retain=inc.retain)
        return Received(inc.topic, info, dec, inc.retain, payload_sha256(inc.payload))

    def _on_packet(self, ev: PacketEvent) -> None:
        """Ledger row for an MQTT packet that is not an application PUBLISH (control packets, and
        PUBLISH retransmissions with DUP set, which the application did not send twice)."""
        if ev.packet_type == "PUBLISH" and not ev.dup:
            return
        sent = ev.direction == "out"
        with self._count_lock:
            if sent:
                self.control_bytes_sent += ev.packet_bytes
            else:
                self.control_bytes_received += ev.packet_bytes
        if self.ledger is None:
            return
        to_server = (self.side == "agent") == sent
        kind = "PUBLISH-DUP" if ev.packet_type == "PUBLISH" else ev.packet_type
        self.ledger.record(LedgerRow(
            federation=self.federation, side=self.side, node=self.node_id, event="sent" if sent else "received",
            direction="up" if to_server else "down", kind=kind, round=None,
            client=self.node_id if self.side == "agent" else "*", sender=None, seq=None, topic="",
            topic_bytes=0, mqtt_header_bytes=ev.packet_bytes, envelope_bytes=0, body_bytes=0, payload_bytes=0,
            qos=0, retained=False, codec="", reason="control"))

    def _record(self, topic: str, event: str, kind: str, round: int | None, sender: str | None,
                seq: int | None, *, client: str, payload_bytes: int, body_bytes: int, qos: int,
                retain: bool, codec: str = "", reason: str = "") -> None:
        size = publish_size(topic, payload_bytes, qos)
        with self._count_lock:
            if event == "sent":
                self.wire_bytes_sent += size.packet_bytes
            else:
                self.wire_bytes_received += size.packet_bytes
        if self.ledger is None:
            return
        direction = "down" if "/down/" in topic else "up"
        self.ledger.record(LedgerRow(
            federation=self.federation, side=self.side, node=self.node_id, event=event, direction=direction,
            kind=kind, round=round, client=client, sender=sender, seq=seq, topic=topic,
            topic_bytes=size.topic_bytes, mqtt_header_bytes=size.header_bytes,
            envelope_bytes=payload_bytes - body_bytes, body_bytes=body_bytes, payload_bytes=payload_bytes,
            qos=qos, retained=retain, codec=codec, reason=reason))
