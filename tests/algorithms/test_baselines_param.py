"""Parameter-averaging baselines: FedProx, FedAdam / FedOpt, SCAFFOLD, FedDyn (SPECS §6.12–6.14, 6.17).

Every update rule is checked against an independent computation: numpy loops written from the
papers' formulas on tiny models (a 2-parameter linear model whose SGD steps are worked out in
numpy, a quadratic objective for SCAFFOLD), ``torch.optim.SGD`` as a second implementation of
server momentum, and, for one short federation per family over the embedded broker, the
updates a spy client saw on the wire.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch

from broker_server.checkpoint import Checkpoint, CheckpointStore
from broker_server.embedded_broker import EmbeddedBroker
from broker_server.strategies import ClientResult, apply_update, get_strategy
from broker_server.strategies.fedadam import FedAdam, adam_server_step
from broker_server.strategies.feddyn import FedDyn
from broker_server.strategies.fedopt import FedOpt
from broker_server.strategies.fedprox import FedProx
from broker_server.strategies.scaffold import Scaffold
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedavg import FedAvgClient, shuffle_generator
from edge_agent.algorithms.feddyn import FedDynClient
from edge_agent.algorithms.fedprox import FedProxClient, proximal_term
from edge_agent.algorithms.scaffold import CONTROL, CONTROL_DELTA, ScaffoldClient, control_variate_option2
from edge_agent.errors import ModelError
from edge_agent.models import build_model

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------
# helpers: a 2-parameter linear model and its numpy twin


def linear_model(w: np.ndarray) -> torch.nn.Linear:
    """Linear(1 → 2, no bias): logits = [w0·x, w1·x]; weight [2, 1]."""
    m = torch.nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.tensor(w, dtype=torch.float32).reshape(2, 1))
    return m


def ce_grad(w: np.ndarray, xb: np.ndarray, yb: np.ndarray) -> tuple[np.ndarray, float]:
    """Mean cross-entropy of logits w·x (w [2], x [B]) and its gradient in w, by hand."""
    z = np.outer(xb, w)  # [B, 2]
    z = z - z.max(1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    onehot = np.eye(2)[yb]
    loss = float(-np.log(p[np.arange(len(yb)), yb]).mean())
    return ((p - onehot) * xb[:, None]).mean(0), loss


def batches(n: int, batch: int, epochs: int, seed: int, rnd: int, idx: int) -> list[np.ndarray]:
    """The mini-batch index lists FedAvg's sgd_epochs visits (documented: randperm of the round's generator)."""
    g = shuffle_generator(seed, rnd, idx)
    out = []
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g).numpy()
        out += [perm[s:s + batch] for s in range(0, n, batch)]
    return out


X1 = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
Y1 = np.array([0, 1, 1, 0], np.int64)
W_G = np.array([0.3, -0.2])


def run_linear(client, w_g=W_G, *, lr=0.1, batch=1, epochs=1, momentum=0.0, params=None, extras=None, rnd=1):
    model = linear_model(np.zeros(2))
    cfg = TrainConfig(local_epochs=epochs, batch_size=batch, lr=lr, momentum=momentum, seed=3)
    res = client.local_round(model, (w_g.reshape(2, 1).astype(np.float32),), torch.from_numpy(X1[:, None]),
                             torch.from_numpy(Y1), cfg, round=rnd, client_index=0, device=CPU,
                             params=params or {}, global_extras=extras or {})
    return res, cfg


# ------------------------------------------------------------------------------------------
# FedProx


def test_proximal_term_value_and_gradient() -> None:
    w = [torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([[3.0]], requires_grad=True)]
    a = [torch.tensor([0.5, 0.0]), torch.tensor([[1.0]])]
    t = proximal_term(w, a)
    assert float(t.detach()) == pytest.approx(0.25 + 4.0 + 4.0)
    t.backward()
    np.testing.assert_allclose(w[0].grad.numpy(), [1.0, 4.0])  # 2·(w − a)
    np.testing.assert_allclose(w[1].grad.numpy(), [[4.0]])


def test_fedprox_two_sgd_steps_by_hand() -> None:
    mu, lr = 0.5, 0.1
    res, cfg = run_linear(FedProxClient(), params={"mu": mu}, lr=lr, batch=2)
    w = W_G.copy()
    losses = []
    for b in batches(4, 2, 1, cfg.seed, 1, 0):
        g, ce = ce_grad(w, X1[b].astype(np.float64), Y1[b])
        losses.append((ce + mu / 2 * np.sum((w - W_G) ** 2)) * len(b))
        w = w - lr * (g + mu * (w - W_G))
    np.testing.assert_allclose(res.tensors[0].reshape(-1), w, rtol=1e-6, atol=1e-7)
    assert res.train_loss == pytest.approx(sum(losses) / 4, rel=1e-6)
    assert res.num_samples == 4 and res.extras == {}
    # the proximal pull is visible: FedAvg from the same start ends elsewhere
    plain, _ = run_linear(FedAvgClient(), lr=lr, batch=2)
    assert not np.allclose(plain.tensors[0], res.tensors[0])


def test_fedprox_mu_zero_is_fedavg_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    glob = tuple(t.detach().numpy().copy() for t in model.state_dict().values())
    x = torch.randn(40, 1, 8, 8)
    y = torch.randint(0, 10, (40,))
    cfg = TrainConfig(local_epochs=2, batch_size=8, lr=0.05, momentum=0.5, weight_decay=1e-3, seed=7)
    out = []
    for client in (FedAvgClient(), FedProxClient()):
        m = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
        out.append(client.local_round(m, glob, x, y, cfg, round=2, client_index=1, device=CPU, params={"mu": 0.0}))
    for a, b in zip(out[0].tensors, out[1].tensors):
        np.testing.assert_array_equal(a, b)
    assert out[0].train_loss == out[1].train_loss
    assert out[0].metrics["train_accuracy"] == out[1].metrics["train_accuracy"]


def test_fedprox_strategy_sends_mu_and_aggregates_as_fedavg() -> None:
    s = FedProx(mu=0.2, train_config={"lr": 0.1})
    plan = s.configure_round(1, ["a", "b"], np.random.default_rng(0))
    assert plan.config == {"lr": 0.1, "mu": 0.2}
    assert FedProx().train_config["mu"] == 0.01  # SPECS §6.17 default
    res = [ClientResult("a", (np.array([1.0, 2.0], np.float32),), 1, 0.0),
           ClientResult("b", (np.array([4.0, 8.0], np.float32),), 3, 0.0)]
    np.testing.assert_allclose(s.step(1, [np.zeros(2, np.float32)], res)[0], [3.25, 6.5])
    with pytest.raises(ValueError, match="mu"):
        FedProx(mu=-1.0)


# ------------------------------------------------------------------------------------------
# FedAdam / FedOpt

CUR = [np.array([[0.5, -1.0, 2.0], [0.0, 1.5, -0.5]], np.float32), np.array([1.0, 2.0, 3.0, 4.0], np.float32),
       np.array([7], np.int64)]


def client_models(rnd: int) -> list[ClientResult]:
    """Three clients' models for round ``rnd`` (deterministic), with sample counts 10, 30, 60."""
    rng = np.random.default_rng(100 + rnd)
    out = []
    for i, n in enumerate((10, 30, 60)):
        ts = (rng.normal(size=(2, 3)).astype(np.float32), rng.normal(size=4).astype(np.float32),
              np.array([7 + i], np.int64))
        out.append(ClientResult(f"c{i}", ts, n, 0.0))
    return out


def weighted_mean(results, i, weights=None) -> np.ndarray:
    w = np.array([r.num_samples for r in results], np.float64) if weights is None else np.asarray(weights, float)
    return sum(wk * r.tensors[i].astype(np.float64) for wk, r in zip(w, results)) / w.sum()


@pytest.mark.parametrize("bias_correction", [False, True])
def test_fedadam_two_rounds_against_numpy(bias_correction: bool) -> None:
    eta, b1, b2, tau = 0.05, 0.8, 0.95, 1e-2
    s = FedAdam(server_lr=eta, beta1=b1, beta2=b2, tau=tau, bias_correction=bias_correction)
    w = [c.astype(np.float64) for c in CUR[:2]]
    m = [np.zeros_like(a) for a in w]
    v = [np.zeros_like(a) for a in w]
    current = list(CUR)
    for t in (1, 2):
        results = client_models(t)
        new = s.step(t, current, results)
        lr = eta * np.sqrt(1 - b2 ** t) / (1 - b1 ** t) if bias_correction else eta
        for i in range(2):
            d = weighted_mean(results, i) - w[i]
            m[i] = b1 * m[i] + (1 - b1) * d
            v[i] = b2 * v[i] + (1 - b2) * d ** 2
            w[i] = w[i] + lr * m[i] / (np.sqrt(v[i]) + tau)
            np.testing.assert_allclose(s.m[i], m[i], rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(s.v[i], v[i], rtol=1e-6, atol=1e-9)
            np.testing.assert_allclose(new[i], w[i], rtol=1e-6, atol=1e-6)
            assert new[i].dtype == np.float32
        # integer state takes FedAvg's mean (cast back to int64)
        assert new[2].dtype == np.int64 and new[2][0] == int(weighted_mean(results, 2)[0])
        current = new
        w = [a.astype(np.float64) for a in new[:2]]  # the server's model is float32
    assert s.steps == 2
    assert s.committed_metrics["server_update_norm"] > 0


def test_fedadam_defaults_are_specs() -> None:
    s = FedAdam()
    assert (s.server_lr, s.beta1, s.beta2, s.tau, s.bias_correction) == (1e-2, 0.9, 0.99, 1e-3, False)
    for bad in ({"beta1": 1.0}, {"beta2": -0.1}, {"tau": 0.0}, {"server_lr": 0.0}, {"bias_correction": "yes"}):
        with pytest.raises(ValueError):
            FedAdam(**bad)
    with pytest.raises(TypeError):
        FedAdam(no_such_knob=1)


def test_adam_first_step_moves_each_entry_by_about_eta() -> None:
    # t = 1, no bias correction: m = (1−β1)Δ, v = (1−β2)Δ², step = η·(1−β1)/√(1−β2)·sign(Δ) for |Δ| ≫ τ
    new, m, v = adam_server_step([np.zeros(3, np.float32)], [np.array([1.0, -4.0, 100.0])], None, None, step=1,
                                 lr=0.1, beta1=0.9, beta2=0.99, tau=1e-9)
    np.testing.assert_allclose(new[0], 0.1 * 0.1 / np.sqrt(0.01) * np.array([1, -1, 1]), rtol=1e-6)


def test_fedopt_matches_torch_sgd_momentum() -> None:
    """Server SGD with momentum (RethinkFL's FedOpt) recomputed with torch.optim.SGD on grad = w − mean."""
    lr, beta = 0.3, 0.9
    s = FedOpt(server_lr=lr, server_momentum=beta)
    params = [torch.nn.Parameter(torch.from_numpy(c.astype(np.float64))) for c in CUR[:2]]
    opt = torch.optim.SGD(params, lr=lr, momentum=beta)
    current = list(CUR)
    for t in (1, 2, 3):
        results = client_models(t)
        new = s.step(t, current, results)
        opt.zero_grad()
        for i, p in enumerate(params):
            p.grad = p.detach() - torch.from_numpy(weighted_mean(results, i))
        opt.step()
        for i, p in enumerate(params):
            np.testing.assert_allclose(new[i], p.detach().numpy(), rtol=1e-6, atol=1e-6)
        current = new
        with torch.no_grad():  # continue from the float32 model the server holds
            for p, a in zip(params, new):
                p.copy_(torch.from_numpy(a.astype(np.float64)))
    assert (FedOpt().server_lr, FedOpt().server_momentum) == (0.1, 0.9)


def test_streaming_equals_aggregate_and_nan_is_not_committed() -> None:
    a, b = FedAdam(), FedAdam()
    acc = a.accumulator(1, CUR)
    for r in client_models(1):
        acc.add(r)
    streamed = apply_update(a, 1, acc.result())
    whole = b.step(1, CUR, client_models(1))
    for x, y in zip(streamed, whole):
        np.testing.assert_array_equal(x, y)
    assert a.accumulator(2, CUR).result() is None  # nothing arrived: keep the model
    m_before = [x.copy() for x in a.m]
    bad = client_models(2)
    bad[0] = ClientResult("c0", (np.full((2, 3), np.inf, np.float32),) + bad[0].tensors[1:], 10, 0.0)
    with np.errstate(invalid="ignore"):  # inf/inf in the Adam step
        out = a.step(2, streamed, bad)
    assert not np.isfinite(out[0]).all()  # the server discards it ...
    for x, y in zip(a.m, m_before):  # ... and the strategy's state did not move
        np.testing.assert_array_equal(x, y)
    assert a.steps == 1


# ------------------------------------------------------------------------------------------
# SCAFFOLD on a quadratic


A = {0: np.array([1.0, 3.0]), 1: np.array([2.0, 0.5])}
B = {0: np.array([1.0, -1.0]), 1: np.array([-2.0, 4.0])}


class QuadraticScaffold(ScaffoldClient):
    """SCAFFOLD's client on f_k(w) = ½ Σ_j a_j (w_j − b_j)² (independent of the data), w = Linear(2→1).weight."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.a, self.b = torch.tensor(A[k], dtype=torch.float32), torch.tensor(B[k], dtype=torch.float32)

    def begin_round(self, model, config, params, global_extras):
        super().begin_round(model, config, params, global_extras)  # c − c_i for before_step

        def loss_fn(m, xb, yb):
            w = m.weight.reshape(-1)
            return 0.5 * (self.a * (w - self.b) ** 2).sum(), torch.zeros(len(yb), 2)

        return loss_fn


def quad_round(client, x, c, *, lr, momentum=0.0, wd=0.0, rnd=1):
    model = torch.nn.Linear(2, 1, bias=False)
    cfg = TrainConfig(local_epochs=2, batch_size=2, lr=lr, momentum=momentum, weight_decay=wd, seed=0)
    extras = {} if c is None else {CONTROL: c.astype(np.float32)}
    return client.local_round(model, (x.reshape(1, 2).astype(np.float32),), torch.zeros(3, 1), torch.zeros(3).long(),
                              cfg, round=rnd, client_index=0, device=CPU, global_extras=extras)


def numpy_scaffold_client(k, x, c, c_i, *, lr, steps, momentum=0.0, wd=0.0):
    """K local steps y ← y − η(∇f_k(y) + λy + c − c_i) (heavy-ball when momentum > 0); returns y, c_i⁺."""
    y, buf, gsum = x.astype(np.float64).copy(), None, np.zeros(2)
    for _ in range(steps):
        g = A[k] * (y - B[k]) + wd * y
        gsum += g
        d = g + c - c_i
        buf = d if buf is None else momentum * buf + d
        y = y - lr * (buf if momentum else d)
    c_new = gsum / steps if momentum else c_i - c + (x - y) / (steps * lr)
    return y, c_new


def test_scaffold_one_round_on_a_quadratic_client_and_server() -> None:
    lr, steps = 0.1, 4  # 3 samples, batch 2, 2 epochs: 2 + 2 optimizer steps
    x = np.array([0.5, 0.5])
    clients = {k: QuadraticScaffold(k) for k in (0, 1)}
    s = Scaffold()  # η_g = 1, uniform mean
    s.configure_round(1, ["a", "b", "c"], np.random.default_rng(0))  # N = 3 clients, 2 report
    assert s.global_extras() == {}
    results, ref = [], {}
    for k, client in clients.items():
        res = quad_round(client, x, None, lr=lr)
        y, c_i = numpy_scaffold_client(k, x, np.zeros(2), np.zeros(2), lr=lr, steps=steps)
        assert client.steps == steps
        np.testing.assert_allclose(res.tensors[0].reshape(-1), y, rtol=1e-6)
        # option II on plain gradient descent: c_i⁺ = mean of the gradients along the way
        np.testing.assert_allclose(res.extras[CONTROL_DELTA], c_i, rtol=1e-5)
        np.testing.assert_allclose(client.control, c_i, rtol=1e-5)
        results.append(ClientResult(f"k{k}", res.tensors, 3, 0.0, extras=res.extras))
        ref[k] = (y, c_i)
    new = s.step(1, [x.reshape(1, 2).astype(np.float32)], results)
    c_ref = (ref[0][1] + ref[1][1]) / 3  # c ← 0 + Σ Δc_i / N with N = 3
    np.testing.assert_allclose(s.control, c_ref, rtol=1e-5)
    np.testing.assert_allclose(new[0].reshape(-1), (ref[0][0] + ref[1][0]) / 2, rtol=1e-6)
    assert s.committed_metrics["num_clients"] == 3

    # round 2: c travels in the global extras and corrects each step by c − c_i
    x2 = new[0].reshape(-1).astype(np.float64)
    c = s.global_extras()[CONTROL]
    assert c.dtype == np.float32 and c.shape == (2,)
    res = quad_round(clients[0], x2, c, lr=lr, rnd=2)
    y, c_i = numpy_scaffold_client(0, x2, c.astype(np.float64), ref[0][1], lr=lr, steps=steps)
    np.testing.assert_allclose(res.tensors[0].reshape(-1), y, rtol=1e-5)
    np.testing.assert_allclose(res.extras[CONTROL_DELTA], c_i - ref[0][1], rtol=1e-4, atol=1e-6)


def test_scaffold_momentum_uses_the_mean_gradient() -> None:
    lr, beta, wd = 0.05, 0.9, 0.01
    x, c = np.array([0.5, -0.5]), np.array([0.3, -0.1])
    client = QuadraticScaffold(1)
    client.control = np.array([0.1, 0.2])
    res = quad_round(client, x, c, lr=lr, momentum=beta, wd=wd)
    y, c_i = numpy_scaffold_client(1, x, c.astype(np.float32).astype(np.float64), np.array([0.1, 0.2]), lr=lr,
                                   steps=4, momentum=beta, wd=wd)
    np.testing.assert_allclose(res.tensors[0].reshape(-1), y, rtol=1e-5)
    np.testing.assert_allclose(client.control, c_i, rtol=1e-5)
    # option II's literal formula would have inflated c_i by the momentum (≈ 1/(1−β) in the long run)
    literal = control_variate_option2(np.array([0.1, 0.2]), c, x, y, 4, lr)
    assert not np.allclose(literal, c_i, rtol=0.1)


def test_scaffold_client_refuses_a_control_of_the_wrong_size() -> None:
    with pytest.raises(ModelError, match="2 parameters"):
        quad_round(QuadraticScaffold(0), np.zeros(2), np.zeros(3), lr=0.1)


def test_scaffold_validate_and_weighting() -> None:
    s = Scaffold(weighting="samples", num_clients=4, server_lr=0.5)
    ok = {CONTROL_DELTA: np.ones(2, np.float32)}
    t = (np.zeros((1, 2), np.float32),)
    assert s.validate(ClientResult("a", t, 1, 0.0, extras=ok)) is None
    for extras in ({}, {CONTROL_DELTA: np.ones(2, np.float64)}, {CONTROL_DELTA: np.ones((1, 2), np.float32)},
                   {CONTROL_DELTA: np.array([np.nan, 0], np.float32)}, {**ok, "other": np.ones(1, np.float32)}):
        assert s.validate(ClientResult("a", t, 1, 0.0, extras=extras))
    res = [ClientResult("a", (np.array([[1.0, 1.0]], np.float32),), 1, 0.0,
                        extras={CONTROL_DELTA: np.ones(2, np.float32)}),
           ClientResult("b", (np.array([[5.0, 9.0]], np.float32),), 3, 0.0,
                        extras={CONTROL_DELTA: np.array([2.0, -4.0], np.float32)})]
    new = s.step(1, [np.zeros((1, 2), np.float32)], res)
    np.testing.assert_allclose(new[0], 0.5 * np.array([[4.0, 7.0]]))  # x + η_g·(Σ n_i y_i / n − x)
    np.testing.assert_allclose(s.control, [3.0 / 4, -3.0 / 4])  # Σ Δc / N, N fixed at 4
    assert s.validate(ClientResult("a", t, 1, 0.0, extras={CONTROL_DELTA: np.ones(3, np.float32)}))
    with pytest.raises(ValueError):
        Scaffold(weighting="median")
    with pytest.raises(ValueError):
        Scaffold(num_clients=-1)


# ------------------------------------------------------------------------------------------
# FedDyn


def test_feddyn_client_steps_and_state_by_hand() -> None:
    alpha, lr = 0.5, 0.1
    client = FedDynClient()
    g0 = np.array([0.2, -0.4])
    client.grad_state = [torch.tensor(g0, dtype=torch.float32).reshape(2, 1)]
    res, cfg = run_linear(client, params={"alpha": alpha}, lr=lr, batch=2)
    w = W_G.copy()
    for b in batches(4, 2, 1, cfg.seed, 1, 0):
        g, _ = ce_grad(w, X1[b].astype(np.float64), Y1[b])
        w = w - lr * (g - g0 + alpha * (w - W_G))  # ∇[CE − ⟨g0, w⟩ + (α/2)‖w − w_g‖²]
    np.testing.assert_allclose(res.tensors[0].reshape(-1), w, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(client.grad_state[0].numpy().reshape(-1), g0 - alpha * (w - W_G), rtol=1e-6,
                               atol=1e-7)
    # first round: the state starts at zero, then becomes −α(w − w_g)
    fresh = FedDynClient()
    res, _ = run_linear(fresh, params={"alpha": alpha}, lr=lr, batch=2)
    np.testing.assert_allclose(fresh.grad_state[0].numpy(), -alpha * (res.tensors[0] - W_G.reshape(2, 1)),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_feddyn_server_h_and_model_two_rounds(weighting: str) -> None:
    alpha = 0.1
    s = FedDyn(alpha=alpha, weighting=weighting)
    assert s.train_config["alpha"] == alpha
    s.configure_round(1, ["c0", "c1", "c2", "c3"], np.random.default_rng(0))  # N = 4, 3 report
    h = [np.zeros((2, 3)), np.zeros(4)]
    current = list(CUR)
    for t in (1, 2):
        results = client_models(t)
        new = s.step(t, current, results)
        weights = None if weighting == "samples" else [1, 1, 1]
        for i in range(2):
            diff = sum(r.tensors[i].astype(np.float64) - current[i] for r in results)
            h[i] = h[i] - alpha / 4 * diff
            want = weighted_mean(results, i, weights) - h[i] / alpha
            np.testing.assert_allclose(s.h[i], h[i], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(new[i], want, rtol=1e-5, atol=1e-5)
        current = new
    with pytest.raises(ValueError):
        FedDyn(alpha=0.0)


# ------------------------------------------------------------------------------------------
# resume: the state a checkpoint keeps gives the same next round


@pytest.mark.parametrize("name,kw", [("fedadam", {"bias_correction": True}), ("fedopt", {}), ("feddyn", {}),
                                     ("scaffold", {})])
def test_state_survives_a_checkpoint(tmp_path: Path, name: str, kw: dict) -> None:
    def results(t):
        out = client_models(t)
        if name == "scaffold":
            rng = np.random.default_rng(t)
            out = [ClientResult(r.client_id, r.tensors, r.num_samples, 0.0,
                                extras={CONTROL_DELTA: rng.normal(size=5).astype(np.float32)}) for r in out]
        return out

    a = get_strategy(name, **kw)
    a.configure_round(1, ["c0", "c1", "c2", "c3"], np.random.default_rng(0))
    w1 = a.step(1, CUR, results(1))
    store = CheckpointStore(tmp_path / "ck.sqlite")
    store.save(Checkpoint(round=1, tensors=w1, strategy_state=a.state_dict(), rng_state={}, registry={}, meta={}))
    b = get_strategy(name, **kw)
    b.load_state_dict(store.load().strategy_state)
    store.close()
    for x, y in zip(a.step(2, w1, results(2)), b.step(2, w1, results(2))):
        np.testing.assert_array_equal(x, y)
    if name == "scaffold":
        np.testing.assert_array_equal(a.global_extras()[CONTROL], b.global_extras()[CONTROL])


# ------------------------------------------------------------------------------------------
# short federations over the embedded broker (SCAFFOLD; FedAdam)


@pytest.mark.slow
def test_scaffold_and_fedadam_federations(tmp_path: Path) -> None:
    from helpers.federation import run_with_spy as _run_with_spy
    from helpers.federation import small_config, spied

    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        # --- SCAFFOLD: momentum 0 (option II literally), 2 rounds, all 3 clients report
        cfg = small_config(train={"algorithm": "scaffold", "momentum": 0.0})
        res, spy = _run_with_spy(broker, tmp_path / "scaffold", cfg)
        run = res.run_dir
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [m["clients_reported"] for m in metrics] == [3, 3]
        updates, globals_ = spied(spy)
        assert CONTROL not in globals_[1].extras  # c = 0 is not sent
        r1 = list(updates[1].values())
        p_count = sum(t.size for t in globals_[1].tensors)  # the light CNN has parameters only
        assert all(set(u.extras) == {CONTROL_DELTA} and u.extras[CONTROL_DELTA].shape == (p_count,) for u in r1)
        c1 = sum(u.extras[CONTROL_DELTA].astype(np.float64) for u in r1) / 3
        np.testing.assert_allclose(globals_[2].extras[CONTROL], c1, rtol=1e-5, atol=1e-8)
        for i, t in enumerate(globals_[2].tensors):  # η_g = 1, uniform: x = mean of the y_i
            np.testing.assert_allclose(t, sum(u.tensors[i].astype(np.float64) for u in r1) / 3, rtol=1e-5,
                                       atol=1e-6)
        ck = CheckpointStore(run / "checkpoints.sqlite")
        c2 = c1 + sum(u.extras[CONTROL_DELTA].astype(np.float64) for u in updates[2].values()) / 3
        np.testing.assert_allclose(ck.load().strategy_state["control"], c2, rtol=1e-5, atol=1e-8)
        ck.close()
        con = sqlite3.connect(run / "ledger.sqlite")
        fields = [json.loads(f) for (f,) in con.execute(
            "select fields from messages where side='agent' and kind='update' and event='sent'")]
        assert fields and all(f[f"extras.{CONTROL_DELTA}"] >= 4 * p_count for f in fields)
        con.close()
        assert metrics[-1]["num_clients"] == 3 and metrics[-1]["control_norm"] > 0

        # --- FedAdam: the global after round 1 is one Adam step from the initial model
        cfg = small_config(train={"algorithm": "fedadam"}, algorithm={"server_lr": 0.01, "tau": 0.001})
        res, spy = _run_with_spy(broker, tmp_path / "fedadam", cfg)
        updates, globals_ = spied(spy)
        r1 = list(updates[1].values())
        n = sum(u.num_samples for u in r1)
        for i, w0 in enumerate(globals_[1].tensors):
            d = sum(u.tensors[i].astype(np.float64) * u.num_samples / n for u in r1) - w0
            want = w0 + 0.01 * (0.1 * d) / (np.sqrt(0.01 * d * d) + 0.001)
            np.testing.assert_allclose(globals_[2].tensors[i], want, rtol=1e-5, atol=1e-6)
        assert res.rounds_completed == 2
