"""The audit as CSV files, one table per file."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ._queries import round_label
from ._report import comparison_row


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


#: wire_bytes = body + envelope + sig + enc + mqtt + control − unsent on every row
_BY_KIND_FIELDS = ["run", "kind", "direction", "messages", "body_bytes", "envelope_bytes", "sig_bytes", "enc_bytes",
                   "mqtt_bytes", "control_messages", "control_bytes", "unsent_bytes", "wire_bytes", "overhead_share"]


_COMPARISON_FIELDS = ["run", "federation", "rounds", "final_accuracy", "up_bytes", "down_bytes", "wire_bytes",
                      "overhead_share", "target", "target_round", "bytes_to_target", "uplink_kbps",
                      "downlink_kbps", "up_max_s", "down_max_s", "time_max_s", "up_sum_s", "down_sum_s",
                      "time_sum_s", "up_tensor_bytes_per_client_round", "up_extras_bytes_per_client_round",
                      "down_tensor_bytes_per_client_round", "down_extras_bytes_per_client_round", "resumed_after",
                      "resume_link", "resume_bytes", "resume_rerun_bytes", "resume_ending_bytes", "resume_rejoin_bytes",
                      "resume_refused_bytes", "wire_bytes_without_resume", "resume_note", "repeat_bytes",
                      "repeat_messages", "repeat_again_bytes", "repeat_dup_bytes", "repeat_reconnect_bytes",
                      "repeat_note"]


def _comparison_csv_row(report: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`comparison_row` with ``resumed_after`` as one cell: the rounds joined by ``;``
    (``''``: never resumed)."""
    row = comparison_row(report)
    return {**row, "resumed_after": ";".join(str(r) for r in row["resumed_after"])}


_FIELDS_FIELDS = ["run", "kind", "direction", "source", "field", "codec", "messages", "bytes", "mean_bytes", "share",
                  "raw_bytes", "kind_messages", "kind_message_bytes", "kind_raw_bytes", "kind_encoded_bytes"]


def write_csv(reports: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """Write ``by_round.csv``, ``by_client.csv``, ``by_kind.csv``, ``comparison.csv`` and
    ``fields.csv`` to ``out_dir``.

    Device view; bytes in bytes, shares as fractions, times in seconds, empty cells for None.
    Every file has a ``run`` column (the run path); ``by_round.csv`` writes the session row's
    round as ``session``; ``comparison.csv`` has one row per run, in the order given (see
    :func:`comparison_row`; a resumed run's ``resumed_after`` as ``2`` or ``2;5``, and the
    bytes its resumes added on ``resume_link`` (the device links; the server link for a ledger
    with only the server's rows) in ``resume_bytes``, ``resume_rerun_bytes``,
    ``resume_ending_bytes``, ``resume_rejoin_bytes`` and ``resume_refused_bytes``, empty where
    its ledger does not note them, and ``resume_note`` saying why: ``device ledger`` for a device's
    own, whose cost is in ``repeat_bytes``, ``repeat_messages``, ``repeat_again_bytes``,
    ``repeat_dup_bytes``, ``repeat_reconnect_bytes``: what the devices sent or received again,
    :func:`._queries.repeat_bytes`, empty without device-link rows); ``fields.csv`` has one row
    per body field of :func:`body_fields` (``other`` included, so a kind's ``bytes`` add up to
    its ``kind_message_bytes``), with the kind's
    ``kind_messages``, ``kind_message_bytes``, ``kind_raw_bytes`` and ``kind_encoded_bytes``
    repeated on each.

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
    _write_rows(paths[3], _COMPARISON_FIELDS, (_comparison_csv_row(rep) for rep in reports))
    paths.append(out / "fields.csv")
    _write_rows(paths[4], _FIELDS_FIELDS,
                ({**f, "run": rep["run"]["path"], "kind": g["kind"], "direction": g["direction"],
                  "source": g["source"], "kind_messages": g["messages"], "kind_message_bytes": g["message_bytes"],
                  "kind_raw_bytes": g["raw_bytes"], "kind_encoded_bytes": g["encoded_bytes"]}
                 for rep in reports for g in rep.get("fields") or [] for f in g["fields"]))
    return paths

