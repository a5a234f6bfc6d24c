"""FPL's server half given finite but extreme prototypes from a device: they are refused by
``validate`` or the round's update is discarded by the commit rule — never an exception out of
the accumulator, which the driver does not catch (one device would stop the whole run)."""

from __future__ import annotations

import numpy as np

from broker_server.strategies import ClientResult, accumulator_for, get_strategy, round_result, update_problem
from edge_agent.models import build_model
from edge_agent.state import state_arrays


def _round(value: float) -> tuple[str | None, object]:
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    current = [a.copy() for a in state_arrays(model)]
    s = get_strategy("fpl", min_clients=1)
    s.bind_model(model)
    d = current[-2].shape[1]
    results = [ClientResult(cid, tuple(current), 10, 1.0, {},
                            {"prototypes": protos, "proto_classes": np.arange(10, dtype=np.int64),
                             "proto_counts": np.ones(10, np.int64)})
               for cid, protos in (("a", np.full((10, d), value, np.float32)),
                                   ("b", np.full((10, d), value, np.float32)))]
    s.configure_round(1, ["a", "b"], np.random.default_rng(0))
    acc = accumulator_for(s, 1, current)
    refused = []
    for r in results:
        reason = s.validate(r)
        if reason:
            refused.append(reason)
        else:
            acc.add(r)
    return (refused[0] if refused else None), round_result(acc.result)


def test_prototypes_near_float32_max_never_raise_from_the_round() -> None:
    """Two devices' prototypes of 3e38 (finite; their mean overflows float32): the round ends with a
    reason (refused, or its aggregation failed and the global state is kept), never an exception
    out of the driver's end-of-round call."""
    refused, (update, failure) = _round(3e38)  # must not raise
    assert refused is not None or failure is not None or update is None or update_problem(update) is not None
    if failure is not None:
        assert failure.startswith("aggregation failed: ")


def test_ordinary_prototypes_give_an_update() -> None:
    refused, (update, failure) = _round(0.5)
    assert refused is None and failure is None and update is not None and update_problem(update) is None
    np.testing.assert_allclose(update.extras["unbiased_protos"], 0.5, rtol=1e-6)  # the mean of equal rows
