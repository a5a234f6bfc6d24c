"""The MQTT transport seam: raw bytes in and out over paho-mqtt 2.x.

This is the only module that touches a socket. It knows nothing of message kinds; the
:class:`protocol.channel.Channel` above it encodes, decodes and keeps the ledger.

Design rules (``notes/mqtt-transport-study.md``):

* paho-mqtt 2.x, ``CallbackAPIVersion.VERSION2``, clean sessions, ``loop_start()``: the network
  loop runs on paho's own thread, so training on the caller's thread never starves keepalive.
* MQTT 5 where the broker speaks it, else MQTT 3.1.1 (``mqtt_version="auto"``, the default: a
  broker that refuses the MQTT 5 CONNECT, or leaves it unanswered for :data:`V5_TRIAL_S`, as amqtt
  0.12.1 does, is connected to again with 3.1.1, and later transports of the process to the same
  address go to 3.1.1 at once);
  ``"5"`` or ``"3.1.1"`` forces one. Under MQTT 5 the transport advertises its own Maximum Packet
  Size in CONNECT (``receive_max_packet_bytes``), reads the broker's from CONNACK
  (:attr:`MqttTransport.broker_max_packet_bytes`) and takes a PUBACK reason code >= 0x80 as a
  refusal with its reason.
* Size limits never loop: a PUBLISH above the broker's known Maximum Packet Size is refused before
  it is sent (:class:`~protocol.errors.PublishRefused`, naming the limit), and a QoS 1 PUBLISH the
  broker closes the connection for :data:`OVERSIZE_STRIKES` times (an MQTT 3.1.1 broker with
  ``max_packet_size``, which says nothing) is taken out of paho's queue, reported refused, and the
  limit is taken to be at most half its size (:attr:`MqttTransport.inferred_max_packet_bytes`); a
  message withdrawn so of which the socket never took a byte is reported ``withdrawn`` (its row
  counts no wire bytes), and a retransmission of one that was never written is voided.
  A broker that acknowledges a QoS 1 PUBLISH and closes the connection at once, before any other
  packet (Mosquitto 2.0 with ``message_size_limit`` over MQTT 3.1.1: an ordinary PUBACK, the
  message dropped), refused it: a close within :data:`ACK_CLOSE_S` of the PUBACK of a packet
  larger than every one the broker acknowledged and then kept the connection for is reported
  ``refused`` after its ``acked``, the limit is taken to be at most half its size, and the
  PUBLISHes above that still in paho's queue are withdrawn as after strikes.
  Each outcome reaches the delivery listener (:meth:`MqttTransport.set_delivery_listener`):
  ``acked`` on a successful PUBACK, ``refused`` with the reason otherwise (also after ``acked``,
  for a PUBLISH the broker closed the connection for right after acknowledging it).
* ``on_message`` only enqueues ``(topic, payload)``; all decoding happens on the consumer's thread.
* Subscriptions are renewed in ``on_connect``, so a reconnect after a broker restart resumes
  without relying on broker sessions. The link events reach listeners
  (:class:`~protocol.transport_base.LinkEvents`): a connection lost (``on_disconnect`` of a
  connection that was up, not closed by this client: :meth:`MqttTransport.add_disconnect_listener`)
  and each accepted one (:meth:`MqttTransport.add_connect_listener`, once the broker acknowledged
  the renewed subscriptions (SUBACK), so what they publish (an agent's ``online``) cannot overtake
  them), both on paho's thread.
* ``wait_for_publish(timeout)`` returns silently on timeout: :meth:`MqttTransport.publish` checks
  ``is_published()`` afterwards and raises :class:`~protocol.errors.PublishTimeout`.

The paho-free parts live beside it and are re-exported here: the seam's types in
:mod:`protocol.transport_base` (``Transport``, ``Incoming``, ``Will``, ``PacketEvent``,
``LinkEvents``, ``LinkLost``) and the TLS
checks in :mod:`protocol.transport_tls` (``tls_context``). Importing this module without paho-mqtt
raises an :class:`ImportError` that says so.
"""

from __future__ import annotations

import logging
import queue
import random
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

try:
    import paho.mqtt.client as mqtt
except ImportError as exc:  # the codec works without paho; only the MQTT transport needs it
    raise ImportError(f"protocol.transport (MqttTransport, the MQTT client) needs paho-mqtt 2.x, which cannot be "
                      f"imported ({exc}): pip install 'paho-mqtt>=2.0,<3'. The codec (protocol.messages, "
                      f"protocol.tensors, protocol.chunking, protocol.channel) works without it",
                      name="paho") from exc

from .errors import ConnectError, OfflineBufferFull, PublishDropped, PublishRefused, PublishTimeout, TransportError
from .memory_transport import check_filter
from .mqtt_bytes import MQTT_V5, MQTT_V311, publish_size
from .transport_base import (
    PACKET_TYPES,
    Incoming,
    LinkEvents,
    LinkLost,
    PacketEvent,
    Transport,
    Will,
    tell_link_listeners,
)
from .transport_tls import tls_context

__all__ = ["ACK_CLOSE_S", "MQTT_VERSIONS", "OVERSIZE_STRIKES", "PACKET_TYPES", "ConnectRetry", "Incoming",
           "LinkEvents", "LinkLost", "MqttTransport", "PacketEvent", "PollingClient", "Transport", "Will",
           "parse_mqtt_version", "tls_context"]

log = logging.getLogger(__name__)

#: Seconds an MQTT 5 CONNECT may wait for its CONNACK before ``auto`` tries MQTT 3.1.1.
V5_TRIAL_S = 5.0

#: (host, port) of brokers that refused MQTT 5 in this process: ``auto`` goes to 3.1.1 at once.
_V311_ONLY: set[tuple[str, int]] = set()

#: Accepted values of ``mqtt_version``: ``auto`` (MQTT 5, else 3.1.1), ``5``, ``3.1.1``.
MQTT_VERSIONS = ("auto", "5", "3.1.1")

#: Connections the broker may close while one QoS 1 PUBLISH waits for its PUBACK before that
#: PUBLISH is taken for one above the broker's packet limit and refused (never re-sent whole again).
OVERSIZE_STRIKES = 2

#: Seconds within which a close of the connection right after the PUBACK of a QoS 1 PUBLISH (no
#: other packet between them) counts as the broker's refusal of that PUBLISH.
ACK_CLOSE_S = 0.5

#: MQTT 5 reason codes a PUBACK may carry as a refusal (§3.4.2.1), with their names; Mosquitto
#: 2.0 also sends 0x95 (Packet too large, a DISCONNECT code) for a message over
#: ``message_size_limit``, which paho would take for a protocol error.
PUBACK_REFUSALS = {0x80: "Unspecified error", 0x83: "Implementation specific error", 0x87: "Not authorized",
                   0x90: "Topic Name invalid", 0x91: "Packet Identifier in use", 0x95: "Packet too large",
                   0x97: "Quota exceeded", 0x99: "Payload format invalid"}
_PUBACK_VALID = frozenset(PUBACK_REFUSALS) - {0x95}

#: CONNACK reason codes that say the broker cannot take the connection *now*: MQTT 3.1.1's return
#: code 3 (paho 2.x reports it as 0x88), MQTT 5's 0x88 Server unavailable, 0x89 Server busy, 0x97
#: Quota exceeded and 0x9F Connection rate exceeded. A connect refused with one of them is worth
#: trying again later (:class:`ConnectRetry`); any other refusal (bad login, not authorised) is not.
TRANSIENT_CONNACK_CODES = frozenset({0x03, 0x88, 0x89, 0x97, 0x9F})

#: CONNACK reason codes that refuse the client's login: 0x86 Bad user name or password (MQTT 3.1.1's
#: return code 4), 0x87 Not authorized (return code 5), 0x8C Bad authentication method. A
#: :class:`~protocol.errors.ConnectError` says "refused the login" for them.
LOGIN_CONNACK_CODES = frozenset({0x86, 0x87, 0x8C})


#: MQTT 3.1.1 CONNACK return codes (§3.2.2.3) of the reason codes paho 2.x reports them as
#: (``paho.mqtt._packet.convert_connack_rc_to_reason_code``): 1 unacceptable protocol version,
#: 2 identifier rejected, 3 server unavailable, 4 bad user name or password, 5 not authorized.
#: A return code above 5 (reserved) paho reports as 0x80 Unspecified error, the code itself lost.
V311_RETURN_CODES = {0x84: 1, 0x85: 2, 0x88: 3, 0x86: 4, 0x87: 5}


def _refusal_text(where: str, client_id: str, level: str, code: int, name: str, *, login: bool = True) -> str:
    """What a :class:`~protocol.errors.ConnectError` says of a CONNACK that refused the connection
    of ``client_id`` (``where``: ``the MQTT broker at HOST:PORT``; ``level``: ``"5"`` or
    ``"3.1.1"``; ``code``: the reason code paho reports, ``name`` its text, ``Not authorized``;
    ``login``: whether the client gave a user name). An MQTT 5 refusal names its reason code
    (``0x87``), an MQTT 3.1.1 one its return code (``5``, :data:`V311_RETURN_CODES`). No time
    limit is named: the broker answered. A login refusal (:data:`LOGIN_CONNACK_CODES`) says so,
    and, when the client gave no login, that the broker asks for one; the user name and password
    are never in it."""
    if level == "5":
        said = f"{name} (MQTT 5 CONNACK reason code {code:#04x})"
    elif code in V311_RETURN_CODES:
        said = f"{name} (MQTT 3.1.1 CONNACK return code {V311_RETURN_CODES[code]})"
    else:
        said = f"{name} (MQTT 3.1.1 CONNACK return code above 5, reserved)"
    if code in LOGIN_CONNACK_CODES:
        if not login:
            return (f"{where} refused the connection of {client_id!r}: {said}; the broker asks for a login and none "
                    "was given: pass a user name and password (--username/--password-file, or USER:PASSWORD@ in "
                    "the --broker URL)")
        return (f"{where} refused the login of {client_id!r}: {said}; check the user name and password it was given "
                "(neither is shown here) and the broker's password file and ACL")
    hint = ("the broker may be overloaded or still starting" if code in TRANSIENT_CONNACK_CODES
            else "check the client id, the credentials and the TLS settings")
    return f"{where} refused the connection of {client_id!r}: {said}; {hint}"


_POLL_READ = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP | select.POLLNVAL
_POLL_WRITE = select.POLLOUT | select.POLLERR | select.POLLHUP


@dataclass(frozen=True)
class ConnectRetry:
    """How :meth:`MqttTransport.connect` tries again after a connect that failed for a reason that
    may pass (:attr:`~protocol.errors.ConnectError.transient`: nothing listening yet, no CONNACK in
    time, a CONNACK saying the broker is unavailable or busy).

    A fleet that reboots together (a power cut, a firmware roll-out) connects all at once: a broker
    that cannot answer every CONNECT in time, or is still starting, must not turn that moment into
    devices that give up. Retry ``k`` (1, 2, …) waits a delay drawn uniformly from
    ``[0, min(cap_s, base_s · 2^(k−1))]`` ("full jitter", M. Brooker, "Exponential Backoff And
    Jitter", AWS Architecture Blog, 2015): the exponential part backs the fleet off as the broker
    stays busy, the random part spreads devices that failed together so they do not all come back
    in the same instant. Each retry is logged as a warning with its reason and delay.

    Attributes:
        attempts: connects tried in all (1: no retry), >= 1.
        base_s: upper bound of the first retry's delay (seconds), > 0.
        cap_s: largest delay (seconds), >= ``base_s``.
        seed: seed of the jitter's generator (``None``: a fresh one; tests fix it to know the delays).

    Raises:
        ValueError: a value out of its range.
    """

    attempts: int = 1
    base_s: float = 0.5
    cap_s: float = 30.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"ConnectRetry.attempts must be >= 1, got {self.attempts}")
        if not self.base_s > 0 or not self.cap_s >= self.base_s:
            raise ValueError(f"ConnectRetry needs 0 < base_s <= cap_s, got base_s={self.base_s}, cap_s={self.cap_s}")

    def delay_s(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before retry ``retry`` (1 = the first), drawn from ``rng``."""
        return rng.uniform(0.0, min(self.cap_s, self.base_s * 2.0 ** (retry - 1)))


def parse_mqtt_version(value: str | int) -> str:
    """Normalise an MQTT version choice: ``"auto"``, ``"5"`` or ``"3.1.1"`` (``5``, ``"v5"``,
    ``"5.0"``, ``4``, ``"311"``, ``"v3.1.1"`` are accepted spellings).

    Raises:
        ValueError: any other value (the message lists the accepted ones).
    """
    text = str(value).strip().lower().removeprefix("v").removeprefix("mqtt")
    if text in ("auto", ""):
        return "auto"
    if text in ("5", "5.0"):
        return "5"
    if text in ("3.1.1", "311", "4"):
        return "3.1.1"
    raise ValueError(f"MQTT version {value!r}: expected one of {', '.join(MQTT_VERSIONS)}")


def _published(info: mqtt.MQTTMessageInfo) -> bool:
    """Whether the broker acknowledged the message. paho's ``is_published()`` raises for a message
    queued while the link was down (its ``rc`` stays ``MQTT_ERR_NO_CONN`` even after paho re-sent it
    and got the PUBACK), so the acknowledgement flag paho sets on PUBACK is read directly."""
    try:
        return info.is_published()
    except (RuntimeError, ValueError):
        with info._condition:  # paho-mqtt 2.x: set by the PUBACK handler
            return bool(info._published)


def _unsupported_version(refusal: str | None) -> bool:
    """Whether a CONNACK refusal text says the protocol level was not accepted (MQTT 5 0x84, or
    the 3.1.1 return code 1 an MQTT 3.1.1-only broker such as amqtt answers an MQTT 5 CONNECT with)."""
    return refusal is not None and ("0x84" in refusal or "0x01" in refusal or "protocol version" in refusal.lower())


class PollingClient(mqtt.Client):
    """paho-mqtt's ``Client`` whose network loop waits with ``poll()``, not ``select()``, so that it
    works whatever its socket's descriptor number (see :meth:`_loop`). A drop-in for
    ``paho.mqtt.client.Client``."""

    def _loop(self, timeout: float = 1.0):
        """paho 2.x's ``Client._loop`` (one pass of the network loop that ``loop_forever`` and
        ``loop_start``'s thread run) with ``poll()`` where paho calls ``select()``.

        ``select()`` cannot watch a file descriptor of 1024 (``FD_SETSIZE``) or more: it raises
        ``ValueError``, which paho takes for a lost connection, so a client whose socket got such a
        number never saw its CONNACK and reconnected forever. Each client holds three descriptors
        (its socket and paho's wake-up socket pair), so one process could hold about 340 clients:
        a simulated fleet of 500 virtual agents failed at its 338th connect ("no CONNACK").
        ``poll()`` has no such bound. Everything else is paho's logic: read when readable (or when
        TLS holds decrypted bytes), write when paho wants to and can, or when another thread woke
        the loop through the socket pair; then ``loop_misc`` (keepalive).
        """
        if timeout < 0.0:
            raise ValueError("Invalid timeout.")
        sock = self._sock
        if sock is None:
            return mqtt.MQTT_ERR_NO_CONN
        pending = sock.pending() if hasattr(sock, "pending") else 0
        if pending > 0:  # bytes left in the TLS object: do not wait
            timeout = 0.0
        want_write = self.want_write()
        pair = self._sockpairR
        poller = select.poll()
        try:
            fd = sock.fileno()
            poller.register(fd, select.POLLIN | (select.POLLOUT if want_write else 0))
            pair_fd = pair.fileno() if pair is not None else -1
            if pair_fd >= 0:
                poller.register(pair_fd, select.POLLIN)
            events = dict(poller.poll(timeout * 1000.0))
        except (TypeError, ValueError, OSError):  # the socket was closed under the loop (disconnect)
            if self._state not in (mqtt._ConnectionState.MQTT_CS_DISCONNECTING,
                                   mqtt._ConnectionState.MQTT_CS_DISCONNECTED):
                self._state = mqtt._ConnectionState.MQTT_CS_CONNECTION_LOST
            return mqtt.MQTT_ERR_CONN_LOST
        if events.get(fd, 0) & _POLL_READ or pending > 0:
            rc = self.loop_read()
            if rc or self._sock is None:
                return rc
        woken = pair_fd >= 0 and bool(events.get(pair_fd, 0) & select.POLLIN)
        if woken and pair is not None:
            try:  # one byte per wake-up; many may have accumulated
                pair.recv(10000)
            except BlockingIOError:
                pass
        if woken or (want_write and events.get(fd, 0) & _POLL_WRITE):
            rc = self.loop_write()
            if rc or self._sock is None:
                return rc
        return self.loop_misc()


#: What names the ledger row of a packet queued (:class:`_CountingClient`): the event reported at its
#: queueing, what the packet listener returned for it, and the message's handle for a QoS > 0
#: PUBLISH reported as its message's first transmission (else ``None``).
_Note = tuple[PacketEvent, object, "mqtt.MQTTMessageInfo | None"]


class _CountingClient(PollingClient):
    """paho Client that reports every packet and counts socket bytes.

    Two paho internals are wrapped (paho-mqtt 2.x): ``_packet_queue`` (each outgoing packet, as
    complete bytes) and ``_packet_handle`` (each complete incoming packet); ``_sock_send`` /
    ``_sock_recv`` count the raw bytes written to / read from the socket (before TLS).

    paho marks a QoS 1 PUBLISH as awaiting its PUBACK when it queues the packet, not when the
    socket takes it; a connection lost with the packet still unwritten in paho's queue drops the
    packet, and after the reconnect paho sends the message with DUP set although it was never on the
    wire. :meth:`reconnect` notes such messages (:meth:`unwritten_mids`), and their next PUBLISH is
    reported as a first transmission (``dup=False``), so the ledger counts it once, as the wire does.

    A QoS 0 PUBLISH is kept by paho only as a packet in that queue: one the lost connection leaves
    there is never sent (paho marks it published with ``MQTT_ERR_CONN_LOST``). Each QoS 0 PUBLISH
    queued is noted until the socket took all of it (:meth:`qos0_written`); those :meth:`reconnect`
    finds unwritten or partly written go to ``on_lost``.

    A packet the socket took part of when the connection was lost (or the network thread ended for
    good) never goes out whole: paho writes its queue in order, so only the packet at the head of
    the queue can be partly written (``0 < pos < len``). Each packet queued is noted with what
    names the row that stands for it: the event reported for it, what ``on_packet`` returned for
    that event (a channel: the id of the ledger row it wrote) and, for a QoS > 0 PUBLISH reported
    as its message's first transmission, the message's ``MQTTMessageInfo`` (the channel's row is
    the message's ``sent`` row). A re-send in place of a packet that never reached the socket
    (reported without DUP, above) writes no row of its own: it takes the note of that packet
    (the message's first transmission, or a retransmission whose row then stands for it).
    :meth:`report_cut` finds the partly written head, once, and reports its note to ``on_cut`` as
    ``(event, ref, handle, bytes the socket never took)``. A QoS 0 PUBLISH is left to
    ``on_lost``, which says how much of it the socket took. The notes are keyed by the identity of
    the packet's bytes, which paho's queue holds until the packet is written or dropped; those of
    packets no longer queued are let go on the network thread between passes of its loop
    (:meth:`_loop`), where no packet is half-way through a write.

    The same notes name the row of a transmission that will never be made: a message withdrawn
    (:meth:`MqttTransport._withdraw_oversize`), or held when the network thread has ended for good
    (:meth:`held_messages`), has the note of its pending transmission when the socket took no
    byte of it (:meth:`pending_note`). Which messages the socket took a PUBLISH of whole is noted
    per connection (:meth:`note_whole_writes`): the broker never got a whole packet of the others.

    paho's ``reconnect`` sets its new socket before it queues CONNECT (and calls
    ``on_socket_open`` between the two); a PUBLISH another thread queued in that gap went out
    before CONNECT, and the broker closed the connection (a protocol error; against Mosquitto a
    false MQTT 5 → 3.1.1 fallback). From a reconnect's start until its CONNECT is queued,
    :meth:`_send_publish` answers as paho does without a socket (``MQTT_ERR_NO_CONN``): a QoS > 0
    message waits in paho's queue and goes out after the CONNACK, a QoS 0 one is not sent and said
    so (the link is not up).
    """

    def __init__(self, *args, on_packet, on_lost=None, on_cut=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._fedfleet_on_packet = on_packet
        # called as on_cut(event, ref, handle, bytes the socket never took) (see report_cut)
        self._fedfleet_on_cut: Callable[[PacketEvent, object, mqtt.MQTTMessageInfo | None, int], None] | None = \
            on_cut
        # id(packet bytes) -> note (event reported, what on_packet returned, the message's handle for a
        # first transmission) of each packet queued; the ids of packets no longer in paho's queue are
        # let go in _loop (stale ones are overwritten on reuse)
        self._queued: dict[int, _Note] = {}
        self._last_noted: dict[int, _Note] = {}  # mid -> note of the last QoS > 0 PUBLISH queued of it
        # mid -> handle of each QoS > 0 message of which the socket took one PUBLISH whole (note_whole_writes)
        self._whole: dict[int, mqtt.MQTTMessageInfo] = {}
        # mid -> handle of each QoS > 0 message a PUBLISH of which was queued on this connection
        self._queued_here: dict[int, mqtt.MQTTMessageInfo] = {}
        # held while a packet is noted and queued, and while the notes are pruned: one noted and not
        # yet in paho's queue is never taken for gone (re-entrant: paho may write from inside its queueing)
        self._queued_lock = threading.RLock()
        # called as on_lost(list of (handle, packet bytes, bytes the socket took), why) on paho's thread
        self._fedfleet_on_lost: Callable[[list[tuple[mqtt.MQTTMessageInfo, int, int]], str], None] | None = on_lost
        self.socket_bytes_out = 0
        self.socket_bytes_in = 0
        self.puback_codes: dict[int, int] = {}  # mid -> reason code >= 0x80 of its MQTT 5 PUBACK
        self._never_written: set[int] = set()  # mids whose last PUBLISH was dropped unwritten
        # mid -> (handle, packet bytes) of each QoS 0 PUBLISH queued and not yet wholly written
        self._qos0_unwritten: dict[int, tuple[mqtt.MQTTMessageInfo, int]] = {}
        # held while a QoS 0 PUBLISH is noted and queued, and while the lost ones are taken: one noted
        # but not yet in the queue is not taken for lost (re-entrant: paho may write, then call
        # on_publish, from inside its queueing when no network thread runs)
        self._qos0_lock = threading.RLock()
        # a reconnect's CONNECT not yet queued: no PUBLISH goes into the queue ahead of it (the gate
        # makes the check and the queueing one step against the reconnect's start)
        self._connect_pending = False
        self._publish_gate = threading.RLock()  # re-entrant: paho may call on_publish from inside the queueing

    def qos0_written(self, mid: int) -> mqtt.MQTTMessageInfo | None:
        """The handle of QoS 0 PUBLISH ``mid``, which the socket has now taken whole (paho's
        ``on_publish`` for it), no longer noted as unwritten; ``None`` when it is not one."""
        entry = self._qos0_unwritten.pop(mid, None)
        return entry[0] if entry is not None else None

    def take_lost_qos0(self, taken: dict[int, int] | None = None) -> list[tuple[mqtt.MQTTMessageInfo, int, int]]:
        """``(handle, packet bytes, bytes the socket took)`` of each QoS 0 PUBLISH noted as queued
        and not wholly written that is lost, no longer noted: with ``taken`` (mid -> bytes the
        socket took, read from paho's queue before :meth:`reconnect` emptied it) those no longer in
        the queue; without it every one (a client whose network thread has ended for good: nothing
        in its queue is written any more)."""
        with self._qos0_lock:
            queued = {p["mid"]: p["pos"] for p in tuple(self._out_packet)
                      if p["command"] & 0xF0 == mqtt.PUBLISH and p["qos"] == 0}
            lost = []
            for mid, (info, size) in list(self._qos0_unwritten.items()):
                if taken is None or mid not in queued:
                    self._qos0_unwritten.pop(mid, None)
                    lost.append((info, size, taken.get(mid, 0) if taken is not None else queued.get(mid, 0)))
            return lost

    def report_cut(self) -> None:
        """Report the packet at the head of paho's queue when the socket took part of it and not
        all (``0 < pos < len``), once: to ``on_cut`` as ``(event, ref, handle, unsent)`` with the
        event reported at its queueing, what ``on_packet`` returned for it, the message's handle
        for a QoS > 0 PUBLISH reported as a first transmission (else ``None``), and the bytes the
        socket never took. Only the head can be partly written (paho writes its queue in order).
        A QoS 0 PUBLISH is not reported here (``on_lost`` says what the socket took of it).

        Call it where nothing more of the queue is written: on the network thread once the
        connection is lost (paho's socket closed), or after the thread has ended for good; a
        packet half-way through a write is not in paho's queue (paho takes it out while the
        socket writes), so a call from another thread while the loop runs may miss it.
        """
        with self._queued_lock:
            try:
                head = self._out_packet[0]
            except IndexError:
                return
            if not 0 < head["pos"] < len(head["packet"]):
                return
            noted = self._queued.pop(id(head["packet"]), None)  # popped: reported once
        if noted is None or (head["command"] & 0xF0 == mqtt.PUBLISH and head["qos"] == 0):
            return
        if self._fedfleet_on_cut is not None:
            self._fedfleet_on_cut(*noted, len(head["packet"]) - head["pos"])

    def _loop(self, timeout: float = 1.0):
        """:meth:`PollingClient._loop`, after letting go of the notes of packets no longer in
        paho's queue (written or dropped), and of messages no longer held, once there are many of
        them: here, between two passes of the network loop, every queued packet is in paho's
        queue."""
        if len(self._queued) > 2 * len(self._out_packet) + 64:
            with self._queued_lock:
                live = {id(p["packet"]) for p in tuple(self._out_packet)}
                self._queued = {k: v for k, v in self._queued.items() if k in live}
        if len(self._last_noted) > 2 * len(self._out_messages) + 64:  # acknowledged or withdrawn: never sent again
            with self._queued_lock:
                self._last_noted = {mid: n for mid, n in self._last_noted.items() if mid in self._out_messages}
        for name in ("_whole", "_queued_here"):  # of messages acknowledged or withdrawn
            notes = getattr(self, name)
            if len(notes) > 2 * len(self._out_messages) + 64:
                with self._out_message_mutex, self._queued_lock:  # paho's order: a publish queues under both
                    setattr(self, name, {mid: i for mid, i in notes.items()
                                         if (m := self._out_messages.get(mid)) is not None and m.info is i})
        return super()._loop(timeout)

    def _report_lost(self, lost: list[tuple[mqtt.MQTTMessageInfo, int, int]], why: str) -> None:
        if lost and self._fedfleet_on_lost is not None:
            self._fedfleet_on_lost(lost, why)

    def void_unwritten_control(self) -> None:
        """Report each control packet (not a PUBLISH) in paho's queue of which the socket took no
        byte as ``dropped`` (its queueing was reported), once, with the ``ref`` ``on_packet``
        returned for its queueing (the row to void): paho's reconnect empties the queue, and a
        client whose thread has ended writes it no more. (An unwritten PUBLISH is not reported
        here: at a reconnect its message is sent again, :meth:`reconnect`; a client that has ended
        leaves it to :meth:`held_messages`.)"""
        for p in tuple(self._out_packet):
            if p["command"] & 0xF0 != mqtt.PUBLISH and p["pos"] == 0:
                with self._queued_lock:
                    noted = self._queued.pop(id(p["packet"]), None)  # popped: reported once
                if noted is not None:
                    self._fedfleet_on_packet(PacketEvent("out", PACKET_TYPES.get(p["command"] >> 4, "?"),
                                                         len(p["packet"]), dropped=True, ref=noted[1]))

    def partial_head(self) -> int | None:
        """The message id of the QoS > 0 PUBLISH at the head of paho's queue when the socket took
        part of it and not all (``0 < pos < len``), else ``None`` (whether or not :meth:`report_cut`
        reported it already). Read it where nothing more is written (see :meth:`report_cut`)."""
        try:
            head = self._out_packet[0]
        except IndexError:
            return None
        if head["command"] & 0xF0 == mqtt.PUBLISH and head["qos"] > 0 and 0 < head["pos"] < len(head["packet"]):
            return int(head["mid"])
        return None

    def note_whole_writes(self) -> None:
        """Note each QoS > 0 message whose PUBLISH queued on this connection the socket took whole:
        still held (no PUBACK yet), and its packet neither unwritten in paho's queue nor the partly
        written head (:meth:`partial_head`); a message never noted so has never been on the wire
        whole (:meth:`whole_once`). Call it where nothing more is written and before the next
        connection queues anything: :meth:`reconnect` (which then starts the next connection's
        list), a client replaced or whose network thread has ended."""
        unwritten = self.unwritten_mids()
        partial = self.partial_head()
        with self._out_message_mutex, self._queued_lock:
            for mid, info in self._queued_here.items():
                m = self._out_messages.get(mid)
                if m is not None and m.info is info and mid not in unwritten and mid != partial:
                    self._whole[mid] = info

    def whole_once(self, msg: mqtt.MQTTMessage) -> bool:
        """Whether the socket took a PUBLISH of QoS > 0 message ``msg`` whole (as noted by
        :meth:`note_whole_writes`): the broker may have it."""
        return self._whole.get(msg.mid) is msg.info

    def pending_note(self, msg: mqtt.MQTTMessage, unwritten: set[int] | None = None) -> _Note | None:
        """The note (:data:`_Note`) of the row that stands for the transmission of QoS > 0 message
        ``msg`` that paho has yet to make, when the socket took no byte of it; ``None`` when its
        last PUBLISH reached the socket (whole, or the partly written head of the queue) and no
        transmission of it with a row of its own is pending.

        Pending: the message awaits a connection (or room in flight), or its packet is in paho's
        queue unwritten (``unwritten``: :meth:`unwritten_mids`, read once by a caller asking for many
        messages). Its row: a message never sent before (no DUP flag) has its own first
        transmission (a note made here, with its handle); one whose last PUBLISH was dropped
        unwritten (:meth:`reconnect`) or is unwritten in the queue has the note of that packet (a
        re-send in place of one that never reached the socket took the note of the packet it
        replaced: the message's first transmission, or a ``PUBLISH-DUP`` row); one whose last
        PUBLISH reached the socket on an earlier connection has none yet (its retransmission is
        reported when paho queues it)."""
        if unwritten is None:
            unwritten = self.unwritten_mids()
        mid = msg.mid
        if msg.state == mqtt.mqtt_ms_wait_for_puback and mid not in unwritten and mid not in self._never_written:
            return None  # on the socket on this connection, whole or in part (in flight with no packet: noted)
        size = publish_size(msg.topic, len(msg.payload), msg.qos,
                            protocol=MQTT_V5 if self._protocol == mqtt.MQTTv5 else MQTT_V311).packet_bytes
        own: _Note = (PacketEvent("out", "PUBLISH", size, False), None, msg.info)
        if not msg.dup:
            return own
        if mid in unwritten or mid in self._never_written:
            return self._last_noted.get(mid, own)
        return None

    def held_messages(self) -> list[tuple[mqtt.MQTTMessage, _Note | None]]:
        """Each QoS > 0 message this client holds (not acknowledged), with the note of its pending
        transmission that never reached the socket (:meth:`pending_note`), or ``None``. For a client
        whose network thread has ended for good (nothing more is written): a note with its
        message's handle (no DUP) says no PUBLISH of the message ever reached the socket; one of a
        ``PUBLISH-DUP`` row, a row that stands for a packet never written."""
        unwritten = self.unwritten_mids()
        with self._out_message_mutex:
            held = [m for m in self._out_messages.values() if m.qos > 0]
        with self._queued_lock:
            return [(m, self.pending_note(m, unwritten)) for m in held]

    def unwritten_mids(self) -> set[int]:
        """Message ids of the QoS > 0 PUBLISH packets in paho's queue of which the socket has taken
        no byte yet (any thread; a copy of the queue is read, which paho may change meanwhile)."""
        return {p["mid"] for p in tuple(self._out_packet)
                if p["command"] & 0xF0 == mqtt.PUBLISH and p["qos"] > 0 and p["pos"] == 0}

    def written_awaiting_puback(self) -> list[mqtt.MQTTMessage]:
        """The QoS > 0 messages whose PUBLISH the socket took (a byte of it at least) and whose
        PUBACK has not come: those a broker that closes the connection can have refused."""
        unwritten = self.unwritten_mids()
        with self._out_message_mutex:
            return [m for m in self._out_messages.values()
                    if m.qos > 0 and m.state == mqtt.mqtt_ms_wait_for_puback and m.mid not in unwritten]

    def unsent_messages(self) -> list[mqtt.MQTTMessage]:
        """The QoS > 0 messages of which no PUBLISH ever reached the socket, as far as this client
        knows: the transmission paho has yet to make is their first (:meth:`pending_note`: not sent
        before, or every PUBLISH of them was dropped unwritten, a re-send in place included)."""
        return [m for m, note in self.held_messages() if note is not None and not note[0].dup]

    def take_queue(self, old: _CountingClient) -> list[mqtt.MQTTMessage]:
        """Move the QoS > 0 messages of ``old`` (a client being replaced, its network thread stopped
        or ending) into this client, which has queued none: same message ids and handles, and each
        is sent after this client's CONNACK as paho re-sends its queue after a reconnect (a PUBLISH
        the old socket took a byte of with DUP, one it never took noted as in :meth:`reconnect`).
        Returns the messages moved."""
        old.note_whole_writes()
        with old._out_message_mutex:
            moved = {mid: m for mid, m in old._out_messages.items() if m.qos > 0}
            never = (old._never_written | old.unwritten_mids()) & set(moved)
            old._out_messages.clear()
            old._inflight_messages = 0
        with self._out_message_mutex:
            if self._out_messages:
                raise RuntimeError("take_queue: this client has queued messages of its own")
            self._out_messages.update(moved)
            self._never_written = never
        with self._queued_lock:  # the rows that stand for their next transmissions, and what went out whole
            self._last_noted.update({mid: n for mid, n in old._last_noted.items() if mid in never})
            self._whole.update({mid: i for mid, i in old._whole.items() if mid in moved and moved[mid].info is i})
        with self._mid_generate_mutex:
            self._last_mid = old._last_mid
        return list(moved.values())

    def reconnect(self):
        """paho's ``reconnect`` (which empties paho's packet queue), after noting the QoS > 0
        PUBLISH packets it drops unwritten and the messages the socket took whole
        (:meth:`note_whole_writes`), reporting a packet the socket took part of to
        ``on_cut`` (:meth:`report_cut`), the control packets it drops unwritten as ``dropped``,
        and the QoS 0 PUBLISH packets it drops (never sent again) to ``on_lost``, with how much of
        each the socket took (paho thread)."""
        with self._publish_gate:  # a PUBLISH being queued now goes into the old queue, which is emptied below
            self._connect_pending = True
        with self._out_message_mutex:
            live = set(self._out_messages)
        self._never_written = (self._never_written & live) | self.unwritten_mids()
        self.note_whole_writes()
        with self._queued_lock:
            self._queued_here = {}  # the next connection's
        taken = {p["mid"]: p["pos"] for p in tuple(self._out_packet)
                 if p["command"] & 0xF0 == mqtt.PUBLISH and p["qos"] == 0}
        self.report_cut()  # paho's thread: nothing is written until the queue is emptied
        self.void_unwritten_control()
        try:
            return super().reconnect()
        finally:  # also when the new connection fails (paho emptied its queue first)
            self._connect_pending = False
            self._report_lost(self.take_lost_qos0(taken), "the link is down: the connection was lost")

    def _send_publish(self, mid, topic, payload=b"", qos=0, retain=False, dup=False, info=None, properties=None):
        """paho's, but ``MQTT_ERR_NO_CONN`` while a reconnect has not yet queued its CONNECT (the
        class docstring), as paho answers with no socket.

        A QoS > 0 message's first transmission that gets no packet (``MQTT_ERR_NO_CONN``: no
        socket) is noted as never written: paho may already count it in flight (its re-send after a
        CONNACK whose connection was lost meanwhile, paho's ``_handle_connack``), and then sends it
        with DUP after the next reconnect, though no PUBLISH of it was ever on the wire; that send
        is reported as its first transmission (:meth:`_packet_queue`)."""
        with self._publish_gate:
            if self._connect_pending:
                rc = mqtt.MQTTErrorCode.MQTT_ERR_NO_CONN
            else:
                rc = super()._send_publish(mid, topic, payload, qos, retain, dup, info, properties)
            if rc == mqtt.MQTTErrorCode.MQTT_ERR_NO_CONN and qos > 0 and not dup:
                self._never_written.add(mid)
            return rc

    def _packet_queue(self, command, packet, mid, qos, info=None):
        first = packet[0] if len(packet) else command  # paho sets DUP in the packet, not in `command`
        if first >> 4 == 3 and qos == 0 and info is not None:  # noted before paho's thread can write it
            with self._qos0_lock:
                self._qos0_unwritten[mid] = (info, len(packet))
                return self._queue_noted(PacketEvent("out", "PUBLISH", len(packet), False),
                                         command, packet, mid, qos, info)
        if first >> 4 == 1:  # CONNECT: a PUBLISH queued from now on goes after it
            try:
                return self._queue_noted(PacketEvent("out", "CONNECT", len(packet), False),
                                         command, packet, mid, qos, info)
            finally:
                self._connect_pending = False
        dup = bool(first & 0x08) and first >> 4 == 3
        in_place = False
        if first >> 4 == 3 and qos > 0 and mid in self._never_written:
            # the re-send in place of a packet that never reached the socket (not a retransmission),
            # or a new message under a reused mid (the note was stale: a withdrawn message's)
            self._never_written.discard(mid)
            in_place = dup  # paho's re-send has DUP set; a new message has not
            dup = False
        return self._queue_noted(PacketEvent("out", PACKET_TYPES.get(first >> 4, "?"), len(packet), dup),
                                 command, packet, mid, qos, info, in_place=in_place)

    def _queue_noted(self, event: PacketEvent, command, packet, mid, qos, info, *, in_place: bool = False):
        """Report ``event`` to ``on_packet``, note the packet (for :meth:`report_cut`), then hand
        it to paho's queue. The note: ``event``, what ``on_packet`` returned and, for a QoS > 0
        PUBLISH reported as a first transmission, its message's handle; ``in_place`` (a re-send in
        place of a packet of the message that never reached the socket): that packet's note (when
        this client queued none, as for a message moved from a replaced client that never wrote
        it: the message's own, its first transmission)."""
        ref = self._fedfleet_on_packet(event)
        note: _Note = (event, ref, None)
        publish = event.packet_type == "PUBLISH" and qos > 0
        msg = self._out_messages.get(mid) if publish else None  # a dict read: paho holds its lock around this call
        handle = info if info is not None else msg.info if msg is not None else None
        replaced = self._last_noted.get(mid) if publish and in_place else None
        if replaced is not None:
            note = replaced
        elif publish and not event.dup:
            note = (event, ref, handle)
        with self._queued_lock:
            self._queued[id(packet)] = note
            if publish:
                self._last_noted[mid] = note
                if handle is not None:
                    self._queued_here[mid] = handle
            return super()._packet_queue(command, packet, mid, qos, info)

    def _packet_handle(self):
        ip = self._in_packet
        rl = ip["remaining_length"]
        size = 1 + (1 if rl < 128 else 2 if rl < 16_384 else 3 if rl < 2_097_152 else 4) + rl
        self._fedfleet_on_packet(PacketEvent("in", PACKET_TYPES.get(ip["command"] >> 4, "?"), size,
                                             bool(ip["command"] & 0x08) and ip["command"] >> 4 == 3))
        if ip["command"] >> 4 == 4 and self._protocol == mqtt.MQTTv5 and len(ip["packet"]) >= 3:
            code = ip["packet"][2]
            if code >= 0x80:  # a refusal: remembered for on_publish; a code paho rejects becomes 0x80
                self.puback_codes[int.from_bytes(ip["packet"][:2], "big")] = code
                if code not in _PUBACK_VALID:
                    ip["packet"] = bytearray(ip["packet"][:2]) + b"\x80" + ip["packet"][3:]
        return super()._packet_handle()

    def _sock_send(self, buf):
        n = super()._sock_send(buf)
        if n:
            self.socket_bytes_out += n
        return n

    def _sock_recv(self, bufsize):
        data = super()._sock_recv(bufsize)
        if data:
            self.socket_bytes_in += len(data)
        return data


class _EarlyRef:
    """What :meth:`MqttTransport._on_packet` returns for an event seen before a packet listener was
    set: the listener's answer, once the event is replayed to it (``value``)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: object = None


def _resolved(event: PacketEvent) -> PacketEvent:
    """``event`` with a ``ref`` that is an :class:`_EarlyRef` replaced by the listener's answer it holds."""
    return replace(event, ref=event.ref.value) if isinstance(event.ref, _EarlyRef) else event


def _await_thread(client: _CountingClient, quiet_s: float) -> bool:
    """Wait for ``client``'s network thread to end while its link goes on taking bytes; give up
    once it has taken none for ``quiet_s`` seconds (:func:`_link_progress`: neither a byte more
    written to the socket nor one more acknowledged by the peer) unless the thread, not the link,
    is what holds the packets back (:func:`_thread_behind`). Returns whether the thread ended
    (``True`` at once where it has none, or where this is that thread)."""
    thread = client._thread
    if thread is None or thread is threading.current_thread():
        return True
    seen, since = _link_progress(client), time.monotonic()
    while thread.is_alive():
        thread.join(min(0.05, quiet_s))
        now = _link_progress(client)
        if now != seen or _thread_behind(client, now[1]):
            seen, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return not thread.is_alive()
    return True


def _unacked_bytes(sock: object) -> int | None:
    """Bytes ``sock``'s kernel holds that its peer has not acknowledged (Linux's ``SIOCOUTQ``);
    ``None`` where that cannot be read (another system, a closed socket)."""
    try:
        import fcntl
        import termios

        out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")  # type: ignore[attr-defined]
        return int(struct.unpack("i", out)[0])
    except (ImportError, AttributeError, OSError, ValueError, struct.error):
        return None


def _link_progress(client: _CountingClient) -> tuple[int, int | None]:
    """(bytes the socket took, bytes of them its peer has not acknowledged): either changes while a
    link moves bytes. The first alone does not say it: a slow link's socket takes a third of its
    send buffer at a time, and then nothing for as long as the link takes to carry that (1.3 s at
    100 KB/s with 256 KiB measured), while the peer acknowledges bytes all along."""
    sock = client.socket()
    return client.socket_bytes_out, (_unacked_bytes(sock) if sock is not None else None)


def _thread_behind(client: _CountingClient, unacked: int | None) -> bool:
    """Whether paho has packets to write that its socket has room for (the peer acknowledged all
    it took: ``unacked``, :func:`_link_progress`'s second figure, is 0; where that is unknown,
    the socket is writable): its network thread is busy elsewhere (a listener taking its time),
    the link is not stalled."""
    sock = client.socket()
    if not client._out_packet or sock is None:
        return False
    if unacked is not None:
        return unacked == 0
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLOUT)
        return any(ev & select.POLLOUT for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _close_socket(client: mqtt.Client) -> None:
    """Close ``client``'s socket, if it has one (no DISCONNECT); shut down first, which wakes a
    network thread waiting on it (a close alone leaves its ``poll()`` waiting out its timeout)."""
    sock = client.socket()
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)  # type: ignore[attr-defined]  # a socket.socket here
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class MqttTransport:
    """A paho-mqtt client with a receive queue.

    Args:
        client_id: unique MQTT client id (two clients with one id evict each other forever); a
            fedfleet node uses :func:`protocol.topics.mqtt_client_id`.
        host, port: broker address.
        username, password: MQTT credentials, or ``None``.
        tls: connect with TLS (``mqtts://``); implied by ``tls_ca`` or ``tls_cert``.
        tls_ca: CA file of the broker's certificate (``None`` with ``tls``: the system's CAs);
            ``tls_cert``/``tls_key`` for a client certificate.
        tls_check_time: check certificate validity periods (see :func:`tls_context`).
        clock_skew_s: tolerance of the start-up certificate check (seconds).
        keepalive_s: MQTT keepalive (seconds).
        will: last will, or ``None``.
        max_queue: bound of the receive queue (messages); when full, the network thread blocks,
            which back-pressures the broker instead of dropping.
        max_buffered_messages, max_buffered_bytes: bounds of the offline buffer: QoS 1 messages
            handed to paho and not yet acknowledged (all of them while the link is down). A publish
            beyond either bound raises :class:`~protocol.errors.OfflineBufferFull` while the link
            is down; while it is up, acknowledgements are on their way (a busy broker, a slow
            link), so the publish waits for room up to ``full_wait_s`` seconds first
            (back-pressure on the publishing thread; never on paho's network thread, which
            brings the acknowledgements).

    Raises:
        SecurityConfigError: unusable TLS files (see :func:`tls_context`), at construction.
        ConnectError: from :meth:`connect`, when no CONNACK arrives in time or it refuses.
    """

    def __init__(self, client_id: str, host: str, port: int, *, username: str | None = None,
                 password: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, keepalive_s: int = 30, will: Will | None = None,
                 max_queue: int = 100_000, max_buffered_messages: int = 1000,
                 max_buffered_bytes: int = 256 * 1024 * 1024, tls: bool = False, tls_check_time: bool = True,
                 clock_skew_s: float = 300.0, mqtt_version: str = "auto", receive_max_packet_bytes: int = 0,
                 full_wait_s: float = 60.0) -> None:
        self.client_id = client_id
        if full_wait_s < 0:
            raise ValueError(f"full_wait_s must be >= 0 seconds, got {full_wait_s}")
        self.full_wait_s = full_wait_s
        #: publishes that found the buffer full with the link up and waited for room
        self.full_waits = 0
        self.host, self.port = host, port
        self.keepalive_s = keepalive_s
        self.mqtt_choice = parse_mqtt_version(mqtt_version)
        if receive_max_packet_bytes < 0:
            raise ValueError(f"receive_max_packet_bytes must be >= 0 (0: no limit), got {receive_max_packet_bytes}")
        self.receive_max_packet_bytes = receive_max_packet_bytes
        #: MQTT protocol level in use: 5 or 4 (3.1.1); settled by :meth:`connect`
        self.mqtt_version = (MQTT_V311 if self.mqtt_choice == "3.1.1" or (self.mqtt_choice == "auto"
                             and (host, port) in _V311_ONLY) else MQTT_V5)
        #: the broker's Maximum Packet Size from its MQTT 5 CONNACK (bytes), 0 when it announced none
        self.broker_max_packet_bytes = 0
        #: the limit inferred from PUBLISHes the broker closed the connection for (bytes), 0: none
        self.inferred_max_packet_bytes = 0
        self.refused = 0
        self._filters: dict[str, int] = {}
        self._queue: queue.Queue[Incoming] = queue.Queue(maxsize=max_queue)
        self._connected = threading.Event()
        self._closed = False
        self._closing = threading.Event()  # set by close(): ends connect()'s waits
        # held while close() marks the transport closed and reads its client and link, while connect()
        # starts a client's thread or swaps the client (inside _client_lock), and while on_connect marks
        # the link up: either close() sees a connect's doing, or that connect sees the close
        self._state_lock = threading.Lock()
        self._retired: list[_CountingClient] = []  # clients replaced by connect() whose threads may still end
        self._refused: str | None = None
        self._refused_code = 0
        self._refused_name = ""
        #: connects tried by the last :meth:`connect` (1 when the first succeeded)
        self.connect_attempts = 0
        #: seconds waited before each retry of :meth:`connect` (:class:`ConnectRetry`)
        self.connect_delays: list[float] = []
        self._closed_before_connack = False
        self.connects = 0
        self.disconnects = 0
        self._packet_listener: Callable[[PacketEvent], object] | None = None
        self._delivery_listener: Callable[[object, str, str], None] | None = None
        self._connect_listeners: list[Callable[[int], None]] = []
        self._disconnect_listeners: list[Callable[[LinkLost], None]] = []
        self._suback_waiting: set[int] = set()  # SUBSCRIBEs of this connection not yet acknowledged
        self.max_buffered_messages = max_buffered_messages
        self.max_buffered_bytes = max_buffered_bytes
        self._unacked: list[tuple[mqtt.MQTTMessageInfo, int]] = []
        self._unacked_bytes = 0
        self._buffer_lock = threading.Lock()
        self._early_packets: list[tuple[PacketEvent, _EarlyRef]] = []
        self._packet_lock = threading.RLock()
        # id(info) -> (info, why the broker refused it); the info is held so that its id is not reused
        self._refusals: dict[int, tuple[mqtt.MQTTMessageInfo, PublishRefused]] = {}
        # id(info) -> (info, why it was dropped unsent): QoS 0 lost with a connection, anything unsent at close
        self._drops: dict[int, tuple[mqtt.MQTTMessageInfo, PublishDropped]] = {}
        # id(info) -> (info, bytes of its first PUBLISH the socket never took), as told "unsent" (_on_cut)
        self._first_unsent: dict[int, tuple[mqtt.MQTTMessageInfo, int]] = {}
        # id(info) -> (info, connections the broker closed while it awaited its PUBACK)
        self._strikes: dict[int, tuple[mqtt.MQTTMessageInfo, int]] = {}
        self._bytes_before = (0, 0)  # socket bytes of clients replaced by a protocol fallback or a retry
        # held while publish() hands a message to self._client and while _replace_client swaps it, so
        # that no message lands on a client after its queue was moved to the next one
        self._client_lock = threading.Lock()
        self._withdraw: str | None = None  # why the PUBLISHes above the inferred limit go at the next CONNACK
        # (info, packet bytes, topic, when) of the last PUBACKed QoS 1 PUBLISH while no packet followed it
        self._last_acked: tuple[mqtt.MQTTMessageInfo, int, str, float] | None = None
        #: largest QoS 1 PUBLISH (packet bytes) the broker took: over MQTT 3.1.1 one it acknowledged
        #: and then sent another packet (it did not close the connection for it), over MQTT 5 one
        #: it acknowledged with success
        self.kept_packet_bytes = 0
        #: PUBLISHes the broker acknowledged and then closed the connection for (taken as refused)
        self.ack_close_refusals = 0
        #: whether the last close of the connection was taken for the refusal of a PUBLISH just
        #: acknowledged (read by connect listeners: the links of other clients did not break)
        self.closed_for_refusal = False
        self._username, self._password, self._will = username, password, will
        self._tls: ssl.SSLContext | None = None
        if tls or tls_ca is not None or tls_cert is not None:
            self._tls = tls_context(ca_file=tls_ca, cert_file=tls_cert, key_file=tls_key,
                                    check_time=tls_check_time, clock_skew_s=clock_skew_s)
        self._client = self._make_client(self.mqtt_version)

    def _make_client(self, version: int) -> _CountingClient:
        """A paho client for protocol level ``version`` (5 or 4) with this transport's settings."""
        if version == MQTT_V5:
            c = _CountingClient(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id,
                                protocol=mqtt.MQTTv5, on_packet=self._on_packet, on_lost=self._on_lost,
                                on_cut=self._on_cut)
        else:
            c = _CountingClient(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id,
                                protocol=mqtt.MQTTv311, clean_session=True, on_packet=self._on_packet,
                                on_lost=self._on_lost, on_cut=self._on_cut)
        c.reconnect_delay_set(min_delay=1, max_delay=8)
        c.max_inflight_messages_set(20)
        if self._username is not None:
            c.username_pw_set(self._username, self._password)
        if self._tls is not None:
            c.tls_set_context(self._tls)
        if self._will is not None:
            c.will_set(self._will.topic, self._will.payload, qos=self._will.qos, retain=self._will.retain)
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        c.on_publish = self._on_publish
        c.on_subscribe = self._on_subscribe
        return c

    # paho callbacks (network thread) ---------------------------------------------------------

    def _on_packet(self, event: PacketEvent) -> object:
        """Hand ``event`` to the packet listener and return what it returned (the client notes it
        with the packet, :meth:`_CountingClient.report_cut`); before a listener is set, keep the
        event for it and return a :class:`_EarlyRef` that the replay fills."""
        if event.direction == "in":  # the broker kept the connection after the last PUBACK (paho thread)
            last = self._last_acked
            if last is not None:
                self._last_acked = None
                self.kept_packet_bytes = max(self.kept_packet_bytes, last[1])
        with self._packet_lock:
            listener = self._packet_listener
            if listener is None:
                cell = _EarlyRef()
                if len(self._early_packets) < 10_000:
                    self._early_packets.append((event, cell))
                return cell
        return listener(_resolved(event))

    def set_packet_listener(self, listener: Callable[[PacketEvent], object]) -> None:
        """Receive a :class:`PacketEvent` for every MQTT packet from now on; packets seen before
        (CONNECT, CONNACK, SUBSCRIBE … of :meth:`connect`) are replayed first, before any later
        one. What ``listener`` returns for an ``out`` event (a channel: the id of the ledger row
        it wrote) comes back as the ``ref`` of a later event about the same packet: one with
        ``unsent_bytes`` (the socket took only part of it), or a ``dropped`` one (it never took a
        byte of it: a control packet, or a PUBLISH retransmission (reported with ``dup``) that is
        never written, the transport closed or its message withdrawn)."""
        with self._packet_lock:  # a packet of the network thread meanwhile waits for the replay
            early, self._early_packets = self._early_packets, []
            for ev, cell in early:
                cell.value = listener(_resolved(ev))
            self._packet_listener = listener

    def _on_cut(self, event: PacketEvent, ref: object, handle: mqtt.MQTTMessageInfo | None, unsent: int) -> None:
        """A packet the socket took part of and never will all of (:meth:`_CountingClient.report_cut`),
        named by the note of the row that stands for it: a message's first transmission is told
        to the delivery listener by its ``handle`` (outcome ``unsent``, ``reason`` the bytes never
        written); a control packet or a PUBLISH reported with DUP goes to the packet listener as
        ``event`` with ``unsent_bytes`` and the ``ref`` its listener returned for ``event``."""
        log.info("%s: the socket took %d of the %d bytes of a %s%s before the connection was lost or closed",
                 self.client_id, event.packet_bytes - unsent, event.packet_bytes, event.packet_type,
                 " (DUP)" if event.dup else "")
        if handle is not None:
            if len(self._first_unsent) >= 10_000:  # the oldest: their messages have long had their outcomes
                for k in list(self._first_unsent)[:1000]:
                    del self._first_unsent[k]
            self._first_unsent[id(handle)] = (handle, unsent)
            self._tell(handle, "unsent", str(unsent))
            return
        if event.packet_type == "PUBLISH" and not event.dup:  # a first transmission whose message is not known
            log.warning("%s: %d unsent bytes of a %d-byte PUBLISH not reported: its message is not known",
                        self.client_id, unsent, event.packet_bytes)
            return
        try:
            self._on_packet(PacketEvent("out", event.packet_type, event.packet_bytes, event.dup,
                                        unsent_bytes=unsent, ref=ref))
        except Exception:  # a listener must never break paho's network thread (or a close)
            log.exception("%s: packet listener failed", self.client_id)

    def add_connect_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(n)`` on paho's network thread after the n-th accepted CONNECT (n > 1 is
        a reconnect) once the broker acknowledged (SUBACK) every subscription renewed on that
        connection, at once when there is none: what the listener publishes then reaches the
        broker after it put those subscriptions in place, however it orders one client's
        SUBSCRIBE against its next PUBLISH (a connection lost before its SUBACKs calls no
        listener; the next one does). It must not block: publish without waiting."""
        self._connect_listeners.append(listener)

    def add_disconnect_listener(self, listener: Callable[[LinkLost], None]) -> None:
        """Call ``listener(lost)`` on paho's network thread when a connection that was up is lost
        (:class:`~protocol.transport_base.LinkLost`: its number, paho's reason, whether the broker
        sent a DISCONNECT, and the QoS 1 messages then awaiting acknowledgement, :attr:`buffered`),
        before paho reconnects; never for :meth:`close` or :meth:`abort`, nor for a connect attempt
        that fails. It must not block (paho's thread sends the keepalive): hand slow work to another
        thread."""
        self._disconnect_listeners.append(listener)

    def _call_connect_listeners(self, n: int) -> None:
        tell_link_listeners(self._connect_listeners, n, client_id=self.client_id, what="connect")

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        """A SUBACK: once every subscription renewed on this connection is acknowledged, the
        connect listeners are called (:meth:`add_connect_listener`)."""
        waiting = self._suback_waiting
        if mid not in waiting:  # a subscription made later (subscribe() while connected)
            return
        waiting.discard(mid)
        if not waiting:
            self._call_connect_listeners(self.connects)

    @property
    def socket_bytes(self) -> tuple[int, int]:
        """(bytes written to, bytes read from) the socket so far, MQTT layer (before TLS)."""
        return (self._bytes_before[0] + self._client.socket_bytes_out,
                self._bytes_before[1] + self._client.socket_bytes_in)

    #: the delivery listener hears of every QoS 0 PUBLISH too (``written``, ``dropped``, ``cut``)
    qos0_outcomes = True

    def set_delivery_listener(self, listener: Callable[[object, str, str], None]) -> None:
        """Call ``listener(handle, outcome, reason)`` for what became of each PUBLISH; ``handle``
        is what :meth:`publish` returned. ``outcome``:

        * ``"acked"``: the broker's PUBACK accepted a QoS 1 PUBLISH;
        * ``"refused"``: a QoS 1 PUBLISH refused (PUBACK reason code >= 0x80, or a packet the
          broker closed the connection for; ``reason`` says which and names the limit);
        * ``"withdrawn"``: as ``refused`` (taken out of paho's queue above the packet limit
          inferred from the broker's closes), for a message none of whose PUBLISH packets ever
          reached the socket: no byte of it was on the wire. (A message withdrawn with a
          retransmission never written is ``refused``: its earlier PUBLISH was on the wire, and
          the retransmission's row is voided by a ``dropped`` packet event, see
          :meth:`set_packet_listener`);
        * ``"written"``: the socket took all of a QoS 0 PUBLISH (all MQTT says of QoS 0);
        * ``"dropped"``: a PUBLISH that was not sent and never will be, of which the socket took
          no byte: a QoS 0 one still in paho's queue when the connection was lost (paho empties
          its queue at the reconnect and does not send QoS 0 again), or a message of any QoS
          still unsent when the transport was closed or its client replaced; ``reason`` says which;
        * ``"cut"``: as ``dropped``, but the socket took part of the packet (its bytes were on
          the wire; the broker got no whole packet): a QoS 0 PUBLISH (``unsent`` came first), or a
          QoS 1 message of which the socket never took a whole PUBLISH when the transport was
          closed (``unsent`` came first for its first PUBLISH when that was the one cut);
        * ``"unsent"``: the socket took only part of the message's PUBLISH before the connection
          was lost, or the transport closed, or its client's network thread ended: ``reason``
          is the number of its bytes it never took (a decimal number). For the PUBLISH the
          message went out with first (one reported with DUP is a packet event, see
          :meth:`set_packet_listener`). Not final: a QoS 1 message is sent again after the
          reconnect, with DUP, and its outcome follows; a QoS 0 one is ``cut``;
        * ``"resized"``: a QoS 1 message queued on a client of one MQTT protocol level was moved to
          one of another (``connect``'s fallback from MQTT 5 to 3.1.1): its PUBLISH goes out with
          another size, ``reason`` (the packet's new size in bytes, a decimal number). Not final:
          another outcome follows.

        Called on paho's network thread, or on the thread of :meth:`connect` or :meth:`close`. It
        must not block: queue the work."""
        self._delivery_listener = listener

    def _tell(self, info: object, outcome: str, reason: str) -> None:
        listener = self._delivery_listener
        if listener is not None:
            try:
                listener(info, outcome, reason)
            except Exception:  # a listener must never break paho's network thread
                log.exception("%s: delivery listener failed", self.client_id)

    def _on_lost(self, lost: list[tuple[mqtt.MQTTMessageInfo, int, int]], why: str) -> None:
        """QoS 0 PUBLISH packets (``(handle, packet bytes, bytes the socket took)``) that will never
        be sent: remembered for :meth:`publish`'s wait and reported ``dropped``, or ``unsent``
        (the bytes the socket never took) then ``cut``."""
        for info, size, taken in lost:
            if taken:
                reason = (f"{why} after the socket took {taken:,} of the {size:,} bytes of this QoS 0 PUBLISH: the "
                          "broker got no whole packet, and MQTT does not send a QoS 0 message again")
                self._tell(info, "unsent", str(size - taken))
            else:
                reason = (f"{why} with this {size:,}-byte QoS 0 PUBLISH still in the MQTT client's queue, none of "
                          "it written: MQTT does not send a QoS 0 message again")
            self._drop(info, PublishDropped(f"{self.client_id}: QoS 0 PUBLISH (message id {info.mid}) not sent: "
                                            f"{reason}", client_id=self.client_id, on_wire=taken > 0,
                                            unsent_bytes=size - taken if taken else 0))

    def _drop(self, info: mqtt.MQTTMessageInfo, exc: PublishDropped) -> None:
        log.warning("%s", exc)  # the channel says the message undeliverable (an error)
        if len(self._drops) >= 10_000:  # the oldest: their publishers have long been told
            for k in list(self._drops)[:1000]:
                del self._drops[k]
        self._drops[id(info)] = (info, exc)
        self._tell(info, "cut" if exc.on_wire else "dropped", str(exc).split(" not sent: ", 1)[-1])

    def dropped(self, handle: object) -> PublishDropped | None:
        """Why the PUBLISH of ``handle`` (from :meth:`publish`) was dropped unsent, or ``None``."""
        held = self._drops.get(id(handle))
        return held[1] if held is not None and held[0] is handle else None

    @property
    def ack_refusal_window_s(self) -> float:
        """Seconds after a PUBACK within which this transport may still report that PUBLISH
        refused (a close right after the acknowledgement, :data:`ACK_CLOSE_S`, with a tenfold
        margin for a busy network thread): only under MQTT 3.1.1; under MQTT 5 a PUBACK carries
        its own reason code and an acknowledged PUBLISH stays acknowledged (0)."""
        return 0.0 if self.mqtt_version == MQTT_V5 else 10 * ACK_CLOSE_S

    @property
    def max_packet_bytes(self) -> int:
        """The broker's packet limit as this transport knows it (bytes): the smaller of its CONNACK
        Maximum Packet Size and the inferred one; 0 when neither is known."""
        known = [n for n in (self.broker_max_packet_bytes, self.inferred_max_packet_bytes) if n > 0]
        return min(known) if known else 0

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            self._refused = f"{reason_code} ({reason_code.value:#04x})"
            self._refused_code = int(reason_code.value)
            self._refused_name = str(reason_code)
            trial = self.mqtt_choice == "auto" and self.mqtt_version == MQTT_V5 and not self.connects
            (log.info if trial else log.warning)("%s: broker refused the MQTT %s connection: %s", self.client_id,
                                                 "5" if self.mqtt_version == MQTT_V5 else "3.1.1", reason_code)
            return
        with self._state_lock:  # close() reads `connected` under it
            if self._closed:  # close() came while connecting: nothing goes out on this connection
                client._thread_terminate = True
                client._sock_close()
                return
        limit = getattr(properties, "MaximumPacketSize", None) if properties is not None else None
        if limit and limit != self.broker_max_packet_bytes:
            self.broker_max_packet_bytes = int(limit)
            log.info("%s: the broker takes PUBLISH packets of at most %d bytes (MQTT 5 CONNACK)", self.client_id,
                     limit)
        self.connects += 1
        self._withdraw_oversize(client)
        waiting: set[int] = set()  # the message ids of this connection's SUBSCRIBEs (SUBACK awaited)
        for flt, qos in self._filters.items():
            rc, mid = client.subscribe(flt, qos)
            if rc == mqtt.MQTT_ERR_SUCCESS and mid is not None:
                waiting.add(mid)
        self._suback_waiting = waiting  # the SUBACKs come on this thread, after this callback
        self._connected.set()
        if not waiting:
            self._call_connect_listeners(self.connects)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        was_connected = self._connected.is_set()
        self._connected.clear()
        self.disconnects += 1
        if not was_connected and self.connects == 0:
            self._closed_before_connack = True
        last, self._last_acked = self._last_acked, None
        self.closed_for_refusal = False
        if self._closed:  # close() or abort() say what is left unwritten, with their reason (_settle_ended)
            return
        # paho's socket is closed: the QoS 0 PUBLISH packets still in its queue are never written (its
        # reconnect empties the queue), nor the rest of a packet it took part of; said now, not at the
        # reconnect a delay later
        client.report_cut()
        self._on_lost(client.take_lost_qos0(), "the link is down: the connection was lost")
        log.info("%s: disconnected (%s); paho reconnects", self.client_id, reason_code)
        if was_connected:
            if self._ack_close(client, last, str(reason_code)):
                self.closed_for_refusal = True
            else:
                self._strike(client, str(reason_code))
            if self._disconnect_listeners:
                held, held_bytes = self.buffered
                lost = LinkLost(self.connects, str(reason_code),
                                bool(getattr(flags, "is_disconnect_packet_from_server", False)), held, held_bytes)
                tell_link_listeners(self._disconnect_listeners, lost, client_id=self.client_id, what="disconnect")

    def _ack_close(self, client: _CountingClient, last: tuple[mqtt.MQTTMessageInfo, int, str, float] | None,
                   why: str) -> bool:
        """The broker closed the connection: when the last packet it sent was the PUBACK of a QoS 1
        PUBLISH, less than :data:`ACK_CLOSE_S` after this thread handled it (the delivery listener's
        time not counted), and that PUBLISH is larger than every one it
        acknowledged and kept the connection for and no smaller than every one written and still
        awaiting its PUBACK (a larger one of those is the likelier cause: a broker with
        ``max_packet_size`` closes before acknowledging, see :meth:`_strike`), take the close for its
        refusal of that PUBLISH (Mosquitto's ``message_size_limit`` over MQTT 3.1.1): report it
        refused, take the limit to be at most half its size and withdraw the larger ones at the next
        CONNACK. Returns whether it did (paho thread)."""
        if last is None:
            return False
        info, size, topic, at = last
        if time.monotonic() - at > ACK_CLOSE_S or size <= self.kept_packet_bytes:
            return False
        waiting = [self._packet_size(m) for m in client.written_awaiting_puback()]
        if waiting and max(waiting) > size + max(64, size // 64):  # chunks of one transfer differ by a few bytes
            return False
        limit = max(size // 2, self.kept_packet_bytes)  # never below a packet the broker took and kept
        prev = self.inferred_max_packet_bytes
        self.inferred_max_packet_bytes = limit if not prev else min(prev, limit)
        self.ack_close_refusals += 1
        reason = (f"the broker closed the connection right after acknowledging a {size:,}-byte PUBLISH ({why}): "
                  f"taken for a message above its size limit (Mosquitto's message_size_limit over MQTT 3.1.1 "
                  f"acknowledges and drops it), now assumed to be at most {self.inferred_max_packet_bytes:,} bytes")
        log.error("%s: %d-byte PUBLISH to %s refused: %s", self.client_id, size, topic, reason)
        self._withdraw = reason
        self._refuse(info, PublishRefused(f"{self.client_id}: {size:,}-byte PUBLISH to {topic} refused: {reason}",
                                          client_id=self.client_id, topic=topic, reason=reason, packet_bytes=size,
                                          limit_bytes=self.inferred_max_packet_bytes))
        return True

    def _packet_size(self, msg: mqtt.MQTTMessage) -> int:
        return publish_size(msg.topic, len(msg.payload), msg.qos, protocol=self.mqtt_version).packet_bytes

    def _strike(self, client: _CountingClient, why: str) -> None:
        """The broker closed a connection: count it against the largest QoS 1 PUBLISH that was
        written on it and awaits its PUBACK, unless no larger than one the broker acknowledged and
        kept the connection for (:attr:`kept_packet_bytes`: then the link, not a size limit, closed
        it); at :data:`OVERSIZE_STRIKES` the packet limit is taken to be at most half its size (and
        never below :attr:`kept_packet_bytes`), and that PUBLISH (with every other one above the
        limit) is withdrawn from paho's queue at the next CONNACK, before paho re-sends (paho thread; paho
        may be iterating its queue here, so nothing is removed now)."""
        sent = client.written_awaiting_puback()
        if not sent:
            return
        biggest = max(sent, key=self._packet_size)
        if self._packet_size(biggest) <= self.kept_packet_bytes:
            return  # the broker took a packet this large and kept the connection: a flapping link, not a limit
        key = id(biggest.info)
        n = self._strikes.get(key, (biggest.info, 0))[1] + 1
        self._strikes[key] = (biggest.info, n)
        if n < OVERSIZE_STRIKES:
            return
        size = self._packet_size(biggest)
        limit = max(size // 2, self.kept_packet_bytes)  # never below a packet the broker took and kept
        prev = self.inferred_max_packet_bytes
        self.inferred_max_packet_bytes = limit if not prev else min(prev, limit)
        self._withdraw = (f"the broker closed the connection {n} times while a {size:,}-byte PUBLISH awaited "
                          f"its PUBACK ({why}): taken for a packet above its maximum packet size, now assumed "
                          f"to be at most {self.inferred_max_packet_bytes:,} bytes")

    def _withdraw_oversize(self, client: _CountingClient) -> None:
        """Take every QoS 1 PUBLISH above the inferred limit out of paho's queue and report it
        refused (called from on_connect, before paho re-sends its queue). The transmission each
        would have had next never happens: when the socket took no byte of it, the row that stood
        for it is voided (:meth:`_refuse` with its note, :meth:`_CountingClient.pending_note`): the
        message's own (outcome ``withdrawn``: no PUBLISH of it ever reached the socket) or a
        ``PUBLISH-DUP`` row (a retransmission dropped unwritten: the message is ``refused``)."""
        if self._withdraw is None:
            return
        reason, self._withdraw = self._withdraw, None
        refused: list[tuple[mqtt.MQTTMessageInfo, PublishRefused, _Note | None]] = []
        limit = self.inferred_max_packet_bytes
        unwritten = client.unwritten_mids()
        with client._out_message_mutex:
            for mid, m in list(client._out_messages.items()):
                if m.qos > 0 and self._packet_size(m) > limit:
                    note = client.pending_note(m, unwritten)  # before it is gone from the client's messages
                    client._out_messages.pop(mid)
                    self._strikes.pop(id(m.info), None)
                    msize = self._packet_size(m)
                    refused.append((m.info, PublishRefused(
                        f"{self.client_id}: {msize:,}-byte PUBLISH to {m.topic} refused: {reason}",
                        client_id=self.client_id, topic=m.topic, reason=reason, packet_bytes=msize,
                        limit_bytes=limit), note))
        if refused:
            log.error("%s: %d PUBLISH packet(s) of more than %d bytes withdrawn: %s (a size limit the broker did not "
                      "announce; declare it in the configuration, [protocol] max_packet_bytes, to chunk below it from "
                      "the start)", self.client_id, len(refused), limit, reason)
        for info, exc, note in refused:
            self._refuse(info, exc, note)

    def _refuse(self, info: mqtt.MQTTMessageInfo, exc: PublishRefused, pending: _Note | None = None) -> None:
        """Report the QoS 1 message of ``info`` refused (``exc``) to the delivery listener and keep
        it for :meth:`refusal`. ``pending``: the note of its transmission that will now never be
        made, of which the socket took no byte (:meth:`_CountingClient.pending_note`): a first
        transmission makes the outcome ``withdrawn`` (its row leaves the wire totals); a
        ``PUBLISH-DUP`` row is voided first (:meth:`_void_pending`), and the outcome stays
        ``refused`` (an earlier PUBLISH of the message was on the wire)."""
        self.refused += 1
        if len(self._refusals) >= 10_000:  # the oldest refusals: their publishers have long been told
            for k in list(self._refusals)[:1000]:
                del self._refusals[k]
        self._refusals[id(info)] = (info, exc)
        outcome = "refused"
        if pending is not None and not pending[0].dup:
            outcome = "withdrawn"
        elif pending is not None:
            self._void_pending(pending)
        listener = self._delivery_listener
        if listener is not None:
            try:
                listener(info, outcome, exc.reason)
            except Exception:  # a listener must never break paho's network thread
                log.exception("%s: delivery listener failed", self.client_id)

    def _void_pending(self, note: _Note) -> None:
        """Tell the packet listener that the retransmission ``note`` names (a ``PUBLISH-DUP``
        row) will never reach the socket: a ``dropped`` event with the ``ref`` its listener
        returned for it (the channel voids that row)."""
        event, ref, _ = note
        try:
            self._on_packet(PacketEvent("out", event.packet_type, event.packet_bytes, True, dropped=True, ref=ref))
        except Exception:  # a listener must never break paho's network thread (or a close)
            log.exception("%s: packet listener failed", self.client_id)

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        written = client.qos0_written(mid)  # a QoS 0 PUBLISH the socket took whole
        if written is not None:
            self._tell(written, "written", "")
            return
        msg = client._out_messages.get(mid)  # paho holds its out-message lock; popped after this call
        if msg is None or msg.qos == 0:
            return
        info = msg.info
        self._strikes.pop(id(info), None)
        code = client.puback_codes.pop(mid, None)
        if code is None and getattr(reason_code, "is_failure", False):
            code = reason_code.value
        if code is not None and code >= 0x80:
            size = self._packet_size(msg)
            reason = f"PUBACK reason code {code:#04x} ({PUBACK_REFUSALS.get(code, 'refused')})"
            log.error("%s: the broker refused a %d-byte PUBLISH to %s: %s", self.client_id, size, msg.topic, reason)
            self._refuse(info, PublishRefused(f"{self.client_id}: {size:,}-byte PUBLISH to {msg.topic} refused by "
                                              f"the broker: {reason}", client_id=self.client_id, topic=msg.topic,
                                              reason=reason, packet_bytes=size))
            return
        listener = self._delivery_listener
        if listener is not None:
            try:
                listener(info, "acked", "")
            except Exception:  # a listener must never break paho's network thread
                log.exception("%s: delivery listener failed", self.client_id)
        if self.mqtt_version == MQTT_V311:  # the broker may yet close the connection for it (_ack_close)
            # timed from when this thread can read again: a listener that took its time (a ledger
            # write waiting on SQLite's lock) must not make the close that followed look late
            self._last_acked = (info, self._packet_size(msg), msg.topic, time.monotonic())
        else:  # MQTT 5: a success PUBACK is the broker's word that it took the whole packet (a packet
            # above a limit it declared is a protocol error, closed unacknowledged; one above its
            # message size limit is answered with a refusal code, above): no packet this large is
            # above its limit, and closes while one awaits its PUBACK are the link's (_strike)
            self.kept_packet_bytes = max(self.kept_packet_bytes, self._packet_size(msg))

    def _on_message(self, client, userdata, msg) -> None:
        self._queue.put(Incoming(msg.topic, bytes(msg.payload), msg.qos, bool(msg.retain), time.monotonic()))

    # API -------------------------------------------------------------------------------------

    def connect(self, timeout_s: float = 30.0, *, retry: ConnectRetry | None = None,
                on_retry: Callable[[int, ConnectError, float], None] | None = None) -> None:
        """Connect and start the network thread; return once CONNACK accepted the session.

        An unreachable broker fails at once (a TCP probe) and a refused login as soon as the
        CONNACK says so; ``timeout_s`` only bounds the wait of an accepted TCP connection for its
        CONNACK, which a broker serving many connects at once on a loaded machine may take a while to send.

        With ``retry``, a failure that may pass (:attr:`ConnectError.transient`: nothing listening,
        no CONNACK within ``timeout_s``, a CONNACK saying the broker is unavailable or busy) is
        tried again after a jittered, exponentially growing delay (:class:`ConnectRetry`), up to
        ``retry.attempts`` connects in all; each retry is logged as a warning with its reason and
        delay, and recorded in :attr:`connect_attempts` / :attr:`connect_delays`. A refused login
        or certificate fails at once, whatever ``retry`` says.

        A :meth:`close` (from another thread) ends it: no attempt starts after it, the wait between
        attempts ends, a connection that comes up meanwhile is closed before anything is sent on it,
        and it raises :class:`~protocol.errors.ConnectError` ("closed while connecting"), with no
        paho thread or socket of this transport left behind.

        Args:
            timeout_s: seconds each attempt waits for its CONNACK.
            retry: the retry policy; ``None``: one attempt.
            on_retry: called as ``on_retry(attempt, error, delay_s)`` after failed attempt
                ``attempt`` and before the wait of ``delay_s`` seconds (tests, progress output).

        Raises:
            ConnectError: refused, or no CONNACK within ``timeout_s`` seconds (after the last
                attempt: its ``attempts`` says how many were made), or the transport was closed
                (:meth:`close`) while connecting (not ``transient``).
        """
        policy = retry or ConnectRetry()
        rng = random.Random(policy.seed)
        first = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            self.connect_attempts = attempt
            try:
                self._check_open()
                self._connect_attempt(timeout_s)
                self._check_open()  # closed as the CONNACK came: close() ended that connection
            except ConnectError as exc:
                exc.attempts = attempt
                if self._closed:
                    raise self._closed_error(attempt) from None
                if not exc.transient or attempt >= policy.attempts:
                    if attempt > 1:
                        log.error("%s: connect failed after %d attempts over %.1f s: %s", self.client_id, attempt,
                                  time.monotonic() - first, exc)
                        raise ConnectError(f"{exc} (gave up after {attempt} attempts over "
                                           f"{time.monotonic() - first:.1f} s)", client_id=self.client_id,
                                           transient=exc.transient, attempts=attempt) from None
                    raise
                delay = policy.delay_s(attempt, rng)
                self.connect_delays.append(delay)
                log.warning("%s: connect attempt %d of %d failed (%s); trying again in %.2f s", self.client_id,
                            attempt, policy.attempts, exc, delay)
                if on_retry is not None:
                    on_retry(attempt, exc, delay)
                if self._closing.wait(delay):  # close() ends the wait
                    raise self._closed_error(attempt) from None
                self._replace_client(self.mqtt_version if self.mqtt_choice != "auto" or
                                     (self.host, self.port) not in _V311_ONLY else MQTT_V311)
                continue
            if attempt > 1:
                log.info("%s: connected at attempt %d, %.1f s after the first", self.client_id, attempt,
                         time.monotonic() - first)
            return

    def _check_open(self) -> None:
        """Raises ConnectError ("closed while connecting") once :meth:`close` was called."""
        if self._closed:
            raise self._closed_error()

    def _closed_error(self, attempts: int = 1) -> ConnectError:
        return ConnectError(f"{self.client_id}: closed while connecting to the MQTT broker at {self.host}:{self.port}: "
                            "close() was called, so no connection is made and nothing is sent",
                            client_id=self.client_id, transient=False, attempts=attempts)

    def _replace_client(self, version: int) -> None:
        """A fresh paho client for protocol level ``version`` in place of one whose connect failed
        (its socket bytes are kept in :attr:`socket_bytes`). The QoS 1 messages queued on the old
        one (published before :meth:`connect` or while it tried) move to the new one, and are sent
        after its CONNACK; a :meth:`publish` on another thread meanwhile waits for the swap.

        A moved message's PUBLISH under another protocol level has another size (MQTT 5 adds its
        property length): each such message that never reached the old socket is reported
        ``resized`` with its new packet size to the delivery listener, whose ledger row was sized
        when it was published (one the old socket took goes out again with DUP: its row keeps the
        size of its first transmission). A QoS 0 PUBLISH left in the old client's queue (queued
        before a CONNACK that never came) is never sent: reported ``dropped``.

        Raises:
            ConnectError: the transport was closed (nothing is moved; its messages stay unsent).
        """
        with self._client_lock, self._state_lock:
            self._check_open()
            old = self._client
            self._bytes_before = (self._bytes_before[0] + old.socket_bytes_out,
                                  self._bytes_before[1] + old.socket_bytes_in)
            self.mqtt_version = version
            new = self._make_client(version)
            unsent = {m.mid for m in old.unsent_messages()}  # their rows describe no PUBLISH yet
            moved = new.take_queue(old)
            self._client = new
            if old._thread is not None:  # its thread ends on its own (the MQTT 5 trial): joined by close()
                self._retired.append(old)
        if moved:
            log.info("%s: %d queued message(s) moved to the new MQTT %s client", self.client_id, len(moved),
                     "5" if version == MQTT_V5 else "3.1.1")
        before = old._protocol
        if before != new._protocol:
            for m in moved:
                if m.mid not in unsent:  # went out on the old socket as sized: the re-send is a DUP row
                    continue
                size = publish_size(m.topic, len(m.payload), m.qos, protocol=version).packet_bytes
                if size != publish_size(m.topic, len(m.payload), m.qos, protocol=before).packet_bytes:
                    self._tell(m.info, "resized", str(size))
        self._on_lost(old.take_lost_qos0(), "the client was replaced before its CONNACK")
        old.report_cut()  # its socket is closed: the rest of a packet it took part of never goes out
        if old not in self._retired:  # its loop has ended: what is left in its queue is never written
            old.void_unwritten_control()

    def _connect_attempt(self, timeout_s: float) -> None:
        """One connect (:meth:`connect` without retries): the TCP probe, then MQTT 5 or 3.1.1.

        Raises:
            ConnectError: refused, unreachable, or no CONNACK within ``timeout_s`` seconds.
        """
        try:  # fail fast, with the reason, when nothing listens there
            probe = socket.create_connection((self.host, self.port), timeout=min(timeout_s, 5.0))
        except OSError as exc:
            reason = exc.strerror or exc.__class__.__name__
            raise ConnectError(f"cannot reach the MQTT broker at {self.host}:{self.port}: {reason}. Is the broker "
                               f"running, and are the host and port right?", client_id=self.client_id,
                               transient=True) from exc
        with probe:
            if self._tls is not None:  # a refused certificate says why now, not as "no CONNACK" later
                self._tls_probe(probe)
        deadline = time.monotonic() + timeout_s
        if self.mqtt_choice == "auto" and self.mqtt_version == MQTT_V5:
            try:  # amqtt may leave an MQTT 5 CONNECT unanswered: the trial is bounded
                self._connect_once(MQTT_V5, min(deadline, time.monotonic() + V5_TRIAL_S), timeout_s)
                return
            except ConnectError as exc:
                if self._closed:
                    raise
                silent = self._refused is None and not self._closed_before_connack
                # refused for another reason than the protocol level (a bad login): final, also when the
                # broker's close after its CONNACK was seen first (that is no sign of a 3.1.1-only broker)
                if self._refused is not None and not _unsupported_version(self._refused):
                    raise
                if silent and time.monotonic() >= deadline:
                    raise
                _V311_ONLY.add((self.host, self.port))
                log.info("%s: the broker at %s:%d does not take MQTT 5 (%s); connecting with MQTT 3.1.1",
                         self.client_id, self.host, self.port, self._refused or "closed before CONNACK")
                del exc
            self._replace_client(MQTT_V311)
        self._connect_once(self.mqtt_version if self.mqtt_choice != "auto" else MQTT_V311, deadline, timeout_s)

    def _connect_once(self, version: int, deadline: float, timeout_s: float) -> None:
        """One CONNECT with protocol level ``version`` on ``self._client``; returns when accepted.

        Raises:
            ConnectError: refused, closed before CONNACK (MQTT 5 attempt only) or no CONNACK by ``deadline``.
        """
        self.mqtt_version = version
        self._refused = None
        self._refused_code = 0
        self._closed_before_connack = False
        kwargs: dict = {}
        if version == MQTT_V5:
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            props = Properties(PacketTypes.CONNECT)
            if self.receive_max_packet_bytes:
                props.MaximumPacketSize = self.receive_max_packet_bytes
            kwargs = {"clean_start": True, "properties": props}
        with self._state_lock:  # close() either sees this client's thread started, or it starts none
            self._check_open()
            try:
                self._client.connect_async(self.host, self.port, keepalive=self.keepalive_s, **kwargs)
            except (OSError, ValueError) as exc:
                raise ConnectError(f"cannot connect to {self.host}:{self.port}: {exc}",
                                   client_id=self.client_id) from exc
            self._client.loop_start()
        trial = version == MQTT_V5 and self.mqtt_choice == "auto"
        while not self._connected.wait(0.05):  # a refusal (bad login) ends the wait at once
            if (self._refused or time.monotonic() >= deadline or (trial and self._closed_before_connack)
                    or self._closed):
                break
        if self._closed:  # close() stopped this client's thread and closed its socket
            raise self._closed_error()
        if not self._connected.is_set():
            if trial:  # do not wait out paho's reconnect delay: its thread ends on its own (its queue moves on)
                self._client._thread_terminate = True
            else:
                self._client.loop_stop()
            _close_socket(self._client)
            level = "5" if version == MQTT_V5 else "3.1.1"
            # unanswered, or answered "unavailable / busy": a broker overloaded by a connect storm, worth
            # trying again; any other refusal (login, authorisation) is not
            transient = self._refused is None or self._refused_code in TRANSIENT_CONNACK_CODES
            where = f"the MQTT broker at {self.host}:{self.port}"
            if self._refused is not None:  # its CONNACK said no: no timeout was waited out
                raise ConnectError(_refusal_text(where, self.client_id, level, self._refused_code, self._refused_name,
                                                 login=self._username is not None),
                                   client_id=self.client_id, transient=transient)
            reason = "closed before CONNACK" if self._closed_before_connack else "no CONNACK"
            raise ConnectError(f"{where} did not accept the MQTT {level} connection of {self.client_id!r} within "
                               f"{timeout_s:g} s ({reason}); the broker may be overloaded or still starting",
                               client_id=self.client_id, transient=transient)

    def _tls_probe(self, sock: socket.socket) -> None:
        """TLS handshake on ``sock`` (then closed) with the transport's context.

        Raises:
            ConnectError: the broker's certificate is refused (expired, another CA, another host
                name) or the handshake fails (not a TLS port, TLS version, client certificate).
        """
        where = f"{self.host}:{self.port}"
        assert self._tls is not None  # called only when connecting with TLS
        try:
            with self._tls.wrap_socket(sock, server_hostname=self.host) as tls_sock:
                tls_sock.settimeout(5.0)
        except ssl.SSLCertVerificationError as exc:
            raise ConnectError(f"TLS: the certificate of the broker at {where} was refused: {exc.verify_message}. "
                               f"Check the CA file, the host name in the URL and the certificate's dates",
                               client_id=self.client_id) from None
        except (ssl.SSLError, OSError) as exc:
            reason = getattr(exc, "reason", None) or exc.strerror or exc.__class__.__name__
            raise ConnectError(f"TLS handshake with the broker at {where} failed: {reason}. Is it a TLS port "
                               f"(mqtts://), and does it want a client certificate?",
                               client_id=self.client_id) from None

    @property
    def connected(self) -> bool:
        """Whether the MQTT session is currently up."""
        return self._connected.is_set()

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until connected (True) or ``timeout_s`` seconds pass (False)."""
        return self._connected.wait(timeout_s)

    def subscribe(self, filters: Iterable[str] | str, qos: int = 1) -> None:
        """Subscribe to each filter (one string: that filter) now and after every reconnect.

        Raises:
            ValueError: an invalid filter (:func:`~protocol.memory_transport.check_filter`) or a
                QoS outside 0–2; nothing is subscribed.
        """
        if qos not in (0, 1, 2):
            raise ValueError(f"QoS must be 0, 1 or 2, not {qos!r}")
        filters = [check_filter(f) for f in ([filters] if isinstance(filters, str) else filters)]
        for f in filters:
            self._filters[f] = qos
            if self.connected:
                self._client.subscribe(f, qos)

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                wait_s: float | None = None) -> mqtt.MQTTMessageInfo:
        """Hand one PUBLISH to paho; return its handle (passed to the delivery listener).

        At QoS 1 a publish made while the link is down is queued by paho and sent after the
        reconnect (at QoS 0 it is not: :class:`PublishDropped`); one made before or during
        :meth:`connect` is sent after its CONNACK, also when connect replaces its paho client (the
        MQTT 5 trial's fallback to 3.1.1, a retry). With ``wait_s`` the call blocks until the
        PUBACK (QoS 1) or the socket write.

        Raises:
            PublishRefused: the packet is above the broker's known maximum packet size (not sent;
                the message names both sizes), or, with ``wait_s``, the broker refused it.
            PublishTimeout: ``wait_s`` given and the PUBLISH not acknowledged in that time (it
                stays queued; the error's ``handle`` is the one this call would have returned).
            PublishDropped: a QoS 0 PUBLISH while the link is down (paho does not keep it; nothing
                was written).
            TransportError: paho refused the message (e.g. payload too large for MQTT); the
                transport is closed (nothing sent); with ``wait_s``, :meth:`close` came while it
                waited (the PUBLISH may or may not have reached the broker; the error's
                ``handle``: its outcome comes to the delivery listener as the close settles it).
        """
        if self._closed:
            raise TransportError(f"{self.client_id}: PUBLISH to {topic} ({len(payload):,} bytes) not sent: the "
                                 "transport is closed", client_id=self.client_id, topic=topic)
        limit = self.max_packet_bytes
        size = publish_size(topic, len(payload), qos, protocol=self.mqtt_version).packet_bytes
        if limit and size > limit:
            self.refused += 1
            where = "MQTT 5 CONNACK" if limit == self.broker_max_packet_bytes else "inferred from its disconnects"
            raise PublishRefused(f"{self.client_id}: {size:,}-byte PUBLISH to {topic} not sent: the broker takes "
                                 f"packets of at most {limit:,} bytes ({where})", client_id=self.client_id,
                                 topic=topic, reason=f"above the broker's maximum packet size of {limit:,} bytes",
                                 packet_bytes=size, limit_bytes=limit)
        if qos > 0:
            self._wait_for_room(topic, len(payload))
        try:
            with self._client_lock:  # not onto a client that connect() is replacing (_replace_client)
                info = self._client.publish(topic, payload, qos=qos, retain=retain)
        except (ValueError, TypeError) as exc:
            raise TransportError(f"publish to {topic} refused: {exc}", client_id=self.client_id, topic=topic) from exc
        if qos == 0 and info.rc == mqtt.MQTT_ERR_NO_CONN:
            raise PublishDropped(f"{self.client_id}: QoS 0 PUBLISH to {topic} ({len(payload):,} bytes) not sent: the "
                                 "link is down, and MQTT keeps no QoS 0 message for the reconnect (QoS 1 would)",
                                 client_id=self.client_id, topic=topic)
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            raise TransportError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}",
                                 client_id=self.client_id, topic=topic)
        if qos > 0:
            with self._buffer_lock:
                self._unacked.append((info, len(payload)))
                self._unacked_bytes += len(payload)
        if wait_s is not None:
            deadline = time.monotonic() + wait_s
            while True:
                refusal = self.refusal(info)
                if refusal is not None:
                    raise refusal
                dropped = self.dropped(info)
                if dropped is not None:
                    raise PublishDropped(f"{self.client_id}: PUBLISH to {topic} ({len(payload):,} bytes) not sent: "
                                         f"{str(dropped).split(' not sent: ', 1)[-1]}", client_id=self.client_id,
                                         topic=topic, on_wire=dropped.on_wire, unsent_bytes=dropped.unsent_bytes)
                # paho marks a QoS 0 PUBLISH that a lost connection took out of its queue published, with
                # rc CONN_LOST (paho's reconnect; its report as dropped follows at once): not a success
                lost = _published(info) and qos == 0 and info.rc == mqtt.MQTT_ERR_CONN_LOST
                if _published(info) and not lost:
                    break
                if self._closed:
                    raise TransportError(f"{self.client_id}: PUBLISH to {topic} not acknowledged: the transport was "
                                         "closed while it waited (it may or may not have reached the broker)",
                                         client_id=self.client_id, topic=topic, handle=info)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if lost:
                        raise PublishDropped(f"{self.client_id}: QoS 0 PUBLISH to {topic} ({len(payload):,} bytes) "
                                             "not sent: the link is down: the connection was lost with it in the "
                                             "MQTT client's queue", client_id=self.client_id, topic=topic)
                    raise PublishTimeout(f"{self.client_id}: PUBLISH to {topic} not acknowledged within {wait_s:g} s "
                                         "(it stays queued: its outcome comes later)", client_id=self.client_id,
                                         topic=topic, handle=info)
                if lost:
                    time.sleep(0.005)
                elif self.connected:
                    try:
                        info.wait_for_publish(min(remaining, 0.5))
                    except RuntimeError:  # not connected right now: wait for the reconnect
                        time.sleep(0.05)
                else:
                    self._connected.wait(min(remaining, 0.5))
        return info

    def refusal(self, handle: object) -> PublishRefused | None:
        """Why the broker refused the PUBLISH of ``handle`` (from :meth:`publish`), or ``None``."""
        held = self._refusals.get(id(handle))
        return held[1] if held is not None and held[0] is handle else None

    def _wait_for_room(self, topic: str, nbytes: int) -> None:
        """Return once one more QoS 1 message of ``nbytes`` fits the offline buffer; while the
        link is up (and not on paho's network thread) wait for acknowledgements up to
        :attr:`full_wait_s` seconds, as long as some message awaits one (with none in flight no
        acknowledgement can make room: a message above ``max_buffered_bytes`` fails at once).

        Raises:
            OfflineBufferFull: no room, and the link is down, or the wait ran out, or the caller
                is the network thread, or no message awaits an acknowledgement.
        """
        deadline: float | None = None
        while True:
            with self._buffer_lock:
                self._prune()
                count, held = len(self._unacked), self._unacked_bytes
            if count + 1 <= self.max_buffered_messages and held + nbytes <= self.max_buffered_bytes:
                return
            now = time.monotonic()
            on_network_thread = threading.current_thread() is getattr(self._client, "_thread", None)
            can_wait = self.connected and not on_network_thread and count > 0
            if deadline is None:
                deadline = now + self.full_wait_s
                if can_wait:
                    self.full_waits += 1
            if not can_wait or now >= deadline:
                waited = f", {self.full_wait_s:g} s waited for room" if can_wait else ""
                raise OfflineBufferFull(
                    f"{self.client_id}: no room for a {nbytes:,}-byte message: {count} messages ({held:,} bytes) "
                    f"wait for acknowledgement (link {'up' if self.connected else 'down'}{waited}); the offline "
                    f"buffer holds at most {self.max_buffered_messages} messages / {self.max_buffered_bytes:,} bytes",
                    client_id=self.client_id, topic=topic)
            time.sleep(0.005)

    def _prune(self) -> None:
        """Forget acknowledged messages (caller holds ``_buffer_lock``)."""
        if self._unacked:
            keep = [(i, n) for i, n in self._unacked if not _published(i) and id(i) not in self._refusals]
            self._unacked = keep
            self._unacked_bytes = sum(n for _, n in keep)

    @property
    def buffered(self) -> tuple[int, int]:
        """(messages, bytes) handed to paho at QoS 1 and not yet acknowledged."""
        with self._buffer_lock:
            self._prune()
            return len(self._unacked), self._unacked_bytes

    def get(self, timeout_s: float | None) -> Incoming | None:
        """Next received message, or ``None`` after ``timeout_s`` seconds (``None``: wait forever)."""
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def drop_link(self) -> None:
        """Close the TCP socket without DISCONNECT (the broker then publishes the last will).

        For tests and chaos scenarios: paho's loop sees the broken socket and reconnects.
        """
        sock = self._client.socket()
        if sock is not None:
            try:
                import socket as _socket
                sock.shutdown(_socket.SHUT_RDWR)  # type: ignore[attr-defined]  # a socket.socket here
            except OSError:
                pass

    def abort(self) -> None:
        """Vanish like a device losing power: close the socket without DISCONNECT, so the broker
        publishes the last will, and stop the network thread (the socket is closed first: paho's
        loop, told to end, would otherwise run on until every QoS 1 message had its PUBACK, or the
        keepalive gave up on a stalled link). No reconnect follows (a :meth:`connect` under way
        ends as after :meth:`close`), so what was never sent never will be: reported as
        :meth:`close` reports it (:meth:`_settle_ended`). A no-op after :meth:`close` or a first
        ``abort``."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            client = self._client
        self._closing.set()
        client._thread_terminate = True
        try:  # the socket first: a loop told to end still runs while QoS 1 messages await their PUBACKs
            _close_socket(client)
            client.loop_stop()
            self._end_retired()
        finally:
            self._connected.clear()
        self._settle_ended(client, "the transport was aborted (the device vanished)")

    def close(self, timeout_s: float = 5.0) -> None:
        """Send DISCONNECT (no last will) and stop the network thread (idempotent). Messages
        already received stay in the queue: :meth:`get` still returns them. The packets queued
        before the DISCONNECT go out first, however slow the link, and however long the network
        thread takes to write them (a listener holding it); but once the link has taken no byte
        for ``timeout_s`` seconds (none written to the socket, none acknowledged by the broker's
        side: a stalled link, the broker reads nothing) the socket is closed without it, said in
        the log, and the broker publishes the last will.

        While :meth:`connect` runs on another thread (the link not up yet), it is ended: the
        connection it is making is closed without a packet more (no DISCONNECT: none was
        accepted), and it raises. No paho thread or socket of this transport is left (the clients
        a fallback or a retry replaced included, each given ``timeout_s`` seconds to end). What
        was never sent never will be (:meth:`_settle_ended`): a message none of whose PUBLISH
        packets reached the socket (published before the connection came up, or queued when the
        link was lost) is reported ``dropped`` to the delivery listener, one the socket never took
        a whole PUBLISH of ``cut``, and :meth:`publish` waiting on one raises
        :class:`~protocol.errors.PublishDropped`.

        Called on paho's network thread (a delivery listener, say) with the link up, it returns at
        once and the close is finished on a thread of its own: the network thread writes the
        DISCONNECT once the listener returns (it cannot wait for itself)."""
        with self._state_lock:  # not while connect() starts or replaces a client
            if self._closed:
                return
            self._closed = True
            client = self._client
            up = self.connected  # on_connect looks for a close under this lock before it marks the link up
        self._closing.set()
        if up and client._thread is threading.current_thread():  # a listener on paho's thread: it is waited for
            # elsewhere, and writes the DISCONNECT once the listener returns
            threading.Thread(target=self._finish_close, args=(client, up, timeout_s), daemon=True,
                             name=f"close-{self.client_id}").start()
            return
        self._finish_close(client, up, timeout_s)

    def _finish_close(self, client: _CountingClient, up: bool, timeout_s: float) -> None:
        """:meth:`close` once the transport is marked closed: the DISCONNECT (``up``: the link was
        up) or the socket closed, the network threads ended, what is left unsent settled."""
        try:
            if up:
                client.disconnect()
                if not _await_thread(client, timeout_s):  # a stalled link: paho would wait out the keepalive
                    log.warning("%s: the DISCONNECT could not be written (the socket took no byte in %g s: the link "
                                "is stalled, the broker reads nothing): the connection is closed without it, so the "
                                "broker publishes the last will", self.client_id, timeout_s)
                    _close_socket(client)
            else:  # nothing may go out on a connection coming up now; the loop ends with its socket
                client._thread_terminate = True
                _close_socket(client)
        finally:
            client.loop_stop()
            _close_socket(client)
            self._end_retired(timeout_s)
            self._connected.clear()
        self._settle_ended(client, "the transport was closed")

    def _end_retired(self, timeout_s: float = 5.0) -> None:
        """End the clients :meth:`connect` replaced whose threads end on their own (the MQTT 5
        trial's): each thread is given ``timeout_s`` seconds, its socket closed, the rest of a
        packet it took part of reported and its control packets never written voided (their
        QoS 1 messages moved on; their QoS 0 ones were reported when they were replaced)."""
        for old in self._retired:
            thread = old._thread
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout_s)
            _close_socket(old)
            old.report_cut()
            old.void_unwritten_control()
        self._retired = []

    def _settle_ended(self, client: _CountingClient, why: str) -> None:
        """Report what ``client``, whose network thread has ended for good (:meth:`close`,
        :meth:`abort`), leaves unsent, so that no ledger row counts a byte the socket never wrote:
        the rest of a packet the socket took part of (:meth:`_CountingClient.report_cut`), the
        QoS 0 PUBLISH packets it did not write whole (:meth:`_on_lost`), its control packets never
        written (``dropped`` events) and, for each QoS 1 message it holds (no PUBACK came):

        * no PUBLISH of it ever reached the socket: ``dropped`` (its ``sent`` row leaves the wire
          totals);
        * its pending retransmission never reached the socket: that ``PUBLISH-DUP`` row is voided
          (:meth:`_void_pending`), its earlier PUBLISH packets stay counted;
        * the socket never took a PUBLISH of it whole (each was cut, or is the retransmission just
          voided): ``cut`` (its ``sent`` row stays, with delivery ``dropped``: the broker got no whole
          packet of it; the :class:`~protocol.errors.PublishDropped` a :meth:`publish` waiting on it
          raises carries the ``unsent_bytes`` of its first PUBLISH, for the row its caller writes);
        * one PUBLISH of it went out whole: nothing more (the broker may have it: ``handed``).

        ``why`` begins the reason each report gives ("the transport was closed")."""
        client.note_whole_writes()
        client.report_cut()
        self._on_lost(client.take_lost_qos0(), why)
        client.void_unwritten_control()
        for m, note in client.held_messages():
            head = f"{self.client_id}: QoS {m.qos} PUBLISH to {m.topic} (message id {m.mid}) not sent"
            if note is not None and not note[0].dup:
                self._drop(m.info, PublishDropped(f"{head}: {why} before the socket took a byte of it",
                                                  client_id=self.client_id, topic=m.topic))
                continue
            if note is not None:
                self._void_pending(note)
            if not client.whole_once(m):
                told = self._first_unsent.get(id(m.info))
                self._drop(m.info, PublishDropped(
                    f"{head}: {why} before the socket took a whole PUBLISH of it (what it took of one was on the "
                    "wire; the broker got no whole packet)", client_id=self.client_id, topic=m.topic, on_wire=True,
                    unsent_bytes=told[1] if told is not None and told[0] is m.info else 0))
