"""FedDyn, client half: dynamic regularisation with a per-device gradient state.

Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, "Federated Learning Based on Dynamic
Regularization", ICLR 2021, Algorithm 1 (SPECS §6.13). Client k, starting from the global
weights w_g, minimises

    L_k(w) − ⟨∇L_k^prev, w⟩ + (α/2)·‖w − w_g‖²

(L_k = cross-entropy on its shard; the penalty is the **squared** norm as in the paper — PFLlib's
``clientdyn`` uses the unsquared ‖·‖₂) by local SGD, and then updates its state

    ∇L_k ← ∇L_k^prev − α·(w_k − w_g).

∇L_k starts at zero and lives in the client object (one per device, for the whole run): it is
per-device state that is never sent, and the server's h tracks it, h = (1/N)·Σ_k ∇L_k over the
N clients (those never heard from count as zero), because both add −α·(w_k − w_g) for the same
updates. The state is committed on receipt (:class:`~edge_agent.algorithms._base.StateOnReceipt`):
a round's new ∇L_k stands only once the server's receipt says it accepted the update; when the
server refuses it (late, invalid) or no definite answer comes before the device trains again,
∇L_k goes back to its committed value. A round the server skips for want of a quorum still
updates h with the models it accepted
(:meth:`broker_server.strategies.feddyn.FedDyn.skipped_round`). Not covered: an update the
server took whose receipt never reaches the device before it trains again, and a device that
restarts (it starts again from zero).

α = ``params["alpha"]`` (default :data:`ALPHA` = 0.01, the low end of the paper's and FedNTD's
0.01–0.1; PFLlib's shared default is 1.0). Uploads the full model; the server half is
:class:`broker_server.strategies.feddyn.FedDyn`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import numpy as np
import torch

from ._base import StateOnReceipt, TrainConfig
from ._registry import register_client_algorithm
from .fedavg import LossFn, cross_entropy_loss
from .fedprox import LocalSGDClient, parameter_snapshot, proximal_term, read_param

#: FedDyn regulariser α when the round config has no ``alpha`` (SPECS §6.13).
ALPHA = 0.01


def linear_term(params, grads: list[torch.Tensor]) -> torch.Tensor:
    """Σ_j ⟨g_j, w_j⟩ (sum of elementwise products over tensors), differentiable in ``params``.

    Args:
        params: the model's trainable parameters w_j, in ``parameters()`` order.
        grads: detached tensors g_j of the same shapes (the state ∇L_k^prev).

    Returns:
        A float32 scalar tensor; its gradient with respect to w_j is g_j.
    """
    params = list(params)
    if len(params) != len(grads):
        raise ValueError(f"{len(params)} parameters but {len(grads)} state tensors")
    total = params[0].new_zeros(())
    for p, g in zip(params, grads, strict=False):
        total = total + (p * g).sum()
    return total


def feddyn_state_update(grad_prev: list[torch.Tensor], local: list[torch.Tensor], global_: list[torch.Tensor],
                        alpha: float) -> list[torch.Tensor]:
    """∇L_k ← ∇L_k^prev − α·(w_k − w_g) (Acar et al. 2021, Algorithm 1), per tensor.

    Args:
        grad_prev: the state before the round (float32 tensors, parameter shapes).
        local: w_k after local training; global_: w_g the round started from (same shapes).
        alpha: α ≥ 0.

    Returns:
        New state tensors (fresh, same shapes and dtypes); the inputs are not modified.
    """
    return [g - alpha * (w - wg) for g, w, wg in zip(grad_prev, local, global_, strict=False)]


@register_client_algorithm("feddyn")
class FedDynClient(StateOnReceipt, LocalSGDClient):
    """FedDyn client: local SGD on CE − ⟨∇L_k^prev, w⟩ + (α/2)‖w − w_g‖², then the state update.

    ``train_loss`` reports that whole objective (it includes the linear term, so it can be
    negative). Attribute ``grad_state`` (list of float32 tensors, parameter shapes; ``None``
    before the first round = zeros) is ∇L_k after the last local round; ``on_update_receipt``
    rolls it back when the server does not take that round's update (``committed_state``: the
    value the server has counted). Upload: the full model, no extras.
    """

    name = "feddyn"
    share = "all"
    buffers = "average"
    device_state = "its gradient state ∇L_k"

    state_attr = "grad_state"

    def __init__(self, *, precision: str = "fp32") -> None:
        super().__init__(precision=precision)
        self.grad_state: list[torch.Tensor] | None = None
        self._anchors: list[torch.Tensor] = []
        self._alpha = ALPHA

    def state_to_arrays(self, state: object) -> dict[str, np.ndarray]:
        """∇L_k as ``{"grad_state.000": float32 [shape of parameter 0], …}``, parameter order."""
        return {f"grad_state.{j:03d}": g.detach().to("cpu", copy=True).numpy()
                for j, g in enumerate(cast("list[torch.Tensor]", state))}

    def state_from_arrays(self, arrays: Mapping[str, np.ndarray]) -> object:
        """∇L_k from :meth:`state_to_arrays`' arrays (float32 tensors, parameter order).

        Raises:
            ValueError: names other than ``grad_state.000`` … ``grad_state.{n−1}``.
        """
        names = [f"grad_state.{j:03d}" for j in range(len(arrays))]
        if sorted(arrays) != names:
            raise ValueError(f"FedDyn's device state is arrays grad_state.000, grad_state.001, … (one per model "
                             f"parameter), got {sorted(arrays)[:4]}")
        return [torch.from_numpy(np.array(arrays[n], np.float32, copy=True)) for n in names]

    def check_device_state(self, model: torch.nn.Module) -> None:
        """∇L_k has one array per model parameter, of its shape.

        Raises:
            ValueError: another count or shape.
        """
        if self.grad_state is None:
            return
        shapes = [tuple(p.shape) for p in model.parameters()]
        kept = [tuple(g.shape) for g in self.grad_state]
        if kept != shapes:
            raise ValueError(f"the kept ∇L_k has {len(kept)} arrays {kept[:3]} …, this model {len(shapes)} "
                             f"parameters {shapes[:3]} …")

    def begin_round(self, model: torch.nn.Module, config: TrainConfig, params: Mapping[str, object],
                    global_extras: Mapping[str, np.ndarray]) -> LossFn:
        alpha = read_param(params, "alpha", ALPHA)
        anchors = parameter_snapshot(model)
        if self.grad_state is None:
            self.grad_state = [torch.zeros_like(a) for a in anchors]
        grads = self.grad_state = [g.to(a.device) for g, a in zip(self.grad_state, anchors, strict=False)]
        self._anchors, self._alpha = anchors, alpha

        def loss_fn(m: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            ce, logits = cross_entropy_loss(m, xb, yb)
            prox = (alpha / 2) * proximal_term(m.parameters(), anchors)
            return ce - linear_term(m.parameters(), grads) + prox, logits

        return loss_fn

    def end_round(self, model: torch.nn.Module, config: TrainConfig) -> dict[str, np.ndarray]:
        local = [p.detach() for p in model.parameters()]
        self.grad_state = feddyn_state_update(self.grad_state or [], local, self._anchors, self._alpha)
        return {}
