"""EnsKD, server half: FedMCP++'s teacher with uniform weights (SPECS §5.3 baseline).

``p_T = (1/K) Σ_i p_i`` and ``P_T = (1/K) Σ_i P_i`` over the K clients that reported, instead of
FedMCP++'s proxy-accuracy weights ω_i = a_i / Σ_j a_j; the clients distil without the InfoNCE
and prototype stages (:mod:`edge_agent.algorithms.enskd`). No model tensor travels.
"""

from __future__ import annotations

from edge_agent.algorithms.enskd import ENSKD_DEFAULTS

from ._registry import register_strategy
from .fedmcp import FedMCP


@register_strategy("enskd")
class EnsKD(FedMCP):
    """EnsKD strategy: :class:`~broker_server.strategies.fedmcp.FedMCP` with
    ``weighting = "uniform"`` and the hyperparameter defaults :data:`ENSKD_DEFAULTS`
    (``infonce = false``, ``proto_align = false``), which every round's config carries to the
    clients. Same constructor; ``[algorithm]`` keys override the defaults."""

    name = "enskd"
    share = "none"
    buffers = "average"
    model_requirement = "prototype"
    instructions = ()

    default_weighting = "uniform"
    hyperparameter_defaults = ENSKD_DEFAULTS
