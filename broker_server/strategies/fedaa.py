"""FedAA, server half: a DDPG agent chooses the aggregation weights of the round's client models
(He, Chen, Zhang, "FedAA: A Reinforcement Learning Perspective on Adaptive Aggregation for Fair
and Robust Federated Learning", AAAI 2025; SPECS §4.3, a baseline of FedDO). The agent is
:class:`broker_server.rl.ddpg.DDPGAgent`.

Round t:

1. Selection as FedAvg: a fraction C (``[server] participation_rate``) of the available devices.
   The agent's width m (``aggregated``; 0 = the number selected in round 1) is fixed for the run.
2. **State** s_t ∈ [0, 1]^m (:func:`distance_state`): for the reporting models w_1 … w_n (client-id
   order, n ≤ m), the row sums D_i = Σ_j ‖w_i − w_j‖₂ of their pairwise L2 distances, divided by
   max_i D_i (SPECS §4.3: "normalised row-sums of pairwise L2 distances between the selected
   client models"; dividing by the maximum is a guess, the code is not readable); slots of
   devices that did not report are 0.
3. **Action** a_t = μ(s_t) + exploration, on the simplex (the actor's |·| / ‖·‖₁ output); the
   new global model w = Σ_i a_i·w_i / Σ_i a_i over the slots that reported (renormalised when
   some did not).
4. **Reward** r_t: the new global model's accuracy on the server's validation set
   (:func:`~broker_server.strategies.feddo.validation_split`, the same as FedDO's). FedAA's
   code rewards the number of correct predictions summed over the clients' test sets, which is
   this accuracy times a constant (the test-set size); the fraction keeps the critic's scale
   independent of the data set.
5. The transition (s_t, a_t, r_t, s_{t+1}, done = 0) is stored when s_{t+1} is built (the next
   round's aggregation) and the agent takes ``updates_per_round`` DDPG steps once the buffer
   holds ``warmup`` transitions. FedAA pre-trains over episodes that re-initialise the model; a
   deployed run here is one episode and the agent learns online.

Keys (``[algorithm]``; defaults SPECS §4.3 / FedAA's code): ``aggregated`` (0), ``clip_norm``
(60: the clients' gradient clip, sent in every ``round_start``), ``hidden`` (256), ``lr_actor`` and
``lr_critic`` (1e-2), ``weight_decay`` (1e-5), ``gamma`` (0.99), ``tau`` (0.001), ``batch_size``
(16), ``warmup`` (16 transitions), ``capacity`` (10,000), ``noise_std`` (0.1),
``updates_per_round`` (1), ``val_size`` (500), ``val_source`` (``"train"``), ``mode``
(``"agent"``; ``"uniform"`` = the control that replaces the agent by equal weights, which is
FedAvg with uniform rather than sample-count weights).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from edge_agent.algorithms.fedaa import CLIP_NORM

from ..aggregate import select_clients, weighted_average
from ..rl.ddpg import DDPGAgent, DDPGConfig
from ._base import ClientResult, GlobalUpdate, RoundPlan, Scalar, Strategy
from ._registry import register_strategy
from .feddo import VAL_SIZE, validate_model, validation_split

log = logging.getLogger(__name__)

MODES = ("agent", "uniform")


def pairwise_distances(models: Sequence[Sequence[np.ndarray]]) -> np.ndarray:
    """‖w_i − w_j‖₂ over every floating tensor of the models, float64 [n, n] (0 on the
    diagonal), through the Gram matrix of the flattened models (float64), clipped at 0 against
    rounding."""
    flat = np.stack([np.concatenate([np.asarray(t, np.float64).ravel() for t in m
                                     if np.issubdtype(np.asarray(t).dtype, np.floating)]) for m in models])
    sq = np.einsum("ij,ij->i", flat, flat)
    gram = flat @ flat.T
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2.0 * gram, 0.0)
    np.fill_diagonal(d2, 0.0)
    return np.sqrt(d2)


def distance_state(distances: np.ndarray, slots: Sequence[int], width: int) -> np.ndarray:
    """s ∈ [0, 1]^width: the row sums of ``distances`` [n, n] divided by their maximum (zeros
    when all are 0), written at positions ``slots`` (n of them), 0 elsewhere; float32."""
    rows = np.asarray(distances, np.float64).sum(axis=1)
    top = float(rows.max()) if rows.size else 0.0
    s = np.zeros(width, np.float64)
    if top > 0:
        s[list(slots)] = rows / top
    return s.astype(np.float32)


@register_strategy("fedaa")
class FedAA(Strategy):
    """FedAA strategy (module docstring for the round and every key)."""

    name = "fedaa"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()
    #: the reward of round t (:meth:`evaluate`) is stored with its transition at round t+1's commit
    plans_from_evaluation = True
    setup_keys = ("validation", "run_seed")  # from setup_kwargs, not [algorithm] keys

    def __init__(self, *, participation_rate: float = 1.0, min_clients: int = 1,
                 train_config: Mapping[str, Scalar] | None = None, aggregated: int = 0,
                 clip_norm: float = CLIP_NORM, hidden: int = 256, lr_actor: float = 1e-2, lr_critic: float = 1e-2,
                 weight_decay: float = 1e-5, gamma: float = 0.99, tau: float = 0.001, batch_size: int = 16,
                 warmup: int = 16, capacity: int = 10_000, noise_std: float = 0.1, updates_per_round: int = 1,
                 val_size: int = VAL_SIZE, val_source: str = "train", mode: str = "agent",
                 validation: tuple[np.ndarray, np.ndarray] | None = None, run_seed: int = 0) -> None:
        problems = []
        if not 0 < participation_rate <= 1:
            problems.append(f"participation_rate must be in (0, 1], got {participation_rate}")
        if aggregated < 0 or updates_per_round < 0 or val_size < 1:
            problems.append(f"aggregated ({aggregated}) and updates_per_round ({updates_per_round}) must be >= 0, "
                            f"val_size ({val_size}) >= 1")
        if not (np.isfinite(clip_norm) and clip_norm >= 0):
            problems.append(f"clip_norm = {clip_norm} must be a finite number >= 0 (0: no clipping)")
        if mode not in MODES:
            problems.append(f"mode = {mode!r} must be one of {MODES}")
        if val_source not in ("train", "test"):
            problems.append(f"val_source = {val_source!r} must be 'train' or 'test'")
        if problems:
            raise ValueError("; ".join(problems))
        self.agent_config = DDPGConfig(hidden=hidden, lr_actor=lr_actor, lr_critic=lr_critic,
                                       weight_decay=weight_decay, gamma=gamma, tau=tau, batch_size=batch_size,
                                       warmup=warmup, capacity=capacity, noise_std=noise_std)
        self.participation_rate, self.min_clients = float(participation_rate), int(min_clients)
        self.train_config = {**dict(train_config or {}), "clip_norm": float(clip_norm)}
        self.width, self.mode, self.updates_per_round = int(aggregated), mode, int(updates_per_round)
        self.validation = validation
        self.run_seed = int(run_seed)
        self.agent: DDPGAgent | None = None
        self.pending: dict[str, Any] | None = None  # {"s", "a", "r"} of the last aggregation
        self.last_update: dict[str, float] = {}
        self.next_state: np.ndarray | None = None  # set by commit() from the update's state
        self.next_action: np.ndarray | None = None

    @classmethod
    def setup_kwargs(cls, dataset: Any, params: Mapping[str, object], seed: int,
                     device_samples: np.ndarray | None = None) -> dict:
        """The validation set (:func:`~broker_server.strategies.feddo.validation_split`, held out
        from ``device_samples``) and the run seed."""
        return {"validation": validation_split(dataset, params, seed, device_samples), "run_seed": seed}

    def configure_round(self, round: int, available: Sequence[str], rng: np.random.Generator) -> RoundPlan:
        """FedAvg's selection, at most ``aggregated`` devices once the width is fixed."""
        selected = select_clients(available, self.participation_rate, self.min_clients, rng)
        if not self.width:
            self.width = len(selected)
            log.info("FedAA: the agent weights %d aggregated models per round", self.width)
        if len(selected) > self.width:
            selected = sorted(rng.choice(sorted(selected), self.width, replace=False).tolist())
        return RoundPlan(selected=tuple(selected), config=dict(self.train_config))

    def _ensure_agent(self, width: int) -> DDPGAgent:
        if self.agent is None:
            self.agent = DDPGAgent(width, width, self.agent_config, seed=self.run_seed)
            log.info("FedAA: DDPG agent for %d aggregated models, %d parameters", width, self.agent.parameter_count())
        return self.agent

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        """s_t from the reported models, the action, and the models averaged with its weights
        (module docstring, steps 2–3). Nothing is mutated: the exploration noise comes from a
        generator of (run seed, round), and the transition is stored on :meth:`commit`."""
        if not results:
            return None
        width = self.width or len(results)
        ordered = sorted(results, key=lambda r: r.client_id)[:width]
        slots = list(range(len(ordered)))
        s = distance_state(pairwise_distances([r.tensors for r in ordered]), slots, width)
        if self.mode == "agent":
            noise = torch.Generator().manual_seed(self.run_seed * 1_000_003 + round)
            a = self._ensure_agent(width).act(s, noise=noise)
        else:
            a = np.full(width, 1.0 / width)
        w = np.asarray(a, np.float64)[slots]
        if not w.sum() > 0:
            w = np.ones(len(slots))
        weights = {r.client_id: float(x) for r, x in zip(ordered, w / w.sum(), strict=True)}
        return GlobalUpdate(tensors=weighted_average([r.tensors for r in ordered], list(w)),
                            state={"next_state": s, "next_action": np.asarray(a, np.float32)},
                            metrics={"fedaa_weights": weights, "fedaa_state": [float(v) for v in s]})

    def commit(self, round: int, update: GlobalUpdate) -> None:
        """Adopt ``update``; store the previous round's transition (s_{t−1}, a_{t−1}, r_{t−1}, s_t)
        when its reward is known, take the learning steps, and keep (s_t, a_t) pending until
        :meth:`evaluate` gives r_t (module docstring, step 5)."""
        super().commit(round, update)
        if self.next_state is None:
            return
        self.width = self.width or int(self.next_state.size)
        agent = self._ensure_agent(self.width)
        self.last_update = {}
        if self.pending is not None and self.pending.get("r") is not None:
            agent.observe(self.pending["s"], self.pending["a"], self.pending["r"], self.next_state, False)
            self.last_update = agent.update(self.updates_per_round)
        self.pending = {"s": self.next_state, "a": self.next_action, "r": None}
        self.next_state = self.next_action = None

    def evaluate(self, round: int, model: torch.nn.Module) -> Mapping[str, Any]:
        """The round's reward: the new global model's validation accuracy (step 4)."""
        if self.validation is None:
            raise ValueError("FedAA has no validation set (built by setup_kwargs from the data set)")
        acc, loss = validate_model(model, self.validation)
        if self.pending is not None and self.pending.get("r") is None:
            self.pending["r"] = acc
        return {"fedaa_val_accuracy": acc, "fedaa_reward": acc}

    def round_metrics(self) -> dict:
        """The replay size and the agent's last losses."""
        out: dict[str, Any] = {"fedaa_replay": len(self.agent.buffer) if self.agent is not None else 0}
        out.update({f"fedaa_{k}": v for k, v in self.last_update.items()})
        return out

    def state_dict(self) -> dict:
        """The agent (networks, optimisers, generators, replay buffer: bytes), its width and the
        pending transition."""
        p = self.pending
        return {"agent": self.agent.to_bytes() if self.agent is not None else b"", "width": self.width,
                "pending": None if p is None else {"s": p["s"], "a": p["a"], "r": p["r"]}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (``{}``: nothing)."""
        if not state:
            return
        self.width = int(state["width"])
        if state["agent"]:
            self._ensure_agent(self.width).load_bytes(state["agent"])
        p = state.get("pending")
        self.pending = None if p is None else {"s": np.asarray(p["s"], np.float32), "a": np.asarray(p["a"], np.float32),
                                               "r": None if p["r"] is None else float(p["r"])}
