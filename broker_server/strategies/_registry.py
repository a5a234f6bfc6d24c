"""Name → server-strategy class registry (a duplicate name is an error)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from edge_agent.registry import Registry

from ..errors import ConfigError

if TYPE_CHECKING:
    from ._base import Strategy

_REGISTRY = Registry("strategy", ConfigError)

register_strategy = _REGISTRY.register
list_strategies = _REGISTRY.names


def get_strategy(name: str, **config: object) -> Strategy:
    """An instance of the strategy registered as ``name``, built with keyword-only ``config``.

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    return cast("Strategy", _REGISTRY.get(name, **config))


def get_strategy_class(name: str) -> type[Strategy]:
    """The :class:`Strategy` subclass registered as ``name``.

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    return cast("type[Strategy]", _REGISTRY.get_class(name))
