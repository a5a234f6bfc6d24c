"""The transport seam without paho: what a channel needs from a transport, and the values that
cross it (received messages, last wills, packet events, a lost link).

:class:`Transport` is the interface :class:`protocol.channel.Channel` depends on; the real MQTT
implementation is :class:`protocol.transport.MqttTransport` (paho-mqtt 2.x), loaded only by
those who use it, so the codec and the channel import without paho. :class:`LinkEvents` is what
both it and :class:`protocol.memory_transport.MemoryTransport` offer besides: listeners told when
the link to the broker is lost (:class:`LinkLost`) and when a connection is made.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Incoming:
    """One PUBLISH received from the broker.

    Attributes:
        topic: the topic name.
        payload: the payload bytes, exactly as received.
        qos: QoS of the delivery.
        retain: whether the broker delivered it as a retained message.
        received_at: ``time.monotonic()`` at arrival (seconds).
    """

    topic: str
    payload: bytes
    qos: int
    retain: bool
    received_at: float


@dataclass(frozen=True, slots=True)
class Will:
    """MQTT last will: published by the broker when the connection drops without DISCONNECT."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


#: MQTT control packet type (upper nibble of the first byte) → name.
PACKET_TYPES = {1: "CONNECT", 2: "CONNACK", 3: "PUBLISH", 4: "PUBACK", 5: "PUBREC", 6: "PUBREL", 7: "PUBCOMP",
                8: "SUBSCRIBE", 9: "SUBACK", 10: "UNSUBSCRIBE", 11: "UNSUBACK", 12: "PINGREQ", 13: "PINGRESP",
                14: "DISCONNECT", 15: "AUTH"}


@dataclass(frozen=True, slots=True)
class PacketEvent:
    """One MQTT packet handed to the socket queue (``out``) or parsed from the socket (``in``).

    Attributes:
        direction: ``"out"`` (this client → broker) or ``"in"`` (broker → this client).
        packet_type: name from :data:`PACKET_TYPES` (``"PUBACK"``).
        packet_bytes: exact size of the whole packet: fixed header + variable header + payload.
        dup: the DUP flag of a PUBLISH (a retransmission by paho after a reconnect).
        dropped: an ``out`` packet reported before (at its queueing) that the socket never took a
            byte of and never will: a control packet a lost connection or a close dropped from the
            client's queue, or a PUBLISH retransmission (reported with ``dup``) that is never
            written (the transport closed, or its message withdrawn as refused). It voids that
            earlier event, which ``ref`` names (without a ``ref``: the last one of the same type
            and size); its bytes were never on the wire.
        unsent_bytes: > 0: an ``out`` packet reported before (at its queueing: a control packet,
            or a PUBLISH reported with ``dup``) of which the socket took only part before the
            connection was lost, or the transport closed, or its client's network thread ended:
            this many of its bytes never went out (the other ``packet_bytes - unsent_bytes``
            did). It amends that earlier event, which ``ref`` names. (A PUBLISH reported without
            ``dup``, its message's first transmission, is told to the delivery listener instead,
            by its handle: outcome ``unsent``.)
        ref: with ``unsent_bytes`` or ``dropped``, what the packet listener returned for the
            earlier event of that packet (a :class:`~protocol.channel.Channel` returns the id of
            the ledger row it wrote for it); ``None`` otherwise, or when the listener returned
            nothing.
    """

    direction: str
    packet_type: str
    packet_bytes: int
    dup: bool = False
    dropped: bool = False
    unsent_bytes: int = 0
    ref: object = None


@dataclass(frozen=True, slots=True)
class LinkLost:
    """A connection to the broker that was up and is lost (not closed by this client), as told to
    the disconnect listeners (:meth:`LinkEvents.add_disconnect_listener`). The transport
    reconnects by itself; its connect listeners hear of it.

    Attributes:
        connection: the number of the connection lost, counted as the connect listeners count
            them (1: the first accepted CONNECT); once the link is back the connection is
            ``connection + 1``.
        reason: why, as the MQTT client says it: paho-mqtt's reason code name (``"Unspecified
            error"`` for a socket closed or reset under it, ``"Keep alive timeout"``, or the reason
            code of the broker's MQTT 5 DISCONNECT); ``""`` when none is known.
        by_broker: the broker sent a DISCONNECT packet (MQTT 5) before closing the connection.
        unacked_messages: QoS 1 PUBLISHes handed to the MQTT client and not yet acknowledged when
            the link went, in flight or still queued (the client sends them again once it is back);
            0 for a transport that holds none (the memory transport delivers at once).
        unacked_bytes: their payload bytes.
    """

    connection: int
    reason: str = ""
    by_broker: bool = False
    unacked_messages: int = 0
    unacked_bytes: int = 0


class LinkEvents(Protocol):
    """The link events a transport may offer beside :class:`Transport` (a channel needs none):
    :class:`~protocol.transport.MqttTransport` and
    :class:`~protocol.memory_transport.MemoryTransport` both do. Reconnecting is the transport's
    business; its listeners only hear of it. A listener runs on the transport's network thread
    (paho's; the caller's thread of ``drop_link`` in the memory transport), which also sends the
    keepalive and reads the acknowledgements: it must not block (publish without waiting, hand
    slow work such as writing a log record to another thread: :mod:`protocol.link_log`), and an
    exception it raises is logged, never passed on."""

    def add_connect_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(n)`` after the n-th accepted connection (n > 1: a reconnect)."""

    def add_disconnect_listener(self, listener: Callable[[LinkLost], None]) -> None:
        """Call ``listener(lost)`` when a connection that was up is lost, before the reconnect;
        never for the transport's own ``close`` or ``abort``, nor for a connect attempt that
        fails."""


def tell_link_listeners(listeners: list, event: object, *, client_id: str, what: str) -> None:
    """Call each of ``listeners`` with ``event`` (a connection's number, or a :class:`LinkLost`),
    on the caller's thread (paho's network thread for the MQTT transport): a listener that raises
    is logged (``"{client_id}: {what} listener failed"``) and never breaks the transport or the
    listeners after it."""
    for listener in list(listeners):
        try:
            listener(event)
        except Exception:  # a listener must never break the transport's thread
            log.exception("%s: %s listener failed", client_id, what)


class Transport(Protocol):
    """What the channel needs from a transport (a real MQTT client, or a test double)."""

    client_id: str

    def subscribe(self, filters: Iterable[str] | str, qos: int = 1) -> None: ...

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                wait_s: float | None = None) -> object | None:
        """Hand one PUBLISH over; return a handle for its delivery outcome (or ``None``). A
        transport that reports outcomes also has ``set_delivery_listener(fn(handle, outcome,
        reason))`` and ``max_packet_bytes`` (the broker's limit as it knows it, 0 = unknown)."""

    def get(self, timeout_s: float | None) -> Incoming | None: ...

    def close(self) -> None: ...
