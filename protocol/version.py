"""The installed fedfleet's version, for ``fedfleet --version`` and ``fedfleet-agent --version``."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def fedfleet_version() -> str:
    """The version of the installed ``fedfleet`` distribution (``pyproject.toml``'s
    ``[project] version``), or ``"unknown (not installed)"`` when the packages are run from a
    checkout that pip never installed."""
    from importlib.metadata import PackageNotFoundError, version  # only when asked: start-up stays light

    try:
        return version("fedfleet")
    except PackageNotFoundError:
        return "unknown (not installed)"


class VersionAction(argparse.Action):
    """``--version``: print ``PROG VERSION`` (:func:`fedfleet_version`, looked up only when
    given) and exit 0."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the installed fedfleet's version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        sys.stdout.write(f"{parser.prog} {fedfleet_version()}\n")
        parser.exit(0)
