"""SCAFFOLD, client half: drift-corrected local SGD with control variates (option II).

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning", ICML 2020, Algorithm 1 (SPECS §6.12). Client i receives the global model x
and the server control variate c, keeps its own c_i (zero at first), and

1. runs K local steps ``y ← y − η_l·(g_i(y) + c − c_i)`` from y = x (here: the round's SGD
   epochs, the correction added to each mini-batch gradient by the training-step hook
   :meth:`ScaffoldClient.before_step`, which :func:`~edge_agent.algorithms.fedavg.sgd_epochs`
   calls between ``backward()`` and the optimizer step; K = the number of mini-batch steps, also
   counting a step that fp16's gradient scaler skips on overflow),
2. sets ``c_i⁺ = c_i − c + (x − y)/(K·η_l)`` (option II, η_l = the round's ``lr``),
3. uploads y (the model, like FedAvg) and ``Δc_i = c_i⁺ − c_i`` in the update's extras.

**Wire format.** Control variates cover the trainable parameters (``model.parameters()``, in
that order, which for every torch module is also their ``state_dict`` order), flattened and
concatenated into one float32 vector of P entries (P = the parameter count; buffers such as
BatchNorm statistics have no gradient and no control variate):

- ``global`` extras ``control``: c, float32 [P] (absent in round 1, read as zeros);
- ``update`` extras ``control_delta``: Δc_i, float32 [P].

Each costs 4·P bytes of tensor data under ``fp32`` plus one tensor header (the ledger's
``extras.control`` / ``extras.control_delta`` fields have the exact figure): for the light CNN
on 28×28 grayscale, P = 105,866, so 423,464 bytes each way — SCAFFOLD doubles FedAvg's
traffic, as the paper says. One flat entry rather than one per tensor keeps the extras count
fixed (the protocol allows 64 names) whatever the model; the price is that a lossy codec of the
extras (``[protocol] extras_codec``) scales the whole vector with one int8 scale.

**Momentum.** The paper's local solver is plain SGD. With ``momentum`` β > 0 the correction is
still added to the gradient (so the momentum buffer averages g + c − c_i, and weight decay is
added by the optimizer on top), but the displacement x − y then grows by up to 1/(1 − β)
(10× at β = 0.9), so option II's (x − y)/(K·η_l) would inflate c_i by that factor. In that case
the client uses what option II estimates for plain SGD instead: the mean, over the K steps, of
the uncorrected mini-batch gradients plus the weight-decay term (g + λ·y). For plain SGD (β = 0)
that mean equals option II exactly in exact arithmetic; the formula is used literally then.

**State.** c_i lives in the client object (one per device, for the whole run) and is committed
on receipt (:class:`~edge_agent.algorithms._base.StateOnReceipt`): a round's c_i⁺ stands only
once the server's receipt says it accepted the update; when the server refuses it (late,
invalid) or no definite answer comes before the device trains again, c_i goes back to its
committed value, so the next Δc_i is taken against what the server has counted. On the server,
a round skipped for want of a quorum still adds the Δc_i of the updates it accepted
(:meth:`broker_server.strategies.scaffold.Scaffold.skipped_round`). Together these keep
c = (1/N)·Σ_i c_i over the N clients (those never heard from count as c_i = 0) whatever the
server drops. Not covered: an update the server took whose receipt never reaches the device
before it trains again (the device rolls back, the server has counted it), and a device that
restarts (it starts again from c_i = 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import numpy as np
import torch

from ..errors import ModelError
from ._base import StateOnReceipt, StepContext, TrainConfig
from ._registry import register_client_algorithm
from .fedprox import LocalSGDClient, parameter_snapshot

#: Name of the server control variate c in the ``global`` extras (float32 [P]).
CONTROL = "control"
#: Name of the client's Δc_i in the ``update`` extras (float32 [P]).
CONTROL_DELTA = "control_delta"


def flatten(tensors) -> np.ndarray:
    """The tensors concatenated in order into one float64 CPU vector [P] (P = total element count)."""
    parts = [t.detach().to("cpu", torch.float64).reshape(-1) for t in tensors]
    return torch.cat(parts).numpy() if parts else np.zeros(0)


def unflatten(vector: np.ndarray, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Split a vector [P] into tensors shaped, typed and placed like ``like`` (inverse of :func:`flatten`).

    Raises:
        ModelError: ``vector`` is not 1-D with exactly Σ numel(like) entries.
    """
    total = sum(t.numel() for t in like)
    if vector.ndim != 1 or vector.shape[0] != total:
        raise ModelError(f"control variate of shape {tuple(vector.shape)}: the model has {total} parameters")
    out, start = [], 0
    for t in like:
        n = t.numel()
        out.append(torch.from_numpy(np.ascontiguousarray(vector[start:start + n])).to(t.device, t.dtype).view_as(t))
        start += n
    return out


def control_variate_option2(c_i: np.ndarray, c: np.ndarray, x: np.ndarray, y: np.ndarray, steps: int,
                            lr: float) -> np.ndarray:
    """c_i⁺ = c_i − c + (x − y)/(K·η_l): SCAFFOLD option II (Karimireddy et al. 2020, Alg. 1 line 12).

    Args:
        c_i, c: the client's and the server's control variates, float [P].
        x: the global model the round started from, y: the model after local training, float [P].
        steps: K ≥ 1, the number of local SGD steps taken.
        lr: η_l > 0, the local learning rate.

    Returns:
        c_i⁺, float64 [P].

    Raises:
        ValueError: ``steps`` < 1 or ``lr`` ≤ 0.
    """
    if steps < 1 or not lr > 0:
        raise ValueError(f"option II needs K >= 1 steps and lr > 0, got K={steps}, lr={lr}")
    return np.asarray(c_i, np.float64) - c + (np.asarray(x, np.float64) - y) / (steps * lr)


@register_client_algorithm("scaffold")
class ScaffoldClient(StateOnReceipt, LocalSGDClient):
    """SCAFFOLD client (option II; see the module docstring for the wire format, momentum and
    the state).

    Attributes:
        control: c_i after the last local round, float64 [P] (``None`` before the first round =
            zeros); rolled back by ``on_update_receipt`` when the server does not take that
            round's update (``committed_control``: the value the server has counted).
        steps: K of the last round (optimizer steps taken).
    """

    name = "scaffold"
    share = "all"
    buffers = "average"
    device_state = "its control variate c_i"

    state_attr = "control"

    def __init__(self, *, precision: str = "fp32") -> None:
        super().__init__(precision=precision)
        self.control: np.ndarray | None = None
        self.steps = 0
        self._x = np.zeros(0)
        self._c = np.zeros(0)
        self._grad_sum: list[torch.Tensor] = []
        self._correction: list[torch.Tensor] = []  # c − c_i per parameter tensor, this round
        self._weight_decay = 0.0

    def begin_round(self, model: torch.nn.Module, config: TrainConfig, params: Mapping[str, object],
                    global_extras: Mapping[str, np.ndarray]) -> None:
        """Read c (zeros when the global carries none) and prepare this round's correction
        c − c_i for :meth:`before_step`; the objective stays cross-entropy (returns ``None``).

        Raises:
            ModelError: ``control`` in the global extras does not have one entry per parameter.
        """
        anchors = parameter_snapshot(model)
        p = sum(a.numel() for a in anchors)
        c = np.asarray(global_extras[CONTROL], np.float64) if CONTROL in global_extras else np.zeros(p)
        unflatten(c, anchors)  # shape check before anything changes
        if self.control is None or self.control.shape != (p,):
            self.control = np.zeros(p)
        self._x, self._c, self.steps = flatten(anchors), c, 0
        self._correction = unflatten(c - self.control, anchors)  # c − c_i per parameter tensor
        self._weight_decay = config.weight_decay
        self._grad_sum = [torch.zeros_like(a) for a in anchors] if config.momentum > 0 else []

    def before_step(self, model: torch.nn.Module, context: StepContext) -> None:
        """The corrected gradient g + c − c_i, in place, once per mini-batch step (between
        ``backward()`` and the optimizer step, true gradients under fp16); counts the step (K).
        Under momentum it first adds g + λ·y to the round's gradient sum (module docstring).
        A parameter without a gradient is left alone."""
        wd = self._weight_decay
        for j, (param, corr) in enumerate(zip(model.parameters(), self._correction, strict=False)):
            if param.grad is None:
                continue
            if self._grad_sum:  # momentum: remember g + λ·y before the correction
                self._grad_sum[j] += param.grad + wd * param.detach()
            param.grad.add_(corr)
        self.steps += 1

    def end_round(self, model: torch.nn.Module, config: TrainConfig) -> dict[str, np.ndarray]:
        """c_i⁺ (option II, or the mean gradient under momentum), Δc_i = c_i⁺ − c_i to upload."""
        old = self.control if self.control is not None else np.zeros_like(self._c)
        if self.steps == 0:
            new = old
        elif self._grad_sum:
            new = flatten(self._grad_sum) / self.steps
        else:
            new = control_variate_option2(old, self._c, self._x, flatten(model.parameters()), self.steps, config.lr)
        delta = (new - old).astype(np.float32)
        self.control = old + delta  # exactly what the server adds up, so c stays the mean of the c_i
        return {CONTROL_DELTA: delta}

    def state_to_arrays(self, state: object) -> dict[str, np.ndarray]:
        """c_i as ``{"control": float64 [P]}``."""
        return {"control": np.array(state, np.float64, copy=True)}

    def state_from_arrays(self, arrays: Mapping[str, np.ndarray]) -> object:
        """c_i from ``{"control": [P]}``.

        Raises:
            ValueError: any other set of names, or not one flat array.
        """
        if set(arrays) != {"control"} or np.asarray(arrays["control"]).ndim != 1:
            raise ValueError(f"SCAFFOLD's device state is one flat array 'control', got "
                             f"{ {k: np.asarray(v).shape for k, v in arrays.items()} }")
        return np.array(arrays["control"], np.float64, copy=True)

    def check_device_state(self, model: torch.nn.Module) -> None:
        """c_i has one entry per model parameter (P).

        Raises:
            ValueError: another length.
        """
        p = sum(t.numel() for t in model.parameters())
        if self.control is not None and self.control.shape != (p,):
            raise ValueError(f"the kept c_i has {self.control.size} entries, this model {p} parameters")

    @property
    def committed_control(self) -> np.ndarray | None:
        """c_i as of the last update the server accepted (:attr:`control` once the round is settled)."""
        return cast("np.ndarray | None", self.committed_state)  # state_attr is "control"
