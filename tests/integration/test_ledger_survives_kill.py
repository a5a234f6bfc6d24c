"""Ledgers that survive a crash, over real processes and a real broker.

A counting relay (a subscriber of the federation's topics, in this test process) knows
independently which messages a device published: ``(sender, kind, seq)`` of every delivery. The
device is a real ``fedfleet-agent`` (idle: no server answers it) or a small process that publishes
``status`` messages through the real Channel, MqttTransport and Ledger as fast as the broker
acknowledges them. It is then killed with SIGKILL or stopped with SIGTERM, and its ledger's
``sent`` rows are compared with what the relay counted. No timing is asserted: every wait is a
bounded loop on a condition.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from broker_server.embedded_broker import EmbeddedBroker, mosquitto_available
from protocol.ledger import ledger_closed_cleanly, read_meta
from protocol.messages import decode

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FED = "durable"


class Relay:
    """Subscriber to ``fedfleet/v1/FED/#`` keeping the set of ``(sender, kind, seq)`` delivered."""

    def __init__(self, host: str, port: int) -> None:
        self.seen: set[tuple[str, str, int]] = set()
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="counting-relay")
        self.client.on_connect = lambda c, *a: c.subscribe(f"fedfleet/v1/{FED}/#", qos=1)
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(host, port)
        self.client.loop_start()
        assert self._subscribed.wait(30), "relay: no SUBACK"

    def _on_message(self, client, userdata, msg) -> None:
        if not msg.payload:
            return
        env = decode(bytes(msg.payload)).envelope
        with self._lock:
            self.seen.add((env.sender, env.kind.label, env.seq))

    def snapshot(self) -> set[tuple[str, str, int]]:
        with self._lock:
            return set(self.seen)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _ledger_sent(path: Path) -> set[tuple[str, str, int]]:
    """Committed ``sent`` message rows of a ledger (MQTT control packets left out)."""
    if not path.is_file():
        return set()
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return {(n, k, s) for n, k, s in db.execute(
            "SELECT node, kind, seq FROM messages WHERE event = 'sent' AND reason != 'control'")}
    except sqlite3.OperationalError:  # the schema is not there yet
        return set()
    finally:
        db.close()


def _wait_for(cond, bound_s: float = 120.0, proc: subprocess.Popen | None = None) -> bool:
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        if cond():
            return True
        if proc is not None and proc.poll() is not None:
            return cond()
        time.sleep(0.05)
    return cond()


@pytest.fixture
def broker(tmp_path: Path):
    with EmbeddedBroker(kind="mosquitto" if mosquitto_available() else "amqtt", workdir=tmp_path / "broker") as b:
        yield b


@pytest.fixture
def relay(broker: EmbeddedBroker):
    r = Relay(broker.host, broker.port)
    yield r
    r.close()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _start_agent(broker: EmbeddedBroker, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "edge_agent.cli", "--broker", broker.url, "--federation", FED, "--client-id", "c0",
         "--dataset", "digits", "--shard", "0/2", "--out", str(out)],
        cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


_STREAMER = textwrap.dedent("""
    import sys
    from protocol import topics
    from protocol.channel import Channel
    from protocol.ledger import Ledger
    from protocol.lifecycle import install_signal_handlers
    from protocol.messages import Status
    from protocol.transport import MqttTransport

    install_signal_handlers()
    host, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    tr = MqttTransport("streamer", host, port)
    tr.connect()
    ledger = Ledger(path)
    ch = Channel(tr, node_id="s0", side="agent", federation="durable", ledger=ledger)
    try:
        while True:
            ch.send(topics.status("durable", "s0"), Status("training", "streaming"), round=0, wait_s=30)
    finally:
        ch.close()
        ledger.close()
""")


def _start_streamer(broker: EmbeddedBroker, path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _STREAMER, broker.host, str(broker.port), str(path)],
                            cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_idle_agent_killed_keeps_its_rows(broker: EmbeddedBroker, relay: Relay, tmp_path: Path) -> None:
    """The issue's case: an agent waiting for a server, killed with SIGKILL (the old ledger: 0 rows)."""
    ledger = tmp_path / "agent" / "ledger.sqlite"
    proc = _start_agent(broker, tmp_path / "agent")
    try:
        assert _wait_for(lambda: {k for _, k, _ in relay.snapshot()} >= {"status", "join"}, proc=proc), \
            proc.stderr.read() if proc.poll() is not None else "agent published no status/join"
        published = relay.snapshot()
        # committed by the ledger on its own: no close, no round end, no flush
        assert _wait_for(lambda: _ledger_sent(ledger) >= published, proc=proc)
        proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        _stop(proc)
    rows = _ledger_sent(ledger)
    assert rows >= published  # survived the kill (WAL) ...
    assert rows <= relay.snapshot() | published  # ... and no row claims a message the broker never delivered
    assert ledger_closed_cleanly(ledger) is False  # the audit can tell this ledger was not closed


def test_idle_agent_stopped_with_sigterm_closes_its_ledger(broker: EmbeddedBroker, relay: Relay,
                                                          tmp_path: Path) -> None:
    ledger = tmp_path / "agent" / "ledger.sqlite"
    proc = _start_agent(broker, tmp_path / "agent")
    try:
        assert _wait_for(lambda: {k for _, k, _ in relay.snapshot()} >= {"status", "join"}, proc=proc), \
            proc.stderr.read() if proc.poll() is not None else "agent published no status/join"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        _stop(proc)
    rows = _ledger_sent(ledger)
    assert _wait_for(lambda: relay.snapshot() >= rows, bound_s=30)
    assert rows == relay.snapshot()  # every message it published, and only those
    assert ledger_closed_cleanly(ledger) is True
    assert read_meta(ledger)["stop_signal"] == "SIGTERM"
    # a clean DISCONNECT fires no last will: the agent said "offline" itself before it (the
    # retained online status at start, then the offline one), and the broker delivered it
    assert sorted(k for _, k, _ in rows).count("status") == 2


def test_streaming_device_stopped_with_sigterm_ledgers_every_message(broker: EmbeddedBroker, relay: Relay,
                                                                    tmp_path: Path) -> None:
    """SIGTERM lands while messages are being published: none of them misses its ledger row."""
    ledger = tmp_path / "ledger.sqlite"
    proc = _start_streamer(broker, ledger)
    try:
        assert _wait_for(lambda: len(relay.snapshot()) >= 200, proc=proc), proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        _stop(proc)
    rows = _ledger_sent(ledger)
    assert _wait_for(lambda: relay.snapshot() >= rows, bound_s=30)
    seen = relay.snapshot()
    assert len(seen) >= 200
    assert rows == seen
    seqs = sorted(s for _, _, s in rows)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive: nothing lost, nothing twice
    assert ledger_closed_cleanly(ledger) is True


def test_streaming_device_killed_loses_only_its_last_second(broker: EmbeddedBroker, relay: Relay,
                                                            tmp_path: Path) -> None:
    """SIGKILL mid-stream: the ledger holds a prefix of what was delivered, everything committed stays."""
    ledger = tmp_path / "ledger.sqlite"
    proc = _start_streamer(broker, ledger)
    try:
        assert _wait_for(lambda: len(relay.snapshot()) >= 200, proc=proc), proc.stderr.read()
        assert _wait_for(lambda: len(_ledger_sent(ledger)) >= 100, proc=proc)  # by the 1 s commits alone
        before = _ledger_sent(ledger)
        proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        _stop(proc)
    rows = _ledger_sent(ledger)
    assert rows >= before
    assert _wait_for(lambda: relay.snapshot() >= rows, bound_s=30)
    assert rows <= relay.snapshot()
    seqs = sorted(s for _, _, s in rows)
    first = min(s for _, _, s in relay.snapshot())
    assert seqs == list(range(first, first + len(seqs)))  # a prefix of what was sent
    assert ledger_closed_cleanly(ledger) is False


def test_simulate_stopped_with_sigterm_closes_its_ledger(broker: EmbeddedBroker, relay: Relay,
                                                        tmp_path: Path) -> None:
    """``fedfleet simulate`` (server and agents in one process, one ledger) stopped mid-run."""
    out = tmp_path / FED  # the run folder's name is the federation id
    proc = subprocess.Popen(
        [sys.executable, "-m", "broker_server.cli", "simulate", "--config", "examples/quickstart.toml",
         "--rounds", "200", "--clients", "2", "--broker", broker.url, "--out", str(out), "-q"],
        cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        metrics = out / "metrics.jsonl"
        assert _wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 1, bound_s=300,
                         proc=proc), proc.stderr.read() if proc.poll() is not None else "no round finished"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        _stop(proc)
    ledger = out / "ledger.sqlite"
    assert ledger_closed_cleanly(ledger) is True
    assert read_meta(ledger)["stop_signal"] == "SIGTERM"
    assert {k for _, k, _ in _ledger_sent(ledger)} >= {"join", "global", "round_start", "update", "receipt"}
    # (sender, seq) only: for a chunk the relay sees kind "chunk", the ledger the kind it carries
    rows = {(n, s) for n, _, s in _ledger_sent(ledger)}
    assert _wait_for(lambda: {(n, s) for n, _, s in relay.snapshot()} >= rows, bound_s=30)
    assert rows == {(n, s) for n, _, s in relay.snapshot()}
