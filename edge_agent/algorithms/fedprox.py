"""FedProx, client half: local SGD on cross-entropy plus a proximal term to the global model.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in Heterogeneous
Networks", MLSys 2020, Eq. (2) (SPECS §6.17): client k minimises

    h_k(w; w_g) = CE_k(w) + (μ/2)·‖w − w_g‖²

from the global weights w_g, where ‖·‖² sums the squared entries of every trainable parameter.
μ comes from the round's config (``[algorithm] mu`` on the server; default :data:`MU` = 0.01,
RethinkFL's ``best_args`` value that SPECS quotes). With μ = 0 the arithmetic is FedAvg's,
bit for bit (the term is still formed: it adds exactly 0 to the loss and to every gradient).
Uploads the full model like FedAvg; the server half is FedAvg's weighted mean
(:class:`broker_server.strategies.fedprox.FedProx`).

This module also holds :class:`LocalSGDClient`, FedAvg's client round with the objective of
:func:`~edge_agent.algorithms.fedavg.sgd_epochs` (``loss_fn``) and per-device state exposed as
methods, which the other parameter-averaging baselines (FedDyn, SCAFFOLD) extend; a gradient
edit goes in the one training-step hook, :meth:`~edge_agent.algorithms.ClientAlgorithm.before_step`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

import numpy as np
import torch

from ._base import FloatLike, LocalResult, TrainConfig, step_hook
from ._registry import register_client_algorithm
from .fedavg import (
    FedAvgClient,
    LossFn,
    _check_precision,
    cross_entropy_loss,
    sgd_epochs,
    shuffle_generator,
)

#: FedProx proximal coefficient μ when the round config has no ``mu`` (RethinkFL best_args; SPECS §6.17).
MU = 0.01


def proximal_term(params: Iterable[torch.Tensor], anchors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ_j ‖w_j − a_j‖² (squared L2 distance summed over tensors), differentiable in ``params``.

    Args:
        params: the model's trainable parameters w_j (float32, any shapes), in ``parameters()`` order.
        anchors: detached tensors a_j of the same shapes and order (the global weights w_g).

    Returns:
        A float32 scalar tensor; its gradient with respect to w_j is 2·(w_j − a_j).

    Raises:
        ValueError: a different number of parameters and anchors.
    """
    params = list(params)
    if len(params) != len(anchors):
        raise ValueError(f"{len(params)} parameters but {len(anchors)} anchors")
    total = params[0].new_zeros(())
    for p, a in zip(params, anchors, strict=False):
        total = total + (p - a).pow(2).sum()
    return total


def parameter_snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    """Detached copies of ``model.parameters()`` (same device and dtype), e.g. w_g right after loading."""
    return [p.detach().clone() for p in model.parameters()]


class LocalSGDClient(FedAvgClient):
    """FedAvg's client round (load the global model, E epochs of SGD, upload the model) with the
    algorithm's hooks in between; subclasses override :meth:`begin_round` / :meth:`end_round`.

    Per round: ``self.load_global(model, global_tensors)`` → ``loss_fn = begin_round(...)``
    → :func:`~edge_agent.algorithms.fedavg.sgd_epochs` with that objective, the algorithm's
    :meth:`~edge_agent.algorithms.ClientAlgorithm.before_step` (when it has one) and the FedAvg
    shuffling generator → ``extras = end_round(...)`` (called only when the shard is non-empty,
    i.e. when an update will be sent) → :class:`LocalResult` with the shared model tensors.
    Without overrides the result equals :class:`FedAvgClient`'s bit for bit.

    Args:
        precision: ``"fp32"`` or ``"fp16"`` (CUDA autocast), as :class:`FedAvgClient`.

    Raises:
        ValueError: unknown ``precision``.
    """

    share = "all"

    def begin_round(self, model: torch.nn.Module, config: TrainConfig, params: Mapping[str, object],
                    global_extras: Mapping[str, np.ndarray]) -> LossFn | None:
        """Called after the global model is loaded, before training: returns the ``loss_fn`` for
        :func:`sgd_epochs` (``None`` = cross-entropy) and prepares whatever the algorithm's
        :meth:`~edge_agent.algorithms.ClientAlgorithm.before_step` needs this round."""
        return None

    def end_round(self, model: torch.nn.Module, config: TrainConfig) -> dict[str, np.ndarray]:
        """Called after training on a non-empty shard: update per-device state, return the extras to upload."""
        return {}

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_id: str = "", client_index: int,
                    device: torch.device, params: Mapping[str, object] | None = None,
                    global_extras: Mapping[str, np.ndarray] | None = None) -> LocalResult:
        """Load ``global_tensors``, train with the algorithm's hooks, return the shared tensors
        (float32, manifest order), ``num_samples = len(y)`` and the extras of :meth:`end_round`.

        A zero-sample shard trains nothing and leaves the per-device state unchanged (the agent
        sends no update then).

        Raises:
            ModelError: ``global_tensors`` do not match the model.
            ValueError: ``precision="fp16"`` with a non-CUDA ``device``; ``config.batch_size`` < 1;
                a hyperparameter in ``params`` out of range.
        """
        _check_precision(self.precision, device)  # before the model is touched
        t0 = time.perf_counter()
        self.load_global(model, global_tensors)
        loss_fn = self.begin_round(model, config, dict(params or {}), dict(global_extras or {}))
        loss, acc = sgd_epochs(model, x, y, config, shuffle_generator(config.seed, round, client_index), device,
                               precision=self.precision, loss_fn=loss_fn, before_step=step_hook(self),
                               step_round=round)
        extras = self.end_round(model, config) if int(y.shape[0]) else {}
        return LocalResult(tensors=self.upload_tensors(model), num_samples=int(y.shape[0]), train_loss=loss,
                           metrics={"train_accuracy": acc, "train_seconds": time.perf_counter() - t0}, extras=extras)


def read_param(params: Mapping[str, object], key: str, default: float, *, minimum: float = 0.0) -> float:
    """``float(params[key])`` (``default`` when absent), checked to be finite and ≥ ``minimum``.

    Raises:
        ValueError: not a number, not finite, or below ``minimum``.
    """
    value = float(cast(FloatLike, params.get(key, default)))
    if not np.isfinite(value) or value < minimum:
        raise ValueError(f"{key} must be a finite number >= {minimum}, got {params.get(key)!r}")
    return value


@register_client_algorithm("fedprox")
class FedProxClient(LocalSGDClient):
    """FedProx client: minimises CE + (μ/2)·‖w − w_g‖² over the parameters by local SGD.

    ``train_loss`` reports that whole objective (the FedProx h_k). Upload: the full model, as
    FedAvg (no extras). μ = ``params["mu"]`` (default :data:`MU`), ≥ 0.
    """

    name = "fedprox"
    share = "all"
    buffers = "average"

    def begin_round(self, model: torch.nn.Module, config: TrainConfig, params: Mapping[str, object],
                    global_extras: Mapping[str, np.ndarray]) -> LossFn:
        mu = read_param(params, "mu", MU)
        anchors = parameter_snapshot(model)

        def loss_fn(m: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            ce, logits = cross_entropy_loss(m, xb, yb)
            return ce + (mu / 2) * proximal_term(m.parameters(), anchors), logits

        return loss_fn
