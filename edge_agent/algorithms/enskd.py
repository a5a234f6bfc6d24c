"""EnsKD, client half: FedMCP++'s exchange with distillation only (SPECS §5.3, §5.5 baseline).

The knowledge-only baseline of the FedMCP++ comparison: ensemble knowledge distillation. Each
device keeps a private model and, like FedMCP++ (:mod:`edge_agent.algorithms.fedmcp`), uploads
its temperature-softened predictions on the public proxy set and its class prototypes; the server
returns a *uniform* average of them (ω_i = 1/K, :class:`broker_server.strategies.enskd.EnsKD`)
and the device distils from it: per round, ``T² · KL(p_T ‖ p_i)`` on the proxy set (when a
teacher came), then local cross-entropy, then the upload. The InfoNCE stage and the prototype
step are off (``infonce = false``, ``proto_align = false``), so the projections are never built.

The wire is FedMCP++'s, byte for byte: the prototypes still travel (42,560 fp32 tensor bytes per
upload with P = 1000, C = 10, d = 64), so a byte comparison with FedMCP++ isolates the teacher
weighting and the two alignment stages; the prototype teacher is formed and broadcast but unused
[choice: SPECS §5.3 says only "the same with uniform ω"].
"""

from __future__ import annotations

from collections.abc import Mapping

from ._registry import register_client_algorithm
from .fedmcp import FedMCPClient

#: The FedMCP++ hyperparameters EnsKD changes: no InfoNCE stage, no prototype step.
ENSKD_DEFAULTS: Mapping[str, object] = {"infonce": False, "proto_align": False}


@register_client_algorithm("enskd")
class EnsKDClient(FedMCPClient):
    """EnsKD client: :class:`~edge_agent.algorithms.fedmcp.FedMCPClient` with the defaults
    :data:`ENSKD_DEFAULTS` (KD and local CE only). Same constructor and round; a round config
    that names ``infonce`` / ``proto_align`` still wins (the server's always does)."""

    name = "enskd"
    share = "none"
    buffers = "average"

    hyperparameter_defaults = ENSKD_DEFAULTS
