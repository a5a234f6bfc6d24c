"""Each ``--resume`` of a run, noted in its byte ledger (``meta`` key ``resumes``), so that the
audit can say which bytes a resume added (:func:`broker_server.audit.resume_bytes`).

A killed or interrupted run keeps in ``ledger.sqlite`` every row its first session wrote: the
ledger equals what crossed the wire, so they stay. The resumed server goes on from its last
checkpoint, so the rounds after that checkpoint which the first session had begun are run again
(their ``global``, ``round_start``, updates and receipts cross the wire twice), and the devices
connect and join once more. The ledger's rows carry their round but nothing that tells one
session from the other; this module's note does:

``meta.resumes`` = a JSON list, one object per resume in the order they happened::

    {"after_round": R, "after_id": L, "at": T, "registry": N}

``after_round``
    the checkpoint's round the resumed session went on from (0 when the run had none yet, or
    when its checkpoint was round 0's, written once the devices had joined: either way it went
    on with round 1).
``after_id``
    the id of the newest ledger row when the resumed session opened the ledger (0: none). Rows
    of that session and later have larger ids (:meth:`protocol.ledger.Ledger.last_row_id`).
``at``
    Unix seconds at which it was noted.
``registry``
    the number of devices in the registry of the checkpoint the resumed session took back (0: it
    took none back, so every device had to join it again). After round 0 this is what tells the
    two resumes apart: with no checkpoint the resumed session is a whole run again from its
    joins; from round 0's checkpoint it knows the devices that had joined, which come back (their
    ``online`` status) as after any later round. Absent in notes written before it was noted:
    the audit then reads it from the resumed session's rows (:func:`broker_server.audit.resume_bytes`).
``refused``
    (only when true) the resume was refused once noted (the checkpoint did not fit the
    configuration: :func:`refused_if_raises`): its session only connected, and the session before
    it goes on to the next resume.
``earlier_unknown``
    (only when true; only on the first) the ledger noted no resumes, or its note could not be
    read, when this resume was noted, and it held rows: they may be several sessions, which
    cannot be told apart (:func:`note_resume`).

A run started afresh writes ``[]``: "never resumed", as distinct from a ledger written before
resumes were noted, which has no ``resumes`` key at all (its resumes, if any, cannot be told
apart in its rows), and from a key whose value cannot be used (unreadable, or numbers no run
could have noted): see :func:`read_resumes`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from protocol.errors import LedgerError
from protocol.ledger import Ledger, read_meta

log = logging.getLogger(__name__)

#: The ``meta`` key of the ledger that lists the resumes of its run.
RESUMES_META = "resumes"


def note_fresh_run(ledger: Ledger) -> None:
    """Note in ``ledger`` that its run started afresh (``resumes`` = ``[]``).

    Raises:
        LedgerError: the ledger is closed or cannot be written.
    """
    ledger.set_meta(RESUMES_META, "[]")


def note_resume(ledger: Ledger, *, after_round: int, after_id: int,
                registry: int | None = None) -> list[dict[str, Any]]:
    """Append one resume to ``ledger``'s ``resumes`` (see the module docstring) and return the list.

    Args:
        ledger: the run's ledger, open.
        after_round: the checkpoint's round the session goes on from (0 without a checkpoint).
        after_id: :meth:`~protocol.ledger.Ledger.last_row_id` as the session opened the ledger,
            before it recorded anything.
        registry: the number of devices in the registry of the checkpoint it goes on from (0
            without a checkpoint); None: not noted.

    When the ledger notes no resumes (written before resumes were noted) or its note cannot be
    used (:func:`read_resumes`) and it already holds rows, the list starts again with this resume,
    marked ``"earlier_unknown": true``: the rows before it may hold earlier sessions that cannot
    be told apart (the audit says so instead of what the run would have sent without them).

    Raises:
        LedgerError: the ledger is closed or cannot be written.
    """
    note = read_resumes(read_meta(ledger.path))
    marks = list(note.marks) if note.state == "noted" and note.marks is not None else []
    mark: dict[str, Any] = {"after_round": int(after_round), "after_id": int(after_id), "at": round(time.time(), 3)}
    if registry is not None:
        mark["registry"] = int(registry)
    if note.state != "noted" and after_id > 0:
        mark["earlier_unknown"] = True
    marks.append(mark)
    ledger.set_meta(RESUMES_META, json.dumps(marks))
    return marks


def mark_refused(ledger: Ledger, *, after_id: int) -> bool:
    """Mark the newest resume of ``ledger``'s note, the one noted at ``after_id``, as refused
    (``"refused": true``); False when there is no such note (nothing is written then).

    Raises:
        LedgerError: the ledger is closed or cannot be written.
    """
    note = read_resumes(read_meta(ledger.path))
    if note.state != "noted" or not note.marks or note.marks[-1]["after_id"] != after_id:
        return False
    note.marks[-1]["refused"] = True
    ledger.set_meta(RESUMES_META, json.dumps(note.marks))
    return True


@contextmanager
def refused_if_raises(ledger: Ledger, *, after_id: int) -> Iterator[None]:
    """Around the taking back of the checkpoint by a resume noted at ``after_id``
    (:func:`note_resume`): when the block raises an :class:`Exception` (the resume is refused:
    the checkpoint does not fit the configuration …), the note is marked refused
    (:func:`mark_refused`) and the exception goes on. The note is written before the block, so
    that the refused session's rows (its connections) are told apart from the session before
    it, which the audit does not take for interrupted by a resume that never went on."""
    try:
        yield
    except Exception:
        try:
            mark_refused(ledger, after_id=after_id)
        except LedgerError as exc:  # the refusal is what the caller must see
            log.warning("the resume refused could not be marked so in %s: %s", ledger.path, exc)
        raise


def ledger_resumes(meta: Mapping[str, str]) -> list[dict[str, Any]] | None:
    """The resumes a ledger's ``meta`` notes, in the order they happened (by ``after_id``): the
    ``marks`` of :func:`read_resumes`.

    Returns:
        A list of ``{"after_round": int, "after_id": int, "at": float | None}`` (with
        ``"registry": int`` where noted; ``[]``: the run was never resumed); ``None`` when the
        ledger notes nothing (written before resumes were noted, or not a server's: a device's
        own ledger) or the entry is unreadable or implausible by itself (see
        :func:`read_resumes`).
    """
    return read_resumes(meta).marks


#: The largest integer SQLite stores (a signed 64-bit one): no ``after_round`` or ``after_id`` of a
#: note the queries are given is larger.
MAX_ROW_ID = 2 ** 63 - 1


@dataclass(frozen=True, slots=True)
class ResumesNote:
    """What a ledger's ``meta`` says of its run's resumes (:func:`read_resumes`).

    Attributes:
        state: ``"absent"`` (no ``resumes`` entry: a ledger written before resumes were noted,
            or a device's own), ``"unreadable"`` (not a JSON list of notes with a whole
            ``after_round`` and ``after_id`` each), ``"implausible"`` (numbers no run could have
            noted: negative, beyond SQLite's integers, an entry repeated or out of order) or
            ``"noted"``.
        marks: when ``"noted"``, one dict per resume in ``after_id`` order (``[]``: never
            resumed), else None.
        why: what is wrong with the entry (``"unreadable"``, ``"implausible"``), else None.
    """

    state: str
    marks: list[dict[str, Any]] | None = None
    why: str | None = None


def _shown(value: Any) -> str:
    """A note's value as JSON writes it (``1e+30``, ``Infinity``, ``"x"``), cut to 40 characters."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


class _Bad(ValueError):
    """One entry is wrong: ``state`` ``"unreadable"`` or ``"implausible"``, the message says why."""

    def __init__(self, state: str, why: str) -> None:
        super().__init__(why)
        self.state = state


def _whole(entry: Mapping[str, Any], key: str, n: int) -> int:
    """``entry[key]`` as a whole number from 0 to :data:`MAX_ROW_ID` (an int, or a float with no
    fraction, as JSON may write one); ``n`` numbers the entry in the message.

    Raises:
        _Bad: unreadable (missing, a bool, a string, a fraction, NaN, ±Infinity) or implausible
            (negative, or beyond SQLite's integers).
    """
    if key not in entry:
        raise _Bad("unreadable", f"entry {n} has no {key}")
    value = entry[key]
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer()))):
        raise _Bad("unreadable", f"entry {n}'s {key} is {_shown(value)}, not a whole number")
    whole = int(value)
    if whole < 0:
        raise _Bad("implausible", f"entry {n}'s {key} is negative ({_shown(value)})")
    if whole > MAX_ROW_ID:
        raise _Bad("implausible", f"entry {n}'s {key} {_shown(value)} is beyond SQLite's integers")
    return whole


def _mark(entry: Any, n: int) -> dict[str, Any]:
    """One entry of the note as ``{"after_round", "after_id", "at"}`` (``at`` None when it is not
    a finite number: the attribution does not use it, so a bad one costs nothing else), with
    ``registry`` where the entry has one, and each of :data:`FLAGS` that is true.

    Raises:
        _Bad: see :func:`_whole`; or the entry is not a JSON object.
    """
    if not isinstance(entry, dict):
        raise _Bad("unreadable", f"entry {n} is {_shown(entry)}, not an object")
    at = entry.get("at")
    try:
        seconds = None if isinstance(at, bool) or not isinstance(at, (int, float)) else float(at)
    except OverflowError:  # an int beyond floats
        seconds = None
    mark = {"after_round": _whole(entry, "after_round", n), "after_id": _whole(entry, "after_id", n),
            "at": seconds if seconds is not None and math.isfinite(seconds) else None}
    if "registry" in entry:
        mark["registry"] = _whole(entry, "registry", n)
    for flag in FLAGS:
        value = entry.get(flag, False)
        if not isinstance(value, bool):
            raise _Bad("unreadable", f"entry {n}'s {flag} is {_shown(value)}, not true or false")
        if value:
            mark[flag] = True
    return mark


#: The flags a note may carry, each only when true (see the module docstring).
FLAGS = ("earlier_unknown", "refused")


def _json_kind(value: Any) -> str:
    """``"a JSON object"``, ``"JSON null"`` …: what a note that is not a list is."""
    if value is None:
        return "JSON null"
    kinds = ((bool, "a JSON boolean"), (dict, "a JSON object"), (str, "a JSON string"), ((int, float), "a JSON number"))
    return next((name for t, name in kinds if isinstance(value, t)), "not a list")


def read_resumes(meta: Mapping[str, str]) -> ResumesNote:
    """What a ledger's ``meta`` (key → value, as :func:`protocol.ledger.read_meta` gives it) says
    of its run's resumes: absent, unreadable, implausible by itself, or the notes (see
    :class:`ResumesNote`). Whether the notes fit the ledger's rows is :func:`implausible_resumes`.
    Never raises for what the entry holds (a hand-edited file may hold anything)."""
    raw = meta.get(RESUMES_META)
    if raw is None:
        return ResumesNote("absent")
    try:
        items = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return ResumesNote("unreadable", why=f"not JSON: {exc}" if isinstance(exc, ValueError) else "not JSON")
    if not isinstance(items, list):
        return ResumesNote("unreadable", why=f"{_json_kind(items)}, not a list")
    try:
        marks = [_mark(m, n) for n, m in enumerate(items, start=1)]
    except _Bad as exc:
        return ResumesNote(exc.state, why=str(exc))
    seen: dict[int, tuple[int, dict[str, Any]]] = {}
    for n, m in enumerate(marks, start=1):
        if n > 1 and m["after_id"] < marks[n - 2]["after_id"]:
            return ResumesNote("implausible", why=f"entry {n}'s after_id {m['after_id']} is before entry {n - 1}'s "
                                                  f"({marks[n - 2]['after_id']}): resumes are noted in the order they "
                                                  "happened")
        if (first := seen.get(m["after_id"])) is not None:
            i, other = first
            if other == m:
                return ResumesNote("implausible", why=f"entry {n} repeats entry {i}")
            if other["after_round"] != m["after_round"]:
                return ResumesNote("implausible", why=f"entries {i} and {n} begin after the same row (after_id "
                                                      f"{m['after_id']}) from different rounds")
        seen.setdefault(m["after_id"], (n, m))
        if n > 1 and m.get("earlier_unknown"):
            return ResumesNote("implausible", why=f"entry {n} says the resumes before it were not noted, but entry "
                                                  f"{n - 1} is one")
    return ResumesNote("noted", marks=sorted(marks, key=lambda m: m["after_id"]))


def implausible_resumes(marks: Sequence[Mapping[str, Any]], *, last_id: int, last_round: int | None) -> str | None:
    """Why ``marks`` (:func:`read_resumes`) cannot be the resumes of a ledger whose newest row has
    id ``last_id`` and whose last training round is ``last_round`` (None: it has none), or None
    when they can: a resume goes on from a round the run reached, after a row it holds."""
    for n, m in enumerate(marks, start=1):
        if m["after_round"] > (last_round or 0):
            return (f"entry {n}'s after_round {m['after_round']} is beyond the run's last round in the ledger "
                    f"({last_round})" if last_round else
                    f"entry {n}'s after_round is {m['after_round']}, and the ledger holds no training round")
        if m["after_id"] > last_id:
            return f"entry {n}'s after_id {m['after_id']} is beyond the ledger's last row (id {last_id})"
    return None
