"""What the server writes to its run folder: ``metrics.jsonl`` (one line per round), the per-round
checkpoints (``checkpoints.sqlite``) and the final model, and what ``--resume`` reads back."""

from __future__ import annotations

import io
import json
import logging
import os
import stat
from pathlib import Path

import torch

from protocol.files import write_atomically

from .checkpoint import Checkpoint, CheckpointStore
from .metrics_file import METRICS_NAME, metrics_line, read_metrics, restore_non_finite, strict_json
from .text import round_list

log = logging.getLogger(__name__)


def write_summary(run_dir: Path, record: dict) -> None:
    """``run_dir/summary.json``: ``record`` as indented strict JSON
    (:func:`~broker_server.metrics_file.strict_json`: a NaN ``final_accuracy`` — no accuracy was
    measured — is ``null``, named under ``non_finite``; :func:`read_summary` gives it back), written whole or not at all
    (:func:`protocol.files.write_atomically`: a run killed while writing it keeps the previous
    one, never half of one, which ``--resume`` would read as no summary).

    Raises:
        OSError: the folder cannot be written (full disk, read-only); the previous file is kept.
    """
    write_atomically(Path(run_dir) / "summary.json", strict_json(record, indent=1).encode("utf-8"))


def read_summary(run_dir: Path) -> dict:
    """``run_dir/summary.json`` as :func:`write_summary` wrote it (non-finite numbers given back).

    Raises:
        OSError: no file, or it cannot be read.
        ValueError: not JSON, not a JSON object, or a malformed ``non_finite`` table.
    """
    record = json.loads((Path(run_dir) / "summary.json").read_text(encoding="utf-8"))
    if not isinstance(record, dict):
        raise ValueError(f"{Path(run_dir) / 'summary.json'}: expected a JSON object, got {type(record).__name__}")
    if (bad := restore_non_finite(record)) is not None:
        raise ValueError(f"{Path(run_dir) / 'summary.json'}: {bad}")
    return record


class RunStore:
    """The run folder of one server.

    Args:
        run_dir: an existing folder; ``metrics.jsonl``, ``checkpoints.sqlite`` and
            ``model_final.pt`` go there.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.checkpoints = CheckpointStore(self.run_dir / "checkpoints.sqlite")

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / METRICS_NAME

    def append_metrics(self, metrics: dict) -> None:
        """Append one round's metrics as a strict JSON line (:func:`~broker_server.metrics_file.
        metrics_line`: a NaN loss is ``null``, named under ``non_finite``)."""
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(metrics_line(metrics))

    def keep_metrics_until(self, round: int, lines: list[dict] | None = None) -> list[dict]:
        """Drop ``metrics.jsonl`` lines of rounds after ``round`` (an interrupted round is run
        again after a resume: the rounds dropped are named in an info line of the log) and return
        the lines kept (``[]`` without a file). ``lines``: the file as
        :func:`~broker_server.metrics_file.read_metrics` gave it, when the caller read it already
        (a last line cut short is dropped there). The file is rewritten whole or not at
        all (:func:`protocol.files.write_atomically`), through a symbolic link to its target,
        keeping its permission bits.

        Raises:
            ValueError: a damaged line (:func:`~broker_server.metrics_file.read_metrics`); the
                file is kept as it is.
        """
        path = self.metrics_path
        if not path.exists():
            return []
        lines = read_metrics(path) if lines is None else lines
        kept = [m for m in lines if m["round"] <= round]
        if (dropped := [m["round"] for m in lines if m["round"] > round]):
            one = len(dropped) == 1
            log.info("%s: %s dropped: %s again after the resume", METRICS_NAME,
                     f"round {dropped[0]}'s line" if one else f"the lines of rounds {round_list(dropped)}",
                     "that round runs" if one else "those rounds run")
        target = path.resolve()
        mode = stat.S_IMODE(target.stat().st_mode)
        write_atomically(target, "".join(metrics_line(m) for m in kept).encode("utf-8"))
        os.chmod(target, mode)  # the umask would narrow a mode passed to the write
        return kept

    def save_checkpoint(self, ckpt: Checkpoint) -> None:
        """Write the checkpoint of ``ckpt.round`` (one transaction)."""
        self.checkpoints.save(ckpt)

    def save_final_model(self, model: torch.nn.Module) -> None:
        """``model_final.pt``: the global model's ``state_dict``, written whole or not at all
        (serialised in memory first, then :func:`protocol.files.write_atomically`)."""
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        write_atomically(self.run_dir / "model_final.pt", buf.getvalue())

    def close(self) -> None:
        self.checkpoints.close()
