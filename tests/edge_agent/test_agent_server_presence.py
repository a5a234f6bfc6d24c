"""The server's presence (``down/status``: ``online`` / ``offline``, retained, ``offline`` its last
will) seen by an agent: re-sends held while an ``offline`` delivered live says the server is gone,
what is pending sent at once on its ``online``, and a retained ``offline`` (a stale fact, perhaps
of an earlier run's server) never held on. The server is scripted over a memory broker; every
count is of the PUBLISHes the broker received (``hub.published``)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers.waiting import wait_for

from broker_server.server import server_will
from edge_agent.agent import EdgeAgent
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol import topics
from protocol.channel import Channel, Received
from protocol.memory_transport import MemoryBroker
from protocol.messages import Finish, Global, Join, Kind, Receipt, RoundStart, Status, Update, decode

FED = "pres"
CID = "dev-a"


class ScriptedServer:
    """The server's side of one connection (MQTT client ``server``, its last will the real
    server's :func:`~broker_server.server.server_will`), driven by the test."""

    def __init__(self, hub: MemoryBroker) -> None:
        self.transport = hub.connect("server", will=server_will(FED))
        self.channel = Channel(self.transport, node_id="server", side="server", federation=FED, ledger=None)
        self.transport.subscribe(topics.server_filters(FED))

    def say(self, state: str, rounds: tuple[int, int] | None = None) -> None:
        """``state`` (retained); ``rounds``: an ``online``'s (last round completed, round collecting or 0)."""
        body = Status(state, "scripted") if rounds is None else \
            Status(state, "scripted", global_round=rounds[0], start_round=rounds[1], update_round=0)
        self.channel.send(topics.server_status(FED), body, round=0, retain=True)

    def next_of(self, body_type: type) -> Received:
        """The next message of ``body_type`` from the agent (others are skipped)."""
        while True:
            item = self.channel.receive(60.0)
            assert item is not None, f"no {body_type.__name__} came"
            if isinstance(item, Received) and isinstance(item.envelope.body, body_type):
                return item

    def answer(self, item: Received) -> None:
        env = item.envelope
        self.channel.send(topics.down_to(FED, CID, Kind.RECEIPT),
                          Receipt(ref_kind=int(env.kind), ref_seq=env.seq, accepted=True, sha256=item.sha256),
                          round=env.round, recipient=CID)

    def start_round(self, rnd: int, model) -> None:
        self.channel.send(topics.down(FED, Kind.GLOBAL), Global(tensors=state_arrays(model)), round=rnd)
        self.channel.send(topics.down(FED, Kind.ROUND_START), RoundStart(selected=(CID,), deadline_s=600.0),
                          round=rnd)

    def finish(self) -> None:
        self.channel.send(topics.down(FED, Kind.FINISH), Finish(reason="completed", rounds_completed=1), round=1)


def _agent(hub: MemoryBroker) -> EdgeAgent:
    """A FedAvg agent of 20 random 1×8×8 images, re-sending an update without receipt at most 3
    times (its receipt timeout an hour: each test lowers it when it wants re-sends)."""
    rng = np.random.default_rng(0)
    return EdgeAgent(channel=Channel(hub.connect(CID), node_id=CID, side="agent", federation=FED, ledger=None),
                     model=build_model("lightcnn", in_channels=1, image_size=8, num_classes=10),
                     algorithm=FedAvgClient(), x=rng.standard_normal((20, 1, 8, 8)).astype(np.float32),
                     y=rng.integers(0, 10, 20), num_classes=10, idle_timeout_s=120,
                     train_defaults=TrainConfig(batch_size=10), receipt_timeout_s=3600.0, max_resends=3)


def _start(agent: EdgeAgent) -> tuple[threading.Thread, dict]:
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("summary", agent.run()), daemon=True)
    t.start()
    return t, box


def _on_wire(hub: MemoryBroker, kind: Kind) -> list:
    """Every PUBLISH of the agent's ``kind`` (its ``up/dev-a/{kind}`` topic) the broker received."""
    return [m for m in hub.published if m.topic == topics.up(FED, CID, kind)]


def _joined_and_trained(hub: MemoryBroker, agent: EdgeAgent, server: ScriptedServer) -> None:
    """The agent joins (answered), trains round 1 and sends its update's first copy (unanswered)."""
    server.answer(server.next_of(Join))
    assert wait_for(lambda: agent.joined)
    server.start_round(1, agent.model)
    server.next_of(Update)
    assert len(_on_wire(hub, Kind.UPDATE)) == 1


def _trained_then_server_gone(rounds: tuple[int, int] | None = None):
    """A server that said online (``rounds``: what its online says of its rounds), an agent that
    joined and sent round 1's update, then the server's process dies: its last will reaches the
    agent live. Returns (hub, server, agent, thread, box)."""
    hub = MemoryBroker()
    server = ScriptedServer(hub)
    server.say("online", rounds)
    agent = _agent(hub)
    t, box = _start(agent)
    _joined_and_trained(hub, agent, server)
    server.transport.abort()
    assert wait_for(lambda: agent.server_offline)
    return hub, server, agent, t, box


@pytest.mark.parametrize("rounds", [None, (0, 1), (1, 0)], ids=["rounds-not-said", "round-collecting", "round-done"])
def test_update_resends_are_held_while_the_server_is_offline_and_the_update_goes_at_once_on_its_online(
        rounds: tuple[int, int] | None) -> None:
    """``rounds``: what the server's online says (nothing; round 1 collecting; round 1 completed,
    the update perhaps counted and its receipt lost): each time the update goes at once."""
    # the server's process dies: the broker publishes its last will, delivered live
    hub, server, agent, t, box = _trained_then_server_gone()
    agent.receipt_timeout_s = 0.05  # from now the receipt timeout runs out again and again
    # each copy the timeout would send is held, at most max_resends (3), and none reaches the broker
    assert wait_for(lambda: agent.held_resends["update"] == 3)
    assert agent.held_resends == {"update": 3, "join": 0}
    assert len(_on_wire(hub, Kind.UPDATE)) == 1
    assert agent.resends == 0
    # the server is back and says online: the update still without a receipt goes at once
    agent.receipt_timeout_s = 3600.0
    back = ScriptedServer(hub)
    back.say("online", rounds)
    item = back.next_of(Update)
    assert not agent.server_offline
    assert agent.sent_on_online == {"update": 1, "join": 0}
    assert item.envelope.round == 1
    back.answer(item)
    assert wait_for(lambda: agent.receipts_accepted == 1)
    back.finish()
    t.join(60)
    assert not t.is_alive() and box["summary"].finished
    # the first copy, then the one sent on the online: nothing went out during the outage
    assert len(_on_wire(hub, Kind.UPDATE)) == 2
    assert agent.held_resends == {"update": 3, "join": 0}
    assert agent.resends == 1


def test_without_the_servers_presence_the_update_is_sent_again_on_its_timeout() -> None:
    """A server that says nothing of its presence (an older version: no status, no last will)
    vanishes: the agent never holds, and sends its update again max_resends times."""
    hub = MemoryBroker()
    server = ScriptedServer(hub)
    server.transport.will = None  # an older server registers no last will
    agent = _agent(hub)
    t, box = _start(agent)
    _joined_and_trained(hub, agent, server)
    server.transport.abort()
    agent.receipt_timeout_s = 0.05
    assert wait_for(lambda: agent.resends == 3)  # max_resends: no fourth
    assert len(_on_wire(hub, Kind.UPDATE)) == 1 + 3
    assert agent.held_resends == {"update": 0, "join": 0} and not agent.server_offline
    agent.stop()
    t.join(60)
    assert not t.is_alive()


def test_a_stale_retained_offline_never_holds_a_new_agents_join() -> None:
    """The retained offline an earlier server of this federation id left on the broker (its last
    will) is delivered to a new agent on subscribing: its first join goes, its join re-sends go
    on their schedule, and a server that says nothing of its presence (an older version) gets it."""
    hub = MemoryBroker()
    earlier = ScriptedServer(hub)
    earlier.say("online")
    earlier.transport.abort()  # gone: its last will is the retained status now
    assert decode(hub.retained[topics.server_status(FED)]).envelope.body == Status("offline", "connection lost")
    agent = _agent(hub)
    agent.join_resend_s = 0.05
    t, box = _start(agent)
    assert wait_for(lambda: len(_on_wire(hub, Kind.JOIN)) >= 3)  # the first join and two re-sends
    assert not agent.server_offline and agent.held_resends == {"update": 0, "join": 0}
    # a server of an older version subscribes (no status at all) and answers the next join
    old = Channel(hub.connect("server"), node_id="server", side="server", federation=FED, ledger=None)
    old.transport.subscribe(topics.server_filters(FED))
    item = None
    while item is None or not isinstance(item.envelope.body, Join):
        item = old.receive(60.0)
    old.send(topics.down_to(FED, CID, Kind.RECEIPT), Receipt(ref_kind=int(Kind.JOIN), ref_seq=item.envelope.seq,
                                                             accepted=True), round=0, recipient=CID)
    assert wait_for(lambda: agent.joined)
    old.send(topics.down(FED, Kind.FINISH), Finish(reason="completed", rounds_completed=0), round=0)
    t.join(60)
    assert not t.is_alive() and box["summary"].finished
    assert agent.held_resends == {"update": 0, "join": 0} and agent.sent_on_online == {"update": 0, "join": 0}


def test_join_resends_are_held_on_a_live_offline_and_the_join_goes_at_once_on_online() -> None:
    """An agent not joined yet sees the server go (its last will, live): its first join went, its
    re-sends are held; the server's online sends the join at once, which it answers."""
    hub = MemoryBroker()
    agent = _agent(hub)
    agent.join_resend_s = 3600.0
    t, box = _start(agent)
    assert wait_for(lambda: len(_on_wire(hub, Kind.JOIN)) == 1)  # the first join, to no one: never held
    gone = ScriptedServer(hub)  # subscribed after that join, which went to no one
    gone.transport.abort()  # its last will, delivered live to the agent
    assert wait_for(lambda: agent.server_offline)
    agent._join_every_s = 0.05  # the schedule's next re-sends come now
    assert wait_for(lambda: agent.held_resends["join"] >= 2)
    assert len(_on_wire(hub, Kind.JOIN)) == 1
    agent._join_every_s = 3600.0
    back = ScriptedServer(hub)
    back.say("online")
    back.answer(back.next_of(Join))
    assert wait_for(lambda: agent.joined)
    assert agent.sent_on_online == {"update": 0, "join": 1} and not agent.server_offline
    back.finish()
    t.join(60)
    assert not t.is_alive() and box["summary"].finished
    assert len(_on_wire(hub, Kind.JOIN)) == 2  # the first, and the one sent on the online


def test_a_live_online_sends_an_unanswered_join_again_at_once() -> None:
    """An agent started before its server: its join went to no one. The server's online (live,
    once it subscribed) sends the join again at once, without the hold ever starting."""
    hub = MemoryBroker()
    agent = _agent(hub)
    agent.join_resend_s = 3600.0
    t, box = _start(agent)
    assert wait_for(lambda: len(_on_wire(hub, Kind.JOIN)) == 1)
    server = ScriptedServer(hub)
    server.say("online")
    server.answer(server.next_of(Join))
    assert wait_for(lambda: agent.joined)
    server.finish()
    t.join(60)
    assert not t.is_alive() and box["summary"].finished
    assert len(_on_wire(hub, Kind.JOIN)) == 2
    assert agent.sent_on_online == {"update": 0, "join": 1}
    assert agent.held_resends == {"update": 0, "join": 0}


def test_a_live_message_of_the_server_ends_the_hold() -> None:
    """A server back without saying online (its messages reach the broker before its last will,
    so one after the will is from a server that is back): its round_start of the round already
    trained ends the hold and is answered with the update, once."""
    hub, server, agent, t, box = _trained_then_server_gone()
    back = ScriptedServer(hub)
    back.channel.send(topics.down(FED, Kind.ROUND_START), RoundStart(selected=(CID,), deadline_s=600.0), round=1)
    item = back.next_of(Update)
    assert not agent.server_offline
    assert agent.sent_on_online == {"update": 0, "join": 0}
    back.answer(item)
    assert wait_for(lambda: agent.receipts_accepted == 1)
    back.finish()
    t.join(60)
    assert not t.is_alive() and box["summary"].finished
    assert len(_on_wire(hub, Kind.UPDATE)) == 2  # the first copy and the answer to the round_start


def test_an_update_of_a_round_the_server_has_not_opened_waits_for_its_round_start() -> None:
    """A resumed server says online having completed no round since its checkpoint and
    collecting none: the held update of round 1 is not sent at once (it would come before the
    round and go unanswered); the round_start of round 1 asks for it, and it goes once."""
    hub, server, agent, t, box = _trained_then_server_gone((0, 1))
    agent.receipt_timeout_s = 0.05
    assert wait_for(lambda: agent.held_resends["update"] == 3)
    agent.receipt_timeout_s = 3600.0
    resumed = ScriptedServer(hub)
    resumed.say("online", (0, 0))
    assert wait_for(lambda: not agent.server_offline)
    assert agent.sent_on_online == {"update": 0, "join": 0}
    assert len(_on_wire(hub, Kind.UPDATE)) == 1
    resumed.channel.send(topics.down(FED, Kind.ROUND_START), RoundStart(selected=(CID,), deadline_s=600.0), round=1)
    item = resumed.next_of(Update)
    resumed.answer(item)
    assert wait_for(lambda: agent.receipts_accepted == 1)
    resumed.finish()
    t.join(60)
    assert not t.is_alive() and box["summary"].finished
    assert len(_on_wire(hub, Kind.UPDATE)) == 2  # the first copy and the answer to the round_start
