"""Oort, client half: FedAvg local training that also reports the statistical utility Oort's
selector needs (Lai et al., "Oort: Efficient Federated Learning via Guided Participant
Selection", OSDI 2021, §4.2, Eq. (1)): U_i = |B_i|·sqrt((1/|B_i|)·Σ_{k∈B_i} Loss(k)²), over the
samples B_i of the device's last local epoch (the training losses as they were computed, the
reference code's choice, not a second pass).

Reported metrics besides FedAvg's: ``oort_loss_sq`` (mean over B_i of the per-sample loss²) and
``oort_utility`` (U_i).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from ._base import LocalResult, TrainConfig, step_hook
from ._registry import register_client_algorithm
from .fedavg import FedAvgClient, _check_precision, sgd_epochs, shuffle_generator


def statistical_utility(losses: np.ndarray) -> float:
    """U = |B|·sqrt(mean(loss²)) of per-sample losses [|B|] (Oort Eq. (1)); 0 for no sample."""
    v = np.asarray(losses, np.float64)
    return float(v.size * math.sqrt(float(np.mean(v ** 2)))) if v.size else 0.0


@register_client_algorithm("oort")
class OortClient(FedAvgClient):
    """FedAvg client reporting Oort's statistical utility (see the module)."""

    name = "oort"
    share = "all"
    buffers = "average"

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_id: str = "", client_index: int,
                    device: torch.device, params: Mapping[str, object] | None = None,
                    global_extras: Mapping[str, np.ndarray] | None = None) -> LocalResult:
        """FedAvg's round, recording every batch's per-sample losses (the last epoch's are kept)."""
        _check_precision(self.precision, device)
        t0 = time.perf_counter()
        self.load_global(model, global_tensors)
        seen: list[torch.Tensor] = []

        def loss_fn(m: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = m(xb)
            per = F.cross_entropy(logits, yb, reduction="none")
            seen.append(per.detach().float().cpu())
            return per.mean(), logits

        loss, acc = sgd_epochs(model, x, y, config, shuffle_generator(config.seed, round, client_index), device,
                               precision=self.precision, loss_fn=loss_fn, before_step=step_hook(self),
                               step_round=round)
        n = int(y.shape[0])
        last = torch.cat(seen).numpy()[-n:] if seen else np.zeros(0)
        return LocalResult(tensors=self.upload_tensors(model), num_samples=n, train_loss=loss,
                           metrics={"train_accuracy": acc, "train_seconds": time.perf_counter() - t0,
                                    "oort_loss_sq": float(np.mean(last.astype(np.float64) ** 2)) if n else 0.0,
                                    "oort_utility": statistical_utility(last)})
