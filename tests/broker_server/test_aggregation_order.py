"""A round's aggregate does not depend on the order its updates arrive in.

Updates arrive in whatever order the devices finish (threads of a simulation, a real fleet's
links), so a reproduction re-run gets them in another order; the global model, its extras and
the round's metrics must come out bit-identical. Each strategy's streaming accumulator is fed the
same updates in three orders and the results compared exactly (a second computation: the same
accumulator, another order)."""

from __future__ import annotations

import numpy as np
import pytest

from broker_server.strategies import ClientResult, accumulator_for, get_strategy, round_result

C, F = 4, 3  # classes, feature width (the stand-in classifier weight is [C, F])


def _updates(rng: np.random.Generator, k: int = 6) -> list[ClientResult]:
    out = []
    for i in range(k):
        classes = np.sort(rng.choice(C, size=int(rng.integers(1, C + 1)), replace=False)).astype(np.int64)
        # magnitudes over several decades, so float rounding would show an order dependence
        w = (rng.standard_normal((C, F)) * 10.0 ** rng.integers(-4, 3, size=(C, F))).astype(np.float32)
        b = rng.standard_normal(C).astype(np.float32)
        protos = (rng.standard_normal((classes.size, F)) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
        out.append(ClientResult(f"client-{i:03d}", (b, w), int(rng.integers(5, 500)), float(rng.random()), {},
                                {"prototypes": protos, "proto_classes": classes,
                                 "proto_counts": np.ones(classes.size, np.int64)}))
    return out


def _round(name: str, updates: list[ClientResult], **kw):
    s = get_strategy(name, min_clients=1, **kw)
    current = [np.zeros(C, np.float32), np.zeros((C, F), np.float32)]
    s.configure_round(1, [u.client_id for u in updates], np.random.default_rng(0))
    acc = accumulator_for(s, 1, current)
    for u in updates:
        assert s.validate(u) is None
        acc.add(u)
    update, problem = round_result(acc.result)
    assert problem is None, problem
    return update


@pytest.mark.parametrize(("name", "kw"), [("fedavg", {}), ("fedavg", {"weighting": "uniform"}), ("fpl", {}),
                                          ("fedpad", {}), ("fedproto-avg", {}), ("fedprox", {}), ("fedadam", {}),
                                          ("feddyn", {})])
def test_aggregate_is_the_same_whatever_the_arrival_order(name: str, kw: dict) -> None:
    rng = np.random.default_rng(7)
    updates = _updates(rng)
    ref = _round(name, updates, **kw)
    for order in (list(reversed(updates)), [updates[i] for i in rng.permutation(len(updates))]):
        got = _round(name, order, **kw)
        for a, b in zip(ref.tensors, got.tensors, strict=True):
            np.testing.assert_array_equal(a, b)
        assert set(ref.extras) == set(got.extras)
        for key in ref.extras:
            np.testing.assert_array_equal(ref.extras[key], got.extras[key])
        assert ref.metrics == got.metrics
