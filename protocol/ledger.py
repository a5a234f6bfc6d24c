"""The byte ledger: one SQLite row per message per side.

Each side that sends or receives a message writes one row. The sender writes ``event='sent'``
when it hands the payload to the MQTT client; the receiver writes ``event='received'`` after a
successful decode, or ``event='rejected'`` with a reason. Wire totals are the sums over
``event IN ('sent', 'received', 'rejected')`` of ``mqtt_header_bytes + topic_bytes +
payload_bytes - unsent_bytes`` (:attr:`LedgerRow.wire_bytes`). Byte columns count exact ``len()`` of
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
unsent_bytes          bytes of the row's packet that the socket never took: the connection was
                      lost, or the transport closed (or its client's network thread ended), after
                      the socket had taken part of the packet (schema 6); 0 for a packet written
                      whole. The row's other byte columns keep the whole packet's sizes; its wire
                      bytes are header + topic + payload - unsent_bytes, as the socket wrote
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

``delivery`` (schema 5) says what became of a PUBLISH this side sent (``event='sent'`` rows):
``handed`` (given to the MQTT client; QoS 0, or no answer yet), ``acked`` (the broker's PUBACK
accepted it), ``refused`` (a PUBACK reason code >= 0x80, a packet above the broker's known limit
that was not sent, or one the broker closed the connection for; ``reason`` says which and names the
limit), ``dropped`` (lost before the broker got it whole: a QoS 0 PUBLISH still in the MQTT
client's queue when the connection was lost, which MQTT does not send again, or a message still
unsent when the transport was closed; ``reason`` says which). It is ``''`` on every other row. A
refused message is sent again as a chunked transfer below the limit (new rows) or fails loudly; a
dropped one is said undeliverable. Rows of a message refused *before* it was sent (above a known
limit), of one withdrawn as refused before the socket took a byte of any PUBLISH of it (above a
limit inferred from the broker's closes, :mod:`protocol.transport`), of one dropped before the
socket took a byte of it, and of a message or the chunks of a transfer that the transport did not
take (it was closed, or its offline buffer full: an unchunked message's one row, or that chunk and
every one after it, never offered, delivery ``dropped``, ``reason`` ``'not handed to the MQTT
client: …'``; the sender logs a warning, and the recipient gets them only if the sender sends the
message again or, chunks, by asking again) count no wire bytes: their ``mqtt_header_bytes``,
``topic_bytes`` and ``payload_bytes`` are kept, but ``event`` is ``'message'`` (a withdrawn or
dropped row's ``sent`` turns into ``message`` when that is known). A PUBLISH the socket took part
of before the connection was lost stays ``sent`` (the part it took was on the wire) with
``dropped``, and ``unsent_bytes`` says how much of it the socket never took. So does a QoS 1
PUBLISH cut that way: its message is sent again after the reconnect (a ``PUBLISH-DUP`` row, whole
unless it is cut too), and its row's delivery is that of the message (``acked`` …; ``dropped`` when
the transport is closed before the socket took a whole PUBLISH of it: the broker got none).

A ``sent`` row's sizes are those of the packet that goes out: a message queued while the MQTT
protocol level was not settled (before the first CONNACK, the MQTT 5 trial) and moved to a client
of another level has its ``mqtt_header_bytes`` corrected when it is moved (:meth:`Ledger.resize`).

Rows with ``reason='control'`` are MQTT control packets (CONNECT, CONNACK, SUBSCRIBE, SUBACK,
PUBACK, PINGREQ, PINGRESP, DISCONNECT, and PUBLISH retransmissions as ``PUBLISH-DUP``): their
whole packet size is in ``mqtt_header_bytes``. One recorded when it was queued that the socket never
took (the connection was lost, or the transport closed, first) turns into a ``message`` row with
delivery ``dropped``; one the socket took part of stays ``sent`` with its ``unsent_bytes``. A
``PUBLISH-DUP`` row is a packet that was on the
wire before: a QoS 1 PUBLISH that a lost connection dropped from paho's queue before the socket
took a byte of it goes out after the reconnect with the DUP flag, but as its first transmission,
counted by its ``sent`` row alone. Likewise a retransmission dropped that way: its re-send after
the next reconnect is counted by its ``PUBLISH-DUP`` row, which turns into a ``message`` row with
delivery ``dropped`` when it is never sent (the transport closed, or its message withdrawn as
refused, before the socket took a byte of it).

``direction`` is ``up`` (agent → server: join, update, status) or ``down`` (server → agents).
``client`` is the agent the row concerns: the sender of an upload, the recipient of a download
on the agent side, and ``'*'`` for a broadcast recorded by the server.

The ledger is safe to share between threads (one connection guarded by a lock) and is written
in WAL mode (``synchronous=NORMAL``: a committed row survives the writing process being killed,
SIGKILL included; only a power loss can take the last commits). Durability:

- rows are committed at most ``commit_interval_s`` (1 s) after they were recorded: on the next
  write once the interval has passed, else by one idle-waiting committer thread per process
  (:class:`_Committer`, started on first use, it sleeps without a timeout while nothing is
  pending); also every ``batch`` rows, on :meth:`Ledger.flush` (the server calls it at each
  round's end) and at once for the rows that end a round on either side (:data:`COMMIT_AT_ONCE`);
- after ``kill -9`` the file holds every row recorded more than about ``commit_interval_s``
  earlier; :mod:`protocol.lifecycle` turns SIGTERM/SIGINT into a commit of every open ledger and
  an orderly exit, and at interpreter exit pending rows are committed (:func:`flush_open_ledgers`);
- the ``meta`` table says how the last writer ended: ``closed_cleanly`` is ``'0'`` while a writer
  has the file open and ``'1'`` after :meth:`Ledger.close` (with ``closed_at``, Unix seconds) of
  the last writer that had it open (each open writer is a ``writer:<pid>:<n>`` key, removed by its
  close; a killed writer's key is dropped by the next writer to open the file, once its
  process is gone);
  ``stop_signal`` names a signal that stopped the writer (``SIGTERM``). Read it with
  :func:`ledger_closed_cleanly`;
- a run's server notes in ``meta`` each ``--resume`` of its run (``resumes``: after which round,
  and the id of the last row before it, so each session's rows are known; :mod:`broker_server.resumes`):
  the rows of every attempt stay, as they crossed the wire, and the audit says which bytes the
  resumes added.

Schema versions: 1 (first cut), 2 (``message`` event, raw/field/chunk columns), 3 (``link_s``),
4 (``sig_bytes``, ``enc_bytes``), 5 (``delivery``), 6 (``unsent_bytes``). Opening an older file for
writing migrates it in place (new columns read 0 in old rows); a newer file is refused. A reader of
an older file takes ``unsent_bytes`` as 0 (those fedfleets counted a cut packet whole).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .errors import LedgerError

SCHEMA_VERSION = 6

log = logging.getLogger(__name__)

#: Seconds a recorded row may wait for its commit (the most a ``kill -9`` can take from a ledger).
COMMIT_INTERVAL_S = 1.0

#: ``(event, kind)`` of rows committed at once: the ends of a round on each side (the agent's
#: ``update`` sent, the ``round_start`` that opens the next round, ``finish``) and ``join``.
COMMIT_AT_ONCE = frozenset({("sent", "update"), ("sent", "round_start"), ("received", "round_start"),
                            ("sent", "finish"), ("received", "finish"), ("sent", "join")})

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
    enc_bytes INTEGER NOT NULL DEFAULT 0,
    delivery TEXT NOT NULL DEFAULT '',
    unsent_bytes INTEGER NOT NULL DEFAULT 0
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
    delivery: str = ""
    unsent_bytes: int = 0
    ts: float = 0.0

    @property
    def wire_bytes(self) -> int:
        """Bytes of the row's packet the socket wrote: header + topic + payload, less the
        ``unsent_bytes`` a lost connection (or a close) kept off the wire."""
        return self.mqtt_header_bytes + self.topic_bytes + self.payload_bytes - self.unsent_bytes


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
    ("delivery", "TEXT NOT NULL DEFAULT ''"),
    ("unsent_bytes", "INTEGER NOT NULL DEFAULT 0"),
)

#: Values of the ``delivery`` column of a ``sent`` row (``''`` on other rows).
DELIVERIES = ("handed", "acked", "refused", "dropped")
_INSERT = f"INSERT INTO messages ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' for _ in _COLUMNS)})"


class _Committer:
    """One daemon thread per process that commits ledgers whose oldest pending row is due.

    It waits on a condition without a timeout while no ledger has pending rows, so an idle process
    has no thread waking up; :meth:`due` is called by a ledger when it records the first row after a
    commit, with the time (``time.monotonic()``) by which that row must be committed.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[int, tuple[float, weakref.ref]] = {}  # ledger token -> (deadline, ledger)
        self._thread: threading.Thread | None = None

    def due(self, token: int, ledger: Ledger, deadline: float) -> None:
        with self._cond:
            if token in self._due:
                return
            self._due[token] = (deadline, weakref.ref(ledger))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ledger-commit", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due:
                    self._cond.wait()
                token, (deadline, ref) = min(self._due.items(), key=lambda kv: kv[1][0])
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                del self._due[token]
            ledger = ref()
            if ledger is not None:
                try:
                    ledger._commit_due()
                except Exception as exc:  # a closed or broken file: the writer sees it on its next row
                    log.warning("ledger %s: timed commit failed: %s", ledger.path, exc)


_committer = _Committer()
_tokens = itertools.count(1)
_open: weakref.WeakSet[Ledger] = weakref.WeakSet()


def _after_fork_in_child() -> None:  # the parent's thread and lock states do not cross a fork
    global _committer, _open
    _committer = _Committer()
    _open = weakref.WeakSet()


os.register_at_fork(after_in_child=_after_fork_in_child)


def open_ledgers() -> list[Ledger]:
    """The ledgers of this process that are open for writing (for :mod:`protocol.lifecycle`)."""
    return list(_open)


def flush_open_ledgers(*, stop_signal: str | None = None) -> int:
    """Commit the pending rows of every open ledger of this process; return how many ledgers.

    Args:
        stop_signal: name of the signal that is stopping the process (``"SIGTERM"``); stored in
            each ledger's ``meta`` as ``stop_signal``. ``None`` stores nothing.

    Never raises: a ledger that cannot commit is logged and skipped (this runs in signal handlers
    and at interpreter exit).
    """
    n = 0
    for ledger in open_ledgers():
        try:
            if stop_signal is not None:
                ledger.set_meta("stop_signal", stop_signal)
            ledger.flush()
            n += 1
        except Exception as exc:
            log.warning("ledger %s: final commit failed: %s", ledger.path, exc)
    return n


atexit.register(flush_open_ledgers)


class Ledger:
    """SQLite byte ledger in ``path`` (created with its schema when missing).

    Args:
        path: the database file, normally ``RUN_DIR/ledger.sqlite``.
        batch: rows kept before an automatic commit.
        commit_interval_s: longest time (seconds) a recorded row waits for its commit; > 0.

    Raises:
        LedgerError: the file cannot be opened or has an incompatible schema.
        ValueError: ``batch`` < 1 or ``commit_interval_s`` <= 0.
    """

    def __init__(self, path: str | os.PathLike, *, batch: int = 256,
                 commit_interval_s: float = COMMIT_INTERVAL_S) -> None:
        if batch < 1:
            raise ValueError(f"Ledger batch={batch!r}: need at least 1 row per commit")
        if not commit_interval_s > 0:
            raise ValueError(f"Ledger commit_interval_s={commit_interval_s!r}: need a positive number of seconds")
        self.path = Path(path)
        self._lock = threading.RLock()  # re-entrant: a signal handler may commit while the main thread records
        self._pending = 0
        self._batch = batch
        self._interval = float(commit_interval_s)
        self._last_commit = time.monotonic()
        self._token = next(_tokens)
        self.write_s = 0.0  # seconds spent in record() and flush() (the per-round phase breakdown reads it)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
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
            self._db.execute("DELETE FROM meta WHERE key IN ('closed_at', 'stop_signal')")
            # writers of earlier sessions that are gone (killed: never closed) no longer count
            for (key,) in self._db.execute("SELECT key FROM meta WHERE key LIKE 'writer:%'").fetchall():
                if not _pid_alive(key):
                    self._db.execute("DELETE FROM meta WHERE key = ?", (key,))
            self._writer_key = f"writer:{os.getpid()}:{self._token}"
            self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                                 [("closed_cleanly", "0"), ("opened_at", repr(time.time())),
                                  ("writer_pid", str(os.getpid())), (self._writer_key, repr(time.time()))])
            self._db.commit()
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot open ledger {self.path}: {exc}") from exc
        _open.add(self)

    def _commit(self) -> None:
        """Commit now (caller holds the lock and has checked the connection is open)."""
        self._db.commit()
        self._pending = 0
        self._last_commit = time.monotonic()

    def _commit_due(self) -> None:
        """The committer thread's call: commit rows that have waited their interval."""
        with self._lock:
            if self._db is not None and self._pending:
                self._commit()

    def record(self, row: LedgerRow) -> int:
        """Append one row (``ts`` is filled with the current time when 0); return its row id
        (for :meth:`set_delivery`).

        Raises:
            LedgerError: SQLite refused the row.
        """
        t0 = time.perf_counter()
        values = asdict(row)
        if not values["ts"]:
            values["ts"] = time.time()
        values["retained"] = int(values["retained"])
        with self._lock:
            if self._db is None:
                raise LedgerError(f"cannot write ledger row ({row.kind}, {row.topic}): {self.path} is closed "
                                  "(a connection outlived its run?)")
            try:
                row_id = int(self._db.execute(_INSERT, [values[c] for c in _COLUMNS]).lastrowid or 0)
                self._pending += 1
                if (self._pending >= self._batch or (row.event, row.kind) in COMMIT_AT_ONCE
                        or time.monotonic() - self._last_commit >= self._interval):
                    self._commit()
                    return row_id
            except sqlite3.Error as exc:
                raise LedgerError(f"cannot write ledger row ({row.kind}, {row.topic}): {exc}") from exc
            finally:
                self.write_s += time.perf_counter() - t0
            if self._pending == 1:  # the first row since the last commit: it is due one interval from now
                _committer.due(self._token, self, time.monotonic() + self._interval)
            return row_id

    def set_delivery(self, row_id: int, delivery: str, reason: str = "", *, on_wire: bool = True) -> None:
        """Set the ``delivery`` of the ``sent`` row ``row_id`` (:data:`DELIVERIES`); a non-empty
        ``reason`` replaces the row's. With ``on_wire=False`` (a PUBLISH dropped before the socket
        took a byte of it) the row's ``event`` becomes ``'message'``: its bytes leave the wire
        totals, its sizes stay. A no-op on a closed ledger (a PUBACK after the close).

        Raises:
            ValueError: ``delivery`` not one of :data:`DELIVERIES`.
            LedgerError: SQLite refused the update.
        """
        if delivery not in DELIVERIES:
            raise ValueError(f"delivery must be one of {', '.join(DELIVERIES)}, not {delivery!r}")
        sets, params = ["delivery = ?"], [delivery]
        if reason:
            sets.append("reason = ?")
            params.append(reason[:500])
        if not on_wire:
            sets.append("event = CASE WHEN event = 'sent' THEN 'message' ELSE event END")
        self._update(row_id, f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*params, row_id))

    def set_unsent(self, row_id: int, unsent_bytes: int) -> None:
        """Set the ``unsent_bytes`` of row ``row_id``: how many bytes of its packet the socket never
        took (the connection was lost, or the transport closed, with the packet partly written).
        Its sizes stay those of the whole packet; its wire bytes become theirs less
        ``unsent_bytes``. A row stands for one transmission of its packet, so a second call
        replaces the first. A no-op on a closed ledger (a loss reported after the close).

        Raises:
            ValueError: ``unsent_bytes`` is negative.
            LedgerError: SQLite refused the update.
        """
        if unsent_bytes < 0:
            raise ValueError(f"unsent_bytes must be >= 0, not {unsent_bytes!r}")
        self._update(row_id, "UPDATE messages SET unsent_bytes = ? WHERE id = ?", (int(unsent_bytes), row_id))

    def resize(self, row_id: int, packet_bytes: int) -> None:
        """Set the PUBLISH packet size of row ``row_id`` to ``packet_bytes`` (its
        ``mqtt_header_bytes`` take the difference; topic and payload are what they were): the
        packet went out under another MQTT protocol level than the row was sized for. A no-op on
        a closed ledger.

        Raises:
            LedgerError: SQLite refused the update.
        """
        self._update(row_id, "UPDATE messages SET mqtt_header_bytes = ? - topic_bytes - payload_bytes WHERE id = ?",
                     (packet_bytes, row_id))

    def _update(self, row_id: int, sql: str, params: tuple) -> None:
        with self._lock:
            if self._db is None:
                return
            try:
                self._db.execute(sql, params)
                self._pending += 1
            except sqlite3.Error as exc:
                raise LedgerError(f"cannot update ledger row {row_id}: {exc}") from exc
            if self._pending == 1:
                _committer.due(self._token, self, time.monotonic() + self._interval)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._db is None

    def flush(self) -> None:
        """Commit pending rows (a no-op on a closed ledger).

        Raises:
            LedgerError: SQLite refused the commit (disk full, file removed …).
        """
        with self._lock:
            if self._db is None:
                return
            t0 = time.perf_counter()
            try:
                self._commit()
            except sqlite3.Error as exc:
                raise LedgerError(f"cannot commit ledger {self.path}: {exc}") from exc
            finally:
                self.write_s += time.perf_counter() - t0

    def close(self) -> None:
        """Commit, record the clean close in ``meta`` (``closed_cleanly='1'``, ``closed_at``) and
        close (idempotent)."""
        with self._lock:
            if self._db is not None:
                _open.discard(self)
                self._db.execute("DELETE FROM meta WHERE key = ?", (self._writer_key,))
                others = self._db.execute("SELECT COUNT(*) FROM meta WHERE key LIKE 'writer:%'").fetchone()[0]
                if not others:  # another writer still open (or killed) keeps the file unclean
                    self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                                         [("closed_cleanly", "1"), ("closed_at", repr(time.time()))])
                self._commit()
                try:  # leave a single self-contained file behind (no -wal/-shm) for readers
                    if not others:
                        self._db.execute("PRAGMA journal_mode=DELETE")
                except sqlite3.Error:
                    pass
                self._db.close()
                self._db = None  # type: ignore[assignment]

    def set_meta(self, key: str, value: str) -> None:
        """Store one key/value pair describing the run (federation, protocol version …); commits.

        Raises:
            LedgerError: the ledger is closed or SQLite refused the write.
        """
        with self._lock:
            if self._db is None:
                raise LedgerError(f"cannot set {key!r} in {self.path}: the ledger is closed")
            try:
                self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
                self._commit()
            except sqlite3.Error as exc:
                raise LedgerError(f"cannot set {key!r} in {self.path}: {exc}") from exc

    def mark_refused(self, *, node: str, sender: str, seq: int, kind: str, reason: str) -> bool:
        """Turn the last ``received`` row of message ``(sender, seq)`` of ``kind`` recorded by
        ``node`` into a ``rejected`` row with ``reason`` (its consumer refused the decoded
        message); for a chunked transfer, whose logical ``message`` row is the message's, that row
        gets the reason (its chunk rows keep ``received``). Byte columns are unchanged, so wire
        totals stay the same.

        Returns:
            Whether a row was found.

        Raises:
            LedgerError: the ledger is closed or SQLite refused the update.
        """
        sql = ("UPDATE messages SET reason = ?, event = CASE WHEN event = 'received' THEN 'rejected' ELSE event END "
               "WHERE id = (SELECT MAX(id) FROM messages WHERE node = ? AND sender = ? AND seq = ? AND kind = ? "
               "AND chunk_index IS NULL AND event IN ('received', 'message'))")
        with self._lock:
            if self._db is None:
                raise LedgerError(f"cannot mark ({sender}, {seq}) refused in {self.path}: the ledger is closed")
            try:
                n = self._db.execute(sql, (reason, node, sender, seq, kind)).rowcount
                self._pending += 1
            except sqlite3.Error as exc:
                raise LedgerError(f"cannot mark ({sender}, {seq}) refused in {self.path}: {exc}") from exc
            if self._pending == 1:
                _committer.due(self._token, self, time.monotonic() + self._interval)
        return n > 0

    def last_row_id(self) -> int:
        """The id of the newest row in the file (0 when it holds none): rows recorded from now on
        get larger ids (``AUTOINCREMENT`` never reuses one, not even that of a row a killed writer
        never committed). A resumed server notes it as where its session begins
        (:mod:`broker_server.resumes`).

        Raises:
            LedgerError: the ledger is closed or SQLite refused the read.
        """
        with self._lock:
            if self._db is None:
                raise LedgerError(f"{self.path} is closed: read it with protocol.ledger.read_rows")
            try:
                return int(self._db.execute("SELECT COALESCE(MAX(id), 0) FROM messages").fetchone()[0])
            except sqlite3.Error as exc:
                raise LedgerError(f"cannot read {self.path}: {exc}") from exc

    def rows(self, where: str = "", params: tuple = ()) -> list[LedgerRow]:
        """Rows matching an optional SQL ``where`` clause (without the keyword), in insertion order.

        Raises:
            LedgerError: the ledger is closed (read the file with :func:`read_rows`).
        """
        self.flush()
        sql = f"SELECT {', '.join(_COLUMNS)} FROM messages" + (f" WHERE {where}" if where else "") + " ORDER BY id"
        with self._lock:
            if self._db is None:
                raise LedgerError(f"{self.path} is closed: read it with protocol.ledger.read_rows")
            cur = self._db.execute(sql, params)
            retained = _COLUMNS.index("retained")
            return [LedgerRow(**{**dict(zip(_COLUMNS, r, strict=True)), "retained": bool(r[retained])})
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


def read_meta(path: str | os.PathLike) -> dict[str, str]:
    """The ``meta`` table of a ledger file as a dict (read-only; a file a writer still has open, or
    one left behind by a killed writer with its ``-wal`` file, reads with every committed row).

    Raises:
        LedgerError: the file is missing or not a fedfleet ledger.
    """
    p = Path(path)
    if not p.is_file():
        raise LedgerError(f"no ledger at {p}")
    try:
        db = sqlite3.connect(f"{p.resolve().as_uri()}?mode=ro", uri=True)
        try:
            return {str(k): str(v) for k, v in db.execute("SELECT key, value FROM meta")}
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise LedgerError(f"{p} is not a readable fedfleet ledger: {exc}") from exc


def _pid_alive(writer_key: str) -> bool:
    """Whether the process of a ``meta`` writer key (``writer:<pid>:<token>``) still runs here."""
    try:
        pid = int(writer_key.split(":")[1])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def ledger_closed_cleanly(path: str | os.PathLike) -> bool | None:
    """Whether the last writer of the ledger at ``path`` closed it (:meth:`Ledger.close`).

    Returns:
        ``True`` after a clean close (also after SIGTERM/SIGINT, which :mod:`protocol.lifecycle`
        turns into one: see ``meta.stop_signal``); ``False`` while a writer has it open or when the
        writer ended without closing it (killed, crashed: rows of its last second may be missing);
        ``None`` for a ledger written before fedfleet recorded closes (no ``closed_cleanly`` key).

    Raises:
        LedgerError: the file is missing or not a fedfleet ledger.
    """
    flag = read_meta(path).get("closed_cleanly")
    return None if flag is None else flag == "1"
