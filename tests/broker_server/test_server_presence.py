"""The server's presence on ``down/status`` (retained): ``online`` once its subscriptions are
made (before it waits for joins) and again after each reconnect, its last will ``offline`` when
its link ends without DISCONNECT, ``offline`` when it is closed; over a memory broker, every
status counted on the wire (``hub.published``)."""

from __future__ import annotations

import numpy as np

from broker_server.round_state import RoundState
from broker_server.server import AggregationServer, ServerSettings, server_will
from broker_server.strategies import get_strategy
from edge_agent.data import ArraySplit
from edge_agent.models import build_model
from protocol import security as S
from protocol import topics
from protocol.channel import Channel
from protocol.memory_transport import MemoryBroker
from protocol.messages import SERVER_ID, Kind, Status, decode

FED = "mem"
TOPIC = topics.server_status(FED)


def _server(hub: MemoryBroker, tmp_path) -> AggregationServer:
    """A server whose connection carries its last will (as :func:`broker_server.runtime.make_server` opens it)."""
    return AggregationServer(
        channel=Channel(hub.connect("server", will=server_will(FED)), node_id="server", side="server",
                        federation=FED, ledger=None),
        strategy=get_strategy("fedavg"),
        model=build_model("lightcnn", in_channels=1, image_size=8, num_classes=10),
        test=ArraySplit(np.zeros((2, 1, 8, 8), np.float32), np.zeros(2, np.int64), 10),
        settings=ServerSettings(rounds=1), run_dir=tmp_path)


def _statuses(hub: MemoryBroker) -> list[tuple[int, str, str, bool]]:
    """(seq, state, detail, retain) of every PUBLISH on the server's status topic."""
    out = []
    for m in hub.published:
        if m.topic == TOPIC:
            env = decode(m.payload).envelope
            assert env.sender == SERVER_ID and env.round == 0 and isinstance(env.body, Status)
            out.append((env.seq, env.body.state, env.body.detail, m.retain))
    return out


def test_the_server_says_online_once_subscribed_and_it_stays_retained_for_later_agents(tmp_path) -> None:
    hub = MemoryBroker()
    server = _server(hub, tmp_path)
    assert _statuses(hub) == [(1, "online", "serving", True)]  # its first message
    assert hub.published[0].topic == TOPIC
    assert server.presence == "online"
    assert server.channel.transport.filters == dict.fromkeys(topics.server_filters(FED), 1)
    # an agent subscribing later gets it, retained, on its down/+ subscription
    late = hub.connect("dev-a")
    late.subscribe(topics.agent_filters(FED, "dev-a"))
    got = late.get(0.0)
    assert got is not None and got.topic == TOPIC and got.retain
    # where the rounds are: none completed, none collecting
    assert decode(got.payload).envelope.body == Status("online", "serving", global_round=0, start_round=0,
                                                       update_round=0)


def test_the_last_will_says_offline_live_and_retained_when_the_link_is_aborted(tmp_path) -> None:
    hub = MemoryBroker()
    server = _server(hub, tmp_path)
    agent = hub.connect("dev-a")
    agent.subscribe(topics.agent_filters(FED, "dev-a"))
    assert agent.get(0.0).retain  # the online, retained
    server.channel.transport.abort()  # the process dies: no DISCONNECT
    assert _statuses(hub) == [(1, "online", "serving", True), (0, "offline", "connection lost", True)]
    live = agent.get(0.0)
    assert live is not None and live.topic == TOPIC and not live.retain  # delivered live
    assert decode(live.payload).envelope.body == Status("offline", "connection lost")
    assert decode(hub.retained[TOPIC]).envelope.body == Status("offline", "connection lost")


def test_after_a_lost_link_the_server_says_online_again_and_offline_when_closed(tmp_path) -> None:
    hub = MemoryBroker()
    server = _server(hub, tmp_path)
    server.round, server.open = 2, RoundState(collecting=3)  # round 3 collects (its messages not kept here)
    server.channel.transport.drop_link()  # the broker publishes its will; the link comes back
    assert _statuses(hub)[-1] == (0, "offline", "connection lost", True)
    server.pump(0.0)  # the round loop says online again
    assert _statuses(hub) == [(1, "online", "serving", True), (0, "offline", "connection lost", True),
                              (2, "online", "reconnected", True)]
    assert decode(hub.retained[TOPIC]).envelope.body == Status("online", "reconnected", global_round=2, start_round=3,
                                                               update_round=0)
    server.pump(0.0)
    assert len(_statuses(hub)) == 3  # once per reconnect
    server.close("run finished")
    server.close()  # a second close says nothing more
    assert _statuses(hub)[3:] == [(3, "offline", "run finished", True)]
    assert decode(hub.retained[TOPIC]).envelope.body == Status("offline", "run finished")
    assert server.presence == "offline"


def test_a_broker_restart_loses_the_retained_status_and_the_reconnected_server_says_it_again(tmp_path) -> None:
    hub = MemoryBroker()
    server = _server(hub, tmp_path)
    hub.restart()  # no will (the broker died), retained messages lost
    assert TOPIC not in hub.retained
    server.pump(0.0)
    assert _statuses(hub) == [(1, "online", "serving", True), (2, "online", "reconnected", True)]
    assert decode(hub.retained[TOPIC]).envelope.body == Status("online", "reconnected", global_round=0, start_round=0,
                                                               update_round=0)


def test_a_server_closed_after_its_link_is_gone_publishes_nothing(tmp_path) -> None:
    hub = MemoryBroker()
    server = _server(hub, tmp_path)
    server.channel.transport.abort()  # the will said offline already
    server.close()
    assert [s[:2] for s in _statuses(hub)] == [(1, "online"), (0, "offline")]


def test_a_signing_servers_will_is_sealed_and_an_agent_takes_it_once() -> None:
    srv = S.generate_identity("server")
    sec = S.ChannelSecurity(srv, side="server", peers=S.AllowList(None), epoch=3)
    agent = S.ChannelSecurity(S.generate_identity("dev-a"), side="agent", peers={"server": srv.public}, epoch=1)
    will = server_will(FED, sec)
    assert (will.topic, will.qos, will.retain) == (TOPIC, 1, True)
    info = topics.parse(TOPIC)
    assert (info.direction, info.client_id, info.kind_label) == ("down", None, Kind.STATUS.label)
    opened = agent.open(TOPIC, info.client_id, info.direction, will.payload)
    env = decode(opened.payload).envelope
    assert (env.sender, env.seq, env.body) == (SERVER_ID, 0, Status("offline", "connection lost"))
    assert opened.sig_bytes > 0
