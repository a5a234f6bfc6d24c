"""FedCross, client half (Hu et al., "FedCross: Towards Accurate Federated Learning via
Multi-Model Cross-Aggregation", ICDE 2024; SPECS §6.10): the device trains the server's middleware
model number ``cross_slot`` (its own instruction) with plain cross-entropy SGD and uploads it.

The middleware models travel in the round's ``global`` as extras ``cross_0`` … ``cross_{M−1}``,
each the model's state entries flattened in manifest order (float32, :func:`flatten_state`); the
``global`` tensors are their sample-weighted mean (the evaluated model). A ``global`` sent to
this device alone (per-device delivery) carries no middleware extras: its tensors are this
device's own middleware model (the server's ``FedCross.device_global``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ..errors import ModelError
from ._base import LocalResult, TrainConfig
from ._registry import register_client_algorithm
from .fedavg import FedAvgClient

SLOT_KEY = "cross_slot"
#: the extras names of the middleware models begin with this (``cross_0`` …)
PREFIX = "cross_"


def extras_name(slot: int) -> str:
    """The extras entry of middleware model ``slot``."""
    return f"{PREFIX}{int(slot)}"


def flatten_state(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The state entries concatenated, float32 [Σ numel]."""
    return np.concatenate([np.asarray(a, np.float32).ravel() for a in arrays]) if arrays else np.zeros(0, np.float32)


def unflatten_state(flat: np.ndarray, like: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``flat`` cut back into arrays shaped and typed as ``like``.

    Raises:
        ModelError: the lengths differ.
    """
    total = sum(int(np.asarray(a).size) for a in like)
    if flat.size != total:
        raise ModelError(f"a middleware model of {flat.size} values does not fit a model of {total}")
    out, i = [], 0
    for a in like:
        a = np.asarray(a)
        out.append(np.asarray(flat[i:i + a.size]).reshape(a.shape).astype(a.dtype))
        i += a.size
    return out


@register_client_algorithm("fedcross")
class FedCrossClient(FedAvgClient):
    """Trains middleware model ``cross_slot`` (from the round's extras, or the global's tensors
    when the global carries no middleware extras: a copy for this device alone) as FedAvg trains
    the global.

    Raises (from :meth:`local_round`):
        ValueError: no ``cross_slot`` instruction, or middleware extras without this slot's.
    """

    name = "fedcross"
    share = "all"
    buffers = "average"

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_id: str = "", client_index: int,
                    device: torch.device, params: Mapping[str, object] | None = None,
                    global_extras: Mapping[str, np.ndarray] | None = None) -> LocalResult:
        """Replace the global by middleware model ``cross_slot``, then FedAvg's round."""
        slot = (params or {}).get(SLOT_KEY)
        if slot is None or isinstance(slot, bool) or not isinstance(slot, (int, float)):
            raise ValueError(f"FedCross needs the instruction {SLOT_KEY} (an int), got {slot!r}")
        name = extras_name(int(slot))
        extras = global_extras or {}
        if name in extras:  # the broadcast: every middleware model
            mine = tuple(unflatten_state(np.asarray(extras[name]), global_tensors))
        elif not any(k.startswith(PREFIX) for k in extras):  # this device's own copy: its model is the tensors
            mine = tuple(global_tensors)
        else:
            raise ValueError(f"FedCross: the global carries no middleware model {name!r} "
                             f"(it has {sorted(extras)})")
        return super().local_round(model, mine, x, y, config, round=round, client_id=client_id,
                                   client_index=client_index, device=device, params=params, global_extras=extras)
