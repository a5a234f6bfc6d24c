"""The server half of the public API: the strategy contract (:class:`Strategy` and the records
it exchanges with the driver) and :class:`FedAvg`, the base to subclass when a strategy keeps
FedAvg's client selection and round config and changes only its aggregation.

Subclass :class:`Strategy` (implement ``aggregate``; every other hook has a default, see the
README's hook table) or :class:`FedAvg`. The runtime builds a strategy with the keywords its
constructor takes among ``participation_rate``, ``min_clients`` and ``train_config`` (from
``[server]`` and ``[train]``), plus every ``[algorithm]`` key and what ``setup_kwargs`` returns.
"""

from __future__ import annotations

from broker_server.aggregate import RunningWeightedSum, select_clients, weighted_average
from broker_server.strategies import (
    Accumulator,
    BufferedAccumulator,
    ClientReport,
    ClientResult,
    GlobalUpdate,
    RoundPlan,
    Strategy,
)
from broker_server.strategies._base import Scalar, classifier_shape, parameter_count
from broker_server.strategies.fedavg import FedAvg

__all__ = [
    "Accumulator", "BufferedAccumulator", "ClientReport", "ClientResult", "FedAvg", "GlobalUpdate", "RoundPlan",
    "RunningWeightedSum", "Scalar", "Strategy", "classifier_shape", "parameter_count", "select_clients",
    "weighted_average",
]
