"""Users' own code, named in the configuration: one resolver for every kind (algorithm, data set,
model), the :class:`Algorithm` pairing of a client half with a server half, and the checks that a
user's class or function fits before anything runs.

A reference is either an **import path** ``"package.module:name"`` (``name`` may be dotted:
``"pkg.mod:Class.attr"``), imported where it is needed — on the server and on every device, so
the package must be importable there (``pip install`` it, or put the folder holding it on
``PYTHONPATH``) — or the **name of an entry point** in the kind's group (:data:`ENTRY_POINT_GROUPS`)
of an installed distribution (``[project.entry-points."fedfleet.algorithms"] trimmed =
"mypkg.algorithm:trimmed"``). Built-in names (the zoo, the data-set table, the registered
algorithms) come first; a reference is resolved only when it is none of them.

This module imports neither torch nor ``broker_server``: a device resolves only the client half.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

__all__ = [
    "ENTRY_POINT_GROUPS", "Algorithm", "accepted_keywords", "entry_point_names", "hook_problems",
    "import_object", "is_import_path", "is_reference", "resolve_reference",
]

#: kind → the entry-point group searched for names that are not built in.
ENTRY_POINT_GROUPS = {"algorithm": "fedfleet.algorithms", "dataset": "fedfleet.datasets", "model": "fedfleet.models"}

_WHERE = ("the package must be importable by the server and by every device: pip install it, or put the folder "
          "holding it on PYTHONPATH")


def is_import_path(ref: object) -> bool:
    """True when ``ref`` reads as ``package.module:name`` (a string with a colon)."""
    return isinstance(ref, str) and ":" in ref


def _entry_points(kind: str) -> list[metadata.EntryPoint]:
    group = ENTRY_POINT_GROUPS[kind]
    return list(metadata.entry_points(group=group))


def entry_point_names(kind: str) -> list[str]:
    """Sorted names of the installed entry points of ``kind`` (``"algorithm"``, ``"dataset"``,
    ``"model"``).

    Raises:
        KeyError: an unknown kind.
    """
    return sorted({ep.name for ep in _entry_points(kind)})


def is_reference(ref: object, kind: str) -> bool:
    """True when ``ref`` is an import path or the name of an installed entry point of ``kind``."""
    return is_import_path(ref) or (isinstance(ref, str) and ref in entry_point_names(kind))


def import_object(ref: str, *, what: str, error: type[Exception], form: str = "package.module:name") -> Any:
    """The object an import path ``package.module:name`` names (the module is imported).

    Args:
        ref: the import path.
        what: what it should be, for messages (``"model factory"``).
        error: the exception class raised.
        form: the expected form, for the message of a malformed path.

    Raises:
        error: a malformed path, a module that cannot be imported (or raises while importing),
            a missing attribute — each message names ``what``, ``ref`` and what went wrong.
    """
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr or ":" in attr:
        raise error(f"{what} {ref!r}: expected {form!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(f"{what} {ref!r}: cannot import module {module_name!r}: {exc} ({_WHERE})") from exc
    except Exception as exc:  # noqa: BLE001 — user code failing at import (SyntaxError, RuntimeError …)
        raise error(f"{what} {ref!r}: importing module {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise error(f"{what} {ref!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


def resolve_reference(ref: str, *, kind: str, what: str, error: type[Exception]) -> Any:
    """The object behind a user's reference: an import path, or an entry point of ``kind``.

    Raises:
        error: as :func:`import_object`; a name that is no entry point of the kind's group (the
            message lists the installed ones); an entry point that fails to load.
    """
    if not isinstance(ref, str) or not ref:
        raise error(f"{what}: expected a non-empty name, got {ref!r}")
    if is_import_path(ref):
        return import_object(ref, what=what, error=error)
    group = ENTRY_POINT_GROUPS[kind]
    found = [ep for ep in _entry_points(kind) if ep.name == ref]
    if not found:
        installed = ", ".join(entry_point_names(kind)) or "none installed"
        raise error(f"{what} {ref!r}: no entry point of that name in group {group!r} ({installed})")
    ep = found[0]
    try:
        return ep.load()
    except Exception as exc:  # noqa: BLE001 — the user's module failing is reported, naming it
        raise error(f"{what} {ref!r}: entry point {ep.value!r} of group {group!r} failed to load: "
                    f"{type(exc).__name__}: {exc} ({_WHERE})") from exc


@dataclass(frozen=True)
class Algorithm:
    """A user's algorithm: its client half and its server half under one name.

    Put one in your package and name it in the configuration, ``[train] algorithm =
    "mypkg.algorithm:trimmed"`` (or register it as entry point ``trimmed`` in group
    ``fedfleet.algorithms``)::

        trimmed = Algorithm(client="mypkg.client:ClippedSGD", strategy="mypkg.server:TrimmedMean")

    Attributes:
        client: the :class:`~edge_agent.algorithms.ClientAlgorithm` subclass, or its import path
            (a device imports only this half: given as a path, the server half's module — and
            ``broker_server`` — is never imported there).
        strategy: the :class:`~broker_server.strategies.Strategy` subclass, or its import path.
        name: the name both halves report (``Strategy.name``, ``ClientAlgorithm.name``, logs);
            ``""``: the reference it was found by.
    """

    client: type | str
    strategy: type | str
    name: str = ""

    def half(self, side: str, ref: str, error: type[Exception]) -> type:
        """The class of one half (``side`` ``"client"`` or ``"strategy"``), imported when given as
        a path (not checked: each side checks its own half).

        Raises:
            error: the path cannot be imported, or it names something that is not a class.
        """
        obj = getattr(self, side)
        what = f"algorithm {ref!r}: the {'client half' if side == 'client' else 'server half (strategy)'}"
        if isinstance(obj, str):
            obj = import_object(obj, what=what, error=error)
        if not isinstance(obj, type):
            raise error(f"{what} is a {type(obj).__name__}, not a class")
        return obj

    def name_halves(self, ref: str, *classes: type) -> None:
        """Give each of ``classes`` (the checked halves) the name :attr:`name` (or ``ref``)
        when it declares none (``name = ""``, the bases' default); a class that names itself
        keeps its name. Called once the halves passed their checks."""
        for cls in classes:
            if not getattr(cls, "name", "x"):
                cls.name = self.name or ref  # type: ignore[attr-defined]


def user_algorithm(ref: str, error: type[Exception]) -> Algorithm:
    """The :class:`Algorithm` a reference names.

    Raises:
        error: not resolvable (:func:`resolve_reference`), or not an :class:`Algorithm`.
    """
    obj = resolve_reference(ref, kind="algorithm", what="algorithm", error=error)
    if not isinstance(obj, Algorithm):
        raise error(f"algorithm {ref!r} is a {type(obj).__name__}, not a fedfleet.Algorithm pairing a client half "
                    "with a server half (Algorithm(client=MyClient, strategy=MyStrategy))")
    return obj


def accepted_keywords(cls: type) -> tuple[set[str], bool]:
    """The keyword names ``cls(...)`` accepts, following ``**kwargs`` up the MRO to the next
    ``__init__`` that has none, less the class's ``fixed_keywords`` (those an ``__init__`` on the
    way passes up itself, such as FedOCP's FedProto ``weighting``: a caller's would be a second
    value); and whether it accepts any keyword at all (a ``**kwargs`` that reaches ``object``)."""
    names: set[str] = set()
    fixed = set(getattr(cls, "fixed_keywords", ()))
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass is object:
            return names - fixed, False
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            return names - fixed, True
        names |= {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)} - {"self"}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names - fixed, False
    return names - fixed, False


def _call_shape(attr: Any) -> tuple[Callable[..., Any] | None, bool]:
    """(the function, whether its first parameter is bound: self/cls) of a class attribute."""
    if isinstance(attr, staticmethod):
        return attr.__func__, False
    if isinstance(attr, classmethod):
        return attr.__func__, True
    if inspect.isfunction(attr):
        return attr, True
    return None, False


def hook_problems(cls: type, base: type, hooks: Iterable[str]) -> list[str]:
    """What is wrong with ``cls``'s overrides of ``base``'s hooks: a hook whose override cannot
    be called the way the driver calls the base's (a missing parameter, one keyword-only where
    the base's is positional), or an override that is not a method.

    Returns:
        One text per problem (empty: every override fits).
    """
    out = []
    for hook in hooks:
        owner = next((k for k in cls.__mro__ if hook in k.__dict__), None)
        if owner is None or owner is base or issubclass(base, owner):
            continue
        base_fn, _ = _call_shape(inspect.getattr_static(base, hook))
        fn, _ = _call_shape(inspect.getattr_static(cls, hook))
        if base_fn is None:
            continue
        if fn is None:
            out.append(f"{hook} is a {type(inspect.getattr_static(cls, hook)).__name__}, not a method")
            continue
        base_params = list(inspect.signature(base_fn).parameters.values())[1:]
        args = [None] + [None for p in base_params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        kwargs = {p.name: None for p in base_params if p.kind is p.KEYWORD_ONLY}
        try:
            inspect.signature(fn).bind(*args, **kwargs)
        except TypeError as exc:
            expected = ", ".join(str(p) for p in base_params)
            out.append(f"{hook}() cannot be called as the base's {hook}({expected}): {exc}")
    return out
