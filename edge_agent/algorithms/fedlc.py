"""FedLC, client half: cross-entropy on logits calibrated by the local label counts (SPECS.md §6.9).

Zhang, Li, Li, Xu, Wu, Ding, Wu, "Federated Learning with Label Distribution Skew via Logits
Calibration", ICML 2022, §4 (the calibrated loss; equation numbers not checked here, the paper
is not in the store). With z the logits and n_c the number of samples of class c on this
client:

    z̄_c = z_c − τ · n_c^{−1/4}
    L   = CE(z̄, y) = −log( exp(z̄_y) / Σ_c exp(z̄_c) )

so a rare local class gets a larger margin subtracted from its logit during training (the model
must push it further up to fit it), which counters the bias towards the locally frequent classes.
τ = ``tau`` (1.0, SPECS §6.9 / PFLlib's default). Inference uses the raw logits.

Choices: n_c are the client's **own** counts, as the paper (PFLlib's ``serverlc`` sends global
counts instead, SPECS §6.9). A class absent from the shard (n_c = 0) has an infinite margin:
its calibrated logit is −∞, i.e. it leaves the softmax of the training loss (exactly what the
formula gives in the limit, computed as a mask, never as ∞ arithmetic). The denominator runs over
all classes (CE), as SPECS §6.9 and PFLlib's ``clientlc`` do.

Uploads the model as FedAvg; the server half is FedAvg (:mod:`broker_server.strategies.fedlc`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ModelError
from ._base import LocalResult, TrainConfig
from ._registry import register_client_algorithm
from .fedavg import LossFn
from .fedprox import LocalSGDClient, read_param

#: Default calibration strength τ (SPECS §6.9).
TAU = 1.0


def calibration_margins(counts: np.ndarray, tau: float) -> torch.Tensor:
    """τ·n_c^{−1/4} per class, float32 [C]; +∞ where n_c = 0.

    Raises:
        ValueError: a negative count or τ < 0.
    """
    n = np.asarray(counts, np.float64)
    if n.ndim != 1 or (n < 0).any() or tau < 0:
        raise ValueError(f"counts must be a vector of non-negative counts and tau >= 0, got {counts!r}, {tau}")
    with np.errstate(divide="ignore"):
        m = np.where(n > 0, tau * np.power(np.where(n > 0, n, 1.0), -0.25), np.inf)
    return torch.as_tensor(m, dtype=torch.float32)


def calibrated_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, margins: torch.Tensor) -> torch.Tensor:
    """Mean CE of z − margins (classes with an infinite margin masked out of the softmax).

    Args:
        logits: float [B, C]. labels: int64 [B] (each label's margin must be finite, i.e. the
            class present locally). margins: float [C] (:func:`calibration_margins`).

    Raises:
        ValueError: a label whose class has an infinite margin.
    """
    m = margins.to(logits.device)
    absent = torch.isinf(m)
    if bool(absent[labels].any()):
        raise ValueError("a batch label belongs to a class with no local samples (n_c = 0)")
    z = (logits - torch.where(absent, torch.zeros_like(m), m)).masked_fill(absent, float("-inf"))
    return F.cross_entropy(z, labels)


@register_client_algorithm("fedlc")
class FedLCClient(LocalSGDClient):
    """FedLC client (module docstring): n_c counted from each round's shard.

    Args:
        precision: ``"fp32"`` or ``"fp16"``, as FedAvg.
    """

    name = "fedlc"
    share = "all"
    buffers = "average"

    def __init__(self, *, precision: str = "fp32") -> None:
        super().__init__(precision=precision)
        self.counts: np.ndarray | None = None

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, **kw) -> LocalResult:
        """FedAvg's round on the calibrated loss; n_c = the class counts of ``y``.

        Raises:
            ModelError: the model has no ``num_classes`` or a label is outside [0, C).
        """
        c = getattr(model, "num_classes", None)
        if not isinstance(c, int) or c < 1:
            raise ModelError("FedLC needs a model with num_classes (the light CNN, the zoo)")
        yn = y.numpy()
        if yn.size and (yn.min() < 0 or yn.max() >= c):
            raise ModelError(f"labels outside [0, {c})")
        self.counts = np.bincount(yn.astype(np.int64), minlength=c)
        return super().local_round(model, global_tensors, x, y, config, **kw)

    def begin_round(self, model: torch.nn.Module, config: TrainConfig, params: Mapping[str, object],
                    global_extras: Mapping[str, np.ndarray]) -> LossFn:
        """The calibrated CE with this round's margins.

        Raises:
            ValueError: ``tau`` < 0.
        """
        assert self.counts is not None  # set by local_round
        margins = calibration_margins(self.counts, read_param(params, "tau", TAU))

        def loss_fn(m: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = m(xb)
            return calibrated_cross_entropy(logits, yb, margins), logits

        return loss_fn
