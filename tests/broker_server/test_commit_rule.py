"""The driver commits a round's GlobalUpdate only when every part is finite and encodable with
the round's codecs, for strategies with extras too (FedPAD's prototypes stay as they were)."""

from __future__ import annotations

import numpy as np

from broker_server.server import AggregationServer, ServerSettings
from broker_server.strategies import GlobalUpdate, apply_update, update_problem
from broker_server.strategies.fedpad import FedPAD
from edge_agent.data import ArraySplit
from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol.channel import Channel
from protocol.tensors import Codec

PROTOS = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
CLASSES = np.array([0, 1], np.int64)


def _fedpad_with_prototypes() -> FedPAD:
    s = FedPAD()
    s.load_state_dict({"prototypes": PROTOS, "proto_classes": CLASSES, "prev_clients": [], "prev_alpha": np.zeros(0)})
    return s


def _update(protos: np.ndarray, tensors=None) -> GlobalUpdate:
    return GlobalUpdate(tensors=tensors, extras={"prototypes": protos, "proto_classes": CLASSES},
                        state={"prototypes": protos, "proto_classes": CLASSES}, metrics={"fedpad_round": 1})


def test_update_problem_by_case() -> None:
    fp16 = Codec.parse("fp16")
    ok = _update(np.full((2, 2), 60000.0, np.float32))  # 60000 < 65504, the largest fp16
    assert update_problem(ok) is None and update_problem(ok, codec=fp16) is None
    big = _update(np.full((2, 2), 70000.0, np.float32))
    assert update_problem(big) is None  # fine in fp32 ...
    assert "fp16" in update_problem(big, codec=fp16)  # ... overflows fp16
    # a per-name extras codec applies to that name only
    assert update_problem(big, codec=None, extra_codecs={"prototypes": fp16}) is not None
    assert update_problem(big, codec=fp16, extra_codecs={"prototypes": Codec.parse("fp32")}) is None
    assert "NaN" in update_problem(_update(np.array([[np.nan, 0], [0, 0]], np.float32)))
    assert "NaN" in update_problem(GlobalUpdate(tensors=[np.array([np.inf], np.float32)]))
    assert "metrics" in update_problem(GlobalUpdate(metrics={"norm": float("nan")}))
    assert "state" in update_problem(GlobalUpdate(state={"h": [np.array([np.inf])]}))


def test_apply_update_keeps_fedpad_prototypes_on_nan() -> None:
    s = _fedpad_with_prototypes()
    apply_update(s, 2, _update(np.array([[np.nan, 0], [0, 0]], np.float32)))
    np.testing.assert_array_equal(s.prototypes, PROTOS)
    apply_update(s, 2, _update(PROTOS * 2))
    np.testing.assert_array_equal(s.prototypes, PROTOS * 2)
    assert s.committed_metrics == {"fedpad_round": 1}


def test_driver_refuses_an_fp16_overflow_and_records_why(memory_hub, tmp_path) -> None:
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    ch = Channel(memory_hub.connect("server"), node_id="server", side="server", federation="mem", ledger=None)
    test = ArraySplit(np.zeros((2, 1, 8, 8), np.float32), np.zeros(2, np.int64), 10)
    s = _fedpad_with_prototypes()
    srv = AggregationServer(channel=ch, strategy=s, model=model, test=test, run_dir=tmp_path,
                            settings=ServerSettings(rounds=1, global_codec="fp16"))
    before = [t.copy() for t in srv.global_tensors]
    new = [t + 1 if np.issubdtype(t.dtype, np.floating) else t for t in state_arrays(model)]
    assert srv._commit(1, _update(np.full((2, 2), 1e5, np.float32), tensors=new)) is False
    assert "fp16" in srv.open.stats.skip_reason and srv.open.stats.skipped
    np.testing.assert_array_equal(s.prototypes, PROTOS)  # the strategy's state is as it was
    for a, b in zip(srv.global_tensors, before, strict=True):  # and so is the model
        np.testing.assert_array_equal(a, b)
    assert srv._commit(1, _update(PROTOS + 1, tensors=new)) is True
    np.testing.assert_array_equal(s.prototypes, PROTOS + 1)
    np.testing.assert_array_equal(srv.global_tensors[0], before[0] + 1)
