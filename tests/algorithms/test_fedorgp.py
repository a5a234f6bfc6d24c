"""FedORGP: the server loss by hand and against a loop, the server's training (prototypes pulled
to their class and pushed orthogonal to the others; state, checkpoint), the client's loss as
CE + λ_c · (1 − cos) worked out beside the training loop, and one federation of two
architectures in which only prototypes travel."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from broker_server.strategies import ClientResult, get_strategy
from broker_server.strategies.fedorgp import orgp_server_loss
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedorgp import FedORGPClient
from edge_agent.models import build_model


def test_server_loss_by_hand() -> None:
    """Centers P0 = (1, 0), P1 = (0, 1), P2 = (−1, 0); p = (1, 1) of class 0: cos (1/√2, 1/√2,
    −1/√2) → own 1/√2, others |1/√2|, |−1/√2| → mean 1/√2; p = (0, 2) of class 1: own 1, others
    0, 0. λ_s = 1, γ = 10: (1 − (1/√2 + 1)/2) + 10 · (1/√2 + 0)/2 = 0.146447 + 3.535534 = 3.681981."""
    centers = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    p = torch.tensor([[1.0, 1.0], [0.0, 2.0]])
    y = torch.tensor([0, 1])
    r = 1 / math.sqrt(2)
    want = (1 - (r + 1) / 2) + 10 * (r + 0) / 2
    assert float(orgp_server_loss(p, y, centers, 1.0, 10.0)) == pytest.approx(want, rel=1e-6)
    # λ_s scales only the first term, γ only the second
    assert float(orgp_server_loss(p, y, centers, 2.0, 0.0)) == pytest.approx(2 * (1 - (r + 1) / 2), rel=1e-6)
    # one class: no other class to push from, the first term alone
    one = orgp_server_loss(torch.tensor([[3.0, 4.0]]), torch.tensor([0]), torch.tensor([[1.0, 0.0]]), 1.0, 10.0)
    assert float(one) == pytest.approx(1 - 0.6, rel=1e-6)


def test_server_loss_against_a_loop() -> None:
    """Random batch: the vectorised loss equals a per-sample, per-class loop in float64."""
    rng = np.random.default_rng(3)
    p, centers = rng.standard_normal((7, 5)), rng.standard_normal((4, 5))
    y = rng.integers(0, 4, 7)

    def cos(a: np.ndarray, b: np.ndarray) -> float:
        return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))

    own = np.mean([cos(p[b], centers[y[b]]) for b in range(7)])
    inter = np.mean([np.mean([abs(cos(p[b], centers[c])) for c in range(4) if c != y[b]]) for b in range(7)])
    want = 0.5 * (1 - own) + 3.0 * inter
    got = orgp_server_loss(torch.from_numpy(p), torch.from_numpy(y), torch.from_numpy(centers), 0.5, 3.0)
    assert float(got) == pytest.approx(want, rel=1e-10)


def _upload(cid: str, protos, classes) -> ClientResult:
    p = np.asarray(protos, np.float32)
    return ClientResult(cid, (), 20, 0.5, {}, {"prototypes": p, "proto_classes": np.asarray(classes, np.int64),
                                               "proto_counts": np.full(len(classes), 5, np.int64)})


class _Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.classifier = torch.nn.Linear(4, 3)


def _cosines(glob: np.ndarray, ups: list[ClientResult]) -> tuple[float, float]:
    """(mean cos of each upload with its class's global prototype, mean |cos| with the others')."""
    g = glob / np.linalg.norm(glob, axis=1, keepdims=True)
    own, other = [], []
    for u in ups:
        for row, c in zip(u.extras["prototypes"], u.extras["proto_classes"], strict=True):
            cs = g @ (row / np.linalg.norm(row))
            own.append(cs[c])
            other += [abs(v) for k, v in enumerate(cs) if k != c]
    return float(np.mean(own)), float(np.mean(other))


def test_server_training_pulls_each_upload_to_its_class_and_orthogonal_to_the_others() -> None:
    """Two clients upload prototypes of classes 0 and 1 whose classes are orthogonal to each
    other (d = 4, C = 3 from a stand-in model), so the loss's optimum (own cosine 1, others 0)
    exists: against the untrained network (0 epochs), 300 epochs at γ = 1 raise the uploads'
    cosine with their own class's prototype above 0.9 and keep their |cosine| with the others'
    low; the state changes only on commit, survives a checkpoint, and the next round starts from
    it. (At the paper's γ = 10 this toy case settles with class 1's prototype at cosine 0.3 to its
    uploads, the |cos| term's kink outweighing the pull: measured, not asserted.)"""
    ups = [_upload("a", [[4, 0, 0, 0], [0, 4, 0, 0]], [0, 1]), _upload("b", [[3, 0, 1, 0], [0, 3, 0, 1]], [0, 1])]
    untrained = get_strategy("fedorgp", server_epochs=0, gamma=1.0)
    untrained.bind_model(_Head())
    s = get_strategy("fedorgp", server_epochs=300, server_lr=0.05, gamma=1.0)
    s.bind_model(_Head())
    for u in ups:
        assert s.validate(u) is None
    before = untrained.aggregate(1, [], ups)
    update = s.aggregate(1, [], ups)
    assert before is not None and update is not None and not s.generator_state  # nothing adopted yet
    own0, other0 = _cosines(before.extras["prototypes"], ups)
    own1, other1 = _cosines(update.extras["prototypes"], ups)
    assert own1 > own0 + 0.2 and own1 > 0.9
    assert other1 < 0.15
    s.commit(1, update)
    glob = s.global_extras()
    assert glob["proto_classes"].tolist() == [0, 1, 2] and glob["prototypes"].shape == (3, 4)
    m = s.committed_metrics
    assert m["prototype_classes"] == 3 and math.isfinite(m["orgp_server_loss"])
    assert m["global_prototype_cosine"] == pytest.approx(
        np.mean([F.cosine_similarity(torch.from_numpy(glob["prototypes"][i]),
                                     torch.from_numpy(glob["prototypes"][j]), dim=0).item()
                 for i in range(3) for j in range(i + 1, 3)]), abs=1e-6)
    t = get_strategy("fedorgp")
    t.load_state_dict(s.state_dict())
    assert all(np.array_equal(a, b) for a, b in zip(t.generator_state, s.generator_state, strict=True))
    fresh = get_strategy("fedorgp")
    fresh.bind_model(_Head())
    resumed, anew = t.aggregate(2, [], ups), fresh.aggregate(2, [], ups)
    assert not np.allclose(resumed.extras["prototypes"], anew.extras["prototypes"])


def test_round_config_and_bad_keys() -> None:
    """The clients get λ_c; the paper's best weights and FedORGP's 1 server epoch are the
    defaults; a bad value names its key."""
    s = get_strategy("fedorgp", participation_rate=1.0)
    plan = s.configure_round(1, ["a", "b"], np.random.default_rng(0))
    assert plan.config["lambda_client"] == 100.0 and sorted(plan.selected) == ["a", "b"]
    assert (s.lambda_server, s.gamma, s.server_epochs, s.server_batch) == (1.0, 10.0, 1, 32)
    for key, value in (("lambda_client", -1.0), ("gamma", float("nan")), ("server_epochs", 1.5),
                       ("server_batch", 0), ("server_lr", 0.0)):
        with pytest.raises(ValueError, match=key):
            get_strategy("fedorgp", **{key: value})


def test_client_loss_is_cross_entropy_plus_lambda_times_cosine_distance() -> None:
    """One batch, one SGD step (lr 0.1, no momentum): the FedORGP client's step equals a step on
    CE(h(z), y) + λ_c · mean(1 − cos(z, P_y)) taken by hand on a copy of the same model (the rows of
    class 4, which has no global prototype, left out of the second term); the head keeps its
    random initialisation (no orthogonal anchors); the uploads are the trained model's eval-mode
    class means."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((6, 1, 8, 8)).astype(np.float32))
    y = torch.tensor([0, 1, 1, 0, 4, 0])
    torch.manual_seed(0)
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10, feature_dim=16)
    twin = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10, feature_dim=16)
    twin.load_state_dict(model.state_dict())
    protos = rng.standard_normal((2, 16)).astype(np.float32)
    extras = {"prototypes": protos, "proto_classes": np.array([0, 1], np.int64)}
    lam = 7.0
    cfg = TrainConfig(local_epochs=1, batch_size=6, lr=0.1, momentum=0.0)
    head_before = model.classifier.weight.detach().clone()
    res = FedORGPClient().local_round(model, (), x, y, cfg, round=2, client_index=0, device=torch.device("cpu"),
                                      params={"lambda_client": lam}, global_extras=extras)
    # the same step by hand
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    twin.train()
    z = twin.features(x)
    keep = y != 4
    table = torch.zeros(10, 16)
    table[0], table[1] = torch.from_numpy(protos[0]), torch.from_numpy(protos[1])
    align = (1 - F.cosine_similarity(z[keep], table[y[keep]], dim=1)).mean()
    loss = F.cross_entropy(twin.classifier(z), y) + lam * align
    opt.zero_grad()
    loss.backward()
    opt.step()
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # no orthogonal init: the head moved by one step from its random rows, not to unit anchors
    assert torch.linalg.norm(model.classifier.weight - head_before) < 0.5 * torch.linalg.norm(head_before)
    assert "ocp_orth_error" not in res.metrics and "ocp_anchor_digest" not in res.metrics
    with torch.no_grad():
        feats = model.eval().features(x).numpy()
    assert res.extras["proto_classes"].tolist() == [0, 1, 4]
    for row, c in zip(res.extras["prototypes"], res.extras["proto_classes"], strict=True):
        np.testing.assert_allclose(row, feats[y.numpy() == c].mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fedorgp_federation_of_two_architectures_exchanges_prototypes_only(tmp_path) -> None:
    """Digits, 3 IID clients of two architectures (lightcnn, resnet8), 2 rounds × 2 epochs:
    updates carry no model tensor, the round-2 global carries C = 10 prototypes of width 64, and
    the devices' own heads beat chance (0.1) clearly."""
    from helpers.federation import assert_prototypes_only_on_the_wire, read_metrics, small_config

    from broker_server.simulate import simulate

    cfg = small_config(train={"algorithm": "fedorgp", "local_epochs": 2}, server={"client_eval": True},
                       model={"group": ["lightcnn", "resnet8"], "feature_dim": 64})
    res = simulate(cfg, run_dir=tmp_path / "run")
    assert res.rounds_completed == 2
    metrics = read_metrics(tmp_path / "run")
    assert all(m["share"] == "none" and m["prototype_classes"] == 10 for m in metrics)
    assert metrics[-1]["client_accuracy_mean"] > 0.3
    assert_prototypes_only_on_the_wire(tmp_path / "run")  # no parameter up; C = 10 prototypes of d = 64 down


@pytest.mark.parametrize("algorithm", ["fedorgp", "fedocp", "fedgh"])
@pytest.mark.parametrize("key", ["weighting", "lambda_proto"])
def test_fedprotos_own_keys_are_not_offered_where_the_method_sets_them(algorithm: str, key: str) -> None:
    """These methods set FedProto's uniform weighting (and λ_proto = 0) themselves: a user's value
    is an unknown [algorithm] key, named as such, not a 'multiple values' TypeError; FedTGP still
    takes its own λ_proto."""
    from broker_server.config import from_dict
    from broker_server.errors import ConfigError
    from broker_server.runtime import make_strategy
    from broker_server.strategies import get_strategy_class
    from edge_agent.data import load_dataset
    from edge_agent.plugins import accepted_keywords

    names, _ = accepted_keywords(get_strategy_class(algorithm))
    assert key not in names and "server_epochs" in names
    assert "lambda_proto" in accepted_keywords(get_strategy_class("fedtgp"))[0]
    cfg = from_dict({"run": {"name": "t", "rounds": 1}, "data": {"dataset": "digits", "clients": 2},
                     "train": {"algorithm": algorithm}, "algorithm": {key: "count" if key == "weighting" else 1.0}},
                    "<test>")
    with pytest.raises(ConfigError, match=f"unknown key {key}"):
        make_strategy(cfg, load_dataset("digits"))


def test_a_head_that_is_not_a_linear_layer_is_named_with_the_algorithm() -> None:
    """The error a device raises names FedORGP (not FedOCP, whose loop it shares) and what the
    head was, and a bad λ_c is named as the server's ``lambda_client``; a model without
    ``num_classes`` reads C from its ``classifier.weight``."""
    from edge_agent.errors import ModelError

    class Scaled(torch.nn.Module):  # a head with a weight entry [C, d] that is not a Linear
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(10, 16))

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return z @ self.weight.T

    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10, feature_dim=16)
    model.classifier = Scaled()
    x, y = torch.zeros(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    with pytest.raises(ModelError, match="fedorgp needs a model whose head is a torch.nn.Linear named 'classifier' "
                                         r"\(got Scaled\)"):
        FedORGPClient().local_round(model, (), x, y, TrainConfig(local_epochs=1, batch_size=4, lr=0.1), round=1,
                                    client_index=0, device=torch.device("cpu"))
    for bad in (-1.0, float("nan"), "x"):  # the client names the server's key, not FedOCP's
        with pytest.raises(ValueError, match="lambda_client"):
            FedORGPClient().local_round(build_model("lightcnn", in_channels=1, image_size=8, num_classes=10,
                                                    feature_dim=16), (), x, y,
                                        TrainConfig(local_epochs=1, batch_size=4, lr=0.1), round=1, client_index=0,
                                        device=torch.device("cpu"), params={"lambda_client": bad})
    plain = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10, feature_dim=16)
    del plain.num_classes
    res = FedORGPClient().local_round(plain, (), x, y, TrainConfig(local_epochs=1, batch_size=4, lr=0.1), round=1,
                                      client_index=0, device=torch.device("cpu"))
    assert res.extras["proto_classes"].tolist() == [0, 1, 2, 3]
