"""FedORGP, server half: trainable global prototypes with an orthogonality regulariser (Guo et
al., "FedORGP: Guiding Heterogeneous Federated Learning with Orthogonality Regularization on
Global Prototypes", arXiv 2502.16119; SPECS.md §6.5; the client half is
:mod:`edge_agent.algorithms.fedorgp`). FedOCP's strongest baseline in its paper (SPECS §3.6).

The exchange is FedProto's: each client uploads its class-mean features, the server broadcasts
one prototype per class. The server keeps FedTGP's network (SPECS §6.5: "Server generator as in
FedTGP"; :func:`~broker_server.strategies._prototype_net.prototype_net`),
``P_c = fc(ReLU(W · Emb(c) + b))``, and each round trains it for ``server_epochs`` epochs of SGD
(lr ``server_lr``, batch ``server_batch``, shuffled by (``server_seed``, round)) over the
uploaded (p, c) pairs on

    L_s = λ_s · (1 − mean_b cos(p_b, P_{c_b})) + γ · mean_b mean_{c' ≠ c_b} |cos(p_b, P_{c'})|

(:func:`orgp_server_loss`; SPECS §6.5: a client prototype is pulled toward its class's global
prototype and pushed **orthogonal** to every other class's, in absolute cosine), then broadcasts
the P_c of every class (eval mode, float32) as ``prototypes`` [C, d] / ``proto_classes`` [C].
The clients are sent ``lambda_client`` (λ_c of their alignment loss).

============================  ========  ========================================================
key                           default   reason
============================  ========  ========================================================
``lambda_client``             100       λ_c: the paper's best (λ_c, λ_s, γ) = (100, 1, 10)
``lambda_server``             1         λ_s: as above (its code's default is (1, 1, 1))
``gamma``                     10        γ: as above
``server_epochs``             1         FedORGP's (SPECS §6.5: "server 1 epoch")
``server_lr``                 0.01      FedORGP §5.1 (= the clients' lr)
``server_batch``              32        FedORGP §5.1 (batch 32 for client and server)
``server_seed``               0         the network's initial weights and the shuffling
============================  ========  ========================================================

SPECS' means are used where the authors' code sums over the batch (and over the other classes);
the sums scale the gradient by the batch size, which SPECS' form leaves to ``server_lr``. The
outlier filtering and adaptive weights of the code's latest commit are not in the paper and are
left out (SPECS §6.5). The network's state is the strategy's (checkpointed); the round trains a
copy. Metrics: ``prototype_classes``, ``global_prototype_cosine`` (the mean cosine between the
broadcast prototypes of different classes), ``orgp_server_loss`` (the last batch's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ._base import GlobalUpdate, RoundPlan
from ._prototype_net import PrototypeUploads
from ._registry import register_strategy
from ._trained_prototypes import TrainedPrototypes, trained_update
from .fedavg import FedAvg
from .fedopt import check_range

if TYPE_CHECKING:
    import numpy.random
    import torch

#: The paper's best weights and FedORGP §5.1's server optimisation (SPECS §6.5).
LAMBDA_CLIENT = 100.0
LAMBDA_SERVER = 1.0
GAMMA = 10.0
SERVER_EPOCHS = 1
SERVER_LR = 0.01
SERVER_BATCH = 32


def orgp_server_loss(protos: torch.Tensor, labels: torch.Tensor, centers: torch.Tensor, lambda_server: float,
                     gamma: float) -> torch.Tensor:
    """FedORGP's server loss (SPECS §6.5):
    ``λ_s · (1 − mean_b cos(p_b, P_{y_b})) + γ · mean_b mean_{c ≠ y_b} |cos(p_b, P_c)|``.

    Args:
        protos: uploaded client prototypes, float [B, d].
        labels: their classes, int64 [B] in [0, C).
        centers: the generated global prototypes, float [C, d] (C ≥ 2 for the second term; with
            C = 1 it is 0).
        lambda_server, gamma: λ_s, γ.

    Returns:
        A scalar tensor. Zero-length rows count as cosine 0 (``F.normalize``'s ε).
    """
    import torch
    import torch.nn.functional as F

    cos = F.normalize(protos, dim=1) @ F.normalize(centers, dim=1).T  # [B, C]
    own = cos.gather(1, labels.view(-1, 1)).squeeze(1)
    num_classes = centers.shape[0]
    if num_classes < 2:
        return lambda_server * (1 - own.mean())
    others = torch.ones_like(cos, dtype=torch.bool).scatter_(1, labels.view(-1, 1), False)
    inter = (cos.abs() * others).sum(1) / (num_classes - 1)
    return lambda_server * (1 - own.mean()) + gamma * inter.mean()


class FedORGPAccumulator(PrototypeUploads):
    """One round of :class:`FedORGP`: the uploaded prototypes, then the server training."""

    def trained(self, protos: np.ndarray, classes: np.ndarray) -> GlobalUpdate | None:
        s = self.strategy
        glob, state, last = self.train_network(
            protos, classes, lambda p, c, centers: orgp_server_loss(p, c, centers, s.lambda_server, s.gamma))
        return trained_update(glob, state, {"orgp_server_loss": last} if last == last else {})


@register_strategy("fedorgp")
class FedORGP(TrainedPrototypes):
    """FedORGP strategy: FedProto's exchange and validation, prototypes trained with the
    orthogonality regulariser.

    Args:
        lambda_client, lambda_server, gamma, server_epochs, server_lr, server_batch, server_seed:
            the table of the module docstring.
        participation_rate, min_clients, train_config: as :class:`FedAvg`.

    Raises:
        ValueError: a value out of range or of the wrong type, naming the key.

    C and d come from the bound model's classifier (:meth:`bind_model`); unbound, from the
    network's embedding once trained, else from the first round's uploads.
    """

    name = "fedorgp"
    accumulator_class = FedORGPAccumulator

    def __init__(self, *, lambda_client: float = LAMBDA_CLIENT, lambda_server: float = LAMBDA_SERVER,
                 gamma: float = GAMMA, server_epochs: int = SERVER_EPOCHS, server_lr: float = SERVER_LR,
                 server_batch: int = SERVER_BATCH, server_seed: int = 0, **base: object) -> None:
        super().__init__(server_epochs=server_epochs, server_lr=server_lr, server_batch=server_batch,
                         server_seed=server_seed, lambda_proto=0.0, **base)
        self.lambda_client = check_range("lambda_client", lambda_client, 0.0, np.inf)
        self.lambda_server = check_range("lambda_server", lambda_server, 0.0, np.inf)
        self.gamma = check_range("gamma", gamma, 0.0, np.inf)

    def configure_round(self, round: int, available: Sequence[str], rng: numpy.random.Generator) -> RoundPlan:
        """FedAvg's client selection; ``lambda_client`` in the config."""
        plan = FedAvg.configure_round(self, round, available, rng)
        return RoundPlan(selected=plan.selected, config={**plan.config, "lambda_client": self.lambda_client})
