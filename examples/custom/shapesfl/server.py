"""The server half: a coordinate-wise trimmed mean (Yin et al., "Byzantine-Robust Distributed
Learning: Towards Optimal Statistical Rates", ICML 2018): for every parameter coordinate, the
``trim`` largest and ``trim`` smallest client values are dropped and the rest averaged,
unweighted — robust to up to ``trim`` outlying (faulty or hostile) devices per round. With
fewer than ``2·trim + 1`` updates the trim shrinks to ``(n − 1) // 2``.

Also: FedAvg's client selection (subclassing :class:`fedfleet.server.FedAvg`), a learning-rate
schedule ``lr_r = lr · lr_decay^(r − 1)`` sent in every round's config (``config_for_round``),
the devices' metrics aggregated into the round's (``aggregate_metrics``) and the global model
evaluated on a validation set of the server's own (``evaluate``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fedfleet.server import ClientReport, ClientResult, FedAvg, GlobalUpdate
from shapesfl.data import validation_set


def trimmed_mean(stack: Sequence[np.ndarray], trim: int) -> np.ndarray:
    """The coordinate-wise trimmed mean of ``stack`` (one array per client, equal shapes): sort
    each coordinate's n values, drop ``k = min(trim, (n − 1) // 2)`` at each end, average the
    rest (float64, returned in the inputs' dtype)."""
    a = np.sort(np.stack([np.asarray(s, np.float64) for s in stack]), axis=0)
    k = min(trim, (len(a) - 1) // 2)
    return a[k:len(a) - k].mean(axis=0).astype(np.asarray(stack[0]).dtype)


class TrimmedMean(FedAvg):
    """Trimmed-mean aggregation with a learning-rate schedule.

    Args:
        trim: values dropped at each end per coordinate (>= 0; 0 = the plain mean).
        lr_decay: the schedule's factor per round, in (0, 1].
        clip_norm: the clients' gradient-norm bound (sent in the round config; 0 = none).
        val_size: images in the server's own validation set (>= 1).
        participation_rate, min_clients, train_config: as FedAvg (given by fedfleet).
    """

    share = "all"
    buffers = "average"

    def __init__(self, *, trim: int = 1, lr_decay: float = 1.0, clip_norm: float = 0.0, val_size: int = 300,
                 **base) -> None:
        super().__init__(**base)
        if isinstance(trim, bool) or not isinstance(trim, int) or trim < 0:
            raise ValueError(f"trim must be an integer >= 0, got {trim!r}")
        if not 0 < float(lr_decay) <= 1:
            raise ValueError(f"lr_decay must be in (0, 1], got {lr_decay!r}")
        if float(clip_norm) < 0:
            raise ValueError(f"clip_norm must be >= 0, got {clip_norm!r}")
        if isinstance(val_size, bool) or not isinstance(val_size, int) or val_size < 1:
            raise ValueError(f"val_size must be an integer >= 1, got {val_size!r}")
        self.trim, self.lr_decay = trim, float(lr_decay)
        self.train_config["clip_norm"] = float(clip_norm)
        self.base_lr = float(self.train_config.get("lr", 0.05))
        x, y = validation_set(val_size)
        self.val_x, self.val_y = torch.from_numpy(x), torch.from_numpy(y)

    def config_for_round(self, round: int) -> dict:
        return {"lr": self.base_lr * self.lr_decay ** (round - 1)}

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        if not results:
            return None
        k = min(self.trim, (len(results) - 1) // 2)
        tensors = [trimmed_mean([r.tensors[i] for r in results], self.trim) for i in range(len(current))]
        return GlobalUpdate(tensors=tensors, metrics={"trimmed_per_side": k})

    def aggregate_metrics(self, round: int, reports: Sequence[ClientReport]) -> dict:
        accs = [float(r.metrics["train_accuracy"]) for r in reports if "train_accuracy" in r.metrics]
        weights = [r.num_samples for r in reports if "train_accuracy" in r.metrics]
        if not accs:
            return {}
        return {"train_accuracy_weighted": float(np.average(accs, weights=weights)),
                "train_accuracy_worst": min(accs),
                "clipped_fraction_mean": float(np.mean([float(r.metrics.get("clipped_fraction", 0.0))
                                                        for r in reports]))}

    def evaluate(self, round: int, model: torch.nn.Module) -> dict:
        predicted = model(self.val_x).argmax(1)
        return {"val_accuracy": float((predicted == self.val_y).float().mean())}
