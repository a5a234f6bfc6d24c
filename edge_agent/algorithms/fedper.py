"""FedPer, client half: joint local training, only the base (backbone) travels.

Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with Personalization Layers",
arXiv:1912.00818, 2019 (SPECS §6.15; code: PFLlib ``clientper.py``). Each round client i loads
the global base (the ``backbone.*`` entries of the light CNN) into its model, trains base and its
private personalization layer (``classifier.*``) jointly with cross-entropy for E local epochs —
the FedAvg ClientUpdate on the whole model — and uploads the base only; the server averages the
bases (:class:`broker_server.strategies.fedper.FedPer`).

The head stays in the agent's model object, which the agent keeps for the whole run, so
client-side evaluation (``[server] client_eval = true``) scores each client's personal model.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import torch

from ._base import LocalResult, TrainConfig, load_shared, shared_arrays
from ._registry import register_client_algorithm
from .fedavg import FedAvgClient, _check_precision, sgd_epochs, shuffle_generator


@register_client_algorithm("fedper")
class FedPerClient(FedAvgClient):
    """FedPer client: FedAvg's local SGD on the whole model; uploads the backbone only.

    Upload per round (``share = "backbone"``): for the light CNN on 28×28 grayscale 105,216
    parameters × 4 bytes = 420,864 body bytes of tensor data (the 650 head parameters stay).

    Args:
        precision: ``"fp32"`` (default) or ``"fp16"`` (CUDA autocast), as for FedAvg.

    Raises:
        ValueError: unknown ``precision``.
    """

    share = "backbone"

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_index: int,
                    device: torch.device, params: Mapping[str, object] | None = None,
                    global_extras: Mapping[str, np.ndarray] | None = None) -> LocalResult:
        """Load the global backbone (the private head is kept), train everything, return the backbone.

        Returns:
            LocalResult with the backbone arrays (float32, manifest order), ``num_samples =
            len(y)``, mean training cross-entropy and accuracy of the last epoch. A shard of zero
            samples trains nothing and returns ``num_samples = 0`` (not sent).

        Raises:
            ModelError: ``global_tensors`` are not the model's backbone.
            ValueError: ``fp16`` on a non-CUDA device; ``batch_size`` < 1.
        """
        _check_precision(self.precision, device)
        t0 = time.perf_counter()
        load_shared(model, global_tensors, self.share)
        loss, acc = sgd_epochs(model, x, y, config, shuffle_generator(config.seed, round, client_index), device,
                               precision=self.precision)
        return LocalResult(tensors=shared_arrays(model, self.share), num_samples=int(y.shape[0]), train_loss=loss,
                           metrics={"train_accuracy": acc, "train_seconds": time.perf_counter() - t0})
