"""Proof that the byte ledger is exact on the wire: every MQTT connection of a federation is routed
through a byte-counting TCP relay on loopback (:class:`tools.counting_relay.CountingRelay`), and for each
connection the ledger's totals (all PUBLISH rows plus the control packets CONNECT, CONNACK,
SUBSCRIBE, SUBACK, PUBACK, PINGREQ, PINGRESP, DISCONNECT; each row's packet less its
``unsent_bytes``, the part a lost connection kept off the wire) must equal what the relay
counted, to the byte, in both directions."""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from pathlib import Path

import pytest
from helpers.federation import small_config

from broker_server.embedded_broker import EmbeddedBroker
from broker_server.simulate import simulate
from tools.counting_relay import CountingRelay


@pytest.mark.parametrize("kind", [pytest.param("mosquitto", marks=pytest.mark.mosquitto), "amqtt"])
def test_ledger_equals_bytes_on_the_wire(kind: str, tmp_path: Path) -> None:
    if kind == "mosquitto":
        from helpers.brokers import require_mosquitto

        require_mosquitto()
    with EmbeddedBroker(kind=kind, workdir=tmp_path / "broker") as broker:
        relay = CountingRelay(broker.port)
        try:
            res = simulate(small_config(broker={"keepalive_s": 5}), broker_url=f"mqtt://127.0.0.1:{relay.port}",
                           run_dir=tmp_path / "run")
        finally:
            relay.close()
    assert res.rounds_completed == 2
    db = sqlite3.connect(tmp_path / "run" / "ledger.sqlite")
    sums: dict[tuple[str, str], int] = defaultdict(int)
    kinds = set()
    for node, event, kind_, h, t, p, u in db.execute(
            "SELECT node, event, kind, mqtt_header_bytes, topic_bytes, payload_bytes, unsent_bytes FROM messages"):
        sums[(node, "out" if event == "sent" else "in")] += h + t + p - u
        kinds.add(kind_)
    db.close()
    assert {"CONNECT", "CONNACK", "SUBSCRIBE", "SUBACK", "PUBACK", "DISCONNECT"} <= kinds
    # per node over all its connections: against amqtt each client first tries MQTT 5 (refused,
    # then 3.1.1 on a second connection); both connections' packets are in the ledger
    wire = {(node, "out" if way == "up" else "in"): n for (node, way), n in relay.bytes_per_node().items()}
    for (node, way), n in sorted(wire.items()):
        assert sums[(node, way)] == n, f"{node}: {'client→broker' if way == 'out' else 'broker→client'} bytes"
    assert len(wire) == 8  # the server and three agents, both ways
