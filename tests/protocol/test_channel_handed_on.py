"""``Channel.handed_on``: the transport connection a message's last copy went out on, which an
agent reads to tell whether its update reached the broker since its own link came back. A
QoS 1 PUBLISH the MQTT client held through a lost connection and sent again after the reconnect
went out on the connection the broker acknowledged it on, not the one it was first handed on."""

from __future__ import annotations

from helpers.stub_transport import StubTransport, update_of

from protocol.channel import Channel

TOPIC = "fedfleet/v1/fed/up/client-001/update"


class LinkTransport(StubTransport):
    """A transport whose connection count and state the test sets, and that reports outcomes
    only when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.connects, self.connected = 1, True
        self.handles: list[object] = []

    def publish(self, topic, payload, *, qos=1, retain=False, wait_s=None):
        handle = object()
        self.handles.append(handle)
        return handle


def test_a_copy_acknowledged_after_a_reconnect_went_out_on_that_connection() -> None:
    tr = LinkTransport()
    ch = Channel(tr, node_id="client-001", side="agent", federation="fed", ledger=None)
    held = ch.send(TOPIC, update_of(4), round=1).seq  # handed on connection 1 …
    acked_before = ch.send(TOPIC, update_of(4), round=1).seq
    tr.listener(tr.handles[1], "acked", "")  # … this one acknowledged there
    assert (ch.handed_on(held), ch.handed_on(acked_before)) == (1, 1)
    tr.connects = 2  # the link broke and came back: the client sent the held one again
    tr.listener(tr.handles[0], "acked", "")
    assert (ch.handed_on(held), ch.handed_on(acked_before)) == (2, 1)
    assert not ch.in_flight(held)


def test_a_message_handed_while_the_link_is_down_goes_out_on_the_next_connection() -> None:
    tr = LinkTransport()
    ch = Channel(tr, node_id="client-001", side="agent", federation="fed", ledger=None)
    tr.connected = False
    seq = ch.send(TOPIC, update_of(4), round=1).seq
    assert ch.handed_on(seq) == 2 and ch.in_flight(seq)
    tr.connects, tr.connected = 2, True
    tr.listener(tr.handles[0], "acked", "")
    assert ch.handed_on(seq) == 2 and not ch.in_flight(seq)
