"""A TCP relay on loopback between clients and a server that counts what each connection put on
the wire, independently of fedfleet's ledger: bytes per connection and direction (any protocol:
Flower's gRPC too), and for MQTT whole packets by type (PUBLISH with and without the DUP flag; a
packet cut off by a closed connection counts as ``partial``), with each connection named by the
client id of its CONNECT (MQTT 3.1.1 §3.1, MQTT 5 §3.1).

For link faults it can stall a connection's client→broker direction (the client's socket fills
and paho keeps packets unwritten in its queue) and cut a connection as a broker closing it would.
When the broker side closes, the client's side is only half-closed: what the client wrote before it
saw the close is still read and counted (not forwarded), as the client's socket took it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter, defaultdict

from protocol import topics
from protocol.mqtt_bytes import connect_client_id

TYPES = {1: "CONNECT", 2: "CONNACK", 3: "PUBLISH", 4: "PUBACK", 8: "SUBSCRIBE", 9: "SUBACK", 12: "PINGREQ",
         13: "PINGRESP", 14: "DISCONNECT"}


class _Parser:
    """Incremental MQTT packet framing (fixed header, remaining length)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.bytes = 0
        self.packets: Counter[str] = Counter()
        self.publish_sizes: list[int] = []

    def feed(self, data: bytes) -> None:
        self.bytes += len(data)
        self.buf += data
        while len(self.buf) >= 2:
            n, shift, i = 0, 0, 1
            while True:
                if i >= len(self.buf):
                    return
                b = self.buf[i]
                n |= (b & 0x7F) << shift
                shift += 7
                i += 1
                if not b & 0x80:
                    break
            if len(self.buf) < i + n:
                return
            first = self.buf[0]
            name = TYPES.get(first >> 4, str(first >> 4))
            if name == "PUBLISH" and first & 0x08:
                name = "PUBLISH-DUP"
            self.packets[name] += 1
            if name.startswith("PUBLISH"):
                self.publish_sizes.append(i + n)
            del self.buf[:i + n]


def node_of(client_id: str) -> str:
    """fedfleet's node name in an MQTT client id (:func:`protocol.topics.node_of`: ``server``,
    ``client-NNN``); a client id of another form is returned as it is."""
    return topics.node_of(client_id) or client_id


class CountingRelay:
    """TCP relay 127.0.0.1:``port`` → 127.0.0.1:``target_port`` counting bytes and MQTT packets per
    connection (numbered from 0 in accept order) and direction (``up``: client → server)."""

    def __init__(self, target_port: int) -> None:
        """Listen on a free loopback port (:attr:`port`) and relay each connection to
        127.0.0.1:``target_port``.

        Raises:
            OSError: no loopback port could be bound.
        """
        self.target = ("127.0.0.1", target_port)
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.parsers: dict[tuple[int, str], _Parser] = defaultdict(_Parser)
        self.first: dict[int, bytearray] = defaultdict(bytearray)
        self.lock = threading.Lock()
        self._links: dict[int, tuple[socket.socket, socket.socket]] = {}
        self._held: set[int] = set()
        self._hold_after: dict[int, int] = {}  # connection -> bytes of its client -> broker direction, then held
        self._threads: list[threading.Thread] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        n = 0
        while not self._stop:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(self.target)
            except OSError:  # the server is not there (yet, or any more): the client sees a close
                c.close()
                continue
            with self.lock:
                self._links[n] = (c, b)
            for src, dst, way in ((c, b, "up"), (b, c, "down")):
                t = threading.Thread(target=self._pump, args=(n, src, dst, way), daemon=True)
                t.start()
                self._threads.append(t)
            n += 1

    def _pump(self, n: int, src: socket.socket, dst: socket.socket, way: str) -> None:
        forward = True
        try:
            while True:
                while way == "up" and n in self._held:
                    time.sleep(0.01)
                data = src.recv(65536)
                if not data:
                    break
                with self.lock:
                    self.parsers[(n, way)].feed(data)
                    if way == "up" and len(self.first[n]) < 512:
                        self.first[n] += data[:512]
                    if way == "up" and n in self._hold_after and self.parsers[(n, way)].bytes >= self._hold_after[n]:
                        del self._hold_after[n]
                        self._held.add(n)  # what was read is forwarded; the next read waits
                if forward:
                    try:
                        dst.sendall(data)
                    except OSError:
                        if way == "down":  # the client is gone
                            break
                        forward = False  # the broker is gone: go on counting what the client writes
        except OSError:
            pass
        finally:
            if way == "down":  # broker -> client ended: the client sees the close, its writes are still read
                _shutdown(dst, socket.SHUT_WR)
                _shutdown(src, socket.SHUT_RDWR)
            else:
                _shutdown(src, socket.SHUT_RDWR)
                _shutdown(dst, socket.SHUT_RDWR)

    @property
    def connections(self) -> int:
        """Connections accepted so far."""
        with self.lock:
            return len(self._links)

    def hold(self, n: int, *, after_bytes: int = 0) -> None:
        """Stop reading connection ``n``'s client → broker direction: the client's writes stay in
        the sockets' buffers until those are full, then in paho's queue.

        With ``after_bytes`` > 0 the direction is held once the relay has read at least that many
        bytes of it (in whole reads of up to 64 KiB, each forwarded); ``n`` may be a connection not
        accepted yet (``hold(relay.connections, after_bytes=1)``: the next connection's CONNECT
        goes through, which a client sends alone before its CONNACK, then it is held)."""
        if after_bytes > 0:
            with self.lock:
                self._hold_after[n] = after_bytes
        else:
            self._held.add(n)

    def cut(self, n: int, *, keep_held: bool = False) -> None:
        """Close connection ``n`` as its broker would (and read its client → broker direction
        again, so what the client wrote is counted).

        With ``keep_held`` a held direction stays held until :meth:`release`. A client goes on
        writing until it has seen the close, and what the relay reads meanwhile makes room in the
        sockets for more of its queue; a caller that needs the client's queue as it was at the cut
        releases the connection only once the client has closed its socket."""
        with self.lock:
            _, b = self._links[n]
        _shutdown(b, socket.SHUT_RDWR)
        if not keep_held:
            self.release(n)

    def release(self, n: int) -> None:
        """Read connection ``n``'s client → broker direction again (after :meth:`hold`)."""
        with self.lock:
            self._hold_after.pop(n, None)
        self._held.discard(n)

    def client_id(self, n: int) -> str:
        """The MQTT client id in connection ``n``'s CONNECT (3.1.1 or 5); ``""`` before one came."""
        return connect_client_id(bytes(self.first[n])) or ""

    def total_bytes(self, way: str) -> int:
        """Bytes of every connection in direction ``way`` (``"up"``: client → server, ``"down"``)."""
        with self.lock:
            return sum(p.bytes for (_, w), p in self.parsers.items() if w == way)

    def bytes_per_node(self) -> dict[tuple[str, str], int]:
        """``{(node, "up" | "down"): bytes}`` summed over the node's connections."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        with self.lock:
            for (n, way), p in self.parsers.items():
                cid = self.client_id(n)
                if cid:
                    out[(node_of(cid), way)] += p.bytes
        return dict(out)

    def packets(self, n: int, way: str = "up") -> Counter[str]:
        """Connection ``n``'s whole packets by type, plus ``partial`` for one cut off at its close."""
        with self.lock:
            p = self.parsers[(n, way)]
            return p.packets + Counter(partial=1 if p.buf else 0)

    def per_node(self) -> dict[str, dict[str, Counter[str]]]:
        """``{node: {"up": packets, "down": packets}}`` summed over the node's connections
        (``server`` or ``client-NNN``), plus ``partial`` for a packet cut off at a close and
        ``max_up`` / ``max_down``: the largest PUBLISH packet, bytes."""
        out: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: {"up": Counter(), "down": Counter()})
        with self.lock:
            for (n, way), p in self.parsers.items():
                cid = self.client_id(n)
                if not cid:
                    continue
                node = node_of(cid)
                out[node][way].update(p.packets)
                if p.buf:
                    out[node][way]["partial"] += 1
                if p.publish_sizes:
                    key = f"max_{way}"
                    out[node][way][key] = max(out[node][way][key], max(p.publish_sizes))
        return dict(out)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, let the open connections end on their own for at most ``timeout_s``
        (their last bytes are counted), then close every socket."""
        self._stop = True
        with self.lock:
            self._hold_after.clear()
        self._held.clear()
        self.srv.close()
        end = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, end - time.monotonic()))
        with self.lock:
            links = list(self._links.values())
        for c, b in links:
            for s in (c, b):
                _shutdown(s, socket.SHUT_RDWR)
                s.close()


def _shutdown(s: socket.socket, how: int) -> None:
    try:
        s.shutdown(how)
    except OSError:
        pass
