"""The audit's SQL queries (broker_server.audit._queries, ._fields) against a second method.

A ledger of known rows is built by a seeded generator: several rounds, the session (round NULL
and round 0), three clients, both sides, every event, control packets, chunked transfers,
signed and encrypted rows, rejected rows, JSON ``fields`` columns, and sent packets the socket took
only part of (``unsent_bytes``). Every expected number is a plain Python sum over those rows,
written out below from the definitions of the audit (device view: the agents'
sent/received/rejected rows; wire = MQTT header + topic + payload − unsent; …), never
by calling the audit. The queries run both on the ledger file (the connection ``audit_report``
uses) and on the same rows as dicts (loaded into an in-memory table).
"""

from __future__ import annotations

import json
import random
import sqlite3
from collections import defaultdict
from dataclasses import asdict

import pytest

import broker_server.audit as audit
from broker_server.audit import (
    audit_report,
    body_fields,
    by_client,
    by_kind,
    by_round,
    by_round_kind,
    cumulative_bytes,
    cumulative_parts,
    link_time_s,
    load_run,
    open_ledger,
    rejected,
    render_html,
    render_text,
    totals,
)
from broker_server.audit._queries import deliveries
from protocol.ledger import Ledger, LedgerRow

FED = "fed-sql"
CLIENTS = ("a1", "a2", "a3")
CONTROL = ("CONNECT", "CONNACK", "PUBACK", "PINGREQ", "DISCONNECT")


def _make_rows(seed: int = 7, n: int = 400) -> list[LedgerRow]:
    rng = random.Random(seed)
    cut = random.Random(seed + 1)  # which sent packets a lost connection cut short (its own stream)
    rows = []

    def unsent(event: str, whole: int) -> int:
        return cut.randint(1, whole - 1) if event == "sent" and whole > 1 and cut.random() < 0.15 else 0
    for _ in range(n):
        side = rng.choice(("agent", "server"))
        client = rng.choice(CLIENTS)
        control = rng.random() < 0.2
        if control:
            kind, direction = rng.choice(CONTROL), rng.choice(("up", "down"))
            event, size = rng.choice(("sent", "received")), rng.randint(2, 30)
            rows.append(LedgerRow(federation=FED, side=side, node=client if side == "agent" else "server",
                                  event=event, direction=direction, kind=kind, round=None,
                                  client=client if side == "agent" else "*", sender=None, seq=None, topic="",
                                  topic_bytes=0, mqtt_header_bytes=size, envelope_bytes=0,
                                  body_bytes=0, payload_bytes=0, qos=0, reason="control",
                                  unsent_bytes=unsent(event, size)))
            continue
        kind, direction = rng.choice((("update", "up"), ("global", "down"), ("status", "up"), ("join", "up")))
        event = rng.choices(("sent", "received", "rejected", "message"), weights=(5, 5, 1, 1))[0]
        rnd = rng.choice((1, 2, 3, 4, 0, None)) if kind in ("update", "global") else rng.choice((0, None))
        chunk = rng.random() < 0.2 and event in ("sent", "received")
        envelope, body = rng.randint(10, 60), rng.randint(0, 5000)
        sig = rng.choice((0, 0, 77))
        enc = rng.choice((0, 0, 28))
        fields = ""
        if kind in ("update", "global") and not chunk:
            f = {"tensors": rng.choice((1, rng.randint(2, 3000))), "meta": rng.randint(1, 40)}
            if rng.random() < 0.5:
                f["extras"] = 1
                for name in rng.sample(("prototypes", "soft_predictions", "teacher"), rng.randint(1, 3)):
                    f[f"extras.{name}"] = rng.randint(5, 900)
            elif rng.random() < 0.3:
                f["extras"] = rng.randint(5, 900)  # a receiver's lump
            fields = rng.choice((json.dumps(f), json.dumps(f), "", "not json", "[1, 2]"))
        topic = f"fedfleet/v1/{FED}/{direction}/{client}/{kind}"
        header = rng.randint(2, 5)
        rows.append(LedgerRow(
            federation=FED, side=side, node=client if side == "agent" else "server", event=event,
            direction=direction, kind=kind, round=rnd, client=client if (side == "agent" or direction == "up") else "*",
            sender=None, seq=None, topic=topic, topic_bytes=len(topic), mqtt_header_bytes=header,
            envelope_bytes=envelope, body_bytes=body, payload_bytes=envelope + body + sig + enc, qos=1,
            codec=rng.choice(("fp32", "int8+zstd", "fp32,prototypes=fp16", "")), reason="bad" if event == "rejected"
            else "", raw_bytes=rng.randint(0, 9000), fields=fields,
            transfer_id=f"t{rng.randint(0, 9)}" if chunk or event == "message" else None,
            chunk_index=rng.randint(0, 3) if chunk else None, chunk_count=4 if chunk else None,
            sig_bytes=sig, enc_bytes=enc,
            unsent_bytes=unsent(event, header + len(topic) + envelope + body + sig + enc)))
    return rows


# --------------------------------------------------------------------------------------------
# The second method: plain Python over the rows, from the definitions


def _wire(r: LedgerRow) -> int:
    return r.mqtt_header_bytes + r.topic_bytes + r.payload_bytes - r.unsent_bytes


def _view(rows, side="agent"):
    return [r for r in rows if r.side == side and r.event in ("sent", "received", "rejected")]


def _sums(rows) -> dict:
    app = [r for r in rows if r.reason != "control"]
    ctl = [r for r in rows if r.reason == "control"]
    wire = sum(_wire(r) for r in rows)
    body = sum(r.body_bytes for r in app)
    return {"messages": len(rows), "body_bytes": body, "envelope_bytes": sum(r.envelope_bytes for r in app),
            "mqtt_bytes": sum(r.mqtt_header_bytes + r.topic_bytes for r in app), "control_messages": len(ctl),
            "control_bytes": sum(_wire(r) for r in ctl), "wire_bytes": wire,
            "overhead_share": (wire - body) / wire if wire else None,
            "sig_bytes": sum(r.sig_bytes for r in app), "enc_bytes": sum(r.enc_bytes for r in app),
            "unsent_bytes": sum(r.unsent_bytes for r in app), "signed_messages": sum(r.sig_bytes > 0 for r in app),
            "encrypted_messages": sum(r.enc_bytes > 0 for r in app)}


def _round_order(rnd):
    return (rnd is None, rnd or 0)


@pytest.fixture(scope="module")
def ledger(tmp_path_factory):
    """(run folder, rows as LedgerRow, rows as read back from the file)."""
    rows = _make_rows()
    run = tmp_path_factory.mktemp("sql") / "run"
    with Ledger(run / "ledger.sqlite") as led:
        for r in rows:
            led.record(r)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"round": k, "accuracy": a}) + "\n"
                                               for k, a in ((1, 0.3), (2, 0.6), (3, 0.55), (4, 0.9))))
    return run, rows, load_run(run).rows


@pytest.fixture(params=["file", "rows"])
def source(request, ledger):
    """The ledger as the queries take it: an open connection on the file, or the rows as dicts."""
    run, _, dict_rows = ledger
    if request.param == "rows":
        yield dict_rows
        return
    db = open_ledger(run)
    yield db
    db.close()


def test_the_generated_ledger_covers_every_case(ledger):
    _, rows, _ = ledger
    events = {r.event for r in rows}
    assert events == {"sent", "received", "rejected", "message"}
    assert {r.round for r in rows} >= {None, 0, 1, 2, 3, 4}
    assert any(r.reason == "control" for r in _view(rows)) and any(r.chunk_index is not None for r in rows)
    assert any(r.sig_bytes for r in _view(rows)) and any(r.enc_bytes for r in _view(rows))
    for side in ("agent", "server"):  # cut packets: application and control, in both views
        assert any(r.unsent_bytes and r.reason != "control" for r in _view(rows, side))
        assert any(r.unsent_bytes and r.reason == "control" for r in _view(rows, side))


@pytest.mark.parametrize("view, side", [("device", "agent"), ("server", "server")])
def test_totals_equal_python_sums(source, ledger, view, side):
    mine = _view(ledger[1], side)
    expected = {"view": view, "up": _sums([r for r in mine if r.direction == "up"]),
                "down": _sums([r for r in mine if r.direction != "up"]), "all": _sums(mine)}
    got = totals(source, view)
    assert got == expected
    for t in (got["up"], got["down"], got["all"]):  # the parts size whole packets: less what never went out
        assert t["wire_bytes"] == (t["body_bytes"] + t["envelope_bytes"] + t["sig_bytes"] + t["enc_bytes"]
                                   + t["mqtt_bytes"] + t["control_bytes"] - t["unsent_bytes"])
    assert got["all"]["unsent_bytes"] > 0


@pytest.mark.parametrize("view, side", [("device", "agent"), ("server", "server")])
def test_by_round_equals_python_sums(source, ledger, view, side):
    groups = defaultdict(list)
    for r in _view(ledger[1], side):
        groups[r.round].append(r)
    expected = []
    for rnd in sorted(groups, key=_round_order):
        up = [r for r in groups[rnd] if r.direction == "up"]
        down = [r for r in groups[rnd] if r.direction != "up"]
        wire, body = sum(map(_wire, groups[rnd])), sum(r.body_bytes for r in groups[rnd] if r.reason != "control")
        expected.append({"round": rnd, "up_messages": len(up), "up_bytes": sum(map(_wire, up)),
                         "up_body_bytes": sum(r.body_bytes for r in up if r.reason != "control"),
                         "down_messages": len(down), "down_bytes": sum(map(_wire, down)),
                         "down_body_bytes": sum(r.body_bytes for r in down if r.reason != "control"),
                         "overhead_share": (wire - body) / wire if wire else None})
    assert by_round(source, view) == expected
    assert [r["round"] for r in expected][-1] is None and 0 in [r["round"] for r in expected]


def test_by_client_by_kind_by_round_kind_equal_python_sums(source, ledger):
    dev = _view(ledger[1])
    clients = sorted({r.client for r in dev})
    assert by_client(source) == [
        {"client": c, "up_messages": sum(r.client == c and r.direction == "up" for r in dev),
         "up_bytes": sum(_wire(r) for r in dev if r.client == c and r.direction == "up"),
         "down_messages": sum(r.client == c and r.direction != "up" for r in dev),
         "down_bytes": sum(_wire(r) for r in dev if r.client == c and r.direction != "up"),
         "body_bytes": sum(r.body_bytes for r in dev if r.client == c and r.reason != "control")}
        for c in clients]
    pairs = sorted({(r.kind, r.direction) for r in dev})
    assert by_kind(source) == [{"kind": k, "direction": d, **_sums([r for r in dev if (r.kind, r.direction) == (k, d)])}
                               for k, d in pairs]
    triples = sorted({(r.round, r.kind, r.direction) for r in dev}, key=lambda t: (_round_order(t[0]), t[1], t[2]))
    assert by_round_kind(source) == [
        {"round": rnd, "kind": k, "direction": d, "control": k in CONTROL,
         "messages": sum((r.round, r.kind, r.direction) == (rnd, k, d) for r in dev),
         "wire_bytes": sum(_wire(r) for r in dev if (r.round, r.kind, r.direction) == (rnd, k, d))}
        for rnd, k, d in triples]
    # The device view's per-client bytes add up to its totals.
    assert sum(c["up_bytes"] + c["down_bytes"] for c in by_client(source)) == sum(map(_wire, dev))


def test_rejected_and_cumulative_bytes_equal_python(source, ledger):
    rows = ledger[1]
    assert rejected(source) == [{"side": r.side, "node": r.node, "topic": r.topic, "reason": r.reason,
                                 "payload_bytes": r.payload_bytes} for r in rows if r.event == "rejected"]
    dev = _view(rows)
    expected = {}
    for target in (-1, 0, 1, 2, 3, 4, 9):
        mine = [i for i, r in enumerate(dev) if r.round is not None and 1 <= r.round <= target]
        if not mine:
            expected[target] = 0
            continue
        last = max(mine)
        session = [i for i, r in enumerate(dev) if (r.round is None or r.round < 1) and i < last]
        expected[target] = sum(_wire(dev[i]) for i in mine + session)
    assert cumulative_bytes(source, list(expected)) == expected


def test_cumulative_parts_equal_python(source, ledger):
    dev = _view(ledger[1])
    for target in (-1, 0, 1, 2, 3, 4, 9):
        mine = [i for i, r in enumerate(dev) if r.round is not None and 1 <= r.round <= target]
        last = max(mine, default=-1)
        zero = [dev[i] for i, r in enumerate(dev) if r.round is not None and r.round < 1 and i < last]
        session = [dev[i] for i, r in enumerate(dev) if r.round is None and i < last]
        expected = {"round": target, "last_round": max((dev[i].round for i in mine), default=None),
                    "rounds_bytes": sum(_wire(dev[i]) for i in mine), "rounds_messages": len(mine),
                    "round0_bytes": sum(map(_wire, zero)), "round0_messages": len(zero),
                    "round0_all_bytes": sum(_wire(r) for r in dev if r.round is not None and r.round < 1),
                    "session_bytes": sum(map(_wire, session)), "session_messages": len(session),
                    "session_control_messages": sum(r.reason == "control" for r in session),
                    "session_all_bytes": sum(_wire(r) for r in dev if r.round is None)}
        expected["wire_bytes"] = expected["rounds_bytes"] + expected["round0_bytes"] + expected["session_bytes"]
        assert cumulative_parts(source, target) == expected, target
        assert expected["wire_bytes"] == cumulative_bytes(source, [target])[target], target
    assert 0 < cumulative_parts(source, 2)["session_control_messages"] < cumulative_parts(source, 2)["session_messages"]


@pytest.mark.parametrize("view, side", [("device", "agent"), ("server", "server")])
def test_by_kind_equals_python_sums_in_each_view(source, ledger, view, side):
    mine = _view(ledger[1], side)
    pairs = sorted({(r.kind, r.direction) for r in mine})
    assert by_kind(source, view) == [{"kind": k, "direction": d,
                                      **_sums([r for r in mine if (r.kind, r.direction) == (k, d)])} for k, d in pairs]


def test_deliveries_per_side_equal_python(source, ledger):
    rows = ledger[1]
    out = deliveries(source)
    for side in ("agent", "server"):
        sent = [r for r in rows if r.side == side and r.event == "sent" and r.reason != "control"]
        # the generated rows carry no delivery: every sent PUBLISH is 'unknown' (an older ledger)
        assert out["by_side"][side] == {"acked": 0, "handed": 0, "refused": 0, "unknown": len(sent),
                                        "dropped": 0, "not_handed": 0, "undeliverable": 0, "not_sent": 0,
                                        "sent": len(sent)}, side
    assert out["unknown"] == out["by_side"]["agent"]["unknown"] + out["by_side"]["server"]["unknown"] > 0


def test_link_time_equals_python(source, ledger):
    per = defaultdict(lambda: defaultdict(int))
    for r in _view(ledger[1]):
        per[(r.round, "up" if r.direction == "up" else "down")][r.client] += _wire(r)
    t = link_time_s(source, 80, 8)  # 10,000 and 1,000 bytes/s
    rounds = sorted({k[0] for k in per}, key=_round_order)
    assert [e["round"] for e in t["per_round"]] == rounds
    for e in t["per_round"]:
        up, down = per[(e["round"], "up")], per[(e["round"], "down")]
        assert e["up_max_s"] == pytest.approx(max(up.values(), default=0) / 10_000)
        assert e["up_sum_s"] == pytest.approx(sum(up.values()) / 10_000)
        assert e["down_max_s"] == pytest.approx(max(down.values(), default=0) / 1_000)
        assert e["down_sum_s"] == pytest.approx(sum(down.values()) / 1_000)


def _expected_fields(rows, kind, direction, side, skip_event):
    """body_fields of one group by the definition: whole-message rows of the side, fields parsed by json."""
    mine = [r for r in rows if r.kind == kind and r.direction == direction and r.side == side and r.event != skip_event
            and (r.event == "message" or (r.event in ("sent", "received") and r.chunk_index is None))]
    per_field, count, order, raw = defaultdict(int), defaultdict(int), [], {}
    for r in mine:
        try:
            f = json.loads(r.fields) if r.fields else {}
        except json.JSONDecodeError:
            f = {}
        f = f if isinstance(f, dict) else {}
        per_entry = any(k.startswith("extras.") for k in f)
        parts = [(k, v) for k, v in f.items() if k == "tensors" or k.startswith("extras.")
                 or (k == "extras" and not per_entry)]
        bearing = [k for k, v in parts if not (k == "tensors" and v <= 1)]
        for k, v in parts:
            per_field[k] += v
            count[k] += 1
            if k not in order:
                order.append(k)
            share = 0 if k not in bearing else (r.raw_bytes if len(bearing) == 1 else None)
            raw[k] = None if raw.get(k, 0) is None or share is None else raw.get(k, 0) + share
    order.sort(key=lambda k: k != "tensors")
    return mine, [(k, count[k], per_field[k], raw[k]) for k in order]


def test_body_fields_equal_python_json(source, ledger):
    rows = ledger[1]
    groups = body_fields(source)
    assert [(g["kind"], g["source"]) for g in groups] == [("global", "sender"), ("update", "sender")]
    for g, (kind, direction, side, skip) in zip(groups, (("global", "down", "server", "received"),
                                                         ("update", "up", "agent", "received")), strict=True):
        mine, fields = _expected_fields(rows, kind, direction, side, skip)
        message_bytes = sum(r.envelope_bytes + r.body_bytes for r in mine)
        assert (g["messages"], g["message_bytes"], g["raw_bytes"], g["chunked_messages"]) == (
            len(mine), message_bytes, sum(r.raw_bytes for r in mine), sum(r.transfer_id is not None for r in mine))
        assert g["client_rounds"] == len({(r.client, r.round) for r in mine})
        assert [(f["field"], f["messages"], f["bytes"], f["raw_bytes"]) for f in g["fields"][:-1]] == fields
        assert g["fields"][-1]["bytes"] == message_bytes - sum(b for _, _, b, _ in fields)
        assert g["tensor_bytes"] == sum(b for k, _, b, _ in fields if k == "tensors")


def test_report_on_the_file_equals_the_queries_on_rows(ledger):
    run, _, dict_rows = ledger
    rep = audit_report(run, target=0.5)
    assert rep["totals"]["device"] == totals(dict_rows) and rep["by_round"] == by_round(dict_rows)
    assert rep["fields"] == body_fields(dict_rows) and rep["rejected"] == rejected(dict_rows)
    assert rep["target"] == {"accuracy": 0.5, "round": 2, "bytes": cumulative_bytes(dict_rows, [2])[2],
                             "parts": cumulative_parts(dict_rows, 2)}
    assert rep["by_kind_server"] == by_kind(dict_rows, "server")
    assert rep["run"]["rounds"] == 4 and rep["ledger_closed"] is True


# --------------------------------------------------------------------------------------------
# By hand: four rows whose sums are worked out in the comments


def _hand_rows() -> list[dict]:
    base = {"federation": FED, "side": "agent", "topic": "t", "reason": "", "fields": ""}
    return [
        # a1 uploads in round 1: wire 3 + 1 + (10 + 100) = 114, body 100
        {**base, "event": "sent", "direction": "up", "kind": "update", "round": 1, "client": "a1",
         "mqtt_header_bytes": 3, "topic_bytes": 1, "envelope_bytes": 10, "body_bytes": 100, "payload_bytes": 110},
        # a2 receives the round-1 global: wire 3 + 1 + (20 + 200) = 224, body 200
        {**base, "event": "received", "direction": "down", "kind": "global", "round": 1, "client": "a2",
         "mqtt_header_bytes": 3, "topic_bytes": 1, "envelope_bytes": 20, "body_bytes": 200, "payload_bytes": 220},
        # a1's CONNECT: 14 bytes, all control, in the session
        {**base, "event": "sent", "direction": "up", "kind": "CONNECT", "round": None, "client": "a1",
         "reason": "control", "mqtt_header_bytes": 14, "topic_bytes": 0, "envelope_bytes": 0, "body_bytes": 0,
         "payload_bytes": 0},
        # the server's copy of a1's upload: not on a device link
        {**base, "side": "server", "event": "received", "direction": "up", "kind": "update", "round": 1,
         "client": "a1", "mqtt_header_bytes": 3, "topic_bytes": 1, "envelope_bytes": 10, "body_bytes": 100,
         "payload_bytes": 110},
    ]


def test_hand_sums():
    rows = _hand_rows()
    t = totals(rows)
    assert (t["up"]["wire_bytes"], t["down"]["wire_bytes"], t["all"]["wire_bytes"]) == (114 + 14, 224, 352)
    assert (t["all"]["body_bytes"], t["all"]["control_bytes"], t["all"]["mqtt_bytes"]) == (300, 14, 8)
    assert [(r["round"], r["up_bytes"], r["down_bytes"]) for r in by_round(rows)] == [(1, 114, 224), (None, 14, 0)]
    assert [(c["client"], c["up_bytes"], c["down_bytes"]) for c in by_client(rows)] == [("a1", 128, 0),
                                                                                         ("a2", 0, 224)]
    assert totals(rows, "server")["all"]["wire_bytes"] == 114
    assert cumulative_bytes(rows, [1]) == {1: 338}  # the CONNECT came after round 1's last row: not counted
    assert cumulative_bytes([rows[2], *rows[:2]], [1]) == {1: 352}  # before it: counted


def test_rows_in_id_order_for_cumulative_bytes():
    rows = [dict(r, id=i) for i, r in zip((3, 1, 2, 4), _hand_rows(), strict=True)]
    # By id the CONNECT (id 2) lies between the download (id 1) and the upload (id 3), before round 1 ended.
    assert cumulative_bytes(rows, [1]) == {1: 352}


# --------------------------------------------------------------------------------------------
# Ledger files: older schemas, bad fields, unclean close


def test_an_older_ledger_without_the_security_columns_reads_zero(tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    db = sqlite3.connect(run / "ledger.sqlite")
    db.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, side TEXT, event TEXT, direction TEXT, kind TEXT, "
               "round INTEGER, client TEXT, topic TEXT, topic_bytes INTEGER, mqtt_header_bytes INTEGER, "
               "envelope_bytes INTEGER, body_bytes INTEGER, payload_bytes INTEGER)")
    db.execute("INSERT INTO messages VALUES (1, 'agent', 'sent', 'up', 'update', 1, 'a1', 't', 1, 3, 10, 100, 110)")
    db.commit()
    db.close()
    rep = audit_report(run)
    assert rep["totals"]["device"]["all"]["wire_bytes"] == 114
    assert rep["totals"]["device"]["all"]["sig_bytes"] == 0 and rep["fields"][0]["fields"][-1]["bytes"] == 110


def test_fields_that_are_not_a_json_object_count_as_other():
    row = {"side": "agent", "event": "sent", "direction": "up", "kind": "update", "round": 1, "client": "a1",
           "envelope_bytes": 10, "body_bytes": 90}
    bad = [dict(row, fields=f) for f in ("", "not json", "[1, 2]", '"text"', json.dumps({"tensors": 50}))]
    (g,) = body_fields(bad)
    assert g["messages"] == 5 and g["message_bytes"] == 500
    assert [(f["field"], f["messages"], f["bytes"]) for f in g["fields"]] == [("tensors", 1, 50), ("other", 5, 450)]


def test_a_ledger_left_open_is_reported_as_not_closed_cleanly(tmp_path):
    run = tmp_path / "open"
    led = Ledger(run / "ledger.sqlite")
    try:
        for r in _hand_rows():
            led.record(LedgerRow(**r, node=r["client"], sender=None, seq=None, qos=1))
        led.flush()  # committed, but the writer is still running (as after a crash: the file is in WAL mode)
        rep = audit_report(run)
        assert rep["ledger_closed"] is False
        assert rep["totals"]["device"]["all"]["wire_bytes"] == 352  # the committed rows are all there
        line = "Ledger not closed cleanly"
        assert line in render_text(rep) and line in render_html([rep])
    finally:
        led.close()
    rep = audit_report(run)
    assert rep["ledger_closed"] is True
    assert "not closed cleanly" not in render_text(rep)


def test_public_names():
    public = sorted(n for n in vars(audit) if not n.startswith("_") and not isinstance(getattr(audit, n), type(audit)))
    assert len(audit.__all__) == len(set(audit.__all__))
    assert set(audit.__all__) == set(public) - {"annotations"}


def test_dict_rows_and_ledger_rows_agree(ledger):
    _, rows, dict_rows = ledger
    plain = [asdict(r) for r in rows]  # no id: the order given
    assert totals(plain) == totals(dict_rows) and body_fields(plain) == body_fields(dict_rows)


def test_a_connection_without_the_ledger_relation_is_refused(ledger):
    db = sqlite3.connect(ledger[0] / "ledger.sqlite")  # the raw file: a messages table, no 'ledger' view
    try:
        with pytest.raises(ValueError, match="open_ledger"):
            totals(db)
    finally:
        db.close()
