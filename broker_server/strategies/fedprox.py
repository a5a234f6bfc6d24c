"""FedProx, server half: FedAvg's aggregation; the proximal coefficient μ goes to the clients.

Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020 (SPECS §6.17): the
server is FedAvg (sample-weighted mean of the reported models); only the clients' objective
changes (:mod:`edge_agent.algorithms.fedprox`). ``[algorithm] mu`` (default 0.01) is sent in every
``round_start.config`` as ``mu``.
"""

from __future__ import annotations

import numpy as np

from edge_agent.algorithms.fedprox import MU

from ._registry import register_strategy
from .fedavg import FedAvg
from .fedopt import check_range


@register_strategy("fedprox")
class FedProx(FedAvg):
    """FedAvg that tells its clients μ (streaming aggregation and empty state as FedAvg).

    Args:
        participation_rate, min_clients, train_config: as :class:`FedAvg`.
        mu: proximal coefficient μ ≥ 0 (default :data:`edge_agent.algorithms.fedprox.MU`).

    Raises:
        ValueError: ``mu`` negative or not finite.
    """

    name = "fedprox"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()

    def __init__(self, *, mu: float = MU, **kw) -> None:
        super().__init__(**kw)
        self.mu = check_range("mu", mu, 0.0, np.inf)
        self.train_config["mu"] = self.mu
