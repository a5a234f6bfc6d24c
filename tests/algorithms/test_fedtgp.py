"""FedTGP: the adaptive margin and the margin-enhanced contrastive loss by hand, the server's
training (state, checkpoint, nothing changes before commit), the client's eval-mode prototypes,
and one federation in which only prototypes travel."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from broker_server.strategies import ClientResult, get_strategy
from broker_server.strategies.fedtgp import adaptive_margin, class_gaps, margin_contrastive_loss
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedtgp import FedTGPClient
from edge_agent.models import build_model


def test_gaps_and_margin_by_hand() -> None:
    """Means 0:(0,0), 1:(3,4), 2:(0,1): d01 = 5, d02 = 1, d12 = √18 = 4.242641; gaps (1, √18, 1);
    m = min(max gap, threshold)."""
    means = {0: np.array([0.0, 0.0]), 1: np.array([3.0, 4.0]), 2: np.array([0.0, 1.0])}
    g = class_gaps(means)
    assert g[0] == pytest.approx(1.0) and g[1] == pytest.approx(math.sqrt(18)) and g[2] == pytest.approx(1.0)
    assert adaptive_margin(means, 100.0) == pytest.approx(4.242641, abs=1e-6)
    assert adaptive_margin(means, 2.0) == 2.0
    assert adaptive_margin({3: np.zeros(2)}, 100.0) == 0.0


def test_margin_contrastive_loss_by_hand() -> None:
    """p = (0, 0), centers (1, 0) and (0, 2), class 0, m = 0.5: distances (1, 2) → (1.5, 2);
    CE(−d) = log(1 + e^{−0.5}) = 0.474077."""
    got = margin_contrastive_loss(torch.zeros(1, 2), torch.tensor([0]), torch.tensor([[1.0, 0.0], [0.0, 2.0]]), 0.5)
    assert float(got) == pytest.approx(math.log(1 + math.exp(-0.5)), rel=1e-6)
    assert round(math.log(1 + math.exp(-0.5)), 6) == 0.474077
    # a prototype on a center: distance 0, no NaN in the gradient
    c = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    margin_contrastive_loss(torch.tensor([[1.0, 0.0]]), torch.tensor([0]), c, 0.5).backward()
    assert torch.isfinite(c.grad).all()


def _upload(cid: str, protos, classes) -> ClientResult:
    p = np.asarray(protos, np.float32)
    return ClientResult(cid, (), 20, 0.5, {}, {"prototypes": p, "proto_classes": np.asarray(classes, np.int64),
                                               "proto_counts": np.full(len(classes), 5, np.int64)})


def test_server_trains_prototypes_that_fit_the_uploads() -> None:
    """Two clients upload well-separated prototypes of classes 0 and 1 (d = 4, C = 3 from a
    stand-in model): after the server's training every upload is nearest its own class's global
    prototype; the state changes only on commit and survives a checkpoint."""
    s = get_strategy("fedtgp", server_epochs=300, server_lr=0.05)

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.classifier = torch.nn.Linear(4, 3)

    s.bind_model(Head())
    ups = [_upload("a", [[4, 0, 0, 0], [0, 4, 0, 0]], [0, 1]), _upload("b", [[3, 1, 0, 0], [1, 3, 0, 0]], [0, 1])]
    for u in ups:
        assert s.validate(u) is None
    update = s.aggregate(1, [], ups)
    assert update is not None and not s.generator_state  # nothing adopted yet
    s.commit(1, update)
    glob = s.global_extras()
    assert glob["proto_classes"].tolist() == [0, 1, 2] and glob["prototypes"].shape == (3, 4)
    for u in ups:
        for row, c in zip(u.extras["prototypes"], u.extras["proto_classes"], strict=True):
            assert int(np.argmin(np.linalg.norm(glob["prototypes"] - row, axis=1))) == c
    m = s.committed_metrics
    # class means (3.5, 0.5, 0, 0) and (0.5, 3.5, 0, 0): gap = √18 for both, the margin
    assert m["tgp_margin"] == pytest.approx(math.sqrt(18), rel=1e-5) and m["prototype_classes"] == 3
    t = get_strategy("fedtgp")
    t.load_state_dict(s.state_dict())
    np.testing.assert_array_equal(t.global_extras()["prototypes"], glob["prototypes"])
    assert all(np.array_equal(a, b) for a, b in zip(t.generator_state, s.generator_state, strict=True))
    # the next round starts from the trained network, not from a fresh one
    nxt = t.aggregate(2, [], ups)
    fresh = get_strategy("fedtgp")
    fresh.bind_model(Head())
    again = fresh.aggregate(2, [], ups)
    assert not np.allclose(nxt.extras["prototypes"], again.extras["prototypes"])
    with pytest.raises(ValueError, match="server_batch"):
        get_strategy("fedtgp", server_batch=0)


def test_client_uploads_eval_mode_prototypes_of_the_trained_model() -> None:
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((12, 1, 8, 8)).astype(np.float32))
    y = torch.tensor([0, 1, 1, 0, 4, 4, 4, 0, 1, 1, 0, 0])
    torch.manual_seed(0)
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    res = FedTGPClient().local_round(model, (), x, y, TrainConfig(local_epochs=1, batch_size=5, lr=0.05), round=1,
                                     client_index=0, device=torch.device("cpu"), params={"lambda_proto": 10.0})
    e = res.extras
    assert e["proto_classes"].tolist() == [0, 1, 4] and e["proto_counts"].tolist() == [5, 4, 3]
    with torch.no_grad():
        feats = model.eval().features(x).numpy()
    for row, c in zip(e["prototypes"], e["proto_classes"], strict=True):
        np.testing.assert_allclose(row, feats[y.numpy() == c].mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fedtgp_federation_exchanges_trained_prototypes_only(tmp_path) -> None:
    """Digits, 3 IID clients, 2 rounds × 2 epochs: updates carry no model tensor, the round-2
    global carries C = 10 trained prototypes of width 64; the devices' nearest-prototype accuracy
    beats chance (0.1) clearly (0.62 measured after round 2, 0.82 after round 1 on their own
    prototypes; the trainable prototypes need more rounds, see the module docstring)."""
    from helpers.federation import assert_prototypes_only_on_the_wire, read_metrics, small_config

    from broker_server.simulate import simulate

    res = simulate(small_config(train={"algorithm": "fedtgp", "local_epochs": 2}, server={"client_eval": True}),
                   run_dir=tmp_path / "run")
    assert res.rounds_completed == 2
    metrics = read_metrics(tmp_path / "run")
    assert all(m["share"] == "none" and m["prototype_classes"] == 10 for m in metrics)
    assert metrics[-1]["client_accuracy_mean"] > 0.3
    assert_prototypes_only_on_the_wire(tmp_path / "run")  # no parameter up; C = 10 prototypes of d = 64 down
