"""Paths a configuration gives for a strategy's files (:attr:`~broker_server.strategies.Strategy.path_keys`:
FedDO's ``policy``), made absolute when a run starts (:func:`broker_server.cli.absolute_path_keys`)
while remembering how they were given, so a file that cannot be read is named with both."""

from __future__ import annotations

import os


class GivenPath(str):
    """A path key's value (:attr:`~broker_server.strategies.Strategy.path_keys`) made absolute that remembers how the
    configuration gave it: ``given`` (the text, e.g. ``feddo_policy.pt``) and ``folder`` (the
    current folder it was read against), so a file that cannot be read is named with both
    (a relative path is read from the current folder, not the configuration file's). Everywhere
    else it is the absolute path, a ``str`` (the run folder's config.toml gets that)."""

    given: str
    folder: str

    def __new__(cls, absolute: str, given: str, folder: str) -> GivenPath:
        self = super().__new__(cls, absolute)
        self.given, self.folder = given, folder
        return self

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        return GivenPath, (str(self), self.given, self.folder)


def absolute_path(value: str) -> str:
    """``value`` (a path key's) absolute, ``~`` expanded (:func:`os.path.abspath`: ``..`` resolved
    by name); a relative one as a :class:`GivenPath` that remembers it was relative and the
    current folder."""
    full = os.path.abspath(os.path.expanduser(value))
    if os.path.isabs(os.path.expanduser(value)):
        return full
    return GivenPath(full, value, os.getcwd())


def relative_path_note(path: str | os.PathLike[str]) -> str:
    """`` (given as feddo_policy.pt; a relative path is read from the current folder, /tmp)`` for
    a relative ``path``, or a :class:`GivenPath` made absolute from one; ``""`` for one given
    absolute (or ``~``-relative)."""
    given = getattr(path, "given", None)
    folder = getattr(path, "folder", None)
    if given is None:
        given, folder = os.fspath(path), os.getcwd()
        if os.path.isabs(os.path.expanduser(given)):
            return ""
    return f" (given as {given}; a relative path is read from the current folder, {folder})"
