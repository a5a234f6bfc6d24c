"""FedPGP: mixed prototypes, the server's pool, the client's projected step worked out with
autograd and numpy, the layer split, the controls, validation, and one federation whose pool is
recomputed from the uploads the spy saw."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from broker_server.strategies import ClientResult, get_strategy
from broker_server.strategies.fedpgp import build_pool
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.algorithms.fedpgp import FedPGPClient, LayerSplit, PGPSettings, mixed_prototypes
from edge_agent.errors import ModelError
from edge_agent.models import build_model
from edge_agent.state import state_arrays

CPU = torch.device("cpu")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)


def _data(n: int = 20, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return (torch.from_numpy(rng.standard_normal((n, 1, 8, 8)).astype(np.float32)),
            torch.from_numpy((np.arange(n) % 3).astype(np.int64)))


def _pool(d: int = 64, seed: int = 1, classes=(0, 0, 4, 7, 9)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    classes = np.asarray(classes, np.int64)
    return {"pool_protos": np.abs(rng.standard_normal((5, d))).astype(np.float32), "pool_classes": classes,
            "pool_counts": np.array([3, 5, 2, 8, 4], np.int64)}


# ------------------------------------------------------------------ mixed prototypes and the pool


def test_mixed_prototypes_group_same_class_samples_and_drop_singletons() -> None:
    """s = 2: class 0 (3 samples) → one group of 3, class 1 (1 sample) → none, class 2 (4
    samples) → two groups of 2; every group mean is a mean of its class's rows."""
    z = np.arange(16, dtype=np.float32).reshape(8, 2)
    y = np.array([0, 2, 0, 1, 2, 0, 2, 2])
    protos, classes, counts = mixed_prototypes(z, y, 2, np.random.default_rng(0))
    assert classes.tolist() == [0, 2, 2] and counts.tolist() == [3, 2, 2]
    np.testing.assert_allclose(protos[0], z[[0, 2, 5]].mean(0))  # the whole class
    # class 2: the two group means add up (×2) to the class's sum, and each is a pair's mean
    np.testing.assert_allclose(2 * protos[1] + 2 * protos[2], z[[1, 4, 6, 7]].sum(0))
    pairs = [z[[a, b]].mean(0) for a in (1, 4, 6, 7) for b in (1, 4, 6, 7) if a < b]
    assert any(np.allclose(protos[1], p) for p in pairs)
    # groups of at least s: s = 3 on 7 samples gives 2 groups (3 and 4)
    _, _, c = mixed_prototypes(np.zeros((7, 1)), np.zeros(7, int), 3, np.random.default_rng(0))
    assert sorted(c.tolist()) == [3, 4]
    assert mixed_prototypes(np.zeros((1, 3)), np.zeros(1, int), 2, np.random.default_rng(0))[0].shape == (0, 3)


def test_pool_is_the_count_weighted_mean_of_each_random_group() -> None:
    """Class 5 has three mixed prototypes with counts 2, 3, 5: G = 1 gives (2·π1 + 3·π2 + 5·π3)/10
    with count 10; G ≥ 3 gives the three prototypes themselves; class 1's single one is kept."""
    p = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [4.0, 4.0]], np.float32)
    c = np.array([5, 5, 5, 1])
    n = np.array([2, 3, 5, 7])
    pool, pc, pn = build_pool(p, c, n, 1, np.random.default_rng(0))
    assert pc.tolist() == [1, 5] and pn.tolist() == [7, 10]
    np.testing.assert_allclose(pool, [[4.0, 4.0], [(2 * 1 + 5 * 2) / 10, (3 * 1 + 5 * 2) / 10]], rtol=1e-6)
    pool, pc, pn = build_pool(p, c, n, 4, np.random.default_rng(0))
    assert pc.tolist() == [1, 5, 5, 5] and sorted(pn[1:].tolist()) == [2, 3, 5]
    assert {tuple(r) for r in pool[1:]} == {(1.0, 0.0), (0.0, 1.0), (2.0, 2.0)}
    # G = 2: a random split of the three, the mass Σ n·π and Σ n preserved
    pool, pc, pn = build_pool(p, c, n, 2, np.random.default_rng(3))
    assert pc.tolist() == [1, 5, 5] and pn[1:].sum() == 10
    np.testing.assert_allclose((pn[1:, None] * pool[1:]).sum(0), (n[:3, None] * p[:3]).sum(0), rtol=1e-6)


# ------------------------------------------------------------------ the layer split


def test_layer_split_by_name_reassembles_the_model() -> None:
    model = _model().eval()
    x, _ = _data(4)
    for layer, width, units in (("", 64, 1), ("features", 64, 1), ("pool2", 32 * 2 * 2, 2), ("relu3", 64, 1)):
        split = LayerSplit(model, layer)
        z = split.encode(x)
        assert z.shape == (4, width)
        torch.testing.assert_close(split.decode(z), model(x))
        assert len(split.units("module")) == units  # the classifier (and fc after pool2)
        assert len(split.units("tensor")) == 2 * len(split.units("module"))
    with pytest.raises(ModelError, match="conv1, relu1, pool1, conv2"):
        LayerSplit(model, "conv9")


# ------------------------------------------------------------------ the client step by hand


def test_one_full_batch_step_takes_the_projected_gradient() -> None:
    """One SGD step (batch = shard, lr 0.1): g = ∇CE(batch), g_p = ∇ of the count-weighted CE of
    the pool through the classifier at the same weights; per module (classifier weight+bias)
    the projection is applied when ⟨g, g_p⟩ < 0 — computed here with autograd and numpy."""
    x, y = _data(12)
    pool = _pool(classes=(5, 6, 7, 8, 9))  # classes the shard (0, 1, 2) lacks: their logits conflict
    ref = _model()
    glob = state_arrays(ref)
    params = dict(ref.named_parameters())
    ce = F.cross_entropy(ref(x), y)
    g = dict(zip(params, torch.autograd.grad(ce, list(params.values())), strict=True))
    logits = ref.classifier(torch.from_numpy(pool["pool_protos"]))
    w = torch.from_numpy(pool["pool_counts"].astype(np.float32))
    lp = (F.cross_entropy(logits, torch.from_numpy(pool["pool_classes"]), reduction="none") * w).sum() / w.sum()
    gp_w, gp_b = torch.autograd.grad(lp, [params["classifier.weight"], params["classifier.bias"]])
    gv = np.concatenate([g["classifier.weight"].numpy().ravel(), g["classifier.bias"].numpy().ravel()]).astype(float)
    av = np.concatenate([gp_w.numpy().ravel(), gp_b.numpy().ravel()]).astype(np.float64)
    dot = gv @ av
    assert dot < 0, "the fixture must conflict for this test to mean something"
    gproj = gv - dot / (av @ av) * av
    want = {k: (p - 0.1 * g[k]).detach().numpy() for k, p in params.items()}
    want["classifier.weight"] = params["classifier.weight"].detach().numpy() - 0.1 * gproj[:640].reshape(10, 64)
    want["classifier.bias"] = params["classifier.bias"].detach().numpy() - 0.1 * gproj[640:]

    client = FedPGPClient()
    model = _model()
    res = client.local_round(model, glob, x, y, TrainConfig(local_epochs=1, batch_size=12, lr=0.1), round=2,
                             client_index=0, device=CPU, params={"mix_size": 2}, global_extras=pool)
    got = dict(zip(want, res.tensors, strict=True))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert (client.layer_steps, client.conflicts, client.projected) == (1, 1, 1)
    assert res.metrics["pgp_projected"] == 1.0 and res.metrics["pgp_layer_steps"] == 1.0
    # the uploaded mixed prototypes: classes 0, 1, 2 with 4 samples each (12 = 3 × 4), s = 2
    assert res.extras["mixed_classes"].tolist() == [0, 0, 1, 1, 2, 2] and res.extras["mixed_counts"].tolist() == [2] * 6
    feats = model.eval().features(x).detach().numpy()
    for c in range(3):
        rows = res.extras["mixed_classes"] == c
        np.testing.assert_allclose((2 * res.extras["mixed_protos"][rows]).sum(0), feats[y.numpy() == c].sum(0),
                                   rtol=1e-5, atol=1e-5)


def _train(algo, extras, params, epochs: int = 2):
    x, y = _data(20)
    model = _model()
    res = algo.local_round(model, state_arrays(_model()), x, y, TrainConfig(local_epochs=epochs, batch_size=7, lr=0.1),
                           round=3, client_index=1, device=CPU, params=params, global_extras=extras)
    return res, state_arrays(model)


def test_without_a_pool_and_with_unused_prototypes_it_trains_as_fedavg_bit_for_bit() -> None:
    _, ref = _train(FedAvgClient(), {}, {})
    for extras, params in (({}, {}), (_pool(), {"projection": "unused"})):
        client = FedPGPClient()
        _, got = _train(client, extras, params)
        for a, b in zip(got, ref, strict=True):
            np.testing.assert_array_equal(a, b)
        assert client.projected == 0
    assert client.layer_steps == 6  # 2 epochs × 3 batches (20 samples, batch 7) × 1 unit (the classifier)


def test_controls_change_the_step_as_documented() -> None:
    """'always' projects at least as often as 'conflict'; 'add' changes every step; per-round
    g_p differs from per-step g_p; the tensor unit counts twice as many units."""
    counts = {}
    for params in ({}, {"projection": "always"}, {"projection": "add"}, {"gp_every": "round"},
                   {"projection_unit": "tensor"}, {"pool_weighting": "uniform"}):
        client = FedPGPClient()
        res, _ = _train(client, _pool(), params)
        counts[tuple(params.items())] = (client.layer_steps, client.conflicts, client.projected)
        assert np.isfinite(res.train_loss)
    steps = counts[()][0]
    assert counts[(("projection", "always"),)][2] >= counts[()][2]
    assert counts[(("projection", "add"),)][2] == steps
    assert counts[(("projection_unit", "tensor"),)][0] == 2 * steps
    with pytest.raises(ValueError, match="projection must be one of"):
        PGPSettings.from_params({"projection": "sometimes"})


def test_a_pool_of_the_wrong_width_is_refused() -> None:
    with pytest.raises(ModelError, match="width 32"):
        _train(FedPGPClient(), _pool(d=32), {})


# ------------------------------------------------------------------ the server


def _result(cid: str, protos, classes, counts, n: int = 50, metrics=None) -> ClientResult:
    return ClientResult(cid, (np.zeros(2, np.float32),), n, 0.5, metrics or {},
                        {"mixed_protos": np.asarray(protos, np.float32), "mixed_classes": np.asarray(classes, np.int64),
                         "mixed_counts": np.asarray(counts, np.int64)})


def test_strategy_validates_and_pools_over_clients() -> None:
    s = get_strategy("fedpgp", pool_groups=1)
    s.bind_model(_model())
    good = _result("a", [[1.0, 2.0], [3.0, 4.0]], [1, 1], [2, 6], metrics={"pgp_layer_steps": 4, "pgp_projected": 1,
                                                                         "pgp_conflicts": 1})
    assert s.validate(good) is None
    assert "exactly the extras" in s.validate(ClientResult("a", (), 5, 0.1, {}, {}))
    assert "sum to 8" in s.validate(_result("a", [[1.0, 2.0], [3.0, 4.0]], [1, 1], [2, 6], n=7))
    assert "out of range" in s.validate(_result("a", [[1.0, 2.0]], [10], [2]))
    assert ">= 1" in s.validate(_result("a", [[1.0, 2.0]], [1], [0]))
    other = _result("b", [[5.0, 6.0]], [1], [8], metrics={"pgp_layer_steps": 4, "pgp_projected": 3,
                                                          "pgp_conflicts": 3})
    out = s.step(1, [np.zeros(2, np.float32)], [good, other])
    assert out is not None
    # G = 1: class 1's pool prototype = (2·(1,2) + 6·(3,4) + 8·(5,6)) / 16
    np.testing.assert_allclose(s.pool_protos, [[(2 + 18 + 40) / 16, (4 + 24 + 48) / 16]])
    assert s.pool_classes.tolist() == [1] and s.pool_counts.tolist() == [16]
    m = s.committed_metrics
    assert m["pgp_pool_size"] == 1 and m["pgp_pool_bytes"] == 2 * 4 + 16 and m["pgp_projected_share"] == 0.5
    assert set(s.global_extras()) == {"pool_protos", "pool_classes", "pool_counts"}
    assert "width 3" in s.validate(_result("c", [[1.0, 2.0, 3.0]], [1], [2]))  # the pool's width is 2
    with pytest.raises(ValueError, match="pool_groups"):
        get_strategy("fedpgp", pool_groups=0)
    with pytest.raises(ValueError, match="gp_every"):
        get_strategy("fedpgp", gp_every="epoch")


def test_the_pool_survives_a_checkpoint() -> None:
    s = get_strategy("fedpgp")
    s.step(1, [np.zeros(2, np.float32)], [_result("a", [[1.0, 2.0], [3.0, 4.0]], [1, 2], [2, 6])])
    t = get_strategy("fedpgp")
    t.load_state_dict(s.state_dict())
    for k, v in s.global_extras().items():
        np.testing.assert_array_equal(t.global_extras()[k], v)


# ------------------------------------------------------------------ a federation


@pytest.mark.slow
def test_fedpgp_federation_pool_is_recomputed_from_the_uploads(tmp_path) -> None:
    """Digits, Dirichlet(0.5) over 3 clients, 2 rounds: round 2's broadcast pool equals the pool
    built by hand (the documented rule: client-id order, per class a permutation from
    default_rng([pool_seed, round]), count-weighted group means) from the round-1 uploads; the
    round's metrics agree with it; the global model beats chance clearly."""
    from helpers.federation import read_metrics, run_with_spy, small_config, spied

    from broker_server.embedded_broker import EmbeddedBroker

    cfg = small_config(train={"algorithm": "fedpgp", "local_epochs": 2},
                       data={"partition": "dirichlet", "alpha": 0.5}, algorithm={"pool_groups": 2, "pool_seed": 7})
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        res, spy = run_with_spy(broker, tmp_path, cfg)
    assert res.rounds_completed == 2
    updates, globals_ = spied(spy)
    ups = [updates[1][k].extras for k in sorted(updates[1])]
    p = np.concatenate([u["mixed_protos"] for u in ups]).astype(np.float64)
    c = np.concatenate([u["mixed_classes"] for u in ups])
    n = np.concatenate([u["mixed_counts"] for u in ups])
    rng = np.random.default_rng([7, 1])
    want_p, want_c, want_n = [], [], []
    for cls in np.unique(c):
        rows = np.flatnonzero(c == cls)
        for part in np.array_split(rng.permutation(rows), min(2, rows.size)):
            want_p.append((n[part, None] * p[part]).sum(0) / n[part].sum())
            want_c.append(cls)
            want_n.append(n[part].sum())
    g = globals_[2].extras
    assert g["pool_classes"].tolist() == want_c and g["pool_counts"].tolist() == want_n
    np.testing.assert_allclose(g["pool_protos"], np.stack(want_p), rtol=1e-5, atol=1e-6)
    assert "pool_protos" not in globals_[1].extras
    metrics = read_metrics(tmp_path / "run")
    assert metrics[0]["pgp_pool_size"] == len(want_c) and "pgp_projected_share" not in metrics[0]
    assert metrics[0]["pgp_pool_bytes"] == len(want_c) * (64 * 4 + 16)
    assert 0 < metrics[1]["pgp_projected_share"] <= 1
    # chance is 0.1; FedAvg in this setting reaches 0.55 (measured), a central model ~0.9 (conftest)
    assert metrics[1]["accuracy"] > 0.3


def test_mix_size_below_two_is_refused() -> None:
    """A group of one would upload that sample's own representation."""
    with pytest.raises(ValueError, match="mix_size must be an int >= 2"):
        PGPSettings.from_params({"mix_size": 1})
    with pytest.raises(ValueError, match="mix_size"):
        get_strategy("fedpgp", mix_size=1)
