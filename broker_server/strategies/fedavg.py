"""FedAvg, server half (McMahan et al., AISTATS 2017, Algorithm 1).

w_{t+1} = Σ_k (n_k / n) · w_{t+1}^k over the clients k that reported in round t, with
n = Σ_k n_k. Client selection: a fraction C (participation rate) of the available clients,
at least the quorum.

``[algorithm] weighting = "uniform"`` replaces n_k by 1: w_{t+1} = (1/K) Σ_k w_{t+1}^k, the
unweighted mean of the K reported models (the model mean of SCAFFOLD's and FedDyn's papers, and
what FedPAD's α reduces to when all θ_i are equal). It is the control that separates a method's
own reweighting from the plain change from sample weights to equal weights: on a domain-silo
split a domain held by one client with a large shard gets n_k / n of the weight under
``"samples"`` but 1/K under ``"uniform"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..aggregate import RunningWeightedSum, select_clients, weighted_average
from ._base import Accumulator, ClientResult, GlobalUpdate, RoundPlan, Strategy
from ._registry import register_strategy

#: How the reported models are weighted in the mean: ``"samples"`` (n_k, McMahan et al.) or ``"uniform"`` (1).
MODEL_WEIGHTINGS = ("samples", "uniform")


@register_strategy("fedavg")
class FedAvg(Strategy):
    """FedAvg strategy.

    Args:
        participation_rate: fraction C of available clients asked per round, in (0, 1].
        min_clients: never ask fewer than this many (capped at the number available).
        train_config: scalars sent in every ``round_start`` (local_epochs, batch_size, lr …).
        weighting: ``"samples"`` (default: client k's model weighs n_k, its sample count) or
            ``"uniform"`` (every reported model weighs 1); see the module docstring. Kept as
            :attr:`model_weighting`.

    Raises:
        ValueError: ``participation_rate`` outside (0, 1]; ``weighting`` not one of
            :data:`MODEL_WEIGHTINGS`.
    """

    name = "fedavg"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()

    def __init__(self, *, participation_rate: float = 1.0, min_clients: int = 1,
                 train_config: Mapping[str, float | int | str | bool] | None = None,
                 weighting: str = "samples") -> None:
        if not 0 < participation_rate <= 1:
            raise ValueError(f"participation_rate must be in (0, 1], got {participation_rate}")
        if weighting not in MODEL_WEIGHTINGS:
            raise ValueError(f"weighting must be one of {MODEL_WEIGHTINGS}, got {weighting!r}")
        self.participation_rate = participation_rate
        self.min_clients = min_clients
        self.train_config = dict(train_config or {})
        self.model_weighting = weighting

    def configure_round(self, round: int, available: Sequence[str], rng: np.random.Generator) -> RoundPlan:
        """Select clients for ``round`` and attach the training configuration."""
        selected = select_clients(available, self.participation_rate, self.min_clients, rng)
        return RoundPlan(selected=tuple(selected), config=dict(self.train_config))

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        """Mean of the reported models, weighted by n_k (``weighting = "samples"``) or equally
        (``"uniform"``); ``None`` (no change) when nothing came back."""
        if not results:
            return None
        uniform = self.model_weighting == "uniform"
        return GlobalUpdate(tensors=weighted_average([r.tensors for r in results],
                                                     [1.0 if uniform else r.num_samples for r in results]))

    def accumulator(self, round: int, current: Sequence[np.ndarray]) -> Accumulator:
        """Streaming form of :meth:`aggregate`: each update is folded into running weighted sums
        on arrival, so server memory is one model whatever the number of clients."""
        return FedAvgAccumulator(self.model_weighting)

    def state_dict(self) -> dict:
        """FedAvg keeps no state between rounds."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


class FedAvgAccumulator:
    """Running Σ n_k·w_k and Σ n_k over a round's accepted updates (same result as
    :func:`~broker_server.aggregate.weighted_average` on the whole list); with
    ``weighting = "uniform"`` every update weighs 1 instead of n_k.

    Raises:
        ValueError: ``weighting`` not one of :data:`MODEL_WEIGHTINGS`.
    """

    def __init__(self, weighting: str = "samples") -> None:
        if weighting not in MODEL_WEIGHTINGS:
            raise ValueError(f"weighting must be one of {MODEL_WEIGHTINGS}, got {weighting!r}")
        self._uniform = weighting == "uniform"
        self._sum = RunningWeightedSum()

    def add(self, result: ClientResult) -> None:
        self._sum.add(result.tensors, 1.0 if self._uniform else result.num_samples)

    def result(self) -> GlobalUpdate | None:
        return GlobalUpdate(tensors=self._sum.mean()) if self._sum.count else None
