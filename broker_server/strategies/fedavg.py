"""FedAvg, server half (McMahan et al., AISTATS 2017, Algorithm 1).

w_{t+1} = Σ_k (n_k / n) · w_{t+1}^k over the clients k that reported in round t, with
n = Σ_k n_k. Client selection: a fraction C (participation rate) of the available clients,
at least the quorum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..aggregate import RunningWeightedSum, select_clients, weighted_average
from ._base import Accumulator, ClientResult, GlobalUpdate, RoundPlan, Strategy
from ._registry import register_strategy


@register_strategy("fedavg")
class FedAvg(Strategy):
    """FedAvg strategy.

    Args:
        participation_rate: fraction C of available clients asked per round, in (0, 1].
        min_clients: never ask fewer than this many (capped at the number available).
        train_config: scalars sent in every ``round_start`` (local_epochs, batch_size, lr …).
    """

    name = "fedavg"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()

    def __init__(self, *, participation_rate: float = 1.0, min_clients: int = 1,
                 train_config: Mapping[str, float | int | str | bool] | None = None) -> None:
        if not 0 < participation_rate <= 1:
            raise ValueError(f"participation_rate must be in (0, 1], got {participation_rate}")
        self.participation_rate = participation_rate
        self.min_clients = min_clients
        self.train_config = dict(train_config or {})

    def configure_round(self, round: int, available: Sequence[str], rng: np.random.Generator) -> RoundPlan:
        """Select clients for ``round`` and attach the training configuration."""
        selected = select_clients(available, self.participation_rate, self.min_clients, rng)
        return RoundPlan(selected=tuple(selected), config=dict(self.train_config))

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        """Sample-weighted mean of the reported models; ``None`` (no change) when nothing came back."""
        if not results:
            return None
        return GlobalUpdate(tensors=weighted_average([r.tensors for r in results], [r.num_samples for r in results]))

    def accumulator(self, round: int, current: Sequence[np.ndarray]) -> Accumulator:
        """Streaming form of :meth:`aggregate`: each update is folded into running weighted sums
        on arrival, so server memory is one model whatever the number of clients."""
        return FedAvgAccumulator()

    def state_dict(self) -> dict:
        """FedAvg keeps no state between rounds."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


class FedAvgAccumulator:
    """Running Σ n_k·w_k and Σ n_k over a round's accepted updates (same result as
    :func:`~broker_server.aggregate.weighted_average` on the whole list)."""

    def __init__(self) -> None:
        self._sum = RunningWeightedSum()

    def add(self, result: ClientResult) -> None:
        self._sum.add(result.tensors, result.num_samples)

    def result(self) -> GlobalUpdate | None:
        return GlobalUpdate(tensors=self._sum.mean()) if self._sum.count else None
