"""FedPer, client half: joint local training, only the base (backbone) travels.

Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with Personalization Layers",
arXiv:1912.00818, 2019 (SPECS §6.15; code: PFLlib ``clientper.py``). Each round client i loads
the global base (the ``backbone.*`` entries of the light CNN) into its model, trains base and its
private personalization layer (``classifier.*``) jointly with cross-entropy for E local epochs —
the FedAvg ClientUpdate on the whole model — and uploads the base only; the server averages the
bases (:class:`broker_server.strategies.fedper.FedPer`).

The head stays in the agent's model object, which the agent keeps for the whole run, so
client-side evaluation (``[server] client_eval = true``) scores each client's personal model.
"""

from __future__ import annotations

from ._registry import register_client_algorithm
from .fedprox import LocalSGDClient


@register_client_algorithm("fedper")
class FedPerClient(LocalSGDClient):
    """FedPer client: FedAvg's local SGD on the whole model (:class:`LocalSGDClient` without
    hooks); loads and uploads the backbone only (``share = "backbone"``).

    Upload per round: for the light CNN on 28×28 grayscale 105,216 parameters × 4 bytes =
    420,864 body bytes of tensor data (the 650 head parameters stay on the device). A
    ``global_tensors`` that is not the backbone raises ``ModelError``.

    Args:
        precision: ``"fp32"`` (default) or ``"fp16"`` (CUDA autocast), as for FedAvg.

    Raises:
        ValueError: unknown ``precision``.
    """

    name = "fedper"
    share = "backbone"
    buffers = "average"

