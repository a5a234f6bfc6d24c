"""Personalised and knowledge-only baselines: FedPer, FedRep, Local (SPECS §5.5, §6.15, §6.16).

What is checked against independent calculations: which tensors travel (the backbone entries by
name, nothing for Local), the server's backbone average (``np.average`` with explicit weights),
the private heads (they stay on the device and differ between clients, while the loaded backbones
equal the server's average), FedPer's training (bit-identical to the FedAvg client on the whole
model), FedRep's two phases (each leaves the other half bit-identical; the result matches a
hand-written head-then-body SGD loop), and Local's tensor-less update over the real codec.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from broker_server.strategies import ClientResult, get_strategy
from broker_server.strategies.fedper import FedPer
from broker_server.strategies.fedrep import FedRep
from broker_server.strategies.local import Local
from edge_agent.algorithms import TrainConfig, get_client_algorithm, get_client_algorithm_class, shared_indices
from edge_agent.algorithms import fedrep as fedrep_mod
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.algorithms.fedper import FedPerClient
from edge_agent.algorithms.fedrep import FedRepClient, frozen, head_epochs_param, is_backbone
from edge_agent.algorithms.local import LocalClient
from edge_agent.models import build_model
from protocol.messages import Envelope, Update, decode, encode

CPU = torch.device("cpu")
SIZE, CLASSES, FEAT = 8, 3, 8
BACKBONE = ["backbone.conv1.weight", "backbone.conv1.bias", "backbone.conv2.weight", "backbone.conv2.bias",
            "backbone.fc.weight", "backbone.fc.bias"]
HEAD = ["classifier.weight", "classifier.bias"]


def _model(seed: int = 1234) -> torch.nn.Module:
    torch.manual_seed(seed)  # initial weights only; training never reads the global RNG
    return build_model("lightcnn", in_channels=1, image_size=SIZE, num_classes=CLASSES, feature_dim=FEAT)


def _shard(n: int, seed: int, classes: tuple[int, ...] = (0, 1, 2)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, SIZE, SIZE, generator=g)
    y = torch.tensor([classes[i % len(classes)] for i in range(n)], dtype=torch.int64)
    return x, y


def _state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def _backbone(model: torch.nn.Module) -> list[np.ndarray]:
    s = _state(model)
    return [s[n] for n in BACKBONE]


CFG = TrainConfig(local_epochs=2, batch_size=5, lr=0.1, momentum=0.0, weight_decay=0.0, seed=3)


def test_model_names_are_what_the_tests_assume():
    assert list(_model().state_dict()) == BACKBONE + HEAD


# --------------------------------------------------------------------------------------------
# FedPer
# --------------------------------------------------------------------------------------------

def test_fedper_uploads_backbone_and_trains_like_fedavg_on_the_whole_model():
    x, y = _shard(17, seed=5)
    start = _model()
    global_backbone = _backbone(start)
    ours, ref = _model(), _model()
    res = FedPerClient().local_round(ours, tuple(global_backbone), x, y, CFG, round=2, client_index=1, device=CPU)
    # FedPer's local step is FedAvg's ClientUpdate on the whole model (FedAvg's client is itself
    # checked against a hand-written SGD loop in test_fedavg_client.py).
    ref_res = FedAvgClient().local_round(ref, tuple(_state(start).values()), x, y, CFG, round=2, client_index=1,
                                         device=CPU)
    assert res.num_samples == 17 and res.extras == {}
    assert len(res.tensors) == len(BACKBONE)
    for got, name in zip(res.tensors, BACKBONE):
        np.testing.assert_array_equal(got, _state(ref)[name])
    for name in HEAD:  # the head trained too (joint CE) but did not travel
        np.testing.assert_array_equal(_state(ours)[name], _state(ref)[name])
        assert not np.array_equal(_state(ours)[name], _state(start)[name])
    assert res.train_loss == ref_res.train_loss


def test_fedper_round_keeps_heads_private_and_backbones_equal_to_the_server_average():
    """Round 1: two clients train from the same global backbone; the server averages the
    backbones. Round 2 with lr = 0 (training is the identity) shows what the clients hold after
    loading the new global: identical backbones = the weighted mean worked out with np.average,
    and two different private heads (their round-1 heads, which never left the devices)."""
    start = _model()
    g0 = tuple(_backbone(start))
    shards = [_shard(12, seed=11, classes=(0, 1)), _shard(20, seed=12, classes=(1, 2))]
    models = [_model(), _model()]
    algos = [FedPerClient(), FedPerClient()]
    results = [a.local_round(m, g0, x, y, CFG, round=1, client_index=i, device=CPU)
               for i, (a, m, (x, y)) in enumerate(zip(algos, models, shards))]
    heads_r1 = [[_state(m)[n] for n in HEAD] for m in models]

    strategy = FedPer()
    assert strategy.share == "backbone" == algos[0].share
    new = strategy.step(1, list(g0), [ClientResult(f"c{i}", r.tensors, r.num_samples, r.train_loss)
                                          for i, r in enumerate(results)])
    expected = [np.average(np.stack([results[0].tensors[j], results[1].tensors[j]]), axis=0, weights=[12, 20])
                for j in range(len(BACKBONE))]
    assert len(new) == len(BACKBONE)
    for a, b in zip(new, expected):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

    frozen_cfg = TrainConfig(local_epochs=1, batch_size=8, lr=0.0, seed=3)
    for i, (a, m, (x, y)) in enumerate(zip(algos, models, shards)):
        a.local_round(m, tuple(new), x, y, frozen_cfg, round=2, client_index=i, device=CPU)
    for m in models:
        for got, want in zip(_backbone(m), new):
            np.testing.assert_array_equal(got, want)
    for m, head in zip(models, heads_r1):
        for name, want in zip(HEAD, head):
            np.testing.assert_array_equal(_state(m)[name], want)
    assert not np.array_equal(_state(models[0])["classifier.weight"], _state(models[1])["classifier.weight"])


def test_fedper_refuses_a_full_model_as_global():
    from edge_agent.errors import ModelError
    m = _model()
    x, y = _shard(4, seed=1)
    with pytest.raises(ModelError, match="expected for share='backbone'"):
        FedPerClient().local_round(m, tuple(_state(m).values()), x, y, CFG, round=1, client_index=0, device=CPU)


# --------------------------------------------------------------------------------------------
# FedRep
# --------------------------------------------------------------------------------------------

def _reference_fedrep(model, global_backbone, x, y, cfg: TrainConfig, head_epochs: int, *, round: int,
                      client_index: int):
    """FedRep's client round written out by hand (Collins et al. 2021, Alg. 1; plain SGD,
    momentum 0): load φ; τ_h epochs of h ← h − lr·∂L/∂h; then E epochs of φ ← φ − lr·∂L/∂φ, the
    batch order drawn from one generator seeded with the documented formula."""
    with torch.no_grad():
        for name, arr in zip(BACKBONE, global_backbone):
            dict(model.named_parameters())[name].copy_(torch.from_numpy(arr))
    gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + round * 10_007 + client_index) % (2**63 - 1))
    named = dict(model.named_parameters())
    n = len(y)
    for group, epochs in (([named[k] for k in HEAD], head_epochs), ([named[k] for k in BACKBONE], cfg.local_epochs)):
        for _ in range(epochs):
            perm = torch.randperm(n, generator=gen)
            for s in range(0, n, cfg.batch_size):
                idx = perm[s:s + cfg.batch_size]
                loss = F.cross_entropy(model(x[idx]), y[idx])
                grads = torch.autograd.grad(loss, group)
                with torch.no_grad():
                    for p, g in zip(group, grads):
                        p.add_(g, alpha=-cfg.lr)
    return _state(model)


def test_fedrep_matches_a_hand_written_head_then_body_loop():
    x, y = _shard(13, seed=21)
    g0 = tuple(_backbone(_model(seed=99)))  # a global backbone different from the local init
    ours, ref = _model(), _model()
    res = FedRepClient().local_round(ours, g0, x, y, CFG, round=4, client_index=2, device=CPU,
                                     params={"head_epochs": 3})
    want = _reference_fedrep(ref, g0, x, y, CFG, 3, round=4, client_index=2)
    for name, got in zip(BACKBONE, res.tensors):
        np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-6)
    for name in HEAD:
        np.testing.assert_allclose(_state(ours)[name], want[name], rtol=1e-5, atol=1e-6)
    assert res.num_samples == 13 and len(res.tensors) == len(BACKBONE)
    assert {"train_accuracy", "head_train_loss", "head_train_accuracy"} <= set(res.metrics)
    assert all(p.requires_grad for p in ours.parameters())  # the freezing was undone


def test_fedrep_phase_order_each_phase_leaves_the_other_half_bit_identical(monkeypatch):
    """Snapshot the model around each training phase: the head phase (first, head_epochs
    epochs) must not change one bit of the backbone, the body phase (second, local_epochs)
    must not change one bit of the head — with momentum and weight decay on, which would move
    a frozen parameter if the optimizer touched it."""
    calls = []
    real = fedrep_mod.sgd_epochs

    def spy(model, x, y, config, generator, device, **kw):
        before = _state(model)
        out = real(model, x, y, config, generator, device, **kw)
        calls.append((config.local_epochs, before, _state(model)))
        return out

    monkeypatch.setattr(fedrep_mod, "sgd_epochs", spy)
    cfg = TrainConfig(local_epochs=2, batch_size=4, lr=0.1, momentum=0.9, weight_decay=0.01, seed=0)
    x, y = _shard(10, seed=8)
    m = _model()
    FedRepClient().local_round(m, tuple(_backbone(m)), x, y, cfg, round=1, client_index=0, device=CPU,
                               params={"head_epochs": 5})
    assert [c[0] for c in calls] == [5, 2]
    (_, b0, a0), (_, b1, a1) = calls
    for name in BACKBONE:
        np.testing.assert_array_equal(a0[name], b0[name])
        assert not np.array_equal(a1[name], b1[name])
    for name in HEAD:
        assert not np.array_equal(a0[name], b0[name])
        np.testing.assert_array_equal(a1[name], b1[name])


def test_frozen_restores_flags_even_on_error():
    m = _model()
    m.classifier.bias.requires_grad_(False)
    with pytest.raises(RuntimeError):
        with frozen(m, is_backbone):
            assert [p.requires_grad for p in m.parameters()] == [False] * 6 + [True, False]
            raise RuntimeError("boom")
    assert [p.requires_grad for p in m.parameters()] == [True] * 7 + [False]


@pytest.mark.parametrize("params, want", [({}, 1), (None, 1), ({"head_epochs": 10}, 10), ({"head_epochs": 2.0}, 2)])
def test_head_epochs_param(params, want):
    assert head_epochs_param(params) == want


@pytest.mark.parametrize("bad", [0, -1, 1.5, "3", True])
def test_head_epochs_param_refuses(bad):
    with pytest.raises(ValueError, match="head_epochs"):
        head_epochs_param({"head_epochs": bad})
    with pytest.raises(ValueError, match="head_epochs"):
        FedRep(head_epochs=bad)


def test_fedrep_strategy_sends_head_epochs_and_averages_the_backbone():
    s = FedRep(head_epochs=10, train_config={"lr": 0.01})
    plan = s.configure_round(1, ["a", "b", "c"], np.random.default_rng(0))
    assert plan.config == {"lr": 0.01, "head_epochs": 10}
    assert sorted(plan.selected) == ["a", "b", "c"]
    assert s.share == FedRepClient.share == "backbone"
    r = [ClientResult("a", (np.array([1.0, 2.0], np.float32),), 1, 0.0),
         ClientResult("b", (np.array([4.0, 8.0], np.float32),), 3, 0.0)]
    np.testing.assert_allclose(s.step(1, [np.zeros(2, np.float32)], r)[0], [3.25, 6.5])  # (1·x_a + 3·x_b)/4


# --------------------------------------------------------------------------------------------
# Local
# --------------------------------------------------------------------------------------------

def test_local_uploads_nothing_and_keeps_training_its_own_model():
    """Two Local rounds = two FedAvg client rounds, each starting from the device's own model."""
    x, y = _shard(9, seed=2)
    ours, ref = _model(), _model()
    algo = LocalClient()
    assert algo.share == Local.share == "none"
    for rnd in (1, 2):
        res = algo.local_round(ours, (), x, y, CFG, round=rnd, client_index=0, device=CPU)
        FedAvgClient().local_round(ref, tuple(_state(ref).values()), x, y, CFG, round=rnd, client_index=0, device=CPU)
        assert res.tensors == () and res.extras == {} and res.num_samples == 9
        for name, want in _state(ref).items():
            np.testing.assert_array_equal(_state(ours)[name], want)


def test_local_update_without_tensors_round_trips_through_the_protocol():
    res = LocalClient().local_round(_model(), (), *_shard(6, seed=4), CFG, round=1, client_index=0, device=CPU)
    env = Envelope(round=1, sender="pi-1", seq=1, body=Update(tensors=res.tensors, num_samples=res.num_samples,
                                                            train_loss=res.train_loss, metrics=dict(res.metrics),
                                                            delta=False, extras=res.extras))
    enc = encode(env)
    assert enc.raw_tensor_bytes == 0
    body = decode(enc.payload).envelope.body
    assert body.tensors == () and body.num_samples == 6 and body.extras == {}


def test_local_strategy_never_changes_anything():
    s = Local()
    r = ClientResult("a", (), 5, 0.3, {"eval_accuracy": 0.9})
    assert s.step(1, [], [r]) is None
    acc = s.accumulator(1, [])
    acc.add(r)
    assert acc.result() is None
    assert s.state_dict() == {}


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, client_cls, strategy_cls, share", [
    ("fedper", FedPerClient, FedPer, "backbone"), ("fedrep", FedRepClient, FedRep, "backbone"),
    ("local", LocalClient, Local, "none")])
def test_registered_by_name_with_matching_shares(name, client_cls, strategy_cls, share):
    client, strategy = get_client_algorithm(name), get_strategy(name)
    assert type(client) is client_cls and type(strategy) is strategy_cls
    assert client.name == strategy.name == name
    assert client.share == strategy.share == share
    assert len(shared_indices(list(_model().state_dict()), share)) == (len(BACKBONE) if share == "backbone" else 0)


# --------------------------------------------------------------------------------------------
# A FedPer federation over a real broker with client-side evaluation
# --------------------------------------------------------------------------------------------

#: LightCNN backbone on 1×8×8 digits, by hand: conv1 1·16·9+16 = 160, conv2 16·32·9+32 = 4,640,
#: fc (32·2·2)·64+64 = 8,256 → 13,056 float32 parameters.
DIGITS_BACKBONE_BYTES = 4 * (160 + 4_640 + 8_256)


@pytest.mark.slow
def test_fedper_federation_with_client_eval(tmp_path):
    import json
    import sqlite3
    import time

    from helpers.federation import Spy, small_config, spied

    from broker_server.embedded_broker import EmbeddedBroker
    from broker_server.simulate import simulate
    from edge_agent.data import load_dataset

    cfg = small_config(train={"algorithm": "fedper"}, server={"client_eval": True})
    agents = {}
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        spy = Spy(broker.host, broker.port)
        try:
            res = simulate(cfg, broker_url=broker.url, run_dir=tmp_path / "run",
                           agent_hook=lambda i, a: (setattr(a, "keep_model", True), agents.setdefault(a.client_id, a)))
            time.sleep(0.3)
        finally:
            spy.close()
    assert res.rounds_completed == 2
    metrics = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["share"] == "backbone" and m["clients_reported"] == 3 and m["clients_evaluated"] == 3
               for m in metrics)

    updates, global_msgs = spied(spy)
    globals_ = {r: g.tensors for r, g in global_msgs.items()}
    # only the six backbone tensors travel, both ways
    assert all(len(g) == len(BACKBONE) for g in globals_.values())
    assert all(len(u.tensors) == len(BACKBONE) and u.extras == {} for r in updates.values() for u in r.values())
    con = sqlite3.connect(res.run_dir / "ledger.sqlite")
    raw = {r for (r,) in con.execute(
        "select raw_bytes from messages where side='agent' and kind='update' and event='sent'")}
    con.close()
    assert raw == {DIGITS_BACKBONE_BYTES}

    # the final global backbone = the n_k-weighted mean of round 2's backbones; the server's
    # classifier never moved from its initial value (it never received one)
    final = torch.load(res.run_dir / "model_final.pt")
    ups = list(updates[2].values())
    weights = [u.num_samples for u in ups]
    for j, name in enumerate(BACKBONE):
        want = np.average(np.stack([u.tensors[j] for u in ups]), axis=0, weights=weights)
        np.testing.assert_allclose(final[name].numpy(), want, rtol=1e-5, atol=1e-6)
    from broker_server.checkpoint import CheckpointStore

    store = CheckpointStore(res.run_dir / "checkpoints.sqlite")
    initial = store.load(0).tensors
    store.close()
    for name in HEAD:
        np.testing.assert_array_equal(final[name].numpy(), initial[list(final).index(name)])

    # each device's own model: its backbone is what it uploaded in round 2, its head is private
    # (different on every device), and its accuracy on the test split is what it reported
    test = load_dataset("digits").test
    accs = []
    for cid, agent in sorted(agents.items()):
        state = {k: v.detach().cpu().numpy() for k, v in agent.model.state_dict().items()}
        for j, name in enumerate(BACKBONE):
            np.testing.assert_array_equal(state[name], updates[2][cid].tensors[j])
        with torch.no_grad():
            pred = agent.model.eval()(torch.from_numpy(np.asarray(test.x))).argmax(1).numpy()
        acc = float((pred == test.y).mean())
        assert updates[2][cid].metrics["eval_accuracy"] == pytest.approx(acc)
        accs.append(acc)
    heads = [agent.model.state_dict()["classifier.weight"].numpy() for agent in agents.values()]
    assert not np.array_equal(heads[0], heads[1]) and not np.array_equal(heads[1], heads[2])
    assert metrics[-1]["client_accuracy_mean"] == pytest.approx(np.mean(accs))
    assert metrics[-1]["client_accuracy_worst"] == pytest.approx(min(accs))


@pytest.mark.slow
def test_local_federation_sends_no_tensors(tmp_path):
    """Over a real broker: Local's updates and the server's globals carry zero tensor bytes,
    every update is accepted, the clients' own models are evaluated, and the server's (empty)
    global model never changes."""
    import json
    import sqlite3

    from helpers.federation import small_config

    from broker_server.simulate import simulate

    res = simulate(small_config(train={"algorithm": "local"}, server={"client_eval": True}), run_dir=tmp_path / "run")
    metrics = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["clients_reported"] for m in metrics] == [3, 3]
    assert all(m["share"] == "none" and m["clients_evaluated"] == 3 for m in metrics)
    # the round's accuracy is the clients' own models' (the server holds no model of its own)
    assert all(m["accuracy"] == m["client_accuracy_mean"] and m["accuracy_source"] == "clients" for m in metrics)
    from broker_server.checkpoint import CheckpointStore

    store = CheckpointStore(res.run_dir / "checkpoints.sqlite")
    initial, last = store.load(0).tensors, store.load().tensors
    store.close()
    for a, b in zip(initial, last):  # the server's copy never changed
        np.testing.assert_array_equal(a, b)
    con = sqlite3.connect(res.run_dir / "ledger.sqlite")
    rows = con.execute("select side, kind, raw_bytes from messages where event='sent' and kind in ('update', 'global')"
                       ).fetchall()
    con.close()
    assert sorted({(s, k) for s, k, _ in rows}) == [("agent", "update"), ("server", "global")]
    assert [k for _, k, _ in rows].count("update") == 6 and {r for _, _, r in rows} == {0}


# --------------------------------------------------------------------------------------------
# EnsKD = FedMCP++ with a uniform teacher and distillation only
# --------------------------------------------------------------------------------------------

def _enskd_results():
    """Three uploads on a 4-sample, 3-class proxy set (labels 0, 1, 2, 0) with proxy accuracies
    4/4, 2/4 and 1/4 — so the accuracy weighting would give 4/7, 2/7, 1/7."""
    labels = np.array([0, 1, 2, 0], np.int64)
    a = np.eye(3)[labels]
    b = a.copy()
    b[[2, 3]] = [[1, 0, 0], [0, 1, 0]]
    c = np.full((4, 3), 0.2)
    c[np.arange(4), [0, 2, 0, 1]] = 0.6
    protos = [np.arange(6, dtype=np.float32).reshape(3, 2) * k for k in (1.0, 2.0, 5.0)]
    return labels, [ClientResult(cid, (), n, 0.1, extras={"soft_predictions": s.astype(np.float32), "prototypes": p})
                    for cid, n, s, p in zip("ABC", (10, 30, 60), (a, b, c), protos)]


def test_enskd_teacher_is_the_plain_mean_whatever_the_accuracies_and_sample_counts():
    from broker_server.strategies.enskd import EnsKD
    from broker_server.strategies.fedmcp import FedMCP

    labels, results = _enskd_results()
    s = EnsKD(proxy_y=labels, num_classes=3, proxy_size=4)
    assert isinstance(s, FedMCP) and s.share == "none" and s.weighting == "uniform"
    assert all(s.validate(r) is None for r in results)
    assert s.step(1, [], results) is None  # no model changes
    teacher = s.global_extras()
    np.testing.assert_allclose(teacher["teacher_soft_predictions"],
                               np.mean([r.extras["soft_predictions"] for r in results], axis=0), rtol=1e-6)
    np.testing.assert_allclose(teacher["teacher_prototypes"], np.arange(6).reshape(3, 2) * (1 + 2 + 5) / 3, rtol=1e-6)
    assert s.committed_metrics["teacher_weights"] == pytest.approx({"A": 1 / 3, "B": 1 / 3, "C": 1 / 3})
    config = s.configure_round(1, ["A", "B", "C"], np.random.default_rng(0)).config
    assert (config["kd"], config["infonce"], config["proto_align"]) == (True, False, False)
    # [algorithm] keys still override the defaults (the strategy refuses unknown ones as FedMCP++ does)
    assert EnsKD(proxy_y=labels, num_classes=3, proxy_size=4, infonce=True).params.infonce is True
    with pytest.raises(TypeError, match="no_such"):
        EnsKD(proxy_y=labels, num_classes=3, proxy_size=4, no_such=1)


def test_enskd_client_distils_only_and_equals_fedmcp_with_the_stages_off():
    """Round 2 with a teacher: EnsKD runs the KD stage and no InfoNCE / prototype step (no
    projections are ever built), and its result is bit-identical to FedMCP++'s client given
    ``infonce = proto_align = false`` — EnsKD is that parameterisation, nothing else."""
    from edge_agent.algorithms.enskd import EnsKDClient
    from edge_agent.algorithms.fedmcp import FedMCPClient

    g = torch.Generator().manual_seed(0)
    proxy_x = torch.randn(12, 1, SIZE, SIZE, generator=g).numpy()
    proxy_y = np.array([0, 1, 2] * 4, np.int64)
    x, y = _shard(15, seed=30)
    cfg = TrainConfig(local_epochs=1, batch_size=8, lr=0.05, momentum=0.9, seed=2)
    teacher = {"teacher_soft_predictions": np.full((12, CLASSES), 1 / CLASSES, np.float32),
               "teacher_prototypes": np.zeros((CLASSES, FEAT), np.float32)}
    runs = []
    for cls, params in ((EnsKDClient, {}), (FedMCPClient, {"infonce": False, "proto_align": False})):
        algo, model = cls(proxy_x=proxy_x, proxy_y=proxy_y), _model()
        res = algo.local_round(model, (), x, y, cfg, round=2, client_index=1, device=CPU, global_extras=teacher,
                               params={"onnx_soft_predictions": False, "proxy_batch_size": 4, **params})
        runs.append((algo, model, res))
    (enskd, m_e, r_e), (_, m_f, r_f) = runs
    assert get_client_algorithm_class("enskd") is EnsKDClient
    assert "kd_loss" in r_e.metrics and not {"infonce_loss", "proto_loss"} & set(r_e.metrics)
    assert enskd.proj_s is None and enskd.proj_t is None
    assert r_e.tensors == () and set(r_e.extras) == {"soft_predictions", "prototypes"}
    for name in r_e.extras:
        np.testing.assert_array_equal(r_e.extras[name], r_f.extras[name])
    for (k, a), b in zip(_state(m_e).items(), _state(m_f).values()):
        np.testing.assert_array_equal(a, b, err_msg=k)
