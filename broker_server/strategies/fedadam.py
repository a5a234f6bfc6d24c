"""FedAdam, server half: an Adam step on the averaged client update.

Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan, "Adaptive Federated
Optimization", ICLR 2021, Algorithm 2 (FedAdam; SPECS §6.14). With the pseudo-gradient

    Δ_t = Σ_i (n_i/n)·w_i − w_t          (FedAvg's sample-weighted mean minus the global model)

the server keeps m, v (zero at first) and sets

    m_t = β1·m_{t−1} + (1 − β1)·Δ_t
    v_t = β2·v_{t−1} + (1 − β2)·Δ_t²
    w_{t+1} = w_t + η·m_t / (√v_t + τ)

Defaults (SPECS §6.14, the paper's CIFAR-10 setting as in Flower's baseline config):
η = ``server_lr`` = 1e-2, β1 = 0.9, β2 = 0.99, τ = 1e-3 (the paper's client rate η_l = 10^−1.5
is the ordinary ``[train] lr``). **Bias correction** is off by default, as in the paper's
Algorithm 2; ``bias_correction = true`` multiplies η by √(1 − β2^t)/(1 − β1^t) with t = the
number of server steps taken (Kingma & Ba); Flower always applies it, with t = round + 1.
The step applies to every floating-point tensor; integer state takes FedAvg's mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._registry import register_strategy
from .fedopt import ServerOptimizer, check_range

#: FedAdam defaults (SPECS §6.14).
SERVER_LR = 1e-2
BETA1 = 0.9
BETA2 = 0.99
TAU = 1e-3


def adam_server_step(current: Sequence[np.ndarray], delta: Sequence[np.ndarray], m: Sequence[np.ndarray] | None,
                     v: Sequence[np.ndarray] | None, *, step: int, lr: float, beta1: float, beta2: float, tau: float,
                     bias_correction: bool = False) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """One FedAdam server step (Reddi et al. 2021, Alg. 2, lines for m_t, v_t, x_{t+1}).

    Args:
        current: w_t, float arrays. delta: Δ_t, same shapes.
        m, v: the moments before the step (``None`` = zeros).
        step: t ≥ 1, this step's number (used by the bias correction only).
        lr: η > 0. beta1, beta2: in [0, 1). tau: τ > 0 (adaptivity, keeps the division finite).
        bias_correction: scale η by √(1 − β2^t)/(1 − β1^t).

    Returns:
        (w_{t+1} in each tensor's dtype, m_t, v_t in float64). Inputs are not modified.
    """
    m0 = [np.zeros_like(d) for d in delta] if m is None else [np.asarray(a, np.float64) for a in m]
    v0 = [np.zeros_like(d) for d in delta] if v is None else [np.asarray(a, np.float64) for a in v]
    m1 = [beta1 * a + (1 - beta1) * d for a, d in zip(m0, delta, strict=False)]
    v1 = [beta2 * a + (1 - beta2) * d * d for a, d in zip(v0, delta, strict=False)]
    eta = lr * np.sqrt(1 - beta2 ** step) / (1 - beta1 ** step) if bias_correction else lr
    new = [(np.asarray(w, np.float64) + eta * a / (np.sqrt(b) + tau)).astype(np.asarray(w).dtype)
           for w, a, b in zip(current, m1, v1, strict=False)]
    return new, m1, v1


@register_strategy("fedadam")
class FedAdam(ServerOptimizer):
    """FedAdam (see the module docstring).

    Args:
        participation_rate, min_clients, train_config: as :class:`FedAvg`.
        server_lr: η > 0 (default :data:`SERVER_LR`).
        beta1, beta2: in [0, 1) (defaults :data:`BETA1`, :data:`BETA2`).
        tau: τ > 0 (default :data:`TAU`).
        bias_correction: Adam's bias correction of η (default off, as the paper).

    Raises:
        ValueError: a hyperparameter out of range.

    State (``state_dict``, for ``--resume``): m and v (float64 arrays, the floating tensors'
    shapes; ``None`` before the first step) and the step count t.
    """

    name = "fedadam"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()

    def __init__(self, *, server_lr: float = SERVER_LR, beta1: float = BETA1, beta2: float = BETA2, tau: float = TAU,
                 bias_correction: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.server_lr = check_range("server_lr", server_lr, 0.0, np.inf, low_open=True)
        self.beta1 = check_range("beta1", beta1, 0.0, 1.0, high_open=True)
        self.beta2 = check_range("beta2", beta2, 0.0, 1.0, high_open=True)
        self.tau = check_range("tau", tau, 0.0, np.inf, low_open=True)
        if not isinstance(bias_correction, bool):
            raise ValueError(f"bias_correction must be true or false, got {bias_correction!r}")
        self.bias_correction = bias_correction
        self.m: list[np.ndarray] | None = None
        self.v: list[np.ndarray] | None = None
        self.steps = 0

    def optimizer_step(self, current, delta):
        t = self.steps + 1
        new, m, v = adam_server_step(current, delta, self.m, self.v, step=t, lr=self.server_lr, beta1=self.beta1,
                                     beta2=self.beta2, tau=self.tau, bias_correction=self.bias_correction)
        return new, {"m": m, "v": v, "steps": t}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "m": self.m, "v": self.v, "steps": int(self.steps)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.m, self.v, self.steps = state.get("m"), state.get("v"), int(state.get("steps", 0))
