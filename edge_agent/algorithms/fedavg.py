"""FedAvg, client half: E local epochs of mini-batch SGD from the global model.

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017, Algorithm 1 (ClientUpdate): the client starts from the global weights w_t,
runs E epochs of SGD with batch size B and learning rate η on its shard, and returns its
weights w_{t+1}^k together with its sample count n_k (the server's weight).
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from ..state import load_arrays, state_arrays
from ._base import LocalResult, TrainConfig
from ._registry import register_client_algorithm


def shuffle_generator(seed: int, round: int, client_index: int) -> torch.Generator:
    """A private CPU generator for one client's round, independent of global RNG state."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + round * 10_007 + client_index) % (2**63 - 1))
    return g


def sgd_epochs(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, config: TrainConfig,
               generator: torch.Generator, device: torch.device) -> tuple[float, float]:
    """Run ``config.local_epochs`` epochs of SGD on ``(x, y)``.

    Args:
        model: trained in place.
        x: inputs, float32 [N, C, H, W] (CPU; batches are moved to ``device``).
        y: labels, int64 [N].
        config: epochs, batch size, learning rate, momentum, weight decay.
        generator: shuffling RNG.
        device: where the model lives.

    Returns:
        (mean cross-entropy over the last epoch, training accuracy over the last epoch as a fraction).
        A shard of zero samples returns (0.0, 0.0) and leaves the model unchanged.
    """
    n = int(x.shape[0])
    if n == 0:
        return 0.0, 0.0
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                          weight_decay=config.weight_decay)
    model.train()
    loss_sum = 0.0
    correct = 0
    for _ in range(max(1, config.local_epochs)):
        perm = torch.randperm(n, generator=generator)
        loss_sum, correct = 0.0, 0
        for start in range(0, n, config.batch_size):
            idx = perm[start:start + config.batch_size]
            xb, yb = x[idx].to(device, non_blocking=True), y[idx].to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            logits = model(xb)
            loss = F.cross_entropy(logits, yb)
            loss.backward()
            opt.step()
            loss_sum += float(loss.detach()) * int(yb.shape[0])
            correct += int((logits.detach().argmax(1) == yb).sum())
    return loss_sum / n, correct / n


@register_client_algorithm("fedavg")
class FedAvgClient:
    """FedAvg client: local SGD from the global model; uploads the full local model (float32).

    Upload per round: every ``state_dict`` tensor; for the light CNN on 28×28 grayscale that is
    105,216 + 650 parameters × 4 bytes = 423,464 body bytes of tensor data.
    """

    name = "fedavg"

    def __init__(self) -> None:
        pass

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_index: int,
                    device: torch.device) -> LocalResult:
        """Load ``global_tensors``, train, return the new weights and ``num_samples = len(y)``.

        Raises:
            ModelError: ``global_tensors`` do not match the model.
        """
        t0 = time.perf_counter()
        load_arrays(model, global_tensors)
        loss, acc = sgd_epochs(model, x, y, config, shuffle_generator(config.seed, round, client_index), device)
        return LocalResult(tensors=state_arrays(model), num_samples=int(y.shape[0]), train_loss=loss,
                           metrics={"train_accuracy": acc, "train_seconds": time.perf_counter() - t0})
