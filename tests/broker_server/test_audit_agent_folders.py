"""The audit of a fleet's agent folders, against hand-made agent ledgers: what each device sent or
received again (``repeat_bytes``: a resume's or reconnect's cost as its own ledger tells it) and
the fleet total of several folders (``fedfleet audit --json``'s ``fleet_total``, and the text's).

Three agent folders of federation ``fleet-x``, each a device's ``--out`` ledger (agent rows only):

- ``dev-a``: the server is stopped (Ctrl-C) in round 2 and resumed with ``--resume`` while the
  device stays connected: it receives round 2's global and round_start again, confirms the global
  again, sends its round-2 update a second time on its receipt timeout and a third time for the
  resumed server, and gets two receipts for them;
- ``dev-b``: its first connection takes two CONNECTs (MQTT 5 trial, then 3.1.1); round 1's global
  comes in two chunks, the second after a resend request and delivered twice; the broker restarts
  in round 2: the device reconnects, MQTT retransmits its update (PUBLISH-DUP), it says it is online
  again, and the server sends it round 2's global and round_start on its own topics;
- ``dev-c``: uninterrupted; round 2 has per-device instructions, so the device gets a round_start on
  its own topic and a broadcast one naming nobody: both first copies.

Sizes (bytes). An application row: MQTT header 5 + topic + payload (envelope 20 + body), so wire =
5 + topic + payload. Topics (``fedfleet/v1/fleet-x/`` is 20 characters, a client id 5): status 32,
join 33, down/global 31, down/dev-b/global 37, down/round_start 36, down/dev-x/round_start 42,
up/…/receipt 36, down/…/receipt 38, up/…/update 35, up/…/resend 35, down/finish 31. Payloads: status
30 (the reconnected one 33), join 500, receipt 60 down and 50 up, global 2,000 (a chunk 1,020:
1,000 of data + 20 of framing), round_start 100 broadcast and 90 on the device's own topic, update
1,500, resend 40, finish 40. Wire: status 67 (70), join 538, receipt down 103, receipt up 91,
global 2,036 (2,042 on the own topic; a chunk 1,056), round_start 141 (own 137), update 1,540,
resend 80, finish 76. Control packets (the whole packet): CONNECT 60 (the 3.1.1 one 58), CONNACK
4, SUBSCRIBE 30, SUBACK 5, PUBACK 4, PINGREQ 2, PINGRESP 2, DISCONNECT 2; a PUBLISH-DUP of an
update 1,540.
"""

from __future__ import annotations

import csv
import html
import json
import re
from dataclasses import asdict, replace
from itertools import zip_longest
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from broker_server.audit import (  # noqa: E402
    audit_report,
    comparison_row,
    fleet_total,
    load_run,
    main_audit,
    render_comparison_text,
    render_html,
    render_text,
    repeat_bytes,
    write_csv,
)
from protocol.ledger import Ledger, LedgerRow  # noqa: E402

FED = "fleet-x"
P = f"fedfleet/v1/{FED}/"  # 20 characters

# Wire bytes of each packet, by hand (see the module docstring).
STATUS, STATUS_AGAIN, JOIN, RCPT_DOWN, RCPT_UP = 67, 70, 538, 103, 91
GLOBAL, GLOBAL_OWN, CHUNK, START, START_OWN, UPDATE, RESEND, FINISH = 2036, 2042, 1056, 141, 137, 1540, 80, 76
CONNECT, CONNECT_311, CONNACK, SUBSCRIBE, SUBACK, PUBACK, PING, DISCONNECT = 60, 58, 4, 30, 5, 4, 2, 2

# dev-a (server resumed): again, round 2's update twice, global, round_start, its receipt (up) and
# the second receipt of its update (down); nothing retransmitted, no reconnection.
A_AGAIN = 2 * UPDATE + GLOBAL + START + RCPT_UP + RCPT_DOWN  # 3,080 + 2,036 + 141 + 91 + 103 = 5,451
A_TOTAL = (60 + 4 + 30 + 30 + 5 + 5 + 4 + 2 + 2 + 2  # its control packets: 144
           + 2 * STATUS + JOIN + RCPT_DOWN + 4 * GLOBAL + 4 * RCPT_UP + 4 * START + 5 * UPDATE + 4 * RCPT_DOWN
           + FINISH)  # 18,179
# dev-b (broker restart): again, the resend request, round 1's second chunk delivered twice, round
# 2's global on its own topic, its receipt, the update sent again, its second receipt; MQTT
# retransmitted the update once; reconnecting, CONNECT, CONNACK, 2 SUBSCRIBE, 2 SUBACK.
B_AGAIN = RESEND + CHUNK + GLOBAL_OWN + RCPT_UP + UPDATE + RCPT_DOWN  # 4,912
B_DUP = UPDATE  # 1,540
B_RECONNECT = CONNECT_311 + CONNACK + 2 * SUBSCRIBE + 2 * SUBACK  # 132
B_TOTAL = (CONNECT + 2 * CONNECT_311 + 2 * CONNACK + 4 * SUBSCRIBE + 4 * SUBACK + B_DUP + PUBACK + DISCONNECT  # 1,870
           + 2 * STATUS + STATUS_AGAIN + JOIN + RCPT_DOWN  # 845
           + 3 * CHUNK + RESEND + RCPT_UP + START + UPDATE + RCPT_DOWN  # round 1: 5,123
           + GLOBAL + RCPT_UP + START + UPDATE  # round 2 before the restart: 3,808
           + GLOBAL_OWN + RCPT_UP + START_OWN + UPDATE + 2 * RCPT_DOWN + FINISH)  # after it: 4,092; in all 15,738
C_TOTAL = (CONNECT + CONNACK + 2 * SUBSCRIBE + 2 * SUBACK + DISCONNECT + 2 * STATUS + JOIN + RCPT_DOWN  # 911
           + GLOBAL + RCPT_UP + START + UPDATE + RCPT_DOWN  # round 1: 3,911
           + GLOBAL + RCPT_UP + START + START_OWN + UPDATE + RCPT_DOWN + FINISH)  # round 2 and finish: 4,124; 8,946


def _app(node: str, event: str, direction: str, kind: str, rnd: int | None, topic: str, payload: int, *,
         seq: int | None = None, transfer: str | None = None, index: int | None = None) -> LedgerRow:
    """An application row as protocol.channel writes it on the agent side (``sender``: the node for
    what it sends, the server for what it receives)."""
    return LedgerRow(federation=FED, side="agent", node=node, event=event, direction=direction, kind=kind, round=rnd,
                     client=node, sender=node if event == "sent" else "server", seq=seq, topic=topic,
                     topic_bytes=len(topic.encode()), mqtt_header_bytes=5, envelope_bytes=20,
                     body_bytes=payload - 20, payload_bytes=payload, qos=1, transfer_id=transfer, chunk_index=index,
                     chunk_count=None if transfer is None else 2)


def _ctl(node: str, event: str, direction: str, kind: str, size: int) -> LedgerRow:
    """A control-packet row as protocol.channel writes it: reason 'control', round NULL, the whole
    packet in ``mqtt_header_bytes``."""
    return LedgerRow(federation=FED, side="agent", node=node, event=event, direction=direction, kind=kind, round=None,
                     client=node, sender=None, seq=None, topic="", topic_bytes=0, mqtt_header_bytes=size,
                     envelope_bytes=0, body_bytes=0, payload_bytes=0, qos=0, reason="control")


def _round(node: str, rnd: int, seqs: tuple[int, int, int, int, int]) -> list[LedgerRow]:
    """One uninterrupted round: the broadcast global (with its PUBACK), its receipt, the broadcast
    round_start, the update and its receipt (``seqs``: global, receipt up, round_start, update, receipt down)."""
    g, ru, s, u, rd = seqs
    return [_app(node, "received", "down", "global", rnd, P + "down/global", 2000, seq=g),
            _ctl(node, "sent", "up", "PUBACK", PUBACK) if node == "dev-a" and rnd == 1 else None,
            _app(node, "sent", "up", "receipt", rnd, P + f"up/{node}/receipt", 50, seq=ru),
            _app(node, "received", "down", "round_start", rnd, P + "down/round_start", 100, seq=s),
            _app(node, "sent", "up", "update", rnd, P + f"up/{node}/update", 1500, seq=u),
            _app(node, "received", "down", "receipt", rnd, P + f"down/{node}/receipt", 60, seq=rd)]


def _start(node: str, *, trial: bool = False) -> list[LedgerRow]:
    """The first connection (an MQTT 5 trial CONNECT first when ``trial``), the online status (before
    the SUBACKs arrive), the join and its receipt."""
    connects = ([_ctl(node, "sent", "up", "CONNECT", CONNECT), _ctl(node, "sent", "up", "CONNECT", CONNECT_311)]
                if trial else [_ctl(node, "sent", "up", "CONNECT", CONNECT)])
    return [*connects, _ctl(node, "received", "down", "CONNACK", CONNACK),
            _ctl(node, "sent", "up", "SUBSCRIBE", SUBSCRIBE), _ctl(node, "sent", "up", "SUBSCRIBE", SUBSCRIBE),
            _app(node, "sent", "up", "status", 0, P + f"status/{node}", 30, seq=1),
            _ctl(node, "received", "down", "SUBACK", SUBACK), _ctl(node, "received", "down", "SUBACK", SUBACK),
            _app(node, "sent", "up", "join", 0, P + f"up/{node}/join", 500, seq=2),
            _app(node, "received", "down", "receipt", 0, P + f"down/{node}/receipt", 60, seq=3)]


def _end(node: str, rnd: int, seq: int) -> list[LedgerRow]:
    return [_app(node, "received", "down", "finish", rnd, P + "down/finish", 40, seq=99),
            _app(node, "sent", "up", "status", 0, P + f"status/{node}", 30, seq=seq),
            _ctl(node, "sent", "up", "DISCONNECT", DISCONNECT)]


def dev_a_rows(*, twin: bool = False) -> list[LedgerRow]:
    """dev-a: the server stopped in round 2 (after dev-a's update) and resumed; dev-a stays connected.
    ``twin``: the same device uninterrupted (without the 6 rows of what came and went again)."""
    node = "dev-a"
    again = [] if twin else [None]  # a row kept only when not ``twin``: ``*again and [row]``
    rows = _start(node) + _round(node, 1, (4, 3, 5, 4, 6))
    rows += [_app(node, "received", "down", "global", 2, P + "down/global", 2000, seq=9),
             _app(node, "sent", "up", "receipt", 2, P + f"up/{node}/receipt", 50, seq=5),
             _app(node, "received", "down", "round_start", 2, P + "down/round_start", 100, seq=10),
             _app(node, "sent", "up", "update", 2, P + f"up/{node}/update", 1500, seq=6),  # the server stops
             *(again and [_app(node, "sent", "up", "update", 2, P + f"up/{node}/update", 1500, seq=7)]),  # no receipt
             _ctl(node, "sent", "up", "PINGREQ", PING), _ctl(node, "received", "down", "PINGRESP", PING),
             # the resumed server (its seqs start again at 1) runs round 2 again
             *(again and [_app(node, "received", "down", "global", 2, P + "down/global", 2000, seq=1),
                          _app(node, "sent", "up", "receipt", 2, P + f"up/{node}/receipt", 50, seq=8),
                          _app(node, "received", "down", "round_start", 2, P + "down/round_start", 100, seq=2),
                          _app(node, "sent", "up", "update", 2, P + f"up/{node}/update", 1500, seq=9)]),
             _app(node, "received", "down", "receipt", 2, P + f"down/{node}/receipt", 60, seq=3),  # accepted
             *(again and [_app(node, "received", "down", "receipt", 2, P + f"down/{node}/receipt", 60, seq=4)])]
    rows += _round(node, 3, (5, 10, 6, 11, 7)) + _end(node, 3, 12)
    return [r for r in rows if r is not None]


def dev_b_rows() -> list[LedgerRow]:
    """dev-b: the MQTT 5 trial at start, a chunked global with a resend request, a broker restart."""
    node = "dev-b"
    rows = _start(node, trial=True)
    rows += [_app(node, "received", "down", "global", 1, P + "down/global", 1020, seq=4, transfer="t1", index=0),
             _app(node, "sent", "up", "resend", 0, P + f"up/{node}/resend", 40, seq=3),
             _app(node, "received", "down", "global", 1, P + "down/global", 1020, seq=7, transfer="t1", index=1),
             _app(node, "received", "down", "global", 1, P + "down/global", 1020, seq=7, transfer="t1", index=1),
             # the whole message's logical row: no wire bytes
             _app(node, "message", "down", "global", 1, P + "down/global", 2020, seq=4, transfer="t1"),
             _app(node, "sent", "up", "receipt", 1, P + f"up/{node}/receipt", 50, seq=4),
             _app(node, "received", "down", "round_start", 1, P + "down/round_start", 100, seq=8),
             _app(node, "sent", "up", "update", 1, P + f"up/{node}/update", 1500, seq=5),
             _app(node, "received", "down", "receipt", 1, P + f"down/{node}/receipt", 60, seq=9),
             _app(node, "received", "down", "global", 2, P + "down/global", 2000, seq=20),
             _app(node, "sent", "up", "receipt", 2, P + f"up/{node}/receipt", 50, seq=6),
             _app(node, "received", "down", "round_start", 2, P + "down/round_start", 100, seq=21),
             _app(node, "sent", "up", "update", 2, P + f"up/{node}/update", 1500, seq=7),  # the broker dies
             _ctl(node, "sent", "up", "CONNECT", CONNECT_311), _ctl(node, "received", "down", "CONNACK", CONNACK),
             _ctl(node, "sent", "up", "SUBSCRIBE", SUBSCRIBE), _ctl(node, "sent", "up", "SUBSCRIBE", SUBSCRIBE),
             _app(node, "sent", "up", "status", 0, P + f"status/{node}", 33, seq=8),  # online, reconnected
             _ctl(node, "received", "down", "SUBACK", SUBACK), _ctl(node, "received", "down", "SUBACK", SUBACK),
             _ctl(node, "sent", "up", "PUBLISH-DUP", UPDATE), _ctl(node, "received", "down", "PUBACK", PUBACK),
             # the server sends the device that came back the round on its own topics
             _app(node, "received", "down", "global", 2, P + f"down/{node}/global", 2000, seq=30),
             _app(node, "sent", "up", "receipt", 2, P + f"up/{node}/receipt", 50, seq=9),
             _app(node, "received", "down", "round_start", 2, P + f"down/{node}/round_start", 90, seq=31),
             _app(node, "sent", "up", "update", 2, P + f"up/{node}/update", 1500, seq=10),
             _app(node, "received", "down", "receipt", 2, P + f"down/{node}/receipt", 60, seq=32),
             _app(node, "received", "down", "receipt", 2, P + f"down/{node}/receipt", 60, seq=33)]
    return rows + _end(node, 2, 11)


def dev_c_rows() -> list[LedgerRow]:
    """dev-c: uninterrupted; round 2 has per-device instructions and a broadcast naming nobody."""
    node = "dev-c"
    rows = [r for r in _start(node) + _round(node, 1, (4, 3, 5, 4, 6)) if r is not None]
    rows += [_app(node, "received", "down", "global", 2, P + "down/global", 2000, seq=9),
             _app(node, "sent", "up", "receipt", 2, P + f"up/{node}/receipt", 50, seq=5),
             _app(node, "received", "down", "round_start", 2, P + "down/round_start", 100, seq=10),  # nobody
             _app(node, "received", "down", "round_start", 2, P + f"down/{node}/round_start", 90, seq=11),
             _app(node, "sent", "up", "update", 2, P + f"up/{node}/update", 1500, seq=6),
             _app(node, "received", "down", "receipt", 2, P + f"down/{node}/receipt", 60, seq=12)]
    return rows + _end(node, 2, 7)


def _write(folder: Path, rows: list[LedgerRow], federation: str = FED) -> Path:
    """An agent's --out folder: its ledger alone (no metrics, no summary)."""
    with Ledger(folder / "ledger.sqlite") as ledger:
        ledger.set_meta("federation", federation)
        for r in rows:
            ledger.record(r if r.federation == federation else replace(r, federation=federation))
    return folder


def _wire(rows: list[LedgerRow], direction: str | None = None) -> int:
    """Device-link wire bytes of ``rows``, summed here in Python: agent rows on the wire."""
    return sum(r.wire_bytes for r in rows if r.side == "agent" and r.event in ("sent", "received", "rejected")
               and (direction is None or r.direction == direction))


@pytest.fixture
def fleet(tmp_path: Path) -> list[Path]:
    return [_write(tmp_path / name, rows()) for name, rows in (("dev-a", dev_a_rows), ("dev-b", dev_b_rows),
                                                                ("dev-c", dev_c_rows))]


def test_hand_numbers_are_consistent() -> None:
    topics = {"status": 32, "up/dev-a/join": 33, "down/global": 31, "down/dev-b/global": 37,
              "down/round_start": 36, "down/dev-a/round_start": 42, "up/dev-a/receipt": 36,
              "down/dev-a/receipt": 38, "up/dev-a/update": 35, "up/dev-a/resend": 35, "down/finish": 31}
    for tail, n in topics.items():
        topic = P + (tail if tail != "status" else "status/dev-a")
        assert len(topic) == n, topic
    assert (A_AGAIN, A_TOTAL) == (5451, 18179)
    assert (B_AGAIN, B_DUP, B_RECONNECT, B_TOTAL, C_TOTAL) == (4912, 1540, 132, 15738, 8946)
    for rows, total in ((dev_a_rows(), A_TOTAL), (dev_b_rows(), B_TOTAL), (dev_c_rows(), C_TOTAL)):
        assert _wire(rows) == total


def test_a_device_that_stayed_connected_through_a_server_resume_counts_what_came_and_went_again(fleet) -> None:
    rep = audit_report(fleet[0])
    assert rep["totals"]["device"]["all"]["wire_bytes"] == A_TOTAL and rep["resume"] is None
    again = rep["repeats"]
    assert {k: again["again"][k] for k in ("messages", "up_bytes", "down_bytes", "wire_bytes")} == {
        "messages": 6, "up_bytes": 2 * UPDATE + RCPT_UP, "down_bytes": GLOBAL + START + RCPT_DOWN,
        "wire_bytes": A_AGAIN}
    assert [(k["kind"], k["direction"], k["messages"], k["wire_bytes"]) for k in again["again"]["kinds"]] == [
        ("update", "up", 2, 2 * UPDATE), ("global", "down", 1, GLOBAL), ("receipt", "up", 1, RCPT_UP),
        ("round_start", "down", 1, START), ("receipt", "down", 1, RCPT_DOWN)]
    assert again["again"]["rounds"] == [{"round": 2, "messages": 6, "wire_bytes": A_AGAIN}]
    assert again["dup"]["wire_bytes"] == again["reconnect"]["wire_bytes"] == 0
    assert again["all"] == {"messages": 6, "up_bytes": 2 * UPDATE + RCPT_UP, "down_bytes": GLOBAL + START + RCPT_DOWN,
                            "wire_bytes": A_AGAIN, "control_messages": 0}
    assert again["by_client"] == [{"client": "dev-a", "messages": 6, "up_bytes": 3171, "down_bytes": 2280,
                                   "wire_bytes": A_AGAIN}]
    assert again["without_control"] == []
    # its uninterrupted twin sends exactly that less, and nothing again
    twin_rows = dev_a_rows(twin=True)
    assert len(dev_a_rows()) - len(twin_rows) == 6 and _wire(dev_a_rows()) - _wire(twin_rows) == A_AGAIN
    twin = audit_report(_write(fleet[0].parent / "twin-a", twin_rows))
    assert twin["repeats"]["all"]["wire_bytes"] == 0


def test_a_broker_restart_counts_the_copies_the_retransmissions_and_the_reconnection(fleet) -> None:
    """Not counted: the MQTT 5 trial's CONNECT and the first connection's SUBACKs (before or after the
    first message, they are the first connection's), the online status said again, the PUBACK of the
    retransmission and the round_start sent on the device's own topic after the broadcast one."""
    rep = audit_report(fleet[1])
    assert rep["totals"]["device"]["all"]["wire_bytes"] == B_TOTAL
    again = rep["repeats"]
    assert [(k["kind"], k["direction"], k["messages"], k["wire_bytes"]) for k in again["again"]["kinds"]] == [
        ("resend", "up", 1, RESEND), ("global", "down", 2, CHUNK + GLOBAL_OWN), ("receipt", "up", 1, RCPT_UP),
        ("update", "up", 1, UPDATE), ("receipt", "down", 1, RCPT_DOWN)]
    assert again["again"]["wire_bytes"] == B_AGAIN
    assert again["again"]["rounds"] == [{"round": 0, "messages": 1, "wire_bytes": RESEND},
                                        {"round": 1, "messages": 1, "wire_bytes": CHUNK},
                                        {"round": 2, "messages": 4, "wire_bytes": GLOBAL_OWN + RCPT_UP + UPDATE
                                         + RCPT_DOWN}]
    assert [(k["kind"], k["messages"], k["wire_bytes"]) for k in again["dup"]["kinds"]] == [
        ("PUBLISH-DUP", 1, B_DUP)]
    assert [(k["kind"], k["direction"], k["messages"], k["wire_bytes"]) for k in again["reconnect"]["kinds"]] == [
        ("CONNECT", "up", 1, CONNECT_311), ("CONNACK", "down", 1, CONNACK), ("SUBSCRIBE", "up", 2, 2 * SUBSCRIBE),
        ("SUBACK", "down", 2, 2 * SUBACK)]
    assert again["reconnect"]["rounds"] == [{"round": None, "messages": 6, "wire_bytes": B_RECONNECT}]
    assert (again["all"]["messages"], again["all"]["wire_bytes"], again["all"]["control_messages"]) == (
        6 + 1 + 6, B_AGAIN + B_DUP + B_RECONNECT, 7)


def test_an_uninterrupted_device_sent_nothing_again(fleet) -> None:
    """A broadcast round_start naming nobody beside the device's own (per-device instructions) is no copy."""
    rep = audit_report(fleet[2])
    assert rep["totals"]["device"]["all"]["wire_bytes"] == C_TOTAL
    assert rep["repeats"]["all"] == {"messages": 0, "up_bytes": 0, "down_bytes": 0, "wire_bytes": 0,
                                     "control_messages": 0}
    assert ("Resume/reconnect cost on the device links (what was sent or received again): 0 B: no copy of a message "
            "after the first, no MQTT retransmission, no reconnection.") in " ".join(render_text(rep).split())


def test_rows_give_what_the_ledger_file_gives_and_a_ledger_without_seq_counts_the_same(fleet) -> None:
    for folder in fleet:
        assert repeat_bytes(load_run(folder).rows) == audit_report(folder)["repeats"]
    # rows without ids (their order is the ledger's) and without envelope seqs: every copy is a row of its own
    plain = [{**asdict(r), "seq": None} for r in dev_a_rows()]
    got = repeat_bytes(plain)
    assert (got["all"]["wire_bytes"], got["all"]["messages"]) == (A_AGAIN, 6)


def test_one_ledger_of_several_devices_counts_each_device_s_copies_apart(tmp_path: Path) -> None:
    """A simulation's ledger holds every device's rows: dev-a's first copies do not make dev-b's
    (or dev-c's) copies again, and dev-b's reconnection starts after its own first message."""
    a, b, c = dev_a_rows(), dev_b_rows(), dev_c_rows()
    mixed = [r for trio in zip_longest(a, b, c) for r in trio if r is not None]
    assert len(mixed) == len(a) + len(b) + len(c)
    got = repeat_bytes([asdict(r) for r in mixed])
    assert got["by_client"] == [
        {"client": "dev-a", "messages": 6, "up_bytes": 3171, "down_bytes": 2280, "wire_bytes": A_AGAIN},
        {"client": "dev-b", "messages": 13, "up_bytes": RESEND + RCPT_UP + UPDATE + B_DUP + CONNECT_311
         + 2 * SUBSCRIBE, "down_bytes": CHUNK + GLOBAL_OWN + RCPT_DOWN + CONNACK + 2 * SUBACK,
         "wire_bytes": B_AGAIN + B_DUP + B_RECONNECT}]
    assert got["all"]["wire_bytes"] == A_AGAIN + B_AGAIN + B_DUP + B_RECONNECT


def test_a_ledger_without_control_packets_says_its_reconnections_are_unknown(tmp_path: Path, capsys) -> None:
    rows = [r for r in dev_a_rows() if r.reason != "control"]
    folder = _write(tmp_path / "dev-a", rows)
    rep = audit_report(folder)
    assert rep["repeats"]["without_control"] == ["dev-a"]
    assert rep["repeats"]["all"]["wire_bytes"] == A_AGAIN  # the copies are still counted
    flat = " ".join(render_text(rep).split())
    assert (f"(what was sent or received again): at least {A_AGAIN:,} of the {_wire(rows):,} bytes, in 6 messages"
            in flat)
    assert ("the retransmissions and reconnections of dev-a are unknown (no MQTT control packets in its ledger)."
            in flat)
    row = comparison_row(rep)
    assert (row["repeat_bytes"], row["repeat_note"]) == (A_AGAIN, "control packets not recorded")
    table = render_comparison_text([rep, audit_report(_write(tmp_path / "dev-c", dev_c_rows()))])
    assert f"≥ {A_AGAIN:,} again" in table


def test_a_device_folder_is_never_said_to_be_never_resumed(fleet, tmp_path: Path, capsys) -> None:
    """Its resume B is what it sent or received again ("N again"), in the text, HTML and CSV
    comparison; its own text gives it in a line, its kinds largest first."""
    reports = [audit_report(f) for f in fleet]
    rows = [comparison_row(r) for r in reports]
    assert [(r["resume_bytes"], r["resume_note"], r["wire_bytes_without_resume"]) for r in rows] == [
        (None, "device ledger", None)] * 3
    assert [(r["repeat_bytes"], r["repeat_messages"], r["repeat_again_bytes"], r["repeat_dup_bytes"],
             r["repeat_reconnect_bytes"], r["repeat_note"]) for r in rows] == [
        (A_AGAIN, 6, A_AGAIN, 0, 0, ""), (B_AGAIN + B_DUP + B_RECONNECT, 13, B_AGAIN, B_DUP, B_RECONNECT, ""),
        (0, 0, 0, 0, 0, "")]

    flat = " ".join(render_text(reports[0]).split())
    assert ("Resume/reconnect cost on the device links (what was sent or received again): 5,451 of the 18,179 bytes, "
            "in 6 messages: 5,451 B copies after the first (update (up) 2× 3,080 B, global (down) 1× 2,036 B, "
            "round_start (down) 1× 141 B, receipt (down) 1× 103 B, receipt (up) 1× 91 B), 0 B retransmitted by MQTT "
            "and 0 B reconnecting.") in flat
    assert "Not counted, as no row ties them to it: their acknowledgements (PUBACK)" in flat
    flat_b = " ".join(render_text(reports[1]).split())
    assert ("6,584 of the 15,738 bytes, in 13 messages: 4,912 B copies after the first (global (down) 2× 3,098 B, "
            "update (up) 1× 1,540 B, receipt (down) 1× 103 B, receipt (up) 1× 91 B, resend (up) 1× 80 B), 1,540 B "
            "retransmitted by MQTT (PUBLISH-DUP (up) 1× 1,540 B) and 132 B reconnecting (SUBSCRIBE (up) 2× 60 B, "
            "CONNECT (up) 1× 58 B, SUBACK (down) 2× 10 B, CONNACK (down) 1× 4 B).") in flat_b

    text = render_comparison_text(reports)
    cells = {line.split()[0]: line for line in text[:text.index("Model tensors")].splitlines()
             if line.split()[:1] in (["dev-a"], ["dev-b"], ["dev-c"])}
    assert "5,451 again" in cells["dev-a"] and "6,584 again" in cells["dev-b"] and "0 again" in cells["dev-c"]
    flat = " ".join(text.split())
    assert "resume B: N again: a device's own ledger, where no resume is noted" in flat
    assert "never resumed" not in flat  # that legend is for the runs whose server's rows would note a resume

    page = render_html(reports)
    assert "5,451 again" in page and "Resume/reconnect cost: what the devices sent or received again" in page
    assert "never resumed" not in page
    assert html.escape("5,451 of the 18,179 bytes, in 6 messages") in page

    out = tmp_path / "csv"
    write_csv(reports, out)
    with (out / "comparison.csv").open(encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    assert [(r["resume_bytes"], r["resume_note"], r["repeat_bytes"], r["repeat_dup_bytes"]) for r in table] == [
        ("", "device ledger", str(A_AGAIN), "0"), ("", "device ledger", "6584", str(B_DUP)),
        ("", "device ledger", "0", "0")]


def test_json_fleet_total_is_the_sum_of_the_folders_and_what_the_text_prints(fleet, capsys) -> None:
    """``fedfleet audit --json`` of a fleet's agent folders carries, in each report, the fleet total
    the text prints: each folder's up and down bytes are summed here from the rows written, in Python."""
    per_rows = [dev_a_rows(), dev_b_rows(), dev_c_rows()]
    up = sum(_wire(rows, "up") for rows in per_rows)
    down = sum(_wire(rows, "down") for rows in per_rows)
    messages = sum(1 for rows in per_rows for r in rows if r.event in ("sent", "received", "rejected"))
    assert up + down == A_TOTAL + B_TOTAL + C_TOTAL == 42863

    assert main_audit([str(f) for f in fleet] + ["--json"]) == 0
    reps = json.loads(capsys.readouterr().out)
    assert [r["run"]["path"] for r in reps] == [str(f) for f in fleet]
    expected = {"federation": FED, "runs": 3, "ledgers": 3, "up_bytes": up, "down_bytes": down, "wire_bytes": up + down,
                "messages": messages, "repeat_bytes": A_AGAIN + B_AGAIN + B_DUP + B_RECONNECT,
                "repeat_messages": 6 + 13, "repeat_unknown": []}
    assert all(r["fleet_total"] == expected for r in reps)  # the same object in every report
    assert fleet_total([audit_report(f) for f in fleet]) == expected

    assert main_audit([str(f) for f in fleet]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    m = re.search(r"Fleet total of federation (\S+) \((\d+) device ledgers\): up ([\d,]+) B, down "
                  r"([\d,]+) B, ([\d,]+) B in ([\d,]+) messages; sent or received again \(resume/reconnect cost\): "
                  r"([\d,]+) B in ([\d,]+) messages", flat)
    assert m, flat[flat.find("Fleet total"):][:300]
    printed = [m.group(1), int(m.group(2)), *(int(g.replace(",", "")) for g in m.groups()[2:])]
    fleet_json = reps[0]["fleet_total"]
    assert printed == [fleet_json["federation"], fleet_json["runs"], fleet_json["up_bytes"], fleet_json["down_bytes"],
                       fleet_json["wire_bytes"], fleet_json["messages"], fleet_json["repeat_bytes"],
                       fleet_json["repeat_messages"]]


def test_json_fleet_total_is_null_for_one_folder_or_folders_of_other_federations(fleet, tmp_path: Path,
                                                                                  capsys) -> None:
    assert main_audit([str(fleet[0]), "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["run"]["path"] == str(fleet[0]) and one["fleet_total"] is None
    other = _write(tmp_path / "other" / "dev-c", dev_c_rows(), federation="fleet-y")
    assert main_audit([str(fleet[0]), str(other), "--json"]) == 0
    assert [r["fleet_total"] for r in json.loads(capsys.readouterr().out)] == [None, None]
    assert main_audit([str(fleet[0]), str(other)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Fleet total" not in text
    assert ("No fleet total: the ledgers are of 2 federations (fleet-x, fleet-y); a fleet total sums the ledgers "
            "of one") in text


def test_a_server_folder_in_the_fleet_adds_no_device_ledger(fleet, tmp_path: Path, capsys) -> None:
    """The three devices' folders and a server's (dev-c's rows as the server side writes them: no
    device-link row): the fleet total is the three devices' sum, ``runs`` counts the 3 device
    ledgers, ``ledgers`` all 4, and the text says the fourth adds nothing."""
    server = _write(tmp_path / "server", [replace(r, side="server", node="server") for r in dev_c_rows()])
    devices = fleet_total([audit_report(f) for f in fleet])
    assert devices is not None and devices["runs"] == devices["ledgers"] == 3
    assert main_audit([*(str(f) for f in fleet), str(server), "--json"]) == 0
    total = json.loads(capsys.readouterr().out)[0]["fleet_total"]
    assert total == {**devices, "runs": 3, "ledgers": 4}
    assert main_audit([*(str(f) for f in fleet), str(server)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (f"Fleet total of federation {FED} (3 device ledgers; 1 other ledger, without device-link rows (a "
            f"server's), adds nothing): up {devices['up_bytes']:,} B") in text
