"""What a device keeps between rounds, kept on disk (SQLite), so that a device that restarts
carries on where the server's checkpoint is instead of from its initial values.

A device of SCAFFOLD keeps its control variate c_i, of FedDyn its gradient state ∇L_k, of MOON
its previous local model, of FedProto, FedPer, FedOCP or FedMCP++ the model entries it never
sends (:func:`edge_agent.algorithms.restarted_device_state` lists them per algorithm), and a
device of any algorithm under ``[protocol] error_feedback`` the residuals its lossy update codec
held back (entries ``ef.<tensor index>``, :class:`edge_agent.agent.EdgeAgent`). Lost on a
restart, SCAFFOLD's and FedDyn's invariants (the server's c = mean c_i, h = mean ∇L_k) break
without a word, and a personalised model starts over.

One row per (device, round): the state after the local round whose update the device sent,
written *unsettled* when the update goes out and *settled* when the server's receipt accepts it
(dropped when it refuses it, :meth:`edge_agent.agent.EdgeAgent._settle`), and a settled row for
round 0, the initial state. A restarted device loads its newest settled row. An unsettled row is
an update whose answer the device never read (it stopped between sending it and reading the
receipt): when the server's next round is a later one, the server finished that round, and the
device takes the row as accepted, saying so (the server counts an update it acknowledged; a
refused one would be counted wrongly, which the warning names); when the server runs that round
or an earlier one again (it was resumed from a checkpoint taken before the round was
aggregated), the row is dropped and the device goes back to its newest settled row of an earlier
round, so its state is again the one the server's checkpoint counted. The newest :data:`KEEP`
settled rows per device are kept, the round-0 row (the initial state: where a device goes back
to when a new run under the same federation id starts at round 1), and one unsettled row.

Arrays are written with :func:`numpy.save` (no pickle) in one blob per row and read back with
``allow_pickle=False``: a state file from elsewhere cannot run code here.
"""

from __future__ import annotations

import io
import sqlite3
import threading
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .errors import EdgeAgentError

__all__ = ["KEEP", "DeviceStateStore", "StateStoreError"]

#: settled rows kept per device (the newest ones): a server writes its checkpoint of round k
#: before it starts round k + 1, so a device's newest accepted round is at most one past the
#: checkpoint a server resumes from, and going back needs only the row before it
KEEP = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS device_state (
    client_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    arrays BLOB NOT NULL,
    settled INTEGER NOT NULL,
    PRIMARY KEY (client_id, round)
);
"""


class StateStoreError(EdgeAgentError):
    """The state file cannot be opened, or a row cannot be read back (names the file, the device
    and the round)."""


def _pack(arrays: Mapping[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    named: dict[str, Any] = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    np.savez(buf, allow_pickle=False, **named)
    return buf.getvalue()


def _unpack(blob: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


class DeviceStateStore:
    """The devices' committed state per round, in the SQLite file ``path`` (created when absent;
    one file may serve a whole simulated fleet: every method is thread-safe).

    Args:
        path: the SQLite file.

    Raises:
        StateStoreError: the file cannot be opened as SQLite.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except (sqlite3.Error, OSError) as exc:
            raise StateStoreError(f"device state file {self.path}: cannot be opened ({exc})") from None
        # a write tried now and rolled back (the rows stay as they are): a file that cannot be written
        # is said at start, not at the first round's update
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    self._db.execute("INSERT OR REPLACE INTO device_state VALUES ('', -1, x'', 1)")
                finally:
                    self._db.execute("ROLLBACK")
            except sqlite3.Error as exc:
                self._db.close()
                raise StateStoreError(f"device state file {self.path}: cannot be written ({exc})") from None

    def _write(self, *statements: tuple[str, tuple]) -> None:
        """Run ``statements`` as one transaction (a killed process leaves all or none).

        Raises:
            StateStoreError: SQLite refused the write (a read-only file or folder, a full disk,
                a file locked by another process for longer than its timeout).
        """
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    for sql, args in statements:
                        self._db.execute(sql, args)
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise StateStoreError(f"device state file {self.path}: cannot be written ({exc})") from None

    def _prune(self, client_id: str) -> tuple[str, tuple]:
        """Drop the settled rows but round 0's and the newest :data:`KEEP`."""
        return ("DELETE FROM device_state WHERE client_id = ? AND settled = 1 AND round > 0 AND round NOT IN "
                "(SELECT round FROM device_state WHERE client_id = ? AND settled = 1 ORDER BY round DESC LIMIT ?)",
                (client_id, client_id, KEEP))

    def put(self, client_id: str, round: int, arrays: Mapping[str, np.ndarray], *, settled: bool = True) -> None:
        """Keep ``arrays`` (name → array, any dtype but object) as ``client_id``'s state after
        ``round`` (≥ 0), replacing a row of that round: ``settled`` (the server accepted that
        round's update, or round 0), keeping the newest :data:`KEEP` settled rows, or not yet
        (the update was sent), replacing any other unsettled row.

        Raises:
            ValueError: ``round`` < 0, or an array of dtype object.
        """
        if round < 0:
            raise ValueError(f"round must be >= 0, got {round}")
        bad = [k for k, v in arrays.items() if np.asarray(v).dtype == object]
        if bad:
            raise ValueError(f"device state {bad[0]!r} is an object array: only numeric arrays are kept")
        blob = _pack(arrays)
        self._write(("DELETE FROM device_state WHERE client_id = ? AND settled = 0", (client_id,)),
                    ("INSERT OR REPLACE INTO device_state VALUES (?, ?, ?, ?)",
                     (client_id, int(round), blob, int(settled))),
                    self._prune(client_id))

    def settle(self, client_id: str, round: int, accepted: bool) -> None:
        """The server's answer to the update of ``round``: its unsettled row becomes settled
        (``accepted``) or is dropped; nothing when there is no such row."""
        if accepted:
            self._write(("UPDATE device_state SET settled = 1 WHERE client_id = ? AND round = ? AND settled = 0",
                         (client_id, int(round))), self._prune(client_id))
        else:
            self._write(("DELETE FROM device_state WHERE client_id = ? AND round = ? AND settled = 0",
                         (client_id, int(round))))

    def forget_from(self, client_id: str, round: int) -> None:
        """Drop ``client_id``'s rows of ``round`` and later, settled or not (a server resumed
        from an earlier checkpoint runs those rounds again: that state is no longer the one it
        counts)."""
        self._write(("DELETE FROM device_state WHERE client_id = ? AND round >= ?", (client_id, int(round))))

    def rounds(self, client_id: str) -> list[int]:
        """The settled rounds kept for ``client_id``, oldest first (``[]``: none)."""
        rows = self._read("SELECT round FROM device_state WHERE client_id = ? AND settled = 1 ORDER BY round",
                          (client_id,), all_rows=True)
        return [int(r[0]) for r in rows]

    def _read(self, sql: str, args: tuple, *, all_rows: bool = False):
        """One query's first row (``all_rows``: every row).

        Raises:
            StateStoreError: SQLite could not read the file (damaged, not a database).
        """
        with self._lock:
            try:
                cur = self._db.execute(sql, args)
                return cur.fetchall() if all_rows else cur.fetchone()
            except sqlite3.Error as exc:
                raise StateStoreError(f"device state file {self.path}: cannot be read ({exc})") from None

    def unsettled(self, client_id: str) -> int | None:
        """The round of ``client_id``'s unsettled row, if it is newer than every settled one
        (an update sent whose answer was never read); else ``None``."""
        row = self._read("SELECT MAX(round) FROM device_state WHERE client_id = ? AND settled = 0 AND round > "
                         "(SELECT COALESCE(MAX(round), -1) FROM device_state WHERE client_id = ? AND settled = 1)",
                         (client_id, client_id))
        return None if row is None or row[0] is None else int(row[0])

    def newest(self, client_id: str, before: int | None = None, *,
               settled: bool = True) -> tuple[int, dict[str, np.ndarray]] | None:
        """``client_id``'s newest settled row (with ``before``: of a round < ``before``;
        ``settled=False``: its unsettled row instead) as (round, arrays); ``None`` when there is
        none.

        Raises:
            StateStoreError: the row's blob is not what :meth:`put` writes.
        """
        sql = "SELECT round, arrays FROM device_state WHERE client_id = ? AND settled = ?"
        args: tuple = (client_id, int(settled))
        if before is not None:
            sql += " AND round < ?"
            args += (int(before),)
        row = self._read(sql + " ORDER BY round DESC LIMIT 1", args)
        if row is None:
            return None
        try:
            return int(row[0]), _unpack(row[1])
        except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
            why = ("it holds a pickled object, which is never loaded (the file keeps numeric arrays only)"
                   if "allow_pickle" in str(exc) else f"{type(exc).__name__}: {exc}")
            raise StateStoreError(f"device state file {self.path}: {client_id}'s state of round {row[0]} cannot be "
                                  f"read ({why})") from None

    def clear(self) -> None:
        """Drop every row (a fresh run into the file of an earlier one)."""
        self._write(("DELETE FROM device_state", ()))

    def close(self) -> None:
        """Close the file (a second close is a no-op)."""
        with self._lock:
            self._db.close()
