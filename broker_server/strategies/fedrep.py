"""FedRep, server half: FedAvg over the shared representation (SPECS §6.16).

Collins et al., "Exploiting Shared Representations for Personalized Federated Learning", ICML
2021, Algorithm 1: the server averages the clients' representations (``backbone.*``,
``share = "backbone"``) with FedAvg weights n_k / n; heads stay on the devices. The strategy
also tells the clients how many head epochs to run before the representation epochs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from edge_agent.algorithms.fedrep import HEAD_EPOCHS

from ._base import RoundPlan
from ._registry import register_strategy
from .fedper import FedPer


@register_strategy("fedrep")
class FedRep(FedPer):
    """FedRep strategy: FedPer's backbone averaging plus the ``head_epochs`` round setting.

    Args:
        head_epochs: head epochs per round with the backbone frozen (τ_h), an int ≥ 1; default 1
            as PFLlib's ``plocal_epochs``; the paper uses about 10. Sent in every
            ``round_start.config`` as ``head_epochs``; the representation epochs are the usual
            ``local_epochs``.
        participation_rate, min_clients, train_config, weighting: as for FedAvg (FedPer's
            backbone average: n_k, or equal weights with ``"uniform"``).

    Raises:
        ValueError: ``head_epochs`` not an int ≥ 1; a bad ``participation_rate`` or ``weighting``.
    """

    name = "fedrep"
    share = "backbone"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()

    def __init__(self, *, head_epochs: int = HEAD_EPOCHS, participation_rate: float = 1.0, min_clients: int = 1,
                 train_config: Mapping[str, float | int | str | bool] | None = None,
                 weighting: str = "samples") -> None:
        if isinstance(head_epochs, bool) or not isinstance(head_epochs, int) or head_epochs < 1:
            raise ValueError(f"head_epochs must be an integer >= 1, got {head_epochs!r}")
        super().__init__(participation_rate=participation_rate, min_clients=min_clients, train_config=train_config,
                         weighting=weighting)
        self.head_epochs = head_epochs

    def configure_round(self, round: int, available: Sequence[str], rng: np.random.Generator) -> RoundPlan:
        """FedAvg's selection; the config also carries ``head_epochs``."""
        plan = super().configure_round(round, available, rng)
        return RoundPlan(selected=plan.selected, config={**plan.config, "head_epochs": self.head_epochs})
