"""Server halves of the federated algorithms, registered by name (see ``edge_agent.algorithms``).

A strategy never publishes: :meth:`configure_round` says what to send and whom to ask,
:meth:`aggregate` (or the round's accumulator) turns the round's results into ONE
:class:`GlobalUpdate`, which the server driver commits (:meth:`Strategy.commit`) only when it is
finite and encodable; the driver owns the round loop and the wire. Every hook is declared, with
its default, on :class:`Strategy` (``_base.py``).
"""

from __future__ import annotations

from . import enskd as _enskd  # noqa: F401  (registers "enskd")
from . import fedaa as _fedaa  # noqa: F401  (registers "fedaa")
from . import fedadam as _fedadam  # noqa: F401  (registers "fedadam")
from . import fedavg as _fedavg  # noqa: F401  (registers "fedavg")
from . import fedcross as _fedcross  # noqa: F401  (registers "fedcross")
from . import feddo as _feddo  # noqa: F401  (registers "feddo")
from . import feddyn as _feddyn  # noqa: F401  (registers "feddyn")
from . import fedgh as _fedgh  # noqa: F401  (registers "fedgh")
from . import fedlc as _fedlc  # noqa: F401  (registers "fedlc")
from . import fedmcp as _fedmcp  # noqa: F401  (registers "fedmcp")
from . import fedntd as _fedntd  # noqa: F401  (registers "fedntd")
from . import fedocp as _fedocp  # noqa: F401  (registers "fedocp")
from . import fedopt as _fedopt  # noqa: F401  (registers "fedopt")
from . import fedorgp as _fedorgp  # noqa: F401  (registers "fedorgp")
from . import fedpad as _fedpad  # noqa: F401  (registers "fedpad")
from . import fedper as _fedper  # noqa: F401  (registers "fedper")
from . import fedpgp as _fedpgp  # noqa: F401  (registers "fedpgp")
from . import fedproto as _fedproto  # noqa: F401  (registers "fedproto", "fedproto-avg")
from . import fedprox as _fedprox  # noqa: F401  (registers "fedprox")
from . import fedrep as _fedrep  # noqa: F401  (registers "fedrep")
from . import fedtgp as _fedtgp  # noqa: F401  (registers "fedtgp")
from . import fpl as _fpl  # noqa: F401  (registers "fpl")
from . import local as _local  # noqa: F401  (registers "local")
from . import moon as _moon  # noqa: F401  (registers "moon")
from . import oort as _oort  # noqa: F401  (registers "oort")
from . import scaffold as _scaffold  # noqa: F401  (registers "scaffold")
from ._base import (
    BUFFERS,
    MODEL_REQUIREMENTS,
    SHARES,
    Accumulator,
    BufferedAccumulator,
    ClientReport,
    ClientResult,
    GlobalUpdate,
    RoundPlan,
    Strategy,
    accumulator_for,
    apply_update,
    client_metrics,
    round_config,
    round_result,
    server_evaluate,
    update_problem,
)
from ._registry import check_strategy_class, get_strategy, get_strategy_class, list_strategies, register_strategy

__all__ = [
    "Accumulator", "BUFFERS", "BufferedAccumulator", "ClientReport", "ClientResult", "GlobalUpdate",
    "MODEL_REQUIREMENTS", "RoundPlan", "SHARES", "Strategy", "accumulator_for", "apply_update", "check_strategy_class",
    "client_metrics", "get_strategy", "get_strategy_class", "list_strategies", "register_strategy", "round_config",
    "round_result", "server_evaluate", "update_problem",
]
