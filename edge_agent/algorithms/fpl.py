"""FPL, client half (Huang, Ye, Du, "Rethinking Federated Learning with Domain Shift: A
Prototype View", CVPR 2023; SPECS.md §6.3; RethinkFL code ``models/fpl.py``).

The model is FedAvg-averaged (``share = "all"``). The server broadcasts, per class c, the
**cluster prototypes** {P_c^j} (FINCH clusters of the clients' prototypes of class c) and the
**unbiased prototype** P̄_c (the mean of those cluster prototypes). The local objective is

    L = CE(h(z), y) + (1/B) Σ_{b : y_b has prototypes} [ L_InfoNCE(z_b) + MSE(z_b, P̄_{y_b}) ]

    L_InfoNCE(z_b) = −log( Σ_j exp(cos(z_b, P_{y_b}^j)/τ) / Σ_{c, j} exp(cos(z_b, P_c^j)/τ) )

(positives: every cluster prototype of the sample's class; the denominator runs over all
cluster prototypes, positives and negatives = the other classes'; τ = 0.02; MSE = mean over the
d entries). As in RethinkFL the sum over the samples that have a prototype is divided by the
whole batch size B. In round 1 (no global prototypes) L = CE.

Local prototypes: the mean feature per class over the **last local epoch** (each local sample
once), uploaded as FedProto's extras ``prototypes`` float32 [k, d], ``proto_classes`` int64 [k],
``proto_counts`` int64 [k]. Evaluation uses the model's own head (logits).

Received extras: ``cluster_protos`` float32 [K, d], ``cluster_classes`` int64 [K] (class of each
cluster prototype), ``unbiased_protos`` float32 [C', d], ``unbiased_classes`` int64 [C'].
Hyperparameter (``round_start.config``): ``tau`` (τ, default 0.02).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ModelError
from ._base import FloatLike
from ._registry import register_client_algorithm
from .fedproto import PrototypeClient, prototype_table

#: RethinkFL's InfoNCE temperature (``infoNCET``).
DEFAULT_TAU = 0.02


def fpl_prototype_loss(features: torch.Tensor, labels: torch.Tensor, cluster_protos: torch.Tensor,
                       cluster_classes: torch.Tensor, unbiased_table: torch.Tensor, unbiased_mask: torch.Tensor,
                       tau: float) -> torch.Tensor:
    """FPL's prototype term (1/B) Σ_b [InfoNCE + MSE] of the module docstring.

    Args:
        features: z, float [B, d].
        labels: int64 [B].
        cluster_protos: float32 [K, d].
        cluster_classes: int64 [K], the class of each cluster prototype.
        unbiased_table: float32 [C, d], P̄_c in row c; unbiased_mask: bool [C], rows that exist.
        tau: temperature τ > 0.

    Returns:
        Scalar float32 tensor; 0 when no sample's class has cluster prototypes and an unbiased
        prototype (gradients flow only through the samples that do).
    """
    zf = features.float()
    pos = cluster_classes.unsqueeze(0) == labels.unsqueeze(1)  # [B, K]
    has = pos.any(dim=1) & unbiased_mask[labels]
    if not bool(has.any()):
        return zf.sum() * 0.0
    z, y, pos = zf[has], labels[has], pos[has]
    sim = F.cosine_similarity(z.unsqueeze(1), cluster_protos.unsqueeze(0), dim=2) / tau  # [b, K]
    info = sim.logsumexp(dim=1) - sim.masked_fill(~pos, float("-inf")).logsumexp(dim=1)
    mse = ((z - unbiased_table[y]) ** 2).mean(dim=1)
    return (info + mse).sum() / features.shape[0]


@register_client_algorithm("fpl")
class FPLClient(PrototypeClient):
    """FPL client: FedAvg model exchange, last-epoch prototypes up, cluster and unbiased
    prototypes down, CE + InfoNCE + MSE locally (module docstring).

    Args:
        precision: ``"fp32"`` or ``"fp16"`` (CUDA autocast), as for FedAvg.

    Raises:
        ValueError: unknown ``precision``.
    """

    name = "fpl"
    share = "all"
    buffers = "average"

    prototypes_from_last_epoch = True

    def feature_loss(self, global_extras: Mapping[str, np.ndarray], params: Mapping[str, object],
                     num_classes: int,
                     device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """:func:`fpl_prototype_loss` with the round's cluster and unbiased prototypes; ``None``
        in round 1 (no ``cluster_protos``).

        Raises:
            ValueError: ``params["tau"]`` (default 0.02) not > 0.
            ModelError: malformed or inconsistent global extras.
        """
        tau = float(cast(FloatLike, params.get("tau", DEFAULT_TAU)))
        if not tau > 0:
            raise ValueError(f"tau must be > 0, got {tau}")
        names = ("cluster_protos", "cluster_classes", "unbiased_protos", "unbiased_classes")
        if not all(n in global_extras for n in names) or not len(global_extras["cluster_classes"]):
            return None
        cp = np.asarray(global_extras["cluster_protos"])
        cc = np.asarray(global_extras["cluster_classes"])
        if cp.ndim != 2 or cc.shape != (cp.shape[0],) or not np.issubdtype(cc.dtype, np.integer):
            raise ModelError(f"cluster_protos [K, d] with integer cluster_classes [K] expected, got {cp.shape} "
                             f"and {cc.dtype} {cc.shape}")
        table, mask = prototype_table(global_extras["unbiased_protos"], global_extras["unbiased_classes"],
                                      num_classes, device)
        if table.shape[1] != cp.shape[1]:
            raise ModelError(f"cluster prototypes are {cp.shape[1]}-d, unbiased prototypes {table.shape[1]}-d")
        protos = torch.as_tensor(cp.astype(np.float32), device=device)
        classes = torch.as_tensor(cc.astype(np.int64), device=device)
        return lambda z, yb: fpl_prototype_loss(z, yb, protos, classes, table, mask, tau)
