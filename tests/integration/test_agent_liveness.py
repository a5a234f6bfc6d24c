"""A live, healthy agent stays in the federation and stops when it should: forged messages and
link drops do not remove it for good, and a device that falls behind does not train rounds that
are already over. Real federations (digits, amqtt, 3 clients, 3–4 rounds). And what an agent
says in its log when its broker is killed and comes back (each broker kind)."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from helpers.federation import read_metrics as _metrics
from helpers.federation import read_summary, small_config
from helpers.waiting import wait_for

from broker_server import config as config_mod
from broker_server.embedded_broker import EmbeddedBroker
from broker_server.simulate import simulate
from edge_agent.agent import EdgeAgent
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.models import build_model
from protocol.channel import Channel
from protocol.messages import Envelope, Join, RoundStart, decode, encode
from protocol.topics import mqtt_client_id
from protocol.transport import MqttTransport

pytestmark = pytest.mark.slow

TRAIN_S = 1.0


def _cfg(**over) -> config_mod.Config:
    """The small digits federation of ``helpers.federation.small_config``, 3 rounds."""
    return small_config(run={"name": "brk", "rounds": 3, **over.pop("run", {})}, **over)


def test_forged_join_with_wrong_manifest_does_not_kill_a_live_agent(tmp_path: Path) -> None:
    """A forged ``join`` with a wrong manifest hash on ``up/<live client>/join`` makes the server
    send that client a refusal receipt; the live agent, already joined, ignores a refusal of a
    join that is not its own (``ref_seq``), so it keeps training: no agent errors, every
    client trains all 3 rounds, every round has 3 reports."""
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
    summary = read_summary(run_dir)
    assert summary["agent_errors"] == []
    assert {a.client_id: a.rounds_trained for a in res.agents} == {f"client-00{i}": 3 for i in range(3)}
    assert all(m["clients_reported"] == 3 for m in _metrics(run_dir))


def test_agent_is_selected_again_after_a_transient_link_drop(tmp_path: Path) -> None:
    """After a transient link drop the broker publishes the agent's last will (``offline``,
    retained); once paho has reconnected, the agent says ``online`` again, so the server
    selects it again: the last of 4 rounds asks all three clients."""
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
    # a round that asked the dropped client while its link was down closes on the other two after 15 s
    res = simulate(_cfg(run={"rounds": 4}, server={"round_deadline_s": 15.0}), run_dir=run_dir, agent_hook=hook)
    assert dropped.is_set()
    metrics = _metrics(run_dir)
    assert res.rounds_completed == 4
    # once reconnected (it received 'finish', so it was), client-001 is selectable again
    assert metrics[-1]["clients_selected"] == 3, metrics


def test_agent_does_not_train_rounds_that_are_already_over(tmp_path: Path) -> None:
    """An agent that falls behind (training takes 1 s, the round deadline is 0.5 s) skips the
    rounds that are over and stops at ``finish``: besides the training in progress when
    ``finish`` was published, no agent sends an update after it (ledger order)."""
    def hook(i, agent):
        original = agent.algorithm.local_round

        def slow(*args, **kwargs):
            time.sleep(TRAIN_S)  # a slow device: training takes longer than the round deadline
            return original(*args, **kwargs)

        agent.algorithm.local_round = slow

    cfg = config_mod.from_dict({
        "run": {"name": "brk", "seed": 1, "rounds": 4},
        "data": {"dataset": "digits", "partition": "iid", "clients": 3},
        "train": {"local_epochs": 1, "batch_size": 16},
        "server": {"quorum": 1, "round_deadline_s": 0.5, "join_timeout_s": 30.0},
        "agents": {"train_slots": 3},
        "broker": {"kind": "amqtt"},
    }, "<test>")
    run_dir = tmp_path / "run"
    simulate(cfg, run_dir=run_dir, agent_hook=hook)
    db = sqlite3.connect(run_dir / "ledger.sqlite")
    (finish_ts,) = db.execute("SELECT ts FROM messages WHERE side='server' AND event='sent' "
                              "AND kind='finish'").fetchone()
    after = dict(db.execute("SELECT node, COUNT(*) FROM messages WHERE side='agent' AND event='sent' "
                            "AND kind='update' AND ts > ? GROUP BY node", (finish_ts,)).fetchall())
    db.close()
    assert all(n <= 1 for n in after.values()), f"updates published after the server's finish: {after}"


def test_agent_logs_its_broker_killed_as_lost_and_the_restarted_one_as_back(embedded_broker: EmbeddedBroker,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """The broker is SIGKILLed under a connected agent (nothing in flight) and started again on
    its port: the agent logs one WARNING, with paho's reason for a connection closed under it
    (``Unspecified error``, its name for MQTT_ERR_CONN_LOST whatever the protocol level: a killed
    broker sends no DISCONNECT), and, once paho has reconnected, one INFO naming connection 2 and
    the seconds down on the agent's link clock (scripted: lost at 50 s, back at 57.5 s)."""
    caplog.set_level(logging.INFO, logger="edge_agent.agent")
    tr = MqttTransport(mqtt_client_id("brk-log", "dev-k"), "127.0.0.1", embedded_broker.port, keepalive_s=30)
    tr.connect(timeout_s=30.0)
    try:
        rng = np.random.default_rng(0)
        agent = EdgeAgent(channel=Channel(tr, node_id="dev-k", side="agent", federation="brk-log", ledger=None),
                          model=build_model("lightcnn", in_channels=1, image_size=8, num_classes=10),
                          algorithm=FedAvgClient(), x=rng.standard_normal((20, 1, 8, 8)).astype(np.float32),
                          y=rng.integers(0, 10, 20), num_classes=10, train_defaults=TrainConfig(batch_size=10))
        ticks = iter([50.0, 57.5])
        agent.link_log.clock = lambda: next(ticks)
        embedded_broker.kill()
        assert wait_for(lambda: not tr.connected, 30)
        embedded_broker.start()
        assert wait_for(lambda: tr.connects == 2, 60)
        assert wait_for(lambda: any("link to the broker back" in r.getMessage() for r in caplog.records), 30)
    finally:
        tr.close()
    records = [(r.levelno, r.getMessage()) for r in caplog.records
               if r.name == "edge_agent.agent" and "link to the broker" in r.getMessage()]
    assert records == [
        (logging.WARNING, "dev-k: link to the broker lost (connection 1: Unspecified error); no message awaiting "
                          "acknowledgement; reconnecting"),
        (logging.INFO, "dev-k: link to the broker back (connection 2), 7.5 s after it was lost")]
