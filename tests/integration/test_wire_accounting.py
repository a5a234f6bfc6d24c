"""Proof that the byte ledger is exact on the wire: every MQTT connection of a federation is routed
through a byte-counting TCP relay on loopback, and for each connection the ledger's totals (all
PUBLISH rows plus the control packets CONNECT, CONNACK, SUBSCRIBE, SUBACK, PUBACK, PINGREQ,
PINGRESP, DISCONNECT) must equal what the relay counted, to the byte, in both directions."""

from __future__ import annotations

import socket
import sqlite3
import threading
from collections import defaultdict
from pathlib import Path

import pytest
from helpers.federation import small_config

from broker_server.embedded_broker import EmbeddedBroker
from broker_server.simulate import simulate


class CountingRelay:
    """TCP relay 127.0.0.1:port → broker that counts bytes per connection and direction and reads
    the MQTT client id from each connection's CONNECT packet (MQTT 3.1.1 §3.1)."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.up: dict[int, int] = defaultdict(int)     # conn no → client→broker bytes
        self.down: dict[int, int] = defaultdict(int)   # conn no → broker→client bytes
        self.first: dict[int, bytearray] = defaultdict(bytearray)
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self._stop = False
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()

    def _accept(self) -> None:
        n = 0
        while not self._stop:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            for src, dst, up in ((c, b, True), (b, c, False)):
                t = threading.Thread(target=self._pump, args=(n, src, dst, up), daemon=True)
                t.start()
                self.threads.append(t)
            n += 1

    def _pump(self, n: int, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                with self.lock:
                    (self.up if up else self.down)[n] += len(data)
                    if up and len(self.first[n]) < 512:
                        self.first[n] += data[:512]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def client_id(self, n: int) -> str:
        """Client id of connection ``n`` from its CONNECT packet."""
        pkt = bytes(self.first[n])
        i = 1
        while pkt[i] & 0x80:  # remaining length varint
            i += 1
        i += 1
        level = pkt[i + 6]  # after the protocol name (2+4): 4 = MQTT 3.1.1, 5 = MQTT 5
        i += 10  # protocol name (2+4), level, flags, keepalive (2)
        if level == 5:  # MQTT 5 §3.1.2.11: the CONNECT properties (a varint length, then them)
            n, shift = 0, 0
            while True:
                n |= (pkt[i] & 0x7F) << shift
                shift += 7
                i += 1
                if not pkt[i - 1] & 0x80:
                    break
            i += n
        ln = int.from_bytes(pkt[i:i + 2], "big")
        return pkt[i + 2:i + 2 + ln].decode()

    def close(self) -> None:
        self._stop = True
        self.srv.close()
        for t in self.threads:
            t.join(timeout=5)


@pytest.mark.parametrize("kind", [pytest.param("mosquitto", marks=pytest.mark.mosquitto), "amqtt"])
def test_ledger_equals_bytes_on_the_wire(kind: str, tmp_path: Path) -> None:
    if kind == "mosquitto":
        from helpers.brokers import require_mosquitto

        require_mosquitto()
    with EmbeddedBroker(kind=kind, workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        try:
            res = simulate(small_config(broker={"keepalive_s": 5}), broker_url=f"mqtt://127.0.0.1:{relay.port}",
                           run_dir=tmp_path / "run")
        finally:
            relay.close()
    assert res.rounds_completed == 2
    db = sqlite3.connect(tmp_path / "run" / "ledger.sqlite")
    sums: dict[tuple[str, str], int] = defaultdict(int)
    kinds = set()
    for node, event, kind_, h, t, p in db.execute(
            "SELECT node, event, kind, mqtt_header_bytes, topic_bytes, payload_bytes FROM messages"):
        sums[(node, "out" if event == "sent" else "in")] += h + t + p
        kinds.add(kind_)
    db.close()
    assert {"CONNECT", "CONNACK", "SUBSCRIBE", "SUBACK", "PUBACK", "DISCONNECT"} <= kinds
    # per node over all its connections: against amqtt each client first tries MQTT 5 (refused,
    # then 3.1.1 on a second connection); both connections' packets are in the ledger
    wire: dict[tuple[str, str], int] = defaultdict(int)
    for n in sorted(relay.up):
        cid = relay.client_id(n)
        node = "server" if cid.endswith("-server") else cid.rsplit("-", 2)[-2] + "-" + cid.rsplit("-", 1)[-1]
        wire[(node, "out")] += relay.up[n]
        wire[(node, "in")] += relay.down[n]
    for (node, way), n in sorted(wire.items()):
        assert sums[(node, way)] == n, f"{node}: {'client→broker' if way == 'out' else 'broker→client'} bytes"
    assert len(wire) == 8  # the server and three agents, both ways
