"""FedNTD, server half: FedAvg; β and τ go to the clients (SPECS.md §6.8; Lee et al., NeurIPS
2022: the server is FedAvg, only the local objective changes, :mod:`edge_agent.algorithms.fedntd`).
``[algorithm] beta`` (1) and ``tau`` (1) are sent in every ``round_start.config``.
"""

from __future__ import annotations

import numpy as np

from edge_agent.algorithms.fedntd import BETA, TAU

from ._registry import register_strategy
from .fedavg import FedAvg
from .fedopt import check_range


@register_strategy("fedntd")
class FedNTD(FedAvg):
    """FedAvg that tells its clients β ≥ 0 and τ > 0 (streaming aggregation, no state).

    Raises:
        ValueError: ``beta`` < 0, ``tau`` ≤ 0, or either not finite.
    """

    name = "fedntd"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()

    def __init__(self, *, beta: float = BETA, tau: float = TAU, **kw) -> None:
        super().__init__(**kw)
        self.beta = check_range("beta", beta, 0.0, np.inf)
        self.tau = check_range("tau", tau, 0.0, np.inf, low_open=True)
        self.train_config.update(beta=self.beta, tau=self.tau)
