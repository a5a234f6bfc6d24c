"""Local, client half: each device trains its own model alone (the no-communication baseline).

The "Local" row of the FedMCP++ comparison (SPECS §5.5): client i trains its private model with
cross-entropy for E local epochs per round and never uploads model tensors (``share = "none"``)
nor extras. To keep the round loop uniform it still answers each ``round_start`` with an
``update`` that carries no tensors — only ``num_samples``, ``train_loss`` and metrics (with
``[server] client_eval = true``, the accuracy of its own model) — so the only bytes of a Local
run are the rounds' control traffic: ``round_start``, an empty ``global`` (metadata, no tensors),
the tensor-less ``update``, receipts and the MQTT control packets. The server's "global model"
carries nothing; the measure is client-side evaluation (``[server] client_eval = true``), which
the server then reports as the round's accuracy.

The model persists across rounds in the agent's model object (the agent keeps it for the run).
"""

from __future__ import annotations

from ._registry import register_client_algorithm
from .fedprox import LocalSGDClient


@register_client_algorithm("local")
class LocalClient(LocalSGDClient):
    """Local client: FedAvg's local SGD on the device's own model (:class:`LocalSGDClient`
    without hooks); loads and uploads no tensors (``share = "none"``).

    ``global_tensors`` must be ``()`` and :attr:`LocalResult.tensors` is ``()``.

    Args:
        precision: ``"fp32"`` (default) or ``"fp16"`` (CUDA autocast), as for FedAvg.

    Raises:
        ValueError: unknown ``precision``.
    """

    name = "local"
    share = "none"
    buffers = "average"

