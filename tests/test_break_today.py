"""Break-it pass over what was added on the extras/algorithms/security day.

Each test is a minimal reproducer of one problem found by attacking the new code: the ``extras``
map of ``global``/``update`` bodies, each strategy's ``validate`` and aggregation under
adversarial but well-formed updates, ``--resume`` of stateful strategies, the security layer and
the new configuration keys. Federations use scikit-learn's digits, 1–2 rounds and 2–3 clients.
Tests of problems not fixed yet are ``xfail(strict=True)`` with the reason; the rest guard the
fixes (or behaviour that held and is worth keeping).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import paho.mqtt.client as mqtt
import pytest
import torch
from test_federation import small_config

from broker_server.embedded_broker import EmbeddedBroker
from broker_server.simulate import simulate
from broker_server.strategies import ClientResult, accumulator_for, apply_update
from protocol.errors import ProtocolError
from protocol.messages import Kind, decode
from protocol.tensors import encode_tensor

pytestmark = pytest.mark.slow


# ------------------------------------------------------------------------------------------ helpers


def _update_payload(sender: str, rnd: int, body: list, seq: int = 1_000) -> bytes:
    """A hand-made (unsigned) update envelope around ``body`` (a list packed as the body bin)."""
    return msgpack.packb([1, 4, rnd, sender, seq, 0, msgpack.packb(body, use_bin_type=True)], use_bin_type=True)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


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


def _result(cid: str, tensors=(), n: int = 10, **extras) -> ClientResult:
    return ClientResult(cid, tuple(tensors), n, 0.5, {}, extras=extras)


def _lightcnn():
    """The server's model of the digits tests: LightCNN 1×8×8, classifier [10, 64]."""
    from edge_agent.models import build_model

    return build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)


def _protos(k: int, d: int, classes=None, counts=None) -> dict:
    return {"prototypes": np.ones((k, d), np.float32),
            "proto_classes": np.arange(k, dtype=np.int64) if classes is None else np.asarray(classes, np.int64),
            "proto_counts": np.ones(k, np.int64) if counts is None else np.asarray(counts, np.int64)}


# ------------------------------------------------------------------------- the extras map on the wire


@pytest.mark.parametrize("kind_fields", [
    pytest.param(([], 10, 0.5, {}, False, None), id="update-extras-nil"),
], )
def test_decode_refuses_nil_extras_with_a_protocol_error(kind_fields) -> None:
    """An ``update`` whose 6th body field (extras) is msgpack nil: decode() must raise a
    ProtocolError ("nothing else escapes"), not AttributeError from the codec summary."""
    with pytest.raises(ProtocolError):
        decode(_update_payload("client-000", 1, list(kind_fields)))


def test_decode_refuses_nil_extras_in_a_global() -> None:
    body = msgpack.packb([[], {}, None], use_bin_type=True)
    with pytest.raises(ProtocolError):
        decode(msgpack.packb([1, 3, 1, "server", 7, 0, body], use_bin_type=True))


def test_update_with_nil_extras_from_a_rogue_client_is_rejected_and_the_run_goes_on(tmp_path: Path) -> None:
    """One unauthenticated publish (signing off, the default) of an update with ``extras = nil``
    used to crash the server: AttributeError escaped Channel.accept -> pump -> run."""
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


# ------------------------------------------------------------- prototype strategies (FedProto, FPL)


def test_fpl_prototypes_of_another_width_are_refused_not_a_server_crash(tmp_path: Path) -> None:
    """FPL, round 1: one client uploads 32-d prototypes, the others the model's 64-d. FPL's
    validate only compared widths with the previous round's broadcast (none in round 1), so both
    were accepted and FINCH's fpl_prototypes raised ValueError in acc.result(): the server died.
    The width is the classifier's input width, known from the model tensors of the update."""
    cfg = small_config(run={"rounds": 1}, data={"clients": 3}, train={"algorithm": "fpl"},
                       server={"round_deadline_s": 12.0})
    hook = _tamper(0, lambda ex, r: {**ex, "prototypes": np.ascontiguousarray(ex["prototypes"][:, :32])})
    res = simulate(cfg, run_dir=tmp_path / "run", agent_hook=hook)
    m = _metrics(tmp_path / "run")[0]
    assert res.rounds_completed == 1
    assert m["clients_reported"] == 2 and m["invalid"] == 1 and not m["skipped"]


def test_fpl_refuses_class_ids_outside_the_model() -> None:
    """FPL validate: class id 10 of a 10-class model and a huge id (C is the classifier's output
    width); FPL's clients would otherwise receive cluster prototypes of classes they cannot index."""
    from broker_server.strategies.fpl import FPL

    head = [np.zeros((64, 1, 3, 3), np.float32), np.zeros((10, 64), np.float32), np.zeros(10, np.float32)]
    s = FPL()
    assert s.validate(_result("a", head, **_protos(2, 64, [0, 10]))) is not None
    assert s.validate(_result("a", head, **_protos(2, 64, [0, 10**12]))) is not None
    assert s.validate(_result("a", head, **_protos(2, 64, [0, 9]))) is None


def test_fedproto_class_id_out_of_range_does_not_kill_the_honest_agents(tmp_path: Path) -> None:
    """FedProto (no model shared): a client adds a prototype for class 10 (the task has 10
    classes). The server accepted it and broadcast it in round 2's global prototypes; every honest
    agent then raised ModelError in prototype_table ("classes must be ... in [0, 10)") and its
    thread died: one device took the whole federation down. Fixed: the server binds its model,
    FedProto refuses class ids outside [0, C)."""
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


def test_fedproto_round1_width_is_not_decided_by_the_first_reporter() -> None:
    """FedProto knew no width before its first aggregate: the first update of round 1 fixed it,
    so a 3-d upload arriving first made every honest 64-d upload "cannot aggregate" (and the
    next round's global prototypes 3-d). Fixed: the server binds its model (d = 64)."""
    from broker_server.strategies.fedproto import FedProto

    s = FedProto()
    s.bind_model(_lightcnn())
    acc = accumulator_for(s, 1, [])
    evil, good = _result("evil", **_protos(2, 3)), _result("good", **_protos(2, 64))
    for r in (evil, good):
        if s.validate(r) is None:
            try:
                acc.add(r)
            except ValueError:
                pass
    apply_update(s, 1, acc.result())
    assert s.prototypes.shape[1] == 64


def test_fedproto_avg_does_not_aggregate_the_model_of_a_refused_update() -> None:
    """FedProtoAccumulator.add folded the model into the FedAvg sums BEFORE the prototypes, whose
    add can raise (width clash): the server then refused the update ("cannot aggregate") but its
    model stayed in the round's average."""
    from broker_server.strategies.fedproto import FedProtoAvg

    s = FedProtoAvg()
    acc = accumulator_for(s, 1, [np.zeros((2, 2), np.float32)])
    acc.add(_result("a", [np.ones((2, 2), np.float32)], **_protos(2, 3)))
    with pytest.raises(ValueError):
        acc.add(_result("b", [np.full((2, 2), 100.0, np.float32)], **_protos(2, 64)))
    np.testing.assert_array_equal(apply_update(s, 1, acc.result())[0], np.ones((2, 2), np.float32))


def test_fedpad_proto_counts_that_overflow_int64_are_refused() -> None:
    """FedPAD validate checks Σ proto_counts ≤ num_samples with numpy's int64 sum, which wraps:
    four counts of 2**62 sum to 0 and passed."""
    from broker_server.strategies.fedpad import FedPAD

    head = [np.zeros((10, 64), np.float32), np.zeros(10, np.float32)]
    reason = FedPAD().validate(_result("a", head, n=10, **_protos(4, 64, counts=[2**62] * 4)))
    assert reason is not None and "num_samples" in reason


def test_fedproto_count_weighting_is_not_owned_by_one_client_claiming_huge_counts() -> None:
    """weighting = "count" (the paper's |D_i,c|): a client that claims 10**15 samples of every
    class (num_samples = 10) owns every global prototype. Counts should be bounded by what the
    update stands for (num_samples × local_epochs: the client counts features over all epochs);
    fixed: FedProto.validate refuses a larger Σ proto_counts."""
    from broker_server.strategies.fedproto import FedProto

    s = FedProto(weighting="count", train_config={"local_epochs": 1})
    evil = _result("evil", n=10, **{**_protos(2, 4, counts=[10**15, 10**15]),
                                    "prototypes": np.full((2, 4), 100.0, np.float32)})
    assert s.validate(evil) is not None


# ------------------------------------------ round 1: the bound model pins the extras' shapes


def test_scaffold_first_reporter_does_not_decide_the_control_variate_size() -> None:
    """Round 1, c is still None: validate accepted a control_delta of any length, the first one
    folded in fixes the size, every honest update is then refused ("cannot aggregate") and c of
    the wrong size is broadcast; every honest client's begin_round raises ModelError next round
    (unflatten: "the model has P parameters"). P is the model's parameter count, known up front:
    fixed by the server's bind_model."""
    from broker_server.strategies.scaffold import Scaffold

    s = Scaffold()
    s.bind_model(torch.nn.Linear(4, 1))  # P = 4 weights + 1 bias = 5
    model = [np.zeros(5, np.float32)]
    acc = accumulator_for(s, 1, model)
    evil = _result("evil", [np.ones(5, np.float32)], control_delta=np.ones(3, np.float32))
    good = _result("good", [np.ones(5, np.float32)], control_delta=np.ones(5, np.float32))
    for r in (evil, good):
        if s.validate(r) is None:
            try:
                acc.add(r)
            except ValueError:
                pass
    apply_update(s, 1, acc.result())
    assert s.control is not None and s.control.shape == (5,)


def test_fedmcp_first_reporter_does_not_decide_the_teacher_prototype_width() -> None:
    """Round 1 (no teacher yet): validate accepted prototypes [C, d] for any d, the first one
    folded in fixes d, honest [C, 64] uploads are refused and the [C, 3] teacher is broadcast
    (the honest clients' alignment then raises on the shape). Fixed: d from the bound model."""
    from broker_server.strategies.fedmcp import FedMCP

    P, C = 50, 10
    s = FedMCP(proxy_y=np.arange(P, dtype=np.int64) % C, num_classes=C, proxy_size=P)
    s.bind_model(_lightcnn())
    soft = np.full((P, C), 0.1, np.float32)
    acc = accumulator_for(s, 1, [])
    for cid, d in (("evil", 3), ("good", 64)):
        r = _result(cid, soft_predictions=soft, prototypes=np.ones((C, d), np.float32))
        if s.validate(r) is None:
            try:
                acc.add(r)
            except ValueError:
                pass
    apply_update(s, 1, acc.result())
    assert s.teacher_protos.shape == (C, 64)


# ------------------------------------------------------------------ configuration of the new keys


@pytest.mark.parametrize("text", ["int8,soft_predictions=fp16", "int8,fp16", " , ", "prototypes=int8, ",
                                  "soft_predictions=int8,=fp16", "a/b=int8", "p=int8,p=fp16"])
def test_extras_codec_the_agents_cannot_read_is_refused_by_the_config(text: str) -> None:
    """config.validate parsed each comma part on its own, the agent the whole text: these passed
    the server's validation and then raised ValueError in every agent's _maybe_train (uncaught:
    the agent threads died after their first local round)."""
    from broker_server.errors import ConfigError

    with pytest.raises(ConfigError, match="extras_codec"):
        small_config(protocol={"extras_codec": text})


@pytest.mark.parametrize("text", ["", "int8", "fp16+zstd", "soft_predictions=int8+zstd,prototypes=fp16+zstd",
                                  " prototypes = fp16 "])
def test_extras_codec_that_the_config_accepts_the_agent_reads(text: str) -> None:
    from edge_agent.agent import extras_codecs
    from protocol.tensors import Codec

    small_config(protocol={"extras_codec": text})
    ex = {"soft_predictions": np.zeros(2, np.float32), "prototypes": np.zeros(2, np.float32)}
    extras_codecs(text, ex, Codec.parse("fp32"))


def test_agent_survives_an_unreadable_extras_codec_in_round_start(tmp_path: Path) -> None:
    """A round_start whose extras_codec the agent cannot parse (a server of another version):
    the agent logs it and sends its extras with the update codec instead of dying."""
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
    """A per-name extras_codec entry with a typo used to be silently ignored (that entry kept the
    update codec). FedProto's updates carry prototypes, proto_classes and proto_counts, its
    globals prototypes and proto_classes: a name outside those is warned about once, by name."""
    import logging

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


@pytest.mark.parametrize("params", [{"proxy_size": "x"}, {"proxy_size": 100, "proxy_seed": "x"}])
def test_fedmcp_bad_proxy_keys_are_a_config_error_not_a_traceback(params: dict) -> None:
    """make_strategy ran the strategy's data setup (which reads [algorithm] proxy_size and
    proxy_seed) outside its try: `fedfleet simulate` printed a ValueError traceback."""
    from broker_server.errors import ConfigError
    from broker_server.runtime import make_strategy
    from edge_agent.data import load_dataset

    cfg = small_config(train={"algorithm": "fedmcp"}, algorithm=params)
    with pytest.raises(ConfigError, match=r"\[algorithm\]"):
        make_strategy(cfg, load_dataset("digits"))


# ----------------------------------------------------------- kill -9 and --resume, stateful strategies


def _spy(broker: EmbeddedBroker, fed: str):
    from test_federation import Spy

    return Spy(broker.host, broker.port)


from test_chaos import _checkpoint_round  # noqa: E402  (one reader of a run's checkpoint round)


def _kill_and_resume(tmp_path: Path, cfg, *, kill_after: int = 1):
    """Run ``fedfleet simulate`` in a subprocess against a broker of this process, SIGKILL it once
    its checkpoint of round ``kill_after`` is written, then ``simulate(..., resume=True)`` here
    with a spy on the broker. Returns (result, checkpoint at the kill, the spied messages of the
    resumed session, the run folder)."""
    import os
    import signal
    import subprocess
    import sys

    from broker_server.checkpoint import CheckpointStore

    repo = Path(__file__).resolve().parents[1]
    toml = tmp_path / "cfg.toml"
    toml.write_text(cfg.to_toml(), encoding="utf-8")
    run = tmp_path / "run"
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        log = open(tmp_path / "crashed.log", "wb")
        p = subprocess.Popen([sys.executable, "-m", "broker_server.cli", "simulate", "--config", str(toml), "--out",
                              str(run), "--broker", broker.url, "-q"], cwd=repo, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, "FEDFLEET_OFFLINE": "1"})
        log.close()
        try:
            t0 = time.monotonic()
            while _checkpoint_round(run / "checkpoints.sqlite") < kill_after and p.poll() is None:
                assert time.monotonic() - t0 < 120, "no checkpoint"
                time.sleep(0.05)
            assert p.poll() is None, (tmp_path / "crashed.log").read_text()[-3000:]
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        finally:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        store = CheckpointStore(run / "checkpoints.sqlite")
        ckpt = store.load()
        store.close()
        spy = _spy(broker, run.name)
        try:
            res = simulate(cfg, broker_url=broker.url, run_dir=run, resume=True)
            time.sleep(0.3)
        finally:
            spy.close()
    msgs = []
    for topic, payload, _ in spy.messages:
        if payload:
            try:
                msgs.append((topic, decode(payload).envelope))
            except ProtocolError:
                pass
    return res, ckpt, msgs, run


def _resume_cfg(name: str, **over):
    sections = {"run": {"rounds": 2}, "data": {"clients": 2}, "train": {"algorithm": name},
                "server": {"quorum": 2, "round_deadline_s": 30.0}}
    for k, v in over.items():
        sections.setdefault(k, {}).update(v)
    return small_config(**sections)


def _globals(msgs, rnd):
    return [env.body for _, env in msgs if type(env.body).__name__ == "Global" and env.round == rnd]


def _check_resumed(res, ckpt, run):
    assert ckpt.round >= 1
    assert res.rounds_completed == 2
    assert [m["round"] for m in _metrics(run)] == [1, 2]
    assert _summary(run)["agent_errors"] == []
    assert all(m["clients_reported"] == 2 and not m["skipped"] for m in _metrics(run))


@pytest.mark.parametrize("algorithm,over,extras", [
    ("scaffold", {}, ("control",)),
    ("fedpad", {}, ("prototypes", "proto_classes")),
    ("fedmcp", {"algorithm": {"proxy_size": 100}, "server": {"client_eval": True, "client_eval_max": 50}},
     ("teacher_soft_predictions", "teacher_prototypes")),
])
def test_resume_broadcasts_the_restored_state(tmp_path: Path, algorithm: str, over: dict, extras: tuple) -> None:
    """kill -9 after round 1's checkpoint; the resumed server's round-2 global carries exactly the
    strategy state of that checkpoint (SCAFFOLD c, FedPAD's global prototypes, FedMCP's teacher)."""
    res, ckpt, msgs, run = _kill_and_resume(tmp_path, _resume_cfg(algorithm, **over))
    _check_resumed(res, ckpt, run)
    if ckpt.round >= 2:
        pytest.skip(reason="the server was killed after the last round: there is no round-2 global to check")
    g = _globals(msgs, 2)
    assert g, "no round-2 global seen"
    from broker_server.runtime import make_strategy
    from edge_agent.data import load_dataset

    s = make_strategy(_resume_cfg(algorithm, **over), load_dataset("digits"))
    s.load_state_dict(ckpt.strategy_state)
    want = s.global_extras()
    assert set(want) == set(extras) and set(g[-1].extras) == set(extras)
    for name in extras:
        np.testing.assert_array_equal(g[-1].extras[name], want[name])


def test_resume_fedadam_keeps_its_moments(tmp_path: Path) -> None:
    """FedAdam after kill -9 + resume: the step count and the moments continue from the checkpoint
    (m_2 = β1·m_1 + (1−β1)·Δ_2 with Δ_2 from the resumed round's updates)."""
    from broker_server.checkpoint import CheckpointStore

    res, ckpt, msgs, run = _kill_and_resume(tmp_path, _resume_cfg("fedadam"))
    _check_resumed(res, ckpt, run)
    store = CheckpointStore(run / "checkpoints.sqlite")
    final = store.load(2).strategy_state
    store.close()
    assert final["steps"] == 2 and ckpt.strategy_state["steps"] == ckpt.round
    if ckpt.round == 1:
        ups = {env.sender: env.body for _, env in msgs if type(env.body).__name__ == "Update" and env.round == 2}
        n = sum(u.num_samples for u in ups.values())
        mean = [sum(u.num_samples * np.asarray(u.tensors[i], np.float64) for u in ups.values()) / n
                for i in range(len(ckpt.tensors))]
        delta = [m - np.asarray(w, np.float64) for m, w in zip(mean, ckpt.tensors)]
        m2 = [0.9 * m1 + 0.1 * d for m1, d in zip(ckpt.strategy_state["m"], delta)]
        for a, b in zip(m2, final["m"]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)


def test_resume_feddyn_keeps_h(tmp_path: Path) -> None:
    """FedDyn after kill -9 + resume: h_2 = h_1 − (α/N)·Σ_i (w_i − w_g) from the checkpoint's h_1."""
    from broker_server.checkpoint import CheckpointStore

    res, ckpt, msgs, run = _kill_and_resume(tmp_path, _resume_cfg("feddyn"))
    _check_resumed(res, ckpt, run)
    if ckpt.round >= 2:
        pytest.skip(reason="the server was killed after the last round: there is no round-2 global to check")
    store = CheckpointStore(run / "checkpoints.sqlite")
    final = store.load(2).strategy_state
    store.close()
    ups = [env.body for _, env in msgs if type(env.body).__name__ == "Update" and env.round == 2]
    alpha, N = 0.01, final["clients_seen"]
    for i, (h1, h2) in enumerate(zip(ckpt.strategy_state["h"], final["h"])):
        s = sum(np.asarray(u.tensors[i], np.float64) - ckpt.tensors[i] for u in ups)
        np.testing.assert_allclose(h2, h1 - alpha / N * s, rtol=1e-5, atol=1e-9)


# ------------------------------------------------------------------------------- the security layer


def _sec_upd(seq: int, rnd: int = 1, sender: str = "pi-07") -> bytes:
    from protocol.messages import Envelope, Update, encode

    return encode(Envelope(round=rnd, sender=sender, seq=seq,
                           body=Update((np.zeros(3, np.float32),), 10, 0.5))).payload


def _sec_open(server, topic: str, payload: bytes):
    from protocol import topics

    info = topics.parse(topic)
    return server.open(topic, info.client_id, info.direction, payload)


def test_a_stray_file_in_enrolled_does_not_freeze_the_live_allow_list(tmp_path: Path) -> None:
    """AllowList re-reads enrolled/ when it changes, through list_enrolled, which raises on any
    malformed file; the error was swallowed after the new mtime was recorded, so from then on the
    running server kept its old list: `fedfleet keys revoke` reported success and the revoked
    device stayed allowed, new enrolments never applied."""
    from protocol import security as S

    srv = S.generate_identity("server")
    S.write_key_dir(srv, tmp_path / "server")
    a, b = S.generate_identity("pi-a"), S.generate_identity("pi-b")
    S.enroll(tmp_path / "server", a.public)
    allow = S.AllowList(tmp_path / "server")
    assert allow.get("pi-a") is not None
    (tmp_path / "server" / "enrolled" / "notes.pub").write_text("not a key")
    time.sleep(1.05)
    assert allow.get("pi-a") is not None  # the stray file costs nobody their enrolment
    assert S.revoke(tmp_path / "server", "pi-a")
    S.enroll(tmp_path / "server", b.public)
    time.sleep(1.05)
    assert allow.get("pi-a") is None and allow.get("pi-b") is not None


def test_a_file_written_after_a_failed_read_is_picked_up(tmp_path: Path) -> None:
    """A half-written <id>.pub (cp into enrolled/) seen by a re-read: once complete it is loaded."""
    from protocol import security as S

    srv = S.generate_identity("server")
    S.write_key_dir(srv, tmp_path / "server")
    (tmp_path / "server" / "enrolled").mkdir(exist_ok=True)
    allow = S.AllowList(tmp_path / "server")
    c = S.generate_identity("pi-c")
    target = tmp_path / "server" / "enrolled" / "pi-c.pub"
    target.write_text(c.public.to_text()[:20])  # the copy has begun
    time.sleep(1.05)
    assert allow.get("pi-c") is None
    target.write_text(c.public.to_text())  # ... and finished (the folder's mtime does not change)
    time.sleep(1.05)
    assert allow.get("pi-c") is not None


def test_a_device_re_keyed_under_its_id_is_not_locked_out_by_its_old_epoch(tmp_path: Path) -> None:
    """The server's replay state was keyed by the sender id alone: after a device was re-provisioned
    (new keys, `fedfleet keys enroll --replace`, epoch counter from 0 again) every message of its
    new key was `stale_epoch` until the server restarted. Old-key messages stay refused (their
    signature no longer verifies)."""
    from protocol import security as S
    from protocol import topics
    from protocol.errors import SecurityRejection

    srv = S.generate_identity("server")
    S.write_key_dir(srv, tmp_path / "server")
    old = S.generate_identity("pi-07")
    S.enroll(tmp_path / "server", old.public)
    server = S.ChannelSecurity(srv, side="server", peers=S.AllowList(tmp_path / "server"), epoch=1)
    up = topics.up("fed", "pi-07", Kind.UPDATE)
    dev_old = S.ChannelSecurity(old, side="agent", peers={"server": srv.public}, epoch=5)
    old_msg = dev_old.seal(up, _sec_upd(1)).payload
    _sec_open(server, up, old_msg)
    new = S.generate_identity("pi-07")
    S.enroll(tmp_path / "server", new.public, replace=True)
    time.sleep(1.05)
    dev_new = S.ChannelSecurity(new, side="agent", peers={"server": srv.public}, epoch=1)
    assert _sec_open(server, up, dev_new.seal(up, _sec_upd(1)).payload).epoch == 1
    with pytest.raises(SecurityRejection) as err:
        _sec_open(server, up, dev_old.seal(up, _sec_upd(2)).payload)
    assert err.value.code == "bad_signature"


def test_a_device_message_from_before_its_restart_is_refused_by_a_restarted_server(tmp_path: Path) -> None:
    """README: "a restarted device is accepted while its old messages are not". That holds while
    the server runs; a server restarted (or resumed) after the device's restart has forgotten
    the device's newest epoch, so a recorded message of the device's previous session (here a
    join-like update of epoch 1) is accepted if it arrives before the device speaks again."""
    from protocol import security as S
    from protocol import topics
    from protocol.errors import SecurityRejection

    srv = S.generate_identity("server")
    S.write_key_dir(srv, tmp_path / "server")
    srv = S.load_identity(tmp_path / "server")
    dev = S.generate_identity("pi-07")
    S.write_key_dir(dev, tmp_path / "dev")
    dev = S.load_identity(tmp_path / "dev")
    S.enroll(tmp_path / "server", dev.public)
    up = topics.up("fed", "pi-07", Kind.UPDATE)
    server1 = S.ChannelSecurity(srv, side="server", peers=S.AllowList(tmp_path / "server"))
    boot1 = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public})
    recorded = boot1.seal(up, _sec_upd(1)).payload
    _sec_open(server1, up, recorded)
    boot2 = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public})  # the device restarts
    _sec_open(server1, up, boot2.seal(up, _sec_upd(1)).payload)
    server2 = S.ChannelSecurity(srv, side="server", peers=S.AllowList(tmp_path / "server"))  # the server restarts
    with pytest.raises(SecurityRejection):
        _sec_open(server2, up, recorded)


def test_another_enrolled_devices_valid_signature_cannot_speak_for_a_device(tmp_path: Path) -> None:
    """pi-a (enrolled) signs an update naming pi-b as sender on pi-b's topic (bad_signature), and
    one naming itself on pi-b's topic (sender_mismatch); its chunks of a transfer likewise."""
    from protocol import security as S
    from protocol import topics
    from protocol.errors import SecurityRejection

    srv = S.generate_identity("server")
    a, b = S.generate_identity("pi-a"), S.generate_identity("pi-b")
    server = S.ChannelSecurity(srv, side="server", peers=S.AllowList(None, {"pi-a": a.public, "pi-b": b.public}),
                               epoch=1)
    dev_a = S.ChannelSecurity(a, side="agent", peers={"server": srv.public}, epoch=1)
    up_b = topics.up("fed", "pi-b", Kind.UPDATE)
    codes = []
    for payload in (dev_a.seal(up_b, _sec_upd(1, sender="pi-b")).payload,
                    dev_a.seal(up_b, _sec_upd(2, sender="pi-a")).payload):
        with pytest.raises(SecurityRejection) as err:
            _sec_open(server, up_b, payload)
        codes.append(err.value.code)
    assert codes == ["bad_signature", "sender_mismatch"]


@pytest.mark.parametrize("name", ["fedpad", "fedproto", "fpl"])
def test_prototype_updates_with_unknown_extras_are_refused(name: str) -> None:
    """FedPAD buffers whole updates until the round ends: 60 junk extras of 1 MB each (inside the
    decode budget) were accepted and held in memory per client; FedProto and FPL accepted them too."""
    from broker_server.strategies import get_strategy

    head = [np.zeros((10, 64), np.float32), np.zeros(10, np.float32)]
    junk = {f"junk{i}": np.zeros(4, np.float32) for i in range(3)}
    r = _result("a", head if name != "fedproto" else (), **_protos(2, 64), **junk)
    reason = get_strategy(name).validate(r)
    assert reason is not None and "junk0" in reason


# ---------------------------------------------------------------- client-side evaluation (client_eval)


def _tamper_metrics(index: int, metrics: dict):
    """Agent ``index`` adds ``metrics`` to its update's metrics."""
    return _tamper_result(index, lambda res, rnd: dataclasses.replace(res, metrics={**res.metrics, **metrics}))


@pytest.mark.parametrize("bad", [{"eval_accuracy": "high"}, {"eval_accuracy": 0.5, "eval_macro_f1": float("nan")}],
                         ids=["str", "f1-nan"])
def test_a_clients_eval_metrics_cannot_crash_or_poison_the_round(tmp_path: Path, bad: dict) -> None:
    """server._extra_metrics did float(m["eval_accuracy"]) on the update's free metrics map (any
    scalar, NaN included): a string raised ValueError in run_round (the server died after the
    round), NaN or 7.0 became the round's client_accuracy_mean. Such an update should be refused
    with a reason and the run finish with sane numbers."""
    cfg = small_config(run={"rounds": 1}, data={"clients": 2}, server={"round_deadline_s": 12.0, "quorum": 1})
    res = simulate(cfg, run_dir=tmp_path / "run", agent_hook=_tamper_metrics(0, bad))
    assert res.rounds_completed == 1
    m = _metrics(tmp_path / "run")[0]
    assert m["clients_reported"] == 1 and m["invalid"] == 1
    mean = m.get("client_accuracy_mean")
    assert mean is None or 0.0 <= mean <= 1.0
    f1 = m.get("client_f1_mean")
    assert f1 is None or 0.0 <= f1 <= 1.0


def test_eval_metric_values_the_server_takes() -> None:
    from broker_server.server import _is_fraction

    assert [_is_fraction(v) for v in (0, 1, 0.5, 1.0)] == [True] * 4
    assert not any(_is_fraction(v) for v in ("0.5", float("nan"), float("inf"), -0.1, 7.0, True, None))
