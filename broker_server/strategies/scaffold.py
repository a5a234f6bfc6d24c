"""SCAFFOLD, server half: model step and control-variate update.

Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML
2020, Algorithm 1, lines 16–17 (SPECS §6.12). With S the clients that reported, y_i their
models, Δc_i their control-variate changes and N the number of clients in the federation:

    x ← x + η_g · mean_{i∈S}(y_i − x)
    c ← c + (1/N) · Σ_{i∈S} Δc_i          (= c + (|S|/N)·mean(Δc_i); SPECS: "Σ Δc / N_total")

``mean`` is uniform over S by default, as the paper (and PFLlib's and NIID-Bench's SCAFFOLD);
``weighting = "samples"`` uses FedAvg's n_i/n instead, so that with c = 0 and η_g = 1 the model
update is exactly FedAvg's (useful when shards differ in size, e.g. domain silos). The c update
is always the paper's 1/N: c tracks the mean of all N clients' c_i.

N: ``[algorithm] num_clients`` when > 0, else the most clients the server has ever offered a
round (joined and online; at least the number that reported). c is a flat float32 vector over
the model's trainable parameters, broadcast as the ``global`` extras entry ``control`` from round
2 on (before any client reported, c = 0 and nothing is sent); clients send Δc_i as
``control_delta`` (see :mod:`edge_agent.algorithms.scaffold` for the layout and the bytes).
η_g = ``server_lr``, default 1 (the paper's and SPECS').

**Dropped updates.** c must stay (1/N)·Σ_i c_i over the N clients, each device's c_i counting
what the server counted (a client never heard from has c_i = 0). The devices commit c_i⁺ only
on an accepted receipt (:mod:`edge_agent.algorithms.scaffold`, "State"), so an update the server
refuses or never sees leaves both sides as they were; a round skipped for want of a quorum did
accept (and acknowledge) its updates, so :meth:`Scaffold.skipped_round` adds their Σ Δc_i / N to
c while the model stays as it is, and the round's checkpoint holds that c. The equality holds
up to c's float32 rounding, with N fixed for the run (``num_clients``, or the whole fleet
present from round 1: N = the most clients offered a round grows when a device joins late) and
a lossless extras codec (a lossy one makes c add the decoded Δc_i, the device the exact one).
Not covered: an accepted update whose receipt never reaches its device before it trains again
(the device rolls back what c counted), and a round whose aggregate is non-finite (the server
discards it whole, c included, after its devices committed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from edge_agent.algorithms.scaffold import CONTROL, CONTROL_DELTA

from ._base import Accumulator, ClientResult, GlobalUpdate, parameter_count
from ._registry import register_strategy
from .fedopt import ServerStepStrategy, check_range, step_floats, update_norm

if TYPE_CHECKING:
    import torch

#: SCAFFOLD global step size η_g (SPECS §6.12).
SERVER_LR = 1.0


def _state_only(update: GlobalUpdate | None) -> GlobalUpdate | None:
    """``update`` without its model (``tensors=None``) and without ``server_update_norm``: the
    part of a skipped round's aggregate that mirrors the devices' committed state."""
    if update is None:
        return None
    return GlobalUpdate(tensors=None, extras=update.extras, state=update.state,
                        metrics={k: v for k, v in update.metrics.items() if k != "server_update_norm"})


def scaffold_server_update(x: Sequence[np.ndarray], mean_y: Sequence[np.ndarray], c: np.ndarray | None,
                           sum_dc: np.ndarray, num_clients: int,
                           server_lr: float) -> tuple[list[np.ndarray], np.ndarray]:
    """x ← x + η_g·(mean(y_i) − x), c ← c + Σ Δc_i / N (Karimireddy et al. 2020, Alg. 1 l. 16–17).

    Args:
        x: the global model the round started from (floating-point arrays).
        mean_y: the (uniform or sample-weighted) mean of the reported models, same shapes.
        c: the server control variate, float [P] (``None`` = zeros).
        sum_dc: Σ_{i∈S} Δc_i, float [P].
        num_clients: N ≥ 1, the federation's client count.
        server_lr: η_g > 0.

    Returns:
        (new x in each tensor's dtype, new c float32 [P]). Inputs are not modified.

    Raises:
        ValueError: ``num_clients`` < 1, or ``c`` and ``sum_dc`` of different shapes.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    sum_dc = np.asarray(sum_dc, np.float64)
    c0 = np.zeros_like(sum_dc) if c is None else np.asarray(c, np.float64)
    if c0.shape != sum_dc.shape:
        raise ValueError(f"control variate of shape {c0.shape} but Σ Δc of shape {sum_dc.shape}")
    new_x = [(np.asarray(w, np.float64) + server_lr * (np.asarray(m, np.float64) - w)).astype(np.asarray(w).dtype)
             for w, m in zip(x, mean_y, strict=False)]
    return new_x, (c0 + sum_dc / num_clients).astype(np.float32)


@register_strategy("scaffold")
class Scaffold(ServerStepStrategy):
    """SCAFFOLD server (see the module docstring).

    Args:
        participation_rate, min_clients, train_config: as :class:`FedAvg`.
        server_lr: η_g > 0 (default 1).
        num_clients: N for the c update; 0 (default) = the most clients ever offered a round.
        weighting: ``"uniform"`` (default, the paper) or ``"samples"`` (FedAvg's weights) for
            the model mean.

    Raises:
        ValueError: a hyperparameter out of range.

    State (``state_dict``): c (float32 [P], ``None`` until the first update) and ``clients_seen``.

    P is the bound model's parameter count (:meth:`bind_model`, called by the server before
    round 1); unbound, P is c's size once c exists (in round 1 any size is accepted).
    """

    name = "scaffold"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()

    def __init__(self, *, server_lr: float = SERVER_LR, num_clients: int = 0, weighting: str = "uniform",
                 **kw) -> None:
        super().__init__(**kw)
        self.server_lr = check_range("server_lr", server_lr, 0.0, np.inf, low_open=True)
        self.set_fleet_options(num_clients, weighting)
        self.control: np.ndarray | None = None
        self.num_params: int | None = None  # P of the bound model

    def bind_model(self, model: torch.nn.Module) -> None:
        """P = the model's parameter count (:func:`~broker_server.strategies._base.parameter_count`,
        the client's layout of c and Δc_i). Called by the server before round 1."""
        self.num_params = parameter_count(model)

    def global_extras(self) -> dict[str, np.ndarray]:
        """``{"control": c}`` (float32 [P]); ``{}`` while c is still the initial zero vector of unknown size."""
        return self.extras_of({"control": self.control})

    def extras_of(self, state) -> dict[str, np.ndarray]:
        """``{"control": c}`` of a prospective state (``{}`` without a c)."""
        c = state.get("control")
        return {} if c is None else {CONTROL: c}

    def validate(self, result: ClientResult) -> str | None:
        """Refuse an update without exactly one extras entry ``control_delta``, float32 [P],
        finite, with P = the bound model's parameter count, else the size of c (once known)."""
        if set(result.extras) != {CONTROL_DELTA}:
            return f"SCAFFOLD updates carry exactly one extras entry {CONTROL_DELTA!r}, got {sorted(result.extras)}"
        dc = np.asarray(result.extras[CONTROL_DELTA])
        if dc.dtype != np.float32 or dc.ndim != 1:
            return f"{CONTROL_DELTA} must be a float32 vector, got {dc.dtype} {dc.shape}"
        size = self.num_params if self.num_params is not None else (
            None if self.control is None else self.control.shape[0])
        if size is not None and dc.shape != (size,):
            return f"{CONTROL_DELTA} has {dc.shape[0]} entries, the control variate {size}"
        if not np.isfinite(dc).all():
            return f"{CONTROL_DELTA} holds NaN/Inf"
        return None

    def sum_parts(self):
        # Δc first: a size clash within round 1 (before c's size is known) fails before the model is added
        return {"control": lambda r: ([np.asarray(r.extras[CONTROL_DELTA])], 1.0), **super().sum_parts()}

    def finish_round(self, current, sums):
        dc = sums["control"]
        n = self.fleet_size(dc.count)
        sum_dc = dc.mean()[0].astype(np.float64) * dc.total_weight  # uniform weights: mean · |S| = Σ Δc_i
        out: dict = {}

        def step(x, mean_y):
            new, out["control"] = scaffold_server_update(x, mean_y, self.control, sum_dc, n, self.server_lr)
            return new

        new = step_floats(current, sums["model"].mean(), step)
        out["_metrics"] = {"server_update_norm": update_norm(current, new), "num_clients": n,
                           "control_norm": float(np.linalg.norm(out["control"]))}
        return new, out

    def skipped_round(self, round: int, accumulator: Accumulator) -> GlobalUpdate | None:
        """A round closed without aggregation (quorum missed) whose accepted updates' devices kept
        their c_i⁺: c ← c + (1/N)·Σ_{i∈S} Δc_i over those updates, the model unchanged.

        This is the round's own :meth:`finish_round` (``accumulator.result()``: the same
        :func:`scaffold_server_update`) with its model dropped (``tensors=None``), so c is
        committed by the driver only when finite and encodable, as in an aggregated round. The
        round's metrics keep ``control_norm`` and ``num_clients``, not the update norm of a
        model never applied.
        """
        return _state_only(accumulator.result())

    def state_dict(self) -> dict:
        return {**super().state_dict(), "control": self.control}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        c = state.get("control")
        self.control = None if c is None else np.asarray(c, np.float32)
