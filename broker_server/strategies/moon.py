"""MOON, server half: FedAvg; μ and τ go to the clients (SPECS.md §6.7; Li, He, Song, CVPR 2021:
the server aggregates as FedAvg, only the local objective changes,
:mod:`edge_agent.algorithms.moon`). ``[algorithm] mu`` (1) and ``tau`` (0.5) are sent in every
``round_start.config``.
"""

from __future__ import annotations

import numpy as np

from edge_agent.algorithms.moon import MU, TAU

from ._registry import register_strategy
from .fedavg import FedAvg
from .fedopt import check_range


@register_strategy("moon")
class Moon(FedAvg):
    """FedAvg that tells its clients μ ≥ 0 and τ > 0 (streaming aggregation, no state).

    Raises:
        ValueError: ``mu`` < 0, ``tau`` ≤ 0, or either not finite.
    """

    name = "moon"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()

    def __init__(self, *, mu: float = MU, tau: float = TAU, **kw) -> None:
        super().__init__(**kw)
        self.mu = check_range("mu", mu, 0.0, np.inf)
        self.tau = check_range("tau", tau, 0.0, np.inf, low_open=True)
        self.train_config.update(mu=self.mu, tau=self.tau)
