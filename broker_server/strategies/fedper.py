"""FedPer, server half: FedAvg over the shared base only (SPECS §6.15).

Arivazhagan et al., "Federated Learning with Personalization Layers", arXiv:1912.00818, 2019:
the server holds only the base (``backbone.*`` entries; ``share = "backbone"``) and sets
φ_{t+1} = Σ_k (n_k / n) · φ_{t+1}^k over the clients k that reported — FedAvg's rule applied
to the shared subset; the personalization layers never reach the server.
"""

from __future__ import annotations

from ._registry import register_strategy
from .fedavg import FedAvg


@register_strategy("fedper")
class FedPer(FedAvg):
    """FedPer strategy: :class:`~broker_server.strategies.fedavg.FedAvg` with ``share = "backbone"``.

    ``current`` and each result's ``tensors`` are the backbone arrays in manifest order; the
    sample-weighted mean (streaming, :class:`~broker_server.strategies.fedavg.FedAvgAccumulator`;
    equal weights with ``weighting = "uniform"``) is the new global backbone. Same constructor as
    FedAvg.
    """

    name = "fedper"
    share = "backbone"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()

