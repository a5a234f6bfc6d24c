"""Cells of the audit's tables, shared by the text and HTML renderers: counts, byte sizes,
shares, accuracies, seconds, and the rows of the body-fields table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def count(value: int) -> str:
    """An integer with thousands separators: ``8708`` → ``'8,708'``."""
    return f"{value:,}"


def human(n_bytes: int) -> str:
    """Bytes in binary units: B, KiB, MiB, GiB."""
    if n_bytes < 1024:
        return f"{n_bytes} B"
    for unit, scale in (("KiB", 1024), ("MiB", 1024**2), ("GiB", 1024**3)):
        if n_bytes < scale * 1024 or unit == "GiB":
            return f"{n_bytes / scale:,.1f} {unit}"
    raise AssertionError("unreachable")


def pct(share: float | None) -> str:
    """A fraction as a percentage with one decimal (``'—'`` for None)."""
    return "—" if share is None else f"{100 * share:.1f} %"


def acc(value: float | None) -> str:
    """An accuracy (fraction) as a percentage with two decimals (``'—'`` for None)."""
    return "—" if value is None else f"{100 * value:.2f} %"


def secs(value: float | None) -> str:
    """Seconds with one decimal (``'—'`` for None)."""
    return "—" if value is None else f"{value:,.1f} s"


def kbps(value: float | None) -> str:
    """A link speed in kbit/s (``'—'`` for None)."""
    return "—" if value is None else f"{value:g} kbit/s"


def mean(value: float | None) -> str:
    """A mean number of bytes, rounded to whole bytes, with thousands separators (``'—'`` for None)."""
    return "—" if value is None else f"{value:,.0f}"


def target_text(row: Mapping[str, Any]) -> str:
    """Bytes to the target of a :func:`comparison_row`, with the round that reached it;
    ``'not reached'``; ``'—'`` for a run that records no accuracy (a device's own folder)."""
    if row.get("bytes_to_target") is None:
        return "not reached" if row.get("final_accuracy") is not None else "—"
    return f"{count(row['bytes_to_target'])} ({human(row['bytes_to_target'])}, round {row['target_round']})"


def directions_label(link: Mapping[str, Any] | None) -> str:
    """The estimated directions of a ``link_time`` (``'up+down'``, ``'up'`` …; ``'—'`` for none)."""
    dirs = (link or {}).get("directions") or []
    return "+".join(dirs) if dirs else "—"


FIELDS_TITLE = ("Body fields of global and update messages (each message once, as its sender encoded it: "
                "uploads from the agents' rows, downloads from the server's, so a broadcast counts once; "
                "a chunked message once, not per chunk)")


#: Columns of the body-fields table: *msgs* = messages that carried the field, *B/msg carrying* =
#: its bytes per such message, *B/msg of kind* = its bytes per message of the kind (these add up
#: to the whole message's mean; a field that only some messages carry, e.g. a teacher absent in
#: round 1, is smaller here than in the column before).
FIELD_COLUMNS = ("kind", "dir", "field", "codec", "msgs", "bytes", "B/msg carrying", "B/msg of kind", "share",
                 "raw B")


def field_cells(fields: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Table cells of :func:`body_fields` (columns :data:`FIELD_COLUMNS`): one row per field,
    then the whole message."""
    out = []
    for g in fields:
        for f in g["fields"]:
            out.append([g["kind"], g["direction"], f["field"], f["codec"], count(f["messages"]), count(f["bytes"]),
                        mean(f["bytes"] / f["messages"] if f["messages"] else None), mean(f["mean_bytes"]),
                        pct(f["share"]),
                        "—" if f["raw_bytes"] is None else count(f["raw_bytes"])])
        out.append([g["kind"], g["direction"], "= message", "", count(g["messages"]), count(g["message_bytes"]),
                    mean(g["mean_message_bytes"]), mean(g["mean_message_bytes"]),
                    pct(1.0 if g["message_bytes"] else None), count(g["raw_bytes"])])
    return out


def field_notes(fields: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per kind: messages, chunked ones, and the tensor values before and after the codec."""
    out = []
    for g in fields:
        ratio = f" ({pct(g['encoded_bytes'] / g['raw_bytes'])} of raw)" if g["raw_bytes"] else ""
        source = ("" if g["source"] == "sender" else
                  "; receiver's rows (no sender rows in this ledger): extras counted as one lump")
        out.append(f"{g['kind']} ({g['direction']}): {count(g['messages'])} messages, {count(g['chunked_messages'])} "
                   f"chunked; tensors + extras {count(g['encoded_bytes'])} B encoded from {count(g['raw_bytes'])} B "
                   f"raw{ratio}{source}")
        if g.get("parameter_bytes") == 0 and g["messages"]:
            names = ", ".join(g.get("extras_names") or []) or "none"
            out.append(f"{g['kind']} ({g['direction']}): no model parameter in any message (0 B of model tensors: "
                       f"every tensors field is an empty list); the body's arrays are extras only: {names}")
    out.append("other = envelope, msgpack framing, scalar body fields (num_samples, metrics, meta …), extras map "
               "header.")
    out.append("raw B = tensor values before the codec; per field only where it is a message's one tensor-bearing "
               "field (else —).")
    return out


def overhead_parts(tot: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(part, bytes) of one totals dict: body, envelope, signatures and encryption (when any), MQTT
    header + topic, control packets; they add up to its ``wire_bytes``."""
    parts = [("body", tot["body_bytes"]), ("envelope", tot["envelope_bytes"]),
             ("MQTT header + topic", tot["mqtt_bytes"]), ("control packets", tot.get("control_bytes", 0))]
    if tot.get("sig_bytes") or tot.get("enc_bytes"):
        parts[2:2] = [("signatures", tot.get("sig_bytes", 0)), ("encryption", tot.get("enc_bytes", 0))]
    return parts


def short_run_labels(paths: Sequence[str]) -> list[str]:
    """Short, distinct names for run folders in a table: each path's last component, or its last
    two, three … when those collide (the full paths are listed under the table)."""
    parts = [Path(p).parts or (p,) for p in paths]
    for depth in range(1, max(len(x) for x in parts) + 1 if parts else 1):
        labels = [str(Path(*x[-depth:])) for x in parts]
        if len(set(labels)) == len(labels):
            return labels
    return list(paths)



#: The line of a report whose ledger its writer did not close (``ledger_closed`` False).
UNCLEAN_CLOSE = ("Ledger not closed cleanly (its writer crashed, was killed or is still running): rows it had not "
                 "committed are missing")
