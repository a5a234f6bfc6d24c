"""Wording shared by the command lines' and reports' messages."""

from __future__ import annotations


def plural(n: int, word: str) -> str:
    """``1 client``, ``2 clients``: ``n`` and ``word``, with an ``s`` unless ``n`` is 1."""
    return f"{n} {word}{'' if n == 1 else 's'}"
