"""Name → client-algorithm class registry (a duplicate name is an error), and the client half of
a user's algorithm named by import path or entry point (:mod:`edge_agent.plugins`)."""

from __future__ import annotations

import inspect

from ..errors import EdgeAgentError
from ..plugins import hook_problems, is_reference, user_algorithm
from ..registry import Registry

#: the client hooks whose overrides are checked against the base's call (:func:`check_client_class`).
CLIENT_HOOKS = ("setup_kwargs", "eval_split", "local_round", "before_step", "predict", "on_update_receipt")


def check_client_class(cls: object, ref: str) -> type:
    """``cls`` when it can serve as the client half of algorithm ``ref``.

    Raises:
        EdgeAgentError: not a subclass of :class:`~edge_agent.algorithms.ClientAlgorithm`; an
            abstract hook left unimplemented (``local_round``); ``share``/``buffers`` not one of
            the allowed values; an override whose parameters do not take the base's call.
    """
    from ._base import BUFFERS, SHARES, ClientAlgorithm

    where = f"algorithm {ref!r}: client half"
    if not isinstance(cls, type) or not issubclass(cls, ClientAlgorithm):
        raise EdgeAgentError(f"{where} {cls!r} is not a subclass of fedfleet.ClientAlgorithm")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise EdgeAgentError(f"{where} {cls.__qualname__} does not implement {missing} (abstract in ClientAlgorithm)")
    if cls.share not in SHARES:
        raise EdgeAgentError(f"{where} {cls.__qualname__}.share = {cls.share!r}: must be one of {SHARES}")
    if cls.buffers not in BUFFERS:
        raise EdgeAgentError(f"{where} {cls.__qualname__}.buffers = {cls.buffers!r}: must be one of {BUFFERS}")
    problems = hook_problems(cls, ClientAlgorithm, CLIENT_HOOKS)
    if problems:
        raise EdgeAgentError(f"{where} {cls.__qualname__}: " + "; ".join(problems))
    return cls


def _user_client(name: str) -> type | None:
    if not is_reference(name, "algorithm"):
        return None
    algo = user_algorithm(name, EdgeAgentError)
    cls = check_client_class(algo.half("client", name, EdgeAgentError), name)
    algo.name_halves(name, cls)
    return cls


_REGISTRY = Registry("client algorithm", EdgeAgentError, fallback=_user_client)

register_client_algorithm = _REGISTRY.register
list_client_algorithms = _REGISTRY.names
get_client_algorithm = _REGISTRY.get
get_client_algorithm_class = _REGISTRY.get_class
