"""Tests of the communication audit (broker_server.audit) against a hand-made ledger.

The ledger below describes 2 rounds, 2 agents (a1, a2). In each round the server broadcasts one
``global`` (received by both agents) and each agent uploads one ``update``. In round 2 the server
rejects a2's update, so that upload is paid by a2's link but never counted on the server's.
Every expected number is worked out by hand from the byte columns written in ``_rows``.
"""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import asdict

import pytest

from broker_server.audit import (
    AuditError,
    RunAudit,
    audit_report,
    by_client,
    by_kind,
    by_round,
    load_run,
    main_audit,
    rejected,
    render_text,
    totals,
)
from protocol.ledger import Ledger, LedgerRow

FED = "fed-test"
T_GLOBAL = f"fedfleet/v1/{FED}/down/global"  # 32 characters
T_UP = {c: f"fedfleet/v1/{FED}/up/{c}/update" for c in ("a1", "a2")}  # 33 characters each
HDR = 5  # MQTT fixed + variable header bytes, same for every packet here
ENV_G, ENV_U = 25, 27  # envelope bytes of a global / an update
BODY_G = {1: 1000, 2: 2000}  # global body bytes per round
BODY_U = {(1, "a1"): 400, (1, "a2"): 600, (2, "a1"): 500, (2, "a2"): 700}  # update body bytes
REJECT_REASON = "sender 'a3' does not match topic client 'a2'"

# Wire bytes per packet, by hand: header + topic + (envelope + body).
G1 = 5 + 32 + (25 + 1000)  # 1062
G2 = 5 + 32 + (25 + 2000)  # 2062
U1A1 = 5 + 33 + (27 + 400)  # 465
U1A2 = 5 + 33 + (27 + 600)  # 665
U2A1 = 5 + 33 + (27 + 500)  # 565
U2A2 = 5 + 33 + (27 + 700)  # 765 (rejected by the server)


def _row(side: str, node: str, event: str, direction: str, kind: str, rnd: int | None, client: str,
         topic: str, envelope: int, body: int, reason: str = "") -> LedgerRow:
    return LedgerRow(federation=FED, side=side, node=node, event=event, direction=direction, kind=kind,
                     round=rnd, client=client, sender=None, seq=None, topic=topic,
                     topic_bytes=len(topic.encode()), mqtt_header_bytes=HDR, envelope_bytes=envelope,
                     body_bytes=body, payload_bytes=envelope + body, qos=1, reason=reason)


def _rows() -> list[LedgerRow]:
    rows = []
    for rnd in (1, 2):
        rows.append(_row("server", "server", "sent", "down", "global", rnd, "*", T_GLOBAL, ENV_G, BODY_G[rnd]))
        for c in ("a1", "a2"):
            rows.append(_row("agent", c, "received", "down", "global", rnd, c, T_GLOBAL, ENV_G, BODY_G[rnd]))
        for c in ("a1", "a2"):
            body = BODY_U[(rnd, c)]
            rows.append(_row("agent", c, "sent", "up", "update", rnd, c, T_UP[c], ENV_U, body))
            if (rnd, c) == (2, "a2"):
                # What channel.accept writes: kind 'invalid', no round, all payload counted as envelope.
                rows.append(_row("server", "server", "rejected", "up", "invalid", None, c, T_UP[c],
                                 ENV_U + body, 0, reason=REJECT_REASON))
            else:
                rows.append(_row("server", "server", "received", "up", "update", rnd, c, T_UP[c], ENV_U, body))
    return rows


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run-1"
    with Ledger(run / "ledger.sqlite") as ledger:
        ledger.set_meta("federation", FED)
        for r in _rows():
            ledger.record(r)
    metrics = [
        {"round": 1, "accuracy": 0.5, "loss": 1.2, "clients_reported": 2, "bytes_up": 0, "bytes_down": 0,
         "seconds": 1.0},
        {"round": 2, "accuracy": 0.75, "loss": 0.8, "clients_reported": 1, "bytes_up": 0, "bytes_down": 0,
         "seconds": 1.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return run


@pytest.fixture
def rows(run_dir):
    return load_run(run_dir).rows


def test_hand_numbers_are_consistent():
    assert len(T_GLOBAL) == 32 and all(len(t) == 33 for t in T_UP.values())
    assert (G1, G2, U1A1, U1A2, U2A1, U2A2) == (1062, 2062, 465, 665, 565, 765)


def test_load_run(run_dir):
    run = load_run(run_dir)
    assert isinstance(run, RunAudit)
    assert len(run.rows) == 14  # 7 per round
    assert run.meta["federation"] == FED
    assert [m["round"] for m in run.metrics] == [1, 2]


def test_totals_device_view(rows):
    t = totals(rows, "device")
    assert t["view"] == "device"
    up_body = 400 + 600 + 500 + 700
    down_body = 2 * 1000 + 2 * 2000  # each broadcast counted once per receiving agent
    assert t["up"] == {"messages": 4, "body_bytes": up_body, "envelope_bytes": 4 * 27,
                       "mqtt_bytes": 4 * (5 + 33), "wire_bytes": U1A1 + U1A2 + U2A1 + U2A2,
                       "overhead_share": pytest.approx((2460 - up_body) / 2460)}
    assert t["up"]["wire_bytes"] == 2460
    assert t["down"] == {"messages": 4, "body_bytes": down_body, "envelope_bytes": 4 * 25,
                         "mqtt_bytes": 4 * (5 + 32), "wire_bytes": 2 * G1 + 2 * G2,
                         "overhead_share": pytest.approx((6248 - down_body) / 6248)}
    assert t["down"]["wire_bytes"] == 6248
    assert t["all"]["messages"] == 8
    assert t["all"]["body_bytes"] == 8200
    assert t["all"]["envelope_bytes"] == 208
    assert t["all"]["mqtt_bytes"] == 300
    assert t["all"]["wire_bytes"] == 8708 == 8200 + 208 + 300
    assert t["all"]["overhead_share"] == pytest.approx(508 / 8708)


def test_totals_server_view(rows):
    t = totals(rows, "server")
    # Broadcast once per round; the rejected upload is not in the server's counted traffic.
    assert t["down"]["messages"] == 2
    assert t["down"]["wire_bytes"] == G1 + G2 == 3124
    assert t["down"]["body_bytes"] == 3000
    assert t["up"]["messages"] == 3
    assert t["up"]["wire_bytes"] == U1A1 + U1A2 + U2A1 == 1695
    assert t["up"]["body_bytes"] == 1500
    assert t["all"]["wire_bytes"] == 4819
    assert t["all"]["overhead_share"] == pytest.approx((4819 - 4500) / 4819)


def test_server_view_differs_from_device_view_as_defined(rows):
    dev, srv = totals(rows, "device"), totals(rows, "server")
    n_agents = 2
    # Downloads: the device side pays each broadcast once per agent that received it.
    for key in ("messages", "body_bytes", "envelope_bytes", "mqtt_bytes", "wire_bytes"):
        assert dev["down"][key] == n_agents * srv["down"][key]
    # Uploads: identical except for the one upload the server rejected.
    assert dev["up"]["messages"] - srv["up"]["messages"] == 1
    assert dev["up"]["wire_bytes"] - srv["up"]["wire_bytes"] == U2A2
    # Per client in the server view, a broadcast is one row for client '*'.
    srv_clients = {c["client"]: c for c in by_client(rows, "server")}
    assert srv_clients["*"]["down_messages"] == 2 and srv_clients["*"]["down_bytes"] == G1 + G2
    assert srv_clients["a2"]["up_messages"] == 1 and srv_clients["a2"]["up_bytes"] == U1A2


def test_by_round(rows):
    assert by_round(rows) == [
        {"round": 1, "up_messages": 2, "up_bytes": U1A1 + U1A2, "up_body_bytes": 1000,
         "down_messages": 2, "down_bytes": 2 * G1, "down_body_bytes": 2000,
         "overhead_share": pytest.approx((1130 + 2124 - 3000) / (1130 + 2124))},
        {"round": 2, "up_messages": 2, "up_bytes": U2A1 + U2A2, "up_body_bytes": 1200,
         "down_messages": 2, "down_bytes": 2 * G2, "down_body_bytes": 4000,
         "overhead_share": pytest.approx((1330 + 4124 - 5200) / (1330 + 4124))},
    ]
    srv = by_round(rows, "server")
    assert [(r["round"], r["up_messages"], r["down_messages"]) for r in srv] == [(1, 2, 1), (2, 1, 1)]
    assert srv[1]["up_bytes"] == U2A1 and srv[1]["down_bytes"] == G2


def test_by_round_without_round_sorted_last():
    base = _row("agent", "a1", "sent", "up", "status", None, "a1", f"fedfleet/v1/{FED}/status/a1", 10, 0)
    later = _row("agent", "a1", "sent", "up", "update", 3, "a1", T_UP["a1"], ENV_U, 1)
    out = by_round([asdict(base), asdict(later)])
    assert [r["round"] for r in out] == [3, None]
    assert out[1]["overhead_share"] == 1.0  # no body at all


def test_by_client(rows):
    assert by_client(rows) == [
        {"client": "a1", "up_messages": 2, "up_bytes": U1A1 + U2A1, "down_messages": 2,
         "down_bytes": G1 + G2, "body_bytes": 400 + 500 + 1000 + 2000},
        {"client": "a2", "up_messages": 2, "up_bytes": U1A2 + U2A2, "down_messages": 2,
         "down_bytes": G1 + G2, "body_bytes": 600 + 700 + 1000 + 2000},
    ]


def test_by_kind(rows):
    assert by_kind(rows) == [
        {"kind": "global", "direction": "down", "messages": 4, "body_bytes": 6000, "envelope_bytes": 100,
         "mqtt_bytes": 148, "wire_bytes": 6248, "overhead_share": pytest.approx(248 / 6248)},
        {"kind": "update", "direction": "up", "messages": 4, "body_bytes": 2200, "envelope_bytes": 108,
         "mqtt_bytes": 152, "wire_bytes": 2460, "overhead_share": pytest.approx(260 / 2460)},
    ]


def test_rejected(rows):
    assert rejected(rows) == [{"side": "server", "node": "server", "topic": T_UP["a2"],
                               "reason": REJECT_REASON, "payload_bytes": 27 + 700}]


@pytest.mark.parametrize("fn", [by_round, by_client, by_kind, totals])
def test_unknown_view_raises(rows, fn):
    with pytest.raises(ValueError, match="view"):
        fn(rows, "broker")


def test_empty_ledger_totals_are_zero():
    t = totals([], "device")
    assert t["all"] == {"messages": 0, "body_bytes": 0, "envelope_bytes": 0, "mqtt_bytes": 0,
                        "wire_bytes": 0, "overhead_share": None}
    assert by_round([]) == [] and by_client([]) == [] and by_kind([]) == [] and rejected([]) == []


def test_audit_report(run_dir, rows):
    rep = audit_report(run_dir)
    assert rep["run"] == {"path": str(run_dir), "federation": FED, "rounds": 2, "metrics_rounds": 2}
    assert rep["totals"]["device"] == totals(rows, "device")
    assert rep["totals"]["server"] == totals(rows, "server")
    assert rep["by_round"] == by_round(rows) and rep["by_client"] == by_client(rows)
    assert rep["by_kind"] == by_kind(rows)
    assert rep["rejected"] == rejected(rows)
    assert rep["rejected_totals"] == {"messages": 1, "payload_bytes": 727, "wire_bytes": U2A2}
    assert rep["final_accuracy"] == 0.75
    json.dumps(rep)  # serialisable


def test_audit_report_without_metrics(run_dir):
    (run_dir / "metrics.jsonl").unlink()
    rep = audit_report(run_dir)
    assert rep["final_accuracy"] is None and rep["run"]["metrics_rounds"] == 0


def test_render_text_sections(run_dir):
    text = render_text(audit_report(run_dir))
    for section in ("Totals: device links", "Totals: server link", "Per round", "Per client",
                    "Per kind and direction", "Rejected messages: 1"):
        assert section in text
    assert "8,708" in text and "8.5 KiB" in text  # thousands separators, binary units
    assert REJECT_REASON in text
    assert "75.00 %" in text
    assert all(len(line) <= 120 for line in text.splitlines())


def _text_totals(text: str, section: str) -> dict[str, dict[str, int]]:
    """Parse the up/down/total rows of one Totals table of render_text."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(section))
    out = {}
    for line in lines[start + 1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0] in ("up", "down", "total"):
            out["all" if cells[0] == "total" else cells[0]] = {
                k: int(v.replace(",", "")) for k, v in zip(
                    ("messages", "body_bytes", "envelope_bytes", "mqtt_bytes", "wire_bytes"), cells[1:6])}
            if cells[0] == "total":
                return out
    raise AssertionError(f"no totals table under {section!r}")


def test_main_json_totals_equal_text_totals(run_dir, capsys):
    assert main_audit([str(run_dir), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert main_audit([str(run_dir)]) == 0
    text = capsys.readouterr().out
    for view, section in (("device", "Totals: device links"), ("server", "Totals: server link")):
        parsed = _text_totals(text, section)
        for key in ("up", "down", "all"):
            expected = {k: v for k, v in rep["totals"][view][key].items() if k != "overhead_share"}
            assert parsed[key] == expected, (view, key)
    assert rep["totals"]["device"]["all"]["wire_bytes"] == 8708


def test_main_missing_run_dir(tmp_path, capsys):
    missing = tmp_path / "no-such-run"
    assert main_audit([str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err
    assert err.startswith("fedfleet audit: error:") and "does not exist" in err and str(missing) in err


def test_missing_ledger(tmp_path, capsys):
    with pytest.raises(AuditError, match="no ledger.sqlite"):
        load_run(tmp_path)
    assert main_audit([str(tmp_path), "--json"]) == 2
    assert "no ledger.sqlite" in capsys.readouterr().err


def test_not_a_ledger(tmp_path):
    (tmp_path / "ledger.sqlite").write_bytes(b"this is not sqlite at all, just text" * 10)
    with pytest.raises(AuditError, match="not a readable fedfleet ledger"):
        load_run(tmp_path)


def test_sqlite_without_messages_table(tmp_path):
    db = sqlite3.connect(tmp_path / "ledger.sqlite")
    db.execute("CREATE TABLE other (x INTEGER)")
    db.commit()
    db.close()
    with pytest.raises(AuditError, match="not a readable fedfleet ledger"):
        load_run(tmp_path)


def test_bad_metrics_line(run_dir):
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write("[1, 2]\n")
    with pytest.raises(AuditError, match=r"metrics.jsonl:3: expected a JSON object"):
        load_run(run_dir)
