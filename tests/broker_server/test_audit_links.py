"""The audit per link: the server link's kinds, what up and down mean on each link, whose PUBLISH
packets the broker acknowledged, and what the bytes to a target are made of.

One hand-made run of 2 agents (a1, a2) and 2 rounds. The MQTT control-packet rows are written by
real channels (:meth:`protocol.channel.Channel._on_packet`, given the packets a transport would
report), so their directions are the ledger's own; the application rows are written by hand.
Every byte count is a literal worked out in the comments below, and checked again by SQL of our
own on the ledger file.

Sizes (bytes). An application row: header 5 + topic 30 + envelope 20 + body, so wire = 55 + body:
join 100 → 155, global round 1 1,000 → 1,055, round 2 2,000 → 2,055, update (r1 a1, r1 a2, r2 a1,
r2 a2) 400/600/500/700 → 455/655/555/755, round_start 10 → 65, status 5 → 60. Control packets:
the server's CONNECT 53, CONNACK 11, SUBSCRIBE 59, SUBACK 6; each agent's CONNECT 60, CONNACK 4,
SUBSCRIBE 40, SUBACK 5; PUBACK 4, PINGREQ 2, PINGRESP 2, DISCONNECT 2.
"""

from __future__ import annotations

import html
import json
import re
import sqlite3

import matplotlib
import pytest

matplotlib.use("Agg")

from broker_server.audit import (  # noqa: E402
    audit_report,
    by_kind,
    cumulative_bytes,
    cumulative_parts,
    load_run,
    main_audit,
    render_comparison_text,
    render_html,
    render_text,
)
from broker_server.audit._format import DIRECTION_MEANING  # noqa: E402
from protocol.channel import Channel  # noqa: E402
from protocol.ledger import Ledger, LedgerRow  # noqa: E402
from protocol.memory_transport import MemoryBroker  # noqa: E402
from protocol.transport_base import PacketEvent  # noqa: E402

FED = "fed-links"
AGENTS = ("a1", "a2")
REFUSAL = "quota exceeded (0x97)"
METRICS = [{"round": 1, "accuracy": 0.5}, {"round": 2, "accuracy": 0.8}]


def _app(side: str, event: str, direction: str, kind: str, rnd: int | None, client: str, body: int,
         delivery: str = "", reason: str = "") -> LedgerRow:
    """An application row: wire = 5 + 30 + 20 + body."""
    return LedgerRow(federation=FED, side=side, node=client if side == "agent" else "server", event=event,
                     direction=direction, kind=kind, round=rnd, client=client, sender=None, seq=None,
                     topic=f"fedfleet/v1/{FED}/{direction}/{kind}", topic_bytes=30, mqtt_header_bytes=5,
                     envelope_bytes=20, body_bytes=body, payload_bytes=20 + body, qos=1, delivery=delivery,
                     reason=reason)


def _write_run(run):
    """The run folder; ledger rows in the order below (see the module docstring for the sizes)."""
    broker = MemoryBroker()
    with Ledger(run / "ledger.sqlite") as led:
        led.set_meta("federation", FED)
        srv = Channel(broker.connect("server"), node_id="server", side="server", federation=FED, ledger=led)
        ag = {c: Channel(broker.connect(c), node_id=c, side="agent", federation=FED, ledger=led) for c in AGENTS}

        def pkt(ch: Channel, direction: str, packet: str, size: int) -> None:  # what a transport reports
            ch._on_packet(PacketEvent(direction, packet, size))

        def upload(kind: str, rnd: int | None, c: str, body: int, delivery: str = "acked") -> None:
            led.record(_app("agent", "sent", "up", kind, rnd, c, body, delivery))
            led.record(_app("server", "received", "up", kind, rnd, c, body))
            if delivery == "acked":  # QoS 1: the broker acknowledges to the agent, the server to the broker
                pkt(ag[c], "in", "PUBACK", 4)
                pkt(srv, "out", "PUBACK", 4)

        def download(kind: str, rnd: int, body: int, delivery: str = "acked", to=AGENTS) -> None:
            reason = REFUSAL if delivery == "refused" else ""
            led.record(_app("server", "sent", "down", kind, rnd, "*", body, delivery, reason))
            pkt(srv, "in", "PUBACK", 4)  # the broker's acknowledgement (a refusal is a PUBACK too)
            for c in to:
                led.record(_app("agent", "received", "down", kind, rnd, c, body))
                pkt(ag[c], "out", "PUBACK", 4)

        for direction, packet, size in (("out", "CONNECT", 53), ("in", "CONNACK", 11), ("out", "SUBSCRIBE", 59),
                                        ("in", "SUBACK", 6)):
            pkt(srv, direction, packet, size)
        for c in AGENTS:
            for direction, packet, size in (("out", "CONNECT", 60), ("in", "CONNACK", 4), ("out", "SUBSCRIBE", 40),
                                            ("in", "SUBACK", 5)):
                pkt(ag[c], direction, packet, size)
        for c in AGENTS:
            upload("join", 0, c, 100)
        download("global", 1, 1000)
        upload("update", 1, "a1", 400)
        upload("update", 1, "a2", 600)
        pkt(srv, "out", "PINGREQ", 2)
        pkt(srv, "in", "PINGRESP", 2)
        download("global", 2, 2000)
        download("round_start", 2, 10, delivery="refused", to=())
        upload("update", 2, "a1", 500)
        upload("update", 2, "a2", 700, delivery="handed")  # the last row of round 2 on the device links
        upload("status", 0, "a1", 5)  # an 'offline' status after the rounds
        for c in AGENTS:
            pkt(ag[c], "out", "DISCONNECT", 2)
        pkt(srv, "out", "DISCONNECT", 2)
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in METRICS))
    return run


@pytest.fixture
def run(tmp_path):
    return _write_run(tmp_path / "links-run")


def _flat(text: str) -> str:
    """Text with every run of whitespace as one space (the terminal report wraps at 120 columns)."""
    return " ".join(text.split())


def _sql(run, query: str, *params):
    db = sqlite3.connect(run / "ledger.sqlite")
    try:
        return db.execute(query, params).fetchall()
    finally:
        db.close()


WIRE = "mqtt_header_bytes + topic_bytes + payload_bytes - unsent_bytes"
VIEW = "event IN ('sent', 'received', 'rejected')"


# --------------------------------------------------------------------------------------------
# 1. The server link's kinds

#: (kind, direction) -> (messages, wire bytes) on the server link, by hand.
SERVER_KINDS = {
    ("CONNACK", "up"): (1, 11), ("CONNECT", "down"): (1, 53), ("DISCONNECT", "down"): (1, 2),
    ("PINGREQ", "down"): (1, 2), ("PINGRESP", "up"): (1, 2),
    ("PUBACK", "down"): (6, 24),  # the server's acknowledgements of 2 joins, 3 QoS-1 updates, 1 status
    ("PUBACK", "up"): (3, 12),  # the broker's to the server: 2 globals, the refused round_start
    ("SUBACK", "up"): (1, 6), ("SUBSCRIBE", "down"): (1, 59),
    ("global", "down"): (2, 1055 + 2055),  # a broadcast once
    ("join", "up"): (2, 2 * 155), ("round_start", "down"): (1, 65), ("status", "up"): (1, 60),
    ("update", "up"): (4, 455 + 655 + 555 + 755),
}


def test_the_server_link_is_broken_down_by_kind_in_json_text_and_html(run, capsys):
    rep = audit_report(run)
    got = {(k["kind"], k["direction"]): (k["messages"], k["wire_bytes"]) for k in rep["by_kind_server"]}
    assert got == SERVER_KINDS
    # Our own SQL on the ledger file says the same, and the kinds add up to the server link's totals.
    assert got == {(k, d): (n, b) for k, d, n, b in _sql(
        run, f"SELECT kind, direction, COUNT(*), SUM({WIRE}) FROM messages WHERE side = 'server' AND {VIEW} "
             "GROUP BY kind, direction")}
    srv = rep["totals"]["server"]
    assert srv["up"]["wire_bytes"] == 11 + 2 + 12 + 6 + 310 + 60 + 2420 == 2821
    assert srv["down"]["wire_bytes"] == 53 + 2 + 2 + 24 + 59 + 3110 + 65 == 3315
    for key in ("messages", "wire_bytes", "control_bytes", "body_bytes"):
        assert sum(k[key] for k in rep["by_kind_server"]) == srv["all"][key], key
    assert rep["by_kind_server"] == by_kind(load_run(run).rows, "server")
    assert rep["by_kind"] != rep["by_kind_server"]  # the device links' table is still the device links'

    assert main_audit([str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["by_kind_server"] == json.loads(json.dumps(rep["by_kind_server"]))

    text = render_text(rep)
    server_table = text[text.index("Per kind and direction (server link"):text.index("Rejected messages")]
    assert re.search(r"^CONNACK\s+up\s+1\s+0\s+0\s+0\s+11\s+11\s+100\.0 %$", server_table, re.M)
    assert re.search(r"^PUBACK\s+up\s+3\s+0\s+0\s+0\s+12\s+12\s+100\.0 %$", server_table, re.M)
    assert re.search(r"^global\s+down\s+2\s+3,000\s+40\s+70\s+0\s+3,110\s+3\.5 %$", server_table, re.M)
    assert re.search(r"^update\s+up\s+4\s+2,200\s+80\s+140\s+0\s+2,420\s+9\.1 %$", server_table, re.M)
    assert all(len(line) <= 120 for line in text.splitlines())

    page = render_html([rep])
    section = page[page.index("Per kind and direction (server link"):]
    assert '<td class="text">CONNACK</td><td class="text">up</td><td class="num">1</td>' in section
    assert '<td class="text">global</td><td class="text">down</td><td class="num">2</td>' in section


# --------------------------------------------------------------------------------------------
# 2. What up and down mean on each link


def _parts(meaning: str) -> tuple[str, str]:
    """The 'up = …' and 'down = …' halves of a DIRECTION_MEANING line."""
    up, down = meaning.split("; down = ")
    assert up.startswith("up = ")
    return up, down


def test_up_and_down_are_said_per_link_as_the_channel_records_them(run):
    rep = audit_report(run)
    # The channel's control rows: on the server link, what the server *received* is up.
    ctl = {(side, kind, event): direction for side, kind, event, direction in _sql(
        run, "SELECT DISTINCT side, kind, event, direction FROM messages WHERE reason = 'control'")}
    assert ctl[("server", "CONNACK", "received")] == "up" and ctl[("server", "CONNECT", "sent")] == "down"
    assert ctl[("server", "PUBACK", "received")] == "up" and ctl[("server", "PUBACK", "sent")] == "down"
    assert ctl[("agent", "CONNACK", "received")] == "down" and ctl[("agent", "CONNECT", "sent")] == "up"
    assert ctl[("agent", "PUBACK", "received")] == "down" and ctl[("agent", "PUBACK", "sent")] == "up"
    # The server link's up row holds the control packets the broker sent the server: CONNACK,
    # SUBACK, PINGRESP and the PUBACKs of its own 3 PUBLISH packets.
    assert rep["totals"]["server"]["up"]["control_bytes"] == 11 + 6 + 2 + 3 * 4 == 31
    assert rep["totals"]["server"]["up"]["control_messages"] == 6

    # Each meaning names every control kind of this ledger on the side where the channel put it.
    side = {"device": "agent", "server": "server"}
    for view, meaning in DIRECTION_MEANING.items():
        up, down = _parts(meaning)
        for (s, kind, _event), direction in ctl.items():
            if s != side[view] or kind == "PUBACK":
                continue
            assert re.search(rf"\b{kind}\b", up if direction == "up" else down), (view, kind)
            assert not re.search(rf"\b{kind}\b", down if direction == "up" else up), (view, kind)
    server_up, server_down = _parts(DIRECTION_MEANING["server"])
    assert server_up.startswith("up = towards the server: what the broker sends the server")
    assert "PUBACK for the server's own PUBLISH" in server_up and "PUBACK for an upload it received" in server_down
    device_up, device_down = _parts(DIRECTION_MEANING["device"])
    assert "PUBACK for a download" in device_up and "PUBACK for an upload" in device_down

    text = render_text(rep)
    flat = _flat(text)
    for view, title in (("device", "Totals: device links"), ("server", "Totals: server link")):
        section = _flat(text[text.index(title):])
        assert section.index(_flat(DIRECTION_MEANING[view])) < section.index("Security:" if view == "server"
                                                                              else "Totals: server link")
    assert flat.count(_flat(DIRECTION_MEANING["server"])) == 1
    page = render_html([rep])
    for view in ("device", "server"):
        assert html.escape(DIRECTION_MEANING[view]) in page


# --------------------------------------------------------------------------------------------
# 3. Whose PUBLISH packets the broker acknowledged


DEVICE_LINE = ("PUBLISH packets sent by the devices (device links): 6 acknowledged by the broker, 1 handed over "
               "without acknowledgement, 0 refused by the broker")
SERVER_LINE = ("PUBLISH packets sent by the server (server link): 2 acknowledged by the broker, 0 handed over "
               "without acknowledgement, 1 refused by the broker")


def test_publish_deliveries_are_told_per_side(run):
    rep = audit_report(run)
    dv = rep["deliveries"]
    # agents: 2 joins, 3 updates and the status acknowledged, a2's round-2 update handed over;
    # the server: 2 globals acknowledged, the round_start refused.
    assert {s: (d["acked"], d["handed"], d["refused"], d["sent"]) for s, d in dv["by_side"].items()} == {
        "agent": (6, 1, 0, 7), "server": (2, 0, 1, 3)}
    assert {(s, d): n for s, d, n in _sql(run, "SELECT side, delivery, COUNT(*) FROM messages WHERE event = 'sent' "
                                               "AND reason != 'control' GROUP BY side, delivery")} == {
        ("agent", "acked"): 6, ("agent", "handed"): 1, ("server", "acked"): 2, ("server", "refused"): 1}
    assert (dv["acked"], dv["handed"], dv["refused"]) == (8, 1, 1)  # both sides together, as before

    text = render_text(rep)
    flat = _flat(text)
    assert DEVICE_LINE in flat and SERVER_LINE in flat
    assert "PUBLISH packets sent:" not in flat  # no unlabelled sum of both sides
    assert f"refused (server server, round_start, 1×): {REFUSAL}" in flat
    page = render_html([rep])
    assert html.escape(DEVICE_LINE) in page and html.escape(SERVER_LINE) in page


def _copy_run(rows, dest):
    """A run folder whose ledger holds ``rows`` (dicts, as load_run reads them) and METRICS."""
    dest.mkdir()
    with Ledger(dest / "ledger.sqlite") as led:
        for r in rows:
            led.record(LedgerRow(**{k: v for k, v in r.items() if k in LedgerRow.__dataclass_fields__}))
    (dest / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in METRICS))
    return dest


def test_a_device_s_own_ledger_tells_only_the_devices(run, tmp_path):
    own = _copy_run([r for r in load_run(run).rows if r["side"] == "agent" and r["node"] == "a1"],
                    tmp_path / "agent-a1")
    flat = _flat(render_text(audit_report(own)))
    # a1: its join, 2 updates and the status, all acknowledged
    assert ("PUBLISH packets sent by the devices (device links): 4 acknowledged by the broker, 0 handed over "
            "without acknowledgement, 0 refused by the broker") in flat
    assert "sent by the server" not in flat
    assert "Per kind and direction (server link" not in flat  # no server rows: no server table


# --------------------------------------------------------------------------------------------
# 4. What the bytes to a target are made of

#: Device links. Rounds 1–2: 2 × 1,055 + 455 + 655 (round 1) + 2 × 2,055 + 555 + 755 (round 2).
ROUNDS = 3220 + 5420
#: Round 0: the 2 joins came before round 2's last row (a2's update), a1's status after it.
ROUND0, ROUND0_ALL = 2 * 155, 2 * 155 + 60
#: Session (control packets) before a2's round-2 update: each agent's CONNECT, CONNACK, SUBSCRIBE,
#: SUBACK (2 × 109), the PUBACKs of the 2 joins (8), of the 2 round-1 globals and updates (16), of
#: the 2 round-2 globals and a1's update (12): 17 packets. After it: a1's status PUBACK, 2 DISCONNECTs.
SESSION, SESSION_N = 2 * 109 + 8 + 16 + 12, 2 * 4 + 2 + 4 + 3
SESSION_ALL = SESSION + 4 + 2 * 2


def test_bytes_to_target_are_told_as_their_per_round_rows(run):
    assert (ROUNDS, ROUND0, SESSION, SESSION_N) == (8640, 310, 254, 17)
    rep = audit_report(run, target=0.75)
    assert rep["target"]["round"] == 2 and rep["target"]["bytes"] == ROUNDS + ROUND0 + SESSION == 9204
    assert rep["target"]["parts"] == {
        "round": 2, "last_round": 2, "rounds_bytes": ROUNDS, "rounds_messages": 8, "round0_bytes": ROUND0,
        "round0_messages": 2, "round0_all_bytes": ROUND0_ALL, "session_bytes": SESSION, "session_messages": SESSION_N,
        "session_control_messages": SESSION_N, "session_all_bytes": SESSION_ALL, "wire_bytes": 9204}
    # Our own SQL: the per-round rows of the device links, and the rows before a2's round-2 update.
    dev = f"side = 'agent' AND {VIEW}"
    ((last,),) = _sql(run, f"SELECT MAX(id) FROM messages WHERE {dev} AND round BETWEEN 1 AND 2")
    ((rounds, r0, r0_all, session, session_all),) = _sql(
        run, f"SELECT SUM(CASE WHEN round BETWEEN 1 AND 2 THEN {WIRE} END), "
             f"SUM(CASE WHEN round = 0 AND id < ? THEN {WIRE} END), SUM(CASE WHEN round = 0 THEN {WIRE} END), "
             f"SUM(CASE WHEN round IS NULL AND id < ? THEN {WIRE} END), SUM(CASE WHEN round IS NULL THEN {WIRE} END) "
             f"FROM messages WHERE {dev}", last, last)
    assert (rounds, r0, r0_all, session, session_all) == (ROUNDS, ROUND0, ROUND0_ALL, SESSION, SESSION_ALL)
    # The per-round table's rows say the same.
    rows = {r["round"]: r["up_bytes"] + r["down_bytes"] for r in rep["by_round"]}
    assert (rows[1] + rows[2], rows[0], rows[None]) == (ROUNDS, ROUND0_ALL, SESSION_ALL)

    line = ("Device-link bytes to reach accuracy ≥ 75.00 %: 9,204 (9.0 KiB, round 2) = 8,640 of rounds 1–2 + 310 "
            "of round 0 (of its 370) + 254 of the session row (17 control packets, of its 262): the traffic outside "
            "the rounds counts as far as it was recorded before round 2's last row")
    assert line in _flat(render_text(rep))
    assert html.escape(line) in render_html([rep])
    footnote = _flat(render_comparison_text([rep, rep]))
    assert "and the traffic outside the rounds (round 0, the session row: joins, control packets …) recorded " \
           "before that round's last row." in footnote


def test_round_one_and_a_round_zero_counted_whole(run, tmp_path):
    # Round 1's last row is a2's round-1 update: both joins came before it, a1's status after.
    rep = audit_report(run, target=0.5)
    parts = rep["target"]["parts"]
    # session before a2's round-1 update: 2 × 109 + join PUBACKs 8 + round-1 global PUBACKs 8 + a1's update PUBACK 4
    assert (parts["rounds_bytes"], parts["round0_bytes"], parts["session_bytes"], parts["session_messages"]) == (
        3220, 310, 2 * 109 + 8 + 8 + 4, 8 + 2 + 2 + 1)
    assert rep["target"]["bytes"] == 3220 + 310 + 238 == cumulative_bytes(load_run(run).rows, [1])[1]
    assert ("= 3,220 of round 1 + 310 of round 0 (of its 370) + 238 of the session row (13 control packets, of "
            "its 262): the traffic outside the rounds counts as far as it was recorded before round 1's last row"
            in _flat(render_text(rep)))
    assert audit_report(run, target=0.9)["target"]["parts"] is None  # not reached
    # Without the final status, round 0 counts whole: its row of the per-round table, as it is.
    whole = _copy_run([r for r in load_run(run).rows if r["kind"] != "status"], tmp_path / "no-status")
    assert ("Device-link bytes to reach accuracy ≥ 75.00 %: 9,204 (9.0 KiB, round 2) = 8,640 of rounds 1–2 + 310 "
            "of round 0 + 254 of the session row (17 control packets, of its 262)" in _flat(render_text(
                audit_report(whole, target=0.75))))


def test_cumulative_parts_add_up_to_cumulative_bytes_for_every_round(run):
    rows = load_run(run).rows
    for rnd in (0, 1, 2, 3):
        parts = cumulative_parts(rows, rnd)
        assert parts["wire_bytes"] == cumulative_bytes(rows, [rnd])[rnd], rnd
    assert cumulative_parts(rows, 0)["wire_bytes"] == 0 and cumulative_parts(rows, 0)["last_round"] is None
