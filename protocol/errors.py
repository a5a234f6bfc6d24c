"""Exceptions of the wire protocol.

Every error a decoder raises on bytes from a peer is a :class:`ProtocolError`; callers that
receive from the network catch that one class, log the reason and drop the message. Transport
failures are a separate branch because the caller's remedy differs (retry, reconnect)::

    FedfleetProtocolError                 base of everything in ``protocol``
    ├── ProtocolError                     the bytes are not a valid message: reject and log
    │   ├── MalformedMessage              not msgpack, wrong container, wrong field type
    │   ├── UnsupportedVersion            protocol major version this side does not speak
    │   ├── UnknownKind                   message kind number not defined in this version
    │   ├── FieldError                    one field out of its bounds (``field`` names it)
    │   ├── TensorError                   tensor dtype/shape/size/NaN violation (``field`` too)
    │   ├── ChunkError                    a chunk contradicts its transfer, fails the digest, or
    │   │                                 would exceed the receiver's memory bounds
    │   └── SecurityRejection             signing/encryption/replay checks refused the message
    │                                     (``code``: one of ``protocol.security.REASONS``)
    ├── SecurityConfigError               keys, key files or certificates unusable at start-up
    │                                     (missing, readable by others, mismatched, expired):
    │                                     fix the files; nothing was sent
    ├── LedgerError                       the byte ledger cannot be written or read
    └── TransportError                    MQTT connection / publish failure
        ├── ConnectError                  the broker refused or did not answer CONNECT
        ├── PublishTimeout                a QoS 1 publish was not acknowledged in time
        ├── OfflineBufferFull             too many unacknowledged messages are waiting (link down):
        │                                 back off and send again later; nothing was queued
        ├── PublishDropped                a PUBLISH that was not sent and never will be (QoS 0 with
        │                                 the link down or lost under it; unsent at close)
        └── PublishRefused                the broker refused a PUBLISH (PUBACK reason code >= 0x80,
                                          or it closed the connection each time the packet was sent)

Context is kept as attributes (``field``, ``topic``, ``client_id``) so that logs and ledger rows
can name what was wrong without parsing the message text.
"""

from __future__ import annotations


class FedfleetProtocolError(Exception):
    """Base class of every exception raised by :mod:`protocol`."""


class ProtocolError(FedfleetProtocolError):
    """Bytes received from a peer do not form a valid message.

    Attributes:
        field: dotted name of the offending field (``"envelope.kind"``, ``"body.tensors[3]"``),
            or ``None`` when the whole payload is unusable.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class MalformedMessage(ProtocolError):
    """The payload is not msgpack, or a field has the wrong container or scalar type."""


class UnsupportedVersion(ProtocolError):
    """The envelope's protocol version is not one this implementation speaks."""


class UnknownKind(ProtocolError):
    """The envelope's message kind number is not defined in this protocol version."""


class FieldError(ProtocolError):
    """A field is present and well typed but outside its allowed range or set."""


class TensorError(ProtocolError):
    """A tensor has an unknown dtype, a bad shape, a size mismatch or non-finite values."""


class ChunkError(ProtocolError):
    """A chunk cannot be taken: it contradicts its transfer, breaks the layout, fails the
    digest, or would exceed the receiver's memory bounds.

    Attributes:
        field: dotted name of the offending field (``"body.total_bytes"``), or ``None``.
        sender: envelope sender of the chunk, when known.
        transfer_id: the transfer's id, when known.
    """

    def __init__(self, message: str, *, field: str | None = None, sender: str | None = None,
                 transfer_id: bytes | None = None) -> None:
        super().__init__(message, field=field)
        self.sender = sender
        self.transfer_id = transfer_id


class SecurityRejection(ProtocolError):
    """A message refused by the security checks of :mod:`protocol.security` (signature, enrolment,
    replay, decryption).

    Attributes:
        code: the reason code (a key of :data:`protocol.security.REASONS`); the message text
            starts with it.
    """

    def __init__(self, message: str, *, code: str, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.code = code


class SecurityConfigError(FedfleetProtocolError):
    """Keys, key files or certificates cannot be used (found at start-up, before anything is sent).

    Attributes:
        path: the offending file or folder, when there is one.
    """

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class LedgerError(FedfleetProtocolError):
    """The SQLite byte ledger could not be opened, written or read."""


class TransportError(FedfleetProtocolError):
    """The MQTT transport failed (connection refused, lost, or a publish not acknowledged).

    Attributes:
        handle: where a wait for a PUBLISH the MQTT client had taken ended without its outcome
            (:class:`PublishTimeout`; the transport closed while it waited), that PUBLISH's
            handle: it may be on the wire or go out later, and its outcome still comes to the
            delivery listener. ``None``: nothing of it was handed over.
        seq: with ``handle``, raised by :meth:`protocol.channel.Channel.send`: the envelope seq of
            the message sent (its ``sent`` row kept): it may yet reach its recipient, whose answer
            names this seq. ``None`` otherwise.
        chunks_handed, chunk_count: raised by :meth:`protocol.channel.Channel.send` for a message
            sent as a chunked transfer of ``chunk_count`` chunks, when a chunk's wait ended first
            or the transport did not take a chunk: its first ``chunks_handed`` chunks were handed
            to the MQTT client, the others never were (each a ledger row of event ``message``,
            delivery ``dropped``). The message text says which, numbering chunks from 1
            (:meth:`note_chunks`). ``None`` otherwise.
    """

    def __init__(self, message: str, *, client_id: str | None = None, topic: str | None = None,
                 handle: object | None = None) -> None:
        super().__init__(message)
        self.client_id = client_id
        self.topic = topic
        self.handle = handle
        self.seq: int | None = None
        self.chunks_handed: int | None = None
        self.chunk_count: int | None = None

    def note_chunks(self, handed: int, count: int, note: str) -> None:
        """Say that ``handed`` of the ``count`` chunks of the message whose send this error ended
        were handed to the MQTT client: sets :attr:`chunks_handed` and :attr:`chunk_count`, and
        adds ``note`` (which chunks, and why) to the message, so that whoever logs the error
        names them."""
        self.chunks_handed, self.chunk_count = handed, count
        self.args = (f"{self.args[0]}; {note}" if self.args else note, *self.args[1:])


class ConnectError(TransportError):
    """The broker could not be reached, refused the MQTT CONNECT (its CONNACK's reason: "refused
    the login" for a bad user name or password, never showing them), or did not accept it within
    the timeout (only then does the message name a time limit).

    Attributes:
        transient: whether the cause may pass by itself (nothing listening yet, no CONNACK in time,
            a CONNACK saying the server is unavailable or busy), so that connecting again later can
            succeed; ``False`` for a refused login, a refused certificate or a bad address.
        attempts: connects tried before this error (1 without retries).
    """

    def __init__(self, message: str, *, client_id: str | None = None, topic: str | None = None,
                 transient: bool = False, attempts: int = 1) -> None:
        super().__init__(message, client_id=client_id, topic=topic)
        self.transient = transient
        self.attempts = attempts


class PublishTimeout(TransportError):
    """A QoS 1 PUBLISH was not acknowledged (PUBACK) within the timeout."""


class PublishRefused(TransportError):
    """The broker refused a PUBLISH: an MQTT 5 PUBACK with a reason code >= 0x80, a packet above
    the broker's known maximum packet size (not sent), or a packet the broker closed the
    connection for each time it was sent (``notes/mqtt-transport-study.md`` §2.4).

    Attributes:
        reason: the broker's reason (``"Packet too large (0x95)"``) or the transport's finding.
        packet_bytes: size of the refused PUBLISH packet (bytes).
        limit_bytes: the broker's maximum packet size as known when refused (bytes), 0 if unknown.
    """

    def __init__(self, message: str, *, client_id: str | None = None, topic: str | None = None,
                 reason: str = "", packet_bytes: int = 0, limit_bytes: int = 0) -> None:
        super().__init__(message, client_id=client_id, topic=topic)
        self.reason = reason
        self.packet_bytes = packet_bytes
        self.limit_bytes = limit_bytes


class PublishDropped(TransportError):
    """A PUBLISH that was not sent and never will be: a QoS 0 one made while the link is down, or
    one still in paho's packet queue when the connection was lost (MQTT delivers QoS 0 at most
    once and paho keeps no such message for the reconnect; a QoS 1 one is queued and sent after
    the reconnect), or a message of any QoS still unsent when the transport was closed.

    Attributes:
        on_wire: the socket took part of the packet before the connection was lost (its bytes
            count as sent; the broker got no whole packet); ``False``: nothing reached the socket.
        unsent_bytes: with ``on_wire``, the bytes of the packet the socket never took (the
            ledger row's ``unsent_bytes``); 0 otherwise.
    """

    def __init__(self, message: str, *, client_id: str | None = None, topic: str | None = None,
                 on_wire: bool = False, unsent_bytes: int = 0) -> None:
        super().__init__(message, client_id=client_id, topic=topic)
        self.on_wire = on_wire
        self.unsent_bytes = unsent_bytes


class OfflineBufferFull(TransportError):
    """The bounded buffer of unacknowledged QoS 1 messages is full (typically: the link is down).

    Nothing was queued: the caller keeps the message and tries again later (back-pressure), so no
    message is silently lost and memory stays bounded on a device that is offline for long.
    """
