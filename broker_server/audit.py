"""The communication audit of run folders: what every link carried, from the byte ledger.

``fedfleet audit RUN_DIR [RUN_DIR ...] [--json] [--html OUT.html] [--csv DIR] [--target 0.95]
[--uplink-kbps K] [--downlink-kbps K]`` reads ``RUN_DIR/ledger.sqlite`` (see :mod:`protocol.ledger`)
and ``RUN_DIR/metrics.jsonl`` and reports, in bytes, what the federation cost on the wire: as text
tables (default), JSON, a self-contained HTML report with plots, and CSV files. Given several run
folders it also compares them (final accuracy, bytes, overhead, bytes to reach a target accuracy,
estimated transfer time on a given link).

Each message appears in the ledger up to twice: once written by the server (``side='server'``)
and once by each agent that sent or received it (``side='agent'``). The audit therefore looks at
the ledger through one of two **views**:

``"device"`` (the default: *device links*)
    ``side='agent' AND event IN ('sent', 'received', 'rejected')``: uploads as sent by the agents and
    downloads as received by each agent, so a broadcast counts once **per agent that received
    it**. This is what the fleet pays on its (often metered, slow) links.
``"server"`` (the *server link*)
    ``side='server' AND event IN ('sent', 'received', 'rejected')``: what crossed the server's own
    connection to the broker, so a broadcast counts **once**.

Rows with ``event='rejected'`` count in their side's view (the bytes crossed that link, even
though the receiver refused them); :func:`rejected` also lists them with their reasons. Rows with
``event='message'`` (the logical record of a chunked message, whose bytes the chunk rows already
count) belong to no view.

**Control packets.** The ledger also holds one row per MQTT packet that is not an application
PUBLISH (CONNECT, CONNACK, SUBSCRIBE, SUBACK, PUBACK, PINGREQ, PINGRESP, DISCONNECT, and
PUBLISH-DUP for a retransmission): ``reason='control'``, ``round`` NULL, payload 0 and
``mqtt_header_bytes`` = the whole packet. They are real bytes on the link, so they count in every
view like any other row: as their own kinds in :func:`by_kind`, in :func:`totals` (in
``control_bytes`` and ``wire_bytes``), in the overhead share (they carry no body), and in
:func:`by_round` under the *session* row (``round`` None: traffic not tied to one round).

Byte columns, per row (all in bytes)::

    body_bytes       the message kind's body
    envelope_bytes   payload bytes that are not body, signature or encryption (envelope fields +
                     msgpack framing)
    sig_bytes        the signature trailers of signed messages (``protocol.security``)
    enc_bytes        what encryption added (AES-GCM tags)
    mqtt_bytes       mqtt_header_bytes + topic_bytes of an application PUBLISH (framing and topic)
    control_bytes    the whole packet of a control-packet row (0 for application messages)
    wire_bytes       what crossed the link: mqtt_header_bytes + topic_bytes + payload_bytes,
                     so wire = body + envelope + sig + enc + mqtt + control

``signed_messages`` / ``encrypted_messages`` count the rows that carried a signature / an
encrypted body. A chunked transfer's chunks are each signed (and their bodies encrypted on
uploads), so these costs are all on the wire rows.

and the protocol **overhead share** = (wire_bytes − body_bytes) / wire_bytes, a fraction in [0, 1]
(``None`` where nothing was sent: 0 / 0 has no meaning).

**Body fields.** :func:`body_fields` shows what ``global`` and ``update`` bodies are made of:
model ``tensors``, each named ``extras.<name>`` entry, and the rest, with the tensor values'
bytes before the codec (``raw_bytes``). It reads each message once, as its **sender** encoded it
(the sender's ``fields`` column breaks ``extras`` down per entry; the receiver's holds one lump):
the agents' rows for uploads, the server's for downloads, whole-message rows only
(:func:`whole_message`: a chunked transfer's ``event='message'`` row, never its chunk rows).

The summary functions (:func:`by_round`, :func:`by_round_kind`, :func:`by_client`,
:func:`by_kind`, :func:`body_fields`, :func:`totals`, :func:`rejected`, :func:`bytes_to_target`,
:func:`cumulative_bytes`, :func:`link_time_s`, :func:`comparison_row`) are pure: ledger rows
(mappings with the columns of the ``messages`` table, as :func:`protocol.ledger.read_rows` yields
them, in ledger order) and metrics records in, plain JSON-serialisable lists and dicts out. Rows
are read by column name; columns the audit does not know are ignored, and optional ones that are
missing (``reason``, ``topic``, ``node`` …) read as empty.
"""

from __future__ import annotations

import argparse
import base64
import bisect
import csv
import html
import io
import json
import math
import sqlite3
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.errors import LedgerError
from protocol.ledger import read_rows

__all__ = [
    "CONTROL_KINDS",
    "DEFAULT_TARGET",
    "VIEWS",
    "AuditError",
    "RunAudit",
    "accuracy_curve",
    "add_audit_arguments",
    "audit_report",
    "body_fields",
    "by_client",
    "by_kind",
    "by_round",
    "by_round_kind",
    "bytes_to_target",
    "comparison_row",
    "cumulative_bytes",
    "field_bytes_per_client_round",
    "field_codecs",
    "link_time_s",
    "load_run",
    "main_audit",
    "rejected",
    "render_comparison_text",
    "render_html",
    "render_text",
    "run_audit",
    "totals",
    "whole_message",
    "write_csv",
    "write_html",
]

#: The two ways to look at the ledger (see the module docstring).
VIEWS = ("device", "server")

#: Kinds of the ledger's MQTT control-packet rows (they also carry ``reason='control'``).
CONTROL_KINDS = frozenset({"CONNECT", "CONNACK", "SUBSCRIBE", "SUBACK", "UNSUBSCRIBE", "UNSUBACK", "PUBACK",
                           "PUBREC", "PUBREL", "PUBCOMP", "PINGREQ", "PINGRESP", "DISCONNECT", "AUTH",
                           "PUBLISH-DUP"})

#: Default target accuracy (a fraction) for "bytes to reach the target".
DEFAULT_TARGET = 0.95

LEDGER_NAME = "ledger.sqlite"
METRICS_NAME = "metrics.jsonl"

_COUNTED_EVENTS = ("sent", "received", "rejected")
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


def _int(row: Mapping[str, Any], key: str) -> int:
    """An integer column by name, 0 when missing or NULL."""
    value = row.get(key)
    return 0 if value is None else int(value)


def _str(row: Mapping[str, Any], key: str) -> str:
    """A text column by name, '' when missing or NULL."""
    value = row.get(key)
    return "" if value is None else str(value)


def is_control(row: Mapping[str, Any]) -> bool:
    """Whether a ledger row is an MQTT control packet (``reason='control'``, or a control kind)."""
    return _str(row, "reason") == "control" or _str(row, "kind") in CONTROL_KINDS


def _wire(row: Mapping[str, Any]) -> int:
    """Bytes the row's packet took on the link: header + topic + payload."""
    return _int(row, "mqtt_header_bytes") + _int(row, "topic_bytes") + _int(row, "payload_bytes")


class _Tally:
    """Running sums of messages and byte columns (bytes)."""

    __slots__ = ("messages", "body", "envelope", "mqtt", "control_messages", "control", "wire", "sig", "enc",
                 "signed", "encrypted")

    def __init__(self) -> None:
        self.messages = 0
        self.body = 0
        self.envelope = 0
        self.mqtt = 0
        self.control_messages = 0
        self.control = 0
        self.wire = 0
        self.sig = self.enc = self.signed = self.encrypted = 0

    def add(self, row: Mapping[str, Any]) -> None:
        wire = _wire(row)
        self.messages += 1
        self.wire += wire
        if is_control(row):
            # The whole packet is protocol overhead; a control row has no envelope or body.
            self.control_messages += 1
            self.control += wire
        else:
            self.body += _int(row, "body_bytes")
            self.envelope += _int(row, "envelope_bytes")
            self.mqtt += _int(row, "mqtt_header_bytes") + _int(row, "topic_bytes")
            sig, enc = _int(row, "sig_bytes"), _int(row, "enc_bytes")
            self.sig += sig
            self.enc += enc
            self.signed += sig > 0
            self.encrypted += enc > 0

    def as_dict(self) -> dict[str, Any]:
        return {"messages": self.messages, "body_bytes": self.body, "envelope_bytes": self.envelope,
                "mqtt_bytes": self.mqtt, "control_messages": self.control_messages,
                "control_bytes": self.control, "wire_bytes": self.wire,
                "overhead_share": _overhead(self.wire, self.body), "sig_bytes": self.sig, "enc_bytes": self.enc,
                "signed_messages": self.signed, "encrypted_messages": self.encrypted}


def _overhead(wire_bytes: int, body_bytes: int) -> float | None:
    """(wire − body) / wire, or None when wire is 0."""
    return (wire_bytes - body_bytes) / wire_bytes if wire_bytes else None


def _ordered(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Rows in ledger order: by ``id`` where every row has one, else as given."""
    rows = list(rows)
    if rows and all(r.get("id") is not None for r in rows):
        return sorted(rows, key=lambda r: int(r["id"]))
    return rows


def _select(rows: Iterable[Mapping[str, Any]], view: str) -> list[Mapping[str, Any]]:
    """Rows of ``view`` (see the module docstring), in the order given.

    Raises:
        ValueError: ``view`` is not one of :data:`VIEWS`.
    """
    if view not in _VIEW_SIDE:
        raise ValueError(f"view must be one of {', '.join(map(repr, VIEWS))}, got {view!r}")
    side = _VIEW_SIDE[view]
    return [r for r in rows if r.get("side") == side and r.get("event") in _COUNTED_EVENTS]


def _round_of(row: Mapping[str, Any]) -> int | None:
    value = row.get("round")
    return None if value is None else int(value)


def _round_key(value: int | None) -> tuple[bool, int]:
    """Sort rounds ascending, rows without a round (the session) last."""
    return (value is None, value if value is not None else 0)


def round_label(value: int | None) -> str:
    """``'session'`` for traffic without a round (round NULL), else the round number."""
    return "session" if value is None else str(value)


def by_round(rows: Iterable[Mapping[str, Any]], view: str = "device") -> list[dict[str, Any]]:
    """Traffic per round in ``view``, rounds ascending; rows without a round (control packets and
    any other traffic not tied to a round) form the last, *session* row with ``round`` None.

    Returns:
        One dict per round: ``round`` (int or None), ``up_messages``, ``up_bytes`` (wire bytes),
        ``up_body_bytes``, ``down_messages``, ``down_bytes`` (wire bytes), ``down_body_bytes``,
        ``overhead_share`` (both directions together; None when no bytes).

    Raises:
        ValueError: unknown ``view``.
    """
    tallies: dict[int | None, dict[str, _Tally]] = {}
    for r in _select(rows, view):
        per_dir = tallies.setdefault(_round_of(r), {"up": _Tally(), "down": _Tally()})
        per_dir["up" if r.get("direction") == "up" else "down"].add(r)
    out = []
    for rnd in sorted(tallies, key=_round_key):
        up, down = tallies[rnd]["up"], tallies[rnd]["down"]
        out.append({"round": rnd,
                    "up_messages": up.messages, "up_bytes": up.wire, "up_body_bytes": up.body,
                    "down_messages": down.messages, "down_bytes": down.wire, "down_body_bytes": down.body,
                    "overhead_share": _overhead(up.wire + down.wire, up.body + down.body)})
    return out


def by_round_kind(rows: Iterable[Mapping[str, Any]], view: str = "device") -> list[dict[str, Any]]:
    """Traffic per (round, kind, direction) in ``view``: rounds ascending with the session
    (``round`` None) last, then kind, then direction.

    Returns:
        One dict per triple: ``round``, ``kind``, ``direction``, ``control`` (bool: a control
        packet kind), ``messages``, ``wire_bytes`` (bytes).

    Raises:
        ValueError: unknown ``view``.
    """
    tallies: dict[tuple[int | None, str, str], list[Any]] = {}
    for r in _select(rows, view):
        entry = tallies.setdefault((_round_of(r), _str(r, "kind"), _str(r, "direction")), [0, 0, False])
        entry[0] += 1
        entry[1] += _wire(r)
        entry[2] = entry[2] or is_control(r)
    keys = sorted(tallies, key=lambda k: (_round_key(k[0]), k[1], k[2]))
    return [{"round": k[0], "kind": k[1], "direction": k[2], "control": tallies[k][2],
             "messages": tallies[k][0], "wire_bytes": tallies[k][1]} for k in keys]


def by_client(rows: Iterable[Mapping[str, Any]], view: str = "device") -> list[dict[str, Any]]:
    """Traffic per client in ``view``, sorted by client id.

    ``client`` is the agent a row concerns; in the server view a broadcast (and the server's own
    control packets) is recorded with client ``'*'``.

    Returns:
        One dict per client: ``client``, ``up_messages``, ``up_bytes``, ``down_messages``,
        ``down_bytes`` (wire bytes), ``body_bytes`` (both directions).

    Raises:
        ValueError: unknown ``view``.
    """
    tallies: dict[str, dict[str, _Tally]] = {}
    for r in _select(rows, view):
        per_dir = tallies.setdefault(_str(r, "client"), {"up": _Tally(), "down": _Tally()})
        per_dir["up" if r.get("direction") == "up" else "down"].add(r)
    return [{"client": c,
             "up_messages": t["up"].messages, "up_bytes": t["up"].wire,
             "down_messages": t["down"].messages, "down_bytes": t["down"].wire,
             "body_bytes": t["up"].body + t["down"].body}
            for c, t in sorted(tallies.items())]


def by_kind(rows: Iterable[Mapping[str, Any]], view: str = "device") -> list[dict[str, Any]]:
    """Traffic per (message kind, direction) in ``view``, sorted by kind then direction.

    Control packets appear under their own kinds (``CONNECT``, ``PUBACK`` …), with all their
    bytes in ``control_bytes``.

    Returns:
        One dict per pair: ``kind``, ``direction`` (``'up'``/``'down'``), ``messages``,
        ``body_bytes``, ``envelope_bytes``, ``mqtt_bytes`` (header + topic), ``control_messages``,
        ``control_bytes``, ``wire_bytes``, ``overhead_share``.

    Raises:
        ValueError: unknown ``view``.
    """
    tallies: dict[tuple[str, str], _Tally] = {}
    for r in _select(rows, view):
        tallies.setdefault((_str(r, "kind"), _str(r, "direction")), _Tally()).add(r)
    return [{"kind": k, "direction": d, **t.as_dict()} for (k, d), t in sorted(tallies.items())]


def totals(rows: Iterable[Mapping[str, Any]], view: str = "device") -> dict[str, Any]:
    """Totals of ``view`` by direction and overall, control packets included.

    Returns:
        ``{"view": view, "up": T, "down": T, "all": T}`` where each ``T`` holds ``messages``
        (control packets included), ``body_bytes``, ``envelope_bytes``, ``mqtt_bytes``,
        ``control_messages``, ``control_bytes``, ``wire_bytes`` (= body + envelope + mqtt +
        control) and ``overhead_share``.

    Raises:
        ValueError: unknown ``view``.
    """
    up, down, both = _Tally(), _Tally(), _Tally()
    for r in _select(rows, view):
        (up if r.get("direction") == "up" else down).add(r)
        both.add(r)
    return {"view": view, "up": up.as_dict(), "down": down.as_dict(), "all": both.as_dict()}


def rejected(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rejected messages (either side), in ledger order.

    Returns:
        One dict per rejected row: ``side``, ``node`` (who rejected it), ``topic``, ``reason``,
        ``payload_bytes`` (the MQTT payload length, bytes).
    """
    return [{"side": _str(r, "side"), "node": _str(r, "node"), "topic": _str(r, "topic"),
             "reason": _str(r, "reason"), "payload_bytes": _int(r, "payload_bytes")}
            for r in rows if r.get("event") == "rejected"]


# --------------------------------------------------------------------------------------------
# What the messages are made of: body fields


#: The side that sends each direction (its rows break the body down per ``extras`` entry).
_SENDER_SIDE = {"up": "agent", "down": "server"}
_RECEIVER_SIDE = {"up": "server", "down": "agent"}


def whole_message(row: Mapping[str, Any]) -> bool:
    """Whether a ledger row stands for one whole message, once: an unchunked ``sent`` or
    ``received`` row, or the ``event='message'`` row of a chunked transfer. The chunk rows of a
    transfer (``chunk_index`` set) and ``rejected`` rows are not."""
    event = row.get("event")
    return event == "message" or (event in ("sent", "received") and row.get("chunk_index") is None)


def field_codecs(codec: str) -> dict[str, str]:
    """The codec of each tensor-bearing body field from a sender's ``codec`` column.

    The column holds one codec for the whole message (``"fp32"``, ``"int8+zstd"``, ``"topk:0.01"``),
    or, when ``extras`` entries use other codecs (``[protocol] extras_codec``), the model
    tensors' codec (only when the message has model tensors) followed by ``name=codec`` pairs:
    ``"fp32,soft_predictions=int8+zstd"`` (see :meth:`protocol.channel.Channel.send`).

    Returns:
        ``{field: codec}`` with the keys ``"tensors"`` and ``"extras.<name>"``; ``"*"`` maps to
        the codec of every field not listed ({} for an empty column). Integer arrays always travel
        raw whatever the codec says (:func:`protocol.tensors.encode_tensor`).
    """
    codec = codec.strip()
    if not codec:
        return {}
    if "=" not in codec:
        return {"*": codec}
    out: dict[str, str] = {}
    for part in codec.split(","):
        name, eq, value = part.partition("=")
        if eq:
            out[f"extras.{name.strip()}"] = value.strip()
        elif part.strip():
            out["tensors"] = part.strip()
    return out


def _field_parts(fields_json: str) -> tuple[list[tuple[str, int]], bool]:
    """The ``tensors`` and extras fields of one row's ``fields`` column as (name, bytes), in wire
    order, and whether the row breaks ``extras`` down per entry (an unreadable column: none). A sender's row has ``extras.<name>`` entries and an
    ``extras`` map header (framing); a receiver's row has one lump ``extras`` (entries and
    header), which is then a field of its own."""
    try:
        fields = json.loads(fields_json) if fields_json else {}
    except json.JSONDecodeError:
        return [], False
    if not isinstance(fields, dict):
        return [], False
    per_entry = any(str(k).startswith("extras.") for k in fields)
    out = []
    for name, value in fields.items():
        if name == "tensors" or str(name).startswith("extras.") or (name == "extras" and not per_entry):
            try:
                out.append((str(name), int(value)))
            except (TypeError, ValueError):
                continue
    return out, per_entry


def _bearing(name: str, n_bytes: int) -> bool:
    """Whether a field carries tensor values (an empty ``tensors`` list is 1 byte: 0x90)."""
    return not (name == "tensors" and n_bytes <= 1)


class _FieldTally:
    """Running sums of one (kind, direction): messages, bytes per field, raw bytes."""

    def __init__(self, kind: str, direction: str, source: str) -> None:
        self.kind, self.direction, self.source = kind, direction, source
        self.messages = self.chunked = self.message_bytes = self.body = self.raw = 0
        self.client_rounds: set[tuple[str, int | None]] = set()
        self.bytes: dict[str, int] = {}
        self.count: dict[str, int] = {}
        self.codecs: dict[str, set[str]] = {}
        self.field_raw: dict[str, int | None] = {}
        self.per_entry = False

    def add(self, row: Mapping[str, Any]) -> None:
        parts, per_entry = _field_parts(_str(row, "fields"))
        self.per_entry = self.per_entry or per_entry
        message = _int(row, "envelope_bytes") + _int(row, "body_bytes")
        raw = _int(row, "raw_bytes")
        self.messages += 1
        self.chunked += row.get("transfer_id") is not None
        self.message_bytes += message
        self.body += _int(row, "body_bytes")
        self.raw += raw
        self.client_rounds.add((_str(row, "client"), _round_of(row)))
        codecs = field_codecs(_str(row, "codec")) if self.source == "sender" else {}
        bearing = [name for name, n in parts if _bearing(name, n)]
        for name, n in parts:
            self.bytes[name] = self.bytes.get(name, 0) + n
            self.count[name] = self.count.get(name, 0) + 1
            codec = codecs.get(name, codecs.get("*", _str(row, "codec") if self.source == "receiver" else ""))
            if codec and _bearing(name, n):
                self.codecs.setdefault(name, set()).add(codec)
            # The ledger has one raw_bytes per message: it belongs to a field only when that field
            # is the message's one tensor-bearing field (an empty tensor list holds none).
            if not _bearing(name, n):
                share: int | None = 0
            else:
                share = raw if len(bearing) == 1 else None
            known = self.field_raw.get(name, 0)
            self.field_raw[name] = None if known is None or share is None else known + share

    def as_dict(self) -> dict[str, Any]:
        msgs = self.messages
        tensor = sum(n for k, n in self.bytes.items() if k == "tensors")
        extras = sum(n for k, n in self.bytes.items() if k != "tensors")
        other = self.message_bytes - tensor - extras
        fields = [{"field": name, "messages": self.count[name], "bytes": n, "mean_bytes": n / msgs,
                   "share": n / self.message_bytes if self.message_bytes else None,
                   "codec": ",".join(sorted(self.codecs.get(name, ()))), "raw_bytes": self.field_raw[name]}
                  for name, n in sorted(self.bytes.items(), key=lambda kv: kv[0] != "tensors")]
        fields.append({"field": "other", "messages": msgs, "bytes": other, "mean_bytes": other / msgs,
                       "share": other / self.message_bytes if self.message_bytes else None, "codec": "",
                       "raw_bytes": None})
        return {"kind": self.kind, "direction": self.direction, "source": self.source,
                "extras_per_entry": self.per_entry, "messages": msgs, "chunked_messages": self.chunked,
                "client_rounds": len(self.client_rounds), "message_bytes": self.message_bytes,
                "body_bytes": self.body, "tensor_bytes": tensor, "extras_bytes": extras, "other_bytes": other,
                "raw_bytes": self.raw, "encoded_bytes": tensor + extras,
                "mean_message_bytes": self.message_bytes / msgs, "fields": fields}


def body_fields(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What ``global`` and ``update`` messages are made of, field by field, from the ledger.

    Each message counts **once, as its sender encoded it**: uploads (``update``, up) from the
    agents' rows, downloads (``global``, down) from the server's rows, so a broadcast counts once,
    whatever the number of agents that received it. Only whole-message rows count
    (:func:`whole_message`): the ``event='message'`` row of a chunked transfer (its chunk rows
    carry no fields) or the unchunked ``sent`` row. A ledger without the sender's rows (an
    agent's own ledger has no server rows) falls back to the receiver's whole-message rows
    (``source='receiver'``): their ``extras`` is one lump (entries and map header).

    Bytes are those of the encoded message, before signing, encryption and chunking:
    ``message_bytes`` = envelope_bytes + body_bytes = ``tensor_bytes`` (model ``tensors``) +
    ``extras_bytes`` (every ``extras.<name>`` entry: key + encoded array) + ``other_bytes``
    (everything else: envelope header and msgpack framing, the scalar body fields such as
    ``num_samples``, ``metrics``, ``meta``, and the 1–3 byte ``extras`` map header). The MQTT
    framing, chunk framing, signatures and encryption of each packet are in :func:`by_kind`.

    Returns:
        One dict per (kind, direction) that has messages, ``global`` first: ``kind``,
        ``direction``, ``source`` (``'sender'``/``'receiver'``), ``extras_per_entry`` (bool),
        ``messages``, ``chunked_messages``, ``client_rounds`` (distinct (client, round) pairs;
        a broadcast's client is ``'*'``), ``message_bytes``, ``body_bytes``, ``tensor_bytes``,
        ``extras_bytes``, ``other_bytes``, ``raw_bytes`` (the ledger's ``raw_bytes``: tensor and
        extras values before the codec, ``size × itemsize``), ``encoded_bytes`` (tensor_bytes +
        extras_bytes: what ``raw_bytes`` became), ``mean_message_bytes``, and ``fields``: one
        dict per field — ``tensors`` first, then each ``extras.<name>`` in order of first
        appearance (or the lump ``extras``), then ``other`` — with ``field``, ``messages`` (that
        carried it), ``bytes``, ``mean_bytes`` (per message of the kind, so the means add up to
        ``mean_message_bytes``), ``share`` (of ``message_bytes``), ``codec`` (as configured,
        from the sender's ``codec`` column — :func:`field_codecs`; on a receiver's row the codec
        of its first float tensor; several joined by commas; '' for ``other`` and an empty
        ``tensors`` list) and ``raw_bytes``: the field's bytes before the codec where the
        ledger tells them apart — the message's ``raw_bytes`` when the field is its only
        tensor-bearing field, 0 for an empty ``tensors`` list — else None (several tensor-bearing
        fields share one ``raw_bytes``; see the kind's ``raw_bytes`` and ``encoded_bytes``).
    """
    rows = list(rows)
    out = []
    for kind, direction in (("global", "down"), ("update", "up")):
        mine = [r for r in rows if _str(r, "kind") == kind and r.get("direction") == direction and whole_message(r)]
        source = "sender"
        chosen = [r for r in mine if r.get("side") == _SENDER_SIDE[direction] and r.get("event") != "received"]
        if not chosen:
            source = "receiver"
            chosen = [r for r in mine if r.get("side") == _RECEIVER_SIDE[direction] and r.get("event") != "sent"]
        if not chosen:
            continue
        tally = _FieldTally(kind, direction, source)
        for r in chosen:
            tally.add(r)
        out.append(tally.as_dict())
    return out


def field_bytes_per_client_round(fields: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Model-tensor and extras bytes per client per round, from :func:`body_fields`.

    For each direction, the group's ``tensor_bytes`` and ``extras_bytes`` divided by its
    ``client_rounds``: per update a client sent in a round (up), and per global a client
    received in a round (down: a broadcast, client ``'*'``, is one per round and reaches every
    client whole).

    Returns:
        ``up_tensor_bytes_per_client_round``, ``up_extras_bytes_per_client_round``,
        ``down_tensor_bytes_per_client_round``, ``down_extras_bytes_per_client_round`` (bytes;
        None where the direction has no message).
    """
    out: dict[str, float | None] = {f"{d}_{p}_bytes_per_client_round": None
                                    for d in ("up", "down") for p in ("tensor", "extras")}
    for g in fields:
        n = g.get("client_rounds") or 0
        if n:
            out[f"{g['direction']}_tensor_bytes_per_client_round"] = g["tensor_bytes"] / n
            out[f"{g['direction']}_extras_bytes_per_client_round"] = g["extras_bytes"] / n
    return out


# --------------------------------------------------------------------------------------------
# Accuracy against bytes, and transfer time


def _accuracy_records(metrics: Iterable[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """(round, accuracy) of the metrics records that have both, in file order."""
    out = []
    for m in metrics:
        acc, rnd = m.get("accuracy"), m.get("round")
        if acc is None or rnd is None:
            continue
        try:
            out.append((int(rnd), float(acc)))
        except (TypeError, ValueError):
            continue
    return out


def cumulative_bytes(rows: Iterable[Mapping[str, Any]], rounds: Iterable[int]) -> dict[int, int]:
    """Device-link wire bytes (bytes) paid by the fleet up to and including each round in ``rounds``.

    For training round ``R`` (≥ 1): every device-view row of a round 1 … ``R``, plus every
    *session* row recorded in the ledger **before** the last row of those rounds. Session rows
    are the ones not tied to a training round: ``round`` NULL (MQTT control packets: CONNECT,
    SUBSCRIBE, PUBACK …) or ``round`` 0 (what the protocol sends outside a round: join, status,
    resend). So the connection set-up and the acknowledgements exchanged up to the end of round
    ``R`` count, the final ``offline`` status and DISCONNECT do not. Rows are taken in ledger
    order (by ``id`` where every row has one); rows of later rounds never count, even when they
    interleave.

    Returns:
        ``{R: bytes}`` for every ``R`` in ``rounds`` (0 where the ledger has nothing up to ``R``).
    """
    dev = _select(_ordered(rows), "device")
    per_round: dict[int, int] = {}
    last_pos: dict[int, int] = {}
    session_pos: list[int] = []
    session_cum: list[int] = []  # cumulative session bytes up to and including that position
    running = 0
    for pos, r in enumerate(dev):
        rnd = _round_of(r)
        if rnd is None or rnd < 1:
            running += _wire(r)
            session_pos.append(pos)
            session_cum.append(running)
        else:
            per_round[rnd] = per_round.get(rnd, 0) + _wire(r)
            last_pos[rnd] = pos
    known = sorted(per_round)
    prefix_bytes: list[int] = []  # bytes of the rounds known[:i + 1]
    prefix_last: list[int] = []  # position of the last row of those rounds
    for k in known:
        prefix_bytes.append((prefix_bytes[-1] if prefix_bytes else 0) + per_round[k])
        prefix_last.append(max(prefix_last[-1] if prefix_last else -1, last_pos[k]))
    out: dict[int, int] = {}
    for target_round in rounds:
        i = bisect.bisect_right(known, target_round)
        if i == 0:
            out[target_round] = 0
            continue
        round_bytes, last = prefix_bytes[i - 1], prefix_last[i - 1]
        j = bisect.bisect_left(session_pos, last)  # session rows strictly before `last`
        out[target_round] = round_bytes + (session_cum[j - 1] if j else 0)
    return out


def first_round_reaching(metrics: Iterable[Mapping[str, Any]], target: float) -> int | None:
    """The first round (in ``metrics`` order) whose ``accuracy`` (fraction) is ≥ ``target``, or None."""
    for rnd, acc in _accuracy_records(metrics):
        if acc >= target:
            return rnd
    return None


def bytes_to_target(metrics: Iterable[Mapping[str, Any]], rows: Iterable[Mapping[str, Any]],
                    target: float) -> int | None:
    """Device-link wire bytes (bytes) the fleet paid to reach test accuracy ``target``.

    Args:
        metrics: the records of ``metrics.jsonl`` (``round``, ``accuracy`` as a fraction in [0, 1]).
        rows: the run's ledger rows, in ledger order.
        target: accuracy to reach, a fraction (0.95 = 95 %).

    Returns:
        :func:`cumulative_bytes` up to and including the first round whose ``accuracy`` ≥
        ``target``; None when no round reached it.
    """
    rnd = first_round_reaching(metrics, target)
    if rnd is None:
        return None
    return cumulative_bytes(rows, [rnd])[rnd]


def accuracy_curve(metrics: Iterable[Mapping[str, Any]], rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Test accuracy against the device-link bytes paid so far, one point per evaluated round.

    Returns:
        ``[{"round": R, "accuracy": fraction, "cumulative_bytes": bytes}, …]`` in metrics order
        (see :func:`cumulative_bytes`).
    """
    records = _accuracy_records(metrics)
    cum = cumulative_bytes(rows, [r for r, _ in records])
    return [{"round": r, "accuracy": a, "cumulative_bytes": cum[r]} for r, a in records]


def _check_kbps(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number of kbit/s, got {value!r}")


def link_time_s(rows: Iterable[Mapping[str, Any]], uplink_kbps: float | None,
                downlink_kbps: float | None) -> dict[str, Any]:
    """Estimated time (seconds) to move the device-link bytes over links of the given speeds.

    Every agent has its own link of ``uplink_kbps`` up and ``downlink_kbps`` down, in kbit/s
    (1 kbit/s = 1000 bit/s). A client's time in one direction of one round is its device-view
    wire bytes · 8 / (kbps · 1000) seconds. Per round and direction:

    * ``max``: the slowest client (clients transfer in parallel, each on its own link); the
      round waits for it. This is the estimate of the run's transfer time.
    * ``sum``: the sum over clients (as if the clients shared one link of that speed).

    The session traffic (rows without a round: control packets …) is one more phase, listed as
    ``round`` None and included in the totals. A direction whose speed is None is not estimated
    (its values are None) and is left out of the totals.

    Returns:
        ``{"uplink_kbps", "downlink_kbps", "directions": ["up", "down"] (those estimated),
        "per_round": [{"round", "up_max_s", "up_sum_s", "down_max_s", "down_sum_s"}, …],
        "up_max_s", "up_sum_s", "down_max_s", "down_sum_s", "max_s", "sum_s"}`` where ``max_s``
        and ``sum_s`` add the estimated directions (0.0 when none is).

    Raises:
        ValueError: a speed is not a positive finite number.
    """
    _check_kbps("uplink_kbps", uplink_kbps)
    _check_kbps("downlink_kbps", downlink_kbps)
    speeds = {"up": uplink_kbps, "down": downlink_kbps}
    per: dict[int | None, dict[str, dict[str, int]]] = {}
    for r in _select(rows, "device"):
        direction = "up" if r.get("direction") == "up" else "down"
        clients = per.setdefault(_round_of(r), {"up": {}, "down": {}})[direction]
        client = _str(r, "client")
        clients[client] = clients.get(client, 0) + _wire(r)
    out: dict[str, Any] = {"uplink_kbps": uplink_kbps, "downlink_kbps": downlink_kbps,
                           "directions": [d for d in ("up", "down") if speeds[d] is not None],
                           "per_round": []}
    sums: dict[str, float | None] = {f"{d}_{k}_s": (None if speeds[d] is None else 0.0)
                                     for d in ("up", "down") for k in ("max", "sum")}
    for rnd in sorted(per, key=_round_key):
        entry: dict[str, Any] = {"round": rnd}
        for d in ("up", "down"):
            kbps = speeds[d]
            if kbps is None:
                entry[f"{d}_max_s"] = entry[f"{d}_sum_s"] = None
                continue
            times = [n * 8 / (kbps * 1000) for n in per[rnd][d].values()]
            entry[f"{d}_max_s"] = max(times, default=0.0)
            entry[f"{d}_sum_s"] = sum(times)
            sums[f"{d}_max_s"] += entry[f"{d}_max_s"]  # type: ignore[operator]
            sums[f"{d}_sum_s"] += entry[f"{d}_sum_s"]  # type: ignore[operator]
        out["per_round"].append(entry)
    out.update(sums)
    out["max_s"] = sum(sums[f"{d}_max_s"] or 0.0 for d in ("up", "down"))
    out["sum_s"] = sum(sums[f"{d}_sum_s"] or 0.0 for d in ("up", "down"))
    return out


# --------------------------------------------------------------------------------------------
# Report


def audit_report(run_dir: str | Path, *, target: float = DEFAULT_TARGET, uplink_kbps: float | None = None,
                 downlink_kbps: float | None = None) -> dict[str, Any]:
    """The whole audit of a run folder as a JSON-serialisable dict (byte counts in bytes).

    Args:
        run_dir: the run folder.
        target: accuracy (fraction) for ``target`` below.
        uplink_kbps, downlink_kbps: link speeds (kbit/s) for ``link_time``; both None: no estimate.

    Keys:
        ``run``: ``path``, ``federation`` (the ledger's ``meta`` value, else the federation(s)
        named in the rows, else None), ``rounds`` (distinct round numbers in the ledger),
        ``metrics_rounds`` (records in ``metrics.jsonl``).
        ``totals``: ``{"device": totals(rows, "device"), "server": totals(rows, "server")}``.
        ``by_round``, ``by_round_kind``, ``by_client``, ``by_kind``: device view.
        ``fields``: :func:`body_fields` (what ``global``/``update`` bodies are made of, each
        message once as its sender encoded it).
        ``rejected``: :func:`rejected`; ``rejected_totals``: ``messages``, ``payload_bytes``,
        ``wire_bytes``.
        ``final_accuracy``: fraction in [0, 1] from the last metrics record with an ``accuracy``,
        or None.
        ``accuracy_curve``: :func:`accuracy_curve`.
        ``target``: ``accuracy`` (the target), ``round`` (first round reaching it, or None),
        ``bytes`` (:func:`bytes_to_target`, or None: not reached).
        ``link_time``: :func:`link_time_s`, or None when no speed was given.

    Raises:
        AuditError: see :func:`load_run`.
        ValueError: a link speed is not positive.
    """
    run = load_run(run_dir)
    rows = run.rows
    federation = run.meta.get("federation")
    if federation is None:
        names = sorted({_str(r, "federation") for r in rows} - {""})
        federation = ", ".join(names) if names else None
    rejected_rows = [r for r in rows if r.get("event") == "rejected"]
    final_accuracy = None
    for record in run.metrics:
        if record.get("accuracy") is not None:
            final_accuracy = record["accuracy"]
    target_round = first_round_reaching(run.metrics, target)
    link = None
    if uplink_kbps is not None or downlink_kbps is not None:
        link = link_time_s(rows, uplink_kbps, downlink_kbps)
    return {
        "run": {"path": str(run.run_dir), "federation": federation,
                "rounds": len({r for r in (_round_of(x) for x in rows) if r is not None and r > 0}),
                "metrics_rounds": len(run.metrics)},
        "totals": {view: totals(rows, view) for view in VIEWS},
        "by_round": by_round(rows, "device"),
        "by_round_kind": by_round_kind(rows, "device"),
        "by_client": by_client(rows, "device"),
        "by_kind": by_kind(rows, "device"),
        "fields": body_fields(rows),
        "rejected": rejected(rows),
        "rejected_totals": {
            "messages": len(rejected_rows),
            "payload_bytes": sum(_int(r, "payload_bytes") for r in rejected_rows),
            "wire_bytes": sum(_wire(r) for r in rejected_rows),
        },
        "final_accuracy": final_accuracy,
        "accuracy_curve": accuracy_curve(run.metrics, rows),
        "target": {"accuracy": target, "round": target_round,
                   "bytes": None if target_round is None else cumulative_bytes(rows, [target_round])[target_round]},
        "link_time": link,
    }


def comparison_row(report: Mapping[str, Any]) -> dict[str, Any]:
    """One run's line of the comparison (device links; bytes in bytes, times in seconds).

    Returns:
        ``run`` (path), ``federation``, ``rounds``, ``final_accuracy`` (fraction or None),
        ``up_bytes``, ``down_bytes``, ``wire_bytes`` (device-link wire bytes), ``overhead_share``,
        ``target`` (fraction), ``target_round`` and ``bytes_to_target`` (None: not reached),
        and from ``link_time`` (None without link speeds): ``uplink_kbps``, ``downlink_kbps``,
        ``up_max_s``, ``down_max_s``, ``time_max_s`` (parallel clients), ``up_sum_s``,
        ``down_sum_s``, ``time_sum_s`` (sum over clients); and from ``fields``
        (:func:`field_bytes_per_client_round`; None without it): ``up_tensor_bytes_per_client_round``,
        ``up_extras_bytes_per_client_round``, ``down_tensor_bytes_per_client_round``,
        ``down_extras_bytes_per_client_round``.
    """
    dev = report["totals"]["device"]
    tgt = report.get("target") or {}
    link = report.get("link_time") or {}
    return {
        "run": report["run"]["path"], "federation": report["run"].get("federation"),
        "rounds": report["run"].get("rounds"), "final_accuracy": report.get("final_accuracy"),
        "up_bytes": dev["up"]["wire_bytes"], "down_bytes": dev["down"]["wire_bytes"],
        "wire_bytes": dev["all"]["wire_bytes"], "overhead_share": dev["all"]["overhead_share"],
        "target": tgt.get("accuracy"), "target_round": tgt.get("round"), "bytes_to_target": tgt.get("bytes"),
        "uplink_kbps": link.get("uplink_kbps"), "downlink_kbps": link.get("downlink_kbps"),
        "up_max_s": link.get("up_max_s"), "down_max_s": link.get("down_max_s"),
        "time_max_s": link.get("max_s"),
        "up_sum_s": link.get("up_sum_s"), "down_sum_s": link.get("down_sum_s"),
        "time_sum_s": link.get("sum_s"),
        **field_bytes_per_client_round(report.get("fields") or []),
    }


# --------------------------------------------------------------------------------------------
# Text


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


def _acc(acc: float | None) -> str:
    return "—" if acc is None else f"{100 * acc:.2f} %"


def _secs(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f} s"


def _target_text(row: Mapping[str, Any]) -> str:
    if row.get("bytes_to_target") is None:
        return "not reached"
    return f"{_n(row['bytes_to_target'])} ({_human(row['bytes_to_target'])}, round {row['target_round']})"


def _directions_label(link: Mapping[str, Any] | None) -> str:
    dirs = (link or {}).get("directions") or []
    return "+".join(dirs) if dirs else "—"


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

    Sections: Totals (device links, server link), Per round (control packets and other traffic
    without a round in the ``session`` row), Per client, Per kind and direction, Body fields
    (:func:`body_fields`), Rejected messages, and, when the report has them, bytes to reach the target accuracy and the
    estimated transfer time. Counts use thousands separators; byte columns are in bytes, and the
    totals add the wire bytes in KiB/MiB.
    """
    console, buf = _console()
    run = report["run"]
    console.print(f"Run: {run['path']}")
    console.print(f"Federation: {run.get('federation') or '—'}   rounds: {run['rounds']}   "
                  f"final accuracy: {_acc(report.get('final_accuracy'))}")

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
            t.add_row(label, _n(d["messages"]), _n(d["body_bytes"]), _n(d["envelope_bytes"]),
                      _n(d["mqtt_bytes"]), _n(d.get("control_bytes", 0)), _n(d["wire_bytes"]),
                      _human(d["wire_bytes"]), _pct(d["overhead_share"]))
        console.print(t)

    console.print()
    console.print("Security: bytes added by signatures and by encryption (protocol.security)")
    t = _table("link", "direction", "signed msgs", "signature B", "encrypted msgs", "encryption B", "share of wire",
               text_columns=2)
    for view in VIEWS:
        for label, key in (("up", "up"), ("down", "down"), ("total", "all")):
            d = report["totals"][view][key]
            t.add_row(view, label, _n(d.get("signed_messages", 0)), _n(d.get("sig_bytes", 0)),
                      _n(d.get("encrypted_messages", 0)), _n(d.get("enc_bytes", 0)),
                      _pct((d.get("sig_bytes", 0) + d.get("enc_bytes", 0)) / d["wire_bytes"]
                           if d["wire_bytes"] else None))
    console.print(t)

    console.print()
    console.print("Per round (device links; bytes = wire bytes; session = traffic without a round, "
                  "control packets included)")
    t = _table("round", "up msgs", "up B", "up body B", "down msgs", "down B", "down body B", "overhead")
    for r in report["by_round"]:
        t.add_row(round_label(r["round"]), _n(r["up_messages"]), _n(r["up_bytes"]),
                  _n(r["up_body_bytes"]), _n(r["down_messages"]), _n(r["down_bytes"]),
                  _n(r["down_body_bytes"]), _pct(r["overhead_share"]))
    console.print(t)

    console.print()
    console.print("Per client (device links; bytes = wire bytes)")
    t = _table("client", "up msgs", "up B", "down msgs", "down B", "body B")
    for c in report["by_client"]:
        t.add_row(c["client"], _n(c["up_messages"]), _n(c["up_bytes"]), _n(c["down_messages"]),
                  _n(c["down_bytes"]), _n(c["body_bytes"]))
    console.print(t)

    console.print()
    console.print("Per kind and direction (device links; upper-case kinds are MQTT control packets)")
    t = _table("kind", "dir", "messages", "body B", "envelope B", "MQTT B", "control B", "wire B", "overhead",
               text_columns=2)
    for k in report["by_kind"]:
        t.add_row(k["kind"], k["direction"], _n(k["messages"]), _n(k["body_bytes"]), _n(k["envelope_bytes"]),
                  _n(k["mqtt_bytes"]), _n(k.get("control_bytes", 0)), _n(k["wire_bytes"]),
                  _pct(k["overhead_share"]))
    console.print(t)

    if report.get("fields"):
        console.print()
        console.print(_FIELDS_TITLE)
        t = _table(*_FIELD_COLUMNS, text_columns=4)
        for cells in _field_cells(report["fields"]):
            t.add_row(*cells)
        console.print(t)
        for line in _field_notes(report["fields"]):
            console.print(line)

    console.print()
    rt = report.get("rejected_totals") or {
        "messages": len(report["rejected"]),
        "payload_bytes": sum(r["payload_bytes"] for r in report["rejected"])}
    console.print(f"Rejected messages: {_n(rt['messages'])} ({_n(rt['payload_bytes'])} payload bytes)")
    if report["rejected"]:
        t = _table("side", "node", "topic", "reason", "payload B", text_columns=4)
        for r in report["rejected"]:
            t.add_row(r["side"], r["node"], r["topic"], r["reason"], _n(r["payload_bytes"]))
        console.print(t)

    if report.get("target") is not None:
        row = comparison_row(report)
        console.print()
        console.print(f"Device-link bytes to reach accuracy ≥ {_acc(row['target'])}: {_target_text(row)}")
    link = report.get("link_time")
    if link:
        console.print(f"Estimated transfer time ({_directions_label(link)}; uplink "
                      f"{_kbps(link['uplink_kbps'])}, downlink {_kbps(link['downlink_kbps'])}): "
                      f"{_secs(link['max_s'])} with clients in parallel (slowest client per round), "
                      f"{_secs(link['sum_s'])} summed over clients")
    return _lines(buf)


def _kbps(value: float | None) -> str:
    return "—" if value is None else f"{value:g} kbit/s"


_FIELDS_TITLE = ("Body fields of global and update messages (each message once, as its sender encoded it: "
                 "uploads from the agents' rows, downloads from the server's, so a broadcast counts once; "
                 "a chunked message once, not per chunk)")


def _mean(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


#: Columns of the body-fields table: *msgs* = messages that carried the field, *B/msg carrying* =
#: its bytes per such message, *B/msg of kind* = its bytes per message of the kind (these add up
#: to the whole message's mean; a field that only some messages carry, e.g. a teacher absent in
#: round 1, is smaller here than in the column before).
_FIELD_COLUMNS = ("kind", "dir", "field", "codec", "msgs", "bytes", "B/msg carrying", "B/msg of kind", "share",
                  "raw B")


def _field_cells(fields: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Table cells of :func:`body_fields` (columns :data:`_FIELD_COLUMNS`): one row per field,
    then the whole message."""
    out = []
    for g in fields:
        for f in g["fields"]:
            out.append([g["kind"], g["direction"], f["field"], f["codec"], _n(f["messages"]), _n(f["bytes"]),
                        _mean(f["bytes"] / f["messages"] if f["messages"] else None), _mean(f["mean_bytes"]),
                        _pct(f["share"]),
                        "—" if f["raw_bytes"] is None else _n(f["raw_bytes"])])
        out.append([g["kind"], g["direction"], "= message", "", _n(g["messages"]), _n(g["message_bytes"]),
                    _mean(g["mean_message_bytes"]), _mean(g["mean_message_bytes"]),
                    _pct(1.0 if g["message_bytes"] else None), _n(g["raw_bytes"])])
    return out


def _field_notes(fields: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per kind: messages, chunked ones, and the tensor values before and after the codec."""
    out = []
    for g in fields:
        ratio = f" ({_pct(g['encoded_bytes'] / g['raw_bytes'])} of raw)" if g["raw_bytes"] else ""
        source = ("" if g["source"] == "sender" else
                  "; receiver's rows (no sender rows in this ledger): extras counted as one lump")
        out.append(f"{g['kind']} ({g['direction']}): {_n(g['messages'])} messages, {_n(g['chunked_messages'])} "
                   f"chunked; tensors + extras {_n(g['encoded_bytes'])} B encoded from {_n(g['raw_bytes'])} B "
                   f"raw{ratio}{source}")
    out.append("other = envelope, msgpack framing, scalar body fields (num_samples, metrics, meta …), extras map "
               "header.")
    out.append("raw B = tensor values before the codec; per field only where it is a message's one tensor-bearing "
               "field (else —).")
    return out


def _short_run_labels(paths: Sequence[str]) -> list[str]:
    """Short, distinct names for run folders in a table: each path's last component, or its last
    two, three … when those collide (the full paths are listed under the table)."""
    parts = [Path(p).parts or (p,) for p in paths]
    for depth in range(1, max(len(x) for x in parts) + 1 if parts else 1):
        labels = [str(Path(*x[-depth:])) for x in parts]
        if len(set(labels)) == len(labels):
            return labels
    return list(paths)


def render_comparison_text(reports: Sequence[Mapping[str, Any]]) -> str:
    """The comparison of several runs as text: one table of bytes, accuracy and transfer time, then
    one of model-tensor and extras bytes per client per round (see :func:`comparison_row`); one
    row per run in each, in the order given."""
    console, buf = _console()
    rows = [comparison_row(r) for r in reports]
    labels = _short_run_labels([str(r["run"]) for r in rows])
    target = next((r["target"] for r in rows if r["target"] is not None), None)
    link = next((r.get("link_time") for r in reports if r.get("link_time")), None)
    console.print(f"Comparison of {len(rows)} runs (device links; bytes = wire bytes)")
    headers = ["run", "final acc", "up B", "down B", "overhead", f"B to {_acc(target)}", "at round"]
    if link:
        headers += ["time parallel", "time summed"]
    t = _table(*headers)
    for label, r in zip(labels, rows):
        reached = r["bytes_to_target"] is not None
        cells = [label, _acc(r["final_accuracy"]), _n(r["up_bytes"]), _n(r["down_bytes"]),
                 _pct(r["overhead_share"]), _n(r["bytes_to_target"]) if reached else "not reached",
                 str(r["target_round"]) if reached else "—"]
        if link:
            cells += [_secs(r["time_max_s"]), _secs(r["time_sum_s"])]
        t.add_row(*cells)
    console.print(t)
    console.print(f"B to {_acc(target)}: device-link bytes up to and including the first round whose test "
                  "accuracy reached the target.")
    console.print()
    console.print("Model tensors vs extras per client per round (bytes; each message as its sender encoded it)")
    t = _table("run", "up tensors B", "up extras B", "down tensors B", "down extras B")
    for label, r in zip(labels, rows):
        t.add_row(label, *(_mean(r[f"{d}_{p}_bytes_per_client_round"])
                           for d in ("up", "down") for p in ("tensor", "extras")))
    console.print(t)
    if any(label != str(r["run"]) for label, r in zip(labels, rows)):
        for label, r in zip(labels, rows):
            console.print(f"{label} = {r['run']}", overflow="fold")
    if link:
        console.print(f"Transfer time ({_directions_label(link)}): uplink {_kbps(link['uplink_kbps'])}, downlink "
                      f"{_kbps(link['downlink_kbps'])} per client (1 kbit/s = 1000 bit/s); parallel = slowest "
                      "client per round, summed = sum over clients.")
    return _lines(buf)


# --------------------------------------------------------------------------------------------
# HTML


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1100px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { font-size: 1.3em; border-bottom: 2px solid #ccc; padding-bottom: .2em;
     margin-top: 2.5em; word-break: break-all; } h3 { font-size: 1.05em; margin-top: 1.5em; }
table { border-collapse: collapse; margin: .5em 0 1em; font-size: .9em; }
th, td { border-bottom: 1px solid #ddd; padding: .25em .7em; }
th { background: #f3f3f3; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.text { word-break: break-all; }
img { max-width: 100%; display: block; margin: .5em 0 1.5em; }
p.note { color: #555; font-size: .9em; }
"""


def _esc(value: Any) -> str:
    return html.escape("—" if value is None else str(value), quote=True)


def _html_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], text_columns: int = 1) -> str:
    """An HTML table; every cell is escaped. The first ``text_columns`` columns are text."""
    out = ["<table>", "<tr>" + "".join(f"<th>{_esc(h)}</th>" for h in headers) + "</tr>"]
    for row in rows:
        out.append("<tr>" + "".join(
            f'<td class="{"text" if i < text_columns else "num"}">{_esc(c)}</td>' for i, c in enumerate(row))
            + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _png(fig: Any) -> str:
    """An ``<img>`` with the figure embedded as a base64 PNG (rendered with the Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="">'


def _figure(width: float = 9.0, height: float = 4.0) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _mpl_text(text: str) -> str:
    """Text safe for a matplotlib label: no mathtext, no leading underscore (hidden in legends)."""
    text = text.replace("$", r"\$")
    return " " + text if text.startswith("_") else text


def _unit(max_bytes: float) -> tuple[float, str]:
    """Divisor and unit name for a byte axis."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if max_bytes >= scale:
            return float(scale), unit
    return 1.0, "B"


def _plot_by_round(report: Mapping[str, Any]) -> str:
    """Stacked bars: wire bytes per round by kind, one panel per direction; control packets grouped."""
    entries = report.get("by_round_kind") or []
    rounds = sorted({e["round"] for e in entries}, key=_round_key)
    kinds = sorted({("control packets" if e["control"] else e["kind"]) for e in entries},
                   key=lambda k: (k == "control packets", k))
    fig = _figure(10, 5.5)
    axes = fig.subplots(2, 1, sharex=True)
    peak = max([sum(e["wire_bytes"] for e in entries if e["round"] == r and e["direction"] == d)
                for r in rounds for d in ("up", "down")] or [0])
    scale, unit = _unit(peak)
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    colors = {k: cmap(i % 20) for i, k in enumerate(kinds)}
    xs = list(range(len(rounds)))
    for ax, direction, title in ((axes[0], "up", "uplink (agents → server)"),
                                 (axes[1], "down", "downlink (server → agents)")):
        bottom = [0.0] * len(rounds)
        for kind in kinds:
            heights = [sum(e["wire_bytes"] for e in entries
                           if e["round"] == r and e["direction"] == direction
                           and ("control packets" if e["control"] else e["kind"]) == kind) / scale
                       for r in rounds]
            if any(heights):
                ax.bar(xs, heights, bottom=bottom, color=colors[kind], label=_mpl_text(kind), width=0.7)
                bottom = [b + h for b, h in zip(bottom, heights)]
        for x, r, top in zip(xs, rounds, bottom):
            total = sum(e["wire_bytes"] for e in entries if e["round"] == r and e["direction"] == direction)
            if total:
                ax.annotate(_human(total), (x, top), xytext=(0, 2), textcoords="offset points", ha="center",
                            va="bottom", fontsize=7)
        ax.set_ylim(0, max(bottom + [0.0]) * 1.15 or 1)
        ax.set_ylabel(f"wire {unit}")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    if not rounds:
        axes[0].text(0.5, 0.5, "no traffic in the ledger", ha="center", va="center", transform=axes[0].transAxes)
    axes[1].set_xticks(xs, [round_label(r) for r in rounds])
    axes[1].set_xlabel("round (session = traffic without a round: control packets …)")
    handles, labels = {}, []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    if labels:
        fig.legend([handles[lab] for lab in labels], labels, loc="outside right upper", fontsize=8)
    fig.suptitle("Device-link bytes per round, by kind and direction", fontsize=11)
    return _png(fig)


def _plot_curves(curves: Sequence[tuple[str, Sequence[Mapping[str, Any]]]], target: float | None,
                 title: str) -> str:
    """Accuracy (y) against cumulative device-link MiB (x), one line per curve."""
    fig = _figure(9, 4.5)
    ax = fig.subplots()
    plotted = False
    for label, curve in curves:
        if not curve:
            continue
        xs = [p["cumulative_bytes"] / 1024**2 for p in curve]
        ys = [p["accuracy"] for p in curve]
        (line,) = ax.plot(xs, ys, marker="o", markersize=4, label=_mpl_text(label))
        reached = next((i for i, y in enumerate(ys) if target is not None and y >= target), None)
        if reached is not None:
            ax.plot([xs[reached]], [ys[reached]], marker="*", markersize=13, color=line.get_color())
            ax.annotate(f"round {curve[reached]['round']}: {_human(curve[reached]['cumulative_bytes'])}",
                        (xs[reached], ys[reached]), xytext=(6, -14), textcoords="offset points", fontsize=8)
        plotted = True
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {100 * target:g} %")
    if not plotted:
        ax.text(0.5, 0.5, "no accuracy in metrics.jsonl", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("cumulative device-link wire bytes (MiB)")
    ax.set_ylabel("test accuracy (fraction)")
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    if plotted or target is not None:
        ax.legend(fontsize=8, loc="lower right")
    return _png(fig)


def _plot_clients(report: Mapping[str, Any]) -> str:
    """Grouped bars: device-link wire bytes up and down per client."""
    clients = report.get("by_client") or []
    fig = _figure(max(6.0, min(16.0, 1.0 + 0.6 * len(clients))), 4)
    ax = fig.subplots()
    scale, unit = _unit(max([max(c["up_bytes"], c["down_bytes"]) for c in clients] or [0]))
    xs = list(range(len(clients)))
    ax.bar([x - 0.2 for x in xs], [c["up_bytes"] / scale for c in clients], width=0.4, label="up")
    ax.bar([x + 0.2 for x in xs], [c["down_bytes"] / scale for c in clients], width=0.4, label="down")
    ax.set_xticks(xs, [_mpl_text(c["client"]) for c in clients], rotation=45 if len(clients) > 8 else 0,
                  ha="right" if len(clients) > 8 else "center")
    ax.set_ylabel(f"wire {unit}")
    ax.set_title("Device-link bytes per client", fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    if clients:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no clients in the ledger", ha="center", va="center", transform=ax.transAxes)
    return _png(fig)


def _overhead_parts(tot: Mapping[str, Any]) -> list[tuple[str, int]]:
    parts = [("body", tot["body_bytes"]), ("envelope", tot["envelope_bytes"]),
             ("MQTT header + topic", tot["mqtt_bytes"]), ("control packets", tot.get("control_bytes", 0))]
    if tot.get("sig_bytes") or tot.get("enc_bytes"):
        parts[2:2] = [("signatures", tot.get("sig_bytes", 0)), ("encryption", tot.get("enc_bytes", 0))]
    return parts


def _plot_overhead(report: Mapping[str, Any]) -> str:
    """Horizontal bars of body / envelope / MQTT header+topic / control bytes, numbers printed;
    right panel: the overhead parts alone."""
    tot = report["totals"]["device"]["all"]
    parts = _overhead_parts(tot)
    wire = tot["wire_bytes"]
    fig = _figure(11, 3.2)
    axes = fig.subplots(1, 2)
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    for ax, shown, title in ((axes[0], parts, "all device-link bytes"),
                             (axes[1], parts[1:], "overhead only (everything but the body)")):
        values = [v for _, v in shown]
        names = [n for n, _ in shown]
        ys = list(range(len(shown)))[::-1]
        ax.barh(ys, values, color=colors[len(parts) - len(shown):])
        ax.set_yticks(ys, names)
        top = max(values or [0]) or 1
        ax.set_xlim(0, top * 1.6)
        for y, v in zip(ys, values):
            share = f"{100 * v / wire:.2f} %" if wire else "—"
            ax.text(v + top * 0.02, y, f"{v:,} B ({share})", va="center", fontsize=8)
        ax.set_xlabel("bytes")
        ax.set_title(title, fontsize=10)
        ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 4))
    fig.suptitle(f"Protocol overhead share: {_pct(tot['overhead_share'])} of {wire:,} wire bytes", fontsize=11)
    return _png(fig)


def _totals_html(tot: Mapping[str, Any]) -> str:
    rows = []
    for label, key in (("up", "up"), ("down", "down"), ("total", "all")):
        d = tot[key]
        rows.append([label, _n(d["messages"]), _n(d["body_bytes"]), _n(d["envelope_bytes"]), _n(d["mqtt_bytes"]),
                     _n(d.get("control_bytes", 0)), _n(d["wire_bytes"]), _human(d["wire_bytes"]),
                     _pct(d["overhead_share"])])
    return _html_table(["direction", "messages", "body B", "envelope B", "MQTT header+topic B", "control B",
                        "wire B", "wire", "overhead"], rows)


def _comparison_html(reports: Sequence[Mapping[str, Any]]) -> str:
    rows = [comparison_row(r) for r in reports]
    link = next((r.get("link_time") for r in reports if r.get("link_time")), None)
    target = next((r["target"] for r in rows if r["target"] is not None), None)
    headers = ["run", "federation", "rounds", "final accuracy", "up B", "down B", "overhead",
               f"bytes to {_acc(target)}" if target is not None else "bytes to target",
               "up tensors B/client/round", "up extras B/client/round", "down tensors B/client/round",
               "down extras B/client/round"]
    if link:
        headers += [f"transfer time {_directions_label(link)}, clients in parallel",
                    "transfer time, sum over clients"]
    body = []
    for r in rows:
        cells = [r["run"], r["federation"], r["rounds"], _acc(r["final_accuracy"]), _n(r["up_bytes"]),
                 _n(r["down_bytes"]), _pct(r["overhead_share"]), _target_text(r),
                 *(_mean(r[f"{d}_{p}_bytes_per_client_round"]) for d in ("up", "down") for p in ("tensor", "extras"))]
        if link:
            cells += [_secs(r["time_max_s"]), _secs(r["time_sum_s"])]
        body.append(cells)
    note = ("<p class=\"note\">Device links (what the agents sent and received). Bytes to target: cumulative "
            "device-link wire bytes up to and including the first round whose test accuracy reached the "
            "target (session traffic recorded before then included). Tensors/extras per client per round: "
            "bytes of the model tensors and of the named extras of the updates a client sent and the globals it "
            "received, as their sender encoded them.")
    if link:
        note += (f" Transfer time: uplink {_esc(_kbps(link['uplink_kbps']))}, downlink "
                 f"{_esc(_kbps(link['downlink_kbps']))} per client (1 kbit/s = 1000 bit/s); per round the "
                 "slowest client (parallel links), or the sum over clients (one shared link); session "
                 "traffic counted as one more phase.")
    return _html_table(headers, body, text_columns=2) + "\n" + note + "</p>"


def render_html(reports: Sequence[Mapping[str, Any]], title: str = "fedfleet communication audit") -> str:
    """A self-contained HTML report of one or more :func:`audit_report` dicts.

    No external resources: inline CSS, plots as base64 PNG (matplotlib, Agg canvas). Every string
    from the reports is escaped with :func:`html.escape`. Contents: a comparison table (one row
    per run; with several runs also an overlay of accuracy against cumulative bytes), then per
    run: totals (device links, server link), per kind, bytes per round by kind and direction,
    cumulative bytes against accuracy, bytes per client, protocol overhead share, the body
    fields of global/update messages (:func:`body_fields`), and the rejected messages.
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
        parts.append(_plot_curves([(n, r.get("accuracy_curve") or []) for n, r in zip(names, reports)], target,
                                  "Test accuracy against cumulative device-link bytes, all runs"))
    for i, rep in enumerate(reports, start=1):
        run = rep["run"]
        parts.append(f"<h2>Run {i}: {_esc(run['path'])}</h2>")
        parts.append(f"<p>Federation: {_esc(run.get('federation'))} &nbsp; rounds: {_esc(run['rounds'])} &nbsp; "
                     f"metrics records: {_esc(run.get('metrics_rounds'))} &nbsp; "
                     f"final accuracy: {_esc(_acc(rep.get('final_accuracy')))}</p>")
        parts.append("<h3>Totals: device links (uploads sent + downloads received by each agent)</h3>")
        parts.append(_totals_html(rep["totals"]["device"]))
        parts.append("<h3>Totals: server link (a broadcast counts once)</h3>")
        parts.append(_totals_html(rep["totals"]["server"]))
        parts.append("<h3>Bytes per round, by kind and direction</h3>")
        parts.append(_plot_by_round(rep))
        parts.append("<h3>Cumulative device-link bytes and test accuracy</h3>")
        parts.append(_plot_curves([(Path(run["path"]).name or run["path"], rep.get("accuracy_curve") or [])],
                                  (rep.get("target") or {}).get("accuracy"), "Test accuracy against bytes paid"))
        parts.append("<h3>Bytes per client</h3>")
        parts.append(_plot_clients(rep))
        parts.append("<h3>Protocol overhead</h3>")
        parts.append(_plot_overhead(rep))
        tot = rep["totals"]["device"]["all"]
        parts.append(_html_table(["part", "bytes", "share of wire bytes"],
                                 [[n, _n(v), _pct(v / tot["wire_bytes"] if tot["wire_bytes"] else None)]
                                  for n, v in _overhead_parts(tot)]))
        parts.append("<h3>Per kind and direction (device links; upper-case kinds are MQTT control packets)</h3>")
        parts.append(_html_table(
            ["kind", "dir", "messages", "body B", "envelope B", "MQTT B", "control B", "wire B", "overhead"],
            [[k["kind"], k["direction"], _n(k["messages"]), _n(k["body_bytes"]), _n(k["envelope_bytes"]),
              _n(k["mqtt_bytes"]), _n(k.get("control_bytes", 0)), _n(k["wire_bytes"]), _pct(k["overhead_share"])]
             for k in rep["by_kind"]], text_columns=2))
        if rep.get("fields"):
            parts.append("<h3>" + _esc(_FIELDS_TITLE) + "</h3>")
            parts.append(_html_table(list(_FIELD_COLUMNS), _field_cells(rep["fields"]), text_columns=4))
            parts.append('<p class="note">' + "<br>".join(_esc(n) for n in _field_notes(rep["fields"])) + "</p>")
        rt = rep.get("rejected_totals") or {"messages": len(rep["rejected"]),
                                            "payload_bytes": sum(r["payload_bytes"] for r in rep["rejected"])}
        parts.append(f"<h3>Rejected messages: {_esc(_n(rt['messages']))} "
                     f"({_esc(_n(rt['payload_bytes']))} payload bytes)</h3>")
        if rep["rejected"]:
            parts.append(_html_table(["side", "node", "topic", "reason", "payload B"],
                                     [[r["side"], r["node"], r["topic"], r["reason"], _n(r["payload_bytes"])]
                                      for r in rep["rejected"]], text_columns=4))
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)


def write_html(reports: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write :func:`render_html` to ``path`` (UTF-8); returns the path."""
    out = Path(path)
    out.write_text(render_html(reports), encoding="utf-8")
    return out


# --------------------------------------------------------------------------------------------
# CSV


def _csv_value(value: Any) -> Any:
    return "" if value is None else value


def _write_rows(path: Path, fieldnames: list[str], rows: Iterable[Mapping[str, Any]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(row.get(k)) for k in fieldnames})


_BY_ROUND_FIELDS = ["run", "round", "up_messages", "up_bytes", "up_body_bytes", "down_messages", "down_bytes",
                    "down_body_bytes", "overhead_share"]
_BY_CLIENT_FIELDS = ["run", "client", "up_messages", "up_bytes", "down_messages", "down_bytes", "body_bytes"]
_BY_KIND_FIELDS = ["run", "kind", "direction", "messages", "body_bytes", "envelope_bytes", "mqtt_bytes",
                   "control_messages", "control_bytes", "wire_bytes", "overhead_share"]
_COMPARISON_FIELDS = ["run", "federation", "rounds", "final_accuracy", "up_bytes", "down_bytes", "wire_bytes",
                      "overhead_share", "target", "target_round", "bytes_to_target", "uplink_kbps",
                      "downlink_kbps", "up_max_s", "down_max_s", "time_max_s", "up_sum_s", "down_sum_s",
                      "time_sum_s", "up_tensor_bytes_per_client_round", "up_extras_bytes_per_client_round",
                      "down_tensor_bytes_per_client_round", "down_extras_bytes_per_client_round"]
_FIELDS_FIELDS = ["run", "kind", "direction", "source", "field", "codec", "messages", "bytes", "mean_bytes", "share",
                  "raw_bytes", "kind_messages", "kind_message_bytes", "kind_raw_bytes", "kind_encoded_bytes"]


def write_csv(reports: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """Write ``by_round.csv``, ``by_client.csv``, ``by_kind.csv``, ``comparison.csv`` and
    ``fields.csv`` to ``out_dir``.

    Device view; bytes in bytes, shares as fractions, times in seconds, empty cells for None.
    Every file has a ``run`` column (the run path); ``by_round.csv`` writes the session row's
    round as ``session``; ``comparison.csv`` has one row per run, in the order given (see
    :func:`comparison_row`); ``fields.csv`` has one row per body field of :func:`body_fields`
    (``other`` included, so a kind's ``bytes`` add up to its ``kind_message_bytes``), with the
    kind's ``kind_messages``, ``kind_message_bytes``, ``kind_raw_bytes`` and
    ``kind_encoded_bytes`` repeated on each.

    Returns:
        The five paths written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "by_round.csv", out / "by_client.csv", out / "by_kind.csv", out / "comparison.csv"]
    _write_rows(paths[0], _BY_ROUND_FIELDS,
                ({**r, "run": rep["run"]["path"], "round": round_label(r["round"])}
                 for rep in reports for r in rep["by_round"]))
    _write_rows(paths[1], _BY_CLIENT_FIELDS, ({**c, "run": rep["run"]["path"]}
                                              for rep in reports for c in rep["by_client"]))
    _write_rows(paths[2], _BY_KIND_FIELDS, ({**k, "run": rep["run"]["path"]}
                                            for rep in reports for k in rep["by_kind"]))
    _write_rows(paths[3], _COMPARISON_FIELDS, (comparison_row(rep) for rep in reports))
    paths.append(out / "fields.csv")
    _write_rows(paths[4], _FIELDS_FIELDS,
                ({**f, "run": rep["run"]["path"], "kind": g["kind"], "direction": g["direction"],
                  "source": g["source"], "kind_messages": g["messages"], "kind_message_bytes": g["message_bytes"],
                  "kind_raw_bytes": g["raw_bytes"], "kind_encoded_bytes": g["encoded_bytes"]}
                 for rep in reports for g in rep.get("fields") or [] for f in g["fields"]))
    return paths


# --------------------------------------------------------------------------------------------
# Command line


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an accuracy fraction such as 0.95, got {text!r}") from None
    if not (0 < value <= 1):
        raise argparse.ArgumentTypeError(f"expected an accuracy fraction in (0, 1] such as 0.95, got {text!r}")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a speed in kbit/s such as 256, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive speed in kbit/s, got {text!r}")
    return value


def add_audit_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the arguments of ``fedfleet audit`` to ``parser`` (shared by the CLI and :func:`main_audit`)."""
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folder(s) holding ledger.sqlite")
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON instead of tables (a list of reports for several runs)")
    parser.add_argument("--html", metavar="OUT.html",
                        help="also write a self-contained HTML report with plots to this file")
    parser.add_argument("--csv", metavar="DIR",
                        help="also write by_round.csv, by_client.csv, by_kind.csv, comparison.csv, fields.csv to this folder")
    parser.add_argument("--target", type=_fraction, default=DEFAULT_TARGET, metavar="ACC",
                        help=f"test accuracy (fraction) for 'bytes to reach the target' (default {DEFAULT_TARGET})")
    parser.add_argument("--uplink-kbps", type=_positive, metavar="K",
                        help="per-client uplink speed in kbit/s (1000 bit/s) for the transfer-time estimate")
    parser.add_argument("--downlink-kbps", type=_positive, metavar="K",
                        help="per-client downlink speed in kbit/s for the transfer-time estimate")
    return parser


def _error(message: str) -> int:
    print(f"fedfleet audit: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def run_audit(ns: argparse.Namespace) -> int:
    """Run ``fedfleet audit`` for parsed arguments (see :func:`add_audit_arguments`).

    Prints text tables (default; with several runs each run, then the comparison) or JSON to
    stdout, writes the HTML and CSV files asked for, and says on stderr which files it wrote.

    Returns:
        0 on success; 2 when a run folder cannot be audited or an output cannot be written, after
        one line ``fedfleet audit: error: …`` on stderr.
    """
    try:
        reports = [audit_report(d, target=ns.target, uplink_kbps=ns.uplink_kbps, downlink_kbps=ns.downlink_kbps)
                   for d in ns.run_dirs]
    except AuditError as exc:
        return _error(str(exc))
    written: list[Path] = []
    try:
        if ns.csv:
            written += write_csv(reports, ns.csv)
        if ns.html:
            written.append(write_html(reports, ns.html))
    except OSError as exc:
        return _error(f"cannot write {exc.filename or ''}: {exc.strerror or exc}")
    if ns.json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
    else:
        texts = [render_text(r) for r in reports]
        if len(reports) > 1:
            texts.append(render_comparison_text(reports))
        sys.stdout.write(("\n" + "=" * 120 + "\n\n").join(texts))
    sys.stdout.flush()
    for path in written:
        print(f"fedfleet audit: wrote {path}", file=sys.stderr)
    return 0


def main_audit(args: list[str] | None = None) -> int:
    """``fedfleet audit RUN_DIR [RUN_DIR ...] [--json] [--html OUT.html] [--csv DIR] [--target ACC]
    [--uplink-kbps K] [--downlink-kbps K]``: print (and write) the audit of run folders.

    Returns:
        See :func:`run_audit`. Bad arguments exit through argparse with status 2.
    """
    parser = argparse.ArgumentParser(
        prog="fedfleet audit",
        description="Bytes every link carried in a run, from RUN_DIR/ledger.sqlite: device links "
                    "(what the agents sent and received) and the server link; several runs are compared.")
    add_audit_arguments(parser)
    return run_audit(parser.parse_args(args))
