"""Size limits of the broker and of the devices, over real brokers with their own
configs: every federation must finish with every update counted, the ledger must say which
PUBLISH the broker acknowledged and which it refused (with the limit in the reason), the ledger's
PUBLISH rows must match what a relay counted on the wire, and no oversize packet may be re-sent
whole after every reconnect (the loop of the issue: 178 reconnects)."""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from helpers.brokers import require_mosquitto
from helpers.federation import read_metrics
from helpers.size_limits import run_size_limit, tiny_profile
from helpers.waiting import subscribed

from broker_server.embedded_broker import EmbeddedBroker
from protocol import topics
from protocol.channel import Channel, Received
from protocol.errors import PublishRefused
from protocol.ledger import Ledger
from protocol.messages import Kind, Resend, Update
from protocol.mqtt_bytes import publish_size
from protocol.transport import ACK_CLOSE_S, OVERSIZE_STRIKES, MqttTransport

#: the digits model's global and updates are ~55 KB: a 20,000-byte limit forces 3+ chunks
LIMIT = 20_000


def _check_finished(out, rounds: int = 2) -> None:
    assert out.error == ""
    assert out.rounds == rounds
    assert out.reported == [3] * rounds  # every agent's update counted in every round
    assert out.agent_errors == 0
    assert out.reached_none == []


def _check_wire(out, *, exact: bool = True) -> None:
    # every PUBLISH a node put on the wire (first transmissions and DUP retransmissions) is a ledger row;
    # on links the broker cut (exact=False) the ledger also holds PUBLISHes handed to paho that never
    # reached the socket (withdrawn as oversize before paho re-sent them): more rows, never fewer
    assert set(out.wire_publish) == {"server", "client-000", "client-001", "client-002"}
    for node, n in out.wire_publish.items():
        if exact:
            assert out.ledger_publish.get(node, 0) == n, f"{node}: ledger PUBLISH rows vs relay"
        else:
            assert out.ledger_publish.get(node, 0) >= n, f"{node}: a PUBLISH on the wire has no ledger row"


@pytest.mark.mosquitto
@pytest.mark.parametrize("option", ["max_packet_size", "message_size_limit"])
def test_mqtt5_broker_limit_is_read_from_connack_or_puback(option: str, tmp_path: Path) -> None:
    require_mosquitto()
    out = run_size_limit(tmp_path, broker_lines=(f"{option} {LIMIT}",))
    _check_finished(out)
    # Mosquitto 2.0.11 closes the connection after some PUBACK 0x95 refusals ("bad socket read/write")
    _check_wire(out, exact=option == "max_packet_size")
    if option == "max_packet_size":  # announced in CONNACK: chunked below it from the start
        assert out.refusal_reasons == []
        assert out.deliveries.get(("server", "refused"), 0) == out.deliveries.get(("agent", "refused"), 0) == 0
    else:  # not announced: the first global and updates are refused by PUBACK 0x95, then chunked
        assert out.deliveries[("server", "refused")] >= 1 and out.deliveries[("agent", "refused")] >= 3
        assert all("0x95" in r for r in out.refusal_reasons if r.startswith("PUBACK"))
    if option == "max_packet_size":
        assert out.deliveries.get(("server", "handed"), 0) == out.deliveries.get(("agent", "handed"), 0) == 0
        assert out.dup_publish == {}  # nothing was re-sent by paho after a reconnect


@pytest.mark.mosquitto
def test_mqtt311_broker_that_disconnects_is_detected_not_looped(tmp_path: Path) -> None:
    require_mosquitto()
    out = run_size_limit(tmp_path, broker_lines=(f"max_packet_size {LIMIT}",), mqtt_version="3.1.1")
    _check_finished(out)
    _check_wire(out, exact=False)
    assert out.deliveries[("server", "refused")] >= 1 and out.deliveries[("agent", "refused")] >= 3
    assert any("maximum packet size" in r for r in out.refusal_reasons)
    # each refused packet went on the wire at most OVERSIZE_STRIKES times (the first send + DUPs)
    for node, dups in out.dup_publish.items():
        refused = out.deliveries.get(("server" if node == "server" else "agent", "refused"), 0)
        assert dups <= (OVERSIZE_STRIKES - 1) * refused + 40, node  # + chunks in flight re-sent with them
    assert max(out.connects.values()) <= 12  # reconnects bounded (today: one per second for ever)


@pytest.mark.mosquitto
def test_mqtt311_declared_limit_needs_no_refusal(tmp_path: Path) -> None:
    require_mosquitto()
    out = run_size_limit(tmp_path, broker_lines=(f"max_packet_size {LIMIT}",), mqtt_version="3.1.1", declared=LIMIT)
    _check_finished(out)
    _check_wire(out)
    assert out.refusal_reasons == [] and out.dup_publish == {}
    assert set(out.connects.values()) == {1}


@pytest.mark.parametrize("kind", [pytest.param("mosquitto", marks=pytest.mark.mosquitto), "amqtt"])
def test_device_limit_announced_in_join_sizes_every_download(kind: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    if kind == "mosquitto":  # MQTT 5: the devices advertise 20,000 B; Mosquitto drops bigger packets silently
        require_mosquitto()
    from edge_agent.profiles import SHIPPED_DIR

    name = tiny_profile(tmp_path / "profiles", max_packet_bytes=LIMIT)
    monkeypatch.setenv("FEDFLEET_PROFILES", f"{tmp_path / 'profiles'}:{SHIPPED_DIR}")
    out = run_size_limit(tmp_path, kind=kind, profile=name)
    _check_finished(out)
    _check_wire(out)
    assert out.refusal_reasons == []
    agents = {n: v for n, v in out.max_down.items() if n != "server"}
    assert len(agents) == 3 and 0 < max(agents.values()) <= LIMIT  # every download fit the devices' limit


# --------------------------------------------------------------------------------------------
# MQTT 3.1.1 and Mosquitto's message_size_limit (a limit on the PUBLISH payload, bytes): the broker
# answers an oversize PUBLISH with an ordinary PUBACK and drops it. Mosquitto 2.0.11 then closes
# the connection when max_queued_messages is 0 (the embedded broker's configuration), and keeps it
# with its default of 1000: nothing then tells the sender, only the missing receipt.

MSL = (f"message_size_limit {LIMIT}",)
MSL_SILENT = (*MSL, "max_queued_messages 1000")


def _transport(broker: EmbeddedBroker, name: str):
    tr = MqttTransport(f"{name}-{time.time_ns()}", broker.host, broker.port, mqtt_version="3.1.1", keepalive_s=5)
    outcomes: list[tuple[object, str, str]] = []
    tr.set_delivery_listener(lambda h, o, r: outcomes.append((h, o, r)))
    tr.connect()
    return tr, outcomes


def _wait(cond, bound_s: float = 20.0) -> bool:
    end = time.monotonic() + bound_s
    while time.monotonic() < end and not cond():
        time.sleep(0.02)
    return cond()


@pytest.mark.mosquitto
def test_mqtt311_puback_then_close_is_a_refusal_of_that_publish(tmp_path: Path) -> None:
    require_mosquitto()
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "b", extra_config=MSL) as broker:
        tr, outcomes = _transport(broker, "ack-close")
        try:
            small = tr.publish("t/a", b"x" * 1_000, qos=1)
            assert _wait(lambda: len(outcomes) == 1) and outcomes[0][:2] == (small, "acked")
            big_payload = 30_000  # above the 20,000-byte limit
            packet = publish_size("t/b", big_payload, 1, protocol=4).packet_bytes  # 2+3 fixed, 2+3 topic, 2 id
            assert packet == 1 + 3 + 2 + 3 + 2 + big_payload
            big = tr.publish("t/b", b"y" * big_payload, qos=1)
            # Mosquitto acknowledges it, then closes the connection: reported acked, then refused
            assert _wait(lambda: len(outcomes) == 3), outcomes
            assert [o[:2] for o in outcomes[1:]] == [(big, "acked"), (big, "refused")]
            assert f"{packet:,}-byte PUBLISH" in outcomes[2][2] and "message_size_limit" in outcomes[2][2]
            assert tr.inferred_max_packet_bytes == packet // 2 and tr.ack_close_refusals == 1
            assert _wait(lambda: tr.connected and tr.connects == 2)
            assert tr.closed_for_refusal
            # above the inferred limit: refused before it is sent (no second close)
            with pytest.raises(PublishRefused, match=f"at most {packet // 2:,} bytes"):
                tr.publish("t/c", b"z" * (packet // 2), qos=1)
            tr.publish("t/d", b"w" * 10_000, qos=1, wait_s=10)
            # the 1,000-byte one was kept (a packet came after its PUBACK), the oversize one never
            assert tr.connects == 2 and 1 + 2 + 2 + 3 + 2 + 1_000 <= tr.kept_packet_bytes < packet
        finally:
            tr.close()


@pytest.mark.mosquitto
def test_a_slow_delivery_listener_does_not_hide_the_close_after_the_puback(tmp_path: Path) -> None:
    """The listener takes 3 x ACK_CLOSE_S over the oversize PUBLISH's ``acked`` (a ledger write
    waiting on SQLite's lock, a loaded machine): the close that came right after the PUBACK is
    still that PUBLISH's refusal, because the window starts when the network thread is free."""
    require_mosquitto()
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "b", extra_config=MSL) as broker:
        tr = MqttTransport(f"slow-listener-{time.time_ns()}", broker.host, broker.port, mqtt_version="3.1.1",
                           keepalive_s=5)
        outcomes: list[tuple[object, str, str]] = []

        def slow(handle: object, outcome: str, reason: str) -> None:
            outcomes.append((handle, outcome, reason))
            if outcome == "acked" and len(outcomes) == 1:
                time.sleep(3 * ACK_CLOSE_S)

        tr.set_delivery_listener(slow)
        tr.connect()
        try:
            big = tr.publish("t/b", b"y" * 30_000, qos=1)  # above the 20,000-byte limit
            assert _wait(lambda: len(outcomes) == 2), outcomes
            assert [o[:2] for o in outcomes] == [(big, "acked"), (big, "refused")]
            assert tr.ack_close_refusals == 1
        finally:
            tr.close()


@pytest.mark.mosquitto
def test_mqtt311_puback_without_close_says_nothing_to_the_transport(tmp_path: Path) -> None:
    """With Mosquitto's default max_queued_messages the oversize PUBLISH is acknowledged and
    dropped, the connection kept: the transport cannot tell (only a missing receipt can)."""
    require_mosquitto()
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "b", extra_config=MSL_SILENT) as broker:
        tr, outcomes = _transport(broker, "ack-drop")
        try:
            tr.publish("t/b", b"y" * 30_000, qos=1, wait_s=10)
            tr.publish("t/a", b"x" * 100, qos=1, wait_s=10)  # a packet after it: the broker kept the link
            assert [o[1] for o in outcomes] == ["acked", "acked"]
            assert tr.connects == 1 and tr.inferred_max_packet_bytes == 0
            assert tr.kept_packet_bytes == publish_size("t/b", 30_000, 1, protocol=4).packet_bytes
        finally:
            tr.close()


@pytest.mark.mosquitto
def test_resend_request_for_chunks_above_a_limit_learnt_since_is_not_raised(tmp_path: Path) -> None:
    """The agent failure of the message_size_limit benchmark: the server asked for chunks of a
    transfer cut before the agent's transport learnt the limit; publishing them raised
    PublishRefused out of Channel.receive and ended the agent. Now the message is sent again
    below the limit (the server, which has it already, ignores the copy as superseded)."""
    require_mosquitto()
    fed = "fed-msl"
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "b", extra_config=MSL) as broker:
        a_tr, _ = _transport(broker, "agent")
        s_tr, _ = _transport(broker, "server")
        ledger = Ledger(tmp_path / "agent.sqlite")
        agent = Channel(a_tr, node_id="client-001", side="agent", federation=fed, ledger=ledger)
        server = Channel(s_tr, node_id="server", side="server", federation=fed, ledger=None)
        s_tr.subscribe(topics.server_filters(fed))
        a_tr.subscribe(topics.agent_filters(fed, "client-001"))
        try:
            # probes outside the fedfleet/ tree: their markers come back once the filters above are in place
            subscribed(s_tr, "t/probe-s")
            subscribed(a_tr, "t/probe-a")
            update_topic = topics.up(fed, "client-001", Kind.UPDATE)
            upd = Update(tensors=(np.arange(11_000, dtype=np.float32),), num_samples=7, train_loss=0.5)
            # chunks of packets of at most 16,000 bytes: under the broker's 20,000-byte payload limit
            enc = agent.send(update_topic, upd, round=1, max_packet_bytes=16_000)
            first = server.receive(30.0)
            assert isinstance(first, Received) and first.envelope.seq == enc.seq
            ledger.flush()
            (logical,) = ledger.rows("event = 'message' AND kind = 'update'")
            tid, chunks = bytes.fromhex(logical.transfer_id), logical.chunk_count
            assert chunks == 3  # 44,0xx bytes in slices of under 16,000
            # a 30,0xx-byte update: acknowledged, then the broker closes the agent's link; the agent's
            # transport now takes the limit for 15,0xx bytes, below the cached chunks' 16,000
            agent.send(update_topic, Update(tensors=(np.arange(7_500, dtype=np.float32),), num_samples=7,
                                            train_loss=0.5), round=2)
            assert _wait(lambda: a_tr.ack_close_refusals == 1 and a_tr.connected)
            # never below a packet the broker acknowledged and kept the connection for (the chunks):
            # half of the 30,0xx bytes is less, so the largest chunk's size is the limit inferred
            assert a_tr.inferred_max_packet_bytes == a_tr.kept_packet_bytes > 30_000 // 2
            # a limit below the cached chunks, as a broker restarted with a smaller one would announce
            # (its MQTT 5 CONNACK): the chunks were cut before the agent's transport knew it
            a_tr.inferred_max_packet_bytes = 15_000
            # the reconnect's CONNACK handler renewed the agent's SUBSCRIBEs before ``connected`` turned
            # true; a broker takes one connection's SUBSCRIBEs in order: this marker back, they are active
            subscribed(a_tr, "t/probe-a2")
            server.send(topics.down_to(fed, "client-001", Kind.RESEND), Resend(tid, tuple(range(chunks))), round=0,
                        recipient="client-001")
            end = time.monotonic() + 20
            while time.monotonic() < end and server.reassembler.superseded == 0:
                agent.receive(0.1)  # raised PublishRefused before
                server.receive(0.1)
            # the round-1 update went again as a new transfer below the limit; the server had it: ignored
            assert server.reassembler.superseded == 1
            assert agent.resent_after_refusal == 2  # the 30,0xx-byte update, then the round-1 one
            ledger.flush()
            again = ledger.rows(f"event = 'message' AND kind = 'update' AND round = 1 AND seq = {enc.seq}")
            assert len(again) == 2 and again[1].transfer_id != logical.transfer_id
            resent = ledger.rows(f"event = 'sent' AND transfer_id = '{again[1].transfer_id}'")
            assert len(resent) == again[1].chunk_count and all(
                r.mqtt_header_bytes + r.topic_bytes + r.payload_bytes <= a_tr.inferred_max_packet_bytes for r in resent)
        finally:
            agent.close()
            server.close()


@dataclass
class _Attempt:
    """One way a message went out: a whole PUBLISH, a chunked transfer (its chunks), or a refusal
    before anything was sent (no packets)."""

    packets: list[int] = field(default_factory=list)  # PUBLISH packet bytes (header + topic + payload)
    payloads: list[int] = field(default_factory=list)
    deliveries: list[str] = field(default_factory=list)
    total: int = 0  # the message's payload bytes (a transfer's logical row)
    chunk_data: int = 0  # data bytes of chunk 0 (the slice length)
    chunk_count: int = 0


def _messages(db: sqlite3.Connection, node: str, kind: str, rnd: int) -> dict[int, list[_Attempt]]:
    """``node``'s ``kind`` messages of round ``rnd`` from its ledger rows: envelope seq -> its attempts in order."""
    out: dict[int, list[_Attempt]] = {}
    transfers: dict[str, _Attempt] = {}
    for event, seq, tid, packet, payload, body, delivery, index, count in db.execute(
            "SELECT event, seq, transfer_id, mqtt_header_bytes + topic_bytes + payload_bytes, payload_bytes, "
            "body_bytes, delivery, chunk_index, chunk_count FROM messages WHERE node = ? AND kind = ? AND round = ? "
            "AND event IN ('sent', 'message') ORDER BY id", (node, kind, rnd)):
        if event == "message" and index is not None:  # a chunk refused before it was sent
            transfers[tid].deliveries.append(delivery)
        elif event == "message":  # a transfer begins, or a refusal before sending
            att = _Attempt(total=payload, chunk_count=count or 0)
            if tid is None:
                att.deliveries.append(delivery)
            else:
                transfers[tid] = att
            out.setdefault(seq, []).append(att)
        elif tid is None:
            out.setdefault(seq, []).append(_Attempt([packet], [payload], [delivery], total=payload))
        else:
            att = transfers[tid]
            att.packets.append(packet)
            att.payloads.append(payload)
            att.deliveries.append(delivery)
            if index == 0:
                att.chunk_data = body
    return out


def _received_max(db: sqlite3.Connection, node: str) -> tuple[int, int]:
    """(packet, payload) bytes of the largest PUBLISH the broker delivered to ``node``."""
    return db.execute("SELECT max(mqtt_header_bytes + topic_bytes + payload_bytes), max(payload_bytes) FROM messages "
                      "WHERE node = ? AND event = 'received'", (node,)).fetchone()


def _check_relay(out, db: sqlite3.Connection) -> None:
    """Every PUBLISH on the wire has its ledger row; a row beyond the relay's count is one the
    transport withdrew before paho wrote it (a refused row)."""
    for node, n in out.wire_publish.items():
        (refused,) = db.execute("SELECT COUNT(*) FROM messages WHERE node = ? AND event = 'sent' AND "
                                "delivery = 'refused'", (node,)).fetchone()
        assert n <= out.ledger_publish.get(node, 0) <= n + refused, node


#: each case's codecs: fp32 globals and updates are ~55 KB (above the 20,000-byte limit), int8 ~14 KB
CASES = {"global": {"update_codec": "int8"}, "update": {"global_codec": "int8"}, "both": {}}
SENDS = {"server": "global", "client-000": "update", "client-001": "update", "client-002": "update"}


@pytest.mark.mosquitto
class TestMqtt311MessageSizeLimit:
    """A federation over MQTT 3.1.1 and Mosquitto with ``message_size_limit`` 20,000 (not declared
    to fedfleet): a global above the limit, the updates above it, or both."""

    @pytest.mark.parametrize("case", list(CASES))
    def test_broker_that_closes_after_the_puback(self, case: str, tmp_path: Path) -> None:
        """Each oversize message costs a close of its sender's link: taken for a refusal, sent
        again in packets of half the refused size (the server: 55 KB, 27.5 KB, then 13.7 KB pass) or
        of the largest the broker delivered (an agent: the global's), and every later message of
        that sender is sized under what passed (round 2: nothing refused, nothing waited for)."""
        require_mosquitto()
        out = run_size_limit(tmp_path, broker_lines=MSL, mqtt_version="3.1.1", protocol=CASES[case])
        _check_finished(out)
        db = sqlite3.connect(tmp_path / "run" / "ledger.sqlite")
        _check_relay(out, db)
        assert db.execute("SELECT COUNT(*) FROM messages WHERE event = 'rejected'").fetchone() == (0,)
        m = read_metrics(tmp_path / "run")
        refusals = 0
        for node, kind in SENDS.items():
            above = case in ("both", "global" if node == "server" else "update")
            first_seq, *later = sorted(_messages(db, node, kind, 1))
            attempts = _messages(db, node, kind, 1)[first_seq]
            p0, whole = attempts[0].packets[0], attempts[0].payloads[0]
            assert (whole > LIMIT) == above, (node, whole)
            if above:
                # by hand: the server halves (p0 / 2 is still above the limit, p0 / 4 below: 3 tries);
                # an agent goes straight to the largest packet the broker delivered to it (2 tries)
                tries = 1 + math.ceil(math.log2(p0 / LIMIT)) if node == "server" else 2
                assert len(attempts) == tries, (node, [max(a.packets, default=0) for a in attempts])
                for a in attempts[:-1]:
                    assert "refused" in a.deliveries and max(a.payloads) > LIMIT
                last = attempts[-1]
                assert set(last.deliveries) == {"acked"} and max(last.payloads) <= LIMIT
                if node == "server":
                    for a, b in zip(attempts, attempts[1:], strict=False):
                        assert max(b.packets) <= max(a.packets) // 2
                    bound = max(attempts[-2].packets) // 2  # the limit the last try was cut under
                else:  # the largest packet the broker delivered, and no more payload than it carried
                    packet, payload = _received_max(db, node)
                    bound = min(packet, payload + last.packets[0] - last.payloads[0])
                    assert max(last.payloads) <= payload
                assert max(last.packets) <= bound
                assert last.chunk_count == len(last.packets) == math.ceil(last.total / last.chunk_data)
                refusals += len(attempts) - 1
                # a close per refused try; OVERSIZE_STRIKES when the PUBACK is lost to the close (the
                # reset of a socket with unread data): then the transport counts strikes
                closes = out.connects[node] - 1
                assert len(attempts) - 1 <= closes <= OVERSIZE_STRIKES * (len(attempts) - 1), (node, out.connects)
            else:
                assert len(attempts) == 1 and attempts[0].deliveries == ["acked"]
                bound = 1 << 62
                assert out.connects[node] == 1, node
            # later copies in round 1, each the answer to a reconnect: the server's copies to devices
            # that came back, a device's update for a round_start sent again (its own or the server's)
            others = ("client-000", "client-001", "client-002") if node == "server" else ("server",)
            assert len(later) <= out.connects[node] - 1 + sum(out.connects[o] - 1 for o in others), node
            for seq in later:
                a = _messages(db, node, kind, 1)[seq][-1]
                assert set(a.deliveries) == {"acked"} and max(a.packets) <= bound
            # round 2: sized under what passed at once
            for a_list in _messages(db, node, kind, 2).values():
                assert len(a_list) == 1 and set(a_list[0].deliveries) == {"acked"} and max(a_list[0].packets) <= bound
        (server_refused,) = db.execute("SELECT COUNT(*) FROM messages WHERE side = 'server' AND "
                                       "delivery = 'refused'").fetchone()
        assert sum(x["broker_refusals"] for x in m) == server_refused
        assert m[1]["broker_refusals"] == 0 and refusals >= 1
        assert all(x["global_resends"] == 0 for x in m)  # every refusal was seen at once: no wait for receipts

    def test_broker_that_drops_silently(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        """Acknowledged and dropped, the link kept: the global no device confirms within
        ``global_confirm_s`` and the updates without a receipt are sent again in packets of a
        quarter of the size (the server) or of the largest the broker delivered (an agent), that
        limit is learnt and round 2 is sized under it from the start."""
        require_mosquitto()

        def hook(i, agent):
            agent.receipt_timeout_s = 5.0

        with caplog.at_level(logging.WARNING, logger="protocol.channel"):
            out = run_size_limit(tmp_path, broker_lines=MSL_SILENT, mqtt_version="3.1.1",
                                 server={"global_confirm_s": 5.0}, agent_hook=hook)
        _check_finished(out)
        _check_wire(out)  # no link was cut: exact
        assert set(out.connects.values()) == {1} and out.refusal_reasons == []
        db = sqlite3.connect(tmp_path / "run" / "ledger.sqlite")
        assert db.execute("SELECT COUNT(*) FROM messages WHERE delivery = 'refused' OR event = 'rejected'"
                          ).fetchone() == (0,)
        m = read_metrics(tmp_path / "run")
        assert [x["global_resends"] for x in m] == [1, 0]
        for node, kind in SENDS.items():
            msgs = [atts for _, atts in sorted(_messages(db, node, kind, 1).items())]
            assert all(len(atts) == 1 and set(atts[0].deliveries) == {"acked"} for atts in msgs)  # the broker acked all
            (first,), (again,) = msgs[0], msgs[1]
            p0 = first.packets[0]
            assert len(first.packets) == 1 and first.payloads[0] > LIMIT  # sent whole, acknowledged, dropped
            if node == "server":  # a quarter of the lost packet: 54,997 // 4 = 13,749 bytes
                bound = p0 // 4
                assert f"packets of at most {bound} bytes from now on" in caplog.text
            else:  # the largest packet the broker delivered, and no more payload than it carried
                packet, payload = _received_max(db, node)
                bound = min(packet, payload + again.packets[0] - again.payloads[0])
                assert max(again.payloads) <= payload
            assert max(again.packets) <= bound and max(again.payloads) <= LIMIT
            assert again.chunk_count == len(again.packets) == math.ceil(again.total / again.chunk_data)
            assert again.chunk_count >= math.ceil(again.total / bound)
            for atts in msgs[2:]:  # a copy after a receipt slower than the timeout: no smaller again
                assert max(atts[0].packets) <= bound
            for atts in _messages(db, node, kind, 2).values():  # round 2: under the learnt limit at once
                assert len(atts) == 1 and len(atts[0].packets) > 1 and max(atts[0].packets) <= bound
