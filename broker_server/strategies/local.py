"""Local, server half: no aggregation (the no-communication baseline of SPECS §5.5).

Clients train alone and send tensor-less updates (``share = "none"``: no model tensors, no
extras; only ``num_samples``, ``train_loss`` and metrics). The server still runs the rounds —
selection, deadlines, receipts, the clients' evaluation metrics in ``metrics.jsonl`` — but its
"global model" carries nothing: every round's aggregate is "no change".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ._base import ClientResult, GlobalUpdate
from ._registry import register_strategy
from .fedavg import FedAvg


@register_strategy("local")
class Local(FedAvg):
    """Local strategy: FedAvg's client selection, nothing aggregated. FedAvg's constructor
    without ``weighting`` (there is no mean to weight).

    Raises:
        ValueError: as :class:`FedAvg`.
    """

    name = "local"
    share = "none"
    buffers = "average"
    model_requirement = "prototype"
    instructions = ()

    def __init__(self, *, participation_rate: float = 1.0, min_clients: int = 1,
                 train_config: Mapping[str, float | int | str | bool] | None = None) -> None:
        super().__init__(participation_rate=participation_rate, min_clients=min_clients, train_config=train_config)

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        """Always ``None``: no change (there is no shared model)."""
        return None

    def accumulator(self, round: int, current: Sequence[np.ndarray]) -> NoAggregation:
        """An accumulator that keeps nothing (memory does not grow with the fleet)."""
        return NoAggregation()


class NoAggregation:
    """Accumulator of a strategy without a shared model: ignores results, result ``None``."""

    def add(self, result: ClientResult) -> None:
        """Ignore ``result`` (the server has already ledgered and acknowledged it)."""

    def result(self) -> GlobalUpdate | None:
        """``None``: no change."""
        return None
