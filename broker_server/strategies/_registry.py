"""Name → server-strategy class registry (a duplicate name is an error)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ..errors import ConfigError

_REGISTRY: dict[str, type] = {}
T = TypeVar("T", bound=type)


def register_strategy(name: str) -> Callable[[T], T]:
    """Class decorator registering a server strategy under ``name``.

    Raises:
        ValueError: ``name`` is already registered.
    """

    def deco(cls: T) -> T:
        if name in _REGISTRY:
            raise ValueError(f"strategy {name!r} is already registered by {_REGISTRY[name].__qualname__}")
        cls.name = name  # type: ignore[attr-defined]
        _REGISTRY[name] = cls
        return cls

    return deco


def list_strategies() -> list[str]:
    """Sorted names of the registered strategies."""
    return sorted(_REGISTRY)


def get_strategy(name: str, **config):
    """Instantiate strategy ``name`` with keyword-only ``config``.

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm {name!r}; known: {', '.join(list_strategies())}") from None
    return cls(**config)
