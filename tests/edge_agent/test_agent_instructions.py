"""An agent given instructions it cannot apply (a ``local_epochs`` of NaN or text, a
``batch_size`` of 0): it withdraws from that round saying why and keeps serving, instead of
leaving its run loop with the exception (the device would drop out of the fleet for good)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edge_agent.agent import EdgeAgent
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol import topics
from protocol.channel import Channel
from protocol.memory_transport import MemoryBroker
from protocol.messages import RoundStart, Status, decode


@pytest.mark.parametrize("instructions", [{"local_epochs": float("nan")}, {"local_epochs": "abc"},
                                          {"batch_size": 0}, {"lr": "fast"}])
def test_an_unusable_instruction_withdraws_the_round_and_the_agent_keeps_serving(instructions) -> None:
    hub = MemoryBroker()
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    rng = np.random.default_rng(0)
    agent = EdgeAgent(channel=Channel(hub.connect("dev-a"), node_id="dev-a", side="agent", federation="mem",
                                      ledger=None),
                      model=model, algorithm=FedAvgClient(), x=rng.standard_normal((20, 1, 8, 8)).astype(np.float32),
                      y=rng.integers(0, 10, 20), num_classes=10, client_index=0, idle_timeout_s=60,
                      train_defaults=TrainConfig(local_epochs=1, batch_size=10))
    agent._global = (1, state_arrays(model), {})
    start = RoundStart(selected=("dev-a",), deadline_s=600.0, config={"lr": 0.05}, instructions=instructions)
    agent._pending, agent._pending_at = (1, start), time.monotonic()
    agent._maybe_train()  # must not raise
    assert agent.rounds_trained == 0
    said = [decode(p).envelope.body for t, p in agent.channel.transport.sent
            if t == topics.status("mem", "dev-a")]
    assert any(isinstance(b, Status) and b.state == "idle" and "round 1" in b.detail for b in said)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"local_epochs": float("inf")}, "local_epochs = inf is not finite"),
    ({"local_epochs": 1.5}, "local_epochs = 1.5 must be a whole number >= 0"),
    ({"batch_size": 0}, "batch_size = 0 must be a whole number >= 1"),
    ({"lr": -0.1}, "lr = -0.1 must be >= 0"),
    ({"momentum": 1.0}, "momentum = 1.0 must be in [0, 1)"),
    ({"weight_decay": True}, "weight_decay = True is not a number"),
])
def test_round_settings_a_device_cannot_use_are_named(overrides, message) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        TrainConfig.from_mapping(TrainConfig(), overrides)


def test_usable_round_settings_are_applied_as_given() -> None:
    cfg = TrainConfig.from_mapping(TrainConfig(), {"local_epochs": 3.0, "batch_size": "16", "lr": "0.5",
                                                   "momentum": 0.9, "other": "ignored"})
    assert (cfg.local_epochs, cfg.batch_size, cfg.lr, cfg.momentum) == (3, 16, 0.5, 0.9)
