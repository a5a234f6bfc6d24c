"""Wording shared by the command lines' and reports' messages."""

from __future__ import annotations


def plural(n: int, word: str) -> str:
    """``1 client``, ``2 clients``: ``n`` and ``word``, with an ``s`` unless ``n`` is 1."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def round_list(rounds: list[int], at_most: int = 5) -> str:
    """``"2, 3"``; ``"1, 2, 3, 4, 5, …"`` beyond ``at_most`` rounds."""
    return ", ".join(str(r) for r in rounds[:at_most]) + (", …" if len(rounds) > at_most else "")
