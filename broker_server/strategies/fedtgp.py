"""FedTGP, server half: trainable global prototypes with an adaptive-margin contrastive loss
(Zhang et al., AAAI 2024; SPECS.md §6.2; TsingZ0/FedTGP and HtFLlib ``servertgp``).

The server keeps a small network that outputs one prototype per class,

    P_c = fc(ReLU(W · Emb(c) + b)),   Emb ∈ R^{C×d}, W ∈ R^{d×d}, fc: R^d → R^d

(hidden width = d, as the code), initialised once from ``server_seed`` (PyTorch's default
initialisers: Emb ~ N(0, 1), Linear uniform); network and training loop are
:mod:`broker_server.strategies._prototype_net`, shared with FedOCP. Each round, from the
uploaded client prototypes
{(p, c)} (one per class per client):

1. gap_c = min_{c' ≠ c} ‖p̄_c − p̄_{c'}‖₂ over the per-class means p̄ of the uploads (unweighted
   over clients, as the code's ``proto_cluster``); classes without another class to compare
   take the smallest gap; margin m = min(max_c gap_c, ``margin_threshold`` = 100);
2. ``server_epochs`` (100) epochs of SGD (lr ``server_lr`` = 0.01 = the clients' lr in the code,
   batch ``server_batch`` = 10 = the clients' batch, shuffled by a generator seeded with
   (``server_seed``, round)) on

       L = CE(−(D + m·onehot(c)), c),   D_{b,c'} = ‖p_b − P_{c'}‖₂

   (the true class's distance is enlarged by the margin, so its prototype must come closer
   than every other by at least m);
3. the new global prototypes P_c for every class c (eval mode) are broadcast as FedProto's
   ``prototypes`` [C, d] / ``proto_classes`` [C] and the clients are sent ``lambda_proto``
   (10, the code's λ).

When a round has a single class, no gap exists and m = 0. Distances are taken as
sqrt(max(‖p‖² − 2p·P + ‖P‖², 0)) (the code's expansion, clamped so roundoff never gives a NaN),
the root :func:`broker_server.portable_ops.sqrt` (``torch.sqrt``'s CPU bits differ between CPUs).
The network's parameters are the strategy's state (checkpointed); the round's training works on a
copy, so nothing changes until the driver commits. Metrics: ``tgp_margin``, ``tgp_server_loss``
(the last batch's), ``prototype_classes``, ``global_prototype_cosine`` (the mean cosine between
the broadcast prototypes of different classes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ._base import GlobalUpdate
from ._prototype_net import PrototypeUploads
from ._registry import register_strategy
from ._trained_prototypes import TrainedPrototypes, trained_update
from .fedopt import check_range

if TYPE_CHECKING:
    import torch

#: Defaults of TsingZ0/FedTGP (SPECS §6.2).
LAMBDA = 10.0
SERVER_EPOCHS = 100
SERVER_LR = 0.01
SERVER_BATCH = 10
MARGIN_THRESHOLD = 100.0


def class_gaps(means: dict[int, np.ndarray]) -> dict[int, float]:
    """gap_c = the smallest L2 distance from class c's mean to another class's mean; a class
    without another (a single class) gets none (``{}`` for fewer than two classes)."""
    keys = sorted(means)
    out: dict[int, float] = {}
    for a in keys:
        d = [float(np.linalg.norm(np.asarray(means[a], np.float64) - np.asarray(means[b], np.float64)))
             for b in keys if b != a]
        if d:
            out[a] = min(d)
    return out


def adaptive_margin(means: dict[int, np.ndarray], threshold: float) -> float:
    """m = min(max_c gap_c, threshold) (0 with fewer than two classes)."""
    gaps = class_gaps(means)
    return min(max(gaps.values()), threshold) if gaps else 0.0


def margin_contrastive_loss(protos: torch.Tensor, labels: torch.Tensor, centers: torch.Tensor,
                            margin: float) -> torch.Tensor:
    """CE(−(D + m·onehot), y) with D the L2 distances [B, C] of ``protos`` [B, d] to ``centers``
    [C, d] (module docstring)."""
    import torch
    import torch.nn.functional as F

    from broker_server import portable_ops

    d2 = (protos * protos).sum(1, keepdim=True) - 2 * protos @ centers.T + (centers * centers).sum(1).unsqueeze(0)
    dist = portable_ops.sqrt(torch.clamp(d2, min=0.0) + 0.0)
    dist = dist + margin * F.one_hot(labels, centers.shape[0]).to(dist.dtype)
    return F.cross_entropy(-dist, labels)


class FedTGPAccumulator(PrototypeUploads):
    """One round of :class:`FedTGP`: the uploaded prototypes, then the server training."""

    def trained(self, protos: np.ndarray, classes: np.ndarray) -> GlobalUpdate | None:
        s = self.strategy
        means = {int(c): protos[classes == c].astype(np.float64).mean(axis=0) for c in np.unique(classes)}
        margin = adaptive_margin(means, s.margin_threshold)
        glob, state, last = self.train_network(
            protos, classes, lambda p, c, centers: margin_contrastive_loss(p, c, centers, margin))
        metrics: dict[str, float | int] = {"tgp_margin": float(margin)}
        if last == last:
            metrics["tgp_server_loss"] = last
        return trained_update(glob, state, metrics)


@register_strategy("fedtgp")
class FedTGP(TrainedPrototypes):
    """FedTGP strategy: FedProto's exchange and validation, the server-trained prototypes.

    Args:
        lambda_proto: λ sent to the clients (default 10).
        server_epochs (100), server_lr (0.01), server_batch (10), margin_threshold (100),
        server_seed (0): module docstring.
        participation_rate, min_clients, train_config: as :class:`FedAvg`.

    Raises:
        ValueError: a value out of range.

    C and d come from the bound model's classifier (:meth:`bind_model`); unbound, from the
    network's embedding once trained, else from the first round's uploads (d = their width,
    C = the largest class id + 1).
    """

    name = "fedtgp"
    accumulator_class = FedTGPAccumulator
    fixed_keywords = ("weighting",)  # λ_proto is FedTGP's own key (sent to its clients)

    def __init__(self, *, lambda_proto: float = LAMBDA, server_epochs: int = SERVER_EPOCHS,
                 server_lr: float = SERVER_LR, server_batch: int = SERVER_BATCH,
                 margin_threshold: float = MARGIN_THRESHOLD, server_seed: int = 0, **base: object) -> None:
        super().__init__(server_epochs=server_epochs, server_lr=server_lr, server_batch=server_batch,
                         server_seed=server_seed, lambda_proto=lambda_proto, **base)
        self.margin_threshold = check_range("margin_threshold", margin_threshold, 0.0, np.inf)
