"""Reading a run folder: the ledger (as rows, or as an SQLite relation the queries read), its
``meta`` table, and ``metrics.jsonl``.

The queries of :mod:`._queries` and :mod:`._fields` read one relation, ``ledger``, with the
columns in :data:`LEDGER_COLUMNS`. :func:`open_ledger` makes it a temporary view over a ledger
file (read-only; columns that an older schema lacks read as their defaults, NULLs of text and
byte columns as ``''`` and 0); :func:`memory_ledger` makes it an in-memory table holding rows
given as mappings (as :func:`protocol.ledger.read_rows` yields them), with the same defaults.
Either way ``id`` orders the rows as the ledger does (insertion order).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.errors import LedgerError
from protocol.ledger import read_rows

from .. import metrics_file
from ..metrics_file import METRICS_NAME

LEDGER_NAME = "ledger.sqlite"

#: The columns of the ``ledger`` relation, by how a missing or NULL value reads: byte counts and
#: other integers as 0, text as ''; ``round``, ``chunk_index``, ``transfer_id`` and ``seq`` keep NULL
#: (it means something: no round, not a chunk, not chunked, no envelope: a control packet).
#: ``sender`` and ``seq`` (the envelope's) tell one copy of a message from another
#: (:func:`._queries.repeat_bytes`).
INT_COLUMNS = ("topic_bytes", "mqtt_header_bytes", "envelope_bytes", "body_bytes", "payload_bytes", "raw_bytes",
               "sig_bytes", "enc_bytes", "unsent_bytes")
TEXT_COLUMNS = ("federation", "side", "node", "event", "direction", "kind", "client", "topic", "codec", "reason",
                "fields", "delivery", "sender")
NULLABLE_COLUMNS = ("round", "chunk_index", "transfer_id", "seq")
LEDGER_COLUMNS = ("id", *TEXT_COLUMNS, *INT_COLUMNS, *NULLABLE_COLUMNS)

_TABLE = ("CREATE TABLE ledger (id INTEGER PRIMARY KEY, " + ", ".join(f"{c} TEXT NOT NULL" for c in TEXT_COLUMNS)
          + ", " + ", ".join(f"{c} INTEGER NOT NULL" for c in INT_COLUMNS)
          + ", round INTEGER, chunk_index INTEGER, transfer_id TEXT, seq INTEGER)")


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


def ledger_path(run_dir: str | Path) -> Path:
    """``RUN_DIR/ledger.sqlite``, checked to exist.

    Raises:
        AuditError: ``run_dir`` does not exist, is not a folder, or holds no ``ledger.sqlite``.
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
    return ledger


def load_run(run_dir: str | Path) -> RunAudit:
    """Read the ledger rows, its meta table and the metrics of a run folder.

    Args:
        run_dir: the run folder (holding ``ledger.sqlite`` and, optionally, ``metrics.jsonl``).

    Raises:
        AuditError: ``run_dir`` is not a folder, has no ``ledger.sqlite``, the ledger is not a
            readable fedfleet ledger, or a line of ``metrics.jsonl`` is not a JSON object.
    """
    run = Path(run_dir)
    ledger = ledger_path(run)
    try:
        rows = list(read_rows(ledger))
    except LedgerError as exc:
        raise AuditError(f"cannot audit {run}: {exc}", path=ledger) from exc
    return RunAudit(run_dir=run, rows=rows, metrics=read_metrics(run / METRICS_NAME), meta=_read_meta(ledger))


def _read_meta(ledger: Path) -> dict[str, str]:
    """The ``meta`` table of a ledger file ({} when it has none)."""
    try:
        db = sqlite3.connect(ledger.resolve().as_uri() + "?mode=ro", uri=True)
        try:
            return read_meta(db)
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise AuditError(f"{ledger} is not a readable fedfleet ledger: {exc}", path=ledger) from exc


def read_meta(db: sqlite3.Connection) -> dict[str, str]:
    """The ``meta`` table (key → value) of an open ledger ({} when it has none).

    Raises:
        sqlite3.Error: the file is not an SQLite database.
    """
    try:
        return {str(k): str(v) for k, v in db.execute("SELECT key, value FROM meta")}
    except sqlite3.OperationalError:
        return {}


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Records of ``metrics.jsonl`` in file order ([] when absent): :func:`broker_server.
    metrics_file.read_metrics` (a last line cut short by a killed run is dropped with a warning).

    Raises:
        AuditError: the file is unreadable, or a line before the last is not a JSON object with
            an integer ``round`` (``path:line`` in the message).
    """
    if not path.is_file():
        return []
    try:
        return metrics_file.read_metrics(path)
    except OSError as exc:
        raise AuditError(f"cannot read {path}: {exc}", path=path) from exc
    except ValueError as exc:  # "PATH:LINE: what is wrong"
        raise AuditError(str(exc), path=path) from exc


def open_ledger(run_dir: str | Path) -> sqlite3.Connection:
    """A read-only connection to ``RUN_DIR/ledger.sqlite`` with the temporary view ``ledger``
    (:data:`LEDGER_COLUMNS`) over its ``messages`` table. The caller closes it.

    Raises:
        AuditError: no ledger in ``run_dir`` (see :func:`ledger_path`), or the file is not an
            SQLite database with a ``messages`` table.
    """
    run = Path(run_dir)
    path = ledger_path(run)
    db = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)
    try:
        have = {r[1] for r in db.execute("PRAGMA main.table_info(messages)")}
        if not have:
            raise sqlite3.OperationalError("no such table: messages")
        cols = ["id AS id" if "id" in have else "rowid AS id"]
        for c in TEXT_COLUMNS:
            cols.append(f"COALESCE({c}, '') AS {c}" if c in have else f"'' AS {c}")
        for c in INT_COLUMNS:
            cols.append(f"COALESCE({c}, 0) AS {c}" if c in have else f"0 AS {c}")
        for c in NULLABLE_COLUMNS:
            cols.append(f"{c} AS {c}" if c in have else f"NULL AS {c}")
        db.execute(f"CREATE TEMP VIEW ledger AS SELECT {', '.join(cols)} FROM main.messages")
    except sqlite3.Error as exc:
        db.close()
        raise AuditError(f"cannot audit {run}: {path} is not a readable fedfleet ledger: {exc}", path=path) from exc
    return db


def memory_ledger(rows: Iterable[Mapping[str, Any]], *, keep_ids: bool = False) -> sqlite3.Connection:
    """An in-memory connection whose table ``ledger`` holds ``rows`` (mappings keyed by the
    ``messages`` columns; unknown keys are ignored, missing ones read as in :data:`LEDGER_COLUMNS`)
    with ``id`` = the row's position in ``rows`` (1, 2 …), or with ``keep_ids`` its own ``id``
    where it has one (what the ids noted in ``meta`` refer to: :func:`._queries.resume_bytes`).
    The caller closes it.

    Raises:
        ValueError: a byte column or ``round``/``chunk_index``/``seq`` holds something that is not an integer.
        sqlite3.IntegrityError: with ``keep_ids``, two rows have the same ``id``.
    """
    db = sqlite3.connect(":memory:")
    db.execute(_TABLE)

    def values(pos: int, r: Mapping[str, Any]) -> list[Any]:
        out: list[Any] = [int(r["id"]) if keep_ids and r.get("id") is not None else pos]
        out += ["" if r.get(c) is None else str(r.get(c)) for c in TEXT_COLUMNS]
        out += [0 if r.get(c) is None else int(r.get(c)) for c in INT_COLUMNS]  # type: ignore[arg-type]
        out += [None if r.get(c) is None else int(r.get(c)) for c in ("round", "chunk_index")]  # type: ignore[arg-type]
        out.append(None if r.get("transfer_id") is None else str(r.get("transfer_id")))
        out.append(None if r.get("seq") is None else int(r.get("seq")))  # type: ignore[arg-type]
        return out

    marks = ", ".join("?" for _ in LEDGER_COLUMNS)
    db.executemany(f"INSERT INTO ledger ({', '.join(LEDGER_COLUMNS)}) VALUES ({marks})",
                   (values(i, r) for i, r in enumerate(rows, start=1)))
    return db


def clean_close(db: sqlite3.Connection) -> bool:
    """Whether the ledger file was closed by :meth:`protocol.ledger.Ledger.close`.

    A ledger is written in WAL mode and :meth:`~protocol.ledger.Ledger.close` switches it back to
    a rollback journal (``journal_mode=DELETE``) as it closes, so a file still in WAL mode was
    not closed: its writer crashed, was killed, or is still running, and rows it had not yet
    committed are missing. The ledger's own record (``meta.closed_cleanly``, written by
    :class:`protocol.ledger.Ledger` since it records closes: '0' while open, '1' after a close)
    decides where it exists; the journal mode decides for older ledgers. An in-memory ledger
    (:func:`memory_ledger`) counts as closed.
    """
    try:
        flag = db.execute("SELECT value FROM main.meta WHERE key = 'closed_cleanly'").fetchone()
    except sqlite3.Error:  # no meta table: an in-memory or pre-meta ledger
        flag = None
    if flag is not None:
        return str(flag[0]) == "1"
    mode = db.execute("PRAGMA main.journal_mode").fetchone()
    return not (mode and str(mode[0]).lower() == "wal")
