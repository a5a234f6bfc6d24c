"""FedDyn, server half: the h state and the corrected mean.

Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021, Algorithm 1
(SPECS §6.13). With S the clients that reported, w_i their models, w_g the global model the
round started from and N the number of clients in the federation:

    h ← h − α · (1/N) · Σ_{i∈S} (w_i − w_g)
    w_g ← mean_{i∈S}(w_i) − h/α

h starts at zero. ``mean`` is uniform over S by default, as the paper (and PFLlib's
``serverdyn``); ``weighting = "samples"`` uses FedAvg's n_i/n for it (h keeps the paper's
uniform 1/N sum: it tracks the mean of all N clients' gradient states). N:
``[algorithm] num_clients`` when > 0, else the most clients the server has ever offered a
round. α = ``[algorithm] alpha`` (default 0.01), also sent to the clients in
``round_start.config``. h covers every floating-point tensor of the model (the light CNN has
parameters only; a model with BatchNorm would have its running statistics treated likewise);
integer state takes the mean.

**Dropped updates.** h must stay (1/N)·Σ_k ∇L_k, the devices' gradient states (a client never
heard from counts as zero): both sides add −α·(w_k − w_g) for the updates the server counted.
The devices commit their new state only on an accepted receipt
(:mod:`edge_agent.algorithms.feddyn`), so an update the server refuses or never sees leaves both
sides as they were; a round skipped for want of a quorum did accept (and acknowledge) its
updates, so :meth:`FedDyn.skipped_round` applies the h update with their models while w_g stays
as it is, and the round's checkpoint holds that h. The equality holds with N fixed for the run
(``num_clients``, or the whole fleet present from round 1) and a lossless update codec (with a
lossy one h adds the decoded w_i, the device its exact w_k). Not covered: an accepted update
whose receipt never reaches its device before it trains again (the device rolls back what h
counted), and a round whose aggregate is non-finite (the server discards it whole, h included,
after its devices committed).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edge_agent.algorithms.feddyn import ALPHA

from ._base import Accumulator, GlobalUpdate
from ._registry import register_strategy
from .fedopt import ServerStepStrategy, check_range, step_floats, update_norm
from .scaffold import _state_only


def feddyn_server_update(w_g: Sequence[np.ndarray], mean_w: Sequence[np.ndarray], sum_diff: Sequence[np.ndarray],
                         h: Sequence[np.ndarray] | None, alpha: float,
                         num_clients: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One FedDyn server step on floating-point tensors (Acar et al. 2021, Alg. 1, server lines).

    Args:
        w_g: the global model the round started from (float arrays).
        mean_w: mean of the reported models, same shapes.
        sum_diff: Σ_{i∈S}(w_i − w_g), same shapes.
        h: the state before the round (``None`` = zeros).
        alpha: α > 0. num_clients: N ≥ 1.

    Returns:
        (new w_g in each tensor's dtype, new h in float64). Inputs are not modified.

    Raises:
        ValueError: α ≤ 0 or N < 1.
    """
    if not alpha > 0 or num_clients < 1:
        raise ValueError(f"FedDyn needs alpha > 0 and N >= 1, got alpha={alpha}, N={num_clients}")
    h0 = [np.zeros(np.shape(d)) for d in sum_diff] if h is None else [np.asarray(a, np.float64) for a in h]
    h1 = [a - alpha / num_clients * np.asarray(d, np.float64) for a, d in zip(h0, sum_diff, strict=False)]
    new = [(np.asarray(m, np.float64) - a / alpha).astype(np.asarray(w).dtype)
           for w, m, a in zip(w_g, mean_w, h1, strict=False)]
    return new, h1


@register_strategy("feddyn")
class FedDyn(ServerStepStrategy):
    """FedDyn server (see the module docstring).

    Args:
        participation_rate, min_clients, train_config: as :class:`FedAvg`.
        alpha: α > 0 (default :data:`edge_agent.algorithms.feddyn.ALPHA`).
        num_clients: N; 0 (default) = the most clients ever offered a round.
        weighting: ``"uniform"`` (default, the paper) or ``"samples"`` for the model mean.

    Raises:
        ValueError: a hyperparameter out of range.

    State (``state_dict``): h (float64 arrays, the floating tensors' shapes; ``None`` before
    the first aggregation) and ``clients_seen``.
    """

    name = "feddyn"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()

    def __init__(self, *, alpha: float = ALPHA, num_clients: int = 0, weighting: str = "uniform", **kw) -> None:
        super().__init__(**kw)
        self.alpha = check_range("alpha", alpha, 0.0, np.inf, low_open=True)
        self.set_fleet_options(num_clients, weighting)
        self.train_config["alpha"] = self.alpha
        self.h: list[np.ndarray] | None = None

    def sum_parts(self):
        parts = super().sum_parts()
        if self.weighting != "uniform":  # Σ(w_i − w_g) needs the unweighted sum as well
            parts["sum"] = lambda r: (r.tensors, 1.0)
        return parts

    def finish_round(self, current, sums):
        mean = sums["model"].mean()
        uniform = sums.get("sum", sums["model"])
        mean_u = mean if uniform is sums["model"] else uniform.mean()
        sum_diff = [uniform.count * (np.asarray(m, np.float64) - w) for w, m in zip(current, mean_u, strict=False)]
        n = self.fleet_size(uniform.count)
        out: dict = {}

        def step(w_g, m, d):
            new, out["h"] = feddyn_server_update(w_g, m, d, self.h, self.alpha, n)
            return new

        new = step_floats(current, mean, step, sum_diff)
        out["_metrics"] = {"server_update_norm": update_norm(current, new), "num_clients": n,
                           "h_norm": float(np.sqrt(sum(float(np.sum(a * a)) for a in out["h"])))}
        return new, out

    def skipped_round(self, round: int, accumulator: Accumulator) -> GlobalUpdate | None:
        """A round closed without aggregation (quorum missed) whose accepted updates' devices kept
        their new ∇L_k: h ← h − α·(1/N)·Σ_{i∈S}(w_i − w_g) over those updates, w_g unchanged.

        This is the round's own :meth:`finish_round` (``accumulator.result()``: the same
        :func:`feddyn_server_update`) with its model dropped (``tensors=None``), so h is
        committed by the driver only when finite, as in an aggregated round. The round's
        metrics keep ``h_norm`` and ``num_clients``, not the update norm of a model never applied.
        """
        return _state_only(accumulator.result())

    def state_dict(self) -> dict:
        return {**super().state_dict(), "h": self.h}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.h = state.get("h")
