"""The byte ledger: one SQLite row per message per side.

Each side that sends or receives a message writes one row. The sender writes ``event='sent'``
when it hands the payload to the MQTT client; the receiver writes ``event='received'`` after a
successful decode, or ``event='rejected'`` with a reason. Wire totals are the sums over
``event IN ('sent', 'received', 'rejected')``. Byte columns count exact ``len()`` of
what crossed the MQTT client API (STYLE: count bytes, don't estimate):

====================  ==========================================================================
column                meaning
====================  ==========================================================================
topic_bytes           UTF-8 length of the PUBLISH topic
mqtt_header_bytes     PUBLISH framing except topic and payload (:mod:`protocol.mqtt_bytes`)
envelope_bytes        payload bytes that are not body, signature or encryption (header fields +
                      msgpack framing)
body_bytes            the kind's body (nested ``bin`` content; the plaintext when encrypted)
sig_bytes             bytes the signature trailer ``sec`` adds (Ed25519 signature, epoch, flags,
                      length, check; :mod:`protocol.security`); 0 for unsigned messages
enc_bytes             bytes encryption adds (AES-GCM tag + growth of the body's ``bin`` header);
                      0 for plain bodies
payload_bytes         envelope_bytes + body_bytes + sig_bytes + enc_bytes = the MQTT payload length
raw_bytes             tensor values before the codec (``size × itemsize``), 0 without tensors;
                      ``raw_bytes / body_bytes`` is the codec's compression ratio
fields                JSON object: bytes of each body field (``{"tensors": 423412, …}``)
link_s                simulated transfer time of the packet on the device's link (seconds:
                      bytes·8 / kbit/s + RTT, from its firmware profile), beside ``ts`` (wall
                      time); 0 when the side has no profile link (the server, real devices)
codec                 tensor codec of the message (``fp32``, ``int8+zstd`` …)
transfer_id           hex id of a chunked transfer; ``chunk_index``/``chunk_count`` locate the
                      chunk. The chunks of a transfer are the rows that hit the wire (their
                      ``kind`` is the kind of the message they carry; ``body_bytes`` = the
                      slice, ``envelope_bytes`` = chunk framing). The whole message gets one
                      more row on each side with ``event='message'``: its logical sizes,
                      fields and codec; those bytes are already counted by the chunk rows.
====================  ==========================================================================

Rows with ``reason='control'`` are MQTT control packets (CONNECT, CONNACK, SUBSCRIBE, SUBACK,
PUBACK, PINGREQ, PINGRESP, DISCONNECT, and PUBLISH retransmissions as ``PUBLISH-DUP``): their
whole packet size is in ``mqtt_header_bytes``.

``direction`` is ``up`` (agent → server: join, update, status) or ``down`` (server → agents).
``client`` is the agent the row concerns: the sender of an upload, the recipient of a download
on the agent side, and ``'*'`` for a broadcast recorded by the server.

The ledger is safe to share between threads (one connection guarded by a lock) and is written
in WAL mode; rows are committed in batches and on :meth:`Ledger.flush`.

Schema versions: 1 (first cut), 2 (``message`` event, raw/field/chunk columns), 3 (``link_s``),
4 (``sig_bytes``, ``enc_bytes``). Opening an older file for writing migrates it in place (new
columns read 0 in old rows); a newer file is refused.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .errors import LedgerError

SCHEMA_VERSION = 4

_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    federation TEXT NOT NULL,
    side TEXT NOT NULL CHECK (side IN ('server', 'agent')),
    node TEXT NOT NULL,
    event TEXT NOT NULL CHECK (event IN ('sent', 'received', 'rejected', 'message')),
    direction TEXT NOT NULL CHECK (direction IN ('up', 'down')),
    kind TEXT NOT NULL,
    round INTEGER,
    client TEXT NOT NULL,
    sender TEXT,
    seq INTEGER,
    topic TEXT NOT NULL,
    topic_bytes INTEGER NOT NULL,
    mqtt_header_bytes INTEGER NOT NULL,
    envelope_bytes INTEGER NOT NULL,
    body_bytes INTEGER NOT NULL,
    payload_bytes INTEGER NOT NULL,
    qos INTEGER NOT NULL,
    retained INTEGER NOT NULL DEFAULT 0,
    codec TEXT NOT NULL DEFAULT '',
    reason TEXT NOT NULL DEFAULT '',
    raw_bytes INTEGER NOT NULL DEFAULT 0,
    fields TEXT NOT NULL DEFAULT '',
    transfer_id TEXT,
    chunk_index INTEGER,
    chunk_count INTEGER,
    link_s REAL NOT NULL DEFAULT 0,
    sig_bytes INTEGER NOT NULL DEFAULT 0,
    enc_bytes INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS messages_round ON messages (round);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass(frozen=True, slots=True)
class LedgerRow:
    """One message as seen by one side. Byte fields are in bytes; ``ts`` is Unix seconds."""

    federation: str
    side: str
    node: str
    event: str
    direction: str
    kind: str
    round: int | None
    client: str
    sender: str | None
    seq: int | None
    topic: str
    topic_bytes: int
    mqtt_header_bytes: int
    envelope_bytes: int
    body_bytes: int
    payload_bytes: int
    qos: int
    retained: bool = False
    codec: str = ""
    reason: str = ""
    raw_bytes: int = 0
    fields: str = ""
    transfer_id: str | None = None
    chunk_index: int | None = None
    chunk_count: int | None = None
    link_s: float = 0.0
    sig_bytes: int = 0
    enc_bytes: int = 0
    ts: float = 0.0

    @property
    def wire_bytes(self) -> int:
        """Bytes of the whole PUBLISH packet (header + topic + payload)."""
        return self.mqtt_header_bytes + self.topic_bytes + self.payload_bytes


_COLUMNS = [f.name for f in fields(LedgerRow)]


def _migrate(db: sqlite3.Connection, version: int) -> None:
    """Bring a schema-``version`` ledger to :data:`SCHEMA_VERSION` in one transaction.

    Version 1 lacks ``'message'`` in the ``event`` CHECK constraint, which SQLite cannot alter: its
    table is rebuilt (rows copied). Later versions only lack columns, which are added with their
    defaults.
    """
    try:
        db.execute("BEGIN")
        have = [r[1] for r in db.execute("PRAGMA table_info(messages)")]
        if version < 2:
            db.execute("ALTER TABLE messages RENAME TO messages_v1")
            db.execute("DROP INDEX IF EXISTS messages_round")
            for statement in _SCHEMA.split(";"):  # not executescript: it would commit the transaction
                if statement.strip():
                    db.execute(statement)
            common = [c for c in have if c in _COLUMNS or c == "id"]
            cols = ", ".join(common)
            db.execute(f"INSERT INTO messages ({cols}) SELECT {cols} FROM messages_v1")
            db.execute("DROP TABLE messages_v1")
        else:
            for name, decl in _ADDED_COLUMNS:
                if name not in have:
                    db.execute(f"ALTER TABLE messages ADD COLUMN {name} {decl}")
        db.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        db.execute("INSERT OR REPLACE INTO meta VALUES ('migrated_from', ?)", (str(version),))
        db.execute("COMMIT")
    except sqlite3.Error:
        db.execute("ROLLBACK")
        raise


#: Columns added after schema 2, with their declarations (for :func:`_migrate`).
_ADDED_COLUMNS = (
    ("raw_bytes", "INTEGER NOT NULL DEFAULT 0"),
    ("fields", "TEXT NOT NULL DEFAULT ''"),
    ("transfer_id", "TEXT"),
    ("chunk_index", "INTEGER"),
    ("chunk_count", "INTEGER"),
    ("link_s", "REAL NOT NULL DEFAULT 0"),
    ("sig_bytes", "INTEGER NOT NULL DEFAULT 0"),
    ("enc_bytes", "INTEGER NOT NULL DEFAULT 0"),
)
_INSERT = f"INSERT INTO messages ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' for _ in _COLUMNS)})"


class Ledger:
    """SQLite byte ledger in ``path`` (created with its schema when missing).

    Args:
        path: the database file, normally ``RUN_DIR/ledger.sqlite``.
        batch: rows kept before an automatic commit.

    Raises:
        LedgerError: the file cannot be opened or has an incompatible schema.
    """

    def __init__(self, path: str | os.PathLike, *, batch: int = 256) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._pending = 0
        self._batch = batch
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                self._db.commit()
            elif int(row[0]) > SCHEMA_VERSION:
                raise LedgerError(f"{self.path}: ledger schema {row[0]} is newer than this fedfleet's "
                                  f"({SCHEMA_VERSION}); upgrade fedfleet to write to it")
            elif int(row[0]) < SCHEMA_VERSION:
                _migrate(self._db, int(row[0]))
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot open ledger {self.path}: {exc}") from exc

    def record(self, row: LedgerRow) -> None:
        """Append one row (``ts`` is filled with the current time when 0).

        Raises:
            LedgerError: SQLite refused the row.
        """
        values = asdict(row)
        if not values["ts"]:
            values["ts"] = time.time()
        values["retained"] = int(values["retained"])
        with self._lock:
            try:
                self._db.execute(_INSERT, [values[c] for c in _COLUMNS])
            except sqlite3.Error as exc:
                raise LedgerError(f"cannot write ledger row ({row.kind}, {row.topic}): {exc}") from exc
            self._pending += 1
            if self._pending >= self._batch:
                self._db.commit()
                self._pending = 0

    def flush(self) -> None:
        """Commit pending rows."""
        with self._lock:
            self._db.commit()
            self._pending = 0

    def close(self) -> None:
        """Commit and close (idempotent)."""
        with self._lock:
            if self._db is not None:
                self._db.commit()
                try:  # leave a single self-contained file behind (no -wal/-shm) for readers
                    self._db.execute("PRAGMA journal_mode=DELETE")
                except sqlite3.Error:
                    pass
                self._db.close()
                self._db = None  # type: ignore[assignment]

    def set_meta(self, key: str, value: str) -> None:
        """Store one key/value pair describing the run (federation, protocol version …)."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
            self._db.commit()

    def rows(self, where: str = "", params: tuple = ()) -> list[LedgerRow]:
        """Rows matching an optional SQL ``where`` clause (without the keyword), in insertion order."""
        self.flush()
        sql = f"SELECT {', '.join(_COLUMNS)} FROM messages" + (f" WHERE {where}" if where else "") + " ORDER BY id"
        with self._lock:
            cur = self._db.execute(sql, params)
            return [LedgerRow(**{**dict(zip(_COLUMNS, r)), "retained": bool(r[_COLUMNS.index("retained")])})
                    for r in cur.fetchall()]

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_rows(path: str | os.PathLike) -> Iterator[dict]:
    """Yield every row of a ledger file as a dict (read-only; for the audit).

    Raises:
        LedgerError: the file is missing or not a fedfleet ledger.
    """
    p = Path(path)
    if not p.is_file():
        raise LedgerError(f"no ledger at {p}")
    try:
        db = sqlite3.connect(f"file:{p}?mode=ro", uri=True)
        db.row_factory = sqlite3.Row
        try:
            for r in db.execute("SELECT * FROM messages ORDER BY id"):
                yield dict(r)
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise LedgerError(f"{p} is not a readable fedfleet ledger: {exc}") from exc
