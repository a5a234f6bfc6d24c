"""The audit as one self-contained HTML page: inline CSS, tables, and the plots of :mod:`._plots`."""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
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
    overhead_parts,
    pct,
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
from ._plots import plot_by_round, plot_clients, plot_curves, plot_overhead
from ._report import comparison_row, fleet_total, resume_view

# Tables fit the page: long run paths are not table cells (short labels there, the full paths in a
# list under the table); text cells wrap at word boundaries first (overflow-wrap, never a path cut
# three characters a line), numbers never wrap; a table wider than the page scrolls inside its
# own box instead of pushing the page wider.
_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1100px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { font-size: 1.3em; border-bottom: 2px solid #ccc; padding-bottom: .2em;
     margin-top: 2.5em; overflow-wrap: anywhere; } h3 { font-size: 1.05em; margin-top: 1.5em; }
div.table { max-width: 100%; overflow-x: auto; }
table { border-collapse: collapse; margin: .5em 0 1em; font-size: .9em; line-height: 1.35; }
th, td { border-bottom: 1px solid #ddd; padding: .25em .6em; }
th { background: #f3f3f3; text-align: left; vertical-align: bottom; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.text { overflow-wrap: anywhere; min-width: 6em; }
td.label { white-space: nowrap; }
ul.runs { font-size: .85em; color: #444; overflow-wrap: anywhere; }
img { max-width: 100%; display: block; margin: .5em 0 1.5em; }
p.note { color: #555; font-size: .9em; }
"""


def _esc(value: Any) -> str:
    return html.escape("—" if value is None else str(value), quote=True)


def _html_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], text_columns: int = 1,
                label_column: bool = False) -> str:
    """An HTML table; every cell is escaped. The first ``text_columns`` columns are text;
    ``label_column``: the first is a short run label, kept on one line."""
    out = ['<div class="table"><table>', "<tr>" + "".join(f"<th>{_esc(h)}</th>" for h in headers) + "</tr>"]
    for row in rows:
        out.append("<tr>" + "".join(
            f'<td class="{("label" if label_column and i == 0 else "text") if i < text_columns else "num"}">'
            f"{_esc(c)}</td>" for i, c in enumerate(row)) + "</tr>")
    out.append("</table></div>")
    return "\n".join(out)


def _totals_html(tot: Mapping[str, Any]) -> str:
    rows = []
    for label, key in (("up", "up"), ("down", "down"), ("total", "all")):
        d = tot[key]
        rows.append([label, count(d["messages"]), count(d["body_bytes"]), count(d["envelope_bytes"]),
                     count(d["mqtt_bytes"]), count(d.get("control_bytes", 0)), count(d["wire_bytes"]),
                     human(d["wire_bytes"]), pct(d["overhead_share"])])
    return _html_table(["direction", "messages", "body B", "envelope B", "MQTT header+topic B", "control B",
                        "wire B", "wire", "overhead"], rows)


def _security_html(report: Mapping[str, Any]) -> str:
    """Signatures and encryption: messages and bytes per link and direction, with their share of
    the wire bytes (``sig_bytes``/``enc_bytes`` of the ledger)."""
    rows = []
    for view, label in (("device", "device links"), ("server", "server link")):
        for name, key in (("up", "up"), ("down", "down"), ("total", "all")):
            d = report["totals"][view][key]
            added = d.get("sig_bytes", 0) + d.get("enc_bytes", 0)
            rows.append([label, name, count(d.get("signed_messages", 0)), count(d.get("sig_bytes", 0)),
                         count(d.get("encrypted_messages", 0)), count(d.get("enc_bytes", 0)),
                         pct(added / d["wire_bytes"] if d["wire_bytes"] else None)])
    return _html_table(["link", "direction", "signed messages", "signature B", "encrypted messages",
                        "encryption B", "share of wire B"], rows, text_columns=2)


def _comparison_html(reports: Sequence[Mapping[str, Any]]) -> str:
    """Two tables, so that each fits the page: bytes, accuracy and transfer time per run; then the
    model-tensor and extras bytes per client per round. Runs are named by short labels (their
    folders' last component), the full paths and federations listed under the tables."""
    rows = [comparison_row(r) for r in reports]
    labels = short_run_labels([str(r["run"]) for r in rows])
    link = next((r.get("link_time") for r in reports if r.get("link_time")), None)
    target = next((r["target"] for r in rows if r["target"] is not None), None)
    headers = ["run", "rounds", "final accuracy", "up B", "down B", "overhead",
               f"bytes to {acc(target)}" if target is not None else "bytes to target"]
    resumed = resume_column(rows)
    if resumed:
        headers.insert(5, "resume B")
    if link:
        headers += [f"transfer time {directions_label(link)}, clients in parallel",
                    "transfer time, sum over clients"]
    body = []
    for label, r in zip(labels, rows, strict=True):
        cells = [label, r["rounds"], acc(r["final_accuracy"]), count(r["up_bytes"]),
                 count(r["down_bytes"]), pct(r["overhead_share"]), target_text(r)]
        if resumed:
            cells.insert(5, resume_cell(r))
        if link:
            cells += [secs(r["time_max_s"]), secs(r["time_sum_s"])]
        body.append(cells)
    note = ("<p class=\"note\">Device links (what the agents sent and received). Bytes to target: cumulative "
            "device-link wire bytes up to and including the first round whose test accuracy reached the "
            "target, of the rounds with an accuracy (a run with [server] eval_every = E measures it every "
            "E-th round and the last; the traffic outside the rounds, round 0 and the session row, recorded "
            "before that round's last row included).")
    if link:
        note += (f" Transfer time: uplink {_esc(kbps(link['uplink_kbps']))}, downlink "
                 f"{_esc(kbps(link['downlink_kbps']))} per client (1 kbit/s = 1000 bit/s); per round the "
                 "slowest client (parallel links), or the sum over clients (one shared link); session "
                 "traffic counted as one more phase.")
    if resumed:
        note += (" Resume B: " + _esc(resume_legend(reports, code="")) + " "
                 + " ".join(f"{_esc(label)}: {_esc(line)}" for label, rep in zip(labels, reports, strict=True)
                            if (line := resume_line(rep, resume_view(rep))) is not None))
    fleet = fleet_total(reports)
    if fleet is not None:
        body.append(["fleet total", "", "", count(fleet["up_bytes"]), count(fleet["down_bytes"]), "", "",
                     *([""] * ((2 if link else 0) + (1 if resumed else 0)))])
        note += f" {_esc(fleet_line(fleet))}."
    per_client = _html_table(
        ["run", "up tensors B/client/round", "up extras B/client/round", "down tensors B/client/round",
         "down extras B/client/round"],
        [[label, *(mean(r[f"{d}_{p}_bytes_per_client_round"]) for d in ("up", "down") for p in ("tensor", "extras"))]
         for label, r in zip(labels, rows, strict=True)], label_column=True)
    paths = "".join(f"<li>{_esc(label)}: {_esc(r['run'])} (federation {_esc(r['federation'])})</li>"
                    for label, r in zip(labels, rows, strict=True))
    return (_html_table(headers, body, label_column=True) + "\n" + note + "</p>\n" + per_client + "\n"
            + '<p class="note">Tensors/extras per client per round: bytes of the model tensors and of the named '
              "extras of the updates a client sent and the globals it received, as their sender encoded them.</p>\n"
            + f'<ul class="runs">{paths}</ul>')


def render_html(reports: Sequence[Mapping[str, Any]], title: str = "fedfleet communication audit") -> str:
    """A self-contained HTML report of one or more :func:`audit_report` dicts.

    No external resources: inline CSS, plots as base64 PNG (matplotlib, Agg canvas). Every string
    from the reports is escaped with :func:`html.escape`. Contents: a comparison table (one row
    per run; with several runs also an overlay of accuracy against cumulative bytes), then per
    run: totals (device links, server link, each with what up and down mean on it), the bytes to
    reach the target (with what they are made of in the per-round rows), for a resumed run what
    its resumes added (:func:`resume_report`), what the devices sent or received again
    (:func:`repeat_bytes`, as in :func:`render_text`), per kind (device links, server link), bytes per
    round by kind and direction,
    cumulative bytes against accuracy, bytes per client, protocol overhead share, the body
    fields of global/update messages (:func:`body_fields`), and the rejected messages with what the
    broker did with each side's PUBLISH packets.
    """
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
             f"<title>{_esc(title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
             f"<h1>{_esc(title)}</h1>"]
    target = next(((r.get("target") or {}).get("accuracy") for r in reports if r.get("target")), None)
    parts.append("<h2>Comparison</h2>" if len(reports) > 1 else "<h2>Summary</h2>")
    parts.append(_comparison_html(reports))
    if len(reports) > 1:
        names = [Path(r["run"]["path"]).name or r["run"]["path"] for r in reports]
        if len(set(names)) < len(names):
            names = [r["run"]["path"] for r in reports]
        curves = [(n, r.get("accuracy_curve") or []) for n, r in zip(names, reports, strict=True)]
        parts.append(plot_curves(curves, target, "Test accuracy against cumulative device-link bytes, all runs"))
    for i, rep in enumerate(reports, start=1):
        run = rep["run"]
        parts.append(f"<h2>Run {i}: {_esc(run['path'])}</h2>")
        parts.append(f"<p>Federation: {_esc(run.get('federation'))} &nbsp; rounds: {_esc(run['rounds'])} &nbsp; "
                     f"metrics records: {_esc(run.get('metrics_rounds'))} &nbsp; "
                     f"final accuracy: {_esc(acc(rep.get('final_accuracy')))}</p>")
        if rep.get("ledger_closed") is False:
            parts.append(f'<p class="note">{_esc(UNCLEAN_CLOSE)}</p>')
        parts.append("<h3>Totals: device links (uploads sent + downloads received by each agent)</h3>")
        parts.append(f'<p class="note">{_esc(DIRECTION_MEANING["device"])}</p>')
        parts.append(_totals_html(rep["totals"]["device"]))
        if (cut := unsent_line(rep["totals"]["device"])) is not None:
            parts.append(f'<p class="note">{_esc(cut)}</p>')
        parts.append("<h3>Totals: server link (a broadcast counts once)</h3>")
        parts.append(f'<p class="note">{_esc(DIRECTION_MEANING["server"])}</p>')
        parts.append(_totals_html(rep["totals"]["server"]))
        if (cut := unsent_line(rep["totals"]["server"])) is not None:
            parts.append(f'<p class="note">{_esc(cut)}</p>')
        tgt = rep.get("target") or {}
        if tgt.get("bytes") is not None:
            parts.append(f"<p>Device-link bytes to reach accuracy ≥ {_esc(acc(tgt['accuracy']))}: "
                         f"{_esc(target_text(comparison_row(rep)))} {_esc(target_parts_text(tgt.get('parts')))}</p>")
        told_in = resume_view(rep)
        if (line := resume_line(rep, told_in)) is not None:
            parts.append("<h3>Resumes: the bytes an uninterrupted run would not have sent</h3>")
            parts.append(f"<p>{_esc(line)}</p>")
            if (cells := resume_cells(rep)):
                parts.append(_html_table(list(RESUME_COLUMNS), cells, text_columns=3))
            if (notes := resume_notes(rep, told_in)):
                parts.append('<p class="note">' + "<br>".join(_esc(n) for n in notes) + "</p>")
        if (line := repeat_line(rep)) is not None:
            parts.append("<h3>Resume/reconnect cost: what the devices sent or received again</h3>")
            parts.append(f"<p>{_esc(line)}</p>")
            if (cells := repeat_client_cells(rep)):
                parts.append(_html_table(["client", "messages", "up B", "down B", "wire B"], cells))
            if rep["repeats"]["all"]["messages"]:
                parts.append(f'<p class="note">{_esc(REPEAT_NOTE)}</p>')
        parts.append("<h3>Bytes per round, by kind and direction</h3>")
        parts.append(plot_by_round(rep))
        parts.append("<h3>Cumulative device-link bytes and test accuracy</h3>")
        parts.append(plot_curves([(Path(run["path"]).name or run["path"], rep.get("accuracy_curve") or [])],
                                  (rep.get("target") or {}).get("accuracy"), "Test accuracy against bytes paid"))
        parts.append("<h3>Bytes per client</h3>")
        parts.append(plot_clients(rep))
        parts.append("<h3>Protocol overhead</h3>")
        parts.append(plot_overhead(rep))
        tot = rep["totals"]["device"]["all"]
        parts.append(_html_table(["part", "bytes", "share of wire bytes"],
                                 [[n, count(v), pct(v / tot["wire_bytes"] if tot["wire_bytes"] else None)]
                                  for n, v in overhead_parts(tot)]))
        parts.append("<h3>Security: signatures and encryption</h3>")
        parts.append(_security_html(rep))
        parts.append("<h3>Per kind and direction (device links; upper-case kinds are MQTT control packets)</h3>")
        parts.append(_html_table(list(KIND_COLUMNS), kind_cells(rep["by_kind"]), text_columns=2))
        if rep.get("by_kind_server"):
            parts.append("<h3>Per kind and direction (server link, a broadcast counted once; up = towards the "
                         "server, as in its totals)</h3>")
            parts.append(_html_table(list(KIND_COLUMNS), kind_cells(rep["by_kind_server"]), text_columns=2))
        if rep.get("fields"):
            parts.append("<h3>" + _esc(FIELDS_TITLE) + "</h3>")
            parts.append(_html_table(list(FIELD_COLUMNS), field_cells(rep["fields"]), text_columns=4))
            parts.append('<p class="note">' + "<br>".join(_esc(n) for n in field_notes(rep["fields"])) + "</p>")
        rt = rep.get("rejected_totals") or {"messages": len(rep["rejected"]),
                                            "payload_bytes": sum(r["payload_bytes"] for r in rep["rejected"])}
        parts.append(f"<h3>Rejected messages: {_esc(count(rt['messages']))} "
                     f"({_esc(count(rt['payload_bytes']))} payload bytes)</h3>")
        if (lines := delivery_lines(rep.get("deliveries"))):
            parts.append('<p class="note">' + "<br>".join(_esc(line) for line in lines) + "</p>")
        if rep["rejected"]:
            parts.append(_html_table(["side", "node", "topic", "reason", "payload B"],
                                     [[r["side"], r["node"], r["topic"], r["reason"], count(r["payload_bytes"])]
                                      for r in rep["rejected"]], text_columns=4))
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)


def write_html(reports: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write :func:`render_html` to ``path`` (UTF-8); returns the path."""
    out = Path(path)
    out.write_text(render_html(reports), encoding="utf-8")
    return out

