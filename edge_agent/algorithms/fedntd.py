"""FedNTD, client half: not-true distillation from the global model (SPECS.md §6.8).

Lee, Kim, Lee, Yun, "Preservation of the Global Knowledge by Not-True Distillation in Federated
Learning", NeurIPS 2022, §4 (the local objective; equation numbers not checked here, the paper is
not in the store; the formulas follow SPECS §6.8 and the authors' ``criterion.py``). With z the
local logits, z_g the logits of the frozen received global model, and ~ the removal of the
true class (C−1 "not-true" logits left):

    q̃   = softmax(z̃ / τ),   q̃_g = softmax(z̃_g / τ)
    L    = CE(z, y) + β · τ² · KL(q̃_g ‖ q̃),   KL(p ‖ q) = Σ_c p_c (log p_c − log q_c)

the KL averaged over the batch (``KLDivLoss(reduction="batchmean")``). Defaults β = 1 (``beta``)
and τ = 1 (``tau``), the official FedNTD config (SPECS §6.8; the ``NTD_Loss`` class default is
τ = 3). The τ² factor follows SPECS §6.8's formula (Hinton's gradient scaling); the authors' code
at commit 043269e omits it — the same at the default τ = 1. The global model runs in eval mode.

Uploads the model as FedAvg; the server half is FedAvg (:mod:`broker_server.strategies.fedntd`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from ._base import TrainConfig
from ._registry import register_client_algorithm
from .fedavg import LossFn
from .fedprox import LocalSGDClient, read_param

#: Defaults (module docstring).
BETA = 1.0
TAU = 1.0


def not_true_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The logits without each row's true class: float [B, C] → [B, C−1] (the other classes in
    their order).

    Raises:
        ValueError: C < 2, or ``labels`` not [B].
    """
    b, c = logits.shape
    if c < 2 or labels.shape != (b,):
        raise ValueError(f"logits [B, C>=2] and labels [B] expected, got {list(logits.shape)} and {list(labels.shape)}")
    keep = ~F.one_hot(labels, c).bool()
    return logits[keep].view(b, c - 1)


def ntd_loss(logits: torch.Tensor, global_logits: torch.Tensor, labels: torch.Tensor, tau: float) -> torch.Tensor:
    """τ² · KL(q̃_g ‖ q̃), batch mean (module docstring); differentiable in ``logits`` only."""
    log_q = F.log_softmax(not_true_logits(logits, labels) / tau, dim=1)
    q_g = F.softmax(not_true_logits(global_logits.detach(), labels) / tau, dim=1)
    return tau * tau * F.kl_div(log_q, q_g, reduction="batchmean")


@register_client_algorithm("fedntd")
class FedNTDClient(LocalSGDClient):
    """FedNTD client (module docstring).

    Args:
        precision: ``"fp32"`` or ``"fp16"``, as FedAvg.
    """

    name = "fedntd"
    share = "all"
    buffers = "average"

    def begin_round(self, model: torch.nn.Module, config: TrainConfig, params: Mapping[str, object],
                    global_extras: Mapping[str, np.ndarray]) -> LossFn | None:
        """CE + β·τ²·KL against a frozen copy of the just-loaded global model (CE alone for β = 0).

        Raises:
            ValueError: ``beta`` < 0 or ``tau`` ≤ 0.
        """
        beta = read_param(params, "beta", BETA)
        tau = read_param(params, "tau", TAU)
        if not tau > 0:
            raise ValueError(f"tau must be > 0, got {tau}")
        if beta == 0:
            return None
        glob = copy.deepcopy(model).eval().requires_grad_(False)

        def loss_fn(m: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = m(xb)
            with torch.no_grad():
                zg = glob(xb)
            return F.cross_entropy(logits, yb) + beta * ntd_loss(logits, zg, yb, tau), logits

        return loss_fn
