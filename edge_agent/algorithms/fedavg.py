"""FedAvg, client half: E local epochs of mini-batch SGD from the global model.

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017, Algorithm 1 (ClientUpdate): the client starts from the global weights w_t,
runs E epochs of SGD with batch size B and learning rate η on its shard, and returns its
weights w_{t+1}^k together with its sample count n_k (the server's weight).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from ..models.training import train_mode
from ._base import ClientAlgorithm, LocalResult, StepContext, TrainConfig, step_hook
from ._registry import register_client_algorithm


def shuffle_generator(seed: int, round: int, client_index: int) -> torch.Generator:
    """A private CPU generator for one client's round, independent of global RNG state."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + round * 10_007 + client_index) % (2**63 - 1))
    return g


#: Training precisions: ``"fp32"``, or ``"fp16"`` = CUDA autocast with float16 and a gradient scaler.
PRECISIONS = ("fp32", "fp16")


def _check_precision(precision: str, device: torch.device | None = None) -> None:
    """Raise ValueError for an unknown precision, or fp16 on a ``device`` that is not CUDA."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp16" and device is not None and torch.device(device).type != "cuda":
        raise ValueError(f"fp16 training needs a CUDA device, got {device}: train in fp32 on the CPU "
                         "(edge_agent.device.plan_runtime makes that fallback)")


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; the copy is asynchronous (``non_blocking``) only from pinned host
    memory to CUDA, the one case where that is both safe and faster. A batch gathered by index
    (``x[idx]``) is a fresh, unpinned tensor, so it is copied synchronously."""
    non_blocking = device.type == "cuda" and t.device.type == "cpu" and t.is_pinned()
    return t.to(device, non_blocking=non_blocking)


#: ``loss_fn(model, xb, yb) -> (loss, logits)``: the training objective of one batch (a scalar
#: tensor to differentiate, and the logits [B, C] used for the training accuracy).
LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def cross_entropy_loss(model: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The default :data:`LossFn`: mean cross-entropy of ``model(xb)`` (logits [B, C]) against ``yb`` (int64 [B])."""
    logits = model(xb)
    return F.cross_entropy(logits, yb), logits


def sgd_epochs(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, config: TrainConfig,
               generator: torch.Generator, device: torch.device, *, precision: str = "fp32",
               loss_fn: LossFn | None = None,
               before_step: Callable[[torch.nn.Module, StepContext], None] | None = None,
               step_round: int = 0) -> tuple[float, float]:
    """Run ``config.local_epochs`` epochs (at least one) of SGD on ``(x, y)``.

    Each epoch visits the shard in the order of ``torch.randperm(N, generator=generator)`` in
    batches of ``config.batch_size`` (the last batch may be smaller; a batch size larger than the
    shard gives one batch of N). Only ``generator`` is drawn from, never the global RNG, so
    the result depends on the seed alone. With ``precision="fp32"`` on the CPU the arithmetic is
    exactly that of plain ``loss.backward(); opt.step()`` SGD: bit-identical for the same seed,
    data and torch build.

    Args:
        model: trained in place; already on ``device``.
        x: inputs, float32 [N, C, H, W] (CPU; batches are moved to ``device``).
        y: labels, int64 [N]; classes absent from the shard are fine.
        config: epochs, batch size, learning rate, momentum, weight decay.
        generator: shuffling RNG (CPU).
        device: where the model lives.
        precision: ``"fp32"``, or ``"fp16"``: forward pass and loss under
            ``torch.autocast("cuda", float16)``, backward through ``torch.amp.GradScaler("cuda")``
            (master weights stay float32). fp16 needs a CUDA ``device``.
        loss_fn: the objective of one batch, ``(model, xb, yb) -> (loss, logits)`` (see
            :data:`LossFn`); called inside autocast under fp16. ``None`` = :func:`cross_entropy_loss`,
            the FedAvg objective (same operations, so FedAvg stays bit-identical). Algorithms with
            an extra term (FedProx's proximal term, FedPAD's prototype term …) pass their own.
        before_step: the algorithm's one training-step hook (:meth:`ClientAlgorithm.before_step`,
            passed through :func:`~edge_agent.algorithms._base.step_hook`), called as
            ``before_step(model, StepContext(epoch, step, loss, step_round))`` once per batch
            after ``backward()`` and before the optimizer step, to edit ``p.grad`` in place
            (SCAFFOLD's corrected gradient g + c − c_i). Under fp16 the gradients are unscaled
            first (``scaler.unscale_``), so the hook always sees true gradients. ``None`` =
            nothing (and no unscale).
        step_round: the federated round, passed on in the :class:`StepContext`.

    Returns:
        (mean loss over the last epoch — cross-entropy, or ``loss_fn``'s loss when one is given —,
        training accuracy over the last epoch as a fraction).
        A shard of zero samples returns (0.0, 0.0) and leaves the model unchanged.

    Raises:
        ValueError: unknown ``precision``; ``"fp16"`` on a non-CUDA device (the runtime plan
            falls back to fp32 there, see :func:`edge_agent.device.plan_runtime`);
            ``config.batch_size`` < 1.
    """
    device = torch.device(device)
    _check_precision(precision, device)
    if config.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {config.batch_size}")
    n = int(x.shape[0])
    if n == 0:
        return 0.0, 0.0
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                          weight_decay=config.weight_decay)
    objective = cross_entropy_loss if loss_fn is None else loss_fn
    amp = precision == "fp16"
    scaler = torch.amp.GradScaler("cuda") if amp else None
    train_mode(model)  # frozen layers (BatchNorm included) stay in eval mode
    loss_sum = 0.0
    correct = 0
    step = 0

    for epoch in range(max(1, config.local_epochs)):
        perm = torch.randperm(n, generator=generator)
        loss_sum, correct = 0.0, 0
        for start in range(0, n, config.batch_size):
            idx = perm[start:start + config.batch_size]
            xb, yb = _to_device(x[idx], device), _to_device(y[idx], device)
            opt.zero_grad(set_to_none=True)
            if scaler is None:
                loss, logits = objective(model, xb, yb)
                loss.backward()
                if before_step is not None:
                    before_step(model, StepContext(epoch, step, loss.detach(), step_round))
                opt.step()
            else:
                with torch.autocast(device_type="cuda", dtype=torch.float16):
                    loss, logits = objective(model, xb, yb)  # autocast runs cross_entropy in float32
                scaler.scale(loss).backward()
                if before_step is not None:
                    scaler.unscale_(opt)  # the hook edits true gradients; step() does not unscale twice
                    before_step(model, StepContext(epoch, step, loss.detach(), step_round))
                scaler.step(opt)  # skipped when the scaled gradients overflowed
                scaler.update()
            step += 1
            loss_sum += float(loss.detach()) * int(yb.shape[0])
            correct += int((logits.detach().argmax(1) == yb).sum())
    return loss_sum / n, correct / n


@register_client_algorithm("fedavg")
class FedAvgClient(ClientAlgorithm):
    """FedAvg client: local SGD from the global model; uploads the full local model (float32)
    (without its buffers when a subclass declares ``buffers = "local"``).

    Upload per round: every ``state_dict`` tensor; for the light CNN on 28×28 grayscale that is
    105,216 + 650 parameters × 4 bytes = 423,464 body bytes of tensor data.

    Args:
        precision: ``"fp32"`` (default), or ``"fp16"`` (CUDA autocast; take it from
            :attr:`edge_agent.device.RuntimePlan.precision`, which is already ``"fp32"`` on a
            device without CUDA). Uploads are float32 either way.

    Raises:
        ValueError: unknown ``precision``.
    """

    name = "fedavg"
    share = "all"
    buffers = "average"
    borrows_model = True  # its model between rounds is its state entries (ClientAlgorithm)


    def __init__(self, *, precision: str = "fp32") -> None:
        _check_precision(precision)
        self.precision = precision

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_id: str = "", client_index: int,
                    device: torch.device, params: Mapping[str, object] | None = None,
                    global_extras: Mapping[str, np.ndarray] | None = None) -> LocalResult:
        """Load ``global_tensors``, train, return the new weights and ``num_samples = len(y)``.

        A shard of zero samples is not an error: the model is loaded with ``global_tensors`` and
        the result carries those weights unchanged, ``num_samples=0``, ``train_loss=0.0`` and
        ``train_accuracy=0.0``. The protocol refuses an update with ``num_samples`` 0, so the
        caller must not send that result (skip the round) — it is not a FedAvg contribution.

        Raises:
            ModelError: ``global_tensors`` do not match the model.
            ValueError: ``precision="fp16"`` with a non-CUDA ``device``; ``config.batch_size`` < 1.
        """
        _check_precision(self.precision, device)  # before the model is touched
        t0 = time.perf_counter()
        self.load_global(model, global_tensors)
        loss, acc = sgd_epochs(model, x, y, config, shuffle_generator(config.seed, round, client_index), device,
                               precision=self.precision, before_step=step_hook(self), step_round=round)
        return LocalResult(tensors=self.upload_tensors(model), num_samples=int(y.shape[0]), train_loss=loss,
                           metrics={"train_accuracy": acc, "train_seconds": time.perf_counter() - t0})
