"""An in-process MQTT broker and its transport: the :class:`~protocol.transport.Transport` seam
without a socket, for tests and single-process experiments.

:class:`MemoryBroker` routes every PUBLISH to the clients whose subscriptions match its topic,
with the rules of MQTT 3.1.1 §4.7 (``+`` one level, ``#`` this level and all below it, wildcards
at the first level never match topics starting with ``$``); it keeps the last retained message
per topic (an empty retained payload clears it, §3.3.1.3) and hands retained messages to a new
subscription with the retain flag set; live deliveries carry retain = 0. A delivery's QoS is the
smaller of the PUBLISH's and the subscription's (§3.8.4); a client whose subscriptions overlap
gets one copy, at the highest granted QoS. Delivery is synchronous: when
:meth:`MemoryTransport.publish` returns, every matching client has the message in its queue, so
nothing is ever lost or reordered and a ``wait_s`` never times out.

:class:`MemoryTransport` is what :class:`~protocol.channel.Channel` and the aggregation server
use from :class:`~protocol.transport.MqttTransport`: ``client_id``, ``subscribe``, ``publish``,
``get``, ``close``, the link listeners (:class:`~protocol.transport_base.LinkEvents`:
``add_connect_listener``, ``add_disconnect_listener``), plus the link events of the real one
(``abort``: vanish, the broker publishes the last will; ``drop_link``: the link breaks and comes
back, the disconnect listeners are called, the will is published, subscriptions are renewed and
the connect listeners called), and of the broker (:meth:`MemoryBroker.restart`: every link
breaks, no will, retained messages lost, the clients come back one by one) and of a broker
that drops a message for one subscriber (:meth:`MemoryBroker.drop_deliveries`: Mosquitto does
so, acknowledging the PUBLISH, when that client's queue is full). It reports no
MQTT control packets (no ``set_packet_listener``), so a channel on it ledgers PUBLISH rows only.

Example::

    broker = MemoryBroker()
    server = broker.connect("server")
    server.subscribe(["fedfleet/v1/fed/up/+/+"])
    broker.connect("client-1").publish("fedfleet/v1/fed/up/client-1/update", b"...")
    server.get(0.0).topic  # 'fedfleet/v1/fed/up/client-1/update'
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .errors import TransportError
from .transport_base import Incoming, LinkLost, Will, tell_link_listeners

log = logging.getLogger(__name__)

__all__ = ["DROP_REASON", "RESTART_REASON", "MemoryBroker", "MemoryTransport", "Published", "check_filter",
           "check_topic", "topic_matches"]

#: the ``reason`` of the :class:`~protocol.transport_base.LinkLost` that
#: :meth:`MemoryTransport.drop_link` tells its disconnect listeners
DROP_REASON = "link dropped (MemoryTransport.drop_link)"
#: the disconnect listeners' reason at :meth:`MemoryBroker.restart`
RESTART_REASON = "broker restarted (MemoryBroker.restart)"


def check_topic(topic: str) -> str:
    """Return ``topic`` if it is a valid MQTT topic *name* (what a PUBLISH carries).

    Raises:
        ValueError: empty, containing a wildcard (``+``, ``#``) or a NUL character (MQTT 3.1.1 §4.7.3).
    """
    if not isinstance(topic, str) or not topic:
        raise ValueError(f"a topic name is a non-empty string, not {topic!r}")
    if "+" in topic or "#" in topic or "\x00" in topic:
        raise ValueError(f"topic name {topic!r} must not contain '+', '#' or NUL (wildcards belong in filters)")
    return topic


def check_filter(topic_filter: str) -> str:
    """Return ``topic_filter`` if it is a valid MQTT topic filter (what a SUBSCRIBE carries).

    Raises:
        ValueError: empty, containing NUL, no UTF-8 form (a lone surrogate) or more than 65,535
            bytes of it (MQTT 3.1.1 §1.5.3: what a SUBSCRIBE can carry), ``#`` not alone in the
            last level, or ``+`` not alone in its level (MQTT 3.1.1 §4.7.1).
    """
    if not isinstance(topic_filter, str) or not topic_filter or "\x00" in topic_filter:
        raise ValueError(f"a topic filter is a non-empty string without NUL, not {topic_filter!r}")
    try:
        size = len(topic_filter.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"topic filter {topic_filter[:80]!r}: no UTF-8 form ({exc.reason})") from None
    if size > 65_535:
        raise ValueError(f"topic filter {topic_filter[:80]!r}…: {size:,} bytes of UTF-8, above MQTT's 65,535")
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise ValueError(f"topic filter {topic_filter!r}: '#' must be a whole level and the last one")
        if "+" in level and level != "+":
            raise ValueError(f"topic filter {topic_filter!r}: '+' must be a whole level")
    return topic_filter


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Whether the MQTT ``topic_filter`` matches the topic name ``topic`` (MQTT 3.1.1 §4.7).

    ``+`` matches exactly one level (an empty one too), ``#`` the parent level and any number of
    levels below it (``a/#`` matches ``a``), and a wildcard in the first level does not match a
    topic starting with ``$`` (§4.7.2).

    Raises:
        ValueError: an invalid filter or topic name (see :func:`check_filter`, :func:`check_topic`).
    """
    f_levels = check_filter(topic_filter).split("/")
    t_levels = check_topic(topic).split("/")
    if topic.startswith("$") and f_levels[0] in ("+", "#"):
        return False
    for i, level in enumerate(f_levels):
        if level == "#":
            return True
        if i >= len(t_levels) or (level != "+" and level != t_levels[i]):
            return False
    return len(f_levels) == len(t_levels)


@dataclass(frozen=True, slots=True)
class Published:
    """One PUBLISH the broker received: who sent it and what it carried."""

    sender: str
    topic: str
    payload: bytes
    qos: int
    retain: bool


class MemoryBroker:
    """An MQTT broker in this process (thread-safe). See the module docstring for the rules.

    Attributes:
        published: every PUBLISH received, in order (last wills included, sender = the client id).
        dropped: (subscriber's client id, message) of every delivery the broker dropped
            (:meth:`drop_deliveries`), in order.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._clients: dict[str, MemoryTransport] = {}
        self._retained: dict[str, tuple[bytes, int]] = {}
        self.published: list[Published] = []
        self.dropped: list[tuple[str, Published]] = []
        self._drop: Callable[[str, Published], bool] | None = None

    def connect(self, client_id: str, *, will: Will | None = None, keep_sent: bool = True,
                on_idle: Callable[[], None] | None = None) -> MemoryTransport:
        """A connected :class:`MemoryTransport` named ``client_id`` (see its arguments). A client
        already connected under that id is taken over: it is disconnected without its will."""
        transport = MemoryTransport(self, client_id, will=will, keep_sent=keep_sent, on_idle=on_idle)
        with self._lock:
            old = self._clients.get(client_id)
            if old is not None:
                old._connected = False
            self._clients[client_id] = transport
        return transport

    @property
    def retained(self) -> dict[str, bytes]:
        """Topic → payload of every retained message held now."""
        with self._lock:
            return {t: p for t, (p, _) in self._retained.items()}

    @property
    def clients(self) -> list[str]:
        """Ids of the clients connected now."""
        with self._lock:
            return sorted(c for c, t in self._clients.items() if t._connected)

    def restart(self, order: Iterable[str] | None = None) -> None:
        """The broker process stops and starts again, without persistence (Mosquitto's default):
        every connected client loses its link at once, no last will is published (the broker that
        would publish it is gone), the retained messages are lost; then the clients connect again
        one after the other, in ``order`` (client ids; default: the order they first connected in),
        each as :meth:`MemoryTransport.drop_link` reconnects (``connects`` + 1, subscriptions
        renewed, connect listeners called), after every client's disconnect listeners were called
        (reason :data:`RESTART_REASON`). A client not yet back is not connected: what is
        published meanwhile is not delivered to it, and a PUBLISH it makes raises.

        Raises:
            ValueError: ``order`` names a client that was not connected, or leaves one out.
        """
        with self._lock:
            was = {c.client_id: c for c in self._clients.values() if c._connected}
            for c in was.values():
                c._connected = False
        ids = list(was) if order is None else list(order)
        if sorted(ids) != sorted(was):
            with self._lock:
                for c in was.values():
                    c._connected = True
            raise ValueError(f"restart order {ids} is not the connected clients {sorted(was)}")
        with self._lock:
            self._retained.clear()
        for c in was.values():
            c._tell_lost(RESTART_REASON)
        for cid in ids:
            was[cid]._come_back()

    def drop_deliveries(self, rule: Callable[[str, Published], bool] | None) -> None:
        """From now on, drop each live delivery for which ``rule(subscriber's client id, message)``
        is true, as a broker whose queue for that client is full drops it (Mosquitto's
        ``max_queued_messages``): the PUBLISH is received (in :attr:`published`, its sender's
        ``publish`` returns normally), the other subscribers get it, and the dropped delivery is
        recorded in :attr:`dropped`. Retained messages handed to a new subscription are never
        dropped. ``rule`` runs on the publisher's thread, under the broker's lock; ``None``: drop
        nothing."""
        with self._lock:
            self._drop = rule

    # ------------------------------------------------------------------ called by the transports

    def _route(self, sender: str, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        message = Published(sender, topic, payload, qos, retain)
        with self._lock:
            self.published.append(message)
            if retain:
                if payload:
                    self._retained[topic] = (payload, qos)
                else:
                    self._retained.pop(topic, None)
            targets = []
            for c in list(self._clients.values()):
                granted = c._granted(topic) if c._connected else None
                if granted is None:
                    continue
                if self._drop is not None and self._drop(c.client_id, message):
                    self.dropped.append((c.client_id, message))
                    continue
                targets.append((c, granted))
        for client, granted in targets:
            client._deliver(Incoming(topic, payload, min(qos, granted), False, time.monotonic()))

    def _retained_for(self, topic_filter: str) -> list[tuple[str, bytes, int]]:
        with self._lock:
            return [(t, p, q) for t, (p, q) in self._retained.items() if topic_matches(topic_filter, t)]

    def _gone(self, client: MemoryTransport, *, publish_will: bool) -> None:
        with self._lock:
            if self._clients.get(client.client_id) is client:
                del self._clients[client.client_id]
        if publish_will and client.will is not None:
            w = client.will
            self._route(client.client_id, check_topic(w.topic), bytes(w.payload), w.qos, w.retain)


class MemoryTransport:
    """One client of a :class:`MemoryBroker`, with the :class:`~protocol.transport.Transport`
    interface. Make it with :meth:`MemoryBroker.connect`.

    Args:
        broker: the broker it is connected to.
        client_id: its MQTT client id.
        will: last will, published by the broker on :meth:`abort` and :meth:`drop_link`
            (never on :meth:`close`).
        keep_sent: keep every (topic, payload) this client published in :attr:`sent`; ``False``
            for long runs that only need the counts.
        on_idle: called (without arguments, on the caller's thread) by :meth:`get` whenever the
            receive queue is empty, before it waits: a scripted peer publishes its next message
            from there, so a test holds one message at a time however many it sends.

    Attributes:
        sent: (topic, payload) of each PUBLISH made, in order (when ``keep_sent``).
        sent_count, sent_bytes: PUBLISHes made and their payload bytes.
        connects: accepted connections so far (``drop_link`` adds one).
    """

    def __init__(self, broker: MemoryBroker, client_id: str, *, will: Will | None = None, keep_sent: bool = True,
                 on_idle: Callable[[], None] | None = None) -> None:
        if not isinstance(client_id, str) or not client_id:
            raise ValueError(f"client_id must be a non-empty string, not {client_id!r}")
        if will is not None:
            check_topic(will.topic)
        self.broker = broker
        self.client_id = client_id
        self.will = will
        self.keep_sent = keep_sent
        self.on_idle = on_idle
        self.sent: list[tuple[str, bytes]] = []
        self.sent_count = 0
        self.sent_bytes = 0
        self.connects = 1
        self._filters: dict[str, int] = {}
        self._inbox: deque[Incoming] = deque()
        self._cond = threading.Condition()
        self._connected = True
        self._closed = False
        self._listeners: list[Callable[[int], None]] = []
        self._lost_listeners: list[Callable[[LinkLost], None]] = []

    # ------------------------------------------------------------------ Transport

    @property
    def connected(self) -> bool:
        """Whether the client is connected to its broker now."""
        return self._connected

    def wait_connected(self, timeout_s: float) -> bool:
        """Whether connected (no wait: connecting is instantaneous here)."""
        return self._connected

    @property
    def filters(self) -> dict[str, int]:
        """Topic filter → granted QoS of every subscription."""
        return dict(self._filters)

    def subscribe(self, filters: Iterable[str], qos: int = 1) -> None:
        """Subscribe to each filter (kept across :meth:`drop_link`); the retained messages that
        match a filter are delivered at once with the retain flag set.

        Raises:
            ValueError: an invalid filter or a QoS outside 0–2.
            TransportError: the client is closed.
        """
        if qos not in (0, 1, 2):
            raise ValueError(f"QoS must be 0, 1 or 2, not {qos!r}")
        filters = [check_filter(f) for f in ([filters] if isinstance(filters, str) else filters)]
        if not self._connected:
            raise TransportError(f"{self.client_id}: not connected", client_id=self.client_id)
        for f in filters:
            self._filters[f] = qos
            for topic, payload, q in self.broker._retained_for(f):
                self._deliver(Incoming(topic, payload, min(q, qos), True, time.monotonic()))

    def unsubscribe(self, filters: Iterable[str]) -> None:
        """Remove these subscriptions (unknown filters are ignored)."""
        for f in [filters] if isinstance(filters, str) else filters:
            self._filters.pop(f, None)

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                wait_s: float | None = None) -> None:
        """Hand one PUBLISH to the broker, which delivers it before this returns (``wait_s`` is
        accepted for the interface; the message is acknowledged at once).

        Raises:
            ValueError: an invalid topic name or a QoS outside 0–2.
            TransportError: the client is closed or aborted.
        """
        check_topic(topic)
        if qos not in (0, 1, 2):
            raise ValueError(f"QoS must be 0, 1 or 2, not {qos!r}")
        if not self._connected:
            raise TransportError(f"{self.client_id}: publish to {topic} on a closed connection",
                                 client_id=self.client_id, topic=topic)
        payload = bytes(payload)
        self.sent_count += 1
        self.sent_bytes += len(payload)
        if self.keep_sent:
            self.sent.append((topic, payload))
        self.broker._route(self.client_id, topic, payload, qos, bool(retain))

    def get(self, timeout_s: float | None) -> Incoming | None:
        """Next delivered message, or ``None`` after ``timeout_s`` seconds (``None``: wait
        forever). With ``on_idle``, an empty queue first calls it, then is looked at again."""
        with self._cond:
            if self._inbox:
                return self._inbox.popleft()
        if self.on_idle is not None:
            self.on_idle()
        with self._cond:
            if not self._inbox and timeout_s != 0:
                self._cond.wait_for(lambda: bool(self._inbox), timeout=timeout_s)
            return self._inbox.popleft() if self._inbox else None

    def close(self) -> None:
        """Disconnect cleanly (no last will; idempotent). Messages already delivered stay gettable."""
        if self._closed:
            return
        self._closed = True
        self._connected = False
        self.broker._gone(self, publish_will=False)

    def deliver(self, inc: Incoming) -> None:
        """Hand ``inc`` to this client as if the broker had delivered it, subscriptions aside (a
        scripted arrival time in ``inc.received_at``, bytes no client of this broker sent)."""
        self._deliver(inc)

    # ------------------------------------------------------------------ link events, as MqttTransport

    def add_connect_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(n)`` after the n-th connection (n > 1: a reconnect, see :meth:`drop_link`)."""
        self._listeners.append(listener)

    def add_disconnect_listener(self, listener: Callable[[LinkLost], None]) -> None:
        """Call ``listener(lost)`` when the link breaks (:meth:`drop_link`, before the will and the
        reconnect), on the caller's thread: :class:`~protocol.transport_base.LinkLost` with the
        number of the connection lost, reason :data:`DROP_REASON` and no message awaiting
        acknowledgement (delivery is immediate here). Never for :meth:`close` or :meth:`abort`."""
        self._lost_listeners.append(listener)

    def abort(self) -> None:
        """Vanish like a device losing power: the broker publishes the last will; no reconnect."""
        if self._closed:
            return
        self._closed = True
        self._connected = False
        self.broker._gone(self, publish_will=True)

    def drop_link(self) -> None:
        """The link breaks and comes back: the disconnect listeners are called (with
        ``connection`` = ``connects``), the broker publishes the last will, the client reconnects
        (``connects`` + 1), renews its subscriptions (retained messages are delivered again) and
        calls the connect listeners with the new count.

        Raises:
            TransportError: the client is closed, or was taken over by a newer connection under
                its id (which keeps receiving).
        """
        if self._closed:
            raise TransportError(f"{self.client_id}: closed", client_id=self.client_id)
        if not self._connected:  # taken over by a newer connection under this id: it keeps the id
            raise TransportError(f"{self.client_id}: not connected (taken over by a newer connection)",
                                 client_id=self.client_id)
        self._tell_lost(DROP_REASON)
        self.broker._gone(self, publish_will=True)
        with self.broker._lock:
            self.broker._clients[self.client_id] = self
        self._come_back()

    def _tell_lost(self, reason: str) -> None:
        """Call the disconnect listeners: the connection ``connects`` is lost, for ``reason``."""
        lost = LinkLost(self.connects, reason)
        tell_link_listeners(self._lost_listeners, lost, client_id=self.client_id, what="disconnect")

    def _come_back(self) -> None:
        """Connect again: ``connects`` + 1, every subscription renewed (its retained messages
        delivered, flagged retained), then the connect listeners called with the new count (as
        :class:`~protocol.transport.MqttTransport` calls them once the broker acknowledged the
        renewed subscriptions)."""
        self._connected = True
        self.connects += 1
        for f, q in list(self._filters.items()):
            for topic, payload, rq in self.broker._retained_for(f):
                self._deliver(Incoming(topic, payload, min(rq, q), True, time.monotonic()))
        tell_link_listeners(self._listeners, self.connects, client_id=self.client_id, what="connect")

    # ------------------------------------------------------------------ called by the broker

    def _granted(self, topic: str) -> int | None:
        granted = [q for f, q in self._filters.items() if topic_matches(f, topic)]
        return max(granted) if granted else None

    def _deliver(self, inc: Incoming) -> None:
        with self._cond:
            self._inbox.append(inc)
            self._cond.notify_all()
