"""The prototype and control-variate strategies refuse malformed but well-formed updates with a
reason (``validate``), and shapes are decided by the bound model, never by the first update.

Strategies: FPL, FedProto (+ fedproto-avg), FedPAD, SCAFFOLD, FedMCP. Expected shapes are worked
out by hand from the digits LightCNN (1×8×8, classifier [10, 64])."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from broker_server.strategies import ClientResult, accumulator_for, apply_update, get_strategy
from broker_server.strategies.fedmcp import FedMCP
from broker_server.strategies.fedpad import FedPAD
from broker_server.strategies.fedproto import FedProto, FedProtoAvg
from broker_server.strategies.fpl import FPL
from broker_server.strategies.scaffold import Scaffold
from edge_agent.models import build_model


def _result(cid: str, tensors=(), n: int = 10, **extras) -> ClientResult:
    return ClientResult(cid, tuple(tensors), n, 0.5, {}, extras=extras)


def _lightcnn():
    """The server's model of the digits tests: LightCNN 1×8×8, classifier [10, 64]."""
    return build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)


def _protos(k: int, d: int, classes=None, counts=None) -> dict:
    return {"prototypes": np.ones((k, d), np.float32),
            "proto_classes": np.arange(k, dtype=np.int64) if classes is None else np.asarray(classes, np.int64),
            "proto_counts": np.ones(k, np.int64) if counts is None else np.asarray(counts, np.int64)}


def test_fpl_refuses_class_ids_outside_the_model() -> None:
    """FPL refuses prototypes of class ids outside [0, C) (C = 10, the classifier's output width):
    id 10 and id 10**12 are refused, ids 0 and 9 accepted."""
    head = [np.zeros((64, 1, 3, 3), np.float32), np.zeros((10, 64), np.float32), np.zeros(10, np.float32)]
    s = FPL()
    assert s.validate(_result("a", head, **_protos(2, 64, [0, 10]))) is not None
    assert s.validate(_result("a", head, **_protos(2, 64, [0, 10**12]))) is not None
    assert s.validate(_result("a", head, **_protos(2, 64, [0, 9]))) is None


def test_fedproto_round1_width_is_not_decided_by_the_first_reporter() -> None:
    """Round 1, FedProto bound to the digits LightCNN (d = 64): a 3-d upload arriving first is
    refused, the honest 64-d one aggregated, and the global prototypes are 64-d."""
    s = FedProto()
    s.bind_model(_lightcnn())
    acc = accumulator_for(s, 1, [])
    evil, good = _result("evil", **_protos(2, 3)), _result("good", **_protos(2, 64))
    for r in (evil, good):
        if s.validate(r) is None:
            try:
                acc.add(r)
            except ValueError:
                pass
    apply_update(s, 1, acc.result())
    assert s.prototypes.shape[1] == 64


def test_fedproto_avg_does_not_aggregate_the_model_of_a_refused_update() -> None:
    """fedproto-avg: an update whose prototypes cannot be aggregated (width clash) is refused
    whole: its model (all 100s) is not in the round's average, which stays the first update's."""
    s = FedProtoAvg()
    acc = accumulator_for(s, 1, [np.zeros((2, 2), np.float32)])
    acc.add(_result("a", [np.ones((2, 2), np.float32)], **_protos(2, 3)))
    with pytest.raises(ValueError):
        acc.add(_result("b", [np.full((2, 2), 100.0, np.float32)], **_protos(2, 64)))
    np.testing.assert_array_equal(apply_update(s, 1, acc.result())[0], np.ones((2, 2), np.float32))


def test_fedpad_proto_counts_that_overflow_int64_are_refused() -> None:
    """FedPAD refuses Σ proto_counts > num_samples computed without int64 wrap-around: four counts
    of 2**62 (which wrap to 0 in int64) are refused with a reason naming num_samples."""
    head = [np.zeros((10, 64), np.float32), np.zeros(10, np.float32)]
    reason = FedPAD().validate(_result("a", head, n=10, **_protos(4, 64, counts=[2**62] * 4)))
    assert reason is not None and "num_samples" in reason


def test_fedproto_count_weighting_is_not_owned_by_one_client_claiming_huge_counts() -> None:
    """weighting = "count" (the paper's |D_i,c|): counts are bounded by what the update stands for
    (num_samples × local_epochs), so a client claiming 10**15 samples of each class with
    num_samples = 10 is refused and cannot own the global prototypes."""
    s = FedProto(weighting="count", train_config={"local_epochs": 1})
    evil = _result("evil", n=10, **{**_protos(2, 4, counts=[10**15, 10**15]),
                                    "prototypes": np.full((2, 4), 100.0, np.float32)})
    assert s.validate(evil) is not None


def test_scaffold_first_reporter_does_not_decide_the_control_variate_size() -> None:
    """Round 1 (c not yet set): the size of c is the bound model's parameter count P (Linear(4, 1):
    4 weights + 1 bias = 5), so a control_delta of length 3 arriving first is refused and c
    is 5 long."""
    s = Scaffold()
    s.bind_model(torch.nn.Linear(4, 1))  # P = 4 weights + 1 bias = 5
    model = [np.zeros(5, np.float32)]
    acc = accumulator_for(s, 1, model)
    evil = _result("evil", [np.ones(5, np.float32)], control_delta=np.ones(3, np.float32))
    good = _result("good", [np.ones(5, np.float32)], control_delta=np.ones(5, np.float32))
    for r in (evil, good):
        if s.validate(r) is None:
            try:
                acc.add(r)
            except ValueError:
                pass
    apply_update(s, 1, acc.result())
    assert s.control is not None and s.control.shape == (5,)


def test_fedmcp_first_reporter_does_not_decide_the_teacher_prototype_width() -> None:
    """Round 1 (no teacher yet): the teacher's prototype width comes from the bound model (d = 64),
    so [C, 3] prototypes arriving first are refused and the teacher is [C, 64]."""
    P, C = 50, 10
    s = FedMCP(proxy_y=np.arange(P, dtype=np.int64) % C, num_classes=C, proxy_size=P)
    s.bind_model(_lightcnn())
    soft = np.full((P, C), 0.1, np.float32)
    acc = accumulator_for(s, 1, [])
    for cid, d in (("evil", 3), ("good", 64)):
        r = _result(cid, soft_predictions=soft, prototypes=np.ones((C, d), np.float32))
        if s.validate(r) is None:
            try:
                acc.add(r)
            except ValueError:
                pass
    apply_update(s, 1, acc.result())
    assert s.teacher_protos.shape == (C, 64)


@pytest.mark.parametrize("name", ["fedpad", "fedproto", "fpl"])
def test_prototype_updates_with_unknown_extras_are_refused(name: str) -> None:
    """FedPAD, FedProto and FPL refuse an update carrying extras they do not use (they buffer
    whole updates until the round ends), with a reason naming the first unknown name."""
    head = [np.zeros((10, 64), np.float32), np.zeros(10, np.float32)]
    junk = {f"junk{i}": np.zeros(4, np.float32) for i in range(3)}
    r = _result("a", head if name != "fedproto" else (), **_protos(2, 64), **junk)
    reason = get_strategy(name).validate(r)
    assert reason is not None and "junk0" in reason
