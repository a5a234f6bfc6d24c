"""Per-round checkpoints in SQLite (``RUN_DIR/checkpoints.sqlite``).

One row per completed round: the global model tensors (msgpack, the wire's tensor encoding),
the strategy's state, the server RNG state and the client registry, as one transaction, so a
killed server finds either the whole round or none of it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from protocol.tensors import TensorLimits, decode_tensor, encode_tensor

from .errors import FedfleetServerError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    round INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    tensors BLOB NOT NULL,
    strategy_state BLOB NOT NULL,
    rng_state TEXT NOT NULL,
    registry TEXT NOT NULL,
    meta TEXT NOT NULL
);
"""


class CheckpointError(FedfleetServerError):
    """A checkpoint could not be written or read back."""


@dataclass(frozen=True)
class Checkpoint:
    """The server state after ``round`` (0 = the initial model).

    Attributes:
        round: last completed round.
        tensors: global model arrays in manifest order.
        strategy_state: the strategy's ``state_dict()`` (msgpack-able values and arrays).
        rng_state: ``numpy.random.Generator.bit_generator.state`` of the server's selection RNG.
        registry: per-client records (JSON-able dicts).
        meta: free JSON-able values (accuracy, manifest hash …).
    """

    round: int
    tensors: list[np.ndarray]
    strategy_state: dict[str, Any]
    rng_state: dict[str, Any]
    registry: list[dict[str, Any]]
    meta: dict[str, Any]


def pack_state(value: Any) -> Any:
    """``value`` (a strategy's ``state_dict()``: dicts, lists, scalars, bytes, numpy arrays) in
    msgpack-able form: each array as the wire's tensor encoding, dict keys as strings, tuples as
    lists. :func:`unpack_state` gives it back."""
    if isinstance(value, np.ndarray):
        return {"__tensor__": encode_tensor(value)}
    if isinstance(value, dict):
        return {str(k): pack_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [pack_state(v) for v in value]
    return value


def unpack_state(value: Any) -> Any:
    """:func:`pack_state`'s ``value`` back (arrays as numpy arrays, non-finite values kept)."""
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return np.array(decode_tensor(value["__tensor__"], limits=TensorLimits(allow_nonfinite=True)))
        return {k: unpack_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unpack_state(v) for v in value]
    return value


class CheckpointStore:
    """Read and write the checkpoints of one run.

    Raises:
        CheckpointError: SQLite errors, converted once here.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise CheckpointError(f"cannot open checkpoint store {self.path}: {exc}") from exc

    def save(self, ckpt: Checkpoint) -> None:
        """Write (or replace) the checkpoint of ``ckpt.round`` in one transaction."""
        tensors = msgpack.packb([encode_tensor(t) for t in ckpt.tensors], use_bin_type=True)
        state = msgpack.packb(pack_state(ckpt.strategy_state), use_bin_type=True)
        try:
            with self._db:
                self._db.execute(
                    "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (ckpt.round, time.time(), tensors, state, json.dumps(ckpt.rng_state),
                     json.dumps(ckpt.registry), json.dumps(ckpt.meta)))
        except sqlite3.Error as exc:
            raise CheckpointError(f"cannot write checkpoint of round {ckpt.round}: {exc}") from exc

    def rounds(self) -> list[int]:
        """Rounds that have a checkpoint, ascending."""
        return [r for (r,) in self._db.execute("SELECT round FROM checkpoints ORDER BY round")]

    def load(self, round: int | None = None) -> Checkpoint | None:
        """The checkpoint of ``round`` (the latest when ``None``), or ``None`` when there is none."""
        sql = "SELECT * FROM checkpoints " + ("WHERE round = ?" if round is not None else "ORDER BY round DESC LIMIT 1")
        try:
            row = self._db.execute(sql, (round,) if round is not None else ()).fetchone()
        except sqlite3.Error as exc:
            raise CheckpointError(f"cannot read {self.path}: {exc}") from exc
        if row is None:
            return None
        rnd, _ts, tensors, state, rng, registry, meta = row
        arrays = [np.array(decode_tensor(t, limits=TensorLimits(allow_nonfinite=True)))
                  for t in msgpack.unpackb(tensors, raw=False)]
        return Checkpoint(round=rnd, tensors=arrays, strategy_state=unpack_state(msgpack.unpackb(state, raw=False)),
                          rng_state=json.loads(rng), registry=json.loads(registry), meta=json.loads(meta))

    @staticmethod
    def _read_only(path: str | os.PathLike, sql: str) -> tuple | None:
        """The first row of ``sql`` on the store at ``path``, read without writing to it (a store
        a killed server left in WAL mode, which a read-only connection cannot read, is opened as
        a store; SQLite may add its ``-shm`` and ``-wal`` files beside a WAL-mode store even
        then); ``None``: no file, or an empty one.

        Raises:
            CheckpointError: the file is not a readable checkpoint store.
        """
        p = Path(path)
        if not p.is_file() or p.stat().st_size == 0:  # an empty file is no store: not made into one here
            return None
        try:
            db = sqlite3.connect(f"{p.resolve().as_uri()}?mode=ro", uri=True)
            try:
                return db.execute(sql).fetchone()
            finally:
                db.close()
        except sqlite3.Error:
            pass
        try:
            store = CheckpointStore(p)
            try:
                return store._db.execute(sql).fetchone()
            finally:
                store.close()
        except (CheckpointError, sqlite3.Error) as exc:
            raise CheckpointError(f"cannot read the checkpoints in {p}: {exc}") from None

    @staticmethod
    def latest_round(path: str | os.PathLike) -> int | None:
        """The latest round with a checkpoint in the store at ``path``, read without writing to
        it (:meth:`_read_only`); ``None``: no file, or no checkpoint.

        Raises:
            CheckpointError: the file is not a readable checkpoint store.
        """
        row = CheckpointStore._read_only(path, "SELECT MAX(round) FROM checkpoints")
        return None if row is None or row[0] is None else int(row[0])

    @staticmethod
    def latest_meta(path: str | os.PathLike) -> tuple[int, dict] | None:
        """(round, ``meta``) of the latest checkpoint in the store at ``path``, read without
        writing to it and without its tensors (:meth:`_read_only`); ``None``: no file, or no
        checkpoint.

        Raises:
            CheckpointError: the file is not a readable checkpoint store, or the meta is not JSON.
        """
        row = CheckpointStore._read_only(path, "SELECT round, meta FROM checkpoints ORDER BY round DESC LIMIT 1")
        if row is None:
            return None
        try:
            return int(row[0]), json.loads(row[1])
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"cannot read the checkpoint of round {row[0]} in {path}: {exc}") from None

    def close(self) -> None:
        """Close the database (idempotent)."""
        if self._db is not None:
            try:  # leave a single self-contained file behind (no -wal/-shm)
                self._db.execute("PRAGMA journal_mode=DELETE")
            except sqlite3.Error:
                pass
            self._db.close()
            self._db = None  # type: ignore[assignment]
