"""Chaos tests: federations over real MQTT brokers while things break.

Every scenario runs a real federation (scikit-learn digits, 3 agents, quorum 2) and breaks one
thing: the broker is SIGKILLed and restarted mid-round, an agent dies half-way through a chunked
upload, a TCP relay cuts connections at random byte offsets and a rogue client re-publishes
updates, the server process is SIGKILLed and resumed, a fourth device joins mid-run, the broker
vanishes under a bounded offline buffer, a device trains for longer than the MQTT keepalive.

Each scenario ends with the same accounting, from evidence the code under test does not compute
itself:

* ``Recorder`` wraps the server's accumulator (``broker_server.server.accumulator_for``): the
  clients whose update was actually folded into each round's aggregate (``counted``);
* it wraps each agent's ``_handle``: the rounds for which the agent's ``receipts_accepted`` grew
  (``acked``), and every receipt an agent got for an update it had sent (``answers``);
* the byte ledger: every ``received`` row has a ``sent`` row of another node with the same
  ``(sender, seq)``, topic and byte sizes, and every update delivery the server ledgered is
  accounted for exactly once by the server's counters:
  ``deliveries = counted + duplicates + late + unsolicited + invalid``.

The invariants: the run finished; no acknowledged update was left out of its round's aggregate
(``lost`` = acked − counted = ∅); no client was aggregated twice in a round; ``counted`` equals
``clients_reported``; each agent's ``receipts_accepted`` equals its acknowledged rounds; and,
where no receipt can be lost in flight, every aggregated update was acknowledged.

Besides the scenarios, narrower behaviours under the same faults:

* a QoS 1 message published while the link is down is sent after the reconnect and then frees
  its offline-buffer slot (``test_message_sent_after_an_outage_frees_its_buffer_slot``);
* a PUBLISH that paho re-sends after a reconnect is a ``PUBLISH-DUP`` row of the ledger
  (``test_retransmission_after_a_reconnect_is_ledgered``).

The server's answers to copies of updates (after their round closed, after a reconnect) are
tested message by message in tests/broker_server/test_server_rounds.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from helpers.checkpoints import checkpoint_round
from helpers.federation import small_config
from helpers.waiting import wait_for

import broker_server.server as server_mod
import broker_server.simulate as simulate_mod
from broker_server import config as config_mod
from broker_server.embedded_broker import EmbeddedBroker
from broker_server.runtime import channel_options, device_model, expected_data, open_transport
from broker_server.server import AggregationServer
from edge_agent.agent import AgentSummary, EdgeAgent
from edge_agent.algorithms import TrainConfig, get_client_algorithm
from edge_agent.data import load_dataset
from protocol import topics
from protocol.channel import Channel
from protocol.errors import OfflineBufferFull
from protocol.ledger import Ledger
from protocol.messages import Chunk, Envelope, Kind, Receipt, Status, Update, decode, encode
from protocol.mqtt_bytes import connect_client_id
from protocol.transport import MqttTransport, Will

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


# ============================================================================ configuration


def chaos_config(**over) -> config_mod.Config:
    """The integration tests' small federation (3 agents on digits, quorum 2), 3 rounds, 20 s
    deadline: a round takes about a second."""
    base = {"run": {"name": "chaos", "rounds": 3}, "server": {"round_deadline_s": 20.0}}
    for sec, vals in over.items():
        base[sec] = {**base.get(sec, {}), **vals}
    return small_config(**base)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def ledger_rows(*paths: Path, since: float | None = None) -> list[dict]:
    """Rows of one or more ledger files (``since``: only rows with ``ts`` ≥ it)."""
    rows: list[dict] = []
    for p in paths:
        db = sqlite3.connect(f"file:{p}?mode=ro", uri=True, timeout=30)
        db.row_factory = sqlite3.Row
        rows += [dict(r) for r in db.execute("SELECT * FROM messages ORDER BY id")]
        db.close()
    if since is not None:
        rows = [r for r in rows if r["ts"] >= since]
    return rows


def wait_until(cond: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> bool:
    """Poll ``cond`` until it is true (True) or ``timeout_s`` passed (False)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step_s)
    return cond()


# ============================================================================ instrumentation


class _CountingAccumulator:
    """Wraps the server's accumulator: records each update folded into the round's aggregate."""

    def __init__(self, inner, round: int, rec: Recorder) -> None:
        self.inner, self.round, self.rec = inner, round, rec

    def add(self, result) -> None:
        self.inner.add(result)  # raises on a bad update: then nothing is recorded (nor aggregated)
        with self.rec.lock:
            self.rec.counted[self.round].append(result.client_id)

    def result(self):
        return self.inner.result()


class Recorder:
    """What the server aggregated, and what each agent was told (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counted: dict[int, list[str]] = defaultdict(list)
        self.acked: dict[int, set[str]] = defaultdict(set)
        self.answers: list[tuple[str, int, int, bool, str]] = []  # client, round, ref_seq, accepted, reason
        self.servers: list[AggregationServer] = []
        self.agents: list[EdgeAgent] = []

    @contextmanager
    def installed(self) -> Iterator[Recorder]:
        """Patch the server's ``accumulator_for`` and ``simulate``'s ``make_server`` (restored after)."""
        orig_acc, orig_make = server_mod.accumulator_for, simulate_mod.make_server

        def accumulator_for(strategy, round, current):
            return _CountingAccumulator(orig_acc(strategy, round, current), round, self)

        def make_server(*args, **kwargs):
            srv = orig_make(*args, **kwargs)
            self.servers.append(srv)
            return srv

        server_mod.accumulator_for, simulate_mod.make_server = accumulator_for, make_server
        try:
            yield self
        finally:
            server_mod.accumulator_for, simulate_mod.make_server = orig_acc, orig_make

    def attach(self, agent: EdgeAgent) -> None:
        """Record the update receipts ``agent`` takes into account."""
        self.agents.append(agent)
        original = agent._handle

        def handle(item):
            env = item.envelope
            body = env.body
            if not (isinstance(body, Receipt) and body.ref_kind == Kind.UPDATE and env.sender == "server"):
                return original(item)
            ours = body.ref_seq in agent._update_seqs
            before = agent.receipts_accepted
            try:
                return original(item)
            finally:
                with self.lock:
                    if ours:
                        self.answers.append((agent.client_id, env.round, body.ref_seq, body.accepted, body.reason))
                    if agent.receipts_accepted > before:
                        self.acked[env.round].add(agent.client_id)

        agent._handle = handle

    def hook(self, extra: Callable[[int, EdgeAgent], None] | None = None) -> Callable[[int, EdgeAgent], None]:
        """An ``agent_hook`` for :func:`simulate`: attach, then ``extra``."""

        def hook(i: int, agent: EdgeAgent) -> None:
            self.attach(agent)
            if extra is not None:
                extra(i, agent)

        return hook

    @property
    def server(self) -> AggregationServer:
        return self.servers[-1]


# ============================================================================ the accounting


@dataclass
class Accounting:
    rounds: list[int]
    rounds_completed: int
    counted: dict[int, list[str]]
    acked: dict[int, set[str]]
    reported: dict[int, int]
    skipped: dict[int, bool]
    lost: list[tuple[int, str]]                 # acknowledged, not in its round's accumulator
    acked_in_skipped_rounds: list[tuple[int, str]]  # acknowledged, round closed without aggregation (by design)
    double: list[tuple[int, str]]               # aggregated more than once in a round
    counted_unacked: list[tuple[int, str]]      # aggregated, the agent never got an accepted receipt
    wrongly_rejected: list[tuple[int, str, str]]  # aggregated, yet the agent was told 'rejected'
    deliveries: int                              # update deliveries in the server's ledger
    accounted: int                               # counted + duplicates + late + unsolicited + invalid
    duplicates: int
    late: int
    ledger_mismatches: list[str]
    summaries_mismatch: list[str]
    extra: dict = field(default_factory=dict)

    @property
    def updates_counted(self) -> int:
        """Updates folded into an aggregate that became the global model (skipped rounds left out)."""
        return sum(len(v) for r, v in self.counted.items() if not self.skipped.get(r))

    def figures(self) -> dict:
        return {"rounds_completed": self.rounds_completed, "updates_counted": self.updates_counted,
                "updates_lost": len(self.lost), "duplicates_aggregated": len(self.double),
                "duplicates_rejected": self.duplicates, "late": self.late,
                "counted_unacked": len(self.counted_unacked), "wrongly_rejected": len(self.wrongly_rejected),
                "acked_in_skipped_rounds": len(self.acked_in_skipped_rounds),
                "ledger_mismatches": len(self.ledger_mismatches), **self.extra}


def ledger_mismatches(rows: list[dict]) -> list[str]:
    """Every ``received`` row needs a ``sent`` row of another node with the same (sender, seq),
    topic and byte sizes (seq 0: a last will, published by the broker, has none).

    "Another node", not "the other side": amqtt 0.12.1 hands a client that subscribes late the
    retained ``status`` messages of the other agents although its filters do not match them
    (see :func:`stray_deliveries`); those rows are true to the bytes, so they are kept."""
    sent: dict[tuple[str, int], dict] = {}
    bad: list[str] = []
    for r in rows:
        if r["event"] == "sent" and r["seq"] is not None and r["sender"]:
            key = (r["sender"], r["seq"])
            if key in sent:
                bad.append(f"two sent rows for {key}")
            sent[key] = r
    for r in rows:
        if r["event"] != "received" or r["seq"] is None or r["seq"] == 0:
            continue
        s = sent.get((r["sender"], r["seq"]))
        if s is None:
            bad.append(f"{r['side']} {r['node']} received {r['kind']} ({r['sender']}, {r['seq']}) never sent")
            continue
        same = all(r[k] == s[k] for k in ("topic", "topic_bytes", "envelope_bytes", "body_bytes", "payload_bytes",
                                          "chunk_index", "transfer_id"))
        if not same or s["node"] == r["node"]:
            bad.append(f"{r['side']} {r['node']} received ({r['sender']}, {r['seq']}) differs from its sent row")
    return bad


def stray_deliveries(rows: list[dict]) -> int:
    """Agent-side ``received`` rows of another agent's message (outside the agent's filters)."""
    return sum(1 for r in rows if r["side"] == "agent" and r["event"] == "received" and r["sender"]
               and r["sender"] != "server" and r["seq"] is not None)


def server_update_deliveries(rows: list[dict]) -> list[dict]:
    """Updates the server took off the wire as whole messages: a plain ``received`` row (or a
    ``rejected`` one: an update it refused, late or invalid, with its header), or the ``message``
    row of a reassembled chunked transfer."""
    return [r for r in rows if r["side"] == "server" and r["kind"] == "update" and r["seq"] is not None
            and ((r["event"] in ("received", "rejected") and r["transfer_id"] is None)
                 or (r["event"] == "message" and r["transfer_id"] is not None))]


def account(run_dir: Path, rec: Recorder, rounds_completed: int, agents: list[AgentSummary], *,
            extra_ledgers: tuple[Path, ...] = ()) -> Accounting:
    """The accounting of a finished in-process run (see the module docstring)."""
    metrics = read_metrics(run_dir)
    rows = ledger_rows(run_dir / "ledger.sqlite", *extra_ledgers)
    srv = rec.server
    reported = {m["round"]: m["clients_reported"] for m in metrics}
    skipped = {m["round"]: bool(m["skipped"]) for m in metrics}
    counted = {r: list(rec.counted.get(r, [])) for r in reported}
    acked = {r: set(rec.acked.get(r, set())) for r in reported}
    lost, in_skipped, double, unacked, wrong = [], [], [], [], []
    rejected = {(c, r): reason for c, r, _, ok, reason in rec.answers if not ok}
    for r in reported:
        cset = set(counted[r])
        for c, n in Counter(counted[r]).items():
            if n > 1:
                double.append((r, c))
        for c in sorted(acked[r] - cset):
            lost.append((r, c))
        for c in sorted(acked[r] & cset):
            if skipped[r]:
                in_skipped.append((r, c))
        for c in sorted(cset - acked[r]):
            unacked.append((r, c))
            if (c, r) in rejected:
                wrong.append((r, c, rejected[(c, r)]))
    deliveries = len(server_update_deliveries(rows))
    t = srv.totals
    accounted = sum(len(v) for v in counted.values()) + t["duplicates"] + t["late"] + t["unsolicited"] \
        + t["rejected_invalid"] + t["early"]
    per_agent = Counter(c for r in acked for c in acked[r])
    summaries_mismatch = [f"{s.client_id}: receipts_accepted {s.receipts_accepted} != acked rounds "
                          f"{per_agent.get(s.client_id, 0)}" for s in agents
                          if s.receipts_accepted != per_agent.get(s.client_id, 0)]
    return Accounting(rounds=[m["round"] for m in metrics], rounds_completed=rounds_completed, counted=counted,
                      acked=acked, reported=reported, skipped=skipped, lost=lost, acked_in_skipped_rounds=in_skipped,
                      double=double, counted_unacked=unacked, wrongly_rejected=wrong, deliveries=deliveries,
                      accounted=accounted, duplicates=t["duplicates"], late=t["late"],
                      ledger_mismatches=ledger_mismatches(rows), summaries_mismatch=summaries_mismatch,
                      extra={"stray_deliveries": stray_deliveries(rows)})


def assert_accounting(acc: Accounting, rounds: int, *, strict: bool = True) -> None:
    """The invariants every scenario ends with.

    ``strict``: also every aggregated update was acknowledged to its agent. Scenarios where a
    receipt can be lost in flight (broker restart, cut connections) leave that out: an agent whose
    receipt was lost re-sends after its round closed and the server then answers "round closed"
    (``test_counted_update_resent_after_its_round_closed_is_acknowledged``), or it has moved on to
    the next round. They still assert the converse, which is what matters for the model: nothing
    acknowledged was left out, nothing was aggregated twice.
    """
    assert acc.rounds_completed == rounds
    assert acc.rounds == list(range(1, rounds + 1)), acc.rounds
    for r in acc.rounds:
        assert len(set(acc.counted[r])) == acc.reported[r], (r, acc.counted[r], acc.reported[r])
    assert acc.lost == [], f"acknowledged updates left out of the aggregate: {acc.lost}"
    assert acc.double == [], f"updates aggregated twice: {acc.double}"
    assert acc.deliveries == acc.accounted, (acc.deliveries, acc.accounted)
    assert acc.ledger_mismatches == [], acc.ledger_mismatches[:10]
    assert acc.summaries_mismatch == [], acc.summaries_mismatch
    if strict:
        assert acc.counted_unacked == [], acc.counted_unacked


# ============================================================================ relays


class FaultyRelay:
    """TCP relay 127.0.0.1:port → broker that breaks connections on purpose.

    ``cuts``: ``{client-id suffix: (direction, nbytes)}``: the first connection of a client whose
    MQTT client id ends with the suffix is closed after ``nbytes`` bytes in ``direction`` (``"up"``
    client→broker, ``"down"`` broker→client), mid-packet: the peer sees a truncated packet and
    EOF, as after a network failure. Each cut happens once; the reconnection is relayed intact.
    ``gate``: while cleared, connections are accepted and closed at once (a link that is down).
    """

    def __init__(self, target_port: int, cuts: dict[str, tuple[str, int]] | None = None) -> None:
        self.target = ("127.0.0.1", target_port)
        self.cuts = dict(cuts or {})
        self.done: list[tuple[str, str, int]] = []   # (client id, direction, bytes) of cuts made
        self.connections: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(0.2)
        self.port = self.srv.getsockname()[1]
        self.lock = threading.Lock()
        self.socks: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="faulty-relay", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self.gate.is_set():
                c.close()
                continue
            try:
                b = socket.create_connection(self.target, timeout=2)
                b.settimeout(None)
            except OSError:
                c.close()
                continue
            c.settimeout(None)
            with self.lock:
                self.socks += [c, b]
            t = threading.Thread(target=self._serve, args=(c, b), daemon=True)
            t.start()
            self.threads.append(t)

    def _serve(self, c: socket.socket, b: socket.socket) -> None:
        first = bytearray()
        cid = None
        c.settimeout(5)
        try:
            for _ in range(64):  # the CONNECT packet, before anything is relayed
                data = c.recv(65536)
                if not data:
                    break
                first += data
                cid = connect_client_id(bytes(first))
                if cid is not None:
                    break
        except OSError:
            pass
        c.settimeout(None)
        if cid is None:
            self._close(c, b)
            return
        cut = None
        with self.lock:
            self.connections.append(cid)
            for suffix, plan in list(self.cuts.items()):
                if cid.endswith(suffix):
                    cut = (suffix, plan)
                    del self.cuts[suffix]
                    break
        up_limit = cut[1][1] if cut and cut[1][0] == "up" else None
        down_limit = cut[1][1] if cut and cut[1][0] == "down" else None
        cuts_before = len(self.done)
        t = threading.Thread(target=self._pump, args=(cid, b, c, "down", down_limit, b""), daemon=True)
        t.start()
        self.threads.append(t)
        self._pump(cid, c, b, "up", up_limit, bytes(first))
        t.join(5)
        if cut is not None:
            with self.lock:  # the connection ended before its cut (a refused MQTT 5 CONNECT): cut the next one
                if not any(d[0] == cid for d in self.done[cuts_before:]) and not self._stop.is_set():
                    self.cuts.setdefault(cut[0], cut[1])

    def _pump(self, cid: str, src: socket.socket, dst: socket.socket, direction: str, limit: int | None,
              initial: bytes) -> None:
        n = 0
        try:
            data = initial
            while True:
                if data:
                    if limit is not None and n + len(data) >= limit:
                        dst.sendall(data[:max(0, limit - n)])
                        with self.lock:
                            self.done.append((cid, direction, limit))
                        break
                    dst.sendall(data)
                    n += len(data)
                data = src.recv(65536)
                if not data:
                    break
        except OSError:
            pass
        finally:
            self._close(src, dst)

    @staticmethod
    def _close(*socks: socket.socket) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        try:
            self.srv.close()
        except OSError:
            pass
        self._acceptor.join(timeout=5)
        with self.lock:
            socks = list(self.socks)
        self._close(*socks)
        for t in self.threads:
            t.join(timeout=5)


class Republisher:
    """A rogue MQTT client on ``up/+/update``: re-publishes the first update it sees in each round
    (same topic, same bytes), as a QoS 1 redelivery would. ``after``: only from that round on."""

    def __init__(self, host: str, port: int, federation: str) -> None:
        self.injected: list[tuple[str, int, int]] = []  # (sender, round, seq)
        self._rounds: set[int] = set()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        c = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id=f"rogue-{time.time_ns()}")
        flt = f"fedfleet/v1/{federation}/up/+/update"
        c.on_connect = lambda cl, *_: cl.subscribe(flt, qos=1)
        c.on_subscribe = lambda *_: self._ready.set()
        c.on_message = self._on_message
        c.connect(host, port)
        c.loop_start()
        if not self._ready.wait(10):
            c.loop_stop()
            raise RuntimeError("rogue client did not subscribe")
        self.client = c

    def _on_message(self, client, userdata, msg) -> None:
        if msg.retain or not msg.payload:
            return
        env = decode(bytes(msg.payload)).envelope
        if isinstance(env.body, Chunk):
            return
        with self._lock:
            if env.round in self._rounds:
                return
            self._rounds.add(env.round)
            self.injected.append((env.sender, env.round, env.seq))
        client.publish(msg.topic, bytes(msg.payload), qos=1)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def processes_mentioning(text: str) -> list[int]:
    """Pids (other than this one) whose command line contains ``text`` (Linux /proc)."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if text in cmd:
            found.append(int(p.name))
    return found


# ============================================================================ scenario drivers


def _simulate(cfg, run_dir: Path, rec: Recorder, **kw):
    with rec.installed():
        return simulate_mod.simulate(cfg, run_dir=run_dir, **kw)


def run_broker_restart(kind: str, tmp: Path, *, rounds: int = 4) -> tuple[Accounting, object]:
    """Scenario 1: SIGKILL the broker 0.3 s into round 2, restart it on the same port 2 s later.

    client-002 finishes its round-2 training only once the broker is dead, so at least one update
    is published while the link is down (paho queues it and re-sends it after the reconnect). The
    20 s deadline leaves slack for a loaded CI host (10 s once missed a client after recovery)."""
    cfg = chaos_config(run={"rounds": rounds}, server={"round_deadline_s": 20.0}, broker={"kind": kind})
    rec = Recorder()
    round_done: dict[int, float] = {}
    chaos: dict = {}
    r1, killed = threading.Event(), threading.Event()

    def on_round(m: dict) -> None:
        round_done[m["round"]] = time.monotonic()
        if m["round"] == 1:
            r1.set()

    def hook(i: int, agent: EdgeAgent) -> None:
        agent.receipt_timeout_s = 4.0  # re-send an unacknowledged update after 4 s (default 10)
        if i != 2:
            return
        real = agent.algorithm.local_round

        def train_through_the_crash(*args, **kwargs):
            if kwargs.get("round") == 2:
                killed.wait(60)
            return real(*args, **kwargs)

        agent.algorithm.local_round = train_through_the_crash

    broker = EmbeddedBroker(kind=kind, workdir=tmp / "broker").start()

    def break_it() -> None:
        if not r1.wait(120):
            return
        time.sleep(0.3)
        chaos["open_round"] = max(round_done) + 1
        chaos["t_kill"] = time.monotonic()
        broker.kill()
        killed.set()
        time.sleep(2.0)
        broker.restart()
        chaos["t_restart"] = time.monotonic()
        links = [a.channel.transport for a in rec.agents] + [s.channel.transport for s in rec.servers]
        if wait_until(lambda: all(t.connects >= 2 for t in links), 30):
            chaos["t_all_back"] = time.monotonic()

    t = threading.Thread(target=break_it, name="chaos", daemon=True)
    t.start()
    try:
        res = _simulate(cfg, tmp / "run", rec, broker_url=broker.url, on_round=on_round, agent_hook=rec.hook(hook))
    finally:
        killed.set()
        t.join(timeout=60)
        broker.stop()
    acc = account(res.run_dir, rec, res.rounds_completed, res.agents)
    back = chaos.get("t_all_back", float("inf"))
    summary = json.loads((res.run_dir / "summary.json").read_text())
    acc.extra.update(open_round=chaos.get("open_round"), resyncs=rec.server.resyncs,
                     server_connects=rec.server.channel.transport.connects,
                     links_back=chaos.get("t_all_back") is not None,
                     # rounds that started (= the previous round ended) after every link was back
                     rounds_after_recovery=[r for r in range(2, rounds + 1) if round_done.get(r - 1, 0) > back],
                     resends=sum(a.resends for a in rec.agents), agent_errors=summary["agent_errors"],
                     final_accuracy=res.final_accuracy)
    return acc, res


def run_agent_dies_mid_upload(tmp: Path, *, rounds: int = 2, monkeypatch=None) -> tuple[Accounting, object]:
    """Scenario 2: client-002 loses power after half of its round-1 update's chunks went out.

    Round 1 closes at its deadline (the dead client was selected), so the deadline is most of the
    test's time: 10 s leaves the two live clients (one local epoch on ~600 digits, about a second)
    and the 2 s transfer expiry ample room."""
    cfg = chaos_config(run={"rounds": rounds}, server={"round_deadline_s": 10.0}, protocol={"chunk_bytes": 4096})
    rec = Recorder()
    state: dict = {"published": 0, "count": None, "dead": False}
    import broker_server.runtime as runtime_mod

    orig_opts = runtime_mod.channel_options

    def server_channel_options(c):  # the server's channel only (simulate holds its own reference)
        return {**orig_opts(c), "transfer_ttl_s": 2.0, "resend_after_s": 1.0}

    def hook(i: int, agent: EdgeAgent) -> None:
        if i != 2:
            return
        tr = agent.channel.transport
        real = tr.publish

        def publish(topic, payload, **kw):
            if state["dead"]:
                return  # a dead device sends nothing
            body = decode(payload).envelope.body if topic.endswith("/update") else None
            real(topic, payload, **kw)
            if isinstance(body, Chunk):
                state["count"] = body.count
                state["published"] += 1
                if state["published"] >= body.count // 2:
                    state["dead"] = True
                    # the device dies once its socket has taken the chunks published so far (abort() closes
                    # the socket at once: what is still in paho's queue never goes out, as at a power loss)
                    assert wait_for(lambda: not tr._client._out_packet, 10.0)
                    tr.abort()
                    agent.stop()

        tr.publish = publish

    runtime_mod.channel_options = server_channel_options
    try:
        t0 = time.monotonic()
        res = _simulate(cfg, tmp / "run", rec, agent_hook=rec.hook(hook))
        seconds = time.monotonic() - t0
    finally:
        runtime_mod.channel_options = orig_opts
    acc = account(res.run_dir, rec, res.rounds_completed, res.agents)
    ch = rec.server.channel
    rows = ledger_rows(res.run_dir / "ledger.sqlite")
    acc.extra.update(chunks=state["count"], chunks_published=state["published"],
                     incomplete_transfers=ch.incomplete_transfers, reassembler_expired=ch.reassembler.expired,
                     buffered_after=ch.reassembler.buffered_bytes, seconds=seconds,
                     incomplete_rows=[r["reason"] for r in rows if r["kind"] == "incomplete"],
                     dead_chunks_received=sum(1 for r in rows if r["side"] == "server" and r["event"] == "received"
                                              and r["sender"] == "client-002" and r["kind"] == "update"),
                     final_accuracy=res.final_accuracy)
    return acc, res


def run_faulty_relay(kind: str, tmp: Path, *, rounds: int = 3, seed: int = 7) -> tuple[Accounting, object]:
    """Scenario 3: every connection cut once at a random byte offset by a relay, and a rogue
    client re-publishing one update per round."""
    rng = random.Random(seed)
    cuts = {"client-000": ("up", rng.randrange(2_000, 50_000)),     # mid its round-1 update
            "client-002": ("up", rng.randrange(2_000, 50_000)),     # mid its round-1 update
            "client-001": ("down", rng.randrange(60_000, 110_000)),  # mid the round-2 global download
            "server": ("down", rng.randrange(60_000, 170_000))}     # mid an update delivery to the server
    cfg = chaos_config(run={"rounds": rounds}, server={"round_deadline_s": 10.0}, broker={"kind": kind})
    rec = Recorder()

    def speedy(i: int, agent: EdgeAgent) -> None:
        agent.receipt_timeout_s = 4.0

    run_dir = tmp / "relay-run"
    with EmbeddedBroker(kind=kind, workdir=tmp / "broker") as broker:
        relay = FaultyRelay(broker.port, cuts)
        rogue = Republisher(broker.host, broker.port, run_dir.name)
        try:
            res = _simulate(cfg, run_dir, rec, broker_url=f"mqtt://127.0.0.1:{relay.port}",
                            agent_hook=rec.hook(speedy))
            time.sleep(0.3)
        finally:
            rogue.close()
            relay.close()
    acc = account(res.run_dir, rec, res.rounds_completed, res.agents)
    rows = ledger_rows(res.run_dir / "ledger.sqlite")
    deliveries = Counter((r["sender"], r["seq"]) for r in server_update_deliveries(rows))
    acc.extra.update(cuts=list(relay.done), connections=Counter(relay.connections),
                     injected=list(rogue.injected),
                     injected_delivered_twice=sum(1 for s, _, q in rogue.injected if deliveries[(s, q)] >= 2),
                     dup_publishes=sum(1 for r in rows if r["kind"] == "PUBLISH-DUP"),
                     resends=sum(a.resends for a in rec.agents), resyncs=rec.server.resyncs,
                     final_accuracy=res.final_accuracy)
    return acc, res


RESUME_TOML = """\
[run]
name = "resume"
seed = 0
rounds = {rounds}
out = "{out}"

[data]
dataset = "digits"
partition = "dirichlet"
alpha = 1.0
clients = 3

[train]
algorithm = "fedavg"
local_epochs = 1
batch_size = 16
lr = 0.05
momentum = 0.5

[server]
quorum = 2
round_deadline_s = 60.0
join_timeout_s = 60.0
"""


def _cli(args: list[str], log: Path, cwd: Path) -> subprocess.Popen:
    fh = open(log, "wb")
    try:
        return subprocess.Popen([sys.executable, "-m", "broker_server.cli", *args], cwd=cwd, stdout=fh,
                                stderr=subprocess.STDOUT, env={**os.environ, "FEDFLEET_OFFLINE": "1"})
    finally:
        fh.close()


def run_kill_server_and_resume(tmp: Path, *, rounds: int = 5, kill_after: int = 2) -> dict:
    """Scenario 4: ``fedfleet simulate`` (a subprocess) SIGKILLed once its checkpoint store has
    round 2, then ``simulate(cfg, run_dir=RUN, resume=True)`` in this process; compared with an
    uninterrupted in-process run of the same configuration and seed."""
    toml = tmp / "resume.toml"
    toml.write_text(RESUME_TOML.format(rounds=rounds, out=tmp / "runs"))
    cfg = config_mod.load(toml)
    run, ref = tmp / "crashed", tmp / "reference"
    out: dict = {}
    p = _cli(["simulate", "--config", str(toml), "--out", str(run), "-q"], tmp / "crashed.log", REPO)
    try:
        if not wait_until(lambda: checkpoint_round(run / "checkpoints.sqlite") >= kill_after or p.poll() is not None,
                          240, 0.05):
            raise AssertionError("the run never reached its checkpoint of round 2")
        assert p.poll() is None, (tmp / "crashed.log").read_text()[-3000:]
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        out["killed_at_round"] = checkpoint_round(run / "checkpoints.sqlite")
        out["metrics_lines_at_kill"] = len(read_metrics(run)) if (run / "metrics.jsonl").exists() else 0
        # the embedded broker's watchdog must stop the broker of the dead parent
        out["broker_gone"] = wait_until(lambda: not processes_mentioning(str(run)), 15, 0.1)
        out["orphans"] = processes_mentioning(str(run))
        t_resume = time.time()
        res = simulate_mod.simulate(cfg, run_dir=run, resume=True)
        out["resumed_seconds"] = time.time() - t_resume
        out["resumed_accuracy"] = res.final_accuracy
        out["rounds_completed"] = res.rounds_completed
        ref_res = simulate_mod.simulate(cfg, run_dir=ref)
        out["reference_accuracy"] = ref_res.final_accuracy
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
        for pid in processes_mentioning(str(tmp)):  # never leave a broker behind, whatever failed
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    out["orphans_after"] = processes_mentioning(str(tmp))
    out["log"] = (tmp / "crashed.log").read_text()[-2000:]
    m = read_metrics(run)
    out["metrics_rounds"] = [x["round"] for x in m]
    out["reported"] = [x["clients_reported"] for x in m]
    out["agent_errors"] = json.loads((run / "summary.json").read_text())["agent_errors"]
    rows = ledger_rows(run / "ledger.sqlite", since=t_resume)
    out["ledger_mismatches"] = ledger_mismatches(rows)
    # the resumed session: each round's clients_reported = distinct senders the server took an update from
    got = defaultdict(set)
    for r in server_update_deliveries(rows):
        got[r["round"]].add(r["sender"])
    out["resumed_rounds_deliveries"] = {r: len(got[r]) for r in sorted(got)}
    out["resumed_rounds"] = sorted(got)
    return out


def run_join_mid_run(tmp: Path, *, rounds: int = 3) -> tuple[Accounting, object]:
    """Scenario 5: a fourth device joins after round 1 (built as simulate builds its agents).

    It is started from ``on_round`` after round 1, which returns once the broker acknowledged its
    ``join``: round 2's clients are chosen before the server reads it, so it is first asked in
    round 3."""
    cfg = chaos_config(run={"rounds": rounds})
    rec = Recorder()
    run_dir = tmp / "join-run"
    fed = run_dir.name
    extra_ledger_path = tmp / "extra-ledger.sqlite"
    box: dict = {}

    with EmbeddedBroker(kind="amqtt", workdir=tmp / "broker") as broker:
        url = broker.url

        def newcomer() -> None:
            cid = "client-003"
            ledger = Ledger(extra_ledger_path)
            tr = None
            try:
                ds = load_dataset(cfg.data.dataset)
                idx = simulate_mod.split_clients(ds, cfg)[0]  # the device holds a copy of shard 0
                will = encode(Envelope(round=0, sender=cid, seq=0, body=Status("offline", "connection lost"))).payload
                tr = open_transport(topics.mqtt_client_id(fed, cid), cfg, url,
                                    will=Will(topics.status(fed, cid), will, qos=1, retain=True))
                tr.connect()
                ch = Channel(tr, node_id=cid, side="agent", federation=fed, ledger=ledger, **channel_options(cfg))
                agent = EdgeAgent(
                    channel=ch, model=device_model(ds, cfg.run.seed + 10),
                    algorithm=get_client_algorithm(cfg.train.algorithm), x=ds.train.x[idx], y=ds.train.y[idx],
                    num_classes=ds.num_classes, client_index=3, idle_timeout_s=120,
                    train_defaults=TrainConfig(local_epochs=cfg.train.local_epochs, batch_size=cfg.train.batch_size,
                                               lr=cfg.train.lr, momentum=cfg.train.momentum, seed=cfg.run.seed),
                    info={"virtual": True, **expected_data(cfg)})
                rec.attach(agent)
                box["agent"] = agent
                box["summary"] = agent.run()
            except BaseException as exc:  # reported by the test
                box["error"] = exc
            finally:
                if tr is not None:
                    tr.close()
                ledger.close()

        thread = threading.Thread(target=newcomer, name="newcomer", daemon=True)

        def on_round(m: dict) -> None:
            if m["round"] == 1:
                thread.start()
                wait_until(lambda: "error" in box or ("agent" in box and box["agent"]._join_seq > 0), 60)

        try:
            res = _simulate(cfg, run_dir, rec, broker_url=url, on_round=on_round, agent_hook=rec.hook())
        finally:
            if "agent" in box:
                box["agent"].stop()
            if thread.ident is not None:
                thread.join(timeout=30)
    summaries = list(res.agents) + ([box["summary"]] if "summary" in box else [])
    acc = account(res.run_dir, rec, res.rounds_completed, summaries, extra_ledgers=(extra_ledger_path,))
    m = read_metrics(run_dir)
    acc.extra.update(selected=[x["clients_selected"] for x in m], newcomer_rounds=sorted(
        r for r, cs in acc.counted.items() if "client-003" in cs), newcomer_error=repr(box.get("error")),
        newcomer_summary=box.get("summary"), final_accuracy=res.final_accuracy)
    return acc, res


def run_offline_buffer(kind: str, tmp: Path, *, limit: int = 5) -> dict:
    """Scenario 6: a bounded offline buffer across a broker crash (through a gated relay, so the
    subscriber is back before the publisher's link). Exceptions are recorded, not raised."""
    out: dict = {"errors": []}
    topic = "fedfleet/v1/buf/up/client-000/update"
    got: list[bytes] = []
    lock = threading.Lock()

    def attempt(what: str, fn):
        try:
            return fn()
        except OfflineBufferFull:
            raise
        except Exception as exc:  # recorded: the test says what should have happened
            out["errors"].append(f"{what}: {exc!r}")
            return None

    with EmbeddedBroker(kind=kind, workdir=tmp / "broker") as broker:
        relay = FaultyRelay(broker.port)
        pub = MqttTransport(f"buf-pub-{time.time_ns()}", "127.0.0.1", relay.port, max_buffered_messages=limit,
                            keepalive_s=5)
        sub = None
        try:
            pub.connect()
            relay.gate.clear()
            broker.kill()
            out["disconnected"] = wait_until(lambda: not pub.connected, 10)
            payloads = [f"message {i}".encode() * 10 for i in range(limit + 1)]
            out["accepted_while_down"] = 0
            for i, p in enumerate(payloads[:limit]):
                try:
                    if attempt(f"publish {i + 1} while down", lambda p=p: pub.publish(topic, p, qos=1) or True):
                        out["accepted_while_down"] += 1
                except OfflineBufferFull as exc:
                    out["errors"].append(f"publish {i + 1} while down: {exc!r}")
            out["buffered_before"] = attempt("buffered", lambda: pub.buffered)
            try:
                attempt(f"publish {limit + 1} while down", lambda: pub.publish(topic, payloads[limit], qos=1))
                out["overflow_raised"] = False
            except OfflineBufferFull as exc:
                out["overflow_raised"] = True
                out["overflow_message"] = str(exc)
            out["buffered_after_refusal"] = attempt("buffered", lambda: pub.buffered)
            broker.restart()
            sub = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
                              client_id=f"buf-sub-{time.time_ns()}")
            ready = threading.Event()

            def on_message(c, u, msg):
                with lock:
                    got.append(bytes(msg.payload))

            sub.on_connect = lambda cl, *_: cl.subscribe(topic, qos=1)
            sub.on_subscribe = lambda *_: ready.set()
            sub.on_message = on_message
            sub.connect(broker.host, broker.port)
            sub.loop_start()
            out["subscribed"] = ready.wait(10)
            relay.gate.set()  # the publisher's link comes back
            out["reconnected"] = pub.wait_connected(20)
            wait_until(lambda: len(got) >= out["accepted_while_down"], 20, 0.1)
            time.sleep(0.5)  # nothing more may arrive
            # the last PUBACKs on their way back through the relay free the last slots
            out["drained"] = wait_until(lambda: attempt("buffered", lambda: pub.buffered[0] == 0), 20, 0.05)
            out["buffered_final"] = attempt("buffered", lambda: pub.buffered)
            with lock:
                out["received"] = list(got)
            out["expected"] = payloads[:limit]
            out["refused_payload_delivered"] = payloads[limit] in out["received"]
            out["publisher_connects"] = pub.connects
        finally:
            if sub is not None:
                sub.disconnect()
                sub.loop_stop()
            pub.close()
            relay.close()
    return out


def run_slow_device(tmp: Path, *, rounds: int = 2, sleep_s: float = 8.0) -> tuple[Accounting, object]:
    """Scenario 7: keepalive 5 s; client-001 trains for 8 s more in round 1 (deadline 30 s)."""
    cfg = chaos_config(run={"rounds": rounds}, server={"round_deadline_s": 30.0}, broker={"keepalive_s": 5})
    rec = Recorder()
    slept: list[float] = []

    def hook(i: int, agent: EdgeAgent) -> None:
        if i != 1:
            return
        real = agent.algorithm.local_round

        def slow(*args, **kwargs):
            if kwargs.get("round") == 1:
                t0 = time.monotonic()
                time.sleep(sleep_s)
                slept.append(time.monotonic() - t0)
            return real(*args, **kwargs)

        agent.algorithm.local_round = slow

    res = _simulate(cfg, tmp / "run", rec, agent_hook=rec.hook(hook))
    acc = account(res.run_dir, rec, res.rounds_completed, res.agents)
    rows = ledger_rows(res.run_dir / "ledger.sqlite")
    connects = Counter(r["node"] for r in rows if r["kind"] == "CONNECT")
    pings = Counter(r["node"] for r in rows if r["kind"] == "PINGREQ")
    acc.extra.update(slept=slept, connects=dict(connects), pings=dict(pings),
                     round1_seconds=read_metrics(res.run_dir)[0]["seconds"], final_accuracy=res.final_accuracy)
    return acc, res


# ============================================================================ the tests


_RESTART_RUNS: dict[str, tuple[Accounting, object]] = {}


@pytest.fixture(params=[pytest.param("mosquitto", marks=pytest.mark.mosquitto), "amqtt"])
def broker_restart_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Scenario 1, run once per broker kind and shared by the two tests below."""
    kind = request.param
    if kind == "mosquitto":
        from helpers.brokers import require_mosquitto

        require_mosquitto()
    if kind not in _RESTART_RUNS:
        _RESTART_RUNS[kind] = run_broker_restart(kind, tmp_path_factory.mktemp(f"restart-{kind}"))
    return _RESTART_RUNS[kind]


def test_broker_killed_mid_round_nothing_acknowledged_is_lost(broker_restart_run) -> None:
    acc, res = broker_restart_run
    x = acc.extra
    assert x["server_connects"] >= 2, "the server never saw the broker go"
    # the run finished, no acknowledged update was left out, none aggregated twice, the ledger
    # matches what the broker delivered
    assert_accounting(acc, 4, strict=False)
    # the round open at the kill: an agent left out of it was never told 'accepted'
    r = x["open_round"]
    assert r is not None
    for c in ("client-000", "client-001", "client-002"):
        if c not in acc.counted[r]:
            assert c not in acc.acked[r]


def test_broker_killed_mid_round_fleet_recovers(broker_restart_run) -> None:
    """client-002 published its update during the outage: it must survive that (before 117aa66 it
    died at its next publish, RuntimeError from ``MqttTransport._prune``), and every round that
    starts once all links are back has all three clients."""
    acc, res = broker_restart_run
    x = acc.extra
    assert x["agent_errors"] == [], x["agent_errors"]
    assert x["links_back"], "not every link came back within 30 s of the restart"
    assert x["rounds_after_recovery"] and 4 in x["rounds_after_recovery"], x
    for r in x["rounds_after_recovery"]:
        assert acc.reported[r] == 3 and not acc.skipped[r], (r, read_metrics(res.run_dir))
    assert_accounting(acc, 4, strict=False)


def test_agent_killed_mid_upload(tmp_path: Path) -> None:
    acc, res = run_agent_dies_mid_upload(tmp_path)
    x = acc.extra
    assert x["chunks"] and x["chunks"] >= 10, x  # the 55 KB update went as ~14 chunks of 4 KiB
    assert x["chunks_published"] == x["chunks"] // 2
    assert_accounting(acc, 2)
    m = read_metrics(res.run_dir)
    # round 1 closed at the deadline with the two others (quorum 2): aggregated, not skipped
    assert m[0]["clients_selected"] == 3 and m[0]["clients_reported"] == 2 and not m[0]["skipped"]
    assert sorted(acc.counted[1]) == ["client-000", "client-001"]
    # the dead agent's last will took it out of round 2
    assert m[1]["clients_selected"] == 2 and m[1]["clients_reported"] == 2
    # no partial update: its chunks arrived (some), no whole update, the transfer expired and was reported
    assert 0 < x["dead_chunks_received"] < x["chunks"]
    assert all("client-002" not in cs for cs in acc.counted.values())
    assert x["incomplete_transfers"] == 1 and x["reassembler_expired"] >= 1
    assert x["buffered_after"] == 0
    assert len(x["incomplete_rows"]) == 1 and f"/{x['chunks']} chunks" in x["incomplete_rows"][0]


@pytest.mark.parametrize("kind", [pytest.param("mosquitto", marks=pytest.mark.mosquitto), "amqtt"])
def test_faulty_relay_cuts_connections_and_duplicates_are_counted_once(kind: str, tmp_path: Path) -> None:
    if kind == "mosquitto":
        from helpers.brokers import require_mosquitto

        require_mosquitto()
    acc, res = run_faulty_relay(kind, tmp_path)
    x = acc.extra
    assert len(x["cuts"]) == 4, x["cuts"]  # every planned cut happened
    assert all(n >= 2 for n in x["connections"].values()), x["connections"]  # and paho reconnected
    assert_accounting(acc, 3, strict=False)
    # the rogue re-publications reached the server and were not aggregated again
    assert len(x["injected"]) == 3
    assert x["injected_delivered_twice"] >= 1
    assert acc.duplicates + acc.late >= x["injected_delivered_twice"]
    for sender, rnd, _ in x["injected"]:
        assert acc.counted[rnd].count(sender) <= 1


def test_server_killed_and_resumed(tmp_path: Path) -> None:
    out = run_kill_server_and_resume(tmp_path)
    assert out["killed_at_round"] in (2, 3, 4), out["log"]
    assert out["broker_gone"], f"broker of the killed run still alive: {out['orphans']}"
    assert out["orphans_after"] == []
    assert out["metrics_rounds"] == [1, 2, 3, 4, 5]  # each round exactly once
    assert out["rounds_completed"] == 5 and out["agent_errors"] == []
    assert out["resumed_rounds"] == list(range(out["killed_at_round"] + 1, 6))
    m_reported = dict(zip(out["metrics_rounds"], out["reported"]))
    for r, n in out["resumed_rounds_deliveries"].items():
        assert m_reported[r] == n == 3
    assert out["ledger_mismatches"] == [], out["ledger_mismatches"][:10]
    assert abs(out["resumed_accuracy"] - out["reference_accuracy"]) <= 0.02, out


def test_device_joins_mid_run(tmp_path: Path) -> None:
    acc, res = run_join_mid_run(tmp_path)
    x = acc.extra
    assert x["newcomer_error"] == "None"
    assert x["selected"] == [3, 3, 4], x["selected"]
    assert x["newcomer_rounds"] == [3]
    assert x["newcomer_summary"].finished and x["newcomer_summary"].receipts_accepted == 1
    assert_accounting(acc, 3)


@pytest.mark.parametrize("kind", [pytest.param("mosquitto", marks=pytest.mark.mosquitto), "amqtt"])
def test_offline_buffer_is_bounded_and_drains(kind: str, tmp_path: Path) -> None:
    """While the broker is gone, publishes fill the bounded offline buffer (no error before it is
    full, ``OfflineBufferFull`` after); once the broker is back, every queued message is delivered,
    its slot freed, and ``publish(wait_s=...)`` of it returns."""
    if kind == "mosquitto":
        from helpers.brokers import require_mosquitto

        require_mosquitto()
    out = run_offline_buffer(kind, tmp_path)
    assert out["disconnected"]
    assert out["errors"] == [], out["errors"]
    assert out["accepted_while_down"] == 5
    assert out["buffered_before"][0] == 5
    assert out["overflow_raised"], "the 6th message was queued silently"
    assert out["buffered_after_refusal"] == out["buffered_before"]
    assert out["subscribed"] and out["reconnected"] and out["drained"], out
    assert sorted(out["received"]) == sorted(out["expected"])  # all 5, each once
    assert not out["refused_payload_delivered"]
    assert out["buffered_final"] == (0, 0)


def test_message_sent_after_an_outage_frees_its_buffer_slot(tmp_path: Path) -> None:
    """One QoS 1 publish while the broker is down; the broker comes back, paho re-sends it and its
    PUBACK arrives: the transport then forgets it (its offline-buffer slot is free), although
    paho keeps ``rc=MQTT_ERR_NO_CONN`` on such a message's ``MQTTMessageInfo`` (whose
    ``is_published()`` then raises)."""
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        tr = MqttTransport(f"outage-{time.time_ns()}", broker.host, broker.port)
        tr.connect()
        try:
            broker.kill()
            assert wait_until(lambda: not tr.connected, 10)
            tr.publish("fedfleet/v1/x/up/c/update", b"during the outage", qos=1)  # accepted: queued by paho
            broker.restart()
            assert tr.wait_connected(20)
            assert wait_until(lambda: tr._client._out_messages == {}, 10)  # paho re-sent it, PUBACK came
            tr.publish("fedfleet/v1/x/up/c/update", b"after the outage", qos=1)
            assert wait_until(lambda: tr.buffered == (0, 0), 5), f"still buffered: {tr.buffered}"
        finally:
            tr.close()


def test_slow_device_stays_connected_past_keepalive(tmp_path: Path) -> None:
    acc, res = run_slow_device(tmp_path)
    x = acc.extra
    assert x["slept"] and x["slept"][0] >= 8.0 - 0.05
    assert x["connects"].get("client-001") == 1, x["connects"]  # never reconnected
    assert x["pings"].get("client-001", 0) >= 1  # keepalive ran while it trained
    assert "client-001" in acc.counted[1] and "client-001" in acc.acked[1]
    assert_accounting(acc, 2)


def test_retransmission_after_a_reconnect_is_ledgered(tmp_path: Path) -> None:
    """A 55 KB update is cut off mid-PUBLISH by the relay; paho reconnects and sends the PUBLISH
    again (DUP set on the wire). The ledger must show that second copy as a PUBLISH-DUP row."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        relay = FaultyRelay(broker.port, {"dup-agent": ("up", 20_000)})
        # amqtt speaks MQTT 3.1.1 only: chosen up front, so the spy below hooks the client that connects
        tr = MqttTransport("dup-agent", "127.0.0.1", relay.port, mqtt_version="3.1.1")
        wire: list[tuple[int, int]] = []  # (first byte, size) of every PUBLISH paho queued
        real_queue = tr._client._packet_queue

        def spy_queue(command, packet, mid, qos, info=None):
            if command >> 4 == 3:
                wire.append((packet[0], len(packet)))
            return real_queue(command, packet, mid, qos, info)

        tr._client._packet_queue = spy_queue
        try:
            tr.connect()
            ch = Channel(tr, node_id="client-000", side="agent", federation="dup", ledger=ledger)
            rng = np.random.default_rng(0)
            upd = Update(tensors=(rng.standard_normal(13_700).astype(np.float32),), num_samples=1, train_loss=0.1)
            ch.send(topics.up("dup", "client-000", Kind.UPDATE), upd, round=1)
            assert wait_until(lambda: tr.connects >= 2 and not tr._client._out_messages, 20), "no re-send"
        finally:
            tr.close()
            relay.close()
    ledger.flush()
    dup_on_wire = [n for b, n in wire if b & 0x08]
    assert relay.done and dup_on_wire, wire  # paho did re-send the PUBLISH, with DUP set
    rows = ledger.rows("kind='PUBLISH-DUP'")
    ledger.close()
    assert [r.mqtt_header_bytes for r in rows] == dup_on_wire
