"""The MQTT transport seam: raw bytes in and out over paho-mqtt 2.x.

This is the only module that touches a socket. It knows nothing of message kinds; the
:class:`protocol.channel.Channel` above it encodes, decodes and keeps the ledger.

Design rules (``notes/mqtt-transport-study.md``):

* paho-mqtt 2.x, ``CallbackAPIVersion.VERSION2``, MQTT 3.1.1, clean sessions, ``loop_start()``:
  the network loop runs on paho's own thread, so training on the caller's thread never starves
  keepalive.
* ``on_message`` only enqueues ``(topic, payload)``; all decoding happens on the consumer's thread.
* Subscriptions are renewed in ``on_connect``, so a reconnect after a broker restart resumes
  without relying on broker sessions.
* ``wait_for_publish(timeout)`` returns silently on timeout: :meth:`MqttTransport.publish` checks
  ``is_published()`` afterwards and raises :class:`~protocol.errors.PublishTimeout`.

The paho-free parts live beside it and are re-exported here: the seam's types in
:mod:`protocol.transport_base` (``Transport``, ``Incoming``, ``Will``, ``PacketEvent``) and the TLS
checks in :mod:`protocol.transport_tls` (``tls_context``). Importing this module without paho-mqtt
raises an :class:`ImportError` that says so.
"""

from __future__ import annotations

import logging
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable

try:
    import paho.mqtt.client as mqtt
except ImportError as exc:  # the codec works without paho; only the MQTT transport needs it
    raise ImportError(f"protocol.transport (MqttTransport, the MQTT client) needs paho-mqtt 2.x, which cannot be "
                      f"imported ({exc}): pip install 'paho-mqtt>=2.0,<3'. The codec (protocol.messages, "
                      f"protocol.tensors, protocol.chunking, protocol.channel) works without it",
                      name="paho") from exc

from .errors import ConnectError, OfflineBufferFull, PublishTimeout, TransportError
from .transport_base import PACKET_TYPES, Incoming, PacketEvent, Transport, Will
from .transport_tls import tls_context

__all__ = ["PACKET_TYPES", "Incoming", "MqttTransport", "PacketEvent", "Transport", "Will", "tls_context"]

log = logging.getLogger(__name__)


def _published(info: mqtt.MQTTMessageInfo) -> bool:
    """Whether the broker acknowledged the message. paho's ``is_published()`` raises for a message
    queued while the link was down (its ``rc`` stays ``MQTT_ERR_NO_CONN`` even after paho re-sent it
    and got the PUBACK), so the acknowledgement flag paho sets on PUBACK is read directly."""
    try:
        return info.is_published()
    except (RuntimeError, ValueError):
        with info._condition:  # paho-mqtt 2.x: set by the PUBACK handler
            return bool(info._published)


class _CountingClient(mqtt.Client):
    """paho Client that reports every packet and counts socket bytes.

    Two paho internals are wrapped (paho-mqtt 2.x): ``_packet_queue`` (each outgoing packet, as
    complete bytes) and ``_packet_handle`` (each complete incoming packet); ``_sock_send`` /
    ``_sock_recv`` count the raw bytes written to / read from the socket (before TLS).
    """

    def __init__(self, *args, on_packet, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._fedfleet_on_packet = on_packet
        self.socket_bytes_out = 0
        self.socket_bytes_in = 0

    def _packet_queue(self, command, packet, mid, qos, info=None):
        first = packet[0] if len(packet) else command  # paho sets DUP in the packet, not in `command`
        self._fedfleet_on_packet(PacketEvent("out", PACKET_TYPES.get(first >> 4, "?"), len(packet),
                                             bool(first & 0x08) and first >> 4 == 3))
        return super()._packet_queue(command, packet, mid, qos, info)

    def _packet_handle(self):
        ip = self._in_packet
        rl = ip["remaining_length"]
        size = 1 + (1 if rl < 128 else 2 if rl < 16_384 else 3 if rl < 2_097_152 else 4) + rl
        self._fedfleet_on_packet(PacketEvent("in", PACKET_TYPES.get(ip["command"] >> 4, "?"), size,
                                             bool(ip["command"] & 0x08) and ip["command"] >> 4 == 3))
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


class MqttTransport:
    """A paho-mqtt client with a receive queue.

    Args:
        client_id: unique MQTT client id (two clients with one id evict each other forever).
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
            beyond either bound raises :class:`~protocol.errors.OfflineBufferFull`.

    Raises:
        SecurityConfigError: unusable TLS files (see :func:`tls_context`), at construction.
        ConnectError: from :meth:`connect`, when no CONNACK arrives in time or it refuses.
    """

    def __init__(self, client_id: str, host: str, port: int, *, username: str | None = None,
                 password: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, keepalive_s: int = 30, will: Will | None = None,
                 max_queue: int = 100_000, max_buffered_messages: int = 1000,
                 max_buffered_bytes: int = 256 * 1024 * 1024, tls: bool = False, tls_check_time: bool = True,
                 clock_skew_s: float = 300.0) -> None:
        self.client_id = client_id
        self.host, self.port = host, port
        self.keepalive_s = keepalive_s
        self._filters: dict[str, int] = {}
        self._queue: queue.Queue[Incoming] = queue.Queue(maxsize=max_queue)
        self._connected = threading.Event()
        self._closed = False
        self._refused: str | None = None
        self.connects = 0
        self.disconnects = 0
        self._packet_listener: Callable[[PacketEvent], None] | None = None
        self._connect_listeners: list[Callable[[int], None]] = []
        self.max_buffered_messages = max_buffered_messages
        self.max_buffered_bytes = max_buffered_bytes
        self._unacked: list[tuple[mqtt.MQTTMessageInfo, int]] = []
        self._unacked_bytes = 0
        self._buffer_lock = threading.Lock()
        self._early_packets: list[PacketEvent] = []
        self._packet_lock = threading.Lock()
        c = _CountingClient(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                            protocol=mqtt.MQTTv311, clean_session=True, on_packet=self._on_packet)
        c.reconnect_delay_set(min_delay=1, max_delay=8)
        c.max_inflight_messages_set(20)
        if username is not None:
            c.username_pw_set(username, password)
        self._tls: ssl.SSLContext | None = None
        if tls or tls_ca is not None or tls_cert is not None:
            self._tls = tls_context(ca_file=tls_ca, cert_file=tls_cert, key_file=tls_key,
                                    check_time=tls_check_time, clock_skew_s=clock_skew_s)
            c.tls_set_context(self._tls)
        if will is not None:
            c.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain)
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        self._client = c

    # paho callbacks (network thread) ---------------------------------------------------------

    def _on_packet(self, event: PacketEvent) -> None:
        with self._packet_lock:
            listener = self._packet_listener
            if listener is None:
                if len(self._early_packets) < 10_000:
                    self._early_packets.append(event)
                return
        listener(event)

    def set_packet_listener(self, listener: Callable[[PacketEvent], None]) -> None:
        """Receive a :class:`PacketEvent` for every MQTT packet from now on; packets seen before
        (CONNECT, CONNACK, SUBSCRIBE … of :meth:`connect`) are replayed first."""
        with self._packet_lock:
            early, self._early_packets = self._early_packets, []
            self._packet_listener = listener
        for ev in early:
            listener(ev)

    def add_connect_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(n)`` on paho's network thread after the n-th accepted CONNECT (n > 1 is
        a reconnect). It must not block: publish without waiting."""
        self._connect_listeners.append(listener)

    @property
    def socket_bytes(self) -> tuple[int, int]:
        """(bytes written to, bytes read from) the socket so far, MQTT layer (before TLS)."""
        return self._client.socket_bytes_out, self._client.socket_bytes_in

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            self._refused = str(reason_code)
            log.warning("%s: broker refused connection: %s", self.client_id, reason_code)
            return
        self.connects += 1
        for flt, qos in self._filters.items():
            client.subscribe(flt, qos)
        self._connected.set()
        for listener in list(self._connect_listeners):
            try:
                listener(self.connects)
            except Exception:  # a listener must never break paho's network thread
                log.exception("%s: connect listener failed", self.client_id)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self._connected.clear()
        self.disconnects += 1
        if not self._closed:
            log.info("%s: disconnected (%s); paho reconnects", self.client_id, reason_code)

    def _on_message(self, client, userdata, msg) -> None:
        self._queue.put(Incoming(msg.topic, bytes(msg.payload), msg.qos, bool(msg.retain), time.monotonic()))

    # API -------------------------------------------------------------------------------------

    def connect(self, timeout_s: float = 30.0) -> None:
        """Connect and start the network thread; return once CONNACK accepted the session.

        An unreachable broker fails at once (a TCP probe) and a refused login as soon as the
        CONNACK says so; ``timeout_s`` only bounds the wait of an accepted TCP connection for its
        CONNACK, which a broker serving many connects at once on a loaded machine may take a while to send.

        Raises:
            ConnectError: refused, or no CONNACK within ``timeout_s`` seconds.
        """
        try:  # fail fast, with the reason, when nothing listens there
            probe = socket.create_connection((self.host, self.port), timeout=min(timeout_s, 5.0))
        except OSError as exc:
            reason = exc.strerror or exc.__class__.__name__
            raise ConnectError(f"cannot reach the MQTT broker at {self.host}:{self.port}: {reason}. Is the broker "
                               f"running, and are the host and port right?", client_id=self.client_id) from exc
        with probe:
            if self._tls is not None:  # a refused certificate says why now, not as "no CONNACK" later
                self._tls_probe(probe)
        try:
            self._client.connect_async(self.host, self.port, keepalive=self.keepalive_s)
        except (OSError, ValueError) as exc:
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: {exc}", client_id=self.client_id) from exc
        self._client.loop_start()
        deadline = time.monotonic() + timeout_s
        while not self._connected.wait(0.05):  # a refusal (bad login) ends the wait at once
            if self._refused or time.monotonic() >= deadline:
                break
        if not self._connected.is_set():
            self._client.loop_stop()
            reason = self._refused or "no CONNACK"
            raise ConnectError(f"the MQTT broker at {self.host}:{self.port} did not accept the connection of "
                               f"{self.client_id!r} within {timeout_s:g} s ({reason}); check credentials and TLS "
                               f"settings", client_id=self.client_id)

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

    def subscribe(self, filters: list[str], qos: int = 1) -> None:
        """Subscribe now and after every reconnect."""
        for f in filters:
            self._filters[f] = qos
            if self.connected:
                self._client.subscribe(f, qos)

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                wait_s: float | None = None) -> None:
        """Hand one PUBLISH to paho.

        At QoS 1 a publish made while the link is down is queued by paho and sent after the
        reconnect. With ``wait_s`` the call blocks until the PUBACK (QoS 1) or the socket write.

        Raises:
            PublishTimeout: ``wait_s`` given and the PUBLISH not acknowledged in that time.
            TransportError: paho refused the message (e.g. payload too large for MQTT).
        """
        if qos > 0:
            with self._buffer_lock:
                self._prune()
                if (len(self._unacked) + 1 > self.max_buffered_messages
                        or self._unacked_bytes + len(payload) > self.max_buffered_bytes):
                    raise OfflineBufferFull(
                        f"{self.client_id}: {len(self._unacked)} messages ({self._unacked_bytes:,} bytes) wait for "
                        f"acknowledgement (link {'up' if self.connected else 'down'}); the offline buffer holds at "
                        f"most {self.max_buffered_messages} messages / {self.max_buffered_bytes:,} bytes",
                        client_id=self.client_id, topic=topic)
        try:
            info = self._client.publish(topic, payload, qos=qos, retain=retain)
        except (ValueError, TypeError) as exc:
            raise TransportError(f"publish to {topic} refused: {exc}", client_id=self.client_id, topic=topic) from exc
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            raise TransportError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}",
                                 client_id=self.client_id, topic=topic)
        if qos > 0:
            with self._buffer_lock:
                self._unacked.append((info, len(payload)))
                self._unacked_bytes += len(payload)
        if wait_s is not None:
            deadline = time.monotonic() + wait_s
            while not _published(info):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PublishTimeout(f"{self.client_id}: PUBLISH to {topic} not acknowledged within {wait_s:g} s",
                                         client_id=self.client_id, topic=topic)
                if self.connected:
                    try:
                        info.wait_for_publish(min(remaining, 0.5))
                    except RuntimeError:  # not connected right now: wait for the reconnect
                        time.sleep(0.05)
                else:
                    self._connected.wait(min(remaining, 0.5))

    def _prune(self) -> None:
        """Forget acknowledged messages (caller holds ``_buffer_lock``)."""
        if self._unacked:
            keep = [(i, n) for i, n in self._unacked if not _published(i)]
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
        """Vanish like a device losing power: stop the network thread and close the socket
        without DISCONNECT, so the broker publishes the last will. No reconnect follows."""
        self._closed = True
        self._client.loop_stop()
        sock = self._client.socket()
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
        self._connected.clear()

    def close(self, timeout_s: float = 5.0) -> None:
        """Send DISCONNECT (no last will) and stop the network thread (idempotent). Messages
        already received stay in the queue: :meth:`get` still returns them."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.connected:
                self._client.disconnect()
        finally:
            self._client.loop_stop()
