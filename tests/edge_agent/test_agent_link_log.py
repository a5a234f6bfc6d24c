"""What an edge agent says in its log when its link to the broker breaks and comes back, on the
in-process broker (``MemoryTransport.drop_link``): a ``WARNING`` when it is lost (the reason, the
messages awaiting acknowledgement: none here, delivery is immediate, and its update still awaiting
the server's receipt) and an ``INFO`` when it is back (the connection's number, the seconds down
on the agent's link clock, scripted here). The same over a real broker that is killed and
restarted: tests/integration/test_agent_liveness.py."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np
import pytest
from helpers.waiting import wait_for

from edge_agent.agent import EdgeAgent
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol import topics
from protocol.channel import Channel
from protocol.memory_transport import MemoryBroker
from protocol.messages import Finish, Global, Join, Kind, Receipt, RoundStart, Status, Update, decode

FED = "mem"
DEV = "dev-a"
REASON = "link dropped (MemoryTransport.drop_link)"


def _clock(*values: float) -> Callable[[], float]:
    it = iter(values)
    return lambda: next(it)


def _link_records(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == "edge_agent.agent" and "link to the broker" in r.getMessage()]


def test_a_dropped_link_is_a_warning_and_its_return_an_info_naming_the_update_awaiting_its_receipt(
        caplog: pytest.LogCaptureFixture) -> None:
    """Two drops: one before any round (nothing in flight), one after the agent published its
    round-1 update, which the server has not answered. Link clock: lost at 100 s, back at 112.5 s;
    lost at 200 s, back at 203 s. After each return the agent says ``online`` again."""
    caplog.set_level(logging.INFO, logger="edge_agent.agent")
    hub = MemoryBroker()
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    rng = np.random.default_rng(0)
    agent = EdgeAgent(channel=Channel(hub.connect(DEV), node_id=DEV, side="agent", federation=FED, ledger=None),
                      model=model, algorithm=FedAvgClient(), x=rng.standard_normal((20, 1, 8, 8)).astype(np.float32),
                      y=rng.integers(0, 10, 20), num_classes=10, idle_timeout_s=120,
                      train_defaults=TrainConfig(batch_size=10), receipt_timeout_s=600.0)
    agent.link_log.clock = _clock(100.0, 112.5, 200.0, 203.0)
    server = Channel(hub.connect("server"), node_id="server", side="server", federation=FED, ledger=None)
    server.transport.subscribe(topics.server_filters(FED))

    def sent(body_type) -> list:
        envs = [decode(m.payload).envelope for m in hub.published if m.topic.startswith(f"fedfleet/v1/{FED}/")]
        return [e for e in envs if e.sender == DEV and isinstance(e.body, body_type)]

    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: sent(Join))
        server.send(topics.down_to(FED, DEV, Kind.RECEIPT), Receipt(ref_kind=int(Kind.JOIN), ref_seq=sent(Join)[0].seq,
                    accepted=True), round=0, recipient=DEV)
        assert wait_for(lambda: agent.joined)
        agent.channel.transport.drop_link()
        server.send(topics.down(FED, Kind.GLOBAL), Global(tensors=state_arrays(model),
                    meta={"manifest_hash": agent.manifest_hash}), round=1)
        server.send(topics.down(FED, Kind.ROUND_START), RoundStart(selected=(DEV,), deadline_s=600.0, config={}),
                    round=1)
        assert wait_for(lambda: sent(Update) and agent._unacked is not None)
        agent.channel.transport.drop_link()
    finally:
        server.send(topics.down(FED, Kind.FINISH), Finish(reason="completed", rounds_completed=1), round=1)
        thread.join(60)
    assert not thread.is_alive()
    assert _link_records(caplog) == [
        (logging.WARNING, f"{DEV}: link to the broker lost (connection 1: {REASON}); no message awaiting "
                          "acknowledgement; reconnecting"),
        (logging.INFO, f"{DEV}: link to the broker back (connection 2), 12.5 s after it was lost"),
        (logging.WARNING, f"{DEV}: link to the broker lost (connection 2: {REASON}); no message awaiting "
                          "acknowledgement; its update of round 1 awaits its receipt; reconnecting"),
        (logging.INFO, f"{DEV}: link to the broker back (connection 3), 3.0 s after it was lost")]
    assert (agent.link_log.losses, agent.link_log.down_s) == (2, 15.5)
    assert [e.body.detail for e in sent(Status) if e.body.state == "online"] == ["", "reconnected", "reconnected"]


def test_an_agent_whose_logger_is_at_warning_says_the_loss_only(caplog: pytest.LogCaptureFixture) -> None:
    """``fedfleet-agent`` without ``-v`` logs at WARNING: the loss is said, the return is not."""
    caplog.set_level(logging.WARNING, logger="edge_agent.agent")
    hub = MemoryBroker()
    rng = np.random.default_rng(0)
    agent = EdgeAgent(channel=Channel(hub.connect(DEV), node_id=DEV, side="agent", federation=FED, ledger=None),
                      model=build_model("lightcnn", in_channels=1, image_size=8, num_classes=10),
                      algorithm=FedAvgClient(), x=rng.standard_normal((20, 1, 8, 8)).astype(np.float32),
                      y=rng.integers(0, 10, 20), num_classes=10, train_defaults=TrainConfig(batch_size=10))
    agent.link_log.clock = _clock(7.0, 9.0)
    agent.channel.transport.drop_link()
    assert _link_records(caplog) == [
        (logging.WARNING, f"{DEV}: link to the broker lost (connection 1: {REASON}); no message awaiting "
                          "acknowledgement; reconnecting")]
    assert agent.link_log.down_s == 2.0
