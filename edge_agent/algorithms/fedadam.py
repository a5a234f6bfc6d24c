"""FedAdam, client half: FedAvg's client, unchanged.

Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2 (SPECS §6.14): clients
run local SGD from the global model and upload their models, exactly as FedAvg; the server
(:class:`broker_server.strategies.fedadam.FedAdam`) treats the averaged change as a
pseudo-gradient and takes an Adam step.
"""

from __future__ import annotations

from ._registry import register_client_algorithm
from .fedavg import FedAvgClient


@register_client_algorithm("fedadam")
class FedAdamClient(FedAvgClient):
    """FedAdam client: identical to :class:`~edge_agent.algorithms.fedavg.FedAvgClient` (local SGD,
    full model upload); only the server's step differs."""

    name = "fedadam"
    share = "all"
    buffers = "average"
