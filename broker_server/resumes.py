"""Each ``--resume`` of a run, noted in its byte ledger (``meta`` key ``resumes``), so that the
audit can say which bytes a resume added (:func:`broker_server.audit.resume_bytes`).

A killed or interrupted run keeps in ``ledger.sqlite`` every row its first session wrote: the
ledger equals what crossed the wire, so they stay. The resumed server goes on from its last
checkpoint, so the rounds after that checkpoint which the first session had begun are run again
(their ``global``, ``round_start``, updates and receipts cross the wire twice), and the devices
connect and join once more. The ledger's rows carry their round but nothing that tells one
session from the other; this module's note does:

``meta.resumes`` = a JSON list, one object per resume in the order they happened::

    {"after_round": R, "after_id": L, "at": T}

``after_round``
    the checkpoint's round the resumed session went on from (0 when the run had none yet: it
    started again from round 1).
``after_id``
    the id of the newest ledger row when the resumed session opened the ledger (0: none). Rows
    of that session and later have larger ids (:meth:`protocol.ledger.Ledger.last_row_id`).
``at``
    Unix seconds at which it was noted.

A run started afresh writes ``[]``: "never resumed", as distinct from a ledger written before
resumes were noted, which has no ``resumes`` key at all (its resumes, if any, cannot be told
apart in its rows: see :func:`ledger_resumes`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from typing import Any

from protocol.ledger import Ledger, read_meta

#: The ``meta`` key of the ledger that lists the resumes of its run.
RESUMES_META = "resumes"


def note_fresh_run(ledger: Ledger) -> None:
    """Note in ``ledger`` that its run started afresh (``resumes`` = ``[]``).

    Raises:
        LedgerError: the ledger is closed or cannot be written.
    """
    ledger.set_meta(RESUMES_META, "[]")


def note_resume(ledger: Ledger, *, after_round: int, after_id: int) -> list[dict[str, Any]]:
    """Append one resume to ``ledger``'s ``resumes`` (see the module docstring) and return the list.

    Args:
        ledger: the run's ledger, open.
        after_round: the checkpoint's round the session goes on from (0 without a checkpoint).
        after_id: :meth:`~protocol.ledger.Ledger.last_row_id` as the session opened the ledger,
            before it recorded anything.

    Raises:
        LedgerError: the ledger is closed or cannot be written.
    """
    marks = ledger_resumes(read_meta(ledger.path)) or []
    marks.append({"after_round": int(after_round), "after_id": int(after_id), "at": round(time.time(), 3)})
    ledger.set_meta(RESUMES_META, json.dumps(marks))
    return marks


def ledger_resumes(meta: Mapping[str, str]) -> list[dict[str, Any]] | None:
    """The resumes a ledger's ``meta`` notes, in the order they happened (by ``after_id``).

    Returns:
        A list of ``{"after_round": int, "after_id": int, "at": float | None}`` (``[]``: the run
        was never resumed); ``None`` when the ledger notes nothing (written before resumes were
        noted, or not a server's: a device's own ledger) or the entry is unreadable: not a JSON
        list of objects, or an ``after_round`` or ``after_id`` that is not a whole number from 0
        to :data:`MAX_ROW_ID` (SQLite's largest integer: a note the queries can be given).
    """
    raw = meta.get(RESUMES_META)
    if raw is None:
        return None
    try:
        items = json.loads(raw)
        marks = [{"after_round": _whole(m["after_round"]), "after_id": _whole(m["after_id"]),
                  "at": None if m.get("at") is None else float(m["at"])} for m in items]
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError):
        return None
    return sorted(marks, key=lambda m: m["after_id"])


#: The largest integer SQLite stores (a signed 64-bit one): no ``after_round`` or ``after_id`` of a
#: readable note is larger.
MAX_ROW_ID = 2 ** 63 - 1


def _whole(value: Any) -> int:
    """``value`` as a whole number from 0 to :data:`MAX_ROW_ID` (an int, or a float with no
    fraction, as JSON may write one).

    Raises:
        ValueError: anything else (a bool, a string, a fraction, NaN, ±Infinity, a negative number
            or one SQLite cannot store).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is not a number")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise ValueError(f"{value!r} is not a whole number")
    n = int(value)
    if not 0 <= n <= MAX_ROW_ID:
        raise ValueError(f"{value!r} is out of range")
    return n
