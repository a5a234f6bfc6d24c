"""A checkpoint whose strategy state the strategy cannot take back: ``AggregationServer.resume``
raises a RunError naming the round, the strategy and the strategy's reason (the CLI prints it as
one line, exit 1), and leaves the server as it was: no round, no model, no metrics taken from it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.memory_federation import Device, federation_server, run_federation

from broker_server.errors import RunError
from broker_server.strategies.fedavg import FedAvg
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.state import state_arrays
from protocol.memory_transport import MemoryBroker


class _Counting(FedAvg):
    """FedAvg keeping a round counter in its checkpointed state."""

    name = "counting"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.rounds_seen = 0

    def aggregate(self, round, current, results):
        self.rounds_seen += 1
        return super().aggregate(round, current, results)

    def state_dict(self) -> dict:
        return {"rounds_seen": self.rounds_seen}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.rounds_seen = int(state["rounds_seen"])


class _Renamed(_Counting):
    """Reads the counter under another key, as a later version might: the checkpoint lacks it."""

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.rounds_seen = int(state["rounds_aggregated"])


class _Refusing(_Counting):
    def load_state_dict(self, state: dict) -> None:
        raise ValueError("this checkpoint was written for 5 devices, the run has 2")


@pytest.mark.parametrize(("strategy", "reason"), [
    (_Renamed, "KeyError: 'rounds_aggregated'"),
    (_Refusing, "this checkpoint was written for 5 devices, the run has 2"),
])
def test_a_state_the_strategy_cannot_take_is_a_run_error_and_changes_nothing(tmp_path: Path, digits, strategy,
                                                                              reason) -> None:
    devices = {f"dev-{i}": Device(FedAvgClient(), digits.train.x[50 * i:50 * i + 50],
                                  digits.train.y[50 * i:50 * i + 50]) for i in range(2)}
    first = run_federation(tmp_path, MemoryBroker(), _Counting(participation_rate=1.0), devices, digits.test,
                           rounds=2)
    assert first.strategy.rounds_seen == 2
    first.store.close()
    again = federation_server(tmp_path, MemoryBroker(), strategy(participation_rate=1.0), digits.test, rounds=3,
                              clients=2)
    ckpt = again.checkpoints.load()
    assert ckpt is not None and ckpt.round == 2 and ckpt.strategy_state == {"rounds_seen": 2}
    before = [np.array(a) for a in state_arrays(again.model)]
    with pytest.raises(RunError) as err:
        again.resume(ckpt)
    assert str(err.value) == (f"the checkpoint of round 2 in {tmp_path}: strategy 'counting' cannot restore its state "
                              f"from it ({reason})")
    assert again.round == 0 and again.strategy.rounds_seen == 0 and again.metrics == []
    assert all(np.array_equal(a, b) for a, b in zip(before, state_arrays(again.model), strict=True))
