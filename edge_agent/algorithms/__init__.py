"""Client halves of the federated algorithms, registered by name.

Each algorithm has one name and two files with the same stem: ``edge_agent/algorithms/<name>.py``
(what the device computes) and ``broker_server/strategies/<name>.py`` (what the server computes).

>>> from edge_agent.algorithms import get_client_algorithm
>>> algo = get_client_algorithm("fedavg")
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from ..errors import EdgeAgentError
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
    SHARES,
    ClientAlgorithm,
    LocalResult,
    StepContext,
    TrainConfig,
    algorithm_share,
    load_shared,
    local_entries,
    predict_scores,
    private_entries,
    restarted_device_state,
    shared_arrays,
    shared_indices,
)
from ._registry import (
    check_client_class,
    get_client_algorithm,
    get_client_algorithm_class,
    list_client_algorithms,
    register_client_algorithm,
)


def _algorithm_class(name: str) -> type[ClientAlgorithm]:
    # the registry is untyped (it returns ``type``); it holds only ClientAlgorithm subclasses
    return cast("type[ClientAlgorithm]", get_client_algorithm_class(name))


def algorithm_setup(name: str, dataset, params: Mapping[str, object], seed: int) -> dict:
    """Data-dependent constructor arguments of a client algorithm or its strategy (e.g. the
    public proxy set of FedMCP++), from the class's optional ``setup_kwargs(dataset, params,
    seed)`` classmethod; ``{}`` for algorithms without one.

    Raises:
        EdgeAgentError: unknown algorithm.
    """
    return dict(_algorithm_class(name).setup_kwargs(dataset, params, seed))


def build_client_algorithm(name: str, *, precision: str = "fp32", setup: Mapping[str, object] | None = None
                           ) -> ClientAlgorithm:
    """The client half of algorithm ``name`` for one device, built with ``precision`` (passed
    only when its constructor takes it: a user's class need not) and the data-dependent
    ``setup`` (:func:`algorithm_setup`).

    Raises:
        EdgeAgentError: unknown algorithm, a user's class that does not fit, or ``setup`` keys
            its constructor does not take (naming them).
        TypeError, ValueError: the constructor refused a value.
    """
    from ..plugins import accepted_keywords

    cls = _algorithm_class(name)
    names, any_keyword = accepted_keywords(cls)
    kwargs = dict(setup or {})
    extra = sorted(set(kwargs) - names) if not any_keyword else []
    if extra:
        raise EdgeAgentError(f"algorithm {name!r}: setup_kwargs returned {extra}, which "
                             f"{cls.__qualname__}() does not take (it takes {sorted(names) or 'no keywords'})")
    if any_keyword or "precision" in names:
        kwargs["precision"] = precision
    return cast("ClientAlgorithm", cls(**kwargs))


def evaluation_split(name: str, dataset, params: Mapping[str, object], seed: int):
    """The test samples a device evaluates its own model on (``client_eval``): the data set's
    test split, minus what the algorithm reserves (FedMCP++'s proxy set) through the class's
    optional ``eval_split(dataset, params, seed) -> ArraySplit`` classmethod."""
    return _algorithm_class(name).eval_split(dataset, params, seed)


__all__ = [
    "BUFFERS", "ClientAlgorithm", "LocalResult", "SHARES", "StepContext", "TrainConfig", "algorithm_setup",
    "build_client_algorithm", "check_client_class",
    "algorithm_share", "evaluation_split", "get_client_algorithm", "get_client_algorithm_class",
    "list_client_algorithms", "load_shared", "local_entries", "predict_scores", "private_entries",
    "register_client_algorithm", "restarted_device_state", "shared_arrays", "shared_indices",
]
