"""The strategies' ``bind_model`` hook: the server hands its model over before round 1, so the
shapes of shared non-model arrays come from the model, never from the first update.

Hand-checked figures: the digits LightCNN (1×8×8 input, 10 classes, 64-d features) has
conv1 1·16·9 + 16 = 160, conv2 16·32·9 + 32 = 4,640, fc 32·(8/4)²·64 + 64 = 8,256 and
classifier 64·10 + 10 = 650 parameters, P = 13,706; its classifier weight is [10, 64].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.memory_server import memory_server

from broker_server.strategies import ClientResult, get_strategy
from broker_server.strategies._base import classifier_shape, parameter_count
from broker_server.strategies.fedmcp import FedMCP
from broker_server.strategies.fedproto import FedProto, FedProtoAvg
from broker_server.strategies.scaffold import Scaffold
from edge_agent.models import build_model


def _digits_cnn() -> torch.nn.Module:
    return build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)


def _protos(n: int, classes, counts, d: int = 64) -> ClientResult:
    k = len(classes)
    return ClientResult("c", (), n, 0.5, {}, extras={
        "prototypes": np.ones((k, d), np.float32), "proto_classes": np.asarray(classes, np.int64),
        "proto_counts": np.asarray(counts, np.int64)})


# ------------------------------------------------------------------------------------ the helpers


def test_classifier_shape_and_parameter_count_of_the_digits_cnn() -> None:
    m = _digits_cnn()
    assert classifier_shape(m) == (10, 64)
    assert parameter_count(m) == 160 + 4_640 + 8_256 + 650 == 13_706
    assert parameter_count(torch.nn.Linear(4, 1)) == 5
    assert classifier_shape(torch.nn.Linear(4, 1)) is None  # no classifier.weight entry


# ------------------------------------------------------------------------------------- the server


def test_the_server_binds_its_own_model_once(tmp_path: Path) -> None:
    class Spy(FedProto):
        def bind_model(self, model):
            calls.append(model)
            super().bind_model(model)

    calls: list = []
    model = build_model("lightcnn", num_classes=10)  # 1×28×28: classifier [10, 64] too
    strategy = Spy()
    srv = memory_server(tmp_path, model=model, clients=["a"], strategy=strategy)
    assert calls == [model] and srv.model is model
    assert strategy.head == (10, 64)
    # a strategy without the hook is left alone
    memory_server(tmp_path / "avg", model=model, clients=["a"], strategy=get_strategy("fedavg", min_clients=1))


# --------------------------------------------------------------------------------------- FedProto


def test_fedproto_bound_checks_width_and_class_ids_from_round_1() -> None:
    s = FedProto()
    s.bind_model(_digits_cnn())
    assert s.head == (10, 64)
    assert s.validate(_protos(10, [0, 9], [5, 5])) is None
    assert "width 3" in s.validate(_protos(10, [0, 9], [5, 5], d=3))
    assert "out of range [0, 10)" in s.validate(_protos(10, [0, 10], [5, 5]))
    assert "out of range [0, 10)" in s.validate(_protos(10, [10**12], [5]))


def test_fedproto_avg_inherits_the_binding() -> None:
    s = FedProtoAvg()
    s.bind_model(build_model("lightcnn", num_classes=7, feature_dim=16))
    assert s.head == (7, 16)
    assert s.validate(_protos(10, [6], [1], d=16)) is None
    assert s.validate(_protos(10, [7], [1], d=16)) is not None


def test_fedproto_unbound_keeps_its_behaviour() -> None:
    s = FedProto()
    assert s.validate(_protos(10, [0, 10], [5, 5], d=3)) is None  # any width, any id >= 0
    assert s.validate(_protos(10, [-1], [5])) is not None


@pytest.mark.parametrize("epochs,counts,ok", [
    (2, [12, 8], True),            # Σ = 20 = num_samples 10 × 2 epochs: exactly what the client counts
    (2, [12, 9], False),           # 21 > 20
    (1, [10], True),
    (1, [6, 5], False),            # 11 > 10 × 1
    (0, [10], True),               # E = 0 still trains one epoch (sgd_epochs: max(1, E))
    (0, [11], False),
    (1, [2**62] * 4, False),       # int64 Σ wraps to 0: summed as Python ints
    (None, [10**6, 10**6], True),  # no local_epochs sent: no bound (the device's default applies)
])
def test_fedproto_counts_are_bounded_by_num_samples_times_epochs(epochs, counts, ok) -> None:
    s = FedProto(weighting="count", train_config={} if epochs is None else {"local_epochs": epochs})
    reason = s.validate(_protos(10, list(range(len(counts))), counts))
    assert (reason is None) is ok, reason
    if not ok:
        assert "num_samples × local_epochs" in reason


# --------------------------------------------------------------------------------------- SCAFFOLD


def _dc(n: int) -> ClientResult:
    return ClientResult("c", (), 10, 0.5, {}, extras={"control_delta": np.zeros(n, np.float32)})


def test_scaffold_bound_takes_p_from_the_model() -> None:
    s = Scaffold()
    s.bind_model(_digits_cnn())
    assert s.num_params == 13_706
    assert s.validate(_dc(13_706)) is None
    assert "13705 entries, the control variate 13706" in s.validate(_dc(13_705))


def test_scaffold_unbound_keeps_its_behaviour() -> None:
    s = Scaffold()
    assert s.validate(_dc(3)) is None and s.validate(_dc(5)) is None  # round 1: any size
    s.load_state_dict({"control": np.zeros(5, np.float32)})
    assert s.validate(_dc(3)) is not None and s.validate(_dc(5)) is None


# ----------------------------------------------------------------------------------------- FedMCP


def _fedmcp(C: int = 10) -> FedMCP:
    P = 20
    return FedMCP(proxy_y=np.arange(P, dtype=np.int64) % C, num_classes=C, proxy_size=P)


def _upload(C: int, d: int) -> ClientResult:
    return ClientResult("c", (), 10, 0.5, {}, extras={"soft_predictions": np.full((20, C), 1 / C, np.float32),
                                                     "prototypes": np.ones((C, d), np.float32)})


def test_fedmcp_bound_takes_d_from_the_classifier() -> None:
    s = _fedmcp()
    s.bind_model(_digits_cnn())
    assert s.feature_dim == 64
    assert s.validate(_upload(10, 64)) is None
    assert "expected [10, 64]" in s.validate(_upload(10, 3))


def test_fedmcp_refuses_a_model_of_another_class_count() -> None:
    with pytest.raises(ValueError, match="7 classes, the data set 10"):
        _fedmcp().bind_model(build_model("lightcnn", num_classes=7))


def test_fedmcp_unbound_keeps_its_behaviour() -> None:
    s = _fedmcp()
    assert s.validate(_upload(10, 3)) is None and s.validate(_upload(10, 64)) is None
