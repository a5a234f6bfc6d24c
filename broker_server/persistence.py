"""What the server writes to its run folder: ``metrics.jsonl`` (one line per round), the per-round
checkpoints (``checkpoints.sqlite``) and the final model, and what ``--resume`` reads back."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoint import Checkpoint, CheckpointStore


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
        return self.run_dir / "metrics.jsonl"

    def append_metrics(self, metrics: dict) -> None:
        """Append one round's metrics as a JSON line."""
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")

    def keep_metrics_until(self, round: int) -> list[dict]:
        """Drop ``metrics.jsonl`` lines of rounds after ``round`` (an interrupted round is run
        again after a resume) and return the lines kept, parsed (``[]`` without a file)."""
        path = self.metrics_path
        if not path.exists():
            return []
        kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line)["round"] <= round]
        path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        return [json.loads(line) for line in kept]

    def save_checkpoint(self, ckpt: Checkpoint) -> None:
        """Write the checkpoint of ``ckpt.round`` (one transaction)."""
        self.checkpoints.save(ckpt)

    def save_final_model(self, model: torch.nn.Module) -> None:
        """``model_final.pt``: the global model's ``state_dict``."""
        torch.save(model.state_dict(), self.run_dir / "model_final.pt")

    def close(self) -> None:
        self.checkpoints.close()
