"""Tests of the communication audit (broker_server.audit) against a hand-made ledger.

The ledger below describes 2 rounds, 2 agents (a1, a2). In each round the server broadcasts one
``global`` (received by both agents) and each agent uploads one ``update``. In round 2 the server
rejects a2's update, so that upload is paid by a2's link but never counted on the server's.
Every expected number is worked out by hand from the byte columns written in ``_rows``.
"""

from __future__ import annotations

import csv
import html
import json
import re
import sqlite3
import sys
from dataclasses import asdict, replace

import matplotlib
import pytest

matplotlib.use("Agg")

from broker_server.audit import (  # noqa: E402
    AuditError,
    RunAudit,
    _short_run_labels,
    accuracy_curve,
    audit_report,
    body_fields,
    by_client,
    by_kind,
    by_round,
    bytes_to_target,
    comparison_row,
    cumulative_bytes,
    field_bytes_per_client_round,
    field_codecs,
    link_time_s,
    load_run,
    main_audit,
    rejected,
    render_comparison_text,
    render_html,
    render_text,
    totals,
    whole_message,
    write_html,
)
from broker_server.audit._format import target_text  # noqa: E402
from broker_server.cli import main as fedfleet_main  # noqa: E402
from protocol.ledger import Ledger, LedgerRow  # noqa: E402

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
                       "mqtt_bytes": 4 * (5 + 33), "control_messages": 0, "control_bytes": 0,
                       "sig_bytes": 0, "enc_bytes": 0, "unsent_bytes": 0, "signed_messages": 0, "encrypted_messages": 0,
                       "wire_bytes": U1A1 + U1A2 + U2A1 + U2A2,
                       "overhead_share": pytest.approx((2460 - up_body) / 2460)}
    assert t["up"]["wire_bytes"] == 2460
    assert t["down"] == {"messages": 4, "body_bytes": down_body, "envelope_bytes": 4 * 25,
                         "mqtt_bytes": 4 * (5 + 32), "control_messages": 0, "control_bytes": 0,
                         "sig_bytes": 0, "enc_bytes": 0, "unsent_bytes": 0, "signed_messages": 0,
                         "encrypted_messages": 0, "wire_bytes": 2 * G1 + 2 * G2,
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
    # Broadcast once per round; the rejected upload crossed the server's link too (its bytes count,
    # all as overhead: a rejected row has no body).
    assert t["down"]["messages"] == 2
    assert t["down"]["wire_bytes"] == G1 + G2 == 3124
    assert t["down"]["body_bytes"] == 3000
    assert t["up"]["messages"] == 4
    assert t["up"]["wire_bytes"] == U1A1 + U1A2 + U2A1 + U2A2 == 2460
    assert t["up"]["body_bytes"] == 1500
    assert t["all"]["wire_bytes"] == 5584
    assert t["all"]["overhead_share"] == pytest.approx((5584 - 4500) / 5584)


def test_server_view_differs_from_device_view_as_defined(rows):
    dev, srv = totals(rows, "device"), totals(rows, "server")
    n_agents = 2
    # Downloads: the device side pays each broadcast once per agent that received it.
    for key in ("messages", "body_bytes", "envelope_bytes", "mqtt_bytes", "wire_bytes"):
        assert dev["down"][key] == n_agents * srv["down"][key]
    # Uploads: the same bytes on both links (the rejected one crossed both); only its body is
    # missing on the server side, where a rejected payload counts as overhead.
    assert dev["up"]["messages"] == srv["up"]["messages"] == 4
    assert dev["up"]["wire_bytes"] == srv["up"]["wire_bytes"]
    assert dev["up"]["body_bytes"] - srv["up"]["body_bytes"] == 700
    # Per client in the server view, a broadcast is one row for client '*'.
    srv_clients = {c["client"]: c for c in by_client(rows, "server")}
    assert srv_clients["*"]["down_messages"] == 2 and srv_clients["*"]["down_bytes"] == G1 + G2
    assert srv_clients["a2"]["up_messages"] == 2 and srv_clients["a2"]["up_bytes"] == U1A2 + U2A2


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
    assert [(r["round"], r["up_messages"], r["down_messages"]) for r in srv] == [(1, 2, 1), (2, 1, 1), (None, 1, 0)]
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
         "mqtt_bytes": 148, "control_messages": 0, "control_bytes": 0, "wire_bytes": 6248,
         "sig_bytes": 0, "enc_bytes": 0, "unsent_bytes": 0, "signed_messages": 0, "encrypted_messages": 0,
         "overhead_share": pytest.approx(248 / 6248)},
        {"kind": "update", "direction": "up", "messages": 4, "body_bytes": 2200, "envelope_bytes": 108,
         "mqtt_bytes": 152, "control_messages": 0, "control_bytes": 0, "wire_bytes": 2460,
         "sig_bytes": 0, "enc_bytes": 0, "unsent_bytes": 0, "signed_messages": 0, "encrypted_messages": 0,
         "overhead_share": pytest.approx(260 / 2460)},
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
                        "control_messages": 0, "control_bytes": 0, "wire_bytes": 0, "overhead_share": None,
                        "sig_bytes": 0, "enc_bytes": 0, "unsent_bytes": 0, "signed_messages": 0,
                        "encrypted_messages": 0}
    assert by_round([]) == [] and by_client([]) == [] and by_kind([]) == [] and rejected([]) == []


def test_audit_report(run_dir, rows):
    rep = audit_report(run_dir)
    assert rep["run"] == {"path": str(run_dir), "federation": FED, "rounds": 2, "metrics_rounds": 2}
    assert rep["totals"]["device"] == totals(rows, "device")
    assert rep["totals"]["server"] == totals(rows, "server")
    assert rep["by_round"] == by_round(rows) and rep["by_client"] == by_client(rows)
    assert rep["by_kind"] == by_kind(rows)
    assert rep["rejected"] == rejected(rows)
    assert rep["fields"] == body_fields(rows)
    assert rep["rejected_totals"] == {"messages": 1, "payload_bytes": 727, "wire_bytes": U2A2}
    assert rep["final_accuracy"] == 0.75
    json.dumps(rep)  # serialisable


def test_audit_report_without_metrics(run_dir):
    (run_dir / "metrics.jsonl").unlink()
    rep = audit_report(run_dir)
    assert rep["final_accuracy"] is None and rep["run"]["metrics_rounds"] == 0
    # no accuracy recorded (a device's own folder): the bytes to a target are "—", not "not reached"
    row = comparison_row(rep)
    assert row["bytes_to_target"] is None and target_text(row) == "—"
    assert target_text({**row, "final_accuracy": 0.5}) == "not reached"


def test_render_text_sections(run_dir):
    text = render_text(audit_report(run_dir))
    for section in ("Totals: device links", "Totals: server link", "Per round", "Per client",
                    "Per kind and direction", "Rejected messages: 1"):
        assert section in text
    assert "8,708" in text and "8.5 KiB" in text  # thousands separators, binary units
    assert REJECT_REASON in text
    assert "75.00 %" in text
    assert all(len(line) <= 120 for line in text.splitlines())


_TEXT_COLUMNS = {"messages": "messages", "body B": "body_bytes", "envelope B": "envelope_bytes",
                 "MQTT B": "mqtt_bytes", "control B": "control_bytes", "wire B": "wire_bytes"}


def _text_totals(text: str, section: str) -> dict[str, dict[str, int]]:
    """Parse the up/down/total rows of one Totals table of render_text (columns found by header)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(section))
    headers = re.split(r"\s{2,}", lines[start + 1].strip())
    out = {}
    for line in lines[start + 2:]:
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0] in ("up", "down", "total"):
            out["all" if cells[0] == "total" else cells[0]] = {
                _TEXT_COLUMNS[h]: int(v.replace(",", "")) for h, v in zip(headers, cells) if h in _TEXT_COLUMNS}
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
            expected = {k: v for k, v in rep["totals"][view][key].items()  # security costs: their own table
                        if k not in ("overhead_share", "control_messages", "sig_bytes", "enc_bytes",
                                     "unsent_bytes", "signed_messages", "encrypted_messages")}
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
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "[1, 2]", lines[1]]) + "\n")
    with pytest.raises(AuditError, match=r"metrics.jsonl:2: expected a JSON object per round, got list"):
        load_run(run_dir)


def test_a_last_metrics_line_cut_short_by_a_killed_run_is_dropped(run_dir, caplog):
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"round": 3, "accura')
    with caplog.at_level("WARNING"):
        audit = load_run(run_dir)
    assert [m["round"] for m in audit.metrics] == [1, 2]
    assert "metrics.jsonl:3: the last line is cut short" in caplog.text



# --------------------------------------------------------------------------------------------
# Control packets, bytes to target, transfer time, HTML, CSV, several runs
#
# Control-packet rows are written as protocol.channel does: reason 'control', round NULL,
# topic '', payload 0, mqtt_header_bytes = the whole packet. Sizes used below (bytes):
CONNECT_B, CONNACK_B, PUBACK_B, DISCONNECT_B = 14, 4, 4, 2


def _ctrl(side: str, node: str, event: str, direction: str, kind: str, size: int) -> LedgerRow:
    return LedgerRow(federation=FED, side=side, node=node, event=event, direction=direction, kind=kind,
                     round=None, client=node if side == "agent" else "*", sender=None, seq=None, topic="",
                     topic_bytes=0, mqtt_header_bytes=size, envelope_bytes=0, body_bytes=0, payload_bytes=0,
                     qos=0, reason="control")


def _write_run(run, rows, metrics, meta_federation: str | None = FED):
    with Ledger(run / "ledger.sqlite") as ledger:
        if meta_federation is not None:
            ledger.set_meta("federation", meta_federation)
        for r in rows:
            ledger.record(r)
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return run


def _control_rows() -> list[LedgerRow]:
    """The 14 rows of _rows() with control packets around them, in ledger order:

    CONNECT a1, CONNECT a2 (up), CONNACK a1 (down), the server's CONNECT, then round 1, then a
    PUBACK a2 (up), then round 2, then DISCONNECT a1 (up).
    """
    base = _rows()
    return ([_ctrl("agent", "a1", "sent", "up", "CONNECT", CONNECT_B),
             _ctrl("agent", "a2", "sent", "up", "CONNECT", CONNECT_B),
             _ctrl("agent", "a1", "received", "down", "CONNACK", CONNACK_B),
             _ctrl("server", "server", "sent", "down", "CONNECT", CONNECT_B)]
            + base[:7]
            + [_ctrl("agent", "a2", "sent", "up", "PUBACK", PUBACK_B)]
            + base[7:]
            + [_ctrl("agent", "a1", "sent", "up", "DISCONNECT", DISCONNECT_B)])


METRICS = [{"round": 1, "accuracy": 0.5, "loss": 1.2, "bytes_up": 0, "bytes_down": 0},
           {"round": 2, "accuracy": 0.75, "loss": 0.8, "bytes_up": 0, "bytes_down": 0}]


@pytest.fixture
def ctrl_run(tmp_path):
    run = tmp_path / "ctrl-run"
    return _write_run(run, _control_rows(), METRICS)


def test_control_packets_in_by_kind_totals_and_session_row(ctrl_run):
    rows = load_run(ctrl_run).rows
    kinds = {(k["kind"], k["direction"]): k for k in by_kind(rows)}
    assert kinds[("CONNECT", "up")] == {
        "kind": "CONNECT", "direction": "up", "messages": 2, "body_bytes": 0, "envelope_bytes": 0,
        "mqtt_bytes": 0, "control_messages": 2, "control_bytes": 28, "wire_bytes": 28, "overhead_share": 1.0,
        "sig_bytes": 0, "enc_bytes": 0, "unsent_bytes": 0, "signed_messages": 0, "encrypted_messages": 0}
    assert kinds[("CONNACK", "down")]["wire_bytes"] == 4
    assert kinds[("PUBACK", "up")]["wire_bytes"] == 4
    assert kinds[("DISCONNECT", "up")]["wire_bytes"] == 2
    # Application kinds are unchanged by the control rows.
    assert kinds[("update", "up")]["wire_bytes"] == 2460 and kinds[("update", "up")]["control_bytes"] == 0

    t = totals(rows, "device")
    control_up, control_down = 28 + 4 + 2, 4
    assert t["up"]["control_bytes"] == control_up and t["down"]["control_bytes"] == control_down
    assert t["up"]["wire_bytes"] == 2460 + control_up and t["down"]["wire_bytes"] == 6248 + control_down
    assert t["all"]["messages"] == 8 + 5 and t["all"]["control_messages"] == 5
    assert t["all"]["wire_bytes"] == 8708 + 38
    a = t["all"]
    assert a["wire_bytes"] == a["body_bytes"] + a["envelope_bytes"] + a["mqtt_bytes"] + a["control_bytes"]
    assert a["mqtt_bytes"] == 300  # control packets are not double-counted as PUBLISH framing
    assert a["overhead_share"] == pytest.approx((508 + 38) / 8746)  # everything but body is overhead
    # The server's own CONNECT is on the server link only.
    srv = totals(rows, "server")
    assert srv["down"]["control_bytes"] == CONNECT_B and srv["down"]["wire_bytes"] == 3124 + CONNECT_B

    rounds = by_round(rows)
    assert [r["round"] for r in rounds] == [1, 2, None]
    assert rounds[-1] == {"round": None, "up_messages": 4, "up_bytes": control_up, "up_body_bytes": 0,
                          "down_messages": 1, "down_bytes": control_down, "down_body_bytes": 0,
                          "overhead_share": 1.0}
    assert rounds[0]["up_bytes"] == U1A1 + U1A2  # round rows untouched

    text = render_text(audit_report(ctrl_run))
    assert re.search(r"^session\s+4\s+34\s+0\s+1\s+4\s+0\s+100\.0 %$", text, re.M)
    assert re.search(r"^CONNECT\s+up\s+2\s+0\s+0\s+0\s+28\s+28\s+100\.0 %$", text, re.M)


def test_packets_cut_short_count_the_bytes_the_socket_took(tmp_path):
    """The control-packet run with two packets cut short by a lost connection (ledger schema 6):
    a1's round-1 update (465 bytes) of which the socket took 65 (``unsent_bytes`` 400), and a2's
    PUBACK (4 bytes) of which it took 1 (3). By hand, on the device links: up wire 2460 + 34 −
    400 − 3 = 2091; the update kind 2460 − 400 = 2060 of wire with its parts whole (body
    2200 …) and ``unsent_bytes`` 400; the PUBACK's 3 are out of control bytes (1); body +
    envelope + MQTT + control − unsent = wire. The text and HTML say what the parts hold."""
    unsent = {("a1", "update", 1): 400, ("a2", "PUBACK", None): 3}
    rows = [replace(r, unsent_bytes=unsent.get((r.node, r.kind, r.round), 0)) if r.side == "agent"
            and r.event == "sent" else r for r in _control_rows()]
    assert sum(r.unsent_bytes for r in rows) == 403
    run = _write_run(tmp_path / "cut-run", rows, METRICS)
    loaded = load_run(run).rows
    t = totals(loaded, "device")
    assert t["up"]["wire_bytes"] == 2460 + 34 - 400 - 3 == 2091
    assert t["up"]["unsent_bytes"] == 400 and t["up"]["control_bytes"] == 34 - 3
    for d in (t["up"], t["down"], t["all"]):
        assert d["wire_bytes"] == (d["body_bytes"] + d["envelope_bytes"] + d["mqtt_bytes"] + d["control_bytes"]
                                   - d["unsent_bytes"])
    kinds = {(k["kind"], k["direction"]): k for k in by_kind(loaded)}
    assert kinds[("update", "up")]["wire_bytes"] == 2460 - 400 == 2060
    assert kinds[("update", "up")]["body_bytes"] == 2200 and kinds[("update", "up")]["unsent_bytes"] == 400
    assert kinds[("PUBACK", "up")]["wire_bytes"] == 1
    assert by_round(loaded)[0]["up_bytes"] == U1A1 - 400 + U1A2
    assert totals(loaded, "server") == totals([asdict(r) for r in _control_rows()], "server")  # whole
    # by_kind.csv: each row's parts less its unsent bytes are its wire bytes (the update's 2200 body … − 400)
    out = tmp_path / "csv"
    assert main_audit([str(run), "--csv", str(out)]) == 0
    by_kind_csv = {(r["kind"], r["direction"]): r for r in _read_csv(out / "by_kind.csv")}
    update = by_kind_csv[("update", "up")]
    assert (update["unsent_bytes"], update["wire_bytes"]) == ("400", "2060")
    for r in by_kind_csv.values():
        parts = ("body_bytes", "envelope_bytes", "sig_bytes", "enc_bytes", "mqtt_bytes", "control_bytes")
        assert sum(int(r[k]) for k in parts) - int(r["unsent_bytes"]) == int(r["wire_bytes"]), r
    text = render_text(audit_report(run))
    assert "400 bytes of PUBLISH packets cut short by a lost connection" in " ".join(text.split())
    assert "400 bytes of PUBLISH packets cut short" in render_html([audit_report(run)])


def test_a_server_only_ledger_gives_no_device_link_bytes_to_target(tmp_path):
    """A ledger of the server's side alone (a ``fedfleet server`` run folder) has no device-link
    rows: the bytes its devices' links carried to the target are not in it. The comparison says
    so ("— (no device-link rows)"), not 0 bytes, nor "not reached" (round 1 reached 0.5); the
    run with the agents' rows says the bytes to round 1 (3,254 + control packets)."""
    server_only = _write_run(tmp_path / "server-run", [r for r in _control_rows() if r.side == "server"], METRICS)
    both = _write_run(tmp_path / "fleet-run", _control_rows(), METRICS)
    reps = [audit_report(server_only, target=0.5), audit_report(both, target=0.5)]
    rows = [comparison_row(r) for r in reps]
    assert [(r["device_rows"] > 0, r["bytes_to_target"] is None, r["target_round"]) for r in rows] == [
        (False, True, 1), (True, False, 1)]
    assert target_text(rows[0]) == "— (no device-link rows)"
    text = " ".join(render_comparison_text(reps).split())
    assert "— (no device-link rows)" in text and " 0 1 " not in text


def test_unknown_and_missing_optional_columns_are_tolerated(ctrl_run):
    db = sqlite3.connect(ctrl_run / "ledger.sqlite")
    db.execute("ALTER TABLE messages ADD COLUMN zz_future_column INTEGER")
    db.commit()
    db.close()
    rows = load_run(ctrl_run).rows
    assert "zz_future_column" in rows[0]
    assert totals(rows)["all"]["wire_bytes"] == 8746
    # Rows without the optional columns (reason, topic, node, sender …): control kinds still known.
    bare = [{k: v for k, v in r.items() if k not in ("reason", "topic", "node", "sender", "codec", "id")}
            for r in rows]
    assert totals(bare) == totals(rows)
    assert by_kind(bare) == by_kind(rows)


def test_bytes_to_target_exact(rows):
    # Round 1 on the device links: 2 globals + 2 updates; round 2 adds the same for round 2.
    r1 = 2 * G1 + U1A1 + U1A2  # 3254
    r2 = 2 * G2 + U2A1 + U2A2  # 5454
    assert bytes_to_target(METRICS, rows, 0.5) == r1  # round 1 reaches exactly 0.5 (≥)
    assert bytes_to_target(METRICS, rows, 0.4) == r1
    assert bytes_to_target(METRICS, rows, 0.6) == r1 + r2 == 8708
    assert bytes_to_target(METRICS, rows, 0.76) is None
    # The first round reaching the target counts, even if accuracy drops later.
    dips = [{"round": 1, "accuracy": 0.9}, {"round": 2, "accuracy": 0.1}]
    assert bytes_to_target(dips, rows, 0.85) == r1
    # Records without accuracy are skipped; no metrics at all: never reached.
    assert bytes_to_target([{"round": 1}, {"round": 2, "accuracy": 0.8}], rows, 0.7) == r1 + r2
    assert bytes_to_target([], rows, 0.1) is None


def test_bytes_to_target_counts_session_traffic_before_the_round_ends(ctrl_run):
    rows = load_run(ctrl_run).rows
    r1 = 2 * G1 + U1A1 + U1A2
    r2 = 2 * G2 + U2A1 + U2A2
    # Round 1: the agents' CONNECTs and CONNACK came first; the PUBACK after round 1's last row and
    # the final DISCONNECT do not count; the server's CONNECT is not on a device link.
    assert bytes_to_target(METRICS, rows, 0.5) == 2 * CONNECT_B + CONNACK_B + r1
    assert bytes_to_target(METRICS, rows, 0.75) == 2 * CONNECT_B + CONNACK_B + r1 + PUBACK_B + r2
    assert cumulative_bytes(rows, [1, 2]) == {1: 32 + r1, 2: 32 + r1 + 4 + r2}
    curve = accuracy_curve(METRICS, rows)
    assert curve == [{"round": 1, "accuracy": 0.5, "cumulative_bytes": 32 + r1},
                     {"round": 2, "accuracy": 0.75, "cumulative_bytes": 32 + r1 + 4 + r2}]


def test_round_zero_status_at_the_end_is_session_traffic(tmp_path):
    # The protocol sends join/status with round 0 outside any round (the final 'offline' status too).
    status = _row("agent", "a1", "sent", "up", "status", 0, "a1", f"fedfleet/v1/{FED}/status/a1", 20, 5)
    join = replace(status, kind="join")
    rows = load_run(_write_run(tmp_path / "r0", [join] + _rows() + [status], METRICS)).rows
    wire0 = status.wire_bytes
    assert bytes_to_target(METRICS, rows, 0.5) == wire0 + 2 * G1 + U1A1 + U1A2
    assert bytes_to_target(METRICS, rows, 0.75) == wire0 + 8708  # the trailing status is not counted


def _upload(client: str, rnd: int | None, wire: int) -> LedgerRow:
    topic = T_UP[client]
    return _row("agent", client, "sent", "up", "update", rnd, client, topic, 0, wire - HDR - len(topic))


def _download(client: str, rnd: int, wire: int) -> LedgerRow:
    return _row("agent", client, "received", "down", "global", rnd, client, T_GLOBAL, 0, wire - HDR - len(T_GLOBAL))


@pytest.fixture
def link_rows(tmp_path):
    """Round 1: a1 uploads 10,000 B, a2 20,000 B; each downloads 1,000 B. Round 2: a1 uploads
    40,000 B. Session: each agent sends a 100 B CONNECT. The server's rows must not count."""
    rows = [_ctrl("agent", "a1", "sent", "up", "CONNECT", 100), _ctrl("agent", "a2", "sent", "up", "CONNECT", 100),
            _download("a1", 1, 1000), _download("a2", 1, 1000), _upload("a1", 1, 10_000), _upload("a2", 1, 20_000),
            _row("server", "server", "received", "up", "update", 1, "a2", T_UP["a2"], 0, 99_000),
            _upload("a1", 2, 40_000)]
    assert [r.wire_bytes for r in rows[2:6]] == [1000, 1000, 10_000, 20_000]
    return load_run(_write_run(tmp_path / "link", rows, [])).rows


def test_link_time_exact(link_rows):
    t = link_time_s(link_rows, uplink_kbps=80, downlink_kbps=8)
    # 80 kbit/s = 10,000 bytes/s: 10,000 B → 1.0 s, 20,000 B → 2.0 s, 40,000 B → 4.0 s, 100 B → 0.01 s.
    # 8 kbit/s = 1,000 bytes/s: 1,000 B → 1.0 s.
    assert t["per_round"][0] == {"round": 1, "up_max_s": 2.0, "up_sum_s": 3.0, "down_max_s": 1.0, "down_sum_s": 2.0}
    assert t["per_round"][1] == {"round": 2, "up_max_s": 4.0, "up_sum_s": 4.0, "down_max_s": 0.0, "down_sum_s": 0.0}
    session = t["per_round"][2]
    assert session["round"] is None
    assert session["up_max_s"] == pytest.approx(0.01) and session["up_sum_s"] == pytest.approx(0.02)
    assert t["up_max_s"] == pytest.approx(6.01) and t["up_sum_s"] == pytest.approx(7.02)
    assert t["down_max_s"] == 1.0 and t["down_sum_s"] == 2.0
    assert t["max_s"] == pytest.approx(7.01) and t["sum_s"] == pytest.approx(9.02)
    assert t["directions"] == ["up", "down"] and t["uplink_kbps"] == 80 and t["downlink_kbps"] == 8


def test_link_time_one_direction_and_bad_speeds(link_rows):
    t = link_time_s(link_rows, uplink_kbps=80, downlink_kbps=None)
    assert t["directions"] == ["up"]
    assert t["down_max_s"] is None and t["per_round"][0]["down_max_s"] is None
    assert t["max_s"] == pytest.approx(6.01) and t["sum_s"] == pytest.approx(7.02)
    for bad in (0, -1, float("inf")):
        with pytest.raises(ValueError, match="uplink_kbps"):
            link_time_s(link_rows, bad, 8)


def test_report_target_and_link_time(ctrl_run):
    rep = audit_report(ctrl_run, target=0.7, uplink_kbps=100, downlink_kbps=200)
    # parts: rounds 1–2 (8,708), no round 0, and of the session row (the agents' 2 CONNECTs, the CONNACK,
    # the PUBACK and the DISCONNECT: 38 B) the 4 packets (36 B) recorded before round 2's last row.
    assert rep["target"] == {"accuracy": 0.7, "round": 2, "bytes": 32 + 8708 + 4, "parts": {
        "round": 2, "last_round": 2, "rounds_bytes": 8708, "rounds_messages": 8, "round0_bytes": 0,
        "round0_messages": 0, "round0_all_bytes": 0, "session_bytes": 36, "session_messages": 4,
        "session_control_messages": 4, "session_all_bytes": 38, "wire_bytes": 8744}}
    assert rep["link_time"]["uplink_kbps"] == 100
    assert audit_report(ctrl_run)["link_time"] is None
    assert audit_report(ctrl_run)["target"] == {"accuracy": 0.95, "round": None, "bytes": None, "parts": None}
    row = comparison_row(rep)
    assert (row["up_bytes"], row["down_bytes"]) == (rep["totals"]["device"]["up"]["wire_bytes"],
                                                    rep["totals"]["device"]["down"]["wire_bytes"])
    assert row["bytes_to_target"] == 8744 and row["target_round"] == 2
    assert row["time_max_s"] == rep["link_time"]["max_s"]
    json.dumps(rep)
    text = render_text(rep)
    assert "Device-link bytes to reach accuracy ≥ 70.00 %: 8,744" in text
    assert "Estimated transfer time" in text


IMG = '<img src="data:image/png;base64,'


def test_html_is_self_contained(ctrl_run, tmp_path):
    out = write_html([audit_report(ctrl_run, uplink_kbps=64, downlink_kbps=256)], tmp_path / "report.html")
    text = out.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    assert text.count(IMG) >= 4
    assert html.escape(str(ctrl_run)) in text
    assert "http://" not in text and "https://" not in text
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:)""", text)  # no external resources
    assert "<link" not in text and "<script" not in text
    for needle in ("Totals: device links", "Totals: server link", "CONNECT", "control packets",
                   "Rejected messages: 1", html.escape(REJECT_REASON), "not reached"):
        assert needle in text, needle


def test_html_escapes_run_names(tmp_path):
    run = _write_run(tmp_path / "run-<script>alert(1)<", _control_rows(), METRICS,
                     meta_federation='<img src=x onerror="alert(2)">')
    text = render_html([audit_report(run)])
    assert "<script" not in text and "onerror=\"" not in text and "<img src=x" not in text
    assert "run-&lt;script&gt;alert(1)&lt;" in text
    assert "&lt;img src=x onerror=&quot;alert(2)&quot;&gt;" in text
    assert text.count(IMG) >= 4


def _read_csv(path):
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_csv_totals_equal_json(ctrl_run, tmp_path, capsys):
    out = tmp_path / "csv"
    assert main_audit([str(ctrl_run), "--json", "--csv", str(out), "--uplink-kbps", "80"]) == 0
    captured = capsys.readouterr()
    rep = json.loads(captured.out)  # one run: the single report, as before
    assert isinstance(rep, dict) and "by_round.csv" in captured.err
    dev = rep["totals"]["device"]
    by_round_csv = _read_csv(out / "by_round.csv")
    assert [r["round"] for r in by_round_csv] == ["1", "2", "session"]
    assert sum(int(r["up_bytes"]) for r in by_round_csv) == dev["up"]["wire_bytes"]
    assert sum(int(r["down_bytes"]) for r in by_round_csv) == dev["down"]["wire_bytes"]
    by_client_csv = _read_csv(out / "by_client.csv")
    assert sum(int(r["up_bytes"]) + int(r["down_bytes"]) for r in by_client_csv) == dev["all"]["wire_bytes"]
    by_kind_csv = _read_csv(out / "by_kind.csv")
    for key in ("messages", "body_bytes", "envelope_bytes", "mqtt_bytes", "control_bytes", "wire_bytes"):
        assert sum(int(r[key]) for r in by_kind_csv) == dev["all"][key], key
    assert {r["kind"] for r in by_kind_csv} >= {"CONNECT", "CONNACK", "PUBACK", "DISCONNECT"}
    (cmp,) = _read_csv(out / "comparison.csv")
    assert cmp["run"] == str(ctrl_run)
    assert int(cmp["up_bytes"]) == dev["up"]["wire_bytes"] and int(cmp["down_bytes"]) == dev["down"]["wire_bytes"]
    assert float(cmp["overhead_share"]) == pytest.approx(dev["all"]["overhead_share"])
    assert cmp["bytes_to_target"] == "" and cmp["target"] == "0.95"
    assert float(cmp["time_max_s"]) == pytest.approx(rep["link_time"]["max_s"])
    assert all(len(r) == len(by_kind_csv[0]) for r in by_kind_csv)


def test_two_runs_compared_in_order(ctrl_run, run_dir, tmp_path, capsys):
    out = tmp_path / "csv"
    argv = ["audit", str(run_dir), str(ctrl_run), "--target", "0.7", "--csv", str(out),
            "--html", str(tmp_path / "cmp.html"), "--uplink-kbps", "80", "--downlink-kbps", "800"]
    assert fedfleet_main(argv + ["--json"]) == 0
    reps = json.loads(capsys.readouterr().out)
    assert [r["run"]["path"] for r in reps] == [str(run_dir), str(ctrl_run)]
    assert [r["target"]["bytes"] for r in reps] == [8708, 8744]
    cmp = _read_csv(out / "comparison.csv")
    assert [r["run"] for r in cmp] == [str(run_dir), str(ctrl_run)]
    assert [int(r["bytes_to_target"]) for r in cmp] == [8708, 8744]
    assert [int(r["up_bytes"]) for r in cmp] == [r["totals"]["device"]["up"]["wire_bytes"] for r in reps]
    assert {r["run"] for r in _read_csv(out / "by_kind.csv")} == {str(run_dir), str(ctrl_run)}
    page = (tmp_path / "cmp.html").read_text(encoding="utf-8")
    assert page.count(IMG) >= 2 * 4 + 1  # four per run and the overlay
    assert page.index(html.escape(str(run_dir))) < page.index(html.escape(str(ctrl_run)))

    assert fedfleet_main(argv[:3] + ["--target", "0.7"]) == 0
    text = capsys.readouterr().out
    first, second, table = (text.index(f"Run: {run_dir}"), text.index(f"Run: {ctrl_run}"),
                            text.index("Comparison of 2 runs"))
    assert first < second < table
    composition = text.index("Model tensors vs extras per client per round")
    lines = text[table:composition].splitlines()
    # rows are labelled by the run folders' names (distinct here), the full paths listed below
    names = [run_dir.name, ctrl_run.name]
    rows = [line for line in lines if line.split() and line.split()[0] in names and " = " not in line]
    assert [r.split()[0] for r in rows] == names
    # The hand-made ledgers have no body fields: no model tensor or extras bytes.
    assert [line.split() for line in text[composition:].splitlines()
            if line.split()[:1] in ([n] for n in names) and " = " not in line] == [
        [run_dir.name, "0", "0", "0", "0"], [ctrl_run.name, "0", "0", "0", "0"]]
    assert f"{run_dir.name} = {run_dir}" in text and f"{ctrl_run.name} = {ctrl_run}" in text
    assert "8,708" in rows[0] and "8,744" in rows[1]
    assert all(len(line) <= 120 for line in text.splitlines())


def test_cli_rejects_bad_options(run_dir, capsys):
    for bad in (["--target", "95"], ["--target", "0"], ["--uplink-kbps", "0"], ["--downlink-kbps", "fast"]):
        with pytest.raises(SystemExit) as exc:
            fedfleet_main(["audit", str(run_dir), *bad])
        assert exc.value.code == 2
        assert "error" in capsys.readouterr().err


def test_cli_unwritable_output(run_dir, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main_audit([str(run_dir), "--csv", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedfleet audit: error: cannot write") and "\n" not in err.strip()


def test_logical_message_rows_are_not_counted_twice(tmp_path):
    # Schema v2: a chunked message gets one more row per side with event='message' (its logical
    # sizes); its bytes are already in the chunk rows that hit the wire.
    logical = replace(_row("agent", "a1", "sent", "up", "update", 1, "a1", T_UP["a1"], 27, 400), event="message")
    rows = load_run(_write_run(tmp_path / "logical", _rows() + [logical], METRICS)).rows
    assert totals(rows) == totals(load_run(_write_run(tmp_path / "plain", _rows(), METRICS)).rows)
    assert bytes_to_target(METRICS, rows, 0.75) == 8708


# --------------------------------------------------------------------------------------------
# Body fields: what global/update messages are made of
#
# A hand-made ledger (dicts, as read_rows yields them). Sizes in bytes, worked out by hand:
#
# update, a1, round 1, unchunked 'sent': body = 1 (array header) + tensors 1 (empty list) +
#   num_samples 3 + train_loss 9 + metrics 10 + delta 1 + extras map header 1 +
#   extras.soft_predictions 500 + extras.prototypes 300 = 826; envelope 28 → message 854.
# update, a2, round 1, chunked: the 'message' row (soft_predictions 520 → body 846, message 874)
#   plus two chunk 'sent' rows (no fields) that must not count again.
# Both: raw 5,200 (soft predictions 1,000 fp32 values + prototypes 300 fp32 values).
# The server's 'received' rows lump extras into one 'extras' field: ignored (the sender's count).
# global: no server rows (an agent's own ledger), so the agents' 'received' rows are used:
#   round 1 to a1 and a2: tensors 2,001 (fp16, raw 1,960), meta 40 → body 2,042, envelope 24;
#   round 2 to a1: tensors 1 (empty), meta 40, extras 700 (one lump, raw 640) → body 742.

UP_CODEC = "soft_predictions=int8+zstd,prototypes=fp16"  # what Channel.send writes without model tensors


def _fields_row(side, node, event, direction, kind, rnd, client, envelope, body, fields=None, raw=0, codec="",
                **extra):
    row = {"side": side, "node": node, "event": event, "direction": direction, "kind": kind, "round": rnd,
           "client": client, "topic": "t", "topic_bytes": 1, "mqtt_header_bytes": 2, "envelope_bytes": envelope,
           "body_bytes": body, "payload_bytes": envelope + body, "raw_bytes": raw, "codec": codec,
           "fields": json.dumps(fields) if fields else "", "transfer_id": None, "chunk_index": None,
           "chunk_count": None, "reason": ""}
    row.update(extra)
    return row


def _update_fields(soft: int) -> dict:
    return {"tensors": 1, "num_samples": 3, "train_loss": 9, "metrics": 10, "delta": 1, "extras": 1,
            "extras.soft_predictions": soft, "extras.prototypes": 300}


def _field_rows() -> list[dict]:
    up_a1 = _fields_row("agent", "a1", "sent", "up", "update", 1, "a1", 28, 826, _update_fields(500), 5200, UP_CODEC)
    up_a2 = _fields_row("agent", "a2", "message", "up", "update", 1, "a2", 28, 846, _update_fields(520), 5200,
                        UP_CODEC, transfer_id="ab", chunk_count=2)
    chunks = [_fields_row("agent", "a2", "sent", "up", "update", 1, "a2", 90, n, transfer_id="ab", chunk_index=i,
                          chunk_count=2) for i, n in enumerate((500, 374))]
    lump = {"tensors": 1, "num_samples": 3, "train_loss": 9, "metrics": 10, "delta": 1, "extras": 801}
    srv = [_fields_row("server", "server", "received", "up", "update", 1, "a1", 28, 826, lump, 5200, "int8+zstd"),
           *[_fields_row("server", "server", "received", "up", "update", 1, "a2", 90, n, transfer_id="ab",
                         chunk_index=i, chunk_count=2) for i, n in enumerate((500, 374))],
           _fields_row("server", "server", "message", "up", "update", 1, "a2", 28, 846, lump, 5200, "int8+zstd",
                       transfer_id="ab", chunk_count=2),
           _fields_row("server", "server", "rejected", "up", "invalid", None, "a2", 900, 0, reason="bad")]
    down = [_fields_row("agent", c, "received", "down", "global", 1, c, 24, 2042, {"tensors": 2001, "meta": 40},
                        1960, "fp16") for c in ("a1", "a2")]
    down.append(_fields_row("agent", "a1", "received", "down", "global", 2, "a1", 24, 742,
                            {"tensors": 1, "meta": 40, "extras": 700}, 640, "fp32"))
    return [up_a1, *chunks, up_a2, *srv, *down]


def test_whole_message():
    rows = _field_rows()
    assert [whole_message(r) for r in rows[:4]] == [True, False, False, True]  # sent, 2 chunks, message
    assert not whole_message(rows[8])  # rejected


def _dropped_chunk_row() -> dict:
    """The ``message`` row of a chunk never handed to the MQTT client (its transfer's wait ended
    and the transport closed): a chunk's row, never a whole message."""
    return _fields_row("agent", "a2", "message", "up", "update", 1, "a2", 90, 374, transfer_id="ab", chunk_index=1,
                       chunk_count=2, delivery="dropped", reason="not handed to the MQTT client: closed")


def test_a_chunk_never_handed_over_is_no_whole_message(tmp_path, capsys):
    """The up figures stay those of test_body_fields_by_hand (2 messages, 854 + 874 bytes), in the
    Python test and in the SQL one behind ``fedfleet audit --json``."""
    rows, dropped = _field_rows(), _dropped_chunk_row()
    assert not whole_message(dropped)
    up = body_fields(rows + [dropped])[1]
    assert (up["messages"], up["message_bytes"]) == (2, 854 + 874)
    run = tmp_path / "dropped-chunk-run"
    run.mkdir()
    with Ledger(run / "ledger.sqlite") as ledger:
        for r in rows + [dropped]:
            ledger.record(LedgerRow(**{k: v for k, v in r.items() if k != "id"}, federation=FED, sender=None,
                                    seq=None, qos=1))
    assert main_audit([str(run), "--json"]) == 0
    up_sql = json.loads(capsys.readouterr().out)["fields"][1]
    assert (up_sql["kind"], up_sql["messages"], up_sql["message_bytes"]) == ("update", 2, 854 + 874)


def test_field_codecs():
    assert field_codecs("") == {}
    assert field_codecs("fp32") == {"*": "fp32"}
    assert field_codecs("topk:0.01:fp16+zstd:3") == {"*": "topk:0.01:fp16+zstd:3"}
    assert field_codecs("fp32,soft_predictions=int8+zstd") == {"tensors": "fp32",
                                                               "extras.soft_predictions": "int8+zstd"}
    assert field_codecs(UP_CODEC) == {"extras.soft_predictions": "int8+zstd", "extras.prototypes": "fp16"}


def test_body_fields_by_hand():
    down, up = body_fields(_field_rows())
    assert {k: v for k, v in up.items() if k != "fields"} == {
        "kind": "update", "direction": "up", "source": "sender", "extras_per_entry": True, "messages": 2,
        "chunked_messages": 1, "client_rounds": 2, "message_bytes": 854 + 874, "body_bytes": 826 + 846,
        "tensor_bytes": 2, "extras_bytes": 1020 + 600, "other_bytes": 1728 - 2 - 1620, "raw_bytes": 10_400,
        "encoded_bytes": 1622, "mean_message_bytes": 864.0,
        "parameter_bytes": 0, "extras_names": ["soft_predictions", "prototypes"]}  # every tensors field empty
    # other per message: envelope 28 + body array header 1 + scalars 3 + 9 + 10 + 1 + extras header 1 = 53
    assert up["other_bytes"] == 2 * 53
    assert up["fields"] == [
        {"field": "tensors", "messages": 2, "bytes": 2, "mean_bytes": 1.0, "share": pytest.approx(2 / 1728),
         "codec": "", "raw_bytes": 0},
        {"field": "extras.soft_predictions", "messages": 2, "bytes": 1020, "mean_bytes": 510.0,
         "share": pytest.approx(1020 / 1728), "codec": "int8+zstd", "raw_bytes": None},
        {"field": "extras.prototypes", "messages": 2, "bytes": 600, "mean_bytes": 300.0,
         "share": pytest.approx(600 / 1728), "codec": "fp16", "raw_bytes": None},
        {"field": "other", "messages": 2, "bytes": 106, "mean_bytes": 53.0, "share": pytest.approx(106 / 1728),
         "codec": "", "raw_bytes": None},
    ]
    assert sum(f["bytes"] for f in up["fields"]) == up["message_bytes"]
    assert sum(f["mean_bytes"] for f in up["fields"]) == up["mean_message_bytes"]

    # No server rows for the globals: the agents' received rows, one per agent, extras as one lump.
    assert (down["source"], down["extras_per_entry"], down["messages"], down["chunked_messages"],
            down["client_rounds"]) == ("receiver", False, 3, 0, 3)
    assert down["message_bytes"] == 2 * (24 + 2042) + (24 + 742) == 4898
    assert (down["tensor_bytes"], down["extras_bytes"], down["raw_bytes"]) == (4003, 700, 2 * 1960 + 640)
    assert [(f["field"], f["messages"], f["bytes"], f["codec"], f["raw_bytes"]) for f in down["fields"]] == [
        ("tensors", 3, 4003, "fp16", 2 * 1960),  # one tensor-bearing field per message (0 raw when empty)
        ("extras", 1, 700, "fp32", 640),
        ("other", 3, 4898 - 4003 - 700, "", None)]
    assert down["fields"][-1]["bytes"] == 3 * (24 + 1 + 40)
    assert down["parameter_bytes"] == 4003 - 1  # all but the one global whose tensors list was empty (1 B)

    assert field_bytes_per_client_round([down, up]) == {
        "up_tensor_bytes_per_client_round": 1.0, "up_extras_bytes_per_client_round": 810.0,
        "down_tensor_bytes_per_client_round": 4003 / 3, "down_extras_bytes_per_client_round": 700 / 3}
    assert field_bytes_per_client_round([]) == dict.fromkeys(
        ["up_tensor_bytes_per_client_round", "up_extras_bytes_per_client_round",
         "down_tensor_bytes_per_client_round", "down_extras_bytes_per_client_round"])
    assert body_fields([]) == []


def test_body_fields_prefers_the_sender_and_attributes_raw_to_a_lone_field():
    rows = _field_rows()
    # A server 'sent' global beside the agents' received copies: the server's row counts, once.
    glob = _fields_row("server", "server", "sent", "down", "global", 1, "*", 24, 2042 + 5,
                       {"tensors": 2001, "meta": 40, "extras": 1, "extras.prototypes": 4}, 1964, "fp16")
    down = body_fields(rows + [glob])[0]
    assert (down["source"], down["messages"], down["client_rounds"]) == ("sender", 1, 1)
    assert [(f["field"], f["bytes"], f["raw_bytes"]) for f in down["fields"]] == [
        ("tensors", 2001, None), ("extras.prototypes", 4, None), ("other", 24 + 2047 - 2005, None)]
    # The same message with model tensors only: the tensors field gets the message's raw bytes.
    lone = dict(glob, fields=json.dumps({"tensors": 2001, "meta": 40}), body_bytes=2042, raw_bytes=1960)
    assert body_fields([lone])[0]["fields"][0]["raw_bytes"] == 1960


def test_body_fields_in_text_json_csv_and_html(tmp_path, capsys):
    run = tmp_path / "fields-run"
    run.mkdir()
    with Ledger(run / "ledger.sqlite") as ledger:
        for r in _field_rows():
            ledger.record(LedgerRow(**{k: v for k, v in r.items() if k != "id"}, federation=FED, sender=None,
                                    seq=None, qos=1))
    assert main_audit([str(run), "--json", "--csv", str(tmp_path / "csv"), "--html", str(tmp_path / "r.html")]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["fields"] == body_fields(load_run(run).rows)
    text = render_text(rep)
    assert "Body fields of global and update messages" in text
    # msgs carrying, bytes, B per message carrying it, B per message of the kind, share, raw B
    assert re.search(r"^update\s+up\s+extras\.soft_predictions\s+int8\+zstd\s+2\s+1,020\s+510\s+510\s+59\.0 %\s+—$",
                     text, re.M)
    assert re.search(r"^update\s+up\s+= message\s+2\s+1,728\s+864\s+864\s+100\.0 %\s+10,400$", text, re.M)
    assert "update (up): 2 messages, 1 chunked; tensors + extras 1,622 B encoded from 10,400 B raw" in text
    assert all(len(line) <= 120 for line in text.splitlines())
    csv_rows = _read_csv(tmp_path / "csv" / "fields.csv")
    assert [(r["kind"], r["field"]) for r in csv_rows] == [
        ("global", "tensors"), ("global", "extras"), ("global", "other"),
        ("update", "tensors"), ("update", "extras.soft_predictions"), ("update", "extras.prototypes"),
        ("update", "other")]
    for kind in ("global", "update"):
        mine = [r for r in csv_rows if r["kind"] == kind]
        assert sum(int(r["bytes"]) for r in mine) == int(mine[0]["kind_message_bytes"])
    assert csv_rows[4]["raw_bytes"] == "" and csv_rows[4]["codec"] == "int8+zstd"
    (cmp,) = _read_csv(tmp_path / "csv" / "comparison.csv")
    assert float(cmp["up_extras_bytes_per_client_round"]) == 810.0
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "extras.soft_predictions" in page and html.escape("= message") in page


# --------------------------------------------------------------------------------------------
# Body fields of real federations, against sums computed with SQLite straight from the ledger.
#
# Two tiny runs (scikit-learn digits, 2 rounds, 2 clients) over the embedded broker: FedProto with
# share none (updates carry only extras) and FedAvg (only model tensors), with chunk sizes small
# enough that messages travel as chunked transfers.

_SENDER = {"update": ("agent", "up"), "global": ("server", "down")}
_WHOLE = "m.event IN ('sent', 'message') AND m.chunk_index IS NULL"


@pytest.fixture(scope="module")
def fed_runs(tmp_path_factory):
    import torch
    from helpers.federation import small_config

    from broker_server.simulate import simulate

    torch.set_num_threads(1)
    out = {}
    for alg, chunk in (("fedproto", 1024), ("fedavg", 4096)):
        cfg = small_config(train={"algorithm": alg}, data={"clients": 2}, protocol={"chunk_bytes": chunk})
        run = tmp_path_factory.mktemp(alg) / "run"
        assert simulate(cfg, run_dir=run).rounds_completed == 2
        out[alg] = run
    return out


def tmp_path_root(run):
    """The folder that holds every run of :func:`fed_runs` (the base temporary folder)."""
    return run.parent.parent


def _sql(run, query, *params):
    db = sqlite3.connect(run / "ledger.sqlite")
    try:
        return db.execute(query, params).fetchall()
    finally:
        db.close()


def _sql_fields(run, kind):
    """{field: (total bytes, messages carrying it)} of the sender's whole-message rows, by json_each."""
    side, direction = _SENDER[kind]
    return {k: (n, c) for k, n, c in _sql(
        run, f"SELECT j.key, SUM(j.value), COUNT(*) FROM messages m, json_each(m.fields) j WHERE m.side = ? "
             f"AND m.kind = ? AND m.direction = ? AND {_WHOLE} GROUP BY j.key", side, kind, direction)}


def _sql_message(run, kind):
    """(messages, Σ envelope + body, Σ raw, distinct (client, round)) of the sender's whole messages."""
    side, direction = _SENDER[kind]
    return _sql(run, f"SELECT COUNT(*), SUM(envelope_bytes + body_bytes), SUM(raw_bytes), "
                     f"COUNT(DISTINCT client || '/' || round) FROM messages m WHERE side = ? AND kind = ? "
                     f"AND direction = ? AND {_WHOLE}", side, kind, direction)[0]


def _check_against_sql(run, group):
    kind = group["kind"]
    sql = _sql_fields(run, kind)
    n, message_bytes, raw, client_rounds = _sql_message(run, kind)
    assert group["source"] == "sender"
    assert (group["messages"], group["message_bytes"], group["raw_bytes"], group["client_rounds"]) == (
        n, message_bytes, raw, client_rounds)
    tensor_like = {k: v for k, v in sql.items() if k == "tensors" or k.startswith("extras.")}
    got = {f["field"]: (f["bytes"], f["messages"]) for f in group["fields"] if f["field"] != "other"}
    assert got == tensor_like
    other = message_bytes - sum(b for b, _ in tensor_like.values())
    assert group["fields"][-1] == {"field": "other", "messages": n, "bytes": other, "mean_bytes": other / n,
                                   "share": pytest.approx(other / message_bytes), "codec": "", "raw_bytes": None}
    for f in group["fields"]:
        assert f["mean_bytes"] == pytest.approx(f["bytes"] / n)
    assert group["tensor_bytes"] == sql.get("tensors", (0, 0))[0]
    assert group["extras_bytes"] == sum(b for k, (b, _) in tensor_like.items() if k.startswith("extras."))


def _audited(fed_runs, alg):
    """(run folder, audit report, global group, update group) of one run, both groups checked
    against the SQLite sums."""
    run = fed_runs[alg]
    rep = audit_report(run)
    down, up = rep["fields"]
    for group in (down, up):
        _check_against_sql(run, group)
    return run, rep, down, up


@pytest.mark.slow
def test_fedproto_fields_equal_sqlite_sums(fed_runs):
    _, rep, down, up = _audited(fed_runs, "fedproto")
    # share none: every update's model-tensor list is empty (1 byte), its payload is the extras.
    k, d = 10, 64  # iid digits: both clients hold all 10 classes; LightCNN features are 64-d
    assert [f["field"] for f in up["fields"]] == ["tensors", "extras.prototypes", "extras.proto_classes",
                                                  "extras.proto_counts", "other"]
    assert up["messages"] == 4 and up["tensor_bytes"] == 4 and up["fields"][0]["raw_bytes"] == 0
    assert up["raw_bytes"] == 4 * (k * d * 4 + k * 8 + k * 8)  # float32 prototypes, int64 classes and counts
    # The round-1 global carries no prototypes yet, round 2's does: 1 of 2 messages.
    assert [(f["field"], f["messages"]) for f in down["fields"]] == [
        ("tensors", 2), ("extras.prototypes", 1), ("extras.proto_classes", 1), ("other", 2)]
    # chunk_bytes 1024: the updates and round 2's global were chunked, each counted once.
    assert up["chunked_messages"] == 4 and down["chunked_messages"] == 1
    row = comparison_row(rep)
    assert row["up_tensor_bytes_per_client_round"] == 1.0
    assert row["up_extras_bytes_per_client_round"] == up["extras_bytes"] / 4
    assert row["down_extras_bytes_per_client_round"] == down["extras_bytes"] / 2  # one broadcast per round


@pytest.mark.slow
def test_fedavg_fields_equal_sqlite_sums_and_chunks_count_once(fed_runs):
    from edge_agent.models import build_model

    run, rep, down, up = _audited(fed_runs, "fedavg")
    n_model = sum(t.numel() for t in build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
                  .state_dict().values())
    for group, n in ((down, 2), (up, 4)):
        assert [f["field"] for f in group["fields"]] == ["tensors", "other"]
        assert group["messages"] == group["chunked_messages"] == n
        assert group["fields"][0]["raw_bytes"] == group["raw_bytes"] == n * 4 * n_model  # the fp32 model
        assert group["fields"][0]["codec"] == "fp32" and group["extras_bytes"] == 0
    # Chunked (chunk_bytes 4096): many chunk rows per message, which the view must not count. The
    # chunks' data add up to exactly the whole messages once.
    (n_chunks, chunk_data), = _sql(run, "SELECT COUNT(*), SUM(body_bytes) FROM messages WHERE side = 'agent' "
                                        "AND kind = 'update' AND event = 'sent' AND chunk_index IS NOT NULL")
    assert n_chunks > 4 * 10
    assert chunk_data == up["message_bytes"]
    # Two runs compared: model tensors vs extras per client per round, in the order given.
    other = fed_runs["fedproto"]
    reps = [rep, audit_report(other)]
    table = render_comparison_text(reps).splitlines()
    start = next(i for i, ln in enumerate(table) if ln.startswith("Model tensors vs extras per client per round"))
    labels = _short_run_labels([str(run), str(other)])  # distinct folder names, full paths listed below
    rows = [ln.split() for ln in table[start:] if ln.split()[:1] in ([x] for x in labels) and " = " not in ln]
    per = [comparison_row(r) for r in reps]
    assert rows == [[lab, *(f"{p[f'{d}_{k}_bytes_per_client_round']:,.0f}" for d in ("up", "down")
                            for k in ("tensor", "extras"))] for lab, p in zip(labels, per)]
    assert rows[0][1:] == [f"{up['tensor_bytes'] // 4:,}", "0", f"{down['tensor_bytes'] // 2:,}", "0"]


def test_short_run_labels_are_distinct_folder_names() -> None:
    assert _short_run_labels(["/a/runs/x-1", "/b/y"]) == ["x-1", "y"]
    # same last component: one more level each, until they differ
    assert _short_run_labels(["/a/one/run", "/a/two/run"]) == ["one/run", "two/run"]
    assert _short_run_labels(["/p/q/r", "/z/q/r"]) == ["p/q/r", "z/q/r"]


def test_html_without_matplotlib_is_a_clear_error_and_writes_nothing(ctrl_run, tmp_path, monkeypatch, capsys):
    """--html needs the plots extra: without matplotlib the command says so in one line, names the
    install command, and writes neither the page nor the CSV asked beside it."""
    for name in [m for m in list(sys.modules) if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    page, table = tmp_path / "report.html", tmp_path / "rows.csv"
    rc = fedfleet_main(["audit", str(ctrl_run), "--html", str(page), "--csv", str(table)])
    err = capsys.readouterr().err
    assert rc != 0
    assert "pip install 'fedfleet[plots]'" in err and "Traceback" not in err
    assert not page.exists() and not list(tmp_path.glob("rows*.csv"))


# --------------------------------------------------------------------------------------------
# A resumed run: the ledger keeps both attempts; the audit says which bytes the resume added.
#
# One agent a1 and the server. The first session joins, runs round 1, begins round 2 (global,
# a late round-1 receipt, a PUBACK, a1's update) and is killed; the resumed session (checkpoint of
# round 1) reconnects, joins again and runs round 2 again. Its twin is the same run uninterrupted.

T_JOIN = f"fedfleet/v1/{FED}/up/a1/join"  # 31 characters
T_STATUS = f"fedfleet/v1/{FED}/status/a1"  # 30 characters
T_RECEIPT = f"fedfleet/v1/{FED}/down/a1/receipt"  # 36 characters
JOIN = 5 + 31 + (30 + 500)  # 566
STATUS = 5 + 30 + (20 + 10)  # 65
RECEIPT = 5 + 36 + (20 + 30)  # 91


def _join(side: str, event: str) -> LedgerRow:
    return _row(side, "server" if side == "server" else "a1", event, "up", "join", 0, "a1", T_JOIN, 30, 500)


def _a1(kind: str, event: str, rnd: int) -> LedgerRow:
    """a1's row of round ``rnd``'s global (received), update (sent) or receipt (received)."""
    if kind == "global":
        return _row("agent", "a1", event, "down", "global", rnd, "a1", T_GLOBAL, ENV_G, BODY_G[rnd])
    if kind == "update":
        return _row("agent", "a1", event, "up", "update", rnd, "a1", T_UP["a1"], ENV_U, BODY_U[(rnd, "a1")])
    return _row("agent", "a1", event, "down", "receipt", rnd, "a1", T_RECEIPT, 20, 30)


def _srv(kind: str, event: str, rnd: int) -> LedgerRow:
    if kind == "global":
        return _row("server", "server", event, "down", "global", rnd, "*", T_GLOBAL, ENV_G, BODY_G[rnd])
    return _row("server", "server", event, "up", "update", rnd, "a1", T_UP["a1"], ENV_U, BODY_U[(rnd, "a1")])


def _first_session() -> list[LedgerRow]:
    """Up to the kill: round 2's first attempt is the last 5 rows."""
    return [_ctrl("agent", "a1", "sent", "up", "CONNECT", CONNECT_B),
            _ctrl("server", "server", "sent", "down", "CONNECT", CONNECT_B),
            _join("agent", "sent"), _join("server", "received"),
            _srv("global", "sent", 1), _a1("global", "received", 1), _a1("update", "sent", 1),
            _srv("update", "received", 1),
            _srv("global", "sent", 2), _a1("global", "received", 2),
            _a1("receipt", "received", 1),  # round 1's, late: an uninterrupted run has it too
            _ctrl("agent", "a1", "sent", "up", "PUBACK", PUBACK_B),
            _a1("update", "sent", 2)]  # killed before the server read it


def _resumed_session() -> list[LedgerRow]:
    """After the resume from round 1's checkpoint: reconnect, a status, join, round 2 again."""
    return [_ctrl("server", "server", "sent", "down", "CONNECT", CONNECT_B),
            _ctrl("agent", "a1", "sent", "up", "CONNECT", CONNECT_B),
            _row("agent", "a1", "sent", "up", "status", 0, "a1", T_STATUS, 20, 10),
            _join("agent", "sent"), _join("server", "received"),
            _srv("global", "sent", 2), _a1("global", "received", 2),
            _ctrl("agent", "a1", "sent", "up", "PUBACK", PUBACK_B),
            _a1("update", "sent", 2), _srv("update", "received", 2),
            _ctrl("agent", "a1", "sent", "up", "DISCONNECT", DISCONNECT_B)]


def _twin_rows() -> list[LedgerRow]:
    """The same run uninterrupted: the first session, the server reads the update, a1 disconnects."""
    return _first_session() + [_srv("update", "received", 2),
                               _ctrl("agent", "a1", "sent", "up", "DISCONNECT", DISCONNECT_B)]


# By hand (wire bytes). Device links: re-sent, a1's round-2 global and update of the first session;
# ending it, the PUBACK after them (not the late round-1 receipt); reconnecting, a1's CONNECT,
# status and join of the resumed session (not its PUBACK after round 2's global).
DEV_RERUN = G2 + U2A1  # 2,062 + 565 = 2,627
DEV_ENDING = PUBACK_B  # 4
DEV_REJOIN = CONNECT_B + STATUS + JOIN  # 14 + 65 + 566 = 645
DEV_ADDED = DEV_RERUN + DEV_ENDING + DEV_REJOIN  # 3,276
DEV_FIRST = CONNECT_B + JOIN + G1 + U1A1 + G2 + RECEIPT + PUBACK_B + U2A1  # 4,829
DEV_RESUMED = CONNECT_B + STATUS + JOIN + G2 + PUBACK_B + U2A1 + DISCONNECT_B  # 3,278
DEV_TWIN = CONNECT_B + JOIN + G1 + U1A1 + G2 + RECEIPT + PUBACK_B + U2A1 + DISCONNECT_B  # 4,831
# Server link: the first session's round-2 global (nothing after it); the resumed session's CONNECT and join.
SRV_RERUN, SRV_REJOIN = G2, CONNECT_B + JOIN  # 2,062 and 580
SRV_TOTAL = (CONNECT_B + JOIN + G1 + U1A1 + G2) + (CONNECT_B + JOIN + G2 + U2A1)  # 4,169 + 3,207
SRV_TWIN = CONNECT_B + JOIN + G1 + U1A1 + G2 + U2A1  # 4,734


def _resumed_run(run, *, note: bool = True, summary: dict | None = None):
    """The resumed run's folder: the first session written by one writer (killed: never closed),
    the resumed session by the next, which notes the resume (``note``) as ``fedfleet simulate`` does."""
    from broker_server.resumes import note_fresh_run, note_resume

    first = Ledger(run / "ledger.sqlite")
    first.set_meta("federation", FED)
    if note:
        note_fresh_run(first)
    for r in _first_session():
        first.record(r)
    first.flush()  # the kill: the writer never closes
    with Ledger(run / "ledger.sqlite") as ledger:
        after_id = ledger.last_row_id()
        assert after_id == len(_first_session())  # ids 1 … 13 so far
        if note:
            note_resume(ledger, after_round=1, after_id=after_id)
        for r in _resumed_session():
            ledger.record(r)
    first.close()
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in METRICS))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


@pytest.fixture
def resumed_pair(tmp_path):
    """(resumed run, its uninterrupted twin): folders of the same name length."""
    twin = _write_run(tmp_path / "run-t", _twin_rows(), METRICS)
    with Ledger(twin / "ledger.sqlite") as ledger:
        ledger.set_meta("resumes", "[]")
    return _resumed_run(tmp_path / "run-r"), twin


def test_resume_hand_numbers_are_consistent():
    assert (len(T_JOIN), len(T_STATUS), len(T_RECEIPT)) == (31, 30, 36)
    assert (DEV_RERUN, DEV_ENDING, DEV_REJOIN, DEV_ADDED) == (2627, 4, 645, 3276)
    assert (DEV_FIRST, DEV_RESUMED, DEV_TWIN) == (4829, 3278, 4831)
    assert (SRV_RERUN, SRV_REJOIN, SRV_TOTAL, SRV_TWIN) == (2062, 580, 7376, 4734)
    # the resume's bytes are exactly what the resumed run has more than its twin, on either link
    assert DEV_FIRST + DEV_RESUMED - DEV_TWIN == DEV_ADDED
    assert SRV_TOTAL - SRV_TWIN == SRV_RERUN + SRV_REJOIN


def test_a_resume_s_bytes_are_told_apart_and_equal_the_difference_to_the_uninterrupted_twin(resumed_pair):
    from broker_server.audit import resume_bytes

    run, twin = resumed_pair
    rep, twin_rep = audit_report(run), audit_report(twin)
    assert twin_rep["resume"] is None  # noted as never resumed
    resume = rep["resume"]
    assert (resume["noted"], resume["count"], resume["after_rounds"]) == (True, 1, [1])
    dev, srv = resume["device"], resume["server"]
    (x,) = dev["resumes"]
    assert (x["after_round"], x["after_id"], x["rerun_rounds"]) == (1, 13, [2])
    assert {k: x["rerun"][k] for k in ("messages", "up_bytes", "down_bytes", "wire_bytes", "control_messages")} == {
        "messages": 2, "up_bytes": U2A1, "down_bytes": G2, "wire_bytes": DEV_RERUN, "control_messages": 0}
    assert [(k["kind"], k["messages"], k["wire_bytes"]) for k in x["rerun"]["kinds"]] == [
        ("global", 1, G2), ("update", 1, U2A1)]
    assert x["rerun"]["rounds"] == [{"round": 2, "messages": 2, "wire_bytes": G2 + U2A1}]
    assert [(k["kind"], k["control"], k["wire_bytes"]) for k in x["ending"]["kinds"]] == [("PUBACK", True, PUBACK_B)]
    assert x["ending"]["rounds"] == [{"round": None, "messages": 1, "wire_bytes": PUBACK_B}]
    assert {k: x["rejoin"][k] for k in ("messages", "up_bytes", "down_bytes", "wire_bytes")} == {
        "messages": 3, "up_bytes": DEV_REJOIN, "down_bytes": 0, "wire_bytes": DEV_REJOIN}
    assert [(k["kind"], k["wire_bytes"]) for k in x["rejoin"]["kinds"]] == [
        ("CONNECT", CONNECT_B), ("status", STATUS), ("join", JOIN)]
    assert (dev["all"]["wire_bytes"], dev["all"]["messages"]) == (DEV_ADDED, 2 + 1 + 3)
    assert (srv["rerun"]["wire_bytes"], srv["ending"]["wire_bytes"], srv["rejoin"]["wire_bytes"]) == (
        SRV_RERUN, 0, SRV_REJOIN)
    # every byte stays in the totals; the resume's are what the resumed run has beyond its twin
    for view, total, twin_total in (("device", DEV_FIRST + DEV_RESUMED, DEV_TWIN), ("server", SRV_TOTAL, SRV_TWIN)):
        assert rep["totals"][view]["all"]["wire_bytes"] == total
        assert twin_rep["totals"][view]["all"]["wire_bytes"] == twin_total
        assert total - twin_total == resume[view]["all"]["wire_bytes"]
    # the rows (with their ids) give what the ledger file gives
    rows = load_run(run).rows
    assert resume_bytes(rows, [{"after_round": 1, "after_id": 13}], "device") == dev
    row = comparison_row(rep)
    assert (row["resumed_after"], row["resume_bytes"], row["resume_rerun_bytes"], row["resume_ending_bytes"],
            row["resume_rejoin_bytes"], row["wire_bytes_without_resume"]) == (
        [1], DEV_ADDED, DEV_RERUN, DEV_ENDING, DEV_REJOIN, DEV_TWIN)
    assert (comparison_row(twin_rep)["resumed_after"], comparison_row(twin_rep)["resume_bytes"]) == ([], 0)


def test_a_resume_is_said_in_text_json_csv_and_html(resumed_pair, tmp_path, capsys):
    run, twin = resumed_pair
    line = ("Resumed after round 1 (1 resume): 3,276 of the 8,107 device-link bytes belong to it: 2,627 re-sent "
            "(round 2's first attempt, sent again after the resume), 4 ending the interrupted session (control "
            "packets, statuses, finish) and 645 reconnecting (the resumed session's connections and joins); 4,831 "
            "without them.")
    text = render_text(audit_report(run))
    flat = " ".join(text.split())
    assert line in flat
    assert " ".join(render_text(audit_report(twin)).split()).count("Resume") == 0
    table = text[text.index("Resumes:"):text.index("Resume/reconnect cost")]  # what a1 sent again follows it
    cells = [ln.split() for ln in table.splitlines() if ln.startswith(("device", "server"))]
    assert [c[-3] for c in cells] == [f"{b:,}" for b in (DEV_RERUN, DEV_ENDING, DEV_REJOIN, DEV_ADDED,
                                                          SRV_RERUN, 0, SRV_REJOIN, SRV_RERUN + SRV_REJOIN)]
    assert ("Re-sent (device-link bytes), by kind: global (down) 1× 2,062 B, update (up) 1× 565 B; in the "
            "per-round table: round 2 2,627 B.") in flat
    assert "Ending (device-link bytes), by kind: control packets 1× 4 B; in the per-round table: session 4 B." in flat
    assert ("Reconnecting (device-link bytes), by kind: join (up) 1× 566 B, status (up) 1× 65 B, control packets "
            "1× 14 B; in the per-round table: round 0 631 B, session 14 B.") in flat
    assert all(len(ln) <= 120 for ln in text.splitlines())

    out = tmp_path / "csv"
    assert fedfleet_main(["audit", str(run), str(twin), "--json", "--csv", str(out),
                          "--html", str(tmp_path / "r.html")]) == 0
    reps = json.loads(capsys.readouterr().out)
    assert reps[0]["resume"]["device"]["all"]["wire_bytes"] == 3276 and reps[1]["resume"] is None
    cmp = _read_csv(out / "comparison.csv")
    assert [(r["resumed_after"], r["resume_bytes"], r["resume_rerun_bytes"], r["resume_ending_bytes"],
             r["resume_rejoin_bytes"], r["wire_bytes_without_resume"]) for r in cmp] == [
        ("1", "3276", "2627", "4", "645", "4831"), ("", "0", "0", "0", "0", "4831")]
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert page.count(html.escape(line)) == 2  # under the comparison table and in the run's section
    assert "<th>resume B</th>" in page and "<td class=\"num\">3,276</td>" in page

    comparison = render_comparison_text([audit_report(run), audit_report(twin)])
    lines = comparison.splitlines()
    header = lines[1].split()
    assert header[:6] == ["run", "final", "acc", "up", "B", "down"] and "resume" in header
    # run, final acc (2 cells), up B, down B, resume B
    assert [ln.split()[:6] for ln in lines[3:5]] == [["run-r", "75.00", "%", "2,830", "5,277", "3,276"],
                                                     ["run-t", "75.00", "%", "1,616", "3,215", "0"]]
    assert f"run-r: {line}" in " ".join(comparison.split())


def test_a_ledger_that_notes_no_resume_says_the_attribution_is_unknown(tmp_path):
    """A ledger written before resumes were noted, of a run whose summary.json says it was resumed:
    its bytes all count, and the audit says which belong to the resume is unknown."""
    run = _resumed_run(tmp_path / "old", note=False, summary={"resumed_after": 1})
    rep = audit_report(run)
    assert rep["resume"] == {"noted": False, "problem": None, "why": None, "after_rounds": [1], "count": None,
                             "refused": None, "earlier_unknown": False, "device": None, "server": None}
    assert rep["totals"]["device"]["all"]["wire_bytes"] == DEV_FIRST + DEV_RESUMED
    flat = " ".join(render_text(rep).split())
    assert ("Resumed (last after round 1, says summary.json), but this ledger was written before resumes were noted "
            "in it: the bytes of the interrupted attempt and of the reconnection are counted with the run's, and "
            "which they are is unknown.") in flat
    assert "Resumes:" not in flat  # no table: nothing to put in it
    row = comparison_row(rep)
    assert (row["resumed_after"], row["resume_bytes"], row["wire_bytes_without_resume"]) == ([1], None, None)
    assert "unknown" in render_comparison_text([rep, rep])
    # without a summary naming a resume, an old ledger reads as never resumed, as before; what its
    # device sent or received again is still told, from its rows
    plain = _resumed_run(tmp_path / "plain", note=False)
    plain_text = render_text(audit_report(plain))
    assert audit_report(plain)["resume"] is None and "Resumed" not in plain_text and "Resumes:" not in plain_text
    assert "Resume/reconnect cost on the device links (what was sent or received again): 3,207 of" in " ".join(
        plain_text.split())


def test_several_resumes_cut_the_ledger_into_sessions_by_row_id():
    """Two resumes (after rounds 1 and 2); the rows' own ids (not their positions: ids 20… follow
    13) decide the sessions. Session 2 ran round 2 (global, update), began round 3 and was killed;
    session 3 runs round 3 again."""
    from broker_server.audit import resume_bytes

    def rows(first_id, ledger_rows):
        return [{**asdict(r), "id": i} for i, r in enumerate(ledger_rows, start=first_id)]

    g3 = _row("agent", "a1", "received", "down", "global", 3, "a1", T_GLOBAL, ENV_G, 3000)  # 5 + 32 + 3,025
    session2 = _resumed_session()[:-1] + [g3]  # without the DISCONNECT; ids 20 … 30
    session3 = [_ctrl("agent", "a1", "sent", "up", "CONNECT", CONNECT_B), _join("agent", "sent"), g3]  # 40 …
    ledger = rows(1, _first_session()) + rows(20, session2) + rows(40, session3)
    marks = [{"after_round": 2, "after_id": 30}, {"after_round": 1, "after_id": 13}]  # any order
    got = resume_bytes(ledger, marks, "device")
    first, second = got["resumes"]
    assert (first["after_round"], first["rerun"]["wire_bytes"], first["ending"]["wire_bytes"],
            first["rejoin"]["wire_bytes"]) == (1, DEV_RERUN, DEV_ENDING, DEV_REJOIN)
    # session 2's PUBACK comes before its last row of the kept round 2 (its update): it ends nothing
    assert (second["after_round"], second["rerun_rounds"], second["rerun"]["wire_bytes"],
            second["ending"]["wire_bytes"], second["rejoin"]["wire_bytes"]) == (2, [3], 5 + 32 + 3025, 0,
                                                                                CONNECT_B + JOIN)
    assert got["all"]["wire_bytes"] == DEV_ADDED + 3062 + CONNECT_B + JOIN
    assert got["all"]["messages"] == 6 + 1 + 2


def _wire_sql(run, where: str, *params) -> int:
    """Σ wire bytes of the raw ``messages`` rows matching ``where`` (SQL of its own, not the audit's)."""
    ((n,),) = _sql(run, "SELECT COALESCE(SUM(mqtt_header_bytes + topic_bytes + payload_bytes - unsent_bytes), 0) "
                        f"FROM messages WHERE event IN ('sent', 'received', 'rejected') AND {where}", *params)
    return n


@pytest.mark.slow
def test_a_killed_and_resumed_simulation_s_extra_bytes_are_its_resume_s(tmp_path):
    """``fedfleet simulate`` killed (SIGKILL) once round R+1 has begun after round R's checkpoint
    (every device holds its global and round_start), then ``--resume``d on the same broker; its twin
    runs uninterrupted (run folders of one name length: the same topic bytes). The ledger notes the
    resume after the newest row id at the kill; the re-sent bytes are the first session's rows of
    round R+1, the ending its control packets after them (each summed here by SQL on the raw table);
    what the resumed run has beyond its twin is the resume's, to the byte for every message kind
    (MQTT control packets name no message: a few acknowledgements may fall on either side of a
    session's boundary)."""
    import os
    import subprocess
    from pathlib import Path

    from helpers.checkpoints import checkpoint_round, kill_when
    from helpers.federation import small_config

    from broker_server.embedded_broker import EmbeddedBroker
    from broker_server.simulate import simulate

    cfg = small_config(run={"rounds": 4}, server={"quorum": 3, "round_deadline_s": 60.0})  # 3 clients
    toml = tmp_path / "cfg.toml"
    toml.write_text(cfg.to_toml(), encoding="utf-8")
    run, twin = tmp_path / "run-r", tmp_path / "run-t"
    repo = Path(__file__).resolve().parents[2]
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        with open(tmp_path / "killed.log", "wb") as log:
            p = subprocess.Popen([sys.executable, "-m", "broker_server.cli", "simulate", "--config", str(toml),
                                  "--out", str(run), "--broker", broker.url, "-q"], cwd=repo, stdout=log,
                                 stderr=subprocess.STDOUT, env={**os.environ, "FEDFLEET_OFFLINE": "1"})
        def round_started() -> bool:
            r = checkpoint_round(run / "checkpoints.sqlite")
            return r >= 2 and _sql(run, "SELECT COUNT(*) FROM messages WHERE side = 'agent' AND event = 'received' "
                                        "AND kind = 'round_start' AND round = ?", r + 1)[0][0] == 3

        kill_when(p, round_started, tmp_path / "killed.log")
        after_round = checkpoint_round(run / "checkpoints.sqlite")
        ((last_id,),) = _sql(run, "SELECT MAX(id) FROM messages")
        assert simulate(cfg, broker_url=broker.url, run_dir=run, resume=True).rounds_completed == 4
    assert simulate(cfg, run_dir=twin).rounds_completed == 4

    rep, twin_rep = audit_report(run), audit_report(twin)
    assert twin_rep["resume"] is None
    resume = rep["resume"]
    assert (resume["noted"], resume["after_rounds"]) == (True, [after_round])
    (noted,) = json.loads(dict(_sql(run, "SELECT key, value FROM meta"))["resumes"])
    assert (noted["after_round"], noted["after_id"]) == (after_round, last_id)

    for view, side in (("device", "agent"), ("server", "server")):
        (x,) = resume[view]["resumes"]
        assert x["rerun_rounds"] == [after_round + 1]
        # by SQL of its own: re-sent, round R+1's rows of the first session; ending it, the rows
        # without a round recorded in it after the first of them or its last of round 1 … R
        assert x["rerun"]["wire_bytes"] == _wire_sql(run, "side = ? AND id <= ? AND round > ?", side, last_id,
                                                     after_round)
        ((first, last_kept),) = _sql(
            run, "SELECT MIN(CASE WHEN round > ? THEN id END), MAX(CASE WHEN round BETWEEN 1 AND ? THEN id END) "
                 "FROM messages WHERE side = ? AND event IN ('sent', 'received', 'rejected') AND id <= ?",
            after_round, after_round, side, last_id)
        assert x["ending"]["wire_bytes"] == _wire_sql(
            run, "side = ? AND id > ? AND id <= ? AND (round IS NULL OR round < 1)", side, min(first, last_kept),
            last_id)
        # round R+1's global went to every device before the kill, and went again after the resume
        globals_first = [k for k in x["rerun"]["kinds"] if k["kind"] == "global"]
        assert sum(k["messages"] for k in globals_first) == (3 if view == "device" else 1)
        # what the resumed run has beyond its twin, per message kind: exactly the resume's
        mine = {(k["kind"], k["direction"]): k["wire_bytes"] for k in rep["by_kind"]} if view == "device" else {
            (k["kind"], k["direction"]): k["wire_bytes"] for k in by_kind(load_run(run).rows, "server")}
        theirs = {(k["kind"], k["direction"]): k["wire_bytes"] for k in by_kind(load_run(twin).rows, view)}
        added: dict = {}
        for part in ("rerun", "ending", "rejoin"):
            for k in x[part]["kinds"]:
                added[(k["kind"], k["direction"])] = added.get((k["kind"], k["direction"]), 0) + k["wire_bytes"]
        controls = {(k["kind"], k["direction"]) for part in ("rerun", "ending", "rejoin") for k in x[part]["kinds"]
                    if k["control"]} | {key for key in mine.keys() | theirs.keys() if key[0].isupper()}
        for key in (mine.keys() | theirs.keys()) - controls:
            assert mine.get(key, 0) - theirs.get(key, 0) == added.get(key, 0), (view, key)
        left = (rep["totals"][view]["all"]["wire_bytes"] - twin_rep["totals"][view]["all"]["wire_bytes"]
                - resume[view]["all"]["wire_bytes"])
        assert abs(left) <= 100, (view, left)  # control packets only (a PUBACK is 4 B)
    text = " ".join(render_text(rep).split())
    dev = resume["device"]
    assert (f"Resumed after round {after_round} (1 resume): {dev['all']['wire_bytes']:,} of the "
            f"{rep['totals']['device']['all']['wire_bytes']:,} device-link bytes belong to it: "
            f"{dev['rerun']['wire_bytes']:,} re-sent (round {after_round + 1}'s first attempt, sent again after the "
            f"resume), {dev['ending']['wire_bytes']:,} ending the interrupted session (control packets, statuses, "
            f"finish) and {dev['rejoin']['wire_bytes']:,} reconnecting") in text


def test_a_finished_run_resumed_with_more_rounds_ends_with_its_finish_and_goodbyes():
    """A 1-round run that finished (finish, a1's offline status, DISCONNECT), resumed with
    ``--rounds 2``: nothing is re-sent; its finish and goodbyes end the first session, and the
    second connects and joins again. Together they are what it has beyond a 2-round run."""
    from broker_server.audit import resume_bytes

    t_finish = f"fedfleet/v1/{FED}/down/finish"  # 32 characters
    finish = 5 + 32 + (20 + 12)  # 69

    def fin(rnd):
        return _row("agent", "a1", "received", "down", "finish", rnd, "a1", t_finish, 20, 12)

    def status():
        return _row("agent", "a1", "sent", "up", "status", 0, "a1", T_STATUS, 20, 10)

    connect, disconnect = (_ctrl("agent", "a1", "sent", "up", "CONNECT", CONNECT_B),
                           _ctrl("agent", "a1", "sent", "up", "DISCONNECT", DISCONNECT_B))
    first = [connect, _join("agent", "sent"), _a1("global", "received", 1), _a1("update", "sent", 1),
             _a1("receipt", "received", 1), fin(1), status(), disconnect]
    second = [connect, status(), _join("agent", "sent"), _a1("global", "received", 2), _a1("update", "sent", 2),
              fin(2), status(), disconnect]
    twin = [connect, _join("agent", "sent"), _a1("global", "received", 1), _a1("update", "sent", 1),
            _a1("receipt", "received", 1), _a1("global", "received", 2), _a1("update", "sent", 2), fin(2),
            status(), disconnect]
    ledger = [{**asdict(r), "id": i} for i, r in enumerate(first + second, start=1)]
    got = resume_bytes(ledger, [{"after_round": 1, "after_id": len(first)}], "device")
    (x,) = got["resumes"]
    assert (x["rerun_rounds"], x["rerun"]["wire_bytes"]) == ([], 0)
    assert [(k["kind"], k["wire_bytes"]) for k in x["ending"]["kinds"]] == [
        ("finish", finish), ("status", STATUS), ("DISCONNECT", DISCONNECT_B)]
    assert x["rejoin"]["wire_bytes"] == CONNECT_B + STATUS + JOIN
    assert got["all"]["wire_bytes"] == finish + STATUS + DISCONNECT_B + CONNECT_B + STATUS + JOIN == 781
    assert (totals(ledger)["all"]["wire_bytes"] - totals([asdict(r) for r in twin])["all"]["wire_bytes"]
            == got["all"]["wire_bytes"])
    report = {"resume": {"noted": True, "after_rounds": [1], "count": 1, "device": got},
              "totals": {"device": totals(ledger), "server": totals([])}}
    from broker_server.audit._format import resume_line

    assert (x["finished"], x["from_session"]) == (True, 0)
    line = resume_line(report, "device")
    assert line.startswith("Resumed after round 1 (1 resume), continued after its finish: 781 of the ")
    assert ("0 re-sent (the run had finished: no round was run again), 136 for the finish and goodbyes of its first "
            "session and 645 reconnecting (the resumed session's connections and joins);") in line
    assert "interrupted" not in line and "no round after the checkpoint had begun" not in line
    from broker_server.audit._format import resume_cells

    assert [c[2] for c in resume_cells(report)] == [
        "re-sent: nothing (the run had finished)",
        "continued after its finish: the finish and goodbyes of its first session",
        "reconnecting and joining again", "total"]
    # an interrupted run (no finish) is still told as interrupted
    killed = [{**asdict(r), "id": i} for i, r in enumerate(first[:5] + second, start=1)]
    (y,) = resume_bytes(killed, [{"after_round": 1, "after_id": 5}], "device")["resumes"]
    assert y["finished"] is False


def test_an_update_sent_again_before_the_resumed_server_opened_its_round_counts_as_re_sent():
    """Killed after sending round 2's global: a1's round-2 update never reached it. a1 sends that
    update again (its receipt timeout) to the resumed server (checkpoint round 1) before it has
    opened round 2 (not answered: the server's ``early``), then once more when round 2 opens.
    Server link: the early copy is one more than an uninterrupted run receives; device link: a1
    sent round 2's update three times, once in an uninterrupted run. Both are re-sent bytes, and
    the resume's bytes equal the difference to the uninterrupted twin on either link."""
    from broker_server.audit import resume_bytes
    from broker_server.audit._format import resume_cells, resume_line

    def server(kind, rnd=0):
        return _join("server", "received") if kind == "join" else _srv(kind, "sent" if kind == "global" else
                                                                          "received", rnd)

    def agent(kind, rnd=0):
        return _join("agent", "sent") if kind == "join" else _a1(kind, "sent" if kind == "update" else
                                                                 "received", rnd)

    cases = {"server": (server, [("join",), ("global", 1), ("update", 1), ("global", 2)],
                        [("join",), ("update", 2), ("global", 2), ("update", 2)], G2 + U2A1, 1),
             "device": (agent, [("join",), ("global", 1), ("update", 1), ("global", 2), ("update", 2)],
                        [("join",), ("update", 2), ("global", 2), ("update", 2)], G2 + 2 * U2A1, 1)}
    twin_of = [("join",), ("global", 1), ("update", 1), ("global", 2), ("update", 2)]
    for view, (make, first, second, rerun, early) in cases.items():
        rows = [make(*k) for k in first + second]
        ledger = [{**asdict(r), "id": i} for i, r in enumerate(rows, start=1)]
        got = resume_bytes(ledger, [{"after_round": 1, "after_id": len(first)}], view)
        (x,) = got["resumes"]
        assert (x["rerun_rounds"], x["early_updates"], x["rerun"]["wire_bytes"]) == ([2], early, rerun), view
        assert x["rerun"]["rounds"] == [{"round": 2, "messages": len(first) - 3 + early, "wire_bytes": rerun}], view
        assert (x["ending"]["wire_bytes"], x["rejoin"]["wire_bytes"]) == (0, JOIN), view
        twin = totals([asdict(make(*k)) for k in twin_of], view)["all"]["wire_bytes"]
        assert totals(ledger, view)["all"]["wire_bytes"] - twin == got["all"]["wire_bytes"] == rerun + JOIN, view
        report = {"resume": {"noted": True, "after_rounds": [1], "count": 1, view: got},
                  "totals": {"device": totals(ledger, view), "server": totals(ledger, view)}}
        assert ("re-sent (round 2's first attempt, sent again after the resume, and 1 update copy sent again "
                "before the resumed server opened its round)") in resume_line(report, view)
        assert resume_cells(report)[0][2] == "re-sent: round 2's first attempt; 1 update copy sent again before its " \
                                             "round opened"


def _set_resumes(run, value):
    """``meta.resumes`` of ``run``'s ledger set by hand to ``value`` (any SQLite value: text, a blob,
    NULL), as someone editing the file would; the folder is returned."""
    db = sqlite3.connect(run / "ledger.sqlite")
    try:
        db.execute("INSERT OR REPLACE INTO meta VALUES ('resumes', ?)", (value,))
        db.commit()
    finally:
        db.close()
    return run


@pytest.mark.parametrize("value", ['[{"after_round": 1e30, "after_id": 5}]',
                                   '[{"after_round": Infinity, "after_id": 5}]',
                                   '[{"after_round": 1, "after_id": 1e20}]',
                                   '[{"after_round": -Infinity, "after_id": NaN}]',
                                   '[{"after_round": 1, "after_id": 99999999999999999999999}]'])
def test_a_resumes_note_with_numbers_out_of_range_is_audited_without_a_crash(tmp_path, capsys, value):
    """Numbers SQLite cannot hold (or no number at all) in a hand-edited note: the audit (text, JSON,
    CSV, HTML) runs, and gives no attribution from them."""
    from broker_server.audit import resume_bytes
    from broker_server.resumes import ledger_resumes

    run = _set_resumes(_resumed_run(tmp_path / "run-r"), value)
    assert ledger_resumes({"resumes": value}) is None  # not marks the queries could be given
    rep = audit_report(run)
    assert (rep["resume"]["noted"], rep["resume"]["device"]) == (False, None)
    assert rep["resume"]["problem"] in ("unreadable", "implausible")
    assert rep["totals"]["device"]["all"]["wire_bytes"] == DEV_FIRST + DEV_RESUMED
    render_text(rep)
    assert fedfleet_main(["audit", str(run), str(run), "--json", "--csv", str(tmp_path / "csv"),
                          "--html", str(tmp_path / "r.html")]) == 0
    capsys.readouterr()
    # the queries themselves take any whole number: beyond every row id and round, it cuts nothing
    rows = load_run(run).rows
    beyond = resume_bytes(rows, [{"after_round": 10 ** 30, "after_id": 13}])
    assert (beyond["rerun"]["wire_bytes"], beyond["ending"]["wire_bytes"]) == (0, 0)  # no round after it
    far = resume_bytes(rows, [{"after_round": 1, "after_id": 10 ** 20}])
    assert (far["rerun"]["wire_bytes"], far["rejoin"]["wire_bytes"]) == (2 * (G2 + U2A1), 0)  # every round-2 row


_ATTRIBUTION_UNKNOWN = "the attribution is unknown (the bytes of any interrupted attempt and reconnection are counted"


@pytest.mark.parametrize("value, problem, why", [
    ("{}", "unreadable", "a JSON object, not a list"),
    ("not json", "unreadable", "not JSON: Expecting value: line 1 column 1 (char 0)"),
    ("null", "unreadable", "JSON null, not a list"),
    (b"\x00\x01", "unreadable", "not JSON"),  # a blob, read as text
    ("[3]", "unreadable", "entry 1 is 3, not an object"),
    ('[{"after_round": 1}]', "unreadable", "entry 1 has no after_id"),
    ('[{"after_round": "1", "after_id": 13}]', "unreadable", 'entry 1\'s after_round is "1", not a whole number'),
    ('[{"after_round": Infinity, "after_id": 13}]', "unreadable",
     "entry 1's after_round is Infinity, not a whole number"),
    ('[{"after_round": 1e30, "after_id": 13}]', "implausible",
     "entry 1's after_round 1e+30 is beyond SQLite's integers"),
    ('[{"after_round": -1, "after_id": 13}]', "implausible", "entry 1's after_round is negative (-1)"),
    ('[{"after_round": 7, "after_id": 13}]', "implausible",
     "entry 1's after_round 7 is beyond the run's last round in the ledger (2)"),
    ('[{"after_round": 1, "after_id": 500}]', "implausible",
     "entry 1's after_id 500 is beyond the ledger's last row (id 24)"),
    ('[{"after_round": 1, "after_id": 13, "at": 5}, {"after_round": 1, "after_id": 13, "at": 5}]', "implausible",
     "entry 2 repeats entry 1"),
    ('[{"after_round": 1, "after_id": 13}, {"after_round": 2, "after_id": 13}]', "implausible",
     "entries 1 and 2 begin after the same row (after_id 13) from different rounds"),
    ('[{"after_round": 1, "after_id": 13}, {"after_round": 1, "after_id": 5}]', "implausible",
     "entry 2's after_id 5 is before entry 1's (13): resumes are noted in the order they happened"),
])
def test_a_corrupt_resumes_note_is_said_unreadable_or_implausible_not_old_nor_never_resumed(
        tmp_path, value, problem, why):
    """A note that is there but cannot be used is neither a ledger from before resumes were noted
    nor a run never resumed: the audit says what is wrong with it, and that which bytes the
    resumes added is unknown (no numbers: none would be true)."""
    run = _set_resumes(_resumed_run(tmp_path / "run-r"), value)
    rep = audit_report(run)
    assert rep["resume"] == {"noted": False, "problem": problem, "why": rep["resume"]["why"], "after_rounds": [],
                             "count": None, "refused": None, "earlier_unknown": False, "device": None,
                             "server": None}
    assert rep["resume"]["why"].startswith(why)
    flat = " ".join(render_text(rep).split())
    assert f"This ledger's resumes note is {problem} ({why}" in flat and _ATTRIBUTION_UNKNOWN in flat
    assert "written before resumes were noted" not in flat and "Resumes:" not in flat  # no table of numbers
    row = comparison_row(rep)
    assert (row["resumed_after"], row["resume_bytes"], row["wire_bytes_without_resume"]) == ([], None, None)
    comparison = " ".join(render_comparison_text([rep, rep]).split())
    assert "unknown" in comparison and f"resumes note is {problem}" in comparison
    page = render_html([rep])
    assert html.escape(f"resumes note is {problem} ({why}") in page and "<th>resume B</th>" in page
    # with a summary.json naming a resume, that is said too
    (run / "summary.json").write_text(json.dumps({"resumed_after": 1}))
    flat = " ".join(render_text(audit_report(run)).split())
    assert f"Resumed (last after round 1, says summary.json), but this ledger's resumes note is {problem}" in flat


def test_a_bad_at_in_a_resumes_note_keeps_the_attribution(tmp_path, resumed_pair):
    """``at`` (when it was noted) is not used to tell the bytes apart: a bad one changes nothing."""
    run, _ = resumed_pair
    good = audit_report(run)["resume"]
    for at in ('"yesterday"', "null", "Infinity", "true", "[1]", "1" + "0" * 400):
        _set_resumes(run, f'[{{"after_round": 1, "after_id": 13, "at": {at}}}]')
        assert audit_report(run)["resume"] == good, at
    assert good["device"]["all"]["wire_bytes"] == DEV_ADDED


def _third_session(run, *, before: str | None):
    """A third session of ``run`` (resumed after round 2, when ``meta.resumes`` was ``before``;
    None: absent): a1 connects and joins again. Returns the list the resume noted."""
    from broker_server.resumes import note_resume

    if before is not None:
        _set_resumes(run, before)
    with Ledger(run / "ledger.sqlite") as ledger:
        marks = note_resume(ledger, after_round=2, after_id=ledger.last_row_id())
        for r in (_ctrl("agent", "a1", "sent", "up", "CONNECT", CONNECT_B), _join("agent", "sent")):
            ledger.record(r)
    return marks


@pytest.mark.parametrize("before", [None, "{}", "not json", '[{"after_round": -3, "after_id": 1}]'])
def test_a_resume_noted_after_no_usable_note_says_earlier_sessions_are_not_told_apart(tmp_path, before):
    """A ledger written before resumes were noted (or whose note is unusable) holds two sessions
    (a resume not noted); a third session notes its resume. Its list starts again, and says so:
    the earlier resume's bytes count in the first session, so the audit gives this resume's bytes
    but not what the run would have sent without its resumes."""
    run = _resumed_run(tmp_path / "run-r", note=False)  # two sessions, 24 rows, no note
    marks = _third_session(run, before=before)
    assert [(m["after_round"], m["after_id"], m.get("earlier_unknown")) for m in marks] == [(2, 24, True)]
    rep = audit_report(run)
    resume = rep["resume"]
    assert (resume["noted"], resume["count"], resume["earlier_unknown"]) == (True, 1, True)
    assert resume["device"]["rejoin"]["wire_bytes"] == CONNECT_B + JOIN
    flat = " ".join(render_text(rep).split())
    assert (f"Resumed after round 2 (1 resume noted): {CONNECT_B + JOIN + DISCONNECT_B:,} of the "
            f"{DEV_FIRST + DEV_RESUMED + CONNECT_B + JOIN:,} device-link bytes belong to it:") in flat
    assert ("reconnecting (the resumed session's connections and joins); resumes before this one, if any, were not "
            "noted: their bytes count in the first session, so the bytes without them are unknown.") in flat
    assert "without them." not in flat.replace("the bytes without them are unknown.", "")
    row = comparison_row(rep)
    assert (row["resume_bytes"], row["wire_bytes_without_resume"], row["resume_note"]) == (
        CONNECT_B + JOIN + DISCONNECT_B, None, "earlier not noted")
    assert "≥ 582" in render_comparison_text([rep, rep])
    # the next resume keeps the mark, so the audit goes on saying so
    with Ledger(run / "ledger.sqlite") as ledger:
        from broker_server.resumes import note_resume

        again = note_resume(ledger, after_round=2, after_id=ledger.last_row_id())
    assert [m.get("earlier_unknown") for m in again] == [True, None]
    assert audit_report(run)["resume"]["earlier_unknown"] is True


def test_a_resume_of_a_ledger_with_no_rows_or_a_usable_note_is_not_marked(tmp_path):
    from broker_server.resumes import note_fresh_run, note_resume

    with Ledger(tmp_path / "empty.sqlite") as ledger:  # killed before any row: nothing earlier to tell apart
        assert note_resume(ledger, after_round=0, after_id=ledger.last_row_id())[0].get("earlier_unknown") is None
    with Ledger(tmp_path / "fresh.sqlite") as ledger:
        note_fresh_run(ledger)
        ledger.record(_join("agent", "sent"))
        assert note_resume(ledger, after_round=0, after_id=ledger.last_row_id())[0].get("earlier_unknown") is None


# A finished 1-round run (a1 and the server), then a --resume with more rounds that was refused (its
# checkpoint did not load: the server connected, and disconnected), then one that went on.
T_FINISH = f"fedfleet/v1/{FED}/down/finish"  # 32 characters
FINISH = 5 + 32 + (20 + 12)  # 69


def _finish(side: str, rnd: int) -> LedgerRow:
    if side == "server":
        return _row("server", "server", "sent", "down", "finish", rnd, "*", T_FINISH, 20, 12)
    return _row("agent", "a1", "received", "down", "finish", rnd, "a1", T_FINISH, 20, 12)


def _status() -> LedgerRow:
    return _row("agent", "a1", "sent", "up", "status", 0, "a1", T_STATUS, 20, 10)


def _finished_session() -> list[LedgerRow]:
    """A 1-round run to its end: joins, round 1, the finish, a1's offline status and DISCONNECT."""
    return [_ctrl("server", "server", "sent", "down", "CONNECT", CONNECT_B),
            _ctrl("agent", "a1", "sent", "up", "CONNECT", CONNECT_B), _join("agent", "sent"),
            _join("server", "received"), _srv("global", "sent", 1), _a1("global", "received", 1),
            _a1("update", "sent", 1), _srv("update", "received", 1), _finish("server", 1), _finish("agent", 1),
            _status(), _ctrl("agent", "a1", "sent", "up", "DISCONNECT", DISCONNECT_B),
            _ctrl("server", "server", "sent", "down", "DISCONNECT", DISCONNECT_B)]


def _refused_session() -> list[LedgerRow]:
    """The server connects, the checkpoint does not load, it disconnects: no agent saw it."""
    return [_ctrl("server", "server", "sent", "down", "CONNECT", CONNECT_B),
            _ctrl("server", "server", "sent", "down", "DISCONNECT", DISCONNECT_B)]


def _continued_session() -> list[LedgerRow]:
    """A resume with 2 rounds that went on: reconnect, join, round 2, the finish."""
    return [_ctrl("server", "server", "sent", "down", "CONNECT", CONNECT_B),
            _ctrl("agent", "a1", "sent", "up", "CONNECT", CONNECT_B), _status(), _join("agent", "sent"),
            _join("server", "received"), _srv("global", "sent", 2), _a1("global", "received", 2),
            _a1("update", "sent", 2), _srv("update", "received", 2), _finish("server", 2), _finish("agent", 2),
            _status(), _ctrl("agent", "a1", "sent", "up", "DISCONNECT", DISCONNECT_B),
            _ctrl("server", "server", "sent", "down", "DISCONNECT", DISCONNECT_B)]


def _sessions_run(run, sessions, marks):
    """A run folder whose ledger holds ``sessions`` (lists of rows) one after the other, with
    ``marks`` as its resumes note: each mark's ``after_id`` is given as the index of the session
    it begins (1: the second) and becomes that row id."""
    ends, n = [], 0
    for rows in sessions:
        n += len(rows)
        ends.append(n)
    _write_run(run, [r for rows in sessions for r in rows], METRICS)
    noted = [{**m, "after_id": ends[m["after_id"] - 1]} for m in marks]
    return _set_resumes(run, json.dumps(noted))


def test_a_refused_resume_is_told_as_an_attempt_that_added_its_connections(tmp_path):
    """A finished run, then a refused --resume (the checkpoint did not load): the run was never
    continued, so its finish and goodbyes are its own, and the refused attempt added its rows."""
    run = _sessions_run(tmp_path / "run-f", [_finished_session(), _refused_session()],
                        [{"after_round": 1, "after_id": 1, "refused": True}])
    rep = audit_report(run)
    resume = rep["resume"]
    assert (resume["noted"], resume["count"], resume["refused"], resume["after_rounds"]) == (True, 0, 1, [])
    dev, srv = resume["device"], resume["server"]
    assert (dev["all"]["wire_bytes"], dev["ending"]["wire_bytes"], dev["refusal"]["wire_bytes"]) == (0, 0, 0)
    assert (srv["all"]["wire_bytes"], srv["ending"]["wire_bytes"], srv["refusal"]["wire_bytes"]) == (
        CONNECT_B + DISCONNECT_B, 0, CONNECT_B + DISCONNECT_B)
    (x,) = srv["resumes"]
    assert (x["refused"], [(k["kind"], k["wire_bytes"]) for k in x["refusal"]["kinds"]]) == (
        True, [("CONNECT", CONNECT_B), ("DISCONNECT", DISCONNECT_B)])
    wire = rep["totals"]["device"]["all"]["wire_bytes"]
    flat = " ".join(render_text(rep).split())
    assert (f"Not resumed: a refused --resume attempt added 0 of the {wire:,} device-link bytes (its connections); "
            f"{wire:,} without them.") in flat
    assert "Resumed after" not in flat and "ending the interrupted session" not in flat
    assert "server round 1 a refused --resume attempt: its connections 2 0 16 16" in flat
    row = comparison_row(rep)
    assert (row["resumed_after"], row["resume_bytes"], row["resume_refused_bytes"]) == ([], 0, 0)


def test_a_resume_after_a_refused_one_goes_on_from_the_session_before_it(tmp_path):
    """The same finished run, the refused attempt, then a resume with 2 rounds that went on: it
    goes on from the finished session (whose finish and goodbyes it ends), not from the refused
    one; all three add what the run has beyond a 2-round run's twin."""
    run = _sessions_run(tmp_path / "run-f", [_finished_session(), _refused_session(), _continued_session()],
                        [{"after_round": 1, "after_id": 1, "refused": True}, {"after_round": 1, "after_id": 2}])
    rep = audit_report(run)
    resume = rep["resume"]
    assert (resume["count"], resume["refused"], resume["after_rounds"]) == (1, 1, [1])
    dev, srv = resume["device"], resume["server"]
    refused, went_on = dev["resumes"]
    assert (refused["refused"], went_on["refused"]) == (True, False)
    assert [(k["kind"], k["wire_bytes"]) for k in went_on["ending"]["kinds"]] == [
        ("finish", FINISH), ("status", STATUS), ("DISCONNECT", DISCONNECT_B)]
    assert went_on["rejoin"]["wire_bytes"] == CONNECT_B + STATUS + JOIN
    twin = [*_finished_session()[:8], _srv("global", "sent", 2), _a1("global", "received", 2),
            _a1("update", "sent", 2), _srv("update", "received", 2), *_finished_session()[8:]]
    twin = [replace(r, round=2) if r.kind == "finish" else r for r in twin]
    for view, got in (("device", dev), ("server", srv)):
        assert (rep["totals"][view]["all"]["wire_bytes"] - totals([asdict(r) for r in twin], view)["all"]["wire_bytes"]
                == got["all"]["wire_bytes"]), view
    assert srv["refusal"]["wire_bytes"] == CONNECT_B + DISCONNECT_B
    flat = " ".join(render_text(rep).split())
    assert ("reconnecting (the resumed session's connections and joins) and 0 by a refused --resume attempt (its "
            "connections); ") in flat


def test_a_resume_whose_checkpoint_does_not_load_is_marked_refused(tmp_path):
    from broker_server.resumes import note_fresh_run, note_resume, read_resumes, refused_if_raises
    from edge_agent.errors import ModelError
    from protocol.ledger import read_meta

    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        note_fresh_run(ledger)
        ledger.record(_join("agent", "sent"))
        note_resume(ledger, after_round=1, after_id=1)
        with refused_if_raises(ledger, after_id=1):
            pass  # taken back: not marked
        assert "refused" not in read_resumes(read_meta(ledger.path)).marks[0]
        ledger.record(_join("agent", "sent"))
        note_resume(ledger, after_round=1, after_id=2)
        with pytest.raises(ModelError, match="8 tensors received"):
            with refused_if_raises(ledger, after_id=2):
                raise ModelError("8 tensors received, the model has 49")
    marks = read_resumes(read_meta(tmp_path / "ledger.sqlite")).marks
    assert [m.get("refused") for m in marks] == [None, True]


@pytest.mark.slow
def test_a_simulation_resumed_with_a_model_its_checkpoint_does_not_fit_is_not_said_to_be_resumed(tmp_path):
    """A finished 1-round digits run, ``--resume``d with 2 rounds and another model: the checkpoint
    does not load, nothing is continued. The audit does not call the run resumed; the attempt's
    connections are what it added."""
    import shutil

    from helpers.federation import small_config

    from broker_server.server_main import run_server
    from broker_server.simulate import simulate

    first = tmp_path / "first"
    assert simulate(small_config(run={"rounds": 1}), run_dir=first).rounds_completed == 1
    before = audit_report(first)
    assert before["resume"] is None
    for command in ("simulate", "server"):
        run = shutil.copytree(first, tmp_path / command)
        other = small_config(run={"rounds": 2}, model={"name": "resnet8"})
        with pytest.raises(Exception, match="tensors received|cannot restore|checkpoint"):
            if command == "simulate":
                simulate(other, run_dir=run, resume=True)
            else:
                run_server(other, run_dir=run, resume=True)
        _said_not_resumed(audit_report(run), before)


def _said_not_resumed(rep, before):
    flat = " ".join(render_text(rep).split())
    assert "Resumed after" not in flat and "ending the interrupted session" not in flat
    resume = rep["resume"]
    if resume is not None:  # refused once noted (not before the ledger was opened)
        assert (resume["count"], resume["refused"], resume["after_rounds"]) == (0, 1, [])
        added = resume["server"]["all"]["wire_bytes"]
        assert added == resume["server"]["refusal"]["wire_bytes"] > 0
        assert added == rep["totals"]["server"]["all"]["wire_bytes"] - before["totals"]["server"]["all"]["wire_bytes"]
        assert resume["device"]["all"]["wire_bytes"] == 0
        assert "Not resumed: a refused --resume attempt added 0 of the" in flat


def _whole_run() -> list[LedgerRow]:
    """A 1-round run from the start: connections, a1's status and join, round 1, a1's goodbye."""
    return [_ctrl("server", "server", "sent", "down", "CONNECT", CONNECT_B),
            _ctrl("agent", "a1", "sent", "up", "CONNECT", CONNECT_B), _status(), _join("agent", "sent"),
            _join("server", "received"), _srv("global", "sent", 1), _a1("global", "received", 1),
            _ctrl("agent", "a1", "sent", "up", "PUBACK", PUBACK_B), _a1("update", "sent", 1),
            _srv("update", "received", 1), _ctrl("agent", "a1", "sent", "up", "DISCONNECT", DISCONNECT_B)]


@pytest.mark.parametrize("killed_after", [3, 4, 7])  # a1's status; its join sent; round 1's global received
def test_a_resume_before_the_first_checkpoint_adds_the_interrupted_session_whole(tmp_path, killed_after):
    """Killed before round 1's checkpoint (during the joins, or once round 1 had begun), resumed
    after round 0: the resumed session is the whole run again, what an uninterrupted run sends;
    what the resume added is every row of the interrupted one (not the resumed session's joins)."""
    first = _whole_run()[:killed_after]
    run = _sessions_run(tmp_path / "run-0", [first, _whole_run()], [{"after_round": 0, "after_id": 1}])
    rep = audit_report(run)
    for view, side in (("device", "agent"), ("server", "server")):
        got = rep["resume"][view]
        twin = totals([asdict(r) for r in _whole_run()], view)["all"]["wire_bytes"]
        extra = totals([asdict(r) for r in first], view)["all"]["wire_bytes"]
        assert rep["totals"][view]["all"]["wire_bytes"] - twin == extra == got["all"]["wire_bytes"], view
        assert got["rerun"]["wire_bytes"] == sum(_wire_row(r) for r in first if r.side == side and (r.round or 0) > 0)
    dev = rep["resume"]["device"]
    wire = rep["totals"]["device"]["all"]["wire_bytes"]
    flat = " ".join(render_text(rep).split())
    assert (f"Resumed before its first checkpoint (1 resume: the run started again from round 1): "
            f"{dev['all']['wire_bytes']:,} of the {wire:,} device-link bytes belong to it: ") in flat
    assert (f"{dev['rejoin']['wire_bytes']:,} reconnecting (the interrupted session's connections and joins: with no "
            "checkpoint, the resumed session connected and joined again from the start); "
            f"{wire - dev['all']['wire_bytes']:,} without them.") in flat
    if killed_after == 4:  # the joins only: a1's CONNECT, status and join
        assert dev["rejoin"]["wire_bytes"] == CONNECT_B + STATUS + JOIN and "0 re-sent (no round had begun" in flat


def _server_status() -> LedgerRow:
    """a1's ``online`` status as the broker delivers it to the server (kept for it: a1 kept running)."""
    return _row("server", "server", "received", "up", "status", 0, "a1", T_STATUS, 20, 10)


@pytest.mark.parametrize("registry", [1, None])  # noted; or a note from before it was (no join: came back)
def test_a_round_0_resume_whose_devices_came_back_adds_the_resumed_session_s_reconnection(tmp_path, registry):
    """Killed once round 1 had begun after round 0's checkpoint (its registry: a1, which had
    joined), resumed: a1 kept running and comes back through its online status, without joining
    again. The interrupted session's connections and joins are the run's own (an uninterrupted run
    makes them once); the resumed session's connection and a1's status are extra. Without the
    attributed bytes the run is its twin on either link; the text says the devices came back."""
    from broker_server.audit._format import resume_line

    first = _whole_run()[:7]  # the connections, a1's status and join, round 1's global sent and received
    second = [_ctrl("server", "server", "sent", "down", "CONNECT", CONNECT_B), _server_status(),
              *_whole_run()[5:]]
    mark = {"after_round": 0, "after_id": 1, **({} if registry is None else {"registry": registry})}
    run = _sessions_run(tmp_path / "run-0", [first, second], [mark])
    rep = audit_report(run)
    for view in ("device", "server"):
        got = rep["resume"][view]
        (x,) = got["resumes"]
        assert (x["from_start"], x["registry"], x["rerun_rounds"]) == (False, registry, [1]), view
        twin = totals([asdict(r) for r in _whole_run()], view)["all"]["wire_bytes"]
        assert rep["totals"][view]["all"]["wire_bytes"] - got["all"]["wire_bytes"] == twin, view
        assert got["rejoin"]["wire_bytes"] == (CONNECT_B + STATUS if view == "server" else 0), view
    srv = rep["resume"]["server"]
    assert (f"Resumed after round 0 (1 resume: its checkpoint held the devices that had joined): "
            f"{srv['all']['wire_bytes']:,} of the {rep['totals']['server']['all']['wire_bytes']:,} server-link bytes "
            f"belong to it: {srv['rerun']['wire_bytes']:,} re-sent (round 1's first attempt, sent again after the "
            f"resume), 0 ending the interrupted session (control packets, statuses, finish) and "
            f"{CONNECT_B + STATUS:,} reconnecting (the resumed session's connections and statuses: its devices came "
            "back without joining again);") in (resume_line(rep, "server") or "")


def test_a_round_0_resume_noted_without_a_registry_adds_the_interrupted_session_s_joins(tmp_path):
    """The note says the resumed session took back no registry (``registry`` 0: there was no
    checkpoint): it is the whole run again, its joins the run's own; the interrupted session's
    connections and joins are extra, as a note from before ``registry`` was noted reads a
    resumed session with joins."""
    first = _whole_run()[:4]  # killed while a1 joined
    for registry in (0, None):
        mark = {"after_round": 0, "after_id": 1, **({} if registry is None else {"registry": registry})}
        run = _sessions_run(tmp_path / f"run-{registry}", [first, _whole_run()], [mark])
        rep = audit_report(run)
        (x,) = rep["resume"]["device"]["resumes"]
        assert (x["from_start"], x["rejoin"]["wire_bytes"]) == (True, CONNECT_B + STATUS + JOIN)
        assert "Resumed before its first checkpoint" in " ".join(render_text(rep).split())


def test_a_resume_s_registry_is_noted_and_read_back(tmp_path):
    """``note_resume`` notes the registry's size; a note whose registry is not a whole number is
    unreadable, a negative one implausible."""
    from broker_server.resumes import note_fresh_run, note_resume, read_resumes

    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        note_fresh_run(ledger)
        (mark,) = note_resume(ledger, after_round=0, after_id=0, registry=3)
    assert (mark["after_round"], mark["registry"]) == (0, 3)
    (back,) = read_resumes({"resumes": json.dumps([mark])}).marks or []
    assert back["registry"] == 3
    assert "registry" not in (read_resumes({"resumes": '[{"after_round": 0, "after_id": 4}]'}).marks or [{}])[0]
    bad = read_resumes({"resumes": '[{"after_round": 0, "after_id": 4, "registry": "3"}]'})
    assert (bad.state, bad.why) == ("unreadable", 'entry 1\'s registry is "3", not a whole number')
    assert read_resumes({"resumes": '[{"after_round": 0, "after_id": 4, "registry": -1}]'}).state == "implausible"


def _wire_row(r: LedgerRow) -> int:
    return r.mqtt_header_bytes + r.topic_bytes + r.payload_bytes


def test_a_server_only_ledger_s_resume_is_compared_on_the_server_link(tmp_path, capsys):
    """A ``fedfleet server`` run's ledger has only the server's rows: its resume is told on the
    server link in the comparison (text, HTML, CSV) too, not as 0 of 0 device-link bytes."""
    first = [r for r in _first_session() if r.side == "server"]
    second = [r for r in _resumed_session() if r.side == "server"]
    run = _sessions_run(tmp_path / "run-s", [first, second], [{"after_round": 1, "after_id": 1}])
    twin = _sessions_run(tmp_path / "run-t", [[r for r in _twin_rows() if r.side == "server"]], [])
    reps = [audit_report(run), audit_report(twin)]
    added = SRV_RERUN + SRV_REJOIN
    line = (f"Resumed after round 1 (1 resume): {added:,} of the {SRV_TOTAL:,} server-link bytes belong to it: "
            f"{SRV_RERUN:,} re-sent (round 2's first attempt, sent again after the resume), 0 ending the interrupted "
            f"session (control packets, statuses, finish) and {SRV_REJOIN:,} reconnecting (the resumed session's "
            f"connections and joins); {SRV_TWIN:,} without them.")
    assert SRV_TOTAL - added == SRV_TWIN
    comparison = " ".join(render_comparison_text(reps).split())
    assert f"run-s: {line}" in comparison and "device-link bytes belong" not in comparison
    assert f"{added:,} (server link)" in comparison
    row = comparison_row(reps[0])
    assert (row["resume_link"], row["resume_bytes"], row["wire_bytes_without_resume"]) == ("server", added, SRV_TWIN)
    page = render_html(reps)
    assert html.escape(f"run-s: {line}") in page and f"{added:,} (server link)" in page
    assert fedfleet_main(["audit", str(run), str(twin), "--csv", str(tmp_path / "csv")]) == 0
    capsys.readouterr()
    cmp = _read_csv(tmp_path / "csv" / "comparison.csv")
    assert [(r["resume_link"], r["resume_bytes"], r["wire_bytes_without_resume"]) for r in cmp] == [
        ("server", str(added), str(SRV_TWIN)), ("server", "0", str(SRV_TWIN))]


def _undeliverable(why: str, delivery: str = "") -> LedgerRow:
    """The row the channel writes for a message it gave up (protocol.channel._undeliverable):
    ``delivery`` ``dropped`` for one it could not send, the broker never seeing it."""
    return LedgerRow(federation=FED, side="server", node="server", event="message", direction="down",
                     kind="undeliverable", round=2, client="*", sender=None, seq=None, topic=T_GLOBAL,
                     topic_bytes=len(T_GLOBAL), mqtt_header_bytes=0, envelope_bytes=0, body_bytes=0, payload_bytes=0,
                     qos=0, reason=why, delivery=delivery)


NOT_SENT_WHY = (f"global of round 2 (2,025 bytes) not sent: server: QoS 0 PUBLISH to {T_GLOBAL} (2,025 bytes) not "
                "sent: the link is down, and MQTT keeps no QoS 0 message for the reconnect (QoS 1 would)")
GIVEN_UP_WHY = (f"server: global of round 2 (2,025 bytes) on {T_GLOBAL} refused by the broker again: 0x95 Packet too "
                "large; not sent again after 3 chunked re-sends (last packets ≤ 512 bytes)")


def test_a_qos0_message_not_sent_while_the_link_was_down_is_not_said_refused_by_the_broker(tmp_path):
    """QoS 0 while the link is down: the channel records the message as undeliverable, never sent.
    The audit says not sent (link down, QoS 0), apart from a message given up after the broker's
    refusals, and counts neither as refused by the broker."""
    rows = _rows() + [_undeliverable(NOT_SENT_WHY, "dropped"), _undeliverable(GIVEN_UP_WHY)]
    run = _write_run(tmp_path / "run-q", rows, METRICS)
    rep = audit_report(run)
    flat = " ".join(render_text(rep).split())
    assert "refused (server server, undeliverable" not in flat
    assert f"not sent (link down, QoS 0) (server server, undeliverable, 1×): {NOT_SENT_WHY}" in flat
    assert f"given up after the broker's refusals (server server, undeliverable, 1×): {GIVEN_UP_WHY}" in flat
    server = rep["deliveries"]["by_side"]["server"]
    assert (server["refused"], server["undeliverable"], server["not_sent"]) == (0, 1, 1)
    assert [r["what"] for r in rep["deliveries"]["refusals"]] == ["not sent", "given up"]
    line = ("PUBLISH packets sent by the server (server link): 0 acknowledged by the broker, 0 handed over without "
            "acknowledgement, 0 refused by the broker, 2 without a delivery record (older ledger); 1 message(s) given "
            "up; 1 QoS 0 message(s) not sent (the link was down: not refused by the broker, which never saw them)")
    assert line in flat
    assert html.escape(line) in render_html([rep])



def test_publish_packets_the_lost_connection_dropped_are_counted_apart(tmp_path):
    """Two QoS 0 globals the lost connection took out of the server's MQTT client (the channel's
    ``dropped`` delivery): one partly written (its ``sent`` row stays on the wire), one never
    written (its row turned into a ``message`` row, out of the wire totals). By hand: the server
    sent 2 + 2 PUBLISH rows; the delivery line counts 2 dropped, and the server link's wire bytes
    are those of the rows without the never-written one."""
    cut = replace(_row("server", "server", "sent", "down", "global", 3, "*", T_GLOBAL, ENV_G, 2000),
                  delivery="dropped", reason="cut: the link is down")
    never = replace(_row("server", "server", "message", "down", "global", 3, "*", T_GLOBAL, ENV_G, 2000),
                    delivery="dropped", reason="dropped: the link is down")
    with_cut = audit_report(_write_run(tmp_path / "cut", _rows() + [cut], METRICS))
    run = _write_run(tmp_path / "run-d", _rows() + [cut, never], METRICS)
    rep = audit_report(run)
    server = rep["deliveries"]["by_side"]["server"]
    assert server["dropped"] == 2 and server["sent"] == with_cut["deliveries"]["by_side"]["server"]["sent"]
    assert rep["totals"]["server"] == with_cut["totals"]["server"]  # the never-written one adds no byte
    flat = " ".join(render_text(rep).split())
    assert ", 2 lost with the connection before the socket took them whole (QoS 0, or unsent at close)" in flat


UNTAKEN_WHY = ("not handed to the MQTT client: a1: no room for a 527-byte message: 100 messages (52,700 bytes) wait "
               "for acknowledgement (link down); the offline buffer holds at most 100 messages / 1,048,576 bytes")
CHUNK_UNTAKEN_WHY = (f"not handed to the MQTT client: a2: PUBLISH to {T_UP['a2']} (374 bytes) not sent: the transport "
                     "is closed")


def test_publish_packets_never_handed_to_the_mqtt_client_are_counted_as_not_delivered_not_as_wire_bytes(tmp_path):
    """a1's round-2 update first went unchunked to a full offline buffer (the channel's ``message``
    row, delivery ``dropped``, reason ``not handed to the MQTT client: …``: 5 + 33 + 27 + 500 =
    565 bytes kept, none sent) before its ``sent`` row; chunk 2 of 2 of a transfer of a2's went to
    a closed transport (the same, with its chunk index). By hand: the device links' totals are
    those of the run without the two rows (no byte of them reached the MQTT client), the devices'
    delivery line counts 2 never handed over and none lost with the connection, and each reason is
    listed once. Before, the audit counted them as lost with the connection before the socket
    took them (the unchunked one had no row at all)."""
    untaken = replace(_row("agent", "a1", "message", "up", "update", 2, "a1", T_UP["a1"], ENV_U, 500),
                      delivery="dropped", reason=UNTAKEN_WHY)
    chunk = replace(_row("agent", "a2", "message", "up", "update", 2, "a2", T_UP["a2"], 90, 284),
                    delivery="dropped", reason=CHUNK_UNTAKEN_WHY, transfer_id="ab", chunk_index=1, chunk_count=2)
    base = audit_report(_write_run(tmp_path / "base", _rows(), METRICS))
    rep = audit_report(_write_run(tmp_path / "run-n", _rows() + [untaken, chunk], METRICS))
    assert rep["totals"] == base["totals"] and rep["by_round"] == base["by_round"]
    agent = rep["deliveries"]["by_side"]["agent"]
    assert (agent["not_handed"], agent["dropped"], agent["sent"]) == (2, 0, 4)  # the 4 updates' sent rows
    assert rep["deliveries"]["not_handed"] == 2 and rep["deliveries"]["by_side"]["server"]["not_handed"] == 0
    assert [(r["side"], r["node"], r["kind"], r["count"], r["what"], r["reason"])
            for r in rep["deliveries"]["refusals"]] == [("agent", "a1", "update", 1, "not handed", UNTAKEN_WHY),
                                                        ("agent", "a2", "update", 1, "not handed", CHUNK_UNTAKEN_WHY)]
    flat = " ".join(render_text(rep).split())
    line = ("PUBLISH packets sent by the devices (device links): 0 acknowledged by the broker, 0 handed over without "
            "acknowledgement, 0 refused by the broker, 2 never handed to the MQTT client (its offline buffer full, or "
            "the transport closed: none of their bytes were sent), 4 without a delivery record (older ledger)")
    assert line in flat and "lost with the connection" not in flat
    assert f"never handed to the MQTT client (agent a1, update, 1×): {UNTAKEN_WHY}" in flat
    assert html.escape(line) in render_html([rep])
