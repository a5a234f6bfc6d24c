"""Model state ↔ wire tensors (positional, in ``state_dict`` order = the model manifest order)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .errors import ModelError


def state_arrays(model: torch.nn.Module) -> tuple[np.ndarray, ...]:
    """The model's ``state_dict`` values as CPU numpy arrays (copies), in manifest order.

    Returns:
        One array per state entry; float32 for the light CNN's weights and biases.
    """
    return tuple(t.detach().to("cpu", copy=True).numpy() for t in model.state_dict().values())


def load_arrays(model: torch.nn.Module, arrays: Sequence[np.ndarray]) -> None:
    """Copy ``arrays`` (manifest order) into ``model`` in place.

    Raises:
        ModelError: wrong number of tensors, or a shape/dtype that differs from the model's.
    """
    state = model.state_dict()
    if len(arrays) != len(state):
        raise ModelError(f"{len(arrays)} tensors received, the model has {len(state)}")
    new = {}
    for (name, ref), arr in zip(state.items(), arrays):
        if tuple(arr.shape) != tuple(ref.shape):
            raise ModelError(f"tensor {name}: shape {tuple(arr.shape)} received, the model has {tuple(ref.shape)}")
        t = torch.from_numpy(np.array(arr, dtype=ref.detach().cpu().numpy().dtype, copy=True))
        new[name] = t.to(ref.device)
    model.load_state_dict(new)
