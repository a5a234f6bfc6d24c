"""``metrics.jsonl``, the run folder's one JSON line per completed round: reading it back.

The server appends a line per round (:meth:`broker_server.persistence.RunStore.append_metrics`);
``--resume``, the end-of-run files and the audit read the lines with :func:`read_metrics`, which
forgives what a killed process leaves (a last line cut short) and nothing else. Reading needs no
torch (the audit imports it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"


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
