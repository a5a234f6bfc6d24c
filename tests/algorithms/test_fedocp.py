"""FedOCP: the orthogonal initialisation (exact when C ≤ d, the known spherical optima when C > d,
never worse than its random start), the orthogonality loss and both contrastive losses by hand
and in numpy, the client's head and loss, the server's refinement, its ablations and state."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from broker_server.strategies import ClientResult, get_strategy
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedocp import (
    FedOCPClient,
    anchor_digest,
    cosine_alignment,
    max_pairwise_cosine,
    orthogonal_anchors,
    orthogonality_loss,
    prototype_infonce,
)
from edge_agent.models import make_model

# ----------------------------------------------------------------------------- orthogonal init


def _random_rows(c: int, d: int, seed: int) -> np.ndarray:
    """The start the docstring names: default_rng(seed) standard normal C×d, rows normalised."""
    s = np.random.default_rng(seed).standard_normal((c, d))
    return s / np.linalg.norm(s, axis=1, keepdims=True)


@pytest.mark.parametrize(("c", "d"), [(10, 64), (10, 10), (7, 512)])
def test_anchors_are_orthonormal_when_the_classes_fit(c: int, d: int) -> None:
    w = orthogonal_anchors(c, d, seed=3)
    assert w.shape == (c, d) and w.dtype == np.float32
    np.testing.assert_allclose(w.astype(np.float64) @ w.T, np.eye(c), atol=1e-6)
    # the minimum pairwise angle is 90°; random unit rows in the same space come closer
    assert math.degrees(math.acos(max_pairwise_cosine(w))) == pytest.approx(90.0, abs=1e-4)
    assert max_pairwise_cosine(_random_rows(c, d, 3)) > 0.05
    np.testing.assert_array_equal(w, orthogonal_anchors(c, d, seed=3))  # one seed, one matrix
    assert anchor_digest(w) == anchor_digest(orthogonal_anchors(c, d, seed=3))
    assert anchor_digest(w) != anchor_digest(orthogonal_anchors(c, d, seed=4))


@pytest.mark.parametrize(("c", "d", "optimum"), [
    (3, 2, -0.5),                          # three points on the circle: 120° apart
    (5, 2, math.cos(2 * math.pi / 5)),     # a regular pentagon: 72°
    (4, 3, -1 / 3),                        # the regular tetrahedron
    (6, 3, 0.0),                           # the octahedron ±e_i
    (12, 3, 1 / math.sqrt(5)),             # the icosahedron (Tammes problem, N = 12)
])
def test_anchors_reach_the_known_optimum_when_the_classes_outnumber_the_width(c: int, d: int,
                                                                              optimum: float) -> None:
    """d < C: exact orthogonality is impossible; the init guarantees unit rows, a largest pairwise
    cosine no worse than its random start and never below the simplex bound −1/(C−1), and here,
    where the optimum is known, reaches it."""
    w = orthogonal_anchors(c, d, seed=0)
    np.testing.assert_allclose(np.linalg.norm(w.astype(np.float64), axis=1), 1.0, atol=1e-6)
    got = max_pairwise_cosine(w)
    assert got >= -1 / (c - 1) - 1e-6
    assert got <= max_pairwise_cosine(_random_rows(c, d, 0))
    assert got == pytest.approx(optimum, abs=0.01)


def test_anchors_for_many_classes_in_a_narrow_width_beat_random_rows() -> None:
    w = orthogonal_anchors(100, 64, seed=0)
    start = max_pairwise_cosine(_random_rows(100, 64, 0))
    got = max_pairwise_cosine(w)
    assert got < start / 5  # measured 0.040 against the random start's 0.45
    assert got >= -1 / 99
    with pytest.raises(ValueError, match="num_classes"):
        orthogonal_anchors(0, 4, seed=0)


# ----------------------------------------------------------------------------- losses


def test_orthogonality_loss_by_hand() -> None:
    """W rows (1, 0), (1, 1), (0, 5): Ŵ = (1, 0), (1, 1)/√2, (0, 1); ŴŴᵀ − I has off-diagonal
    1/√2, 0, 1/√2 (each twice): squared sum 4 · ½ = 2, the norm √2."""
    w = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 5.0]], dtype=torch.float64, requires_grad=True)
    loss = orthogonality_loss(w)
    assert float(loss.detach()) == pytest.approx(math.sqrt(2), rel=1e-12)
    assert float(orthogonality_loss(w.detach(), squared=True)) == pytest.approx(2.0, rel=1e-12)
    # orthogonal rows of any length: 0, and the gradient there is 0, not NaN
    z = torch.tensor([[2.0, 0.0], [0.0, 3.0]], requires_grad=True)
    out = orthogonality_loss(z)
    out.backward()
    assert float(out.detach()) == 0.0 and torch.equal(z.grad, torch.zeros(2, 2))
    assert torch.autograd.gradcheck(lambda t: orthogonality_loss(t), (w,))


def _infonce_numpy(z: np.ndarray, y: np.ndarray, table: np.ndarray, mask: np.ndarray, tau: float) -> float:
    keep = mask[y]
    zn = z[keep] / np.linalg.norm(z[keep], axis=1, keepdims=True)
    pn = table / np.maximum(np.linalg.norm(table, axis=1, keepdims=True), 1e-300)  # masked rows may be 0
    logits = zn @ pn.T / tau
    logits[:, ~mask] = -np.inf
    m = logits.max(axis=1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(zn)), y[keep]].mean())


def test_contrastive_loss_by_hand_and_against_numpy() -> None:
    """z = (1, 0) of class 0, prototypes (1, 0), (0, 1), (−1, 0), τ = 0.5: cosines (1, 0, −1) →
    logits (2, 0, −2); loss −log(e²/(e² + 1 + e⁻²)) = 0.14293; class 2 masked out:
    −log(e²/(e² + 1)) = 0.12693."""
    table = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    z, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    full = torch.ones(3, dtype=torch.bool)
    assert float(prototype_infonce(z, y, table, full, 0.5)) == pytest.approx(
        -math.log(math.e ** 2 / (math.e ** 2 + 1 + math.e ** -2)), rel=1e-6)
    assert round(-math.log(math.e ** 2 / (math.e ** 2 + 1 + math.e ** -2)), 5) == 0.14293
    two = torch.tensor([True, True, False])
    assert float(prototype_infonce(z, y, table, two, 0.5)) == pytest.approx(0.12693, abs=1e-5)
    # a random batch with one label lacking a prototype (its rows are left out): numpy agrees
    rng = np.random.default_rng(1)
    zb, tb = rng.standard_normal((9, 5)), rng.standard_normal((4, 5))
    yb = np.array([0, 1, 2, 3, 0, 1, 3, 3, 2])
    mb = np.array([True, True, False, True])
    got = prototype_infonce(torch.from_numpy(zb), torch.from_numpy(yb), torch.from_numpy(tb), torch.from_numpy(mb),
                            0.1)
    assert float(got) == pytest.approx(_infonce_numpy(zb, yb, tb, mb, 0.1), rel=1e-5)
    # its gradient in z and in the prototypes (the server trains the latter) against finite differences
    zt, tt = torch.from_numpy(zb).requires_grad_(True), torch.from_numpy(tb).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: prototype_infonce(a, torch.from_numpy(yb), b, torch.from_numpy(mb),
                                                                   0.1), (zt, tt))
    with pytest.raises(ValueError, match="tau"):
        prototype_infonce(z, y, table, full, 0.0)


def test_cosine_alignment_by_hand() -> None:
    """z = (3, 4) → P_0 = (1, 0): cos 0.6; z = (0, 2) → P_1 = (0, 5): cos 1; class 2 has no
    prototype: its row is left out. mean(1 − cos) = (0.4 + 0)/2 = 0.2."""
    table = torch.tensor([[1.0, 0.0], [0.0, 5.0], [0.0, 0.0]])
    mask = torch.tensor([True, True, False])
    z = torch.tensor([[3.0, 4.0], [0.0, 2.0], [1.0, 1.0]])
    assert float(cosine_alignment(z, torch.tensor([0, 1, 2]), table, mask)) == pytest.approx(0.2, rel=1e-6)
    assert float(cosine_alignment(z[2:], torch.tensor([2]), table, mask)) == 0.0


# ----------------------------------------------------------------------------- client


def _shard(n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((n, 1, 8, 8)).astype(np.float32))
    y = torch.from_numpy(np.array([0, 1, 4] * (n // 3), dtype=np.int64))
    return x, y


def test_every_architecture_gets_the_same_orthogonal_head_and_uploads_eval_prototypes() -> None:
    x, y = _shard()
    params = {"anchor_seed": 5, "lambda_orth": 1.0}
    expected = orthogonal_anchors(10, 64, seed=5)
    heads, digests = [], []
    for arch in ("lightcnn", "resnet8"):
        model = make_model(arch, in_channels=1, image_size=8, num_classes=10, seed=0)
        client = FedOCPClient()
        client.init_head(model, params)
        np.testing.assert_array_equal(model.classifier.weight.detach().numpy(), expected)
        assert torch.equal(model.classifier.bias.detach(), torch.zeros(10))
        res = client.local_round(model, (), x, y, TrainConfig(local_epochs=1, batch_size=8, lr=0.05), round=1,
                                 client_index=0, device=torch.device("cpu"), params=params)
        heads.append(model.classifier.weight.detach().numpy().copy())
        digests.append(res.metrics["ocp_anchor_digest"])
        e = res.extras
        assert e["proto_classes"].tolist() == [0, 1, 4] and e["proto_counts"].tolist() == [8, 8, 8]
        with torch.no_grad():
            feats = model.eval().features(x).numpy()
        for row, c in zip(e["prototypes"], e["proto_classes"], strict=True):
            np.testing.assert_allclose(row, feats[y.numpy() == c].mean(0), rtol=1e-5, atol=1e-6)
        assert res.tensors == () and res.metrics["ocp_orth_error"] == pytest.approx(
            float(orthogonality_loss(model.classifier.weight.detach())), rel=1e-6)
    assert digests[0] == digests[1] == anchor_digest(expected)
    server = get_strategy("fedocp", anchor_seed=5)
    server.bind_model(make_model("lightcnn", in_channels=1, image_size=8, num_classes=10))
    assert server.anchor_digest() == digests[0]
    # without the orthogonal init the model keeps its random head
    model = make_model("lightcnn", in_channels=1, image_size=8, num_classes=10, seed=0)
    before = model.classifier.weight.detach().clone()
    FedOCPClient().init_head(model, {"orth_init": False})
    assert torch.equal(model.classifier.weight.detach(), before)


def test_client_term_is_the_weighted_sum_of_the_three_losses() -> None:
    """feature_loss's term on a fixed batch = λ_a·align + λ_o·‖ŴŴᵀ − I‖ + λ_c·InfoNCE, each
    computed independently in numpy."""
    rng = np.random.default_rng(2)
    protos = rng.standard_normal((3, 4)).astype(np.float32)
    classes = np.array([0, 2, 3])
    z = torch.from_numpy(rng.standard_normal((6, 4)).astype(np.float32))
    y = torch.tensor([0, 1, 2, 3, 0, 3])  # class 1 has no global prototype
    w = rng.standard_normal((4, 4))
    client = FedOCPClient()
    client._weight = torch.from_numpy(w.astype(np.float32))
    params = {"lambda_align": 0.5, "lambda_orth": 2.0, "lambda_con": 3.0, "tau_client": 0.2}
    term = client.feature_loss({"prototypes": protos, "proto_classes": classes}, params, 4, torch.device("cpu"))
    table = np.zeros((4, 4))
    table[classes] = protos
    mask = np.isin(np.arange(4), classes)
    keep = mask[y.numpy()]
    zk, tk = z.numpy()[keep].astype(np.float64), table[y.numpy()[keep]]
    align = np.mean(1 - (zk * tk).sum(1) / np.linalg.norm(zk, axis=1) / np.linalg.norm(tk, axis=1))
    wn = w / np.linalg.norm(w, axis=1, keepdims=True)
    orth = np.linalg.norm(wn @ wn.T - np.eye(4))
    con = _infonce_numpy(z.numpy().astype(np.float64), y.numpy(), table, mask, 0.2)
    assert float(term(z, y)) == pytest.approx(0.5 * align + 2.0 * orth + 3.0 * con, rel=1e-5)
    # round 1 (no global prototypes): the orthogonality term alone; every weight 0: no term
    assert float(client.feature_loss({}, params, 4, torch.device("cpu"))(z, y)) == pytest.approx(2 * orth, rel=1e-5)
    assert client.feature_loss({}, {"lambda_orth": 0.0}, 4, torch.device("cpu")) is None


# ----------------------------------------------------------------------------- server


def _upload(cid: str, protos, classes, digest: str | None = None) -> ClientResult:
    p = np.asarray(protos, np.float32)
    return ClientResult(cid, (), 20, 0.5, {} if digest is None else {"ocp_anchor_digest": digest},
                        {"prototypes": p, "proto_classes": np.asarray(classes, np.int64),
                         "proto_counts": np.full(len(classes), 5, np.int64)})


class _Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.classifier = torch.nn.Linear(4, 3)


UPLOADS = [_upload("a", [[4, 0, 0, 0], [0, 4, 0, 0]], [0, 1]), _upload("b", [[3, 1, 0, 0], [1, 3, 0, 1]], [0, 1]),
           _upload("c", [[0, 0, 2, 0]], [2])]


def test_server_refines_prototypes_that_separate_the_uploads() -> None:
    s = get_strategy("fedocp", server_epochs=200, server_lr=0.1, server_batch=2)
    s.bind_model(_Head())
    for u in UPLOADS:
        assert s.validate(u) is None
    update = s.aggregate(1, [], UPLOADS)
    assert update is not None and not s.generator_state and not s.global_extras()  # nothing adopted yet
    s.commit(1, update)
    glob = s.global_extras()
    assert glob["proto_classes"].tolist() == [0, 1, 2] and glob["prototypes"].shape == (3, 4)
    g = glob["prototypes"] / np.linalg.norm(glob["prototypes"], axis=1, keepdims=True)
    for u in UPLOADS:  # each upload's most similar global prototype (cosine) is its own class's
        for row, c in zip(u.extras["prototypes"], u.extras["proto_classes"], strict=True):
            assert int(np.argmax(g @ (row / np.linalg.norm(row)))) == c
    m = s.committed_metrics
    assert m["ocp_server_loss"] < math.log(3)  # below chance level of a 3-way InfoNCE
    iu = np.triu_indices(3, 1)
    assert m["global_prototype_cosine"] == pytest.approx(float((g @ g.T)[iu].mean()), rel=1e-5)
    t = get_strategy("fedocp")
    t.load_state_dict(s.state_dict())
    np.testing.assert_array_equal(t.global_extras()["prototypes"], glob["prototypes"])
    assert all(np.array_equal(a, b) for a, b in zip(t.generator_state, s.generator_state, strict=True))


def test_without_the_server_contrastive_loss_the_global_prototypes_are_class_means() -> None:
    s = get_strategy("fedocp", server_contrastive=False)
    s.bind_model(_Head())
    update = s.aggregate(1, [], UPLOADS)
    assert update is not None
    assert update.extras["proto_classes"].tolist() == [0, 1, 2]
    np.testing.assert_allclose(update.extras["prototypes"],
                               [[3.5, 0.5, 0, 0], [0.5, 3.5, 0, 0.5], [0, 0, 2, 0]], rtol=1e-6)


def test_round_config_carries_the_client_keys_and_the_ablation_switches() -> None:
    rng = np.random.default_rng(0)
    plan = get_strategy("fedocp", lambda_align=0.3, anchor_seed=9).configure_round(1, ["a", "b"], rng)
    assert {k: plan.config[k] for k in ("lambda_align", "lambda_orth", "lambda_con", "tau_client", "orth_init",
                                        "anchor_seed", "anchor_steps")} == {
        "lambda_align": 0.3, "lambda_orth": 1.0, "lambda_con": 1.0, "tau_client": 0.1, "orth_init": True,
        "anchor_seed": 9, "anchor_steps": 2000}
    off = get_strategy("fedocp", client_orthogonality=False, client_contrastive=False, orth_init=False)
    cfg = off.configure_round(1, ["a"], rng).config
    assert cfg["lambda_orth"] == 0.0 and cfg["lambda_con"] == 0.0 and cfg["orth_init"] is False
    assert "lambda_proto" not in cfg
    with pytest.raises(ValueError, match="server_contrastive"):
        get_strategy("fedocp", server_contrastive="yes")
    with pytest.raises(ValueError, match="tau_server"):
        get_strategy("fedocp", tau_server=0.0)


def test_an_update_with_other_anchors_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    s = get_strategy("fedocp", server_epochs=1)
    s.bind_model(_Head())
    good = anchor_digest(orthogonal_anchors(3, 4, 0))
    ups = [_upload("a", [[1, 0, 0, 0]], [0], good), _upload("b", [[0, 1, 0, 0]], [1], "0123456789abcdef")]
    with caplog.at_level("WARNING"):
        update = s.aggregate(1, [], ups)
    assert update is not None and update.metrics["ocp_anchor_mismatches"] == 1
    assert "b holds orthogonal anchors with digest 0123456789abcdef" in caplog.text
