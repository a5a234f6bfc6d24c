"""The strategy hooks for per-round settings, device-metric aggregation and server-side
evaluation: what the driver takes from them, and what it does when they misbehave."""

from __future__ import annotations

import pytest
import torch

from broker_server.server import DRIVER_KEYS
from broker_server.strategies import ClientReport, client_metrics, round_config, server_evaluate
from broker_server.strategies.fedavg import FedAvg


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
