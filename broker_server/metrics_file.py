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


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a ``metrics.jsonl``, parsed, in file order (blank lines skipped).

    A last line that is not a JSON object with an integer ``round`` is dropped with a warning:
    the process was killed in the middle of appending it (or the disk filled). A resume writes
    that round's line again: from the round's checkpoint where it holds the line (evaluation
    overlap), or by running the round again (its checkpoint follows its line otherwise).

    Raises:
        FileNotFoundError: no file at ``path``.
        OSError, UnicodeDecodeError: the file cannot be read as UTF-8 text.
        ValueError: a line other than the last is not a JSON object with an integer ``round``
            (the file was edited or damaged); the message is ``PATH:LINE: what is wrong``.
    """
    lines = [(i, line) for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1)
             if line.strip()]
    out: list[dict[str, Any]] = []
    for n, (lineno, line) in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            problem = f"not valid JSON ({exc.msg})"
        else:
            if not isinstance(record, dict):
                problem = f"expected a JSON object per round, got {type(record).__name__}"
            elif not isinstance(record.get("round"), int) or isinstance(record["round"], bool):
                problem = f"expected an integer 'round', got {record.get('round')!r}"
            else:
                out.append(record)
                continue
        if n == len(lines):
            log.warning("%s:%d: the last line is cut short or not a round's line (%s): dropped, as a line a killed "
                        "process left half-written (--resume writes that round's line again)", path, lineno, problem)
            break
        raise ValueError(f"{path}:{lineno}: {problem}")
    return out
