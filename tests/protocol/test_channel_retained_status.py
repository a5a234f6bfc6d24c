"""With signing on, the broker's retained copy of a ``status`` a channel already accepted (handed
again to a renewed subscription: the server's presence after an agent's reconnect) is that
message again, not a replay to refuse; any other copy of a seen ``seq`` still is."""

from __future__ import annotations

from protocol import security as S
from protocol import topics
from protocol.channel import Channel, Received, Rejected
from protocol.memory_transport import MemoryBroker
from protocol.messages import Status
from protocol.transport_base import Incoming

FED = "f"
TOPIC = topics.server_status(FED)


def _signed_pair(hub: MemoryBroker) -> tuple[Channel, Channel, S.ChannelSecurity]:
    srv, dev = S.generate_identity("server"), S.generate_identity("dev-a")
    server = Channel(hub.connect("server"), node_id="server", side="server", federation=FED, ledger=None,
                     security=S.ChannelSecurity(srv, side="server", peers=S.AllowList(None, {"dev-a": dev.public}),
                                                epoch=1))
    agent_sec = S.ChannelSecurity(dev, side="agent", peers={"server": srv.public}, epoch=1)
    agent = Channel(hub.connect("dev-a"), node_id="dev-a", side="agent", federation=FED, ledger=None,
                    security=agent_sec)
    return server, agent, agent_sec


def test_a_retained_copy_of_the_accepted_status_is_taken_again_after_a_reconnect() -> None:
    hub = MemoryBroker()
    server, agent, sec = _signed_pair(hub)
    server.send(TOPIC, Status("online", "serving", 0, 0, 0), round=0, retain=True)
    agent.transport.subscribe(topics.agent_filters(FED, "dev-a"))
    first = agent.receive(0.0)
    assert isinstance(first, Received) and first.retain
    agent.transport.drop_link()  # renewed subscription: the same retained message again
    again = agent.receive(0.0)
    assert isinstance(again, Received) and again.retain and again.sha256 == first.sha256
    assert again.envelope == first.envelope and sec.rejections == {}


def test_a_live_copy_of_a_seen_status_is_still_refused_as_a_replay() -> None:
    hub = MemoryBroker()
    server, agent, sec = _signed_pair(hub)
    agent.transport.subscribe(topics.agent_filters(FED, "dev-a"))
    server.send(TOPIC, Status("online", "serving", 0, 0, 0), round=0, retain=True)
    got = agent.receive(0.0)
    assert isinstance(got, Received) and not got.retain
    payload = hub.published[-1].payload
    agent.transport.deliver(Incoming(TOPIC, payload, 1, False, 0.0))  # the same bytes, live
    assert isinstance(agent.receive(0.0), Rejected) and sec.rejections == {"replayed": 1}


def test_a_retained_status_other_than_the_last_accepted_one_goes_through_the_checks() -> None:
    """An older status of the server (a captured copy) delivered retained is not the last one
    accepted on the topic: refused as a replay."""
    hub = MemoryBroker()
    server, agent, sec = _signed_pair(hub)
    agent.transport.subscribe(topics.agent_filters(FED, "dev-a"))
    server.send(TOPIC, Status("online", "serving", 0, 0, 0), round=0, retain=True)
    old = hub.published[-1].payload
    server.send(TOPIC, Status("online", "reconnected", 2, 3, 0), round=0, retain=True)
    assert isinstance(agent.receive(0.0), Received) and isinstance(agent.receive(0.0), Received)
    agent.transport.deliver(Incoming(TOPIC, old, 1, True, 0.0))
    assert isinstance(agent.receive(0.0), Rejected) and sec.rejections == {"replayed": 1}
