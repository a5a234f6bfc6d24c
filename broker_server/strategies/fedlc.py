"""FedLC, server half: FedAvg; τ goes to the clients (SPECS.md §6.9; Zhang et al., ICML 2022: the
server is FedAvg, only the local loss changes, :mod:`edge_agent.algorithms.fedlc`).
``[algorithm] tau`` (1.0) is sent in every ``round_start.config``.
"""

from __future__ import annotations

import numpy as np

from edge_agent.algorithms.fedlc import TAU

from ._registry import register_strategy
from .fedavg import FedAvg
from .fedopt import check_range


@register_strategy("fedlc")
class FedLC(FedAvg):
    """FedAvg that tells its clients τ ≥ 0 (streaming aggregation, no state).

    Raises:
        ValueError: ``tau`` < 0 or not finite.
    """

    name = "fedlc"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()

    def __init__(self, *, tau: float = TAU, **kw) -> None:
        super().__init__(**kw)
        self.tau = check_range("tau", tau, 0.0, np.inf)
        self.train_config["tau"] = self.tau
