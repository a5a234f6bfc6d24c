"""Prototype baselines FedProto (+ the RethinkFL variant fedproto-avg) and FPL: every rule
checked against numbers worked out by hand or recomputed directly in numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from broker_server.strategies import ClientResult, apply_update
from broker_server.strategies.fedproto import (
    FedProto,
    FedProtoAvg,
    PrototypeAccumulator,
    aggregate_prototypes,
    check_prototype_extras,
)
from broker_server.strategies.fpl import FPL, finch_partition, fpl_prototypes
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedproto import (
    FedProtoAvgClient,
    FedProtoClient,
    PrototypeSums,
    nearest_prototype_scores,
    prototype_mse,
    prototype_table,
)
from edge_agent.algorithms.fpl import FPLClient, fpl_prototype_loss
from edge_agent.models import build_model

CPU = torch.device("cpu")


def _extras(protos, classes, counts) -> dict[str, np.ndarray]:
    return {"prototypes": np.asarray(protos, np.float32), "proto_classes": np.asarray(classes, np.int64),
            "proto_counts": np.asarray(counts, np.int64)}


def _result(cid: str, protos, classes, counts, tensors=(), n: int = 10) -> ClientResult:
    return ClientResult(cid, tuple(np.asarray(t, np.float32) for t in tensors), n, 0.5,
                        extras=_extras(protos, classes, counts))


# ---------------------------------------------------------------- client-side pure functions

def test_prototype_sums_equal_numpy_class_means_over_batches() -> None:
    rng = np.random.default_rng(0)
    z = rng.normal(size=(23, 5)).astype(np.float32)
    y = rng.choice([0, 2, 3], size=23)  # classes 1 and 4 absent
    sums = PrototypeSums(5)
    for s in range(0, 23, 4):
        sums.add(torch.from_numpy(z[s:s + 4]), torch.from_numpy(y[s:s + 4]))
    protos, classes, counts = sums.result()
    assert classes.dtype == np.int64 and counts.dtype == np.int64 and protos.dtype == np.float32
    np.testing.assert_array_equal(classes, [0, 2, 3])
    np.testing.assert_array_equal(counts, [(y == c).sum() for c in (0, 2, 3)])
    np.testing.assert_allclose(protos, np.stack([z[y == c].mean(0) for c in (0, 2, 3)]), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="labels must lie"):
        sums.add(torch.zeros(1, 5), torch.tensor([5]))
    empty = PrototypeSums(3).result()
    assert empty[0].shape == (0, 0) and empty[1].shape == (0,)


def test_prototype_mse_targets_only_classes_with_a_global_prototype() -> None:
    # global prototypes: class 0 -> (1, 1), class 2 -> (0, 2); class 1 has none
    table, mask = prototype_table(np.array([[1, 1], [0, 2]], np.float32), np.array([0, 2]), 3, CPU)
    z = torch.tensor([[2.0, 3.0], [5.0, 5.0], [1.0, 1.0]], requires_grad=True)
    y = torch.tensor([0, 1, 2])
    loss = prototype_mse(z, y, table, mask)
    # by hand: row0 (1² + 2²) = 5, row1 target = itself = 0, row2 (1² + 1²) = 2; mean over 3·2 entries
    assert loss.item() == pytest.approx(7 / 6)
    loss.backward()
    np.testing.assert_allclose(z.grad.numpy(), [[2 * 1 / 6, 2 * 2 / 6], [0, 0], [2 * 1 / 6, 2 * -1 / 6]], rtol=1e-6)
    with pytest.raises(Exception, match="unique"):
        prototype_table(np.zeros((2, 2)), np.array([1, 1]), 3, CPU)


def test_nearest_prototype_scores_by_hand() -> None:
    table, mask = prototype_table(np.array([[0, 0], [3, 4]], np.float32), np.array([0, 2]), 3, CPU)
    s = nearest_prototype_scores(torch.tensor([[1.0, 1.0], [3.0, 3.0]]), table, mask)
    # ‖(1,1)‖² = 2, ‖(1,1)−(3,4)‖² = 4 + 9 = 13; ‖(3,3)‖² = 18, ‖(3,3)−(3,4)‖² = 1
    np.testing.assert_array_equal(s.numpy(), [[-2, -np.inf, -13], [-18, -np.inf, -1]])
    assert s.argmax(1).tolist() == [0, 2]


class _Identity(torch.nn.Module):
    """features(x) = x (2-d points), 3 classes: the predict example is checkable by hand."""

    num_classes = 3

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def features(self, x):
        return x

    def forward(self, x):
        return torch.zeros(x.shape[0], 3)


def test_fedproto_predict_is_nearest_global_prototype() -> None:
    client = FedProtoClient()
    m = _Identity()
    assert torch.isinf(client.predict(m, torch.zeros(2, 2))).all()  # nothing known yet
    client.local_prototypes = (np.array([[9, 9]], np.float32), np.array([1]))
    assert client.predict(m, torch.zeros(1, 2)).argmax(1).tolist() == [1]  # round-1 fallback: own prototypes
    client.global_prototypes = (np.array([[0, 0], [3, 4]], np.float32), np.array([0, 2]))
    x = torch.tensor([[1.0, 1.0], [3.0, 3.0], [2.0, 2.4]])  # last: 4 + 5.76 = 9.76 vs 1 + 2.56 = 3.56
    assert client.predict(m, x).argmax(1).tolist() == [0, 2, 2]
    assert FedProtoAvgClient().predict(m, x).shape == (3, 3)  # the head's logits


# ---------------------------------------------------------------- FedProto server

def test_prototype_aggregation_by_hand_with_a_class_missing_at_a_client() -> None:
    a = ([[1, 2], [3, 4]], [0, 1], [1, 3])
    b = ([[5, 6], [7, 8]], [1, 2], [1, 1])  # b lacks class 0, a lacks class 2
    p, c = aggregate_prototypes([np.array(a[0]), np.array(b[0])], [a[1], b[1]])
    np.testing.assert_array_equal(c, [0, 1, 2])
    np.testing.assert_allclose(p, [[1, 2], [4, 5], [7, 8]])  # uniform: class 1 = ((3,4) + (5,6)) / 2
    p, c = aggregate_prototypes([np.array(a[0]), np.array(b[0])], [a[1], b[1]], [a[2], b[2]], weighting="count")
    np.testing.assert_allclose(p, [[1, 2], [3.5, 4.5], [7, 8]])  # (3·(3,4) + 1·(5,6)) / 4
    assert p.dtype == np.float32 and c.dtype == np.int64
    acc = PrototypeAccumulator()  # a per-client weight (FedPAD's θ_i): 3 for a, 1 for b, 0 for a third
    acc.add(np.array(a[0]), a[1], weight=3.0)
    acc.add(np.array(b[0]), b[1], weight=1.0)
    acc.add(np.array([[9.0, 9.0]]), [5], weight=0.0)  # zero weight: class 5 gets no prototype
    p, c = acc.result()
    np.testing.assert_array_equal(c, [0, 1, 2])
    np.testing.assert_allclose(p, [[1, 2], [3.5, 4.5], [7, 8]])
    with pytest.raises(ValueError, match="count weighting"):
        aggregate_prototypes([np.ones((1, 2))], [[0]], weighting="count")
    with pytest.raises(ValueError, match="weighting"):
        aggregate_prototypes([np.ones((1, 2))], [[0]], weighting="median")


def test_fedproto_strategy_round_no_model_tensors() -> None:
    s = FedProto(lambda_proto=10, train_config={"lr": 0.1})
    assert s.share == "none" and s.global_extras() == {}
    plan = s.configure_round(1, ["a", "b"], np.random.default_rng(0))
    assert plan.config == {"lr": 0.1, "lambda_proto": 10.0} and plan.selected == ("a", "b")
    assert s.step(1, [], []) is None
    results = [_result("a", [[1, 2], [3, 4]], [0, 1], [1, 3]), _result("b", [[5, 6], [7, 8]], [1, 2], [1, 1])]
    assert all(s.validate(r) is None for r in results)
    acc = s.accumulator(1, [])
    for r in results:
        acc.add(r)
    assert apply_update(s, 1, acc.result()) == []  # share "none": the new shared subset is empty
    g = s.global_extras()
    np.testing.assert_allclose(g["prototypes"], [[1, 2], [4, 5], [7, 8]])
    np.testing.assert_array_equal(g["proto_classes"], [0, 1, 2])
    # mean cosine of (1, 2), (4, 5), (7, 8): 14/√205, 23/√565, 68/√4633 → (0.97780 + 0.96762 + 0.99902)/3
    cos = (14 / np.sqrt(205) + 23 / np.sqrt(565) + 68 / np.sqrt(4633)) / 3
    assert s.committed_metrics == {"prototype_classes": 3, "global_prototype_cosine": pytest.approx(cos, rel=1e-6)}
    assert round(cos, 5) == 0.98148
    s2 = FedProto()
    s2.load_state_dict(s.state_dict())
    np.testing.assert_array_equal(s2.global_extras()["prototypes"], g["prototypes"])
    assert s.step(2, [], []) is None and s.global_extras()["prototypes"] is g["prototypes"]  # kept
    with pytest.raises(TypeError):
        FedProto(mu=1)  # unknown key
    with pytest.raises(ValueError):
        FedProto(lambda_proto=-1)


def test_fedproto_avg_also_averages_the_model() -> None:
    s = FedProtoAvg()
    assert s.share == "all"
    r1 = _result("a", [[1, 0]], [0], [4], tensors=[[1.0, 2.0]], n=1)
    r2 = _result("b", [[0, 1]], [0], [4], tensors=[[4.0, 8.0]], n=3)
    new = s.step(1, [np.zeros(2, np.float32)], [r1, r2])
    np.testing.assert_allclose(new[0], [(1 + 3 * 4) / 4, (2 + 3 * 8) / 4])
    np.testing.assert_allclose(s.global_extras()["prototypes"], [[0.5, 0.5]])


@pytest.mark.parametrize("extras, fragment", [
    ({"prototypes": np.ones((2, 3), np.float32), "proto_classes": np.array([0, 1])}, "missing: proto_counts"),
    (_extras(np.ones((2, 3)), [0, 0], [1, 1]), "unique"),
    (_extras(np.ones((2, 3)), [0, 1], [1, 0]), ">= 1"),
    (_extras(np.ones((2, 3)), [0, 1, 2], [1, 1, 1]), "must both be [2]"),
    (_extras(np.ones(3), [0], [1]), "float [k, d]"),
    (_extras(np.full((1, 3), np.nan), [0], [1]), "NaN"),
    ({"prototypes": np.ones((1, 3), np.float32), "proto_classes": np.array([0.0]), "proto_counts": np.array([1])},
     "integer"),
])
def test_malformed_prototype_extras_are_refused(extras, fragment) -> None:
    assert fragment in check_prototype_extras(extras)


def test_prototype_width_must_match_the_global_prototypes() -> None:
    s = FedProto()
    s.step(1, [], [_result("a", [[1, 2]], [0], [1])])
    assert "width 3" in s.validate(_result("b", [[1, 2, 3]], [0], [1]))


# ---------------------------------------------------------------- FINCH and FPL server

def test_finch_two_separated_groups() -> None:
    pts = np.array([[1, 0], [1, 0.1], [0.9, 0.05], [0, 1], [0.1, 1], [0.05, 0.9]])
    labels = finch_partition(pts)
    assert labels.tolist() == [0, 0, 0, 1, 1, 1]


def test_finch_takes_the_last_partition_of_the_hierarchy() -> None:
    # unit vectors at 0°, 2°, 10°, 12°, 80°, 82°, 90°, 92°. First neighbours (cosine): 0↔2, 10↔12,
    # 80↔82, 90↔92 -> partition 1 = 4 clusters. Their means point at 1°, 11°, 81°, 91°; first
    # neighbours 1↔11, 81↔91 -> partition 2 = 2 clusters; the next merge gives 1 cluster, which FINCH
    # never returns. FPL (RethinkFL) uses the last returned partition: 2 clusters.
    a = np.deg2rad([0, 2, 10, 12, 80, 82, 90, 92])
    assert finch_partition(np.c_[np.cos(a), np.sin(a)]).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert finch_partition(np.array([[1.0, 0.0], [0.0, 1.0]])).tolist() == [0, 0]  # mutual first neighbours
    assert finch_partition(np.array([[1.0, 2.0]])).tolist() == [0]
    with pytest.raises(ValueError):
        finch_partition(np.zeros((0, 2)))


def test_fpl_cluster_and_unbiased_prototypes_by_hand() -> None:
    # class 0: two clients near 0°, two near 90° -> 2 clusters; class 1: one client; class 2: two clients.
    clients_p = [np.array([[1, 0], [3, 3]]), np.array([[2, 0.1], [1, 1]]), np.array([[0, 1], [3, 1]]),
                 np.array([[0.1, 2]])]
    clients_c = [np.array([0, 1]), np.array([0, 2]), np.array([0, 2]), np.array([0])]
    cp, cc, up, uc = fpl_prototypes(clients_p, clients_c)
    np.testing.assert_array_equal(cc, [0, 0, 1, 2])
    np.testing.assert_allclose(cp, [[1.5, 0.05], [0.05, 1.5], [3, 3], [2, 1]], rtol=1e-6)
    np.testing.assert_array_equal(uc, [0, 1, 2])
    np.testing.assert_allclose(up, [[0.775, 0.775], [3, 3], [2, 1]], rtol=1e-6)
    assert cp.dtype == np.float32 and cc.dtype == np.int64


def test_fpl_strategy_fedavg_plus_prototypes() -> None:
    s = FPL(train_config={"lr": 0.01})
    assert s.share == "all" and s.global_extras() == {}
    assert s.configure_round(1, ["a"], np.random.default_rng(0)).config == {"lr": 0.01, "tau": 0.02}
    r1 = _result("a", [[1, 0]], [0], [5], tensors=[[2.0]], n=1)
    r2 = _result("b", [[0, 1]], [0], [5], tensors=[[6.0]], n=3)
    new = s.step(1, [np.zeros(1, np.float32)], [r1, r2])
    np.testing.assert_allclose(new[0], [(2 + 3 * 6) / 4])
    g = s.global_extras()
    assert set(g) == {"cluster_protos", "cluster_classes", "unbiased_protos", "unbiased_classes"}
    np.testing.assert_allclose(g["cluster_protos"], [[0.5, 0.5]])  # two prototypes: one cluster
    assert s.committed_metrics == {"fpl_clusters": {"0": 1}}
    s2 = FPL()
    s2.load_state_dict(s.state_dict())
    np.testing.assert_array_equal(s2.global_extras()["unbiased_protos"], g["unbiased_protos"])
    assert "width" in s.validate(_result("c", [[1, 2, 3]], [0], [1]))


# ---------------------------------------------------------------- FPL client loss

def _fpl_loss_numpy(z, y, cp, cc, up, uc, tau) -> float:
    total = 0.0
    for zb, yb in zip(z, y):
        if yb not in cc or yb not in uc:
            continue
        cos = np.array([zb @ p / (np.linalg.norm(zb) * np.linalg.norm(p)) for p in cp]) / tau
        e = np.exp(cos)
        total += -math.log(e[cc == yb].sum() / e.sum()) + np.mean((zb - up[list(uc).index(yb)]) ** 2)
    return total / len(y)


@pytest.mark.parametrize("tau", [0.5, 0.02])
def test_fpl_infonce_plus_mse_equals_a_direct_numpy_computation(tau) -> None:
    rng = np.random.default_rng(3)
    z = rng.normal(size=(5, 4))
    y = np.array([0, 1, 2, 3, 0])  # class 3 has no prototype: adds 0 but counts in B = 5
    cp = rng.normal(size=(5, 4))
    cc = np.array([0, 0, 1, 2, 2])
    up = np.stack([cp[:2].mean(0), cp[2], cp[3:].mean(0)])
    uc = np.array([0, 1, 2])
    table, mask = prototype_table(up, uc, 4, CPU)
    zt = torch.tensor(z, dtype=torch.float32, requires_grad=True)
    loss = fpl_prototype_loss(zt, torch.from_numpy(y), torch.tensor(cp, dtype=torch.float32), torch.from_numpy(cc),
                              table, mask, tau)
    assert loss.item() == pytest.approx(_fpl_loss_numpy(z, y, cp, cc, up, uc, tau), rel=1e-5)
    loss.backward()
    assert torch.isfinite(zt.grad).all() and (zt.grad[3] == 0).all()
    none = fpl_prototype_loss(zt, torch.tensor([3, 3, 3, 3, 3]), torch.tensor(cp, dtype=torch.float32),
                              torch.from_numpy(cc), table, mask, tau)
    assert none.item() == 0.0


# ---------------------------------------------------------------- client rounds (lr = 0: features fixed)

def _model() -> torch.nn.Module:
    torch.manual_seed(5)
    return build_model("lightcnn", in_channels=1, image_size=8, num_classes=4, feature_dim=6)


def _shard():
    g = torch.Generator().manual_seed(11)
    return torch.randn(10, 1, 8, 8, generator=g), torch.tensor([0, 1, 1, 3, 0, 1, 3, 3, 0, 1])


def test_fedproto_client_round_uploads_only_prototypes() -> None:
    model, (x, y) = _model(), _shard()
    client = FedProtoClient()
    cfg = TrainConfig(local_epochs=2, batch_size=4, lr=0.0)
    res = client.local_round(model, (), x, y, cfg, round=1, client_index=0, device=CPU)
    assert res.tensors == () and set(res.extras) == {"prototypes", "proto_classes", "proto_counts"}
    with torch.no_grad():
        z = model.features(x).numpy()
    np.testing.assert_array_equal(res.extras["proto_classes"], [0, 1, 3])  # class 2 absent: not sent
    np.testing.assert_array_equal(res.extras["proto_counts"], [6, 8, 6])  # every step of 2 epochs
    np.testing.assert_allclose(res.extras["prototypes"], np.stack([z[y.numpy() == c].mean(0) for c in (0, 1, 3)]),
                               rtol=1e-5, atol=1e-6)
    # round 1: CE only; loss of the last epoch with a frozen model = CE over the shard
    with torch.no_grad():
        ce = F.cross_entropy(model(x), y).item()
    assert res.train_loss == pytest.approx(ce, rel=1e-5)
    # with global prototypes for classes 0 and 3 only: CE + λ·MSE over one batch of all 10 samples
    gp = np.arange(12, dtype=np.float32).reshape(2, 6) / 10
    ge = {"prototypes": gp, "proto_classes": np.array([0, 3])}
    res2 = client.local_round(model, (), x, y, TrainConfig(local_epochs=1, batch_size=32, lr=0.0), round=2,
                              client_index=0, device=CPU, params={"lambda_proto": 2.0}, global_extras=ge)
    target = z.copy()
    target[y.numpy() == 0] = gp[0]
    target[y.numpy() == 3] = gp[1]
    assert res2.train_loss == pytest.approx(ce + 2.0 * np.mean((z - target) ** 2), rel=1e-5)
    assert client.global_prototypes is not None


def test_fedproto_avg_client_uploads_the_model_too() -> None:
    model, (x, y) = _model(), _shard()
    res = FedProtoAvgClient().local_round(model, tuple(t.numpy() for t in model.state_dict().values()), x, y,
                                          TrainConfig(lr=0.0), round=1, client_index=0, device=CPU)
    assert len(res.tensors) == len(model.state_dict()) and "prototypes" in res.extras


def test_fpl_client_round_last_epoch_prototypes_and_loss() -> None:
    model, (x, y) = _model(), _shard()
    with torch.no_grad():
        z = model.features(x)
        ce = F.cross_entropy(model(x), y).item()
    cp = np.abs(np.random.default_rng(2).normal(size=(3, 6))).astype(np.float32)
    cc = np.array([0, 0, 1])
    ge = {"cluster_protos": cp, "cluster_classes": cc, "unbiased_protos": np.stack([cp[:2].mean(0), cp[2]]),
          "unbiased_classes": np.array([0, 1])}
    client = FPLClient()
    res = client.local_round(model, tuple(t.numpy() for t in model.state_dict().values()), x, y,
                             TrainConfig(local_epochs=3, batch_size=32, lr=0.0), round=2, client_index=0, device=CPU,
                             params={"tau": 0.5}, global_extras=ge)
    np.testing.assert_array_equal(res.extras["proto_counts"], [3, 4, 3])  # last epoch only
    np.testing.assert_allclose(res.extras["prototypes"],
                               np.stack([z.numpy()[y.numpy() == c].mean(0) for c in (0, 1, 3)]), rtol=1e-5, atol=1e-6)
    expected = ce + _fpl_loss_numpy(z.double().numpy(), y.numpy(), cp.astype(np.float64), cc,
                                    ge["unbiased_protos"].astype(np.float64), ge["unbiased_classes"], 0.5)
    assert res.train_loss == pytest.approx(expected, rel=1e-5)
    assert len(res.tensors) == len(model.state_dict())


# ---------------------------------------------------------------- a short federation over a broker

def test_fedproto_federation_exchanges_prototypes_only(tmp_path) -> None:
    import json
    import sqlite3

    from helpers.federation import small_config

    from broker_server.simulate import simulate

    cfg = small_config(train={"algorithm": "fedproto"}, algorithm={"lambda_proto": 1.0},
                       server={"client_eval": True})
    res = simulate(cfg, run_dir=tmp_path / "run")
    assert res.rounds_completed == 2
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:
        assert m["share"] == "none" and m["prototype_classes"] == 10 and m["clients_evaluated"] == 3
    # round 2 classifies by the nearest global prototype: well above chance (0.1; 0.43 measured)
    assert metrics[1]["client_accuracy_mean"] > 0.25
    con = sqlite3.connect(tmp_path / "run" / "ledger.sqlite")
    rows = con.execute("select fields, raw_bytes from messages where side='agent' and kind='update' "
                       "and event='sent'").fetchall()
    assert len(rows) == 6
    k, d = 10, 64  # iid digits: every client has all 10 classes; LightCNN features are 64-d
    for fields, raw in rows:
        f = json.loads(fields)
        assert {n for n in f if n.startswith("extras.")} == {"extras.prototypes", "extras.proto_classes",
                                                              "extras.proto_counts"}
        assert f["tensors"] == 1  # an empty msgpack array: no model tensor travels
        assert raw == k * d * 4 + k * 8 + k * 8  # float32 prototypes + int64 classes and counts
    glob = dict(con.execute("select round, fields from messages where side='server' and kind='global' "
                            "and event='sent'").fetchall())
    assert "extras.prototypes" not in json.loads(glob[1]) and "extras.prototypes" in json.loads(glob[2])
    assert json.loads(glob[2])["tensors"] == 1


def test_fpl_federation_broadcasts_cluster_and_unbiased_prototypes(tmp_path) -> None:
    import json
    import sqlite3

    from helpers.federation import small_config

    from broker_server.simulate import simulate

    res = simulate(small_config(train={"algorithm": "fpl"}), run_dir=tmp_path / "run")
    assert res.rounds_completed == 2
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # 3 clients: 3 prototypes per class are always one FINCH cluster (a point joins its first neighbour)
    assert all(m["share"] == "all" and m["fpl_clusters"] == {str(c): 1 for c in range(10)} for m in metrics)
    con = sqlite3.connect(tmp_path / "run" / "ledger.sqlite")
    glob = dict(con.execute("select round, fields from messages where side='server' and kind='global' "
                            "and event='sent'").fetchall())
    names = {"extras.cluster_protos", "extras.cluster_classes", "extras.unbiased_protos", "extras.unbiased_classes"}
    assert not names & set(json.loads(glob[1])) and names <= set(json.loads(glob[2]))
    n_model = sum(t.numel() for t in build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
                  .state_dict().values())
    raw = {r for (r,) in con.execute("select raw_bytes from messages where side='agent' and kind='update' "
                                     "and event='sent'")}
    assert raw == {4 * n_model + 10 * 64 * 4 + 10 * 8 + 10 * 8}  # the fp32 model + the prototype extras
