"""Join admission by model: whether a device's model fits what the algorithm needs.

Two requirements (a strategy's ``model_requirement``):

- ``"manifest"`` — parameter-averaging methods (FedAvg, FedProx, SCAFFOLD, FedPer …): every
  tensor is averaged position by position, so the device must run exactly the architecture it
  was assigned: its manifest hash (:func:`edge_agent.models.manifest_hash`) must equal that one.
- ``"prototype"`` — prototype-only methods (FedProto, share = ``"none"``): only class
  prototypes (``[num_classes, feature_dim]`` arrays) travel, so any architecture will do whose
  prototype width and class count are the agreed ones, announced in ``join.info`` as
  ``feature_dim`` and ``num_classes`` (with ``model``, the architecture's name, for the record).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from protocol.messages import Join

if TYPE_CHECKING:
    from .strategies import Strategy

__all__ = ["REQUIREMENTS", "admit", "model_requirement"]

REQUIREMENTS = ("manifest", "prototype")


def model_requirement(strategy_cls: type[Strategy]) -> str:
    """The strategy class's declared ``model_requirement`` (:class:`broker_server.strategies.Strategy`).

    Raises:
        ValueError: a declared requirement other than ``"manifest"`` / ``"prototype"``.
    """
    req = strategy_cls.model_requirement
    if req not in REQUIREMENTS:
        raise ValueError(f"{getattr(strategy_cls, '__name__', strategy_cls)!r} declares model_requirement "
                         f"{req!r}; expected one of {', '.join(REQUIREMENTS)}")
    return req


def _announced_int(info: Mapping[str, object], key: str) -> int | None:
    """An announced count: an int, an integral finite float, or an int's decimal text; else
    ``None`` (a bool, NaN, ±Inf, 64.9 or other text is no count: never truncated, never raised)."""
    value = info.get(key)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if isinstance(value, str) and re.fullmatch(r"[+-]?[0-9]{1,18}", value.strip()):
        return int(value)
    return None


def admit(join: Join, *, requirement: str, expected_manifest_hash: str, feature_dim: int,
          num_classes: int) -> str | None:
    """Whether the server admits ``join`` by its model; pure (no state, no I/O).

    Args:
        join: the device's join (``manifest_hash``; ``info["model"]``, ``info["feature_dim"]``,
            ``info["num_classes"]`` as ints or their decimal text).
        requirement: ``"manifest"`` or ``"prototype"`` (see the module docstring).
        expected_manifest_hash: the manifest hash of the architecture assigned to this device
            (16 hex characters).
        feature_dim: the agreed prototype width d.
        num_classes: the data set's class count C.

    Returns:
        ``None`` to admit, else the refusal reason (sent to the device in its receipt). Under
        ``"prototype"`` a device that announces no ``feature_dim`` / ``num_classes`` (an older
        agent) is admitted only with the expected manifest.

    Raises:
        ValueError: an unknown ``requirement``.
    """
    if requirement not in REQUIREMENTS:
        raise ValueError(f"unknown model requirement {requirement!r}; expected one of {', '.join(REQUIREMENTS)}")
    same = join.manifest_hash == expected_manifest_hash
    if requirement == "manifest":
        if same:
            return None
        model = join.info.get("model")
        named = f" ({model})" if isinstance(model, str) and model else ""
        return (f"model manifest {join.manifest_hash}{named} does not match the server's {expected_manifest_hash}: "
                "same model architecture and data shape needed")
    d, c = _announced_int(join.info, "feature_dim"), _announced_int(join.info, "num_classes")
    if d is None or c is None:
        if same:
            return None
        return (f"model manifest {join.manifest_hash} differs from the server's {expected_manifest_hash} and the "
                "join announces no feature_dim / num_classes: a prototype-only algorithm admits another "
                "architecture only with its prototype width and class count in join.info")
    wrong = [f"{key} {got} (server: {want})" for key, got, want in (("feature_dim", d, feature_dim),
                                                                     ("num_classes", c, num_classes)) if got != want]
    if wrong:
        return ("the model's prototypes do not fit: " + "; ".join(wrong)
                + " — a prototype-only algorithm needs the agreed prototype width and class count")
    return None
