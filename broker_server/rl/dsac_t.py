"""DSAC-T (distributional soft actor-critic with three refinements; Duan et al., "Distributional
Soft Actor-Critic with Three Refinements", IEEE TNNLS 2025) in PyTorch, with the low-rank layers
FedDO uses so that the agent scales to thousands of devices.

What it is (SPECS §4.2, §6.19; the equations are the paper's, the constants the reference code's):

* **Actor** π_ψ(s) → (μ, log σ) per action dimension, an MLP (``hidden``, GELU); log σ clamped to
  [−20, 0.5]; the action a = tanh(u), u ~ N(μ, σ²) (a *tanh-squashed Gaussian*), so a ∈ (−1, 1);
  log π(a|s) = Σ_j [log N(u_j; μ_j, σ_j) − log(1 − tanh² u_j)] (change of variables,
  :func:`squashed_gaussian_log_prob`).
* **Two distributional critics** Z_θi(s, a) ~ N(Q_θi(s, a), σ_θi(s, a)²), an MLP on concat(s, a)
  giving (Q, σ) with σ = softplus(·).
* **Targets** of the actor and both critics, Polyak-averaged: θ̄ ← (1 − τ)θ̄ + τθ.
* **Critic target** (refinement 1, expected-value substitution, and the smaller-mean critic):
  a' ~ π_ψ̄(s'), ī = argmin_i Q_θ̄i(s', a');
  y_q = r + γ(1 − d)(Q_θ̄ī(s', a') − α log π_ψ̄(a'|s')) (the mean), and
  y_z the same with a sampled return Q_θ̄ī + σ_θ̄ī·clip(ε, −3, 3), ε ~ N(0, 1).
* **Variance-based clipping** (refinement 2): y_z^clip = Q_i + clip(y_z − Q_i, −ξσ̄_i, ξσ̄_i),
  ξ = 3, σ̄_i an exponential moving average of the batch-mean σ_i (rate τ_b = τ)
  (:func:`clipped_target`).
* **Variance-weighted critic loss** (refinement 3): with ω = clamp(σ̄_i²/(σ_i,det² + b), 0.1, 10)
  and b = 0.1, mean over the batch of
  ω·[Huber_δ(Q_i, y_q) + σ_i·(σ_i,det² − Huber_δ(Q_i,det, y_z^clip))/(σ_i,det + b)], δ = 50
  (:func:`critic_loss`; the reference code's realisation of the paper's ω·KL(C(y_z)‖Z_θi)).
* **Actor loss** E[α log π(a|s) − min_i Q_θi(s, a)] with a reparameterised sample;
  **temperature** α = exp(log α), loss −log α·E[log π + H̄], H̄ = −|A| (automatic entropy
  temperature). Actor, α and targets are updated every ``delay_update`` critic steps.
* A uniform **replay buffer** (:class:`ReplayBuffer`).

**Low rank** (FedDO, SPECS §4.3): the device-sized layers — the actor's input (state → H) and
output (H → 2K), each critic's input ((state + K) → H) — become ``in → r → out`` products of two
matrices (:class:`LowRankLinear`) when ``rank`` r > 0 and that saves parameters; the trunk is
unchanged. :meth:`DSACTAgent.parameter_counts` gives the counts.
"""

from __future__ import annotations

import copy
import hashlib
import io
import math
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from broker_server import portable_ops
from broker_server.given_paths import relative_path_note
from protocol.files import write_atomically
from protocol.lifecycle import atomic

#: log σ of the actor is clamped to this interval (DSAC-v2's ``min_log_std``/``max_log_std``).
LOG_STD_BOUNDS = (-20.0, 0.5)
#: the ``format`` a policy file of :meth:`DSACTAgent.save_policy` carries
POLICY_FORMAT = "fedfleet-dsac-t/1"


class LowRankLinear(nn.Module):
    """y = V(U x) + b: a ``in_features → out_features`` linear map of rank ≤ ``rank``.

    Parameters: ``in·r`` (U, no bias) + ``r·out`` (V) + ``out`` (bias of V).

    Args:
        in_features, out_features: sizes (≥ 1).
        rank: r ≥ 1.

    Raises:
        ValueError: a size or the rank below 1.
    """

    def __init__(self, in_features: int, out_features: int, rank: int) -> None:
        super().__init__()
        if min(in_features, out_features, rank) < 1:
            raise ValueError(f"LowRankLinear needs sizes and rank >= 1, got in={in_features}, "
                             f"out={out_features}, rank={rank}")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Linear(rank, out_features, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., in] → [..., out]."""
        return self.up(self.down(x))


def maybe_low_rank(in_features: int, out_features: int, rank: int) -> nn.Module:
    """:class:`LowRankLinear` of ``rank`` when ``rank`` > 0 and it has fewer parameters than the
    dense layer (r·(in + out) < in·out), else ``nn.Linear(in, out)``."""
    if rank > 0 and rank * (in_features + out_features) < in_features * out_features:
        return LowRankLinear(in_features, out_features, rank)
    return nn.Linear(in_features, out_features)


def _mlp(in_dim: int, hidden: Sequence[int], out_dim: int, rank_in: int, rank_out: int,
         layer_norm: bool = False) -> nn.Sequential:
    """in → hidden[0] (low rank ``rank_in``) → GELU → … → hidden[-1] → out (low rank ``rank_out``);
    with ``layer_norm`` a LayerNorm between each hidden layer's linear map and its GELU."""
    if not hidden:
        raise ValueError("hidden must name at least one layer width")

    def block(layer: nn.Module, width: int) -> list[nn.Module]:
        return [layer, *([nn.LayerNorm(width)] if layer_norm else []), nn.GELU()]

    layers: list[nn.Module] = block(maybe_low_rank(in_dim, hidden[0], rank_in), hidden[0])
    for a, b in zip(hidden[:-1], hidden[1:], strict=True):
        layers += block(nn.Linear(a, b), b)
    layers.append(maybe_low_rank(hidden[-1], out_dim, rank_out))
    return nn.Sequential(*layers)


class Actor(nn.Module):
    """π_ψ: state [B, S] → (μ [B, A], log σ [B, A]), log σ clamped to :data:`LOG_STD_BOUNDS`."""

    def __init__(self, state_dim: int, action_dim: int, hidden: Sequence[int], rank: int) -> None:
        super().__init__()
        self.action_dim = action_dim
        self.net = _mlp(state_dim, hidden, 2 * action_dim, rank, rank)

    def forward(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(s)
        mean, log_std = out[..., :self.action_dim], out[..., self.action_dim:]
        return mean, log_std.clamp(*LOG_STD_BOUNDS)


class Critic(nn.Module):
    """Z_θ: (state [B, S], action [B, A]) → (Q [B], σ [B]), σ = softplus(·); ``layer_norm``: a
    LayerNorm in each hidden layer (see :class:`DSACTConfig`)."""

    def __init__(self, state_dim: int, action_dim: int, hidden: Sequence[int], rank: int,
                 layer_norm: bool = False) -> None:
        super().__init__()
        self.net = _mlp(state_dim + action_dim, hidden, 2, rank, 0, layer_norm)

    def forward(self, s: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(torch.cat([s, a], dim=-1))
        return out[..., 0], F.softplus(out[..., 1])


def squashed_gaussian_log_prob(mean: torch.Tensor, log_std: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """log π(a) of a = tanh(u), u ~ N(mean, exp(log_std)²), summed over the last dimension.

    log π(a) = Σ_j [log N(u_j; μ_j, σ_j) − log(1 − tanh² u_j)], with the stable identity
    log(1 − tanh² u) = 2(log 2 − u − softplus(−2u)).

    Args:
        mean, log_std, u: float tensors of one shape [..., A].

    Returns:
        [...]: the log density of tanh(u) (nats), the Jacobian of tanh included.
    """
    std = log_std.exp()
    normal = -0.5 * ((u - mean) / std) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
    log_det = 2.0 * (math.log(2.0) - u - F.softplus(-2.0 * u))
    return (normal - log_det).sum(-1)


def clipped_target(y_z: torch.Tensor, q: torch.Tensor, mean_std: torch.Tensor | float, xi: float = 3.0) -> torch.Tensor:
    """y_z^clip = q + clip(y_z − q, −ξσ̄, ξσ̄): the sampled target kept within ξ moving-average
    standard deviations of the critic's own mean (DSAC-T refinement 2). All tensors broadcast;
    ``mean_std`` σ̄ ≥ 0."""
    b = xi * torch.as_tensor(mean_std, dtype=q.dtype)
    return q + torch.maximum(torch.minimum(y_z - q, b), -b)


def critic_loss(q: torch.Tensor, std: torch.Tensor, y_q: torch.Tensor, y_z_clip: torch.Tensor,
                mean_std: torch.Tensor | float, *, bias: float = 0.1, huber_delta: float = 50.0,
                weight_bounds: tuple[float, float] = (0.1, 10.0)) -> torch.Tensor:
    """The variance-weighted distributional critic loss of one critic (DSAC-T refinement 3).

    mean_b ω_b·[Huber_δ(q_b, y_q,b) + std_b·(std_det,b² − Huber_δ(q_det,b, y_z^clip,b))/(std_det,b + bias)]
    with ω_b = clamp(σ̄²/(std_det,b² + bias), *weight_bounds) (detached), Huber_δ(x, y) =
    ½(x − y)² for |x − y| ≤ δ, else δ(|x − y| − ½δ). Its gradient in q is ω·(q − y_q) (for
    small errors) and in std ω·(std² − ½(q − y_z^clip)²)/(std + bias).

    Args:
        q, std: the critic's mean and standard deviation, [B] (with gradients).
        y_q, y_z_clip: the mean target and the clipped sampled target, [B] (no gradients).
        mean_std: σ̄, the moving average of the critic's batch-mean std (a float or 0-d tensor).

    Returns:
        A scalar tensor.
    """
    std_det = std.detach()
    omega = (torch.as_tensor(mean_std, dtype=q.dtype) ** 2 / (std_det ** 2 + bias)).clamp(*weight_bounds)
    h_q = F.huber_loss(q, y_q, delta=huber_delta, reduction="none")
    h_z = F.huber_loss(q.detach(), y_z_clip, delta=huber_delta, reduction="none")
    return torch.mean(omega * (h_q + std * (std_det ** 2 - h_z) / (std_det + bias)))


class ReplayBuffer:
    """A ring buffer of transitions (s, a, r, s', done), float32, sampled uniformly.

    Args:
        capacity: the most transitions kept (the oldest is overwritten), ≥ 1.
        state_dim, action_dim: sizes, ≥ 1.

    Raises:
        ValueError: a size below 1.
    """

    def __init__(self, capacity: int, state_dim: int, action_dim: int) -> None:
        if min(capacity, state_dim, action_dim) < 1:
            raise ValueError(f"ReplayBuffer needs capacity, state_dim, action_dim >= 1, got "
                             f"{capacity}, {state_dim}, {action_dim}")
        self.capacity, self.state_dim, self.action_dim = capacity, state_dim, action_dim
        self.s = np.zeros((capacity, state_dim), np.float32)
        self.a = np.zeros((capacity, action_dim), np.float32)
        self.r = np.zeros(capacity, np.float32)
        self.s2 = np.zeros((capacity, state_dim), np.float32)
        self.done = np.zeros(capacity, np.float32)
        self.ptr = 0
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def add(self, s: np.ndarray, a: np.ndarray, r: float, s2: np.ndarray, done: bool) -> None:
        """Store one transition (``s``, ``s2`` [state_dim], ``a`` [action_dim]).

        Raises:
            ValueError: a wrong shape or a non-finite value (named).
        """
        for name, v, n in (("s", s, self.state_dim), ("a", a, self.action_dim), ("s2", s2, self.state_dim)):
            v = np.asarray(v)
            if v.shape != (n,):
                raise ValueError(f"replay transition {name} has shape {v.shape}, expected ({n},)")
            if not np.isfinite(v).all():
                raise ValueError(f"replay transition {name} is not finite")
        if not math.isfinite(float(r)):
            raise ValueError(f"replay transition reward {r!r} is not finite")
        i = self.ptr
        self.s[i], self.a[i], self.r[i], self.s2[i], self.done[i] = s, a, float(r), s2, float(done)
        self.ptr = (self.ptr + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self, batch: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        """``batch`` transitions drawn uniformly with replacement, as float32 tensors.

        Raises:
            ValueError: the buffer is empty.
        """
        if self.size == 0:
            raise ValueError("cannot sample an empty replay buffer")
        idx = rng.integers(0, self.size, batch)
        return {k: torch.from_numpy(getattr(self, k)[idx]) for k in ("s", "a", "r", "s2", "done")}

    def state_dict(self) -> dict[str, Any]:
        """The stored transitions, oldest first (arrays of ``size`` rows), for a checkpoint."""
        full = self.size == self.capacity
        order = (np.arange(self.capacity) + self.ptr) % self.capacity if full else np.arange(self.size)
        return {"capacity": self.capacity, **{k: getattr(self, k)[order].copy() for k in ("s", "a", "r", "s2", "done")}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the capacity may differ: the newest rows are kept).

        Raises:
            ValueError: arrays of other widths than this buffer's.
        """
        s = np.asarray(state["s"], np.float32)
        n = int(s.shape[0])
        if s.ndim != 2 or (n and s.shape[1] != self.state_dim):
            raise ValueError(f"replay state has shape {s.shape}, this buffer stores states of width {self.state_dim}")
        keep = slice(max(0, n - self.capacity), n)
        m = n - keep.start
        self.s[:m] = s[keep]
        self.a[:m] = np.asarray(state["a"], np.float32).reshape(n, self.action_dim)[keep]
        self.r[:m] = np.asarray(state["r"], np.float32)[keep]
        self.s2[:m] = np.asarray(state["s2"], np.float32).reshape(n, self.state_dim)[keep]
        self.done[:m] = np.asarray(state["done"], np.float32)[keep]
        self.size, self.ptr = m, m % self.capacity


@dataclass(frozen=True)
class DSACTConfig:
    """DSAC-T hyperparameters (defaults: the reference code's, SPECS §6.19, but for the replay
    sizes, which FedDO does not give: a few hundred transitions of warm-up and a 64 batch suit
    a run of a few hundred rounds — SPECS §4.2 [guess]).

    Attributes:
        hidden: MLP widths of the actor and the critics.
        rank: low-rank r of the device-sized layers (0 = dense).
        lr_actor, lr_critic, lr_alpha: Adam learning rates.
        gamma: discount γ.
        tau: Polyak rate τ of the targets (also τ_b of σ̄).
        delay_update: actor, α and targets every this many critic steps.
        batch_size: transitions per update.
        warmup: no update before the buffer holds this many transitions.
        capacity: replay buffer size.
        log_alpha_init: initial log α (1 → α ≈ 2.72).
        target_entropy: H̄; ``None`` = −action_dim.
        xi: target clipping ξ (in units of σ̄).
        huber_delta: Huber δ of the critic loss.
        bias: b in the critic loss and its weight.
        critic_layer_norm: a LayerNorm in each hidden layer of the critics (Ball et al., "Efficient
            Online Reinforcement Learning with Offline Data", ICML 2023, §4: it bounds the critic's
            extrapolation to actions outside the replay data). Not in DSAC-T; ``False`` keeps the
            reference networks, and a policy saved before the key existed loads as ``False``.
    """

    hidden: tuple[int, ...] = (256, 256, 256)
    rank: int = 0
    lr_actor: float = 1e-4
    lr_critic: float = 1e-4
    lr_alpha: float = 3e-4
    gamma: float = 0.99
    tau: float = 0.005
    delay_update: int = 2
    batch_size: int = 64
    warmup: int = 256
    capacity: int = 100_000
    log_alpha_init: float = 1.0
    target_entropy: float | None = None
    xi: float = 3.0
    huber_delta: float = 50.0
    bias: float = 0.1
    critic_layer_norm: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not self.hidden or any(int(h) < 1 for h in self.hidden):
            problems.append(f"hidden = {self.hidden!r} must be widths >= 1")
        if self.rank < 0:
            problems.append(f"rank = {self.rank} must be >= 0")
        for k in ("lr_actor", "lr_critic", "lr_alpha"):
            if not getattr(self, k) > 0:
                problems.append(f"{k} = {getattr(self, k)} must be > 0")
        if not 0 <= self.gamma < 1:
            problems.append(f"gamma = {self.gamma} must be in [0, 1)")
        if not 0 < self.tau <= 1:
            problems.append(f"tau = {self.tau} must be in (0, 1]")
        for k in ("delay_update", "batch_size", "capacity"):
            if getattr(self, k) < 1:
                problems.append(f"{k} = {getattr(self, k)} must be >= 1")
        if self.warmup < 0:
            problems.append(f"warmup = {self.warmup} must be >= 0")
        if problems:
            raise ValueError("DSAC-T config: " + "; ".join(problems))


def _count(module: nn.Module) -> int:
    return sum(int(p.numel()) for p in module.parameters())


def non_finite(obj: Any, where: str = "") -> list[str]:
    """The places in ``obj`` (nested dicts, lists and tuples of tensors and numbers, as
    :meth:`DSACTAgent.networks_state` gives) holding NaN or infinite values: floating-point
    tensors with any such element, and floats that are not finite; as ``a.b.0`` paths."""
    if isinstance(obj, torch.Tensor):
        return [where or "."] if obj.is_floating_point() and not bool(torch.isfinite(obj).all()) else []
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [where or "."]
    items = obj.items() if isinstance(obj, Mapping) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return [p for k, v in items for p in non_finite(v, f"{where}.{k}" if where else str(k))]


def _few(places: list[str], n: int = 3) -> str:
    return ", ".join(places[:n]) + (f" and {len(places) - n} more" if len(places) > n else "")


def _load_reason(exc: BaseException) -> str:
    """What ``torch.load(..., weights_only=True)`` found wrong, in one line: its restricted
    unpickler's own reason (``Unsupported global: GLOBAL …``, ``Unsupported operand 103``), not the
    advice around it (which suggests loading with ``weights_only=False``, i.e. running the file's
    code); another exception's first line as it is."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        rest = text.split("WeightsUnpickler error:", 1)[1]
        lines = [x.strip() for x in rest.splitlines()
                 if x.strip() and not x.strip().startswith("Check the documentation")]
        return "a restricted load refused it: " + (lines[0] if lines else "an object that is no tensor or container")
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


class LoadedPolicy(NamedTuple):
    """What :meth:`DSACTAgent.load_policy` returns."""

    #: the agent, its random streams seeded by the caller
    agent: DSACTAgent
    #: what :meth:`DSACTAgent.save_policy` was given (``fedfleet feddo pretrain``: device count,
    #: episodes, rounds, data settings, CPU seconds …)
    metadata: dict[str, Any]
    #: hex SHA-256 of the file's bytes as read
    file_sha256: str


class DSACTAgent:
    """A DSAC-T agent for a continuous action space (−1, 1)^A.

    Args:
        state_dim: S, the observation width.
        action_dim: A.
        config: hyperparameters.
        seed: seeds the networks' initialisation, the action noise and the replay sampling.

    Raises:
        ValueError: a size below 1, or an unusable config.
    """

    def __init__(self, state_dim: int, action_dim: int, config: DSACTConfig | None = None, seed: int = 0) -> None:
        if state_dim < 1 or action_dim < 1:
            raise ValueError(f"DSAC-T needs state_dim and action_dim >= 1, got {state_dim}, {action_dim}")
        self.state_dim, self.action_dim = state_dim, action_dim
        self.config = c = config or DSACTConfig()
        self.seed = seed
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.actor = Actor(state_dim, action_dim, c.hidden, c.rank)
            self.critics = nn.ModuleList([Critic(state_dim, action_dim, c.hidden, c.rank, c.critic_layer_norm)
                                          for _ in range(2)])
        self.actor_target = copy.deepcopy(self.actor)
        self.critic_targets = copy.deepcopy(self.critics)
        for p in [*self.actor_target.parameters(), *self.critic_targets.parameters()]:
            p.requires_grad_(False)
        self.log_alpha = nn.Parameter(torch.tensor(float(c.log_alpha_init)))
        self.target_entropy = float(c.target_entropy) if c.target_entropy is not None else -float(action_dim)
        self.actor_opt = portable_ops.Adam(self.actor.parameters(), lr=c.lr_actor)
        self.critic_opts = [portable_ops.Adam(q.parameters(), lr=c.lr_critic) for q in self.critics]
        self.alpha_opt = portable_ops.Adam([self.log_alpha], lr=c.lr_alpha)
        self.mean_stds = [-1.0, -1.0]  # σ̄_i; −1 = not yet measured (the first batch sets it)
        self.updates = 0
        self.generator = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.buffer = ReplayBuffer(c.capacity, state_dim, action_dim)

    # ------------------------------------------------------------------ acting

    @property
    def alpha(self) -> float:
        """The entropy temperature α = exp(log α)."""
        return float(self.log_alpha.detach().exp())

    def _sample(self, actor: nn.Module, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_std = actor(s)
        eps = torch.randn(mean.shape, generator=self.generator)
        u = mean + log_std.exp() * eps
        return torch.tanh(u), squashed_gaussian_log_prob(mean, log_std, u)

    def act(self, state: np.ndarray, deterministic: bool = False) -> np.ndarray:
        """The action for ``state`` [S]: a float32 [A] in (−1, 1) — a sample of π, or tanh(μ)
        when ``deterministic``.

        Raises:
            ValueError: a state of the wrong shape or not finite.
        """
        s = np.asarray(state, np.float32)
        if s.shape != (self.state_dim,) or not np.isfinite(s).all():
            raise ValueError(f"state must be {self.state_dim} finite numbers, got shape {s.shape}")
        with torch.no_grad():
            st = torch.from_numpy(s)[None]
            if deterministic:
                a = torch.tanh(self.actor(st)[0])
            else:
                a, _ = self._sample(self.actor, st)
        return a[0].numpy().astype(np.float32)

    def observe(self, s: np.ndarray, a: np.ndarray, r: float, s2: np.ndarray, done: bool) -> None:
        """Store a transition in the replay buffer."""
        self.buffer.add(s, a, r, s2, done)

    # ------------------------------------------------------------------ learning

    @atomic
    def update(self, steps: int = 1) -> dict[str, float]:
        """``steps`` gradient steps (none while the buffer holds fewer than ``warmup``
        transitions), each on ``batch_size`` transitions drawn with replacement (a buffer holding
        fewer gives a batch that repeats them). A stop signal (Ctrl-C, SIGTERM) that arrives meanwhile takes effect when
        the steps are done (:func:`protocol.lifecycle.atomic`), so the networks a stopped process
        saves are never half-way through an optimiser step. Returns the last step's losses, σ̄
        of each critic, ``q_mean`` (the two critics' mean Q on that step's batch, before their
        step: a critic that diverges shows here) and, on a step that updates the actor, α and
        the entropy estimate −mean log π (``{}`` when no step was taken)."""
        out: dict[str, float] = {}
        if len(self.buffer) < max(1, self.config.warmup):
            return out
        for _ in range(steps):
            out = self._step(self.buffer.sample(self.config.batch_size, self.rng))
        return out

    def _step(self, b: dict[str, torch.Tensor]) -> dict[str, float]:
        c = self.config
        s, a, r, s2, done = b["s"], b["a"], b["r"], b["s2"], b["done"]
        alpha = self.log_alpha.detach().exp()
        with torch.no_grad():
            a2, logp2 = self._sample(self.actor_target, s2)
            nxt = [q(s2, a2) for q in self.critic_targets]
            q_next = torch.minimum(nxt[0][0], nxt[1][0])
            use0 = nxt[0][0] < nxt[1][0]
            eps = torch.randn(q_next.shape, generator=self.generator).clamp(-3.0, 3.0)
            samples = [m + sd * eps for m, sd in nxt]
            q_next_sample = torch.where(use0, samples[0], samples[1])
            y_q = r + c.gamma * (1 - done) * (q_next - alpha * logp2)
            y_z = r + c.gamma * (1 - done) * (q_next_sample - alpha * logp2)
        losses, q_means = [], []
        for i, (q_net, opt) in enumerate(zip(self.critics, self.critic_opts, strict=True)):
            q, std = q_net(s, a)
            q_means.append(float(q.detach().mean()))
            batch_std = float(std.detach().mean())
            prev = self.mean_stds[i]
            self.mean_stds[i] = batch_std if prev < 0 else (1 - c.tau) * prev + c.tau * batch_std
            y_clip = clipped_target(y_z, q.detach(), self.mean_stds[i], c.xi)
            loss = critic_loss(q, std, y_q, y_clip, self.mean_stds[i], bias=c.bias, huber_delta=c.huber_delta)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        self.updates += 1
        out = {"critic_loss": sum(losses), "mean_std_1": self.mean_stds[0], "mean_std_2": self.mean_stds[1],
               "q_mean": sum(q_means) / len(q_means)}
        if self.updates % c.delay_update == 0:
            new_a, logp = self._sample(self.actor, s)
            q_pi = torch.minimum(self.critics[0](s, new_a)[0], self.critics[1](s, new_a)[0])
            actor_loss = (alpha * logp - q_pi).mean()
            self.actor_opt.zero_grad(set_to_none=True)
            actor_loss.backward()
            self.actor_opt.step()
            for q_net in self.critics:  # the actor loss must not leave gradients in the critics
                q_net.zero_grad(set_to_none=True)
            alpha_loss = -self.log_alpha * (logp.detach() + self.target_entropy).mean()
            self.alpha_opt.zero_grad(set_to_none=True)
            alpha_loss.backward()
            self.alpha_opt.step()
            with torch.no_grad():
                for net, tgt in ((self.actor, self.actor_target), (self.critics, self.critic_targets)):
                    for p, pt in zip(net.parameters(), tgt.parameters(), strict=True):
                        pt.mul_(1 - c.tau).add_(c.tau * p)
            out.update(actor_loss=float(actor_loss.detach()), alpha=self.alpha, entropy=float(-logp.detach().mean()))
        return out

    # ------------------------------------------------------------------ sizes

    def parameter_counts(self) -> dict[str, int]:
        """Trainable parameters: ``actor``, ``critic`` (one), ``agent`` (actor + two critics, what
        is trained), ``with_targets`` (plus the target copies of all three, what is stored)."""
        actor, critic = _count(self.actor), _count(self.critics[0])
        agent = actor + 2 * critic
        return {"actor": actor, "critic": critic, "agent": agent, "with_targets": 2 * agent}

    # ------------------------------------------------------------------ persistence

    def networks_state(self) -> dict[str, Any]:
        """Everything but the replay buffer (networks, targets, optimisers, log α, σ̄, the update
        counter, the random generators), as torch objects."""
        return {"actor": self.actor.state_dict(), "critics": self.critics.state_dict(),
                "actor_target": self.actor_target.state_dict(), "critic_targets": self.critic_targets.state_dict(),
                "log_alpha": self.log_alpha.detach().clone(), "actor_opt": self.actor_opt.state_dict(),
                "critic_opts": [o.state_dict() for o in self.critic_opts], "alpha_opt": self.alpha_opt.state_dict(),
                "mean_stds": list(self.mean_stds), "updates": self.updates,
                "generator": self.generator.get_state(), "rng": self.rng.bit_generator.state}

    def load_networks_state(self, st: Mapping[str, Any]) -> None:
        """Restore :meth:`networks_state`.

        Raises:
            RuntimeError: weights of other shapes (another device count, hidden width or rank).
        """
        self.actor.load_state_dict(st["actor"])
        self.critics.load_state_dict(st["critics"])
        self.actor_target.load_state_dict(st["actor_target"])
        self.critic_targets.load_state_dict(st["critic_targets"])
        with torch.no_grad():
            self.log_alpha.copy_(st["log_alpha"])
        self.actor_opt.load_state_dict(st["actor_opt"])
        for o, s in zip(self.critic_opts, st["critic_opts"], strict=True):
            o.load_state_dict(s)
        self.alpha_opt.load_state_dict(st["alpha_opt"])
        self.mean_stds = [float(v) for v in st["mean_stds"]]
        self.updates = int(st["updates"])
        self.generator.set_state(st["generator"])
        self.rng.bit_generator.state = st["rng"]

    def to_bytes(self) -> bytes:
        """:meth:`networks_state` serialised with ``torch.save`` (for the server's checkpoint)."""
        buf = io.BytesIO()
        torch.save(self.networks_state(), buf)
        return buf.getvalue()

    def load_bytes(self, data: bytes) -> None:
        """Restore :meth:`to_bytes`."""
        self.load_networks_state(torch.load(io.BytesIO(data), weights_only=True))

    def save_policy(self, path: str | Path, metadata: Mapping[str, Any]) -> None:
        """Write the trained agent to ``path`` (``torch.save``): ``metadata`` (device count,
        state layout …), the sizes, the config and :meth:`networks_state`. The replay buffer is
        not written (the deployed run fills its own). The file is written beside ``path``, flushed
        to the device and renamed onto it, so ``path`` holds the file that was there before or
        the new one whole: a failed write (a full disk) leaves the former, and so does a power cut
        before the rename (a pre-training that goes on from the policy at ``path`` replaces it so).

        Raises:
            ValueError: the agent holds NaN or infinite values (a diverged training; named, and
                nothing written).
            OSError: the file could not be written (the message names it and why, and says the
                file there before, if any, is untouched).
        """
        state = self.networks_state()
        bad = non_finite(state)
        if bad:
            raise ValueError(f"the DSAC-T agent holds NaN or infinite values in {_few(bad)} (a diverged training): "
                             f"not written to {path}")
        path = Path(path)
        buf = io.BytesIO()
        torch.save({"format": POLICY_FORMAT, "state_dim": self.state_dim, "action_dim": self.action_dim,
                    "config": asdict(self.config), "metadata": dict(metadata), "agent": state}, buf)
        try:
            write_atomically(path, buf.getvalue(), fsync=True)
        except OSError as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise OSError(f"policy {path}: could not be written ({type(exc).__name__}: {reason}); "
                          + ("the file there before is untouched" if path.exists() else "nothing was written")) from exc

    @classmethod
    def load_policy(cls, path: str | Path, seed: int = 0) -> LoadedPolicy:
        """An agent from :meth:`save_policy`'s file, its metadata and the SHA-256 of the bytes it
        was loaded from (the file is read once, so the digest is that of the policy loaded even
        when the file is replaced meanwhile): the networks, optimisers
        and temperature from the file, the random streams (action noise, replay batches) from
        ``seed`` — the run's own, so runs of other seeds on one policy do not share the noise the
        pre-training ended with (a checkpoint's :meth:`load_bytes` restores the streams instead,
        so a resumed run continues its own).

        Raises:
            ValueError: not such a file — absent, unreadable, not a torch file (whatever
                ``torch.load`` raises: a pickle error, a zip error, a class it cannot find, any
                object but tensors, containers and numbers, which ``weights_only`` refuses …), not
                a policy, a policy whose parts are missing or do not fit together, or one holding NaN
                or infinite values; the message names the file and what was wrong.
        """
        try:
            # tensors, dicts, lists and numbers only: a policy file from elsewhere cannot run code
            # here (torch's restricted unpickler refuses any other object)
            data = Path(path).read_bytes()
            blob = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a damaged file fails in many ways: each is the same refusal
            # torch.save writes a zip archive: one without its end record was cut short (a copy
            # stopped early, a full disk), which torch's own reason (often "[Errno 22] Invalid
            # argument") does not say
            cut = Path(path).is_file() and not zipfile.is_zipfile(Path(path))
            # a relative path (or one a run made absolute: given_paths.GivenPath) is read from the
            # current folder, not the configuration file's: said with the folder
            where = relative_path_note(path)
            shown = os.path.abspath(path) if where else path
            raise ValueError(f"policy {shown}{where}: cannot be read ({type(exc).__name__}: {_load_reason(exc)})"
                             + ("; it is not a whole torch archive (cut short, or not written by torch.save)"
                                if cut else "")
                             + "; [algorithm] policy must name a file that fedfleet feddo pretrain wrote") from exc
        if not isinstance(blob, dict) or blob.get("format") != POLICY_FORMAT:
            raise ValueError(f"policy {path}: not a fedfleet DSAC-T policy (format {POLICY_FORMAT})")
        bad = non_finite(blob.get("agent"))
        if bad:
            raise ValueError(f"policy {path}: NaN or infinite values in {_few(bad)} (a damaged file, or a training "
                             "that diverged); write it again with fedfleet feddo pretrain")
        try:
            conf = dict(blob["config"])
            conf["hidden"] = tuple(conf["hidden"])
            agent = cls(int(blob["state_dim"]), int(blob["action_dim"]), DSACTConfig(**conf), seed=seed)
            agent.load_networks_state(blob["agent"])
            agent.generator.manual_seed(seed)
            agent.rng = np.random.default_rng(seed)
            metadata = dict(blob["metadata"])
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
            raise ValueError(f"policy {path}: a damaged fedfleet DSAC-T policy ({type(exc).__name__}: {exc}); write "
                             "it again with fedfleet feddo pretrain") from exc
        return LoadedPolicy(agent, metadata, hashlib.sha256(data).hexdigest())

