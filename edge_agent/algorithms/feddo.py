"""FedDO, client half: FedAvg local SGD on a uniform random subset of the shard whose size the
server's agent chose for this device.

FedDO (ECCV 2026; SPECS §4.1 step 3): in round t device k trains on S_t^k ⊂ D_k, drawn uniformly
at random without replacement, with |S_t^k| = d_t^k·|D_k| rounded (:func:`subset_size`), where
d_t^k ∈ [0, 1] is the device's own instruction ``data_ratio`` in its ``round_start``. The upload
is the full model and ``num_samples`` = |S_t^k| (the server's aggregation weight).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import cast

import numpy as np
import torch

from ._base import ClientAlgorithm, FloatLike, LocalResult, TrainConfig, step_hook
from ._registry import register_client_algorithm
from .fedavg import _check_precision, sgd_epochs, shuffle_generator

#: the per-device instruction carrying d_k.
RATIO_KEY = "data_ratio"


def subset_size(ratio: float, n: int) -> int:
    """|S| = round(ratio·n) (Python's round, halves to even), at least 1 when ratio > 0 and
    n > 0 (SPECS §4.1 [guess]: a device the agent made active trains on something), 0 when
    ratio is 0.

    Raises:
        ValueError: ratio outside [0, 1] or not finite, n < 0.
    """
    r = float(ratio)
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"{RATIO_KEY} = {ratio!r} must be in [0, 1]")
    if n < 0:
        raise ValueError(f"sample count {n} must be >= 0")
    if r == 0.0 or n == 0:
        return 0
    return max(1, min(n, round(r * n)))


def subset_indices(n: int, m: int, seed: int, round: int, client_index: int) -> torch.Tensor:
    """``m`` distinct indices of ``range(n)``, uniform without replacement, from a private
    generator of (``seed``, ``round``, ``client_index``) (int64 [m], sorted)."""
    g = shuffle_generator(seed + 7919, round, client_index)
    return torch.randperm(n, generator=g)[:m].sort().values


@register_client_algorithm("feddo")
class FedDOClient(ClientAlgorithm):
    """FedDO client: FedAvg on ``round(d_k·|D_k|)`` samples of the shard (see the module).

    A round whose ``data_ratio`` gives no sample (d = 0) returns ``num_samples = 0`` (nothing is
    sent; the server only asks devices with d > 0). A ``round_start`` without ``data_ratio``
    trains on the whole shard (d = 1).

    Reported metrics besides FedAvg's: ``data_ratio`` (the d it received) and
    ``shard_samples`` (|D_k|).
    """

    name = "feddo"
    share = "all"
    buffers = "average"
    borrows_model = True  # its model between rounds is its state entries (ClientAlgorithm)

    def __init__(self, *, precision: str = "fp32") -> None:
        _check_precision(precision)
        self.precision = precision

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_id: str = "", client_index: int,
                    device: torch.device, params: Mapping[str, object] | None = None,
                    global_extras: Mapping[str, np.ndarray] | None = None) -> LocalResult:
        """Load the global model, draw S (:func:`subset_indices`), train on it, upload.

        Raises:
            ValueError: a ``data_ratio`` that is not a number in [0, 1].
            ModelError: ``global_tensors`` do not match the model.
        """
        _check_precision(self.precision, device)
        t0 = time.perf_counter()
        raw = (params or {}).get(RATIO_KEY, 1.0)
        if isinstance(raw, bool):
            raise ValueError(f"{RATIO_KEY} = {raw!r} is not a number")
        try:
            ratio = float(cast(FloatLike, raw))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{RATIO_KEY} = {raw!r} is not a number") from exc
        n = int(y.shape[0])
        m = subset_size(ratio, n)
        self.load_global(model, global_tensors)
        if m == 0:
            return LocalResult(tensors=self.upload_tensors(model), num_samples=0, train_loss=0.0,
                               metrics={"train_accuracy": 0.0, "data_ratio": ratio, "shard_samples": n})
        idx = subset_indices(n, m, config.seed, round, client_index)
        loss, acc = sgd_epochs(model, x[idx], y[idx], config, shuffle_generator(config.seed, round, client_index),
                               device, precision=self.precision, before_step=step_hook(self), step_round=round)
        return LocalResult(tensors=self.upload_tensors(model), num_samples=m, train_loss=loss,
                           metrics={"train_accuracy": acc, "train_seconds": time.perf_counter() - t0,
                                    "data_ratio": ratio, "shard_samples": n})

