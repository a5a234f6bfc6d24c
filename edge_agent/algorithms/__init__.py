"""Client halves of the federated algorithms, registered by name.

Each algorithm has one name and two files with the same stem: ``edge_agent/algorithms/<name>.py``
(what the device computes) and ``broker_server/strategies/<name>.py`` (what the server computes).

>>> from edge_agent.algorithms import get_client_algorithm
>>> algo = get_client_algorithm("fedavg")
"""

from __future__ import annotations

from ._base import ClientAlgorithm, LocalResult, TrainConfig
from ._registry import get_client_algorithm, list_client_algorithms, register_client_algorithm
from . import fedavg as _fedavg  # noqa: F401  (registers "fedavg")

__all__ = sorted(["ClientAlgorithm", "LocalResult", "TrainConfig", "get_client_algorithm",
                  "list_client_algorithms", "register_client_algorithm"])
