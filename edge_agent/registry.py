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
        fallback: for a name that is not registered: ``fallback(name)`` returns the class of a
            user's algorithm (an import path or an entry point, :mod:`edge_agent.plugins`), raises
            ``unknown_error`` when it names one that does not fit, or returns ``None`` when the
            name is no reference at all (then the unknown-name error). Its classes are kept, not
            registered: :meth:`names` lists the built-in ones.
    """

    def __init__(self, what: str, unknown_error: type[Exception],
                 fallback: Callable[[str], type | None] | None = None) -> None:
        self.what = what
        self.unknown_error = unknown_error
        self.fallback = fallback
        self._classes: dict[str, type] = {}
        self._found: dict[str, type] = {}

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
        if name in self._classes:
            return self._classes[name]
        if name in self._found:
            return self._found[name]
        cls = self.fallback(name) if self.fallback is not None and isinstance(name, str) else None
        if cls is None:
            raise self.unknown_error(f"unknown algorithm {name!r}; known: {', '.join(self.names())}, or your own "
                                     "as 'package.module:name' of a fedfleet.Algorithm (or an entry point of "
                                     "group fedfleet.algorithms)")
        self._found[name] = cls
        return cls
