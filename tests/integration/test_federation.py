"""Integration tests: whole federations over a real MQTT broker (embedded amqtt, and Mosquitto).

Each run uses scikit-learn's digits (offline, small) so a 2-round federation takes seconds.
The checks are independent of the code under test: a spy client on ``fedfleet/#`` sees every
payload the broker delivered, and the test recomputes FedAvg from the spied updates.
"""

from __future__ import annotations

import io
import json
import sqlite3
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

import msgpack
import numpy as np
import paho.mqtt.client as mqtt
import pytest
import torch
from helpers.federation import Spy, small_config
from helpers.federation import run_with_spy as _run_with_spy

from broker_server import config as config_mod
from broker_server.audit import audit_report
from broker_server.checkpoint import CheckpointStore
from broker_server.cli import main as fedfleet_main
from broker_server.embedded_broker import EmbeddedBroker
from broker_server.server import evaluate
from broker_server.simulate import simulate
from edge_agent.data import load_dataset
from edge_agent.models import build_model
from edge_agent.state import load_arrays
from protocol.messages import Global, Update, decode

pytestmark = pytest.mark.slow


def _ledger(run_dir: Path) -> list[dict]:
    db = sqlite3.connect(run_dir / "ledger.sqlite")
    db.row_factory = sqlite3.Row
    rows = [dict(r) for r in db.execute("SELECT * FROM messages ORDER BY id")]
    db.close()
    return rows


def _check_federation(res, spy: Spy, cfg: config_mod.Config) -> None:
    run_dir = res.run_dir
    # -- the run finished with every client every round
    assert res.rounds_completed == 2
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [1, 2]
    assert all(m["clients_reported"] == 3 and m["clients_selected"] == 3 and not m["skipped"] for m in metrics)
    assert all(m["global_receipts"] == 3 for m in metrics)  # every agent confirmed the model's hash
    for key in ("accuracy", "loss", "bytes_up", "bytes_down", "seconds"):
        assert key in metrics[0]
    assert all(s.rounds_trained == 2 and s.receipts_accepted == 2 and s.finished for s in res.agents)

    # -- FedAvg recomputed from what the broker delivered
    delivered = [(t, decode(p)) for t, p, _ in spy.messages if p]
    updates = {}
    globals_ = {}
    for _topic, d in delivered:
        env = d.envelope
        if isinstance(env.body, Update):
            updates.setdefault(env.round, {})[env.sender] = env.body
        elif isinstance(env.body, Global):
            globals_[env.round] = env.body.tensors
    assert sorted(updates) == [1, 2] and all(len(u) == 3 for u in updates.values())
    for r in (1, 2):
        ups = updates[r].values()
        n = sum(u.num_samples for u in ups)
        expected = [sum(u.tensors[i].astype(np.float64) * (u.num_samples / n) for u in ups)
                    for i in range(len(globals_[1]))]
        if r == 1:
            got = globals_[2]
        else:
            state = torch.load(run_dir / "model_final.pt")
            got = [t.numpy() for t in state.values()]
        for e, g in zip(expected, got):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)

    # -- reported accuracy = an independent evaluation of the final model
    ds = load_dataset("digits")
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    model.load_state_dict(torch.load(run_dir / "model_final.pt"))
    correct = 0
    with torch.no_grad():
        pred = model(torch.from_numpy(np.array(ds.test.x))).argmax(1).numpy()
    correct = int((pred == ds.test.y).sum())
    assert metrics[-1]["accuracy"] == pytest.approx(correct / len(ds.test.y))
    assert res.final_accuracy > 0.3  # 2 rounds on digits: far above chance (0.1)

    # -- checkpoints: initial model + one per round; the last equals the final model
    store = CheckpointStore(run_dir / "checkpoints.sqlite")
    assert store.rounds() == [0, 1, 2]
    ck = store.load()
    for a, b in zip(ck.tensors, got):
        np.testing.assert_array_equal(a, b)
    store.close()

    # -- the ledger is exact: every delivered payload has a 'sent' row whose
    #    envelope + body bytes equal the payload length the spy received
    rows = _ledger(run_dir)
    sent = {(r["sender"], r["seq"]): r for r in rows if r["event"] == "sent" and r["seq"] is not None}
    seen = set()
    for topic, d in delivered:
        env = d.envelope
        key = (env.sender, env.seq)
        if env.seq == 0:  # a last will (published by the broker, not by fedfleet)
            continue
        row = sent[key]
        assert row["topic"] == topic
        assert row["envelope_bytes"] + row["body_bytes"] == d.payload_bytes
        assert row["body_bytes"] == d.body_bytes
        seen.add(key)
    assert seen == set(sent), "every sent row was delivered to the spy"
    # received rows: same sizes as their sent row
    for r in rows:
        if r["event"] == "received" and r["seq"] is not None:
            s = sent[(r["sender"], r["seq"])]
            assert (r["envelope_bytes"], r["body_bytes"], r["topic_bytes"]) == \
                (s["envelope_bytes"], s["body_bytes"], s["topic_bytes"])

    # -- ledger totals equal what `fedfleet audit --json` prints
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert fedfleet_main(["audit", str(run_dir), "--json"]) == 0
    report = json.loads(buf.getvalue())
    dev = [r for r in rows if r["side"] == "agent" and r["event"] in ("sent", "received")]
    for direction in ("up", "down"):
        want = sum(r["mqtt_header_bytes"] + r["topic_bytes"] + r["payload_bytes"] for r in dev
                   if r["direction"] == direction)
        assert report["totals"]["device"][direction]["wire_bytes"] == want
    srv = [r for r in rows if r["side"] == "server" and r["event"] in ("sent", "received")]
    assert report["totals"]["server"]["all"]["body_bytes"] == sum(r["body_bytes"] for r in srv)
    # metrics' bytes_up is the server link's uplink for that round
    up_r1 = sum(r["mqtt_header_bytes"] + r["topic_bytes"] + r["payload_bytes"] for r in srv
                if r["event"] == "received" and r["round"] == 1)
    assert metrics[0]["bytes_up"] == up_r1


def test_federation_over_amqtt(tmp_path: Path) -> None:
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        res, spy = _run_with_spy(broker, tmp_path, small_config())
    _check_federation(res, spy, small_config())


@pytest.mark.mosquitto
def test_federation_over_mosquitto(tmp_path: Path) -> None:
    from helpers.brokers import require_mosquitto

    require_mosquitto()
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "broker") as broker:
        res, spy = _run_with_spy(broker, tmp_path, small_config())
    _check_federation(res, spy, small_config())


def test_embedded_broker_started_by_simulate(tmp_path: Path) -> None:
    res = simulate(small_config(run={"rounds": 1}), run_dir=tmp_path / "run")
    assert res.broker == "amqtt" and res.rounds_completed == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_accuracy"] == pytest.approx(res.final_accuracy)
    assert summary["agent_errors"] == []


def test_malformed_messages_are_rejected_and_the_round_goes_on(tmp_path: Path) -> None:
    """Garbage on an agent's update topic mid-round: logged, counted, ledgered; round completes."""
    run_dir = tmp_path / "fed-bad"
    fed = "fed-bad"
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        intruder = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id="intruder")
        sent = threading.Event()

        def on_message(cl, userdata, msg):
            if not sent.is_set():
                sent.set()
                for bad in (b"\xc1not msgpack", b"\x93\x01\x02\x03", b""):
                    cl.publish(f"fedfleet/v1/{fed}/up/client-001/update", bad, qos=1)
                cl.publish(f"fedfleet/v1/{fed}/up/client-009/update",
                           msgpack.packb([2, 4, 1, "client-009", 1, 0, b""]), qos=1)

        intruder.on_connect = lambda cl, *_: cl.subscribe(f"fedfleet/v1/{fed}/down/round_start", qos=1)
        intruder.on_message = on_message
        intruder.connect(broker.host, broker.port)
        intruder.loop_start()
        time.sleep(0.3)
        res = simulate(small_config(), broker_url=broker.url, run_dir=run_dir)
        intruder.disconnect()
        intruder.loop_stop()
    assert sent.is_set()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert res.rounds_completed == 2
    assert metrics[0]["clients_reported"] == 3
    # four refused: not msgpack, a 3-element array, an empty payload (on an update topic it is a
    # refused message, not a cleared retained status), and client-009's envelope of another version
    assert sum(m["invalid"] for m in metrics) == 4
    assert sum(sum(m["rejected_by_reason"].values()) for m in metrics) == 4  # the split adds up
    rejected = [r for r in _ledger(run_dir) if r["event"] == "rejected"]
    assert len(rejected) == 4
    reasons = " | ".join(r["reason"] for r in rejected)
    assert "msgpack" in reasons and "version" in reasons and "empty" in reasons.lower()


def test_agent_that_vanishes_mid_round_is_dropped_after_the_deadline(tmp_path: Path) -> None:
    """client-002 loses power when round 1 starts: round 1 closes at the deadline with the other
    two (quorum 2), its last will marks it offline, and round 2 runs without it."""
    cfg = small_config(server={"round_deadline_s": 8.0})

    def hook(i, agent):
        if i != 2:
            return
        original = agent._maybe_train

        def vanish():
            if agent._pending is not None:
                agent.channel.transport.abort()
                agent.stop()
                return
            original()

        agent._maybe_train = vanish

    res = simulate(cfg, run_dir=tmp_path / "run", agent_hook=hook)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert res.rounds_completed == 2
    # 2 of the 3 selected reported: the round can only have closed at its deadline
    assert metrics[0]["clients_selected"] == 3 and metrics[0]["clients_reported"] == 2
    assert metrics[1]["clients_selected"] == 2 and metrics[1]["clients_reported"] == 2
    assert not metrics[0]["skipped"]


def test_quorum_missed_skips_the_round(tmp_path: Path) -> None:
    """Quorum 3 and one silent agent: both rounds close at the deadline without aggregation and
    the global model stays the initial one."""
    cfg = small_config(server={"round_deadline_s": 2.0, "quorum": 3})

    def hook(i, agent):
        if i == 0:
            agent._maybe_train = lambda: None  # never trains, stays connected

    res = simulate(cfg, run_dir=tmp_path / "run", agent_hook=hook)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped"] for m in metrics] == [True, True]
    assert "quorum" in metrics[0]["skip_reason"]
    store = CheckpointStore(tmp_path / "run" / "checkpoints.sqlite")
    first, last = store.load(0), store.load(2)
    for a, b in zip(first.tensors, last.tensors):
        np.testing.assert_array_equal(a, b)
    store.close()
    # accuracy reported = accuracy of the (unchanged) initial model
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    load_arrays(model, first.tensors)
    acc, _ = evaluate(model, load_dataset("digits").test)
    assert metrics[-1]["accuracy"] == pytest.approx(acc)
    assert res.rounds_completed == 2


def test_cli_simulate_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = Path(__file__).resolve().parents[2]
    code = fedfleet_main(["simulate", "--config", str(root / "examples" / "quickstart.toml"), "--rounds", "1",
                          "--clients", "2", "--out", str(tmp_path / "cli"), "-q"])
    out = capsys.readouterr().out
    assert code == 0
    m = json.loads((tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()[-1])
    assert f"final test accuracy {m['accuracy']:.4f}" in out
    rep = audit_report(tmp_path / "cli")
    assert f"up {rep['totals']['device']['up']['wire_bytes']:,}" in out
    # an algorithm without a global model (FedMCP++, Local, FedPer …) reports the devices' own models
    from broker_server.cli import _print_summary

    _print_summary(tmp_path / "cli", 0.8125, 1, 1.0, "amqtt", accuracy_source="clients")
    assert "final test accuracy of the devices' own models (mean over clients) 0.8125" in capsys.readouterr().out

    bad = tmp_path / "bad.toml"
    bad.write_text("[data]\nclinets = 3\n")
    assert fedfleet_main(["simulate", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "clinets" in err and "bad.toml" in err

    nodata = tmp_path / "nodata.toml"
    nodata.write_text('[data]\ndataset = "svhn"\n')
    assert fedfleet_main(["simulate", "--config", str(nodata), "--out", str(tmp_path / "nd")]) == 3
    assert "svhn" in capsys.readouterr().err
