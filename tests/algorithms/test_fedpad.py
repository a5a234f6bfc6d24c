"""FedPAD (SPECS.md §1.3, paper version): the server math on hand-worked numbers, the Lipschitz
bounds of SPECS §1.5 on random inputs (and the counterexample to the bound as SPECS states it),
the strategy's validation, state and metrics, the client's prototypes and loss against
independent recomputations, the shared ``sgd_epochs`` hooks, and one federation over a broker.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from broker_server.checkpoint import Checkpoint, CheckpointStore
from broker_server.strategies._base import ClientResult
from broker_server.strategies.fedpad import (
    DEFAULT_GAMMA,
    DEFAULT_TAU,
    FedPAD,
    aggregate_prototypes,
    alpha_drift,
    fedpad_weights,
    model_weights,
    prototype_deviation,
    prototype_weights,
)
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms import fedavg as fedavg_mod
from edge_agent.algorithms.fedavg import sgd_epochs, shuffle_generator
from edge_agent.algorithms.fedpad import (
    DEFAULT_LAMBDA_PROTO,
    DEFAULT_PROTO_LOSS,
    FedPADClient,
    model_prototypes,
    prototype_alignment_loss,
)
from edge_agent.algorithms.fedproto import prototype_table
from edge_agent.errors import ModelError
from edge_agent.models import build_model
from edge_agent.state import state_arrays

CPU = torch.device("cpu")
LN2 = math.log(2.0)

# --------------------------------------------------------------------------------------------
# Hand-worked example (2-d prototypes, 3 clients A, B, C; global prototypes of classes 0, 1, 2):
#   P_g: 0 → (0, 0), 1 → (1, 0), 2 → (0, 2)
#   A: 0 → (3, 4), 1 → (1, 1)     d_A = ||(3,4)−(0,0)|| + ||(1,1)−(1,0)|| = 5 + 1 = 6
#   B: 1 → (4, 4), 3 → (9, 9)     d_B = ||(4,4)−(1,0)|| = 5          (class 3 has no P_g)
#   C: 2 → (0, 2)                 d_C = 0
# With γ = ln 2: exp(γ d) = (64, 32, 1), so θ = (64, 32, 1) / 97.
# --------------------------------------------------------------------------------------------
G_PROTOS = np.array([[0, 0], [1, 0], [0, 2]], np.float32)
G_CLASSES = np.array([0, 1, 2], np.int64)
PROTOS = {"A": np.array([[3, 4], [1, 1]], np.float32), "B": np.array([[4, 4], [9, 9]], np.float32),
          "C": np.array([[0, 2]], np.float32)}
CLASSES = {"A": np.array([0, 1], np.int64), "B": np.array([1, 3], np.int64), "C": np.array([2], np.int64)}
COUNTS = {"A": np.array([2, 3], np.int64), "B": np.array([1, 1], np.int64), "C": np.array([4], np.int64)}


def test_deviation_by_hand() -> None:
    d = [prototype_deviation(PROTOS[c], CLASSES[c], G_PROTOS, G_CLASSES) for c in "ABC"]
    assert d == pytest.approx([6.0, 5.0, 0.0], abs=1e-12)


def test_deviation_without_shared_classes_is_zero() -> None:
    assert prototype_deviation(PROTOS["B"][1:], CLASSES["B"][1:], G_PROTOS, G_CLASSES) == 0.0


def test_theta_by_hand() -> None:
    np.testing.assert_allclose(prototype_weights([6.0, 5.0, 0.0], LN2), np.array([64, 32, 1]) / 97, rtol=1e-12)
    np.testing.assert_allclose(prototype_weights([6.0, 5.0, 0.0], 0.0), [1 / 3] * 3, rtol=1e-12)
    # large γ·d does not overflow: θ → one-hot on the largest deviation
    np.testing.assert_allclose(prototype_weights([600.0, 5.0, 0.0], 10.0), [1, 0, 0], atol=1e-300)


def test_alpha_by_hand() -> None:
    # θ = (1/2, 1/4, 1/4), τ = 1/(4 ln 2): −θ/τ = (−2 ln2, −ln2, −ln2) → exp = (1/4, 1/2, 1/2) → α = (0.2, 0.4, 0.4)
    np.testing.assert_allclose(model_weights([0.5, 0.25, 0.25], 0.25 / LN2), [0.2, 0.4, 0.4], rtol=1e-12)


def test_fedpad_weights_chain_and_round_one_rule() -> None:
    theta, alpha = fedpad_weights([6.0, 5.0, 0.0], 3, gamma=LN2, tau=0.1)
    t = np.array([64, 32, 1]) / 97
    e = [math.exp(-ti / 0.1) for ti in t]
    np.testing.assert_allclose(theta, t, rtol=1e-12)
    np.testing.assert_allclose(alpha, np.array(e) / sum(e), rtol=1e-12)
    assert alpha[0] < alpha[1] < alpha[2]  # the most deviant client gets the smallest model weight
    theta1, alpha1 = fedpad_weights(None, 4, gamma=LN2, tau=0.1)  # round 1: no global prototypes
    np.testing.assert_array_equal(theta1, [0.25] * 4)
    np.testing.assert_array_equal(alpha1, [0.25] * 4)
    _, fixed = fedpad_weights([6.0, 5.0, 0.0], 3, gamma=LN2, tau=0.1, fixed_alpha=True)
    np.testing.assert_array_equal(fixed, [1 / 3] * 3)
    with pytest.raises(ValueError):
        fedpad_weights([1.0, 2.0], 3, gamma=1.0, tau=0.1)
    with pytest.raises(ValueError):
        model_weights([0.5, 0.5], 0.0)
    with pytest.raises(ValueError):
        prototype_weights([0.5, np.nan], 1.0)


def test_prototype_aggregation_renormalises_over_the_clients_having_the_class() -> None:
    theta = [0.5, 0.25, 0.25]
    p, c = aggregate_prototypes([PROTOS[k] for k in "ABC"], [CLASSES[k] for k in "ABC"], theta)
    # class 0: A only → (3, 4); class 1: (0.5·(1,1) + 0.25·(4,4)) / 0.75 = (2, 2); class 2: C only; class 3: B only
    np.testing.assert_array_equal(c, [0, 1, 2, 3])
    np.testing.assert_allclose(p, [[3, 4], [2, 2], [0, 2], [9, 9]], rtol=1e-6)
    assert p.dtype == np.float32 and c.dtype == np.int64
    # a previous global class no client sent is kept; one a client sent is replaced
    prev = (np.array([[7, 7], [5, 5]], np.float32), np.array([1, 5], np.int64))
    p2, c2 = aggregate_prototypes([PROTOS[k] for k in "ABC"], [CLASSES[k] for k in "ABC"], theta, previous=prev)
    np.testing.assert_array_equal(c2, [0, 1, 2, 3, 5])
    np.testing.assert_allclose(p2, [[3, 4], [2, 2], [0, 2], [9, 9], [5, 5]], rtol=1e-6)


def _osc(v: np.ndarray) -> float:
    return float(v.max() - v.min())


def test_lipschitz_bounds_on_random_inputs() -> None:
    """SPECS §1.5 on 500 random (d, d', γ, τ): ‖Δθ‖₁ ≤ (γ/2)·osc(Δd) ≤ γ‖Δd‖∞; ‖Δα‖₁ ≤ ‖Δθ‖₁/(2τ);
    the drift ‖Δα‖₁ ≤ γ/(4τ)·osc(Δd) ≤ γ/(2τ)‖Δd‖∞ (osc = max − min ≤ 2‖·‖∞)."""
    rng = np.random.default_rng(20260)
    for _ in range(500):
        m = int(rng.integers(2, 12))
        scale = 10 ** rng.uniform(-2, 1)
        d = np.abs(rng.normal(size=m)) * scale * m
        d2 = np.abs(d + rng.normal(size=m) * scale * rng.uniform(0.01, 2))
        gamma, tau = 10 ** rng.uniform(-2, 1), 10 ** rng.uniform(-1.5, 0.5)
        th, th2 = prototype_weights(d, gamma), prototype_weights(d2, gamma)
        al, al2 = model_weights(th, tau), model_weights(th2, tau)
        dth, dal, dd = np.abs(th - th2).sum(), np.abs(al - al2).sum(), d - d2
        slack = 1e-12
        assert dth <= gamma / 2 * _osc(dd) + slack
        assert dth <= gamma * np.abs(dd).max() + slack
        assert dal <= dth / (2 * tau) + slack
        assert dal <= gamma / (4 * tau) * _osc(dd) + slack
        assert dal <= gamma / (2 * tau) * np.abs(dd).max() + slack


def test_lipschitz_bound_as_stated_in_specs_fails_and_the_corrected_one_is_tight() -> None:
    """SPECS §1.5 writes ‖θ(d)−θ(d')‖₁ ≤ (γ/2)‖d−d'‖∞ and the drift ≤ γ/(4τ)‖d−d'‖∞. For m = 2,
    d = 0, d' = (ε, −ε) both fail by a factor → 2 as ε → 0, while the oscillation forms hold with
    ratio → 1 (so they cannot be tightened)."""
    eps, gamma, tau = 1e-4, 1.0, 0.1
    d, d2 = np.zeros(2), np.array([eps, -eps])
    th, th2 = prototype_weights(d, gamma), prototype_weights(d2, gamma)
    al, al2 = model_weights(th, tau), model_weights(th2, tau)
    dth, dal = np.abs(th - th2).sum(), np.abs(al - al2).sum()
    assert dth > gamma / 2 * eps * 1.99  # the stated bound (γ/2)·ε is exceeded almost twice
    assert dal > gamma / (4 * tau) * eps * 1.99
    assert dth / (gamma / 2 * 2 * eps) == pytest.approx(1.0, rel=1e-6)  # osc(Δd) = 2ε
    assert dal / (gamma / (4 * tau) * 2 * eps) == pytest.approx(1.0, rel=1e-3)


def test_alpha_drift_full_and_partial_participation() -> None:
    drift, n = alpha_drift(["a", "b", "c"], [0.2, 0.3, 0.5], ["a", "b", "c"], [0.4, 0.4, 0.2])
    assert (drift, n) == (pytest.approx(0.2 + 0.1 + 0.3), 3)
    # partial: common {b, c}: previous (0.3, 0.5) → (3/8, 5/8), now (0.4, 0.2) → (2/3, 1/3)
    drift, n = alpha_drift(["a", "b", "c"], [0.2, 0.3, 0.5], ["b", "c", "d"], [0.4, 0.2, 0.4])
    assert n == 2 and drift == pytest.approx(abs(2 / 3 - 3 / 8) + abs(1 / 3 - 5 / 8))
    assert alpha_drift(["a", "b"], [0.5, 0.5], ["b", "c"], [0.5, 0.5]) == (None, 1)
    assert alpha_drift([], [], ["a"], [1.0]) == (None, 0)


# ----------------------------------- the strategy ------------------------------------------


def _head(w: float) -> np.ndarray:
    """A stand-in model entry shaped like a classifier weight [C = 4, F = 2] (validate reads C, F)."""
    return np.full((4, 2), w, np.float32)


def _result(cid: str, w: float, *, n: int = 10, step: int = 7, **extras) -> ClientResult:
    ex = {"prototypes": PROTOS[cid], "proto_classes": CLASSES[cid], "proto_counts": COUNTS[cid]}
    ex.update(extras)
    return ClientResult(cid, (_head(w), np.array(step, np.int64)), n, 0.5, {}, extras=ex)


def _results(ws=(1.0, 2.0, 4.0), ns=(10, 20, 30)) -> list[ClientResult]:
    return [_result(c, w, n=n, step=7 + i) for i, (c, w, n) in enumerate(zip("ABC", ws, ns))]


def test_strategy_round_one_then_round_two_by_hand() -> None:
    s = FedPAD(gamma=LN2, tau=0.1)
    assert s.global_extras() == {}
    plan = s.configure_round(1, ["C", "A", "B"], np.random.default_rng(0))
    assert plan.config["lambda_proto"] == DEFAULT_LAMBDA_PROTO
    out = s.step(1, [], list(reversed(_results())))
    # round 1: θ = α = 1/3, plain mean of the models; integer entry from the first client in id order (A)
    np.testing.assert_allclose(out[0], _head(7 / 3), rtol=1e-6)
    assert out[0].dtype == np.float32 and out[1].dtype == np.int64 and int(out[1]) == 7
    m1 = s.committed_metrics
    assert m1["fedpad_clients"] == ["A", "B", "C"] and m1["fedpad_d"] is None
    assert m1["fedpad_theta"] == pytest.approx([1 / 3] * 3) and m1["fedpad_alpha_drift"] is None
    # round-1 global prototypes = unweighted per-class means over the clients having the class
    g = s.global_extras()
    np.testing.assert_array_equal(g["proto_classes"], [0, 1, 2, 3])
    np.testing.assert_allclose(g["prototypes"], [[3, 4], [2.5, 2.5], [0, 2], [9, 9]], rtol=1e-6)

    # round 2 against that P_g: d_A = ||(3,4)−(3,4)|| + ||(1,1)−(2.5,2.5)|| = 1.5√2,
    # d_B = ||(4,4)−(2.5,2.5)|| + ||(9,9)−(9,9)|| = 1.5√2, d_C = 0
    s.configure_round(2, ["A", "B", "C"], np.random.default_rng(0))
    assert s.round_metrics() == {}  # nothing aggregated yet this round
    out2 = s.step(2, out, _results())
    m2 = s.committed_metrics
    d = [1.5 * math.sqrt(2), 1.5 * math.sqrt(2), 0.0]
    assert m2["fedpad_d"] == pytest.approx(d)
    e = [math.exp(LN2 * x) for x in d]
    theta = [x / sum(e) for x in e]
    a = [math.exp(-t / 0.1) for t in theta]
    alpha = [x / sum(a) for x in a]
    assert m2["fedpad_theta"] == pytest.approx(theta) and m2["fedpad_alpha"] == pytest.approx(alpha)
    np.testing.assert_allclose(out2[0], _head(alpha[0] * 1 + alpha[1] * 2 + alpha[2] * 4), rtol=1e-6)
    assert m2["fedpad_alpha_drift"] == pytest.approx(sum(abs(x - 1 / 3) for x in alpha))
    assert m2["fedpad_alpha_drift_clients"] == 3 and m2["fedpad_round"] == 2
    # class 1 mixes A and B with θ_A = θ_B: their plain mean; others as sent
    np.testing.assert_allclose(s.global_extras()["prototypes"], [[3, 4], [2.5, 2.5], [0, 2], [9, 9]], rtol=1e-6)
    json.dumps(m2)  # JSON-able for metrics.jsonl


def test_fixed_alpha_is_plain_unweighted_averaging() -> None:
    s = FedPAD(gamma=LN2, tau=0.1, fixed_alpha=True)
    s.step(1, [], _results())
    out = s.step(2, [], _results(ws=(1.0, 2.0, 6.0), ns=(5, 50, 100)))
    np.testing.assert_allclose(out[0], _head(3.0), rtol=1e-6)  # (1 + 2 + 6) / 3, not sample-weighted
    m = s.committed_metrics
    assert m["fedpad_alpha"] == pytest.approx([1 / 3] * 3)
    assert m["fedpad_theta"][2] < m["fedpad_theta"][0]  # θ is still computed (and mixes prototypes)


def test_partial_participation_keeps_unreported_classes_and_weights_the_reporters() -> None:
    s = FedPAD(participation_rate=0.2, min_clients=1)
    plan = s.configure_round(1, [f"c{i}" for i in range(10)], np.random.default_rng(3))
    assert len(plan.selected) == 2
    s.step(1, [], _results())
    out = s.step(2, [], [_result("C", 5.0)])  # one reporter: α = 1, its model
    np.testing.assert_allclose(out[0], _head(5.0))
    m = s.committed_metrics
    assert m["fedpad_alpha"] == [1.0] and m["fedpad_alpha_drift"] is None and m["fedpad_alpha_drift_clients"] == 1
    np.testing.assert_array_equal(s.global_extras()["proto_classes"], [0, 1, 2, 3])  # 0, 1, 3 carried over


def test_empty_round_changes_nothing() -> None:
    s = FedPAD()
    s.step(1, [], _results())
    before = s.state_dict()
    assert s.step(2, [], []) is None
    after = s.state_dict()
    np.testing.assert_array_equal(before["prototypes"], after["prototypes"])


@pytest.mark.parametrize(("change", "match"), [
    ({"prototypes": None}, "missing: prototypes"),
    ({"proto_classes": np.array([0], np.int64)}, "must both be \\[2\\]"),
    ({"proto_counts": np.array([1, 1, 1], np.int64)}, "must both be \\[2\\]"),
    ({"proto_classes": np.array([0, 4], np.int64)}, "out of range \\[0, 4\\)"),
    ({"proto_classes": np.array([-1, 1], np.int64)}, "unique and >= 0"),
    ({"proto_classes": np.array([1, 1], np.int64)}, "unique"),
    ({"prototypes": np.zeros((2, 3), np.float32)}, "width 3"),
    ({"prototypes": np.zeros((0, 2), np.float32), "proto_classes": np.zeros(0, np.int64),
      "proto_counts": np.zeros(0, np.int64)}, "no prototypes"),
    ({"prototypes": np.zeros(4, np.float32)}, "float \\[k, d\\]"),
    ({"proto_classes": np.array([0.0, 1.0], np.float32)}, "integer"),
    ({"proto_counts": np.array([0, 3], np.int64)}, "proto_counts must be >= 1"),
    ({"proto_counts": np.array([8, 3], np.int64)}, "num_samples=10"),
    ({"prototypes": np.array([[0, np.nan], [0, 0]], np.float32)}, "NaN"),
], ids=["missing", "short-classes", "long-counts", "class-too-big", "class-negative", "duplicate",
        "feature-dim", "empty", "not-2d", "float-classes", "zero-count", "counts-over-n", "nan"])
def test_validate_refuses_malformed_extras(change: dict, match: str) -> None:
    s = FedPAD()
    assert s.validate(_result("A", 1.0)) is None
    extras = {k: v for k, v in change.items() if v is not None}
    r = _result("A", 1.0, **extras)
    if change.get("prototypes", 0) is None:
        r = ClientResult("A", r.tensors, 10, 0.5, {}, extras={k: v for k, v in r.extras.items() if k != "prototypes"})
    reason = s.validate(r)
    assert reason is not None and __import__("re").search(match, reason), reason
    with pytest.raises(ValueError, match="update of A"):
        s.step(1, [], [r])


def test_validate_checks_feature_width_against_global_prototypes_without_a_head() -> None:
    s = FedPAD()
    s.step(1, [], _results())  # global prototypes are 2-d
    r = ClientResult("A", (np.zeros(3, np.float32),), 10, 0.5, {},
                     extras={"prototypes": np.zeros((1, 5), np.float32), "proto_classes": np.array([0]),
                             "proto_counts": np.array([1])})
    assert "width 5" in s.validate(r)


def test_constructor_parameters_and_defaults() -> None:
    s = FedPAD()
    assert (s.tau, s.gamma, s.lambda_proto, s.fixed_alpha) == (DEFAULT_TAU, DEFAULT_GAMMA, 0.1, False)
    assert DEFAULT_TAU == 0.1 and DEFAULT_GAMMA == 0.1
    assert FedPAD(lambda_proto=0).configure_round(1, ["a"], np.random.default_rng(0)).config["lambda_proto"] == 0.0
    for bad in ({"tau": 0}, {"tau": -1}, {"gamma": -0.1}, {"lambda_proto": -1}, {"fixed_alpha": "yes"},
                {"gamma": float("nan")}):
        with pytest.raises(ValueError):
            FedPAD(**bad)
    with pytest.raises(TypeError):
        FedPAD(mu=0.1)  # unknown [algorithm] key
    assert (s.proto_loss, s.prototype_mix) == ("mse", "theta")
    assert s.configure_round(1, ["a"], np.random.default_rng(0)).config["proto_loss"] == "mse"
    assert FedPAD(proto_loss="sum").configure_round(1, ["a"], np.random.default_rng(0)).config["proto_loss"] == "sum"
    for bad in ({"proto_loss": "mean"}, {"prototype_mix": "alpha"}):
        with pytest.raises(ValueError, match="must be one of"):
            FedPAD(**bad)


def _from_hand_worked_globals(**kw) -> FedPAD:
    s = FedPAD(gamma=LN2, tau=0.1, **kw)
    s.load_state_dict({"prototypes": G_PROTOS, "proto_classes": G_CLASSES, "prev_clients": [],
                       "prev_alpha": np.zeros(0)})
    return s


def test_uniform_prototype_mix_by_hand() -> None:
    """Against P_g of the hand-worked example, d = (6, 5, 0) and θ = (64, 32, 1)/97. Class 1 comes
    from A (1, 1) and B (4, 4): θ-mixed (64·1 + 32·4)/96 = 2 per coordinate; uniform (1 + 4)/2 = 2.5.
    α = softmax(−θ/τ) either way; with fixed_alpha too, α = 1/3 (θ/α off)."""
    theta = np.array([64, 32, 1]) / 97
    a = np.exp(-theta / 0.1)
    alpha = a / a.sum()
    for mix, class1 in (("theta", 2.0), ("uniform", 2.5)):
        s = _from_hand_worked_globals(prototype_mix=mix)
        out = s.step(2, [], _results())
        m = s.committed_metrics
        assert m["fedpad_theta"] == pytest.approx(theta.tolist())
        assert m["fedpad_alpha"] == pytest.approx(alpha.tolist())
        np.testing.assert_allclose(out[0], _head(float(alpha @ [1.0, 2.0, 4.0])), rtol=1e-6)
        g = s.global_extras()
        np.testing.assert_array_equal(g["proto_classes"], [0, 1, 2, 3])
        np.testing.assert_allclose(g["prototypes"], [[3, 4], [class1, class1], [0, 2], [9, 9]], rtol=1e-6)
    s = _from_hand_worked_globals(prototype_mix="uniform", fixed_alpha=True)
    out = s.step(2, [], _results())
    np.testing.assert_allclose(out[0], _head(7 / 3), rtol=1e-6)  # (1 + 2 + 4) / 3
    np.testing.assert_allclose(s.global_extras()["prototypes"][1], [2.5, 2.5], rtol=1e-6)


def test_state_dict_survives_a_checkpoint_and_resumes_identically(tmp_path: Path) -> None:
    a = FedPAD(gamma=LN2)
    a.step(1, [], _results())
    store = CheckpointStore(tmp_path / "c.sqlite")
    store.save(Checkpoint(1, [np.zeros(1, np.float32)], a.state_dict(), {}, [], {}))
    b = FedPAD(gamma=LN2)
    b.load_state_dict(store.load().strategy_state)
    store.close()
    np.testing.assert_array_equal(b.global_extras()["prototypes"], a.global_extras()["prototypes"])
    out_a, out_b = a.step(2, [], _results()), b.step(2, [], _results())
    np.testing.assert_array_equal(out_a[0], out_b[0])
    assert a.committed_metrics == b.committed_metrics  # same d, θ, α and drift (previous α restored)
    fresh = FedPAD()
    fresh.load_state_dict(FedPAD().state_dict())
    assert fresh.global_extras() == {}


# ----------------------------------- the client --------------------------------------------

NUM_CLASSES, SIZE, FEAT = 4, 8, 64


def _model() -> torch.nn.Module:
    torch.manual_seed(11)
    return build_model("lightcnn", in_channels=1, image_size=SIZE, num_classes=NUM_CLASSES, feature_dim=FEAT)


def _shard(n: int, classes=(0, 2, 3), seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, SIZE, SIZE, generator=g)
    y = torch.tensor([classes[i % len(classes)] for i in range(n)], dtype=torch.int64)
    return x, y


def test_model_prototypes_omit_absent_classes_and_empty_shards() -> None:
    x, y = _shard(5, classes=(3, 1))
    p, c, n = model_prototypes(_model(), x, y, CPU, batch_size=2)
    np.testing.assert_array_equal(c, [1, 3])
    np.testing.assert_array_equal(n, [2, 3])
    assert p.shape == (2, FEAT) and np.isfinite(p).all()
    p0, c0, n0 = model_prototypes(_model(), x[:0], y[:0], CPU)
    assert p0.shape[0] == 0 and c0.shape == (0,) and n0.shape == (0,)


def test_client_prototypes_equal_a_numpy_recomputation_from_the_trained_model() -> None:
    x, y = _shard(23)  # classes 0, 2, 3 present; class 1 absent
    model = _model()
    cfg = TrainConfig(local_epochs=2, batch_size=8, lr=0.05, momentum=0.9, seed=3)
    res = FedPADClient().local_round(model, state_arrays(model), x, y, cfg, round=1, client_index=0, device=CPU)
    ex = res.extras
    assert set(ex) == {"prototypes", "proto_classes", "proto_counts"}
    np.testing.assert_array_equal(ex["proto_classes"], [0, 2, 3])
    np.testing.assert_array_equal(ex["proto_counts"], [8, 8, 7])
    assert ex["prototypes"].dtype == np.float32 and ex["prototypes"].shape == (3, FEAT)
    assert ex["proto_classes"].dtype == np.int64 and ex["proto_counts"].dtype == np.int64
    # recompute from the uploaded weights: a fresh model, its features, numpy per-class means
    check = _model()
    check.load_state_dict({k: torch.from_numpy(v) for k, v in zip(check.state_dict(), res.tensors)})
    with torch.no_grad():
        z = check.features(x).numpy().astype(np.float64)
    yn = y.numpy()
    want = np.stack([z[yn == k].mean(axis=0) for k in (0, 2, 3)])
    np.testing.assert_allclose(ex["prototypes"], want, rtol=1e-5, atol=1e-6)
    assert res.num_samples == 23 and np.isfinite(ex["prototypes"]).all()


def _global_protos():
    g = torch.Generator().manual_seed(9)
    # classes 0 and 3 have a global prototype, class 2 (present locally) has none
    return torch.rand(2, FEAT, generator=g).numpy().astype(np.float32), np.array([0, 3], np.int64)


@pytest.mark.parametrize(("proto_loss", "per"), [("sum", 1), ("mse", FEAT)])
def test_lambda_term_changes_one_sgd_step_as_predicted(proto_loss: str, per: int) -> None:
    """One full-batch SGD step (lr η, no momentum): w' = w − η(∇CE + λ∇L_proto), where ∇L_proto is
    back-propagated by hand from dL/dz_b = 2(z_b − p_g^{(y_b)})/(B·per) for samples with a
    prototype: per = 1 for ``proto_loss = "sum"``, F for ``"mse"``."""
    x, y = _shard(12)
    gp, gc = _global_protos()
    lam, lr = 0.7, 0.05
    cfg = TrainConfig(local_epochs=1, batch_size=12, lr=lr, momentum=0.0, seed=1)
    m0 = _model()
    w0 = state_arrays(m0)
    res = FedPADClient().local_round(m0, w0, x, y, cfg, round=2, client_index=0, device=CPU,
                                     params={"lambda_proto": lam, "proto_loss": proto_loss},
                                     global_extras={"prototypes": gp, "proto_classes": gc})
    plain = FedPADClient().local_round(_model(), w0, x, y, cfg, round=2, client_index=0, device=CPU,
                                       params={"lambda_proto": 0.0},
                                       global_extras={"prototypes": gp, "proto_classes": gc})
    # manual gradients on a fresh copy (full batch: the permutation does not matter for the mean losses)
    ref = _model()
    params = list(ref.parameters())
    z = ref.features(x)
    ce = F.cross_entropy(ref.head(z), y)
    g_ce = torch.autograd.grad(ce, params, retain_graph=True)
    table = np.zeros((NUM_CLASSES, FEAT), np.float32)
    table[gc] = gp
    mask = torch.tensor([int(c) in (0, 3) for c in y], dtype=torch.float32).unsqueeze(1)
    dz = 2.0 * (z.detach() - torch.from_numpy(table)[y]) * mask / (len(y) * per)
    g_proto = [torch.zeros_like(p) if g is None else g  # the head does not enter L_proto
               for p, g in zip(params, torch.autograd.grad(z, params, grad_outputs=dz, allow_unused=True))]
    expect = [p.detach().numpy() - lr * (gc_.numpy() + lam * gp_.numpy()) for p, gc_, gp_ in zip(params, g_ce, g_proto)]
    expect_plain = [p.detach().numpy() - lr * gc_.numpy() for p, gc_ in zip(params, g_ce)]
    for got, want in zip(res.tensors, expect):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    for got, want in zip(plain.tensors, expect_plain):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # the difference is exactly the λ term, and it is not negligible
    diff = [a - b for a, b in zip(res.tensors, plain.tensors)]
    want_diff = [-lr * lam * g.numpy() for g in g_proto]
    for dg, dw in zip(diff, want_diff):
        np.testing.assert_allclose(dg, dw, rtol=1e-3, atol=1e-6)
    assert max(float(np.abs(d).max()) for d in diff) > 1e-4
    assert res.metrics["proto_classes_aligned"] == 2 and plain.metrics["proto_classes_aligned"] == 0
    # the reported loss is CE + λ·L_proto at the start of the step
    l_proto = float(((z.detach() - torch.from_numpy(table)[y]) ** 2 * mask).sum() / (len(y) * per))
    assert res.train_loss == pytest.approx(float(ce.detach()) + lam * l_proto, rel=1e-5)


def test_round_one_without_global_prototypes_is_plain_cross_entropy() -> None:
    """No global prototypes → CE only: bit-identical to the FedAvg client (same seed and data)."""
    from edge_agent.algorithms.fedavg import FedAvgClient

    x, y = _shard(20)
    cfg = TrainConfig(local_epochs=2, batch_size=6, lr=0.05, momentum=0.9, seed=4)
    w0 = state_arrays(_model())
    a = FedPADClient().local_round(_model(), w0, x, y, cfg, round=1, client_index=3, device=CPU)
    b = FedAvgClient().local_round(_model(), w0, x, y, cfg, round=1, client_index=3, device=CPU)
    for u, v in zip(a.tensors, b.tensors):
        np.testing.assert_array_equal(u, v)
    assert a.train_loss == b.train_loss


def test_alignment_loss_by_hand_in_both_scales() -> None:
    table, has = prototype_table(np.array([[1.0, 1.0]], np.float32), np.array([2]), 3, CPU)
    z = torch.tensor([[1.0, 3.0], [0.0, 0.0], [4.0, 5.0]])
    y = torch.tensor([2, 0, 2])  # class 0 has no global prototype: adds 0, counts in B = 3
    # "sum": (||(1,3)−(1,1)||² + 0 + ||(4,5)−(1,1)||²) / B = (0² + 2² + 3² + 4²) / 3 = 29 / 3
    assert float(prototype_alignment_loss(z, y, table, has, "sum")) == pytest.approx(29 / 3)
    # "mse": the same squares over the B·F = 3·2 entries: 29 / 6 (nn.MSELoss of the reference code)
    assert float(prototype_alignment_loss(z, y, table, has, "mse")) == pytest.approx(29 / 6)
    assert float(prototype_alignment_loss(z, y, table, has)) == pytest.approx(29 / 6)  # the default
    assert DEFAULT_PROTO_LOSS == "mse"
    assert float(prototype_alignment_loss(z[:0], y[:0], table, has)) == 0.0
    with pytest.raises(ValueError, match="proto_loss must be one of"):
        prototype_alignment_loss(z, y, table, has, "mean")


@pytest.mark.parametrize(("protos", "classes", "match"), [
    (np.zeros((2, FEAT), np.float32), np.array([0]), "expected"),
    (np.zeros((1, FEAT), np.float32), np.array([4]), "in \\[0, 4\\)"),
    (np.zeros((2, FEAT), np.float32), np.array([1, 1]), "unique"),
    (np.zeros((1, 3), np.float32), np.array([1]), "3 features"),
], ids=["lengths", "range", "repeat", "width"])
def test_client_refuses_malformed_global_prototypes(protos, classes, match) -> None:
    x, y = _shard(4)
    m = _model()
    with pytest.raises(ModelError, match=match):
        FedPADClient().local_round(m, state_arrays(m), x, y, TrainConfig(seed=0), round=2, client_index=0, device=CPU,
                                   global_extras={"prototypes": protos, "proto_classes": classes})


# ------------------------------ the shared sgd_epochs hooks --------------------------------


def test_loss_fn_hook_with_cross_entropy_is_bit_identical_to_the_default() -> None:
    x, y = _shard(15)
    cfg = TrainConfig(local_epochs=2, batch_size=4, lr=0.1, momentum=0.9, weight_decay=1e-3, seed=2)
    a, b = _model(), _model()
    ra = sgd_epochs(a, x, y, cfg, shuffle_generator(2, 1, 0), CPU)
    rb = sgd_epochs(b, x, y, cfg, shuffle_generator(2, 1, 0), CPU,
                    loss_fn=lambda m, xb, yb: (F.cross_entropy(m(xb), yb), m(xb)))
    assert ra == rb
    for u, v in zip(state_arrays(a), state_arrays(b)):
        np.testing.assert_array_equal(u, v)


def test_before_step_edits_the_gradient_before_each_step() -> None:
    """A hook adding a constant c to every gradient: one full-batch step gives w − η(g + c)
    (SCAFFOLD's corrected gradient g + c − c_i has this form)."""
    x, y = _shard(10)
    cfg = TrainConfig(local_epochs=1, batch_size=10, lr=0.1, momentum=0.0, seed=0)
    calls = []

    def hook(m, context):
        calls.append(all(p.grad is not None for p in m.parameters()))
        for p in m.parameters():
            p.grad.add_(0.5)

    model = _model()
    sgd_epochs(model, x, y, cfg, shuffle_generator(0, 1, 0), CPU, before_step=hook)
    assert calls == [True]
    ref = _model()
    grads = torch.autograd.grad(F.cross_entropy(ref(x), y), list(ref.parameters()))
    for got, p, g in zip(state_arrays(model), ref.parameters(), grads):
        np.testing.assert_allclose(got, (p - 0.1 * (g + 0.5)).detach().numpy(), rtol=1e-5, atol=1e-6)


class _Scaler:
    def __init__(self, device="cuda"):
        self.calls = []
        _Scaler.last = self

    def scale(self, loss):
        self.calls.append("scale")
        return loss

    def unscale_(self, opt):
        self.calls.append("unscale_")

    def step(self, opt):
        self.calls.append("step")
        opt.step()

    def update(self):
        self.calls.append("update")


class _NoAutocast:
    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_before_step_sees_unscaled_gradients_under_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp16 branch (faked without a GPU): per batch scale → unscale_ → hook → step → update."""
    monkeypatch.setattr(torch, "autocast", _NoAutocast)
    monkeypatch.setattr(torch.amp, "GradScaler", _Scaler)
    monkeypatch.setattr(fedavg_mod, "_to_device", lambda t, device: t)
    x, y = _shard(8)
    cfg = TrainConfig(local_epochs=1, batch_size=4, lr=0.1, seed=0)
    sgd_epochs(_model(), x, y, cfg, shuffle_generator(0, 1, 0), torch.device("cuda", 0), precision="fp16",
               before_step=lambda m, context: _Scaler.last.calls.append("hook"))
    assert _Scaler.last.calls == ["scale", "unscale_", "hook", "step", "update"] * 2


# ------------------------------------ end to end -------------------------------------------


@pytest.mark.slow
def test_fedpad_federation_over_the_broker_with_partial_participation(tmp_path: Path) -> None:
    from helpers.federation import small_config

    from broker_server.simulate import simulate

    cfg = small_config(data={"clients": 5}, server={"participation_rate": 0.4, "quorum": 2},
                       train={"algorithm": "fedpad"}, algorithm={"gamma": 1.0, "lambda_proto": 0.1})
    res = simulate(cfg, run_dir=tmp_path / "run")
    assert res.rounds_completed == 2
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    for m in lines:
        assert m["clients_reported"] == 2 and not m["skipped"]
        assert m["fedpad_clients"] == sorted(m["fedpad_clients"]) and len(m["fedpad_clients"]) == 2
        assert sum(m["fedpad_alpha"]) == pytest.approx(1.0) and sum(m["fedpad_theta"]) == pytest.approx(1.0)
    assert lines[0]["fedpad_d"] is None and lines[0]["fedpad_alpha"] == [0.5, 0.5]
    d = lines[1]["fedpad_d"]
    assert len(d) == 2 and all(x > 0 for x in d)
    theta = np.exp(np.array(d) - max(d))
    theta /= theta.sum()  # γ = 1
    assert lines[1]["fedpad_theta"] == pytest.approx(theta.tolist())
    alpha = np.exp(-theta / 0.1)
    assert lines[1]["fedpad_alpha"] == pytest.approx((alpha / alpha.sum()).tolist())
    common = set(lines[0]["fedpad_clients"]) & set(lines[1]["fedpad_clients"])
    assert lines[1]["fedpad_alpha_drift_clients"] == len(common)
    assert (lines[1]["fedpad_alpha_drift"] is None) == (len(common) < 2)
    # the global of round 2 carried the prototypes: the ledger has them on the downlink
    import sqlite3

    con = sqlite3.connect(tmp_path / "run" / "ledger.sqlite")
    down = [json.loads(f) for (f,) in con.execute(
        "select fields from messages where side='server' and kind='global' and event='sent' and round=2")]
    assert down and all("extras.prototypes" in f and "extras.proto_classes" in f for f in down)
    up = [json.loads(f) for (f,) in con.execute(
        "select fields from messages where side='agent' and kind='update' and event='sent'")]
    assert up and all({"extras.prototypes", "extras.proto_classes", "extras.proto_counts"} <= set(f) for f in up)
