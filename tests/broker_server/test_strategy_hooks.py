"""The strategy hooks for per-round settings, device-metric aggregation and server-side
evaluation: what the driver takes from them, and what it does when they misbehave."""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.memory_server import incoming, memory_server, update_payload

from broker_server.server import DRIVER_KEYS
from broker_server.strategies import ClientReport, GlobalUpdate, client_metrics, round_config, server_evaluate
from broker_server.strategies.fedavg import FedAvg
from edge_agent.models import build_model
from edge_agent.state import state_arrays


class Hooks(FedAvg):
    def config_for_round(self, round):
        return {"lr": 0.2 / round, "local_epochs": round}

    def aggregate_metrics(self, round, reports):
        n = sum(r.num_samples for r in reports)
        return {"acc_w": sum(r.metrics["train_accuracy"] * r.num_samples for r in reports) / n, "round": 99}

    def evaluate(self, round, model):
        assert not model.training and not torch.is_grad_enabled()
        return {"accuracy": 0.5, "loss": 1.5, "mine": round}


def test_the_schedule_wins_over_the_plan_and_is_checked() -> None:
    s = Hooks(train_config={"lr": 0.05, "batch_size": 8})
    assert round_config(s, 4, {"lr": 0.05, "batch_size": 8}) == {"lr": 0.05, "batch_size": 8, "local_epochs": 4}
    s.config_for_round = lambda r: {"batch_size": 0}  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"round 1: round config batch_size = 0 must be a whole number >= 1"):
        round_config(s, 1, {})
    s.config_for_round = lambda r: {"lr": [0.1]}  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"is not a scalar"):
        round_config(s, 1, {})


def test_device_metrics_are_aggregated_by_the_hook_and_the_driver_keys_are_kept() -> None:
    reports = [ClientReport("a", 10, 0.1, {"train_accuracy": 0.5}), ClientReport("b", 30, 0.2, {"train_accuracy": 0.9})]
    out = client_metrics(Hooks(), 3, reports, DRIVER_KEYS)
    assert out["acc_w"] == pytest.approx((0.5 * 10 + 0.9 * 30) / 40)
    assert "round" not in out and out["metrics_refused"] == ["round"]


def test_server_evaluation_and_a_failing_hook() -> None:
    model = torch.nn.Linear(2, 2)
    assert server_evaluate(Hooks(), 2, model) == {"accuracy": 0.5, "loss": 1.5, "mine": 2}
    broken = Hooks()
    broken.evaluate = lambda r, m: 1 / 0  # type: ignore[method-assign, assignment]
    assert server_evaluate(broken, 2, model) == {"evaluate_error": "ZeroDivisionError: division by zero"}
    assert FedAvg().evaluate(1, model) == {} and FedAvg().aggregate_metrics(1, []) == {}
    assert FedAvg().config_for_round(1) == {}


class Garbage(FedAvg):
    """Hooks returning what no metrics line can hold, and driver keys, beside figures that pass."""

    def __init__(self, evaluation, **kw):
        super().__init__(**kw)
        self.evaluation = evaluation

    def evaluate(self, round, model):
        return self.evaluation

    def aggregate_metrics(self, round, reports):
        return {"t": torch.tensor(0.25), "f32": np.float32(0.5), "arr": np.zeros(3, np.float32),
                ("a", "b"): 1, "nan": float("nan"), "ok": [1, "x", {"k": 2}]}

    def round_metrics(self):
        return {"dropped": ["nobody"], "phase_s": 0, "standing": 7}

    def aggregate(self, round, current, results):
        up = super().aggregate(round, current, results)
        return GlobalUpdate(tensors=up.tensors, metrics={"loss": 123.0, "mine": round})


@pytest.mark.parametrize("accuracy", [2.0, -0.1, "high", True, float("nan"), [0.5]])
def test_an_accuracy_that_is_no_fraction_is_refused_and_named(accuracy) -> None:
    out = server_evaluate(Garbage({"accuracy": accuracy, "loss": 0.3, "own": 1}), 1, torch.nn.Linear(2, 2))
    assert "accuracy" not in out and out["metrics_refused"] == ["accuracy"] and out["own"] == 1


def test_a_negative_or_non_numeric_loss_is_refused() -> None:
    out = server_evaluate(Garbage({"accuracy": 0.5, "loss": -1.0}), 1, torch.nn.Linear(2, 2))
    assert out == {"accuracy": 0.5, "metrics_refused": ["loss"]}
    assert server_evaluate(Garbage([1, 2]), 1, torch.nn.Linear(2, 2)) == {
        "evaluate_error": "TypeError: returned a list, not a mapping of figures"}


def test_device_figures_become_numbers_or_are_refused_by_name() -> None:
    out = client_metrics(Garbage({}), 1, [ClientReport("a", 1, 0.1, {})], DRIVER_KEYS)
    assert out["t"] == 0.25 and type(out["t"]) is float and out["f32"] == 0.5 and type(out["f32"]) is float
    assert out["ok"] == [1, "x", {"k": 2}]
    assert out["metrics_refused"] == ["('a', 'b')", "arr", "nan"]
    json.dumps(out, allow_nan=False)  # a valid JSON line


def test_a_round_with_garbage_figures_keeps_the_driver_keys_and_writes_its_line(tmp_path: Path) -> None:
    """One round on the memory broker: before, a tensor from aggregate_metrics stopped the run in
    json.dumps, evaluate's accuracy 2.0 became the round's, and round_metrics' or the update's
    ``dropped``/``loss`` replaced the driver's."""
    model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    like = list(state_arrays(model))
    feed: deque = deque()
    strategy = Garbage({"accuracy": 2.0, "mine2": np.float64(0.5)}, min_clients=1)
    srv = memory_server(tmp_path, model=model, clients=["dev-a"], rounds=1, strategy=strategy,
                        feed=lambda: feed.popleft() if feed else None, fed="hooks", deadline_s=600.0)
    topic, payload = update_payload("hooks", "dev-a", 1, 2, like, np.random.default_rng(0))
    feed.append(incoming(topic, payload))
    m = srv.run_round(1)
    # the blank test split (four zero images of class 0), evaluated by the driver: not 2.0
    assert m["accuracy_source"] == "global" and 0.0 <= m["accuracy"] <= 1.0
    assert m["loss"] != 123.0 and m["dropped"] == [] and isinstance(m["phase_s"], dict)
    assert m["mine"] == 1 and m["standing"] == 7 and m["t"] == 0.25 and m["mine2"] == 0.5
    assert m["metrics_refused"] == sorted(["('a', 'b')", "accuracy", "arr", "dropped", "loss", "nan", "phase_s"])
    line = (tmp_path / "metrics.jsonl").read_text().splitlines()[-1]
    assert json.loads(line)["metrics_refused"] == m["metrics_refused"]


def test_a_failing_round_metrics_costs_its_figures_not_the_round(tmp_path: Path) -> None:
    model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    strategy = FedAvg(min_clients=1)
    strategy.round_metrics = lambda: 1 / 0  # type: ignore[method-assign, assignment]
    srv = memory_server(tmp_path, model=model, clients=["dev-a"], rounds=1, strategy=strategy, deadline_s=0.2)
    m = srv.run_round(1)
    assert m["skipped"] and m["round_metrics_error"] == "ZeroDivisionError: division by zero"
