"""The client half: local SGD from the global model with a label-smoothed cross-entropy and each
step's gradient clipped to a norm of at most ``clip_norm`` (a round-config key the server half
sends). Imports only fedfleet's client half."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from fedfleet.client import ClientAlgorithm, LocalResult, StepContext, sgd_epochs, shuffle_generator

SMOOTHING = 0.05


def smoothed_loss(model: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(xb)
    return F.cross_entropy(logits, yb, label_smoothing=SMOOTHING), logits


class ClippedSGD(ClientAlgorithm):
    """Label-smoothed SGD with per-step gradient-norm clipping; uploads the whole model."""

    share = "all"
    buffers = "average"

    def __init__(self) -> None:
        self.clip_norm = 0.0
        self.clipped = 0
        self.steps = 0

    def before_step(self, model: torch.nn.Module, context: StepContext) -> None:
        """Clip the gradient's global norm to ``clip_norm`` (0 = no clipping), counting the steps clipped."""
        self.steps += 1
        if self.clip_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip_norm))
            self.clipped += norm > self.clip_norm

    def local_round(self, model, global_tensors, x, y, config, *, round, client_id="", client_index, device,
                    params=None, global_extras=None):
        t0 = time.perf_counter()
        self.clip_norm = float((params or {}).get("clip_norm", 0.0))
        self.clipped = self.steps = 0
        self.load_global(model, global_tensors)
        loss, acc = sgd_epochs(model, x, y, config, shuffle_generator(config.seed, round, client_index), device,
                               loss_fn=smoothed_loss, before_step=self.before_step, step_round=round)
        return LocalResult(tensors=self.upload_tensors(model), num_samples=int(y.shape[0]), train_loss=loss,
                           metrics={"train_accuracy": acc, "clipped_fraction": self.clipped / max(1, self.steps),
                                    "lr_used": config.lr, "train_seconds": time.perf_counter() - t0})
