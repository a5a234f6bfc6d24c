"""The strategy's figures in ``metrics.jsonl`` are those of the update committed in that round:
a round skipped for want of a quorum, or whose update the driver refused, carries none of the
round before's, whatever the strategy resets (here: nothing). Rounds on the in-memory broker,
updates scripted message by message (``helpers.memory_server``)."""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from helpers.memory_server import incoming, memory_server, update_payload

from broker_server.strategies import GlobalUpdate, get_strategy
from broker_server.strategies.fedavg import FedAvg
from edge_agent.models import build_model
from edge_agent.state import state_arrays

FED = "metrics"


class NeverResets(FedAvg):
    """FedAvg whose update carries figures and that clears nothing between rounds; round 4's
    figure is NaN, so the driver refuses that update."""

    def aggregate(self, round, current, results):
        up = super().aggregate(round, current, results)
        figure = float("nan") if round == 4 else float(round)
        return GlobalUpdate(tensors=up.tensors, metrics={"figure": figure, "reporters": [r.client_id for r in results]})

    def accumulator(self, round, current):
        return super(FedAvg, self).accumulator(round, current)  # buffered: aggregate() at the close


def _run(tmp_path: Path, strategy, reporting: dict[int, bool]) -> list[dict]:
    """Rounds 1…len(reporting) with one client that reports in round r when ``reporting[r]``."""
    model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    like = list(state_arrays(model))
    rng = np.random.default_rng(0)
    feed: deque = deque()
    srv = memory_server(tmp_path, model=model, clients=["dev-a"], rounds=len(reporting), strategy=strategy,
                        feed=lambda: feed.popleft() if feed else None, fed=FED, deadline_s=3.0)
    out = []
    for r, reports in reporting.items():
        before = [np.array(t) for t in srv.global_tensors]
        if reports:
            topic, payload = update_payload(FED, "dev-a", r, r + 1, like, rng)
            feed.append(incoming(topic, payload))
        m = srv.run_round(r)
        m["_moved"] = math.sqrt(sum(float(np.sum((np.asarray(a, np.float64) - b) ** 2))
                                    for a, b in zip(srv.global_tensors, before, strict=True)
                                    if np.issubdtype(b.dtype, np.floating)))
        out.append(m)
    return out


def test_a_skipped_or_refused_round_logs_none_of_the_round_befores_figures(tmp_path: Path) -> None:
    m = _run(tmp_path, NeverResets(min_clients=1), {1: True, 2: False, 3: True, 4: True})
    assert (m[0]["figure"], m[0]["reporters"]) == (1.0, ["dev-a"]) and not m[0]["skipped"]
    assert m[1]["skipped"] and m[1]["clients_reported"] == 0
    assert "figure" not in m[1] and "reporters" not in m[1]  # quorum missed: nothing committed
    assert (m[2]["figure"], m[2]["reporters"]) == (3.0, ["dev-a"])
    assert m[3]["skipped"] and "NaN" in m[3]["skip_reason"] and m[3]["clients_reported"] == 1
    assert "figure" not in m[3] and "reporters" not in m[3]  # refused: round 3's are not repeated
    assert m[3]["_moved"] == 0.0  # and the model stayed


@pytest.mark.parametrize("name", ["fedopt", "fedadam"])
def test_server_update_norm_is_logged_for_the_committing_round_only(tmp_path: Path, name: str) -> None:
    m = _run(tmp_path, get_strategy(name, min_clients=1), {1: True, 2: False, 3: True})
    # ‖w_{t+1} − w_t‖₂, worked out here from the server's model before and after the round
    for i in (0, 2):
        assert m[i]["server_update_norm"] == pytest.approx(m[i]["_moved"], rel=1e-6) and m[i]["_moved"] > 0
    assert m[1]["skipped"] and "server_update_norm" not in m[1]
