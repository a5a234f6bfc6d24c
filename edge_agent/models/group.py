"""Model groups: which architecture each device of a fleet runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from edge_agent.errors import ModelError

__all__ = ["assign_model", "group_architectures"]

Group = Sequence[str] | Mapping[str, str]
"""A model group: a list of architectures (device ``i`` runs ``group[i % len(group)]``), or a
mapping firmware profile name -> architecture (other profiles run the default name)."""


def assign_model(default: str, group: Group, *, shard: int, profile: str) -> str:
    """The architecture device ``shard`` (0-based shard index) with firmware ``profile`` runs.

    Args:
        default: ``[model] name``: the architecture when ``group`` is empty, or when it is a
            mapping without ``profile``.
        group: ``()``, a list (round-robin by shard index: ``group[shard % len(group)]``) or a
            mapping by profile name.
        shard: the device's shard index ``i`` (>= 0).
        profile: the device's firmware profile name.

    Raises:
        ModelError: a negative shard index.
    """
    if shard < 0:
        raise ModelError(f"shard index must be >= 0, got {shard}")
    if isinstance(group, Mapping):
        return group.get(profile, default)
    if group:
        return group[shard % len(group)]
    return default


def group_architectures(default: str, group: Group) -> list[str]:
    """Every architecture a fleet with this group may run, distinct, in first-use order.

    A list group: its entries and ``default`` (the server's own model). A mapping: its values and
    ``default`` (the profiles it does not name).
    """
    names = [default, *(group.values() if isinstance(group, Mapping) else group)]
    return list(dict.fromkeys(names))
