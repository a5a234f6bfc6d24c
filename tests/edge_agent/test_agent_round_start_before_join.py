"""A ``round_start`` that names the device by member index before its join receipt has brought
that index: a resumed server opens the next round for the devices of its registry as soon as
they are online, and a restarted agent's join receipt may come after the round's broadcast (seen
in a killed-and-resumed FedAdam run: the device ignored the round and the round closed at its
deadline one update short). The agent keeps the newest such start and decides on it when the
receipt arrives: it trains the round when the index the receipt brings is in ``members``, and
not when it is not."""

from __future__ import annotations

import threading

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
from protocol.membership import JOIN_INFO_KEY, encode_members
from protocol.memory_transport import MemoryBroker
from protocol.messages import Finish, Global, Join, Kind, Receipt, RoundStart, Update, decode

FED = "mem"
DEV = "dev-b"



def _sent(hub: MemoryBroker, body_type) -> list:
    envs = [decode(m.payload).envelope for m in hub.published if m.topic.startswith(f"fedfleet/v1/{FED}/up")]
    return [e for e in envs if isinstance(e.body, body_type)]


@pytest.mark.parametrize(("index", "members", "trains"), [
    (1, {0, 1}, True),    # the receipt's index 1 is among the members {0, 1}: round 3 is trained
    (2, {0, 1}, False),   # index 2 is not: the round is not this device's
])
def test_a_round_start_before_the_join_receipt_is_decided_by_the_receipts_index(
        index: int, members: set[int], trains: bool) -> None:
    hub = MemoryBroker()
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    rng = np.random.default_rng(0)
    agent = EdgeAgent(channel=Channel(hub.connect(DEV), node_id=DEV, side="agent", federation=FED, ledger=None),
                      model=model, algorithm=FedAvgClient(),
                      x=rng.standard_normal((20, 1, 8, 8)).astype(np.float32), y=rng.integers(0, 10, 20),
                      num_classes=10, idle_timeout_s=120, train_defaults=TrainConfig(batch_size=10))
    server = Channel(hub.connect("server"), node_id="server", side="server", federation=FED, ledger=None)
    server.transport.subscribe(topics.server_filters(FED))
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    assert wait_for(lambda: _sent(hub, Join))
    join = _sent(hub, Join)[0]
    assert join.body.info.get(JOIN_INFO_KEY) is True  # it reads member sets, so the server may name it so
    # round 3 (a resumed run) opens before the server has answered the join
    start = RoundStart(selected=(), deadline_s=600.0, config={}, members=encode_members(members))
    server.send(topics.down(FED, Kind.GLOBAL), Global(tensors=state_arrays(model),
                meta={"manifest_hash": agent.manifest_hash}), round=3)
    server.send(topics.down(FED, Kind.ROUND_START), start, round=3)
    assert wait_for(lambda: agent._before_join is not None)  # held: its index is not known yet
    assert not _sent(hub, Update)
    server.send(topics.down_to(FED, DEV, Kind.RECEIPT), Receipt(ref_kind=int(Kind.JOIN), ref_seq=join.seq,
                accepted=True, member_index=index), round=0, recipient=DEV)
    assert wait_for(lambda: agent.joined and agent._before_join is None)
    assert agent.member_index == index
    if trains:
        # the agent counts the round once its publish returns, a moment after the hub has the update
        assert wait_for(lambda: len(_sent(hub, Update)) == 1 and agent.rounds_trained == 1)
        assert [e.round for e in _sent(hub, Update)] == [3]
    else:  # round 4 names it by id: the one update that follows is round 4's, none was round 3's
        server.send(topics.down(FED, Kind.GLOBAL), Global(tensors=state_arrays(model),
                    meta={"manifest_hash": agent.manifest_hash}), round=4)
        server.send(topics.down(FED, Kind.ROUND_START), RoundStart(selected=(DEV,), deadline_s=600.0, config={}),
                    round=4)
        assert wait_for(lambda: len(_sent(hub, Update)) == 1 and agent.rounds_trained == 1)
        assert [e.round for e in _sent(hub, Update)] == [4]
    server.send(topics.down(FED, Kind.FINISH), Finish(reason="completed", rounds_completed=4), round=4)
    thread.join(60)
    assert not thread.is_alive()
    assert len(_sent(hub, Update)) == 1
