"""protocol.memory_transport: MQTT 3.1.1 topic matching, retained messages, QoS, last wills, and a
Channel pair talking through it.

Every expected match is read off MQTT 3.1.1 §4.7 (its own examples where it gives them), not off
the code under test."""

from __future__ import annotations

import numpy as np
import pytest

from protocol import topics
from protocol.channel import Channel, Received
from protocol.errors import TransportError
from protocol.memory_transport import MemoryBroker, check_filter, topic_matches
from protocol.messages import Kind, Update
from protocol.transport_base import LinkLost, Will

# (filter, topic, matches): MQTT 3.1.1 §4.7.1.2, §4.7.1.3 and §4.7.2 examples, and fedfleet's filters
CASES = [
    ("sport/tennis/player1/#", "sport/tennis/player1", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
    ("sport/#", "sport", True),
    ("#", "sport/tennis", True),
    ("#", "/", True),
    ("sport/tennis/+", "sport/tennis/player1", True),
    ("sport/tennis/+", "sport/tennis/player1/ranking", False),
    ("sport/+", "sport", False),
    ("sport/+", "sport/", True),
    ("+/+", "/finance", True),
    ("/+", "/finance", True),
    ("+", "/finance", False),
    ("+/monitor/Clients", "$SYS/monitor/Clients", False),
    ("#", "$SYS/broker", False),
    ("$SYS/#", "$SYS/broker", True),
    ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
    ("sport/tennis", "sport/Tennis", False),
    ("fedfleet/v1/f/up/+/+", "fedfleet/v1/f/up/pi-1/update", True),
    ("fedfleet/v1/f/up/+/+", "fedfleet/v1/f/up/pi-1", False),
    ("fedfleet/v1/f/down/+", "fedfleet/v1/f/down/pi-1/receipt", False),
    ("fedfleet/v1/f/down/pi-1/+", "fedfleet/v1/f/down/pi-1/receipt", True),
    ("fedfleet/v1/f/down/pi-1/+", "fedfleet/v1/f/down/pi-2/receipt", False),
]


@pytest.mark.parametrize(("flt", "topic", "want"), CASES)
def test_topic_filters_match_as_mqtt_specifies(flt: str, topic: str, want: bool) -> None:
    assert topic_matches(flt, topic) is want


@pytest.mark.parametrize("bad", ["", "sport/tennis#", "sport/#/ranking", "sport+", "a/b+/c", "a\x00b"])
def test_invalid_filters_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        check_filter(bad)


def test_publishing_to_a_wildcard_topic_is_refused() -> None:
    client = MemoryBroker().connect("c")
    for bad in ("a/+", "a/#", ""):
        with pytest.raises(ValueError):
            client.publish(bad, b"x")


def test_delivery_to_matching_subscribers_only_once_each_at_the_granted_qos() -> None:
    broker = MemoryBroker()
    a, b, c = broker.connect("a"), broker.connect("b"), broker.connect("c")
    a.subscribe(["x/+", "x/#"], qos=1)  # overlapping: one copy at the highest granted QoS (1)
    b.subscribe(["x/y"], qos=0)
    c.subscribe(["z/#"])
    c.publish("x/y", b"hello", qos=1)
    got_a, got_b = a.get(0), b.get(0)
    assert (got_a.topic, got_a.payload, got_a.qos, got_a.retain) == ("x/y", b"hello", 1, False)
    assert (got_b.payload, got_b.qos) == (b"hello", 0)  # min(PUBLISH 1, subscription 0)
    assert a.get(0) is None and b.get(0) is None and c.get(0) is None  # c's filter does not match
    assert (c.sent, c.sent_count, c.sent_bytes) == ([("x/y", b"hello")], 1, 5)


def test_a_dropped_delivery_reaches_no_one_it_names_and_is_recorded() -> None:
    """``drop_deliveries``: the broker takes the PUBLISH (published, retained) and drops it for the
    subscribers the rule names only; a retained copy handed to a new subscription is not dropped;
    ``None`` ends the dropping."""
    broker = MemoryBroker()
    a, b = broker.connect("a"), broker.connect("b")
    for c in (a, b):
        c.subscribe(["x/#"])
    broker.drop_deliveries(lambda client, m: client == "a" and m.topic == "x/start")
    b.publish("x/start", b"go", retain=True)
    b.publish("x/other", b"hi")
    assert [i.topic for i in iter(lambda: a.get(0), None)] == ["x/other"]
    assert [i.topic for i in iter(lambda: b.get(0), None)] == ["x/start", "x/other"]
    assert [(cid, m.sender, m.topic, m.payload) for cid, m in broker.dropped] == [("a", "b", "x/start", b"go")]
    assert [m.topic for m in broker.published] == ["x/start", "x/other"]
    late = broker.connect("a2")
    broker.drop_deliveries(lambda client, m: True)
    late.subscribe(["x/#"])  # the retained copy: never dropped
    assert late.get(0).payload == b"go"
    broker.drop_deliveries(None)
    b.publish("x/start", b"again")
    assert a.get(0).payload == b"again" and len(broker.dropped) == 1


def test_retained_message_reaches_later_subscribers_and_empty_payload_clears_it() -> None:
    broker = MemoryBroker()
    pub = broker.connect("pub")
    pub.publish("s/dev1", b"online", retain=True)
    pub.publish("s/dev1", b"busy", retain=True)  # replaces the first
    pub.publish("s/dev2", b"idle", retain=False)  # not kept
    late = broker.connect("late")
    late.subscribe(["s/+"])
    inc = late.get(0)
    assert (inc.topic, inc.payload, inc.retain) == ("s/dev1", b"busy", True)
    assert late.get(0) is None
    assert broker.retained == {"s/dev1": b"busy"}
    pub.publish("s/dev1", b"", retain=True)  # live subscribers still get it, with retain = 0
    inc = late.get(0)
    assert (inc.payload, inc.retain) == (b"", False)
    assert broker.retained == {}
    later = broker.connect("later")
    later.subscribe(["s/#"])
    assert later.get(0) is None


def test_abort_publishes_the_will_close_does_not() -> None:
    broker = MemoryBroker()
    watcher = broker.connect("w")
    watcher.subscribe(["status/+"])
    polite = broker.connect("p", will=Will("status/p", b"offline"))
    polite.close()
    assert watcher.get(0) is None
    gone = broker.connect("g", will=Will("status/g", b"offline"))
    gone.abort()
    inc = watcher.get(0)
    assert (inc.topic, inc.payload) == ("status/g", b"offline")
    assert broker.retained == {"status/g": b"offline"}  # Will retains by default, as in transport.Will
    with pytest.raises(TransportError):
        gone.publish("status/g", b"back")
    assert broker.clients == ["w"]


def test_drop_link_renews_subscriptions_and_calls_connect_listeners() -> None:
    broker = MemoryBroker()
    a = broker.connect("a", will=Will("status/a", b"offline", retain=False))
    seen: list[int] = []
    a.add_connect_listener(seen.append)
    a.subscribe(["cfg"])
    watcher = broker.connect("w")
    watcher.subscribe(["status/#"])
    broker.connect("admin").publish("cfg", b"v1", retain=True)
    assert a.get(0).retain is False  # a live delivery
    a.drop_link()
    assert (a.connects, seen) == (2, [2])
    assert watcher.get(0).payload == b"offline"
    again = a.get(0)  # re-subscribed: the retained message comes again, flagged retained
    assert (again.payload, again.retain) == (b"v1", True)


def test_drop_link_tells_the_disconnect_listeners_before_the_will_and_the_reconnect() -> None:
    """Each ``drop_link`` tells the disconnect listeners which connection was lost (1, then 2),
    why, and that no message awaits acknowledgement (delivery is immediate), before the broker
    publishes the will (none of this drop's wills is out yet) and before the connect listeners
    hear of the next connection; ``close`` and ``abort`` tell them nothing."""
    broker = MemoryBroker()
    a = broker.connect("a", will=Will("status/a", b"offline", retain=False))
    events: list[object] = []
    a.add_disconnect_listener(lambda lost: events.append(
        (lost, sum(p.topic == "status/a" for p in broker.published))))
    a.add_connect_listener(events.append)
    a.drop_link()
    a.drop_link()
    reason = "link dropped (MemoryTransport.drop_link)"
    assert events == [(LinkLost(1, reason, False, 0, 0), 0), 2, (LinkLost(2, reason, False, 0, 0), 1), 3]
    a.close()
    b = broker.connect("b", will=Will("status/b", b"offline"))
    b.add_disconnect_listener(events.append)
    b.abort()
    assert len(events) == 4


def test_takeover_disconnects_the_older_client_with_the_same_id() -> None:
    broker = MemoryBroker()
    old = broker.connect("dev")
    new = broker.connect("dev")
    assert not old.connected and new.connected
    with pytest.raises(TransportError):
        old.publish("t", b"x")


def test_on_idle_supplies_one_message_at_a_time() -> None:
    broker = MemoryBroker()
    device = broker.connect("dev")
    queue = [b"1", b"2"]
    server = broker.connect("srv", on_idle=lambda: queue and device.publish("t", queue.pop(0)))
    server.subscribe(["t"])
    assert [server.get(0).payload, server.get(0).payload, server.get(0)] == [b"1", b"2", None]


def test_get_waits_for_a_message_from_another_thread() -> None:
    import threading

    broker = MemoryBroker()
    rx, tx = broker.connect("rx"), broker.connect("tx")
    rx.subscribe(["t"])
    threading.Timer(0.05, lambda: tx.publish("t", b"late")).start()
    assert rx.get(10.0).payload == b"late"


def test_two_channels_exchange_a_chunked_update_through_the_broker() -> None:
    """A 1.2 MB update in 256 KiB chunks crosses the memory broker whole, byte for byte."""
    broker = MemoryBroker()
    fed = "mem"
    agent_tr, server_tr = broker.connect("client-1"), broker.connect("server")
    server_tr.subscribe(topics.server_filters(fed))
    agent_tr.subscribe(topics.agent_filters(fed, "client-1"))
    agent = Channel(agent_tr, node_id="client-1", side="agent", federation=fed, ledger=None, chunk_bytes=256 * 1024)
    server = Channel(server_tr, node_id="server", side="server", federation=fed, ledger=None)
    x = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    agent.send(topics.up(fed, "client-1", Kind.UPDATE), Update((x,), 10, 0.5), round=1)
    assert agent_tr.sent_count == 5  # ceil(1.2 MB / 256 KiB) chunks
    got = [server.receive(0.0) for _ in range(5)]
    whole = [g for g in got if isinstance(g, Received)]
    assert len(whole) == 1
    np.testing.assert_array_equal(whole[0].envelope.body.tensors[0], x)


def test_a_taken_over_client_cannot_drop_the_link_of_the_connection_that_replaced_it() -> None:
    """After a second connection took the id over, a link event of the old one is refused and
    the new one keeps receiving (before, the old one re-registered itself, disconnected, and
    every message to that id was delivered to no one)."""
    broker = MemoryBroker()
    old = broker.connect("dev")
    old.subscribe(["t/#"], qos=1)
    new = broker.connect("dev")
    new.subscribe(["t/#"], qos=1)
    with pytest.raises(TransportError, match="taken over"):
        old.drop_link()
    broker.connect("pub").publish("t/x", b"hi")
    got = new.get(0.0)
    assert got is not None and got.payload == b"hi"
    assert old.get(0.0) is None and broker.clients == ["dev", "pub"]


def test_restart_breaks_every_link_without_wills_loses_retained_and_reconnects_in_order() -> None:
    """A broker restart (no persistence): no last will is published, the retained messages are
    gone, and the clients come back in the order given, each renewing its subscriptions and
    calling its connect listeners; a message published before a client is back misses it."""
    broker = MemoryBroker()
    seen: list[tuple[str, int]] = []
    a = broker.connect("a", will=Will("status/a", b"offline"))
    b = broker.connect("b", will=Will("status/b", b"offline"))
    for t in (a, b):
        t.subscribe(["status/#", "news"])
        t.add_connect_listener(lambda n, cid=t.client_id: seen.append((cid, n)))
    a.publish("status/a", b"online", retain=True)
    for t in (a, b):
        assert t.get(0).payload == b"online" and t.get(0) is None

    def b_back(n: int) -> None:  # b's listener runs when b is back: a is not yet
        assert not a.connected
        b.publish("news", b"b is back")

    b.add_connect_listener(b_back)
    broker.restart(["b", "a"])
    assert seen == [("b", 2), ("a", 2)] and a.connects == b.connects == 2
    assert broker.retained == {}  # lost with the broker; no will took its place
    assert b.get(0).payload == b"b is back" and b.get(0) is None
    assert a.get(0) is None  # published before a was back
    with pytest.raises(ValueError, match="order"):
        broker.restart(["a"])
    assert a.connected and b.connected


def test_restart_tells_every_clients_disconnect_listeners_before_any_is_back() -> None:
    """Both links are lost at once (connection 1 of each, the restart's reason), before either
    client's connect listeners hear of connection 2; a refused order tells no one."""
    broker = MemoryBroker()
    a, b = broker.connect("a"), broker.connect("b")
    events: list[object] = []
    for t in (a, b):
        t.add_disconnect_listener(lambda lost, cid=t.client_id: events.append((cid, lost)))
        t.add_connect_listener(lambda n, cid=t.client_id: events.append((cid, n)))
    with pytest.raises(ValueError, match="order"):
        broker.restart(["b"])
    assert events == []
    broker.restart(["b", "a"])
    lost = LinkLost(1, "broker restarted (MemoryBroker.restart)", False, 0, 0)
    assert events == [("a", lost), ("b", lost), ("b", 2), ("a", 2)]
