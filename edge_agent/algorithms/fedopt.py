"""FedOpt (server SGD with momentum), client half: FedAvg's client, unchanged.

Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 1 (SPECS §6.14): in the
FedOpt family only the server's update rule changes; clients run plain local SGD from the global
model and upload their models, exactly as FedAvg. The server half
(:class:`broker_server.strategies.fedopt.FedOpt`) is the variant that RethinkFL — the code base
FedPAD forks — calls "FedOpt": server SGD with momentum on the averaged update.
"""

from __future__ import annotations

from ._registry import register_client_algorithm
from .fedavg import FedAvgClient


@register_client_algorithm("fedopt")
class FedOptClient(FedAvgClient):
    """FedOpt client: identical to :class:`~edge_agent.algorithms.fedavg.FedAvgClient` (local SGD,
    full model upload); only the server's step differs."""

    name = "fedopt"
    share = "all"
    buffers = "average"
