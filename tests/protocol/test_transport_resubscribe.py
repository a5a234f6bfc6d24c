"""A reconnect's connect listeners run only once the broker acknowledged the renewed
subscriptions (SUBACK), so what they publish (an agent's ``online``, which the server answers on
the agent's own topics) cannot reach the broker before the subscriptions are in place, however
the broker orders one client's SUBSCRIBE against its next PUBLISH.

Over a real broker through a counting relay: the reconnect's CONNECT goes through and its
SUBSCRIBE is held in the relay; the transport is connected, the listener has not run; once the
relay lets the SUBSCRIBE through, the listener runs, and at that moment the relay had already
carried the broker's SUBACK to the client."""

from __future__ import annotations

from pathlib import Path

from helpers.waiting import wait_for

from protocol.transport import MqttTransport
from tools.counting_relay import CountingRelay


def test_connect_listeners_of_a_reconnect_run_after_the_suback(embedded_broker, tmp_path: Path) -> None:
    relay = CountingRelay(embedded_broker.port)
    tr = MqttTransport("resub", "127.0.0.1", relay.port, mqtt_version="3.1.1", keepalive_s=30)
    calls: list[tuple[int, int]] = []  # (connection number, SUBACKs the relay carried on it by then)
    try:
        tr.connect(timeout_s=10.0)
        tr.subscribe(["t/resub/#"])
        first = relay.connections - 1
        assert wait_for(lambda: relay.packets(first, "down")["SUBACK"] == 1, 10.0)
        tr.add_connect_listener(lambda n: calls.append((n, relay.packets(relay.connections - 1, "down")["SUBACK"])))
        second = relay.connections
        relay.hold(second, after_bytes=1)  # its CONNECT goes through (sent alone before the CONNACK), then held
        tr.drop_link()
        assert wait_for(lambda: tr.connects == 2 and tr.connected, 20.0)
        assert relay.connections == second + 1
        assert relay.packets(second, "up")["SUBSCRIBE"] == 0  # held in the relay: no SUBACK can come
        assert calls == []
        relay.release(second)
        assert wait_for(lambda: calls, 10.0)
        assert calls == [(2, 1)]
    finally:
        tr.close()
        relay.close()
