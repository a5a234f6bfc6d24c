"""A name → class registry, shared by the client algorithms (``edge_agent.algorithms``) and the
server strategies (``broker_server.strategies``): one algorithm = one name, two halves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T", bound=type)


class Registry:
    """Classes registered by name with a decorator; keyword-only construction by name.

    Args:
        what: what is registered, for messages (``"client algorithm"``).
        unknown_error: exception class raised by :meth:`get` for an unknown name.
    """

    def __init__(self, what: str, unknown_error: type[Exception]) -> None:
        self.what = what
        self.unknown_error = unknown_error
        self._classes: dict[str, type] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator registering the class under ``name`` (sets ``cls.name``).

        Raises:
            ValueError: ``name`` is already registered.
        """

        def deco(cls: T) -> T:
            if name in self._classes:
                raise ValueError(f"{self.what} {name!r} is already registered by {self._classes[name].__qualname__}")
            cls.name = name  # type: ignore[attr-defined]
            self._classes[name] = cls
            return cls

        return deco

    def names(self) -> list[str]:
        """Sorted registered names."""
        return sorted(self._classes)

    def get(self, name: str, **config: Any) -> Any:
        """An instance of the class registered as ``name``, built with keyword-only ``config``.

        Raises:
            unknown_error: unknown name (the message lists the known ones).
        """
        return self.get_class(name)(**config)

    def get_class(self, name: str) -> type:
        """The class registered as ``name``.

        Raises:
            unknown_error: unknown name (the message lists the known ones).
        """
        try:
            return self._classes[name]
        except KeyError:
            raise self.unknown_error(f"unknown algorithm {name!r}; known: {', '.join(self.names())}") from None
