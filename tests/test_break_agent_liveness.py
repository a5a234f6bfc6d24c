"""Reproducers (tester): ways a live, healthy agent is dropped from a federation for good.

1. A refused ``join`` receipt kills the agent even when the join it refers to was not its own:
   one forged ``join`` with a wrong manifest hash on ``up/<live client>/join`` makes the server
   publish a refusal receipt to that client, and ``EdgeAgent._handle`` raises ``AgentError``
   without checking ``ref_seq`` (or that it already joined). The server still believes the dead
   agent is online and waits for it until every later round's deadline.
2. After a transient link drop the broker publishes the agent's last will (``offline``,
   retained); paho reconnects, but nothing ever publishes ``online`` again, so the server never
   selects that agent again although it is connected and serving.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from broker_server import config as config_mod
from broker_server.embedded_broker import EmbeddedBroker
from broker_server.simulate import simulate
from test_federation import small_config
from protocol.messages import Envelope, Join, RoundStart, decode, encode

pytestmark = pytest.mark.slow


def _cfg(**over) -> config_mod.Config:
    """The integration tests' small federation (tests/test_federation.py), 3 rounds."""
    return small_config(run={"name": "brk", "rounds": 3, **over.pop("run", {})}, **over)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_forged_join_with_wrong_manifest_does_not_kill_a_live_agent(tmp_path: Path) -> None:
    fed = "brk-joinspoof"
    run_dir = tmp_path / fed
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        sent = threading.Event()
        intruder = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id="intruder-join")

        def on_message(cl, userdata, msg):
            if sent.is_set() or not msg.payload:
                return
            d = decode(bytes(msg.payload))
            if isinstance(d.envelope.body, RoundStart) and d.envelope.round == 1:
                sent.set()
                forged = encode(Envelope(round=0, sender="client-001", seq=99,
                                         body=Join("x86-cpu", "0000deadbeef0000", 100, (), {}))).payload
                cl.publish(f"fedfleet/v1/{fed}/up/client-001/join", forged, qos=1)

        intruder.on_connect = lambda cl, *_: cl.subscribe(f"fedfleet/v1/{fed}/down/round_start", qos=1)
        intruder.on_message = on_message
        intruder.connect(broker.host, broker.port)
        intruder.loop_start()
        time.sleep(0.3)
        try:
            res = simulate(_cfg(), broker_url=broker.url, run_dir=run_dir)
        finally:
            intruder.disconnect()
            intruder.loop_stop()
    assert sent.is_set()
    summary = json.loads((run_dir / "summary.json").read_text())
    # what should happen: the forged join is refused and counted; client-001 keeps training
    assert summary["agent_errors"] == []
    assert {a.client_id: a.rounds_trained for a in res.agents} == {f"client-00{i}": 3 for i in range(3)}
    assert all(m["clients_reported"] == 3 for m in _metrics(run_dir))


def test_agent_is_selected_again_after_a_transient_link_drop(tmp_path: Path) -> None:
    dropped = threading.Event()

    def hook(i, agent):
        if i != 1:
            return
        original = agent._maybe_train

        def train_then_blip():
            before = agent.rounds_trained
            original()
            if before == 0 and agent.rounds_trained == 1 and not dropped.is_set():
                time.sleep(0.3)
                agent.channel.transport.drop_link()  # a network blip: paho reconnects by itself
                dropped.set()

        agent._maybe_train = train_then_blip

    run_dir = tmp_path / "run"
    res = simulate(_cfg(run={"rounds": 4}), run_dir=run_dir, agent_hook=hook)
    assert dropped.is_set()
    metrics = _metrics(run_dir)
    assert res.rounds_completed == 4
    # what should happen: once reconnected (it received 'finish', so it was), client-001 is
    # selectable again; the last round asks all three clients
    assert metrics[-1]["clients_selected"] == 3, metrics
