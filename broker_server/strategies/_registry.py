"""Name → server-strategy class registry (a duplicate name is an error), and the server half of a
user's algorithm named by import path or entry point (:mod:`edge_agent.plugins`), checked against
its client half."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, cast

from edge_agent.plugins import hook_problems, is_reference, user_algorithm
from edge_agent.registry import Registry

from ..errors import ConfigError

if TYPE_CHECKING:
    from ._base import Strategy

#: the server hooks whose overrides are checked against the base's call (:func:`check_strategy_class`).
SERVER_HOOKS = ("setup_kwargs", "bind_model", "on_join", "configure_round", "config_for_round", "global_extras",
                "validate", "accumulator", "aggregate", "skipped_round", "commit", "aggregate_metrics", "evaluate",
                "round_metrics", "state_dict", "load_state_dict")


def check_strategy_class(cls: object, ref: str, client: type | None = None) -> type[Strategy]:
    """``cls`` when it can serve as the server half of algorithm ``ref`` (paired with ``client``).

    Raises:
        ConfigError: not a subclass of :class:`~broker_server.strategies.Strategy`; an abstract
            hook left unimplemented (``aggregate``); ``share``, ``buffers``,
            ``model_requirement``, ``instructions`` or ``plans_from_evaluation`` (a bool) not of
            the allowed values; ``share`` or
            ``buffers`` other than the client half's; an override whose parameters do not take
            the base's call.
    """
    from ._base import BUFFERS, MODEL_REQUIREMENTS, SHARES, Strategy

    where = f"algorithm {ref!r}: server half"
    if not isinstance(cls, type) or not issubclass(cls, Strategy):
        raise ConfigError(f"{where} {cls!r} is not a subclass of fedfleet.Strategy")
    name = cls.__qualname__
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise ConfigError(f"{where} {name} does not implement {missing} (abstract in Strategy)")
    for attr, allowed in (("share", SHARES), ("buffers", BUFFERS), ("model_requirement", MODEL_REQUIREMENTS)):
        if getattr(cls, attr) not in allowed:
            raise ConfigError(f"{where} {name}.{attr} = {getattr(cls, attr)!r}: must be one of {allowed}")
    if not isinstance(cls.instructions, tuple) or not all(isinstance(k, str) and k for k in cls.instructions):
        raise ConfigError(f"{where} {name}.instructions = {cls.instructions!r}: must be a tuple of key names")
    if not isinstance(cls.plans_from_evaluation, bool):
        raise ConfigError(f"{where} {name}.plans_from_evaluation = {cls.plans_from_evaluation!r}: must be True or "
                          "False (whether its next round's plan reads the round's evaluation)")
    if client is not None:
        for attr in ("share", "buffers"):
            if getattr(client, attr) != getattr(cls, attr):
                raise ConfigError(f"algorithm {ref!r}: the halves disagree: {name}.{attr} = {getattr(cls, attr)!r} "
                                  f"but the client half {client.__qualname__}.{attr} = {getattr(client, attr)!r}")
    problems = hook_problems(cls, Strategy, SERVER_HOOKS)
    if problems:
        raise ConfigError(f"{where} {name}: " + "; ".join(problems))
    return cast("type[Strategy]", cls)


def _user_strategy(name: str) -> type | None:
    if not is_reference(name, "algorithm"):
        return None
    from edge_agent.algorithms import check_client_class
    from edge_agent.errors import EdgeAgentError

    algo = user_algorithm(name, ConfigError)
    try:
        client = check_client_class(algo.half("client", name, ConfigError), name)
    except EdgeAgentError as exc:
        raise ConfigError(str(exc)) from None
    strategy = check_strategy_class(algo.half("strategy", name, ConfigError), name, client)
    algo.name_halves(name, client, strategy)
    return strategy


_REGISTRY = Registry("strategy", ConfigError, fallback=_user_strategy)

register_strategy = _REGISTRY.register
list_strategies = _REGISTRY.names


def get_strategy(name: str, **config: object) -> Strategy:
    """An instance of the strategy registered as ``name``, built with keyword-only ``config``.

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    return cast("Strategy", _REGISTRY.get(name, **config))


def get_strategy_class(name: str) -> type[Strategy]:
    """The :class:`Strategy` subclass registered as ``name``, or the server half of a user's
    algorithm (``package.module:name`` of a :class:`~edge_agent.plugins.Algorithm`, or an entry
    point of group ``fedfleet.algorithms``), checked.

    Raises:
        ConfigError: unknown name (the message lists the known ones); a user's algorithm that
            cannot be imported or does not fit (the message names what).
    """
    return cast("type[Strategy]", _REGISTRY.get_class(name))
