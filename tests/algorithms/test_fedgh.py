"""FedGH: one SGD step of the server's head by hand, the head's state and broadcast, and the
client overwriting its own head with it before training on cross-entropy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from broker_server.strategies import ClientResult, get_strategy
from broker_server.strategies.fedgh import train_head
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedgh import FedGHClient
from edge_agent.errors import ModelError
from edge_agent.models import make_model


def _upload(cid: str, protos, classes) -> ClientResult:
    return ClientResult(cid, (), 20, 0.5, {}, {"prototypes": np.asarray(protos, np.float32),
                                               "proto_classes": np.asarray(classes, np.int64),
                                               "proto_counts": np.full(len(classes), 5, np.int64)})


def test_one_head_step_by_hand() -> None:
    """W = 0, b = 0, p = (1, 0) of class 0, C = 2, lr 1: logits (0, 0), softmax (½, ½), so
    ∂L/∂W = (softmax − e₀) pᵀ = [[−½, 0], [½, 0]], ∂L/∂b = (−½, ½); after the step
    W = [[½, 0], [−½, 0]], b = (½, −½); the loss was log 2."""
    w, b, loss = train_head(np.zeros((2, 2)), np.zeros(2), np.array([[1.0, 0.0]]), np.array([0]), epochs=1, lr=1.0,
                            batch=1, seed=0)
    np.testing.assert_allclose(w, [[0.5, 0.0], [-0.5, 0.0]], atol=1e-7)
    np.testing.assert_allclose(b, [0.5, -0.5], atol=1e-7)
    assert loss == pytest.approx(np.log(2), rel=1e-6)


def test_server_broadcasts_the_trained_head_and_keeps_it_as_state() -> None:
    s = get_strategy("fedgh", server_epochs=1, server_lr=1.0, server_batch=10)
    s.bind_model(make_model("lightcnn", in_channels=1, image_size=8, num_classes=10, feature_dim=2))
    s.load_state_dict({"head_weight": np.zeros((10, 2)), "head_bias": np.zeros(10)})
    ups = [_upload("a", [[1.0, 0.0]], [0]), _upload("b", [[0.0, 2.0]], [3])]
    for u in ups:
        assert s.validate(u) is None
    update = s.aggregate(1, [], ups)
    assert update is not None and not update.tensors
    # one batch of both pairs: ∂L/∂W = ½ Σ_b (softmax − e_{c_b}) p_bᵀ with softmax = 1/10 everywhere
    expected = np.zeros((10, 2))
    for p, c in (([1.0, 0.0], 0), ([0.0, 2.0], 3)):
        g = np.full(10, 0.1)
        g[c] -= 1
        expected -= 0.5 * np.outer(g, p)
    np.testing.assert_allclose(update.extras["head_weight"], expected, atol=1e-6)
    s.commit(1, update)
    glob = s.global_extras()
    assert set(glob) == {"head_weight", "head_bias"} and glob["head_weight"].shape == (10, 2)
    t = get_strategy("fedgh")
    t.load_state_dict(s.state_dict())
    np.testing.assert_array_equal(t.global_extras()["head_weight"], glob["head_weight"])
    assert get_strategy("fedgh").global_extras() == {}  # nothing before the first round


def test_client_overwrites_its_head_then_trains_and_uploads_prototypes_only() -> None:
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((12, 1, 8, 8)).astype(np.float32))
    y = torch.tensor([0, 1, 1, 0, 4, 4, 4, 0, 1, 1, 0, 0])
    model = make_model("resnet8", in_channels=1, image_size=8, num_classes=10, seed=0)
    w, b = rng.standard_normal((10, 64)).astype(np.float32), rng.standard_normal(10).astype(np.float32)
    cfg = TrainConfig(local_epochs=1, batch_size=12, lr=0.0)  # lr 0: the head stays what was loaded
    res = FedGHClient().local_round(model, (), x, y, cfg, round=2, client_index=0, device=torch.device("cpu"),
                                    global_extras={"head_weight": w, "head_bias": b})
    np.testing.assert_array_equal(model.classifier.weight.detach().numpy(), w)
    np.testing.assert_array_equal(model.classifier.bias.detach().numpy(), b)
    assert res.tensors == () and set(res.extras) == {"prototypes", "proto_classes", "proto_counts"}
    assert res.extras["proto_counts"].tolist() == [5, 4, 3]
    with pytest.raises(ModelError, match="global head"):
        FedGHClient().local_round(model, (), x, y, cfg, round=2, client_index=0, device=torch.device("cpu"),
                                  global_extras={"head_weight": w[:, :3], "head_bias": b})
