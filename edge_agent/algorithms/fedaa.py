"""FedAA, client half: FedAvg local SGD with the gradient's global L2 norm clipped before each
step (FedAA's client code clips at 60: ``torch.nn.utils.clip_grad_norm_(params, 60)``; SPECS
§4.3). The server half weights the aggregated models by a DDPG agent's action
(:mod:`broker_server.strategies.fedaa`).

The clip norm comes in the round's config as ``clip_norm`` (``[algorithm] clip_norm`` on the
server, default :data:`CLIP_NORM`; 0 = no clipping, FedAvg's training bit for bit).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ._base import LocalResult, StepContext, TrainConfig
from ._registry import register_client_algorithm
from .fedavg import FedAvgClient
from .fedprox import read_param

#: FedAA's client-side gradient-norm clip (its code's value).
CLIP_NORM = 60.0


@register_client_algorithm("fedaa")
class FedAAClient(FedAvgClient):
    """FedAvg client whose gradient is clipped to ‖g‖₂ ≤ ``clip_norm`` (the norm over every
    parameter's gradient together, as :func:`torch.nn.utils.clip_grad_norm_`) before each step."""

    name = "fedaa"
    share = "all"
    buffers = "average"

    def __init__(self, *, precision: str = "fp32") -> None:
        super().__init__(precision=precision)
        self.clip_norm = CLIP_NORM

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_id: str = "", client_index: int,
                    device: torch.device, params: Mapping[str, object] | None = None,
                    global_extras: Mapping[str, np.ndarray] | None = None) -> LocalResult:
        """FedAvg's round with ``clip_norm`` from the round config (default :data:`CLIP_NORM`).

        Raises:
            ValueError: ``clip_norm`` negative or not a finite number; as FedAvg otherwise.
        """
        self.clip_norm = read_param(params or {}, "clip_norm", CLIP_NORM)
        return super().local_round(model, global_tensors, x, y, config, round=round, client_id=client_id,
                                   client_index=client_index, device=device, params=params,
                                   global_extras=global_extras)

    def before_step(self, model: torch.nn.Module, context: StepContext) -> None:
        """Clip the gradient's total L2 norm to ``clip_norm`` (no-op at 0)."""
        if self.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip_norm)
