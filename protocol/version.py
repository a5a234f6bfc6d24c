"""The installed fedfleet's version, for ``fedfleet --version`` and ``fedfleet-agent --version``."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def fedfleet_version() -> str:
    """The version of the installed ``fedfleet`` distribution (``pyproject.toml``'s
    ``[project] version``), or ``"unknown (not installed)"`` when the packages are run from a
    checkout that pip never installed."""
    try:
        return version("fedfleet")
    except PackageNotFoundError:
        return "unknown (not installed)"
