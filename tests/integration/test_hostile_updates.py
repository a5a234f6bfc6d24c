"""Hostile but protocol-conforming devices in a real federation (digits, amqtt, 1–2 rounds, 2–3
clients): a malformed update, prototypes of the wrong width or class, unusable client metrics or
an unreadable codec setting is refused with a reason or worked around, and the run goes on with
the honest devices (no server crash, no agent error).

A "tampering" device is an honest agent whose algorithm's local result is changed before upload
(signed, right topic, right round); a rogue client is a raw paho client on the broker."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import paho.mqtt.client as mqtt
import pytest
from helpers.federation import read_metrics as _metrics
from helpers.federation import read_summary as _summary
from helpers.federation import small_config

from broker_server.embedded_broker import EmbeddedBroker
from broker_server.simulate import simulate

pytestmark = pytest.mark.slow


def _update_payload(sender: str, rnd: int, body: list, seq: int = 1_000) -> bytes:
    """A hand-made (unsigned) update envelope around ``body`` (a list packed as the body bin)."""
    return msgpack.packb([1, 4, rnd, sender, seq, 0, msgpack.packb(body, use_bin_type=True)], use_bin_type=True)


def _tamper_result(index: int, change):
    """agent_hook: agent ``index`` uploads ``change(result, round)`` instead of its algorithm's
    local result (a malicious but protocol-conforming device: signed, right topic, right round)."""
    def hook(i, agent):
        if i != index:
            return
        real = agent.algorithm.local_round

        def local_round(*a, **kw):
            return change(real(*a, **kw), kw["round"])

        agent.algorithm.local_round = local_round

    return hook


def _tamper(index: int, mutate):
    """Agent ``index`` uploads ``mutate(extras, round) -> extras`` instead of its extras."""
    return _tamper_result(index, lambda res, rnd: dataclasses.replace(res, extras=mutate(dict(res.extras), rnd)))


def _tamper_metrics(index: int, metrics: dict):
    """Agent ``index`` adds ``metrics`` to its update's metrics."""
    return _tamper_result(index, lambda res, rnd: dataclasses.replace(res, metrics={**res.metrics, **metrics}))


def _rogue_on_round_start(broker: EmbeddedBroker, fed: str, payloads: list[tuple[str, bytes]]):
    """A raw paho client that publishes ``payloads`` (topic, bytes) when round 1 starts."""
    c = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id=f"rogue-{time.time_ns()}")
    sent = threading.Event()

    def on_message(cl, userdata, msg):
        if not sent.is_set():
            sent.set()
            for topic, payload in payloads:
                cl.publish(topic, payload, qos=1)

    c.on_connect = lambda cl, *_: cl.subscribe(f"fedfleet/v1/{fed}/down/round_start", qos=1)
    c.on_message = on_message
    c.connect(broker.host, broker.port)
    c.loop_start()
    time.sleep(0.3)
    return c, sent


def test_update_with_nil_extras_from_a_rogue_client_is_rejected_and_the_run_goes_on(tmp_path: Path) -> None:
    """One unauthenticated publish (signing off, the default) of an update with ``extras = nil``
    in client-000's name is counted ``invalid``; the round completes with both honest clients,
    whichever arrives first: an unsigned refusal does not make the round stop waiting for the
    device it names, and client-000 ignores the refusal of a seq it never sent."""
    fed = "fed-nil"
    bad = _update_payload("client-000", 1, [[], 10, 0.5, {}, False, None])
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        rogue, sent = _rogue_on_round_start(broker, fed, [(f"fedfleet/v1/{fed}/up/client-000/update", bad)])
        try:
            res = simulate(small_config(run={"rounds": 1}, data={"clients": 2}), broker_url=broker.url,
                           run_dir=tmp_path / fed)
        finally:
            rogue.loop_stop()
    assert sent.is_set()
    assert res.rounds_completed == 1
    m = _metrics(tmp_path / fed)[0]
    assert m["clients_reported"] == 2 and m["invalid"] >= 1


@pytest.mark.parametrize("sign", [False, True], ids=["unsigned", "signed"])
def test_fpl_prototypes_of_another_width_are_refused_not_a_server_crash(tmp_path: Path, sign: bool) -> None:
    """FPL, round 1: one client uploads 32-d prototypes, the others the model's 64-d. The width is
    the classifier's input width (known from the update's model tensors, before any broadcast),
    so the 32-d update is refused (``invalid`` 1) and the round aggregates the other two. Who
    ends the wait for the refused device: signing off, the device itself, told by the receipt
    for its own seq (``withdrawn`` 1: its idle status); signing on, the server at once (the
    update's signature is the device's), so the device's idle status comes too late to count
    (``withdrawn`` 0)."""
    cfg = small_config(run={"rounds": 1}, data={"clients": 3}, train={"algorithm": "fpl"},
                       server={"round_deadline_s": 12.0}, security={"sign": sign})
    hook = _tamper(0, lambda ex, r: {**ex, "prototypes": np.ascontiguousarray(ex["prototypes"][:, :32])})
    res = simulate(cfg, run_dir=tmp_path / "run", agent_hook=hook)
    m = _metrics(tmp_path / "run")[0]
    assert res.rounds_completed == 1
    assert m["clients_reported"] == 2 and m["invalid"] == 1 and not m["skipped"]
    assert m["withdrawn"] == (0 if sign else 1)


def test_fedproto_class_id_out_of_range_does_not_kill_the_honest_agents(tmp_path: Path) -> None:
    """FedProto (no model shared): a client adds a prototype for class 10 of a 10-class task. The
    server (which binds its model) refuses that update, so round 2's global prototypes hold
    only valid classes: no agent errors, all three report in round 2."""
    cfg = small_config(run={"rounds": 2}, data={"clients": 3}, train={"algorithm": "fedproto"},
                       server={"client_eval": True, "client_eval_max": 50, "round_deadline_s": 12.0})

    def add_class_10(ex, r):
        if r != 1:
            return ex
        p, c, n = ex["prototypes"], ex["proto_classes"], ex["proto_counts"]
        return {"prototypes": np.concatenate([p, p[:1]]), "proto_classes": np.append(c, 10).astype(np.int64),
                "proto_counts": np.append(n, 1).astype(np.int64)}

    simulate(cfg, run_dir=tmp_path / "run", agent_hook=_tamper(0, add_class_10))
    s = _summary(tmp_path / "run")
    m = _metrics(tmp_path / "run")
    assert s["agent_errors"] == []
    assert m[0]["invalid"] >= 1 and m[1]["clients_reported"] == 3


def test_agent_survives_an_unreadable_extras_codec_in_round_start(tmp_path: Path) -> None:
    """A round_start whose extras_codec the agent cannot parse (a server of another version): the
    agent logs it and sends its extras with the update codec; both clients report."""
    cfg = small_config(run={"rounds": 1}, data={"clients": 2}, train={"algorithm": "scaffold"},
                       server={"round_deadline_s": 20.0})

    def hook(i, agent):
        real = agent._handle

        def handle(item):
            body = item.envelope.body
            if type(body).__name__ == "RoundStart":
                body = dataclasses.replace(body, config={**body.config, "extras_codec": "int8,fp16"})
                env = dataclasses.replace(item.envelope, body=body)
                item = dataclasses.replace(item, decoded=dataclasses.replace(item.decoded, envelope=env))
            return real(item)

        agent._handle = handle

    res = simulate(cfg, run_dir=tmp_path / "run", agent_hook=hook)
    assert _summary(tmp_path / "run")["agent_errors"] == []
    assert res.metrics[0]["clients_reported"] == 2


@pytest.mark.parametrize("text, unknown", [("prototypes=fp16,protoypes=int8", ["'protoypes'"]),
                                           ("prototypes=fp16,proto_classes=fp32", [])])
def test_extras_codec_name_that_nothing_carries_is_warned_about(tmp_path: Path, caplog, text: str,
                                                                unknown: list[str]) -> None:
    """A per-name extras_codec entry that nothing in the run carries (a typo) is warned about once,
    by name, with the names the run did carry (FedProto: prototypes, proto_classes,
    proto_counts); names that are carried raise no warning."""
    cfg = small_config(run={"rounds": 2}, data={"clients": 2}, train={"algorithm": "fedproto"},
                       protocol={"extras_codec": text}, server={"round_deadline_s": 20.0})
    with caplog.at_level(logging.WARNING, logger="broker_server.server"):
        res = simulate(cfg, run_dir=tmp_path / "run")
    assert res.metrics[1]["clients_reported"] == 2
    warned = [r.getMessage() for r in caplog.records if "extras_codec names" in r.getMessage()]
    if unknown:
        assert len(warned) == 1 and "'protoypes'" in warned[0] and "'prototypes'" not in warned[0]
        assert "proto_classes, proto_counts, prototypes" in warned[0]  # what the run did carry
    else:
        assert warned == []


@pytest.mark.parametrize("bad", [{"eval_accuracy": "high"}, {"eval_accuracy": 0.5, "eval_macro_f1": float("nan")}],
                         ids=["str", "f1-nan"])
def test_a_clients_eval_metrics_cannot_crash_or_poison_the_round(tmp_path: Path, bad: dict) -> None:
    """An update whose client-side evaluation metrics are not fractions in [0, 1] (a string, NaN)
    is refused with a reason (``invalid`` 1); the round finishes with the other client and
    its client_accuracy_mean / client_f1_mean stay in [0, 1]."""
    # the deadline is a bound: the round ends once both devices have answered (the refused one withdraws)
    cfg = small_config(run={"rounds": 1}, data={"clients": 2}, server={"round_deadline_s": 30.0, "quorum": 1})
    res = simulate(cfg, run_dir=tmp_path / "run", agent_hook=_tamper_metrics(0, bad))
    assert res.rounds_completed == 1
    m = _metrics(tmp_path / "run")[0]
    assert m["clients_reported"] == 1 and m["invalid"] == 1
    mean = m.get("client_accuracy_mean")
    assert mean is None or 0.0 <= mean <= 1.0
    f1 = m.get("client_f1_mean")
    assert f1 is None or 0.0 <= f1 <= 1.0
