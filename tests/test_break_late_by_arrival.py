"""Reproducer (tester): updates that reached the server before the deadline are rejected as late
when the server's single message thread is busy.

``AggregationServer.run_round`` stops pumping at the deadline and judges lateness by the
moment an update is *dequeued* (``_collecting`` is already ``None``), not by when it arrived
(``Incoming.received_at`` is recorded and never used). Anything that delays the server's thread
- expensive hostile payloads (see test_break_decode_amplification.py: one 10 MB message of
nested arrays took ~4 s), many clients, a slow evaluation - turns on-time updates into "late"
ones and can skip the round. Here the busy server is simulated by making each rejected
(garbage) message cost 1 s to handle; 8 garbage messages arrive with round 1's start.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from broker_server import config as config_mod
from broker_server import server as server_mod
from broker_server.embedded_broker import EmbeddedBroker
from broker_server.simulate import simulate
from protocol.channel import Rejected
from protocol.messages import RoundStart, Update, decode

pytestmark = pytest.mark.slow

DEADLINE_S = 6.0


def test_updates_that_arrived_before_the_deadline_are_counted(tmp_path: Path, monkeypatch) -> None:
    original = server_mod.AggregationServer._handle

    def slow_handle(self, item):
        if isinstance(item, Rejected):
            time.sleep(1.0)  # stands for an expensive hostile payload
        return original(self, item)

    monkeypatch.setattr(server_mod.AggregationServer, "_handle", slow_handle)
    fed = "brk-late"
    seen: dict[str, float] = {}
    start: list[float] = []
    lock = threading.Lock()
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        intruder = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id="intruder-late")

        def on_message(cl, userdata, msg):
            if not msg.payload:
                return
            try:
                d = decode(bytes(msg.payload))
            except Exception:
                return
            now = time.monotonic()
            with lock:
                if isinstance(d.envelope.body, RoundStart) and d.envelope.round == 1 and not start:
                    start.append(now)
                    for _ in range(8):
                        cl.publish(f"fedfleet/v1/{fed}/up/client-000/update", b"\xc1garbage", qos=1)
                elif isinstance(d.envelope.body, Update) and d.envelope.round == 1:
                    seen.setdefault(d.envelope.sender, now)

        intruder.on_connect = lambda cl, *_: (cl.subscribe(f"fedfleet/v1/{fed}/down/round_start", qos=1),
                                              cl.subscribe(f"fedfleet/v1/{fed}/up/+/update", qos=1))
        intruder.on_message = on_message
        intruder.connect(broker.host, broker.port)
        intruder.loop_start()
        time.sleep(0.3)
        cfg = config_mod.from_dict({
            "run": {"name": "brk", "seed": 1, "rounds": 1},
            "data": {"dataset": "digits", "partition": "iid", "clients": 3},
            "train": {"local_epochs": 1, "batch_size": 16},
            "server": {"quorum": 2, "round_deadline_s": DEADLINE_S, "join_timeout_s": 30.0},
            "broker": {"kind": "amqtt"},
        }, "<test_break>")
        try:
            simulate(cfg, broker_url=broker.url, run_dir=tmp_path / fed)
        finally:
            intruder.disconnect()
            intruder.loop_stop()
    on_time = [c for c, t in seen.items() if start and t - start[0] < DEADLINE_S - 0.5]
    if len(on_time) < 2:
        pytest.skip(reason=f"precondition not met: only {on_time} delivered well before the deadline")
    m = json.loads((tmp_path / fed / "metrics.jsonl").read_text().splitlines()[0])
    # what should happen: every update the broker delivered before the deadline is aggregated
    assert m["clients_reported"] >= len(on_time) and not m["skipped"], m
