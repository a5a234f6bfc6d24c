"""Size-limit scenarios: a federation over a broker with a packet or message size
limit, or whose devices have a small limit of their own, behind a relay that parses the MQTT
stream, so a test (and ``tools/bench_size_limits.py``) can check what the run, the ledger and
the wire agree on.

``PacketRelay`` forwards 127.0.0.1:port to the broker and counts, per connection and direction,
bytes and whole MQTT packets by type (PUBLISH counted with and without the DUP flag); a packet
cut by a closed connection counts as ``partial``.
"""

from __future__ import annotations

import socket
import sqlite3
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from broker_server.embedded_broker import EmbeddedBroker
from broker_server.simulate import simulate
from edge_agent.agent import EdgeAgent
from helpers.federation import read_metrics, small_config

TYPES = {1: "CONNECT", 2: "CONNACK", 3: "PUBLISH", 4: "PUBACK", 8: "SUBSCRIBE", 9: "SUBACK", 12: "PINGREQ",
         13: "PINGRESP", 14: "DISCONNECT"}


class _Parser:
    """Incremental MQTT packet framing (fixed header, remaining length)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.packets: Counter[str] = Counter()
        self.publish_sizes: list[int] = []

    def feed(self, data: bytes) -> None:
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


class PacketRelay:
    """TCP relay to ``target_port`` counting bytes and MQTT packets per connection and direction."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.parsers: dict[tuple[int, str], _Parser] = defaultdict(_Parser)
        self.first: dict[int, bytearray] = defaultdict(bytearray)
        self.lock = threading.Lock()
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        n = 0
        while not self._stop:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            for src, dst, way in ((c, b, "up"), (b, c, "down")):
                threading.Thread(target=self._pump, args=(n, src, dst, way), daemon=True).start()
            n += 1

    def _pump(self, n: int, src: socket.socket, dst: socket.socket, way: str) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                with self.lock:
                    self.parsers[(n, way)].feed(data)
                    if way == "up" and len(self.first[n]) < 512:
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
        """The MQTT client id in connection ``n``'s CONNECT (3.1.1 or 5)."""
        pkt = bytes(self.first[n])
        if len(pkt) < 12 or pkt[0] >> 4 != 1:  # nothing, or not a CONNECT
            return ""
        i = 1
        while pkt[i] & 0x80:
            i += 1
        i += 1
        level = pkt[i + 6]
        i += 10
        if level == 5:
            ln, shift = 0, 0
            while True:
                ln |= (pkt[i] & 0x7F) << shift
                shift += 7
                i += 1
                if not pkt[i - 1] & 0x80:
                    break
            i += ln
        ln = int.from_bytes(pkt[i:i + 2], "big")
        return pkt[i + 2:i + 2 + ln].decode("utf-8", "replace")

    def per_node(self) -> dict[str, dict[str, Counter[str]]]:
        """``{node: {"up": packets, "down": packets}}`` summed over the node's connections
        (``server`` or ``client-NNN``), plus ``partial`` for a packet cut off at a close."""
        out: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: {"up": Counter(), "down": Counter()})
        with self.lock:
            for (n, way), p in self.parsers.items():
                cid = self.client_id(n)
                if not cid:
                    continue
                node = "server" if cid.endswith("-server") else "-".join(cid.rsplit("-", 2)[-2:])
                out[node][way].update(p.packets)
                if p.buf:
                    out[node][way]["partial"] += 1
                if p.publish_sizes:
                    key = f"max_{way}"
                    out[node][way][key] = max(out[node][way][key], max(p.publish_sizes))
        return dict(out)

    def close(self) -> None:
        self._stop = True
        self.srv.close()


@dataclass
class Outcome:
    """What one size-limit run gave.

    Attributes:
        rounds: rounds completed; ``reported``: updates accepted per round; ``receipts``: global
        receipts per round; ``reached_none``: rounds whose global reached no device; ``agent_errors``:
        agents that failed; ``deliveries``: (side, delivery) -> sent PUBLISH rows; ``ledger_publish``:
        node -> PUBLISH rows it sent (first transmissions + PUBLISH-DUP rows); ``wire_publish``: the
        relay's count of PUBLISH packets from that node (a cut one included); ``dup_publish``:
        node -> PUBLISH-DUP rows (paho's retransmissions); ``connects``: node -> CONNECT rows;
        ``max_down``: node -> largest PUBLISH the broker delivered to it (bytes);
        ``refusal_reasons``: distinct reasons of refused rows; ``seconds``: wall time;
        ``round_seconds``: each round's ``seconds`` (metrics.jsonl); ``global_resends``: each
        round's globals sent again because no device confirmed them.
    """

    rounds: int = 0
    reported: list[int] = field(default_factory=list)
    receipts: list[int] = field(default_factory=list)
    reached_none: list[int] = field(default_factory=list)
    agent_errors: int = 0
    deliveries: dict[tuple[str, str], int] = field(default_factory=dict)
    ledger_publish: dict[str, int] = field(default_factory=dict)
    wire_publish: dict[str, int] = field(default_factory=dict)
    dup_publish: dict[str, int] = field(default_factory=dict)
    connects: dict[str, int] = field(default_factory=dict)
    max_down: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    refusal_reasons: list[str] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0
    round_seconds: list[float] = field(default_factory=list)
    global_resends: list[int] = field(default_factory=list)


def tiny_profile(folder: Path, max_packet_bytes: int = 20_000, chunk_bytes: int = 16_384) -> str:
    """Write firmware profile ``tiny-mqtt`` (the x86-cpu one with an MQTT limit of
    ``max_packet_bytes``) into ``folder``; return its name. Put ``folder`` first in FEDFLEET_PROFILES."""
    from edge_agent.profiles import SHIPPED_DIR

    text = (Path(SHIPPED_DIR) / "x86-cpu.toml").read_text()
    lines = []
    for line in text.splitlines():
        if line.startswith("name = "):
            line = 'name = "tiny-mqtt"'
        elif line.startswith("max_packet_bytes = "):
            line = f"max_packet_bytes = {max_packet_bytes}"
        elif line.startswith("chunk_bytes = "):
            line = f"chunk_bytes = {chunk_bytes}"
        lines.append(line)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny-mqtt.toml").write_text("\n".join(lines) + "\n")
    return "tiny-mqtt"


def run_size_limit(work: Path, *, kind: str = "mosquitto", broker_lines: tuple[str, ...] = (),
                   mqtt_version: str = "auto", declared: int = 0, profile: str = "x86-cpu",
                   rounds: int = 2, deadline_s: float = 40.0, server: dict | None = None,
                   protocol: dict | None = None, agent_hook: Callable[[int, EdgeAgent], None] | None = None) -> Outcome:
    """One digits federation (3 agents, quorum 2) through a :class:`PacketRelay` to a broker of
    ``kind`` with ``broker_lines`` in its config; ``declared`` is ``[protocol] max_packet_bytes``;
    ``server`` / ``protocol`` are more ``[server]`` / ``[protocol]`` keys; ``agent_hook`` is
    :func:`~broker_server.simulate.simulate`'s."""
    out = Outcome()
    t0 = time.monotonic()
    with EmbeddedBroker(kind=kind, workdir=work / "broker", extra_config=broker_lines) as broker:
        relay = PacketRelay(broker.port)
        try:
            cfg = small_config(run={"rounds": rounds}, broker={"mqtt_version": mqtt_version, "keepalive_s": 5},
                               server={"round_deadline_s": deadline_s, **(server or {})},
                               protocol={"max_packet_bytes": declared, **(protocol or {})},
                               agents={"profile": profile})
            try:
                res = simulate(cfg, broker_url=f"mqtt://127.0.0.1:{relay.port}", run_dir=work / "run",
                               agent_hook=agent_hook)
                out.rounds = res.rounds_completed
            except Exception as exc:  # the row says the run did not finish, and why
                out.error = f"{type(exc).__name__}: {exc}"[:300]
            time.sleep(0.3)
            wire = relay.per_node()
        finally:
            relay.close()
    out.seconds = time.monotonic() - t0
    run = work / "run"
    if (run / "metrics.jsonl").exists():
        ms = read_metrics(run)
        out.reported = [m["clients_reported"] for m in ms]
        out.duplicates = sum(m.get("duplicates", 0) for m in ms)
        out.receipts = [m["global_receipts"] for m in ms]
        out.reached_none = [m["round"] for m in ms if m.get("global_reached_no_device")]
        out.round_seconds = [m["seconds"] for m in ms]
        out.global_resends = [m.get("global_resends", 0) for m in ms]
    summary = run / "summary.json"
    if summary.exists():
        import json

        out.agent_errors = len(json.loads(summary.read_text()).get("agent_errors") or [])
    db = sqlite3.connect(run / "ledger.sqlite")
    out.deliveries = {(s, d): n for s, d, n in db.execute(
        "SELECT side, delivery, COUNT(*) FROM messages WHERE event='sent' AND reason != 'control' GROUP BY 1, 2")}
    for node, n in db.execute("SELECT node, COUNT(*) FROM messages WHERE event='sent' AND (reason != 'control' "
                              "OR kind = 'PUBLISH-DUP') GROUP BY node"):
        out.ledger_publish[node] = n
    for node, n in db.execute("SELECT node, COUNT(*) FROM messages WHERE kind='PUBLISH-DUP' AND event='sent' "
                              "GROUP BY node"):
        out.dup_publish[node] = n
    for node, n in db.execute("SELECT node, COUNT(*) FROM messages WHERE kind='CONNECT' GROUP BY node"):
        out.connects[node] = n
    out.refusal_reasons = [r for (r,) in db.execute(
        "SELECT DISTINCT reason FROM messages WHERE delivery='refused' OR kind='undeliverable'")]
    db.close()
    for node, ways in wire.items():
        out.wire_publish[node] = ways["up"]["PUBLISH"] + ways["up"]["PUBLISH-DUP"] + ways["up"]["partial"]
        out.max_down[node] = ways["down"]["max_down"]
    return out
