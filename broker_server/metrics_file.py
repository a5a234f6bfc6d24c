"""``metrics.jsonl``, the run folder's one JSON line per completed round: reading it back.

The server appends a line per round (:meth:`broker_server.persistence.RunStore.append_metrics`);
``--resume``, the end-of-run files and the audit read the lines with :func:`read_metrics`, which
forgives what a killed process leaves (a last line cut short) and nothing else. Reading needs no
torch (the audit imports it).

Each line is strict JSON (:func:`metrics_line`, :func:`strict_json`): JSON has no NaN or
infinity, so a non-finite number (a diverged model's test loss) is written as ``null`` and named
in the line's ``non_finite`` table (JSON Pointer, RFC 6901, → ``"nan"``, ``"inf"`` or ``"-inf"``),
which :func:`read_metrics` turns back into the float. Files written before this (a bare ``NaN``
token) still read. ``summary.json`` is written the same way.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"


#: the key of a metrics line naming its non-finite numbers (:func:`metrics_line`)
NON_FINITE_KEY = "non_finite"


def _pointer_part(key: str | int) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _finite_copy(value: Any, pointer: str, found: dict[str, str]) -> Any:
    """``value`` with every non-finite float replaced by ``None``, each recorded in ``found``
    (JSON Pointer → ``"nan"``/``"inf"``/``"-inf"``)."""
    if isinstance(value, float) and not math.isfinite(value):
        found[pointer] = "nan" if value != value else ("inf" if value > 0 else "-inf")
        return None
    if isinstance(value, dict):
        return {k: _finite_copy(v, f"{pointer}/{_pointer_part(k)}", found) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_copy(v, f"{pointer}/{i}", found) for i, v in enumerate(value)]
    return value


def strict_json(record: dict[str, Any], indent: int | None = None) -> str:
    """``record`` as strict JSON text (RFC 8259), which jq, JavaScript and any other JSON reader
    take: a non-finite float anywhere in it (e.g. ``loss`` NaN: the global model diverged) is
    written as ``null`` and named under :data:`NON_FINITE_KEY`: ``{"loss": null, ...,
    "non_finite": {"/loss": "nan"}}`` (JSON Pointer, RFC 6901, → ``"nan"``, ``"inf"`` or
    ``"-inf"``). :func:`restore_non_finite` gives the floats back. Used for ``metrics.jsonl``
    (:func:`metrics_line`) and ``summary.json``.

    Raises:
        ValueError: ``record`` already has a :data:`NON_FINITE_KEY` key (reserved) while holding
            a non-finite number.
        TypeError: a value JSON cannot hold (an object, bytes).
    """
    found: dict[str, str] = {}
    clean = _finite_copy(record, "", found)
    if found:
        if NON_FINITE_KEY in record:
            raise ValueError(f"a record may not have its own {NON_FINITE_KEY!r} key: {record[NON_FINITE_KEY]!r}")
        clean[NON_FINITE_KEY] = found
    return json.dumps(clean, allow_nan=False, indent=indent)


def metrics_line(metrics: dict[str, Any]) -> str:
    """One ``metrics.jsonl`` line (with its newline) for a round's ``metrics``:
    :func:`strict_json`; :func:`read_metrics` of the line returns ``metrics`` (tuples as lists).

    Raises:
        ValueError, TypeError: as :func:`strict_json`.
    """
    return strict_json(metrics) + "\n"


#: a ``~`` that is not RFC 6901's ``~0`` or ``~1``
_BAD_ESCAPE = re.compile(r"~(?![01])")
#: an array index as RFC 6901 spells it: no sign, no leading zero
_INDEX = re.compile(r"0|[1-9][0-9]*")


def _index(token: str) -> int:
    """An RFC 6901 array index; ``ValueError`` for ``-1``, ``00``, ``-`` and other tokens."""
    if not _INDEX.fullmatch(token):
        raise ValueError(token)
    return int(token)


def restore_non_finite(record: dict[str, Any]) -> str | None:
    """Put the floats named in ``record``'s :data:`NON_FINITE_KEY` table (:func:`strict_json`)
    back, in place, and drop the table. Returns the problem as text when the table is malformed
    (not a table, a pointer to nothing or to a value that is not ``null``, a word other than
    ``"nan"``, ``"inf"``, ``"-inf"``), else ``None``; a record without the table is left as it
    is."""
    table = record.pop(NON_FINITE_KEY, None)
    if table is None:
        return None
    if not isinstance(table, dict):
        return f"{NON_FINITE_KEY!r} is not a table of JSON Pointers"
    for pointer, text in table.items():
        number = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(text) if isinstance(text, str) else None
        raw = str(pointer).split("/")[1:]
        parts = [p.replace("~1", "/").replace("~0", "~") for p in raw]
        if (number is None or not str(pointer).startswith("/") or not parts
                or any(_BAD_ESCAPE.search(p) for p in raw)):
            return f"{NON_FINITE_KEY!r} holds {pointer!r}: {text!r}, not a JSON Pointer to 'nan', 'inf' or '-inf'"
        node: Any = record
        try:
            for part in parts[:-1]:
                node = node[_index(part)] if isinstance(node, list) else node[part]
            last: Any = _index(parts[-1]) if isinstance(node, list) else parts[-1]
            if node[last] is not None:
                return f"{NON_FINITE_KEY!r} names {pointer!r}, which is not null"
            node[last] = number
        except (KeyError, IndexError, ValueError, TypeError):
            return f"{NON_FINITE_KEY!r} names {pointer!r}, which the line does not have"
    return None


#: (path, line number, line) of cut-short last lines already warned about: one warning each,
#: though ``--resume`` reads the file more than once
_WARNED: set[tuple[str, int, bytes]] = set()

#: what a damaged line's error tells the user to do
_WHAT_TO_DO = "repair or delete that line (its round's figures are lost with it), then run again"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a ``metrics.jsonl``, parsed, in file order (blank lines skipped).

    A last line cut short is dropped with a warning (once per process): the process was killed
    in the middle of appending it, or the disk filled. Cut short means the file does not end
    with a newline (each line is appended with its newline in one write) or the line is NUL bytes
    only (a file system's zero-filled tail after a crash), and the line is not a JSON object
    with an integer ``round``. A resume writes that round's line again: from the round's
    checkpoint where it holds the line (evaluation overlap), or by running the round again (its
    checkpoint follows its line otherwise).

    Raises:
        FileNotFoundError: no file at ``path``.
        OSError: the file cannot be read (a folder, no permission).
        ValueError: any other line is not UTF-8 text holding a JSON object with an integer
            ``round`` (the file was edited or damaged); the message is ``PATH:LINE: what is
            wrong; what to do``.
    """
    data = Path(path).read_bytes()
    lines = [(i, raw) for i, raw in enumerate(data.split(b"\n"), 1) if raw.strip()]
    out: list[dict[str, Any]] = []
    for n, (lineno, raw) in enumerate(lines, 1):
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            problem = f"not UTF-8 text (byte {exc.start + 1} of the line)"
        except json.JSONDecodeError as exc:
            problem = f"not valid JSON ({exc.msg})"
        except RecursionError:
            problem = "not a metrics line (JSON nested too deeply)"
        else:
            if not isinstance(record, dict):
                problem = f"expected a JSON object per round, got {type(record).__name__}"
            elif not isinstance(record.get("round"), int) or isinstance(record["round"], bool):
                problem = f"expected an integer 'round', got {record.get('round')!r}"
            elif (bad := restore_non_finite(record)) is not None:
                problem = bad
            else:
                out.append(record)
                continue
        cut_short = n == len(lines) and (not data.endswith(b"\n") or not raw.strip(b"\0\r\n\t "))
        if not cut_short:
            raise ValueError(f"{path}:{lineno}: {problem}; {_WHAT_TO_DO}")
        if (key := (str(path), lineno, raw)) not in _WARNED:
            _WARNED.add(key)
            log.warning("%s:%d: the last line is cut short (%s): dropped, as a line a killed process left "
                        "half-written (--resume writes that round's line again)", path, lineno, problem)
    return out


def missing_line(lines: list[dict[str, Any]], round: int, meta: dict[str, Any]) -> bool:
    """Whether a resume from the checkpoint of ``round`` (its ``meta``) finds no line of that
    round in ``lines`` (:func:`read_metrics`) and none in the checkpoint to write again: a round's
    line is written before its checkpoint, or kept in it as ``pending_line`` under evaluation
    overlap, so only an edited or replaced file lacks it. Round 0 (the start) has no line."""
    return round > 0 and not isinstance(meta.get("pending_line"), dict) and not any(m["round"] == round for m in lines)


def missing_line_text(path: str | Path, round: int) -> str:
    """Why a resume is refused when :func:`missing_line` holds (the caller adds its prefix)."""
    return (f"{path} has no line for round {round}, and its checkpoint holds none to write again (the line, written "
            "before that checkpoint, was removed or the file replaced): restore the file, or that round's figures are "
            "lost")


def rounds_without_line(lines: list[dict[str, Any]], round: int) -> list[int]:
    """Rounds 1 .. ``round`` − 1 that have no line in ``lines``: each completed round's line is
    written before the next round's checkpoint, so a resume from the checkpoint of ``round``
    finds them all unless the file was edited (a damaged line deleted) or replaced; their
    figures are lost, which a resume says (it goes on: the rounds' models are in the
    checkpoints)."""
    have = {m["round"] for m in lines}
    return [r for r in range(1, round) if r not in have]
