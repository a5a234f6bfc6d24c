"""FedOpt, server half: server SGD with momentum on the averaged client update (FedAvgM).

Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 1 (SPECS §6.14) with the
server optimizer SGD + momentum, which is what RethinkFL's ``models/fedopt.py`` (the code base
FedPAD forks, and FedPAD's "FedOpt" baseline) runs: the pseudo-gradient

    Δ_t = Σ_i (n_i/n)·w_i − w_t        (FedAvg's sample-weighted mean minus the global model)

drives ``b ← β·b + Δ_t``, ``w_{t+1} = w_t + η·b`` (torch ``SGD(momentum=β, dampening=0)`` on the
gradient −Δ_t, the buffer starting at zero, so b_1 = Δ_1). Defaults: β = ``server_momentum`` =
0.9 (RethinkFL hard-codes it) and η = ``server_lr`` = 0.1 [guess: RethinkFL reads ``global_lr``
from its command line with the comment "0.5 0.25 0.1" and no default; 0.1 makes the steady-state
step η/(1 − β) = 1 × the averaged update, FedAvg's scale]. RethinkFL averages the models
uniformly; here the mean is FedAvg's sample-weighted one (equal shards: the same).

This module also holds :class:`ServerStepStrategy`, the streaming base of the server-side
baselines that turn the round's running sums into a new global model (FedOpt, FedAdam,
SCAFFOLD, FedDyn), and :func:`pseudo_gradient`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..aggregate import RunningWeightedSum
from ._base import ClientResult, GlobalUpdate, RoundPlan, fold
from ._registry import register_strategy
from .fedavg import MODEL_WEIGHTINGS, FedAvg

#: FedOpt defaults (RethinkFL momentum; the learning rate is a guess, see the module docstring).
SERVER_LR = 0.1
SERVER_MOMENTUM = 0.9

#: How the models are averaged: FedAvg's sample weights n_i, or uniformly (SCAFFOLD's and FedDyn's papers).
WEIGHTINGS = MODEL_WEIGHTINGS

#: What one accepted result adds to one running sum: ``result -> (arrays, weight)``.
SumPart = Callable[[ClientResult], tuple[Sequence[np.ndarray], float]]


def is_float(a: np.ndarray) -> bool:
    """True for floating-point arrays (the tensors a server optimizer steps; integer state such
    as BatchNorm's ``num_batches_tracked`` just takes the mean)."""
    return bool(np.issubdtype(np.asarray(a).dtype, np.floating))


def pseudo_gradient(current: Sequence[np.ndarray], mean: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Δ = mean − current per tensor, in float64 (Reddi et al. 2021, Alg. 2, Δ_t).

    Args:
        current: the global model w_t the round started from (float arrays, manifest order).
        mean: the clients' averaged models, same shapes.

    Returns:
        float64 arrays of the same shapes.
    """
    return [np.asarray(m, np.float64) - np.asarray(w, np.float64) for w, m in zip(current, mean, strict=False)]


def momentum_server_step(current: Sequence[np.ndarray], delta: Sequence[np.ndarray],
                         buffer: Sequence[np.ndarray] | None, lr: float,
                         momentum: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Server SGD with heavy-ball momentum on the pseudo-gradient: b ← β·b + Δ, w ← w + η·b.

    Args:
        current: w_t (float arrays). delta: Δ_t, same shapes. buffer: b_{t−1} (``None`` = zeros).
        lr: η > 0. momentum: β in [0, 1).

    Returns:
        (w_{t+1} in each tensor's dtype, b_t in float64). Inputs are not modified.
    """
    prev = [np.zeros_like(d) for d in delta] if buffer is None else [np.asarray(bb, np.float64) for bb in buffer]
    b = [momentum * p + d for p, d in zip(prev, delta, strict=False)]
    new = [(np.asarray(w, np.float64) + lr * bb).astype(np.asarray(w).dtype) for w, bb in zip(current, b, strict=False)]
    return new, b


def check_range(name: str, value: float, low: float, high: float, *, low_open: bool = False,
                high_open: bool = False) -> float:
    """``float(value)`` when it lies in the interval [low, high] (ends open as asked).

    Raises:
        ValueError: outside the interval or not finite (the runtime reports it as a ConfigError
            naming the ``[algorithm]`` key).
    """
    v = float(value)
    ok = np.isfinite(v) and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be in {lo}{low}, {high}{hi}, got {value!r}")
    return v


class SumsAccumulator:
    """One round's accepted results folded into named running weighted sums on arrival; at the
    end ``finish(sums)`` turns them into the new shared tensors (streaming: server memory is one
    model per sum, whatever the number of clients).

    Args:
        parts: name → :data:`SumPart`: what each result adds to the sum of that name.
        finish: ``{name: RunningWeightedSum} -> GlobalUpdate | None``, called by :meth:`result`
            once at least one result was added.

    Raises:
        ValueError: from :meth:`add`, an update whose arrays do not match the first one's. The
            parts are added in order, so a strategy whose later parts can fail (extras) checks
            them in its ``validate``, which the server calls before ``add``.
    """

    def __init__(self, parts: Mapping[str, SumPart],
                 finish: Callable[[dict[str, RunningWeightedSum]], GlobalUpdate | None]) -> None:
        self._parts = dict(parts)
        self._sums = {name: RunningWeightedSum() for name in self._parts}
        self._finish = finish

    def add(self, result: ClientResult) -> None:
        for name, part in self._parts.items():
            arrays, weight = part(result)
            self._sums[name].add(arrays, weight)

    def result(self) -> GlobalUpdate | None:
        """The round's update, or ``None`` (keep the model) when no result was added."""
        if not all(s.count for s in self._sums.values()):
            return None
        return self._finish(self._sums)


class ServerStepStrategy(FedAvg, abc.ABC):
    """FedAvg's client selection and configuration; aggregation = running sums of the round's
    updates (by default the sample-weighted sum of the models, ``"model"``) followed by the
    subclass's :meth:`finish_round`, which returns the new global model and the new server
    state. :meth:`aggregate` (all results at once) and :meth:`accumulator` (streaming) run the
    same code and return one :class:`GlobalUpdate`; the driver commits it only when the new model
    and state are all finite and encodable, so an aggregate with NaN/Inf (which the server
    discards) leaves the strategy as it was.

    Also tracks ``clients_seen``: the most clients ever offered in one round (N, the fleet
    size, for the SCAFFOLD and FedDyn server rules); the round's figures (``server_update_norm``
    …) travel in the :class:`GlobalUpdate`'s ``metrics``.
    """

    #: how each client's model is weighted in the mean: ``"samples"`` (n_i) or ``"uniform"`` (1).
    weighting = "samples"
    #: N for the SCAFFOLD/FedDyn rules; 0 = automatic (:meth:`fleet_size`).
    num_clients = 0

    def __init__(self, *, participation_rate: float = 1.0, min_clients: int = 1,
                 train_config: Mapping[str, float | int | str | bool] | None = None) -> None:
        super().__init__(participation_rate=participation_rate, min_clients=min_clients, train_config=train_config)
        self.clients_seen = 0

    def configure_round(self, round: int, available: Sequence[str], rng: np.random.Generator) -> RoundPlan:
        """FedAvg's selection and config; also records N = max(N, number available)."""
        self.clients_seen = max(self.clients_seen, len(available))
        return super().configure_round(round, available, rng)

    def model_weight(self, result: ClientResult) -> float:
        """The weight of ``result``'s model in the round's mean (:attr:`weighting`)."""
        return 1.0 if self.weighting == "uniform" else float(result.num_samples)

    def sum_parts(self) -> dict[str, SumPart]:
        """The running sums the round keeps (override to add more, e.g. SCAFFOLD's Δc)."""
        return {"model": lambda r: (r.tensors, self.model_weight(r))}

    @abc.abstractmethod
    def finish_round(self, current: Sequence[np.ndarray],
                     sums: dict[str, RunningWeightedSum]) -> tuple[list[np.ndarray], dict]:
        """(new shared tensors, {attribute: new value}) from the round's sums. Pure (reads
        ``self``, never assigns): :meth:`_finish` wraps them in a :class:`GlobalUpdate`
        (the entry ``_metrics``, a dict of scalars, becomes its ``metrics``)."""

    def extras_of(self, state: Mapping[str, object]) -> dict[str, np.ndarray]:
        """The global extras the strategy broadcasts once ``state`` is committed (default ``{}``;
        SCAFFOLD: its control variate)."""
        return {}

    def _finish(self, current: Sequence[np.ndarray], sums: dict[str, RunningWeightedSum]) -> GlobalUpdate:
        new, state = self.finish_round(current, sums)
        state = dict(state)
        metrics = state.pop("_metrics", {})
        return GlobalUpdate(tensors=new, extras=self.extras_of(state), state=state, metrics=metrics)

    def accumulator(self, round: int, current: Sequence[np.ndarray]) -> SumsAccumulator:
        """Streaming form: each update is folded into the running sums on arrival."""
        return SumsAccumulator(self.sum_parts(), lambda sums: self._finish(current, sums))

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        """The same rule as :meth:`accumulator` on a whole list; ``None`` (no change) when empty."""
        return fold(self.accumulator(round, current), results)

    def set_fleet_options(self, num_clients: int, weighting: str) -> None:
        """Check and keep N (``num_clients``, 0 = automatic, see :meth:`fleet_size`) and the
        model-mean ``weighting`` (one of :data:`WEIGHTINGS`), for SCAFFOLD and FedDyn.

        Raises:
            ValueError: ``num_clients`` not an integer ≥ 0, or an unknown ``weighting``.
        """
        if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 0:
            raise ValueError(f"num_clients must be an integer >= 0, got {num_clients!r}")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        self.num_clients, self.weighting = num_clients, weighting

    def fleet_size(self, reported: int) -> int:
        """N: ``num_clients`` when > 0, else the most clients ever offered a round (at least ``reported``)."""
        fixed = self.num_clients
        return fixed if fixed > 0 else max(self.clients_seen, reported)

    def state_dict(self) -> dict:
        """``clients_seen``; subclasses add their optimizer state."""
        return {"clients_seen": int(self.clients_seen)}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.clients_seen = int(state.get("clients_seen", 0))


def step_floats(current: Sequence[np.ndarray], mean: Sequence[np.ndarray], step: Callable[..., list[np.ndarray]],
                *aligned: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Apply ``step(float_current, float_mean, *float_aligned) -> new floats`` to the
    floating-point tensors and take ``mean`` for the others (integer buffers such as
    ``num_batches_tracked``), keeping manifest order. ``aligned`` are further per-tensor lists
    (same length as ``current``) filtered the same way."""
    idx = [i for i, w in enumerate(current) if is_float(w)]
    stepped = step(*([seq[i] for i in idx] for seq in (current, mean, *aligned)))
    out = list(mean)
    for i, t in zip(idx, stepped, strict=False):
        out[i] = t
    return out


def update_norm(current: Sequence[np.ndarray], new: Sequence[np.ndarray]) -> float:
    """‖w_{t+1} − w_t‖₂ over the floating-point tensors (a per-round diagnostic)."""
    return float(np.sqrt(sum(float(np.sum((np.asarray(n, np.float64) - w) ** 2))
                             for w, n in zip(current, new, strict=False) if is_float(w))))


class ServerOptimizer(ServerStepStrategy):
    """A FedOpt-family server (Reddi et al. 2021, Alg. 1): the mean of the models gives the
    pseudo-gradient Δ = mean − w, and :meth:`optimizer_step` turns (w, Δ) into the new model.
    Floating-point tensors are stepped; integer state takes the mean."""

    @abc.abstractmethod
    def optimizer_step(self, current: list[np.ndarray], delta: list[np.ndarray]) -> tuple[list[np.ndarray], dict]:
        """(w_{t+1}, {attribute: new optimizer state}) for the floating tensors; pure."""

    def finish_round(self, current, sums):
        out: dict = {}

        def step(w, avg):
            new, state = self.optimizer_step(w, pseudo_gradient(w, avg))
            out.update(state)
            return new

        new = step_floats(current, sums["model"].mean(), step)
        out["_metrics"] = {"server_update_norm": update_norm(current, new)}
        return new, out


@register_strategy("fedopt")
class FedOpt(ServerOptimizer):
    """Server SGD with momentum (FedAvgM; RethinkFL's "FedOpt"): see the module docstring.

    Args:
        participation_rate, min_clients, train_config: as :class:`FedAvg`.
        server_lr: η > 0 (default :data:`SERVER_LR`).
        server_momentum: β in [0, 1) (default :data:`SERVER_MOMENTUM`).

    Raises:
        ValueError: a hyperparameter out of range.

    State (``state_dict``): the momentum buffer b (float64 arrays, the floating tensors' shapes;
    ``None`` before the first step).
    """

    name = "fedopt"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()

    def __init__(self, *, server_lr: float = SERVER_LR, server_momentum: float = SERVER_MOMENTUM, **kw) -> None:
        super().__init__(**kw)
        self.server_lr = check_range("server_lr", server_lr, 0.0, np.inf, low_open=True)
        self.server_momentum = check_range("server_momentum", server_momentum, 0.0, 1.0, high_open=True)
        self.buffer: list[np.ndarray] | None = None

    def optimizer_step(self, current, delta):
        new, buffer = momentum_server_step(current, delta, self.buffer, self.server_lr, self.server_momentum)
        return new, {"buffer": buffer}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "buffer": self.buffer}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.buffer = state.get("buffer")
