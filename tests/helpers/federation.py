"""The small federation of the integration tests, and a spy on its broker.

``small_config`` is scikit-learn's digits (offline, small), 3 clients, quorum 2, 2 rounds, amqtt:
a federation over a real broker then takes seconds. ``Spy`` sees every payload the broker
delivers, so a test can recompute what the server did from what travelled.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt

from broker_server import config as config_mod
from broker_server.embedded_broker import EmbeddedBroker
from broker_server.simulate import simulate
from helpers.waiting import wait_for
from protocol.messages import Global, Update, decode, read_header


def small_config(**over) -> config_mod.Config:
    """The digits federation (3 clients, quorum 2, 2 rounds, amqtt); ``over`` maps a section to
    the keys it changes (``small_config(run={"rounds": 1}, data={"clients": 2})``)."""
    raw = {
        "run": {"name": "t", "seed": 1, "rounds": 2},
        "data": {"dataset": "digits", "partition": "iid", "clients": 3},
        "train": {"local_epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.5},
        "server": {"quorum": 2, "round_deadline_s": 60.0, "join_timeout_s": 60.0},
        "broker": {"kind": "amqtt"},
    }
    for sec, vals in over.items():
        raw.setdefault(sec, {}).update(vals)
    return config_mod.from_dict(raw, "<test>")


class Spy:
    """A paho client subscribed to ``fedfleet/#`` recording (topic, payload, retain) of every delivery."""

    def __init__(self, host: str, port: int) -> None:
        self.messages: list[tuple[str, bytes, bool]] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        c = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id=f"spy-{time.time_ns()}")
        c.on_connect = lambda cl, *_: cl.subscribe("fedfleet/#", qos=1)
        c.on_subscribe = lambda *_: self._ready.set()
        c.on_message = self._on_message
        c.connect(host, port)
        c.loop_start()
        if not self._ready.wait(10):
            raise RuntimeError("spy did not subscribe")
        self.client = c

    def _on_message(self, client, userdata, msg) -> None:
        with self._lock:
            self.messages.append((msg.topic, bytes(msg.payload), bool(msg.retain)))

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def spied(spy: Spy) -> tuple[dict[int, dict[str, Update]], dict[int, Global]]:
    """(round → sender → Update, round → Global) of the payloads the spy saw (last wills skipped)."""
    updates: dict[int, dict[str, Update]] = {}
    globals_: dict[int, Global] = {}
    for _, payload, _ in spy.messages:
        if not payload:
            continue
        env = decode(payload).envelope
        if isinstance(env.body, Update):
            updates.setdefault(env.round, {})[env.sender] = env.body
        elif isinstance(env.body, Global):
            globals_[env.round] = env.body
    return updates, globals_


def run_with_spy(broker: EmbeddedBroker, tmp_path: Path, cfg: config_mod.Config):
    """``simulate(cfg)`` on ``broker`` with a :class:`Spy` watching; returns (result, spy)."""
    spy = Spy(broker.host, broker.port)
    try:
        res = simulate(cfg, broker_url=broker.url, run_dir=tmp_path / "run")
        # let the last deliveries reach the spy: every message the ledger recorded as sent
        # (the rows with a seq, keyed (sender, seq) as the envelope's header names it)
        sent = _ledger_sent(res.run_dir / "ledger.sqlite")
        seen: set[tuple[str, int]] = set()
        read = 0

        def delivered() -> bool:
            nonlocal read
            with spy._lock:
                new = spy.messages[read:]
            read += len(new)
            for _, payload, _ in new:
                head = read_header(payload) if payload else None  # empty: a cleared retained topic
                if head is not None:
                    seen.add((head[2], head[3]))
            return sent <= seen

        wait_for(delivered, bound_s=30.0)
    finally:
        spy.close()
    return res, spy


def _ledger_sent(path: Path) -> set[tuple[str, int]]:
    """(sender, seq) of every message a run's ledger recorded as sent (its rows with a seq)."""
    if not path.exists():
        return set()
    con = sqlite3.connect(path)
    try:
        rows = con.execute("select sender, seq from messages where event='sent' and seq is not null").fetchall()
    finally:
        con.close()
    return {(sender, seq) for sender, seq in rows}


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's ``metrics.jsonl``, one dict per round."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_summary(run_dir: Path) -> dict:
    """A run's ``summary.json``."""
    return json.loads((run_dir / "summary.json").read_text())


def assert_prototypes_only_on_the_wire(run_dir: Path, *, classes: int = 10, width: int = 64,
                                       last_round: int = 2) -> None:
    """A prototype-only run's ledger: every update the devices sent carries an empty tensors
    field (the one byte of an empty msgpack array: no model parameter), and the last round's
    global is exactly ``classes`` float32 prototypes of ``width`` plus their int64 class ids."""
    import sqlite3

    con = sqlite3.connect(run_dir / "ledger.sqlite")
    try:
        sent = con.execute("select fields from messages where side='agent' and kind='update' and event='sent'")
        rows = [json.loads(f) for (f,) in sent]
        assert rows and all(f["tensors"] == 1 for f in rows), rows[:3]
        glob = dict(con.execute("select round, raw_bytes from messages where side='server' and kind='global' "
                                "and event='sent'").fetchall())
    finally:
        con.close()
    assert glob[last_round] == classes * width * 4 + classes * 8
