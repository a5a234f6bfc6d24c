"""``summary.json``'s record of the strategy (:func:`broker_server.run_end.summary_record` and
:meth:`broker_server.strategies.Strategy.run_summary`): kept as given where it is JSON, left out
where empty, and a strategy whose record fails costs the run that record only, said by name."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from broker_server.config import load
from broker_server.run_end import summary_record
from broker_server.strategies.fedavg import FedAvg
from edge_agent.data import load_dataset

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml"


class _Told(FedAvg):
    def __init__(self, told) -> None:
        super().__init__()
        self.told = told

    def run_summary(self) -> dict:
        if isinstance(self.told, Exception):
            raise self.told
        return self.told


def _record(strategy) -> dict:
    return summary_record(load(QUICKSTART), load_dataset("digits"), federation="f", final_accuracy=0.5,
                          rounds_completed=1, seconds=1.0, broker="b", refusals={}, onnx={}, strategy=strategy)


def test_a_strategys_record_is_kept_and_an_empty_one_left_out() -> None:
    told = {"policy": {"file_sha256": "ab" * 32, "metadata": {"episodes": 10}}, "agent": None}
    rec = _record(_Told(told))
    assert rec["strategy"] == told and "strategy_summary_error" not in rec
    assert json.loads(json.dumps(rec))["strategy"] == told
    # FedAvg has none: no key, as without a strategy
    assert "strategy" not in _record(FedAvg()) and "strategy" not in _record(None)


@pytest.mark.parametrize(("told", "why"), [(RuntimeError("no agent"), "RuntimeError: no agent"),
                                           ({"slots": {1, 2}}, "TypeError: Object of type set is not JSON")])
def test_a_record_that_fails_costs_only_that_record_and_says_why(told, why: str, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="broker_server.run_end"):
        rec = _record(_Told(told))
    assert "strategy" not in rec and rec["strategy_summary_error"].startswith(why)
    assert rec["final_accuracy"] == 0.5 and "the strategy's run summary is not recorded" in caplog.text
