"""The audit as text tables for a terminal (rich, plain text, 120 columns)."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

from ._format import (
    DIRECTION_MEANING,
    FIELD_COLUMNS,
    FIELDS_TITLE,
    KIND_COLUMNS,
    REPEAT_NOTE,
    RESUME_COLUMNS,
    UNCLEAN_CLOSE,
    acc,
    count,
    delivery_lines,
    directions_label,
    field_cells,
    field_notes,
    fleet_line,
    human,
    kbps,
    kind_cells,
    mean,
    pct,
    refusal_line,
    repeat_client_cells,
    repeat_line,
    resume_cell,
    resume_cells,
    resume_column,
    resume_legend,
    resume_line,
    resume_notes,
    secs,
    short_run_labels,
    target_parts_text,
    target_text,
    unsent_line,
)
from ._queries import VIEWS, round_label
from ._report import comparison_row, fleet_total, fleet_total_omitted, resume_view


def _console() -> tuple[Any, io.StringIO]:
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=False, color_system=None, highlight=False,
                      emoji=False, soft_wrap=False)
    return console, buf


def _table(*headers: str, text_columns: int = 1) -> Any:
    """Counts right-aligned; the first ``text_columns`` columns are left-aligned text. Counts never
    wrap (a number split over two lines reads as two numbers); when the table is too wide, the
    text columns fold instead (a long run path in a comparison)."""
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for i, h in enumerate(headers):
        t.add_column(h, justify="left" if i < text_columns else "right", no_wrap=(i >= text_columns),
                     overflow="fold")
    return t


def _lines(buf: io.StringIO) -> str:
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


def render_text(report: Mapping[str, Any]) -> str:
    """Human tables of an :func:`audit_report` for a terminal (plain text, 120 columns).

    Sections: Totals (device links, server link; each says what up and down mean on it, control
    packets included: :data:`DIRECTION_MEANING`), for a resumed run what its resumes added
    (:func:`resume_report`: one line under the run's name, then a table of the bytes re-sent,
    ending the interrupted session and spent reconnecting, per link and resume), what the devices
    sent or received again (:func:`repeat_bytes`: their resume/reconnect cost as their own ledgers
    tell it; one line, for a device's own ledger and wherever something was, with a table per
    device when several did and what the line counts and leaves out), Per round
    (control packets and other traffic without a round in the ``session`` row), Per client, Per
    kind and direction (device links, then the server link), Body fields (:func:`body_fields`),
    Rejected messages and what the broker did with each side's PUBLISH packets, and, when the
    report has them, bytes to reach the target accuracy (with what they are made of in the
    per-round rows) and the estimated transfer time. Counts
    use thousands separators; byte columns are in bytes, and the totals add the wire bytes in
    KiB/MiB.
    """
    console, buf = _console()
    run = report["run"]
    console.print(f"Run: {run['path']}")
    console.print(f"Federation: {run.get('federation') or '—'}   rounds: {run['rounds']}   "
                  f"final accuracy: {acc(report.get('final_accuracy'))}")
    if report.get("ledger_closed") is False:
        console.print(UNCLEAN_CLOSE)
    told_in = resume_view(report)
    if (line := resume_line(report, told_in)) is not None:
        console.print(line)

    titles = {"device": "Totals: device links (agent side: uploads sent + downloads received by each agent)",
              "server": "Totals: server link (server side: sent + received; a broadcast counts once)"}
    for view in VIEWS:
        tot = report["totals"][view]
        console.print()
        console.print(titles[view])
        if tot["all"]["messages"] == 0:
            console.print("  (no rows from this side in this ledger: in a real fleet each device keeps its own "
                          "ledger; run `fedfleet audit` on the agent's --out folder)" if view == "device" else
                          "  (no rows from this side in this ledger)")
            continue
        t = _table("direction", "messages", "body B", "envelope B", "MQTT B", "control B", "wire B", "wire",
                   "overhead")
        for label, key in (("up", "up"), ("down", "down"), ("total", "all")):
            d = tot[key]
            t.add_row(label, count(d["messages"]), count(d["body_bytes"]), count(d["envelope_bytes"]),
                      count(d["mqtt_bytes"]), count(d.get("control_bytes", 0)), count(d["wire_bytes"]),
                      human(d["wire_bytes"]), pct(d["overhead_share"]))
        console.print(t)
        if (cut := unsent_line(tot)) is not None:
            console.print(cut)
        console.print(DIRECTION_MEANING[view])

    if (resume_rows := resume_cells(report)):
        console.print()
        console.print("Resumes: the bytes an uninterrupted run would not have sent (bytes = wire bytes; counted in "
                      "the totals above, as they crossed the wire)")
        t = _table(*RESUME_COLUMNS, text_columns=3)
        for resume_row in resume_rows:
            t.add_row(*resume_row)
        console.print(t)
        for line in resume_notes(report, told_in):
            console.print(line)

    if (line := repeat_line(report)) is not None:
        console.print()
        console.print(line)
        if (client_rows := repeat_client_cells(report)):
            t = _table("client", "messages", "up B", "down B", "wire B")
            for client_row in client_rows:
                t.add_row(*client_row)
            console.print(t)
        if report["repeats"]["all"]["messages"]:
            console.print(REPEAT_NOTE)

    console.print()
    console.print("Security: bytes added by signatures and by encryption (protocol.security)")
    t = _table("link", "direction", "signed msgs", "signature B", "encrypted msgs", "encryption B", "share of wire",
               text_columns=2)
    for view in VIEWS:
        for label, key in (("up", "up"), ("down", "down"), ("total", "all")):
            d = report["totals"][view][key]
            t.add_row(view, label, count(d.get("signed_messages", 0)), count(d.get("sig_bytes", 0)),
                      count(d.get("encrypted_messages", 0)), count(d.get("enc_bytes", 0)),
                      pct((d.get("sig_bytes", 0) + d.get("enc_bytes", 0)) / d["wire_bytes"]
                          if d["wire_bytes"] else None))
    console.print(t)

    console.print()
    console.print("Per round (device links; bytes = wire bytes; session = traffic without a round, "
                  "control packets included)")
    t = _table("round", "up msgs", "up B", "up body B", "down msgs", "down B", "down body B", "overhead")
    for r in report["by_round"]:
        t.add_row(round_label(r["round"]), count(r["up_messages"]), count(r["up_bytes"]),
                  count(r["up_body_bytes"]), count(r["down_messages"]), count(r["down_bytes"]),
                  count(r["down_body_bytes"]), pct(r["overhead_share"]))
    console.print(t)

    console.print()
    console.print("Per client (device links; bytes = wire bytes)")
    t = _table("client", "up msgs", "up B", "down msgs", "down B", "body B")
    for c in report["by_client"]:
        t.add_row(c["client"], count(c["up_messages"]), count(c["up_bytes"]), count(c["down_messages"]),
                  count(c["down_bytes"]), count(c["body_bytes"]))
    console.print(t)

    kind_titles = {"device": "Per kind and direction (device links; upper-case kinds are MQTT control packets)",
                   "server": "Per kind and direction (server link, a broadcast counted once; up = towards the "
                             "server, as in its totals; upper-case kinds are MQTT control packets)"}
    for view, kinds in (("device", report["by_kind"]), ("server", report.get("by_kind_server"))):
        if kinds is None or (view == "server" and not kinds):
            continue
        console.print()
        console.print(kind_titles[view])
        t = _table(*KIND_COLUMNS, text_columns=2)
        for cells in kind_cells(kinds):
            t.add_row(*cells)
        console.print(t)

    if report.get("fields"):
        console.print()
        console.print(FIELDS_TITLE)
        t = _table(*FIELD_COLUMNS, text_columns=4)
        for cells in field_cells(report["fields"]):
            t.add_row(*cells)
        console.print(t)
        for line in field_notes(report["fields"]):
            console.print(line)

    console.print()
    rt = report.get("rejected_totals") or {
        "messages": len(report["rejected"]),
        "payload_bytes": sum(r["payload_bytes"] for r in report["rejected"])}
    console.print(f"Rejected messages: {count(rt['messages'])} ({count(rt['payload_bytes'])} payload bytes)")
    for line in delivery_lines(report.get("deliveries")):
        console.print(line)
    for r in (report.get("deliveries") or {}).get("refusals", []):
        console.print(refusal_line(r))
    if report["rejected"]:
        t = _table("side", "node", "topic", "reason", "payload B", text_columns=4)
        for r in report["rejected"]:
            t.add_row(r["side"], r["node"], r["topic"], r["reason"], count(r["payload_bytes"]))
        console.print(t)

    if report.get("target") is not None:
        row = comparison_row(report)
        console.print()
        parts = target_parts_text(report["target"].get("parts"))
        console.print(f"Device-link bytes to reach accuracy ≥ {acc(row['target'])}: {target_text(row)}"
                      + (f" {parts}" if parts else ""))
    link = report.get("link_time")
    if link:
        console.print(f"Estimated transfer time ({directions_label(link)}; uplink "
                      f"{kbps(link['uplink_kbps'])}, downlink {kbps(link['downlink_kbps'])}): "
                      f"{secs(link['max_s'])} with clients in parallel (slowest client per round), "
                      f"{secs(link['sum_s'])} summed over clients")
    return _lines(buf)


def render_comparison_text(reports: Sequence[Mapping[str, Any]]) -> str:
    """The comparison of several runs as text: one table of bytes, accuracy and transfer time (and,
    when a run was resumed, the bytes its resumes added: ``resume B``, with one line per resumed
    run under the table saying what they are; a device's own ledger's cell there is what it sent
    or received again, ``N again``: :func:`._format.resume_cell`), the fleet total of ledgers of one
    federation (:func:`fleet_total`), then one of model-tensor and extras bytes per client per
    round (see :func:`comparison_row`); one row per run in each, in the order given."""
    console, buf = _console()
    rows = [comparison_row(r) for r in reports]
    labels = short_run_labels([str(r["run"]) for r in rows])
    target = next((r["target"] for r in rows if r["target"] is not None), None)
    link = next((r.get("link_time") for r in reports if r.get("link_time")), None)
    console.print(f"Comparison of {len(rows)} runs (device links; bytes = wire bytes)")
    headers = ["run", "final acc", "up B", "down B", "overhead", f"B to {acc(target)}", "at round"]
    resumed = resume_column(rows)
    if resumed:
        headers.insert(4, "resume B")
    if link:
        headers += ["time parallel", "time summed"]
    t = _table(*headers)
    for label, r in zip(labels, rows, strict=True):
        reached = r["bytes_to_target"] is not None
        cells = [label, acc(r["final_accuracy"]), count(r["up_bytes"]), count(r["down_bytes"]),
                 pct(r["overhead_share"]), count(r["bytes_to_target"]) if reached else target_text(r),
                 str(r["target_round"]) if reached else "—"]
        if resumed:
            cells.insert(4, resume_cell(r))
        if link:
            cells += [secs(r["time_max_s"]), secs(r["time_sum_s"])]
        t.add_row(*cells)
    console.print(t)
    for label, report in zip(labels, reports, strict=True):
        if (line := resume_line(report, resume_view(report))) is not None:
            console.print(f"{label}: {line}", overflow="fold")
    if resumed:
        console.print("resume B: " + resume_legend(reports))
    console.print(f"B to {acc(target)}: device-link bytes up to and including the first round whose test "
                  "accuracy reached the target, of the rounds with an accuracy (a run with \\[server] eval_every = E "
                  "measures it every E-th round and the last; —: the run records no accuracy, as a device's own "
                  "folder), and the traffic outside the rounds (round 0, the session row: joins, control packets …) "
                  "recorded before that round's last row.")
    if (fleet := fleet_total(reports)) is not None:
        console.print(fleet_line(fleet))
    elif (why := fleet_total_omitted(reports)) is not None:
        console.print(why)
    console.print()
    console.print("Model tensors vs extras per client per round (bytes; each message as its sender encoded it"
                  + ("; a resumed run's include the messages it sent again)" if resumed else ")"))
    t = _table("run", "up tensors B", "up extras B", "down tensors B", "down extras B")
    for label, r in zip(labels, rows, strict=True):
        t.add_row(label, *(mean(r[f"{d}_{p}_bytes_per_client_round"])
                           for d in ("up", "down") for p in ("tensor", "extras")))
    console.print(t)
    if any(label != str(r["run"]) for label, r in zip(labels, rows, strict=True)):
        for label, r in zip(labels, rows, strict=True):
            console.print(f"{label} = {r['run']}", overflow="fold")
    if link:
        console.print(f"Transfer time ({directions_label(link)}): uplink {kbps(link['uplink_kbps'])}, downlink "
                      f"{kbps(link['downlink_kbps'])} per client (1 kbit/s = 1000 bit/s); parallel = slowest "
                      "client per round, summed = sum over clients.")
    return _lines(buf)

