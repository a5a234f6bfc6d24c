"""The communication audit of a run folder: what every link carried, from the byte ledger.

``fedfleet audit RUN_DIR [--json]`` reads ``RUN_DIR/ledger.sqlite`` (see :mod:`protocol.ledger`)
and ``RUN_DIR/metrics.jsonl`` and reports, in bytes, what the federation cost on the wire.

Each message appears in the ledger up to twice: once written by the server (``side='server'``)
and once by each agent that sent or received it (``side='agent'``). The audit therefore looks at
the ledger through one of two **views**:

``"device"`` (the default: *device links*)
    ``side='agent' AND event IN ('sent', 'received')``: uploads as sent by the agents and
    downloads as received by each agent, so a broadcast counts once **per agent that received
    it**. This is what the fleet pays on its (often metered, slow) links.
``"server"`` (the *server link*)
    ``side='server' AND event IN ('sent', 'received')``: what crossed the server's own
    connection to the broker, so a broadcast counts **once**.

Rows with ``event='rejected'`` belong to neither view; :func:`rejected` lists them.

Byte columns, per row (all in bytes)::

    body_bytes       the message kind's body
    envelope_bytes   payload bytes that are not body (envelope fields + msgpack framing)
    mqtt_bytes       mqtt_header_bytes + topic_bytes (PUBLISH framing and topic)
    wire_bytes       mqtt_bytes + payload_bytes = the whole PUBLISH packet,
                     with payload_bytes = envelope_bytes + body_bytes

and the protocol **overhead share** = (wire_bytes − body_bytes) / wire_bytes, a fraction in [0, 1]
(``None`` where nothing was sent: 0 / 0 has no meaning).

The summary functions (:func:`by_round`, :func:`by_client`, :func:`by_kind`, :func:`totals`,
:func:`rejected`) are pure: ledger rows (mappings with the columns of the ``messages`` table, as
:func:`protocol.ledger.read_rows` yields them) in, plain JSON-serialisable lists and dicts out.
"""

from __future__ import annotations

import argparse
import io
import json
import sqlite3
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.errors import LedgerError
from protocol.ledger import read_rows

__all__ = [
    "VIEWS",
    "AuditError",
    "RunAudit",
    "audit_report",
    "by_client",
    "by_kind",
    "by_round",
    "load_run",
    "main_audit",
    "rejected",
    "render_text",
    "totals",
]

#: The two ways to look at the ledger (see the module docstring).
VIEWS = ("device", "server")

LEDGER_NAME = "ledger.sqlite"
METRICS_NAME = "metrics.jsonl"

_COUNTED_EVENTS = ("sent", "received")
_VIEW_SIDE = {"device": "agent", "server": "server"}


class AuditError(Exception):
    """A run folder cannot be audited: it is missing, or its ledger or metrics are unreadable.

    Attributes:
        path: the file or folder that was wrong.
    """

    def __init__(self, message: str, *, path: str | Path | None = None) -> None:
        self.path = None if path is None else str(path)
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class RunAudit:
    """Everything the audit reads from one run folder.

    Attributes:
        run_dir: the run folder.
        rows: every ledger row, in insertion order, as dicts keyed by the ``messages`` columns
            (byte columns in bytes).
        metrics: the records of ``metrics.jsonl`` in file order (empty when the file is absent).
        meta: the ledger's ``meta`` table as key → value (empty when the table is absent).
    """

    run_dir: Path
    rows: list[dict[str, Any]]
    metrics: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# Loading


def load_run(run_dir: str | Path) -> RunAudit:
    """Read the ledger, its meta table and the metrics of a run folder.

    Args:
        run_dir: the run folder (holding ``ledger.sqlite`` and, optionally, ``metrics.jsonl``).

    Raises:
        AuditError: ``run_dir`` is not a folder, has no ``ledger.sqlite``, the ledger is not a
            readable fedfleet ledger, or a line of ``metrics.jsonl`` is not a JSON object.
    """
    run = Path(run_dir)
    if not run.exists():
        raise AuditError(f"run folder {run} does not exist", path=run)
    if not run.is_dir():
        raise AuditError(f"{run} is not a folder (give the run folder that holds {LEDGER_NAME})", path=run)
    ledger = run / LEDGER_NAME
    if not ledger.is_file():
        raise AuditError(f"no {LEDGER_NAME} in {run}: not a fedfleet run folder, or the run wrote no ledger",
                         path=ledger)
    try:
        rows = list(read_rows(ledger))
    except LedgerError as exc:
        raise AuditError(f"cannot audit {run}: {exc}", path=ledger) from exc
    return RunAudit(run_dir=run, rows=rows, metrics=_read_metrics(run / METRICS_NAME), meta=_read_meta(ledger))


def _read_meta(ledger: Path) -> dict[str, str]:
    """The ``meta`` table of a ledger ({} when it has none)."""
    try:
        db = sqlite3.connect(ledger.resolve().as_uri() + "?mode=ro", uri=True)
        try:
            return {str(k): str(v) for k, v in db.execute("SELECT key, value FROM meta")}
        finally:
            db.close()
    except sqlite3.OperationalError:
        return {}
    except sqlite3.Error as exc:
        raise AuditError(f"{ledger} is not a readable fedfleet ledger: {exc}", path=ledger) from exc


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    """Records of ``metrics.jsonl`` ([] when absent); blank lines are skipped."""
    if not path.is_file():
        return []
    records: list[dict[str, Any]] = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AuditError(f"cannot read {path}: {exc}", path=path) from exc
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AuditError(f"{path}:{lineno}: not valid JSON ({exc.msg})", path=path) from exc
        if not isinstance(record, dict):
            raise AuditError(f"{path}:{lineno}: expected a JSON object per round, got {type(record).__name__}",
                             path=path)
        records.append(record)
    return records


# --------------------------------------------------------------------------------------------
# Pure summaries


class _Tally:
    """Running sums of messages and byte columns (bytes)."""

    __slots__ = ("messages", "body", "envelope", "mqtt", "wire")

    def __init__(self) -> None:
        self.messages = 0
        self.body = 0
        self.envelope = 0
        self.mqtt = 0
        self.wire = 0

    def add(self, row: Mapping[str, Any]) -> None:
        mqtt = int(row["mqtt_header_bytes"]) + int(row["topic_bytes"])
        self.messages += 1
        self.body += int(row["body_bytes"])
        self.envelope += int(row["envelope_bytes"])
        self.mqtt += mqtt
        self.wire += mqtt + int(row["payload_bytes"])

    def as_dict(self) -> dict[str, Any]:
        return {"messages": self.messages, "body_bytes": self.body, "envelope_bytes": self.envelope,
                "mqtt_bytes": self.mqtt, "wire_bytes": self.wire,
                "overhead_share": _overhead(self.wire, self.body)}


def _overhead(wire_bytes: int, body_bytes: int) -> float | None:
    """(wire − body) / wire, or None when wire is 0."""
    return (wire_bytes - body_bytes) / wire_bytes if wire_bytes else None


def _select(rows: Iterable[Mapping[str, Any]], view: str) -> list[Mapping[str, Any]]:
    """Rows of ``view`` (see the module docstring).

    Raises:
        ValueError: ``view`` is not one of :data:`VIEWS`.
    """
    if view not in _VIEW_SIDE:
        raise ValueError(f"view must be one of {', '.join(map(repr, VIEWS))}, got {view!r}")
    side = _VIEW_SIDE[view]
    return [r for r in rows if r["side"] == side and r["event"] in _COUNTED_EVENTS]


def _round_key(value: int | None) -> tuple[bool, int]:
    """Sort rounds ascending, rows without a round last."""
    return (value is None, value if value is not None else 0)


def by_round(rows: Iterable[Mapping[str, Any]], view: str = "device") -> list[dict[str, Any]]:
    """Traffic per round in ``view``, rounds ascending (rows without a round last, as ``None``).

    Returns:
        One dict per round: ``round`` (int or None), ``up_messages``, ``up_bytes`` (wire bytes),
        ``up_body_bytes``, ``down_messages``, ``down_bytes`` (wire bytes), ``down_body_bytes``,
        ``overhead_share`` (both directions together; None when no bytes).

    Raises:
        ValueError: unknown ``view``.
    """
    tallies: dict[int | None, dict[str, _Tally]] = {}
    for r in _select(rows, view):
        per_dir = tallies.setdefault(r["round"], {"up": _Tally(), "down": _Tally()})
        per_dir[r["direction"]].add(r)
    out = []
    for rnd in sorted(tallies, key=_round_key):
        up, down = tallies[rnd]["up"], tallies[rnd]["down"]
        out.append({"round": rnd,
                    "up_messages": up.messages, "up_bytes": up.wire, "up_body_bytes": up.body,
                    "down_messages": down.messages, "down_bytes": down.wire, "down_body_bytes": down.body,
                    "overhead_share": _overhead(up.wire + down.wire, up.body + down.body)})
    return out


def by_client(rows: Iterable[Mapping[str, Any]], view: str = "device") -> list[dict[str, Any]]:
    """Traffic per client in ``view``, sorted by client id.

    ``client`` is the agent a row concerns; in the server view a broadcast is recorded once with
    client ``'*'``.

    Returns:
        One dict per client: ``client``, ``up_messages``, ``up_bytes``, ``down_messages``,
        ``down_bytes`` (wire bytes), ``body_bytes`` (both directions).

    Raises:
        ValueError: unknown ``view``.
    """
    tallies: dict[str, dict[str, _Tally]] = {}
    for r in _select(rows, view):
        per_dir = tallies.setdefault(str(r["client"]), {"up": _Tally(), "down": _Tally()})
        per_dir[r["direction"]].add(r)
    return [{"client": c,
             "up_messages": t["up"].messages, "up_bytes": t["up"].wire,
             "down_messages": t["down"].messages, "down_bytes": t["down"].wire,
             "body_bytes": t["up"].body + t["down"].body}
            for c, t in sorted(tallies.items())]


def by_kind(rows: Iterable[Mapping[str, Any]], view: str = "device") -> list[dict[str, Any]]:
    """Traffic per (message kind, direction) in ``view``, sorted by kind then direction.

    Returns:
        One dict per pair: ``kind``, ``direction`` (``'up'``/``'down'``), ``messages``,
        ``body_bytes``, ``envelope_bytes``, ``mqtt_bytes`` (header + topic), ``wire_bytes``,
        ``overhead_share``.

    Raises:
        ValueError: unknown ``view``.
    """
    tallies: dict[tuple[str, str], _Tally] = {}
    for r in _select(rows, view):
        tallies.setdefault((str(r["kind"]), str(r["direction"])), _Tally()).add(r)
    return [{"kind": k, "direction": d, **t.as_dict()} for (k, d), t in sorted(tallies.items())]


def totals(rows: Iterable[Mapping[str, Any]], view: str = "device") -> dict[str, Any]:
    """Totals of ``view`` by direction and overall.

    Returns:
        ``{"view": view, "up": T, "down": T, "all": T}`` where each ``T`` holds ``messages``,
        ``body_bytes``, ``envelope_bytes``, ``mqtt_bytes``, ``wire_bytes`` and ``overhead_share``.

    Raises:
        ValueError: unknown ``view``.
    """
    up, down, both = _Tally(), _Tally(), _Tally()
    for r in _select(rows, view):
        (up if r["direction"] == "up" else down).add(r)
        both.add(r)
    return {"view": view, "up": up.as_dict(), "down": down.as_dict(), "all": both.as_dict()}


def rejected(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rejected messages (either side), in ledger order.

    Returns:
        One dict per rejected row: ``side``, ``node`` (who rejected it), ``topic``, ``reason``,
        ``payload_bytes`` (the MQTT payload length, bytes).
    """
    return [{"side": r["side"], "node": r["node"], "topic": r["topic"], "reason": r["reason"],
             "payload_bytes": int(r["payload_bytes"])}
            for r in rows if r["event"] == "rejected"]


# --------------------------------------------------------------------------------------------
# Report


def audit_report(run_dir: str | Path) -> dict[str, Any]:
    """The whole audit of a run folder as a JSON-serialisable dict (byte counts in bytes).

    Keys:
        ``run``: ``path``, ``federation`` (the ledger's ``meta`` value, else the federation(s)
        named in the rows, else None), ``rounds`` (distinct round numbers in the ledger),
        ``metrics_rounds`` (records in ``metrics.jsonl``).
        ``totals``: ``{"device": totals(rows, "device"), "server": totals(rows, "server")}``.
        ``by_round``, ``by_client``, ``by_kind``: device view.
        ``rejected``: :func:`rejected`; ``rejected_totals``: ``messages``, ``payload_bytes``,
        ``wire_bytes``.
        ``final_accuracy``: fraction in [0, 1] from the last metrics record with an ``accuracy``,
        or None.

    Raises:
        AuditError: see :func:`load_run`.
    """
    run = load_run(run_dir)
    rows = run.rows
    federation = run.meta.get("federation")
    if federation is None:
        names = sorted({str(r["federation"]) for r in rows})
        federation = ", ".join(names) if names else None
    rejected_rows = [r for r in rows if r["event"] == "rejected"]
    final_accuracy = None
    for record in run.metrics:
        if record.get("accuracy") is not None:
            final_accuracy = record["accuracy"]
    return {
        "run": {"path": str(run.run_dir), "federation": federation,
                "rounds": len({r["round"] for r in rows if r["round"] is not None}),
                "metrics_rounds": len(run.metrics)},
        "totals": {view: totals(rows, view) for view in VIEWS},
        "by_round": by_round(rows, "device"),
        "by_client": by_client(rows, "device"),
        "by_kind": by_kind(rows, "device"),
        "rejected": rejected(rows),
        "rejected_totals": {
            "messages": len(rejected_rows),
            "payload_bytes": sum(int(r["payload_bytes"]) for r in rejected_rows),
            "wire_bytes": sum(int(r["mqtt_header_bytes"]) + int(r["topic_bytes"]) + int(r["payload_bytes"])
                              for r in rejected_rows),
        },
        "final_accuracy": final_accuracy,
    }


def _n(value: int) -> str:
    return f"{value:,}"


def _human(n_bytes: int) -> str:
    """Bytes in binary units: B, KiB, MiB, GiB."""
    if n_bytes < 1024:
        return f"{n_bytes} B"
    for unit, scale in (("KiB", 1024), ("MiB", 1024**2), ("GiB", 1024**3)):
        if n_bytes < scale * 1024 or unit == "GiB":
            return f"{n_bytes / scale:,.1f} {unit}"
    raise AssertionError("unreachable")


def _pct(share: float | None) -> str:
    return "—" if share is None else f"{100 * share:.1f} %"


def render_text(report: Mapping[str, Any]) -> str:
    """Human tables of an :func:`audit_report` for a terminal (plain text, 120 columns).

    Sections: Totals (device links, server link), Per round, Per client, Per kind and
    direction, Rejected messages. Counts use thousands separators; byte columns are in bytes,
    and the totals add the wire bytes in KiB/MiB.
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=False, color_system=None, highlight=False,
                      emoji=False, soft_wrap=False)

    def table(*headers: str, text_columns: int = 1) -> Table:
        """Counts right-aligned; the first ``text_columns`` columns are left-aligned text."""
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for i, h in enumerate(headers):
            t.add_column(h, justify="left" if i < text_columns else "right", no_wrap=(i == 0),
                         overflow="fold")
        return t

    run = report["run"]
    acc = report.get("final_accuracy")
    console.print(f"Run: {run['path']}")
    console.print(f"Federation: {run.get('federation') or '—'}   rounds: {run['rounds']}   "
                  f"final accuracy: {'—' if acc is None else f'{100 * acc:.2f} %'}")

    titles = {"device": "Totals: device links (agent side: uploads sent + downloads received by each agent)",
              "server": "Totals: server link (server side: sent + received; a broadcast counts once)"}
    for view in VIEWS:
        tot = report["totals"][view]
        console.print()
        console.print(titles[view])
        t = table("direction", "messages", "body B", "envelope B", "MQTT B", "wire B", "wire", "overhead")
        for label, key in (("up", "up"), ("down", "down"), ("total", "all")):
            d = tot[key]
            t.add_row(label, _n(d["messages"]), _n(d["body_bytes"]), _n(d["envelope_bytes"]),
                      _n(d["mqtt_bytes"]), _n(d["wire_bytes"]), _human(d["wire_bytes"]),
                      _pct(d["overhead_share"]))
        console.print(t)

    console.print()
    console.print("Per round (device links; bytes = wire bytes)")
    t = table("round", "up msgs", "up B", "up body B", "down msgs", "down B", "down body B", "overhead")
    for r in report["by_round"]:
        t.add_row("—" if r["round"] is None else str(r["round"]), _n(r["up_messages"]), _n(r["up_bytes"]),
                  _n(r["up_body_bytes"]), _n(r["down_messages"]), _n(r["down_bytes"]),
                  _n(r["down_body_bytes"]), _pct(r["overhead_share"]))
    console.print(t)

    console.print()
    console.print("Per client (device links; bytes = wire bytes)")
    t = table("client", "up msgs", "up B", "down msgs", "down B", "body B")
    for c in report["by_client"]:
        t.add_row(c["client"], _n(c["up_messages"]), _n(c["up_bytes"]), _n(c["down_messages"]),
                  _n(c["down_bytes"]), _n(c["body_bytes"]))
    console.print(t)

    console.print()
    console.print("Per kind and direction (device links)")
    t = table("kind", "dir", "messages", "body B", "envelope B", "MQTT B", "wire B", "overhead", text_columns=2)
    for k in report["by_kind"]:
        t.add_row(k["kind"], k["direction"], _n(k["messages"]), _n(k["body_bytes"]), _n(k["envelope_bytes"]),
                  _n(k["mqtt_bytes"]), _n(k["wire_bytes"]), _pct(k["overhead_share"]))
    console.print(t)

    console.print()
    rt = report.get("rejected_totals") or {
        "messages": len(report["rejected"]),
        "payload_bytes": sum(r["payload_bytes"] for r in report["rejected"])}
    console.print(f"Rejected messages: {_n(rt['messages'])} ({_n(rt['payload_bytes'])} payload bytes)")
    if report["rejected"]:
        t = table("side", "node", "topic", "reason", "payload B", text_columns=4)
        for r in report["rejected"]:
            t.add_row(r["side"], r["node"], r["topic"], r["reason"], _n(r["payload_bytes"]))
        console.print(t)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


def main_audit(args: list[str] | None = None) -> int:
    """``fedfleet audit RUN_DIR [--json]``: print the audit of a run folder.

    Returns:
        0 on success; 2 when the run folder cannot be audited (:class:`AuditError`), after one
        line ``fedfleet audit: error: …`` on stderr.
    """
    parser = argparse.ArgumentParser(
        prog="fedfleet audit",
        description="Bytes every link carried in a run, from RUN_DIR/ledger.sqlite: device links "
                    "(what the agents sent and received) and the server link.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run folder holding ledger.sqlite")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    ns = parser.parse_args(args)
    try:
        report = audit_report(ns.run_dir)
    except AuditError as exc:
        print(f"fedfleet audit: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        sys.stdout.write(render_text(report))
    return 0
