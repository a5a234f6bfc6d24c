"""Name → client-algorithm class registry (a duplicate name is an error)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ..errors import EdgeAgentError

_REGISTRY: dict[str, type] = {}
T = TypeVar("T", bound=type)


def register_client_algorithm(name: str) -> Callable[[T], T]:
    """Class decorator registering a client algorithm under ``name``.

    Raises:
        ValueError: ``name`` is already registered.
    """

    def deco(cls: T) -> T:
        if name in _REGISTRY:
            raise ValueError(f"client algorithm {name!r} is already registered by {_REGISTRY[name].__qualname__}")
        cls.name = name  # type: ignore[attr-defined]
        _REGISTRY[name] = cls
        return cls

    return deco


def list_client_algorithms() -> list[str]:
    """Sorted names of the registered client algorithms."""
    return sorted(_REGISTRY)


def get_client_algorithm(name: str, **config):
    """Instantiate the client algorithm ``name`` with keyword-only ``config``.

    Raises:
        EdgeAgentError: unknown name (the message lists the known ones).
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise EdgeAgentError(f"unknown algorithm {name!r}; known: {', '.join(list_client_algorithms())}") from None
    return cls(**config)
