"""DDPG (Lillicrap et al., "Continuous control with deep reinforcement learning", ICLR 2016,
Algorithm 1) with an actor whose action is a weight vector on the probability simplex, as FedAA
uses it to weight the aggregated clients (He, Chen, Zhang, AAAI 2025; SPECS §4.3).

Networks (SPECS §4.3, FedAA's code: two hidden layers of 256, ReLU):

- actor μ(s) = |W₃·h(s)| / ‖W₃·h(s)‖₁ with h(s) = ReLU(W₂·ReLU(W₁·s)) [state_dim → action_dim]:
  non-negative weights that sum to 1 (an ε = 1e-12 keeps the division defined);
- critic Q(s, a) = W₃'·ReLU(W₂'·[ReLU(W₁'·s), a]) (the action joins after the first layer).

Hidden layers start from U(±1/√fan_in) (the DDPG paper's §7 initialisation; with PyTorch's
layout ``weight`` [out, in] the fan-in is ``in``) and the output layers from U(±3e-3).

One update on a batch of transitions (s, a, r, s', done) from the replay buffer
(:class:`broker_server.rl.dsac_t.ReplayBuffer`, shared with FedDO's agent):

- target y = r + γ·(1 − done)·Q'(s', μ'(s'))  (Algorithm 1, line 12; :func:`ddpg_target`);
- critic loss (1/N)·Σ (y − Q(s, a))²;
- actor loss −(1/N)·Σ Q(s, μ(s))  (the deterministic policy gradient, line 14);
- soft target update θ' ← τ·θ + (1 − τ)·θ' (line 16; :func:`soft_update`).

Exploration: Gaussian noise of standard deviation ``noise_std`` added to the actor's last hidden
activations before the output layer when acting (FedAA's code adds N(0, 0.1²) there; it also does
so inside the learning step, which here uses the noise-free μ — the DDPG paper's target policy).
"""

from __future__ import annotations

import copy
import io
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from broker_server import portable_ops

from .dsac_t import ReplayBuffer, _load_reason

#: keeps the L1 normalisation of the actor's output defined when every entry is 0.
SIMPLEX_EPS = 1e-12


def _fanin_init(layer: nn.Linear) -> None:
    bound = 1.0 / float(np.sqrt(layer.weight.shape[1]))
    nn.init.uniform_(layer.weight, -bound, bound)


class SimplexActor(nn.Module):
    """μ(s): state float32 [B, state_dim] → weights float32 [B, action_dim], each row ≥ 0 and
    summing to 1 (module docstring)."""

    def __init__(self, state_dim: int, action_dim: int, hidden: int = 256, init_w: float = 3e-3) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(state_dim, hidden), nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, action_dim)
        _fanin_init(self.fc1)
        _fanin_init(self.fc2)
        nn.init.uniform_(self.fc3.weight, -init_w, init_w)

    def forward(self, s: torch.Tensor, noise_std: float = 0.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
        """Weights for states ``s`` [B, state_dim]; ``noise_std`` > 0 adds N(0, noise_std²) to
        the last hidden activations (exploration, drawn from ``generator``)."""
        h = torch.relu(self.fc2(torch.relu(self.fc1(s))))
        if noise_std > 0:
            h = h + noise_std * torch.randn(h.shape, generator=generator, dtype=h.dtype)
        a = self.fc3(h).abs()
        return a / (a.sum(dim=1, keepdim=True) + SIMPLEX_EPS)


class Critic(nn.Module):
    """Q(s, a): states [B, state_dim] and actions [B, action_dim] → values [B, 1]."""

    def __init__(self, state_dim: int, action_dim: int, hidden: int = 256, init_w: float = 3e-3) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(state_dim, hidden), nn.Linear(hidden + action_dim, hidden)
        self.fc3 = nn.Linear(hidden, 1)
        _fanin_init(self.fc1)
        _fanin_init(self.fc2)
        nn.init.uniform_(self.fc3.weight, -init_w, init_w)

    def forward(self, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.cat([torch.relu(self.fc1(s)), a], dim=1))))


def ddpg_target(reward: torch.Tensor, done: torch.Tensor, q_next: torch.Tensor, gamma: float) -> torch.Tensor:
    """y = r + γ·(1 − done)·Q'(s', μ'(s')) (DDPG Algorithm 1, line 12); every argument [B, 1]
    float32, ``done`` 0 or 1."""
    return reward + gamma * (1.0 - done) * q_next


@torch.no_grad()
def soft_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """θ' ← τ·θ + (1 − τ)·θ' for every parameter (DDPG Algorithm 1, line 16), in place."""
    for t, s in zip(target.parameters(), source.parameters(), strict=True):
        t.mul_(1.0 - tau).add_(s, alpha=tau)


@dataclass(frozen=True)
class DDPGConfig:
    """DDPG settings (defaults: FedAA's, SPECS §4.3; ``batch_size`` 16 and ``warmup`` = one batch
    are its code's, the buffer size is not given).

    Attributes:
        hidden: width of both hidden layers of actor and critic.
        lr_actor, lr_critic: Adam learning rates (1e-2).
        weight_decay: Adam weight decay of both (1e-5).
        gamma: discount γ (0.99). tau: soft-update rate τ (0.001).
        batch_size: transitions per update. warmup: transitions stored before the first update.
        capacity: replay buffer size (transitions).
        noise_std: exploration noise on the actor's last hidden layer (0.1).
    """

    hidden: int = 256
    lr_actor: float = 1e-2
    lr_critic: float = 1e-2
    weight_decay: float = 1e-5
    gamma: float = 0.99
    tau: float = 0.001
    batch_size: int = 16
    warmup: int = 16
    capacity: int = 10_000
    noise_std: float = 0.1

    def __post_init__(self) -> None:
        problems = []
        if self.hidden < 1 or self.batch_size < 1 or self.warmup < 1 or self.capacity < 1:
            problems.append(f"hidden ({self.hidden}), batch_size ({self.batch_size}), warmup ({self.warmup}) and "
                            f"capacity ({self.capacity}) must be >= 1")
        if not (0 < self.lr_actor and 0 < self.lr_critic and 0 <= self.weight_decay):
            problems.append(f"lr_actor ({self.lr_actor}), lr_critic ({self.lr_critic}) must be > 0, weight_decay "
                            f"({self.weight_decay}) >= 0")
        if not (0 <= self.gamma <= 1 and 0 < self.tau <= 1 and self.noise_std >= 0):
            problems.append(f"gamma ({self.gamma}) must be in [0, 1], tau ({self.tau}) in (0, 1], noise_std "
                            f"({self.noise_std}) >= 0")
        if problems:
            raise ValueError("; ".join(problems))


class DDPGAgent:
    """A DDPG agent with a simplex-valued action (module docstring).

    Args:
        state_dim: width of a state (float32 vector).
        action_dim: width of an action (weights summing to 1).
        config: :class:`DDPGConfig`.
        seed: seeds the networks' initialisation, the exploration noise and the replay sampling.

    Raises:
        ValueError: a dimension < 1.
    """

    def __init__(self, state_dim: int, action_dim: int, config: DDPGConfig | None = None, seed: int = 0) -> None:
        if state_dim < 1 or action_dim < 1:
            raise ValueError(f"state_dim ({state_dim}) and action_dim ({action_dim}) must be >= 1")
        self.config = config or DDPGConfig()
        self.state_dim, self.action_dim = int(state_dim), int(action_dim)
        c = self.config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.actor = SimplexActor(state_dim, action_dim, c.hidden)
            self.critic = Critic(state_dim, action_dim, c.hidden)
        self.actor_target, self.critic_target = copy.deepcopy(self.actor), copy.deepcopy(self.critic)
        self.actor_opt = portable_ops.Adam(self.actor.parameters(), lr=c.lr_actor, weight_decay=c.weight_decay)
        self.critic_opt = portable_ops.Adam(self.critic.parameters(), lr=c.lr_critic, weight_decay=c.weight_decay)
        self.buffer = ReplayBuffer(c.capacity, state_dim, action_dim)
        self.noise = torch.Generator().manual_seed(seed + 1)
        self.rng = np.random.default_rng(seed + 2)
        self.updates = 0

    def act(self, state: np.ndarray, explore: bool = True, noise: torch.Generator | None = None) -> np.ndarray:
        """The weights for ``state`` float32 [state_dim] → float64 [action_dim] (≥ 0, summing to
        1 in float64; uniform if every output is 0); with ``explore`` the actor's exploration
        noise is added, drawn from ``noise`` (default: the agent's own generator)."""
        s = torch.as_tensor(np.asarray(state, np.float32)).reshape(1, -1)
        with torch.no_grad():
            a = self.actor(s, self.config.noise_std if explore else 0.0, self.noise if noise is None else noise)
        w = a[0].double().numpy()
        return w / w.sum() if w.sum() > 0 else np.full(self.action_dim, 1.0 / self.action_dim)

    def observe(self, s: np.ndarray, a: np.ndarray, r: float, s2: np.ndarray, done: bool) -> None:
        """Store one transition."""
        self.buffer.add(s, a, r, s2, done)

    def update(self, steps: int = 1) -> dict[str, float]:
        """Up to ``steps`` learning steps once the buffer holds ``warmup`` transitions; the last
        step's ``critic_loss`` and ``actor_loss`` (``{}`` when none ran)."""
        out: dict[str, float] = {}
        if len(self.buffer) < self.config.warmup:
            return out
        for _ in range(steps):
            out = self.step(self.buffer.sample(self.config.batch_size, self.rng))
        return out

    def step(self, b: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """One DDPG step on batch ``b`` (``s`` [B, S], ``a`` [B, A], ``r`` [B], ``s2`` [B, S],
        ``done`` [B], float32: :meth:`ReplayBuffer.sample`'s layout)."""
        c = self.config
        r, done = b["r"].reshape(-1, 1), b["done"].reshape(-1, 1)
        with torch.no_grad():
            y = ddpg_target(r, done, self.critic_target(b["s2"], self.actor_target(b["s2"])), c.gamma)
        critic_loss = torch.mean((y - self.critic(b["s"], b["a"])) ** 2)
        self.critic_opt.zero_grad()
        critic_loss.backward()
        self.critic_opt.step()
        actor_loss = -self.critic(b["s"], self.actor(b["s"])).mean()
        self.actor_opt.zero_grad()
        actor_loss.backward()
        self.actor_opt.step()
        soft_update(self.critic_target, self.critic, c.tau)
        soft_update(self.actor_target, self.actor, c.tau)
        self.updates += 1
        return {"critic_loss": float(critic_loss.detach()), "actor_loss": float(actor_loss.detach())}

    def parameter_count(self) -> int:
        """Trainable parameters of actor and critic (targets not counted)."""
        return sum(p.numel() for m in (self.actor, self.critic) for p in m.parameters())

    def to_bytes(self) -> bytes:
        """Networks, targets, optimisers, generators and the replay buffer, for a checkpoint:
        tensors, containers and numbers only (the buffer's float32 arrays as tensors), so that
        :meth:`load_bytes` reads it with torch's restricted unpickler."""
        buf = io.BytesIO()
        buffer = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                  for k, v in self.buffer.state_dict().items()}
        torch.save({"config": asdict(self.config), "dims": (self.state_dim, self.action_dim),
                    "nets": {k: getattr(self, k).state_dict() for k in
                             ("actor", "critic", "actor_target", "critic_target", "actor_opt", "critic_opt")},
                    "noise": self.noise.get_state(), "rng": self.rng.bit_generator.state,
                    "buffer": buffer, "updates": self.updates}, buf)
        return buf.getvalue()

    def load_bytes(self, data: bytes) -> None:
        """Restore :meth:`to_bytes`. Read with ``torch.load(..., weights_only=True)``: a
        checkpoint from elsewhere cannot run code here.

        Raises:
            ValueError: the bytes are no such agent (torch's restricted unpickler refused them:
                an object that is no tensor, container or number, as a checkpoint written before
                the replay buffer was kept as tensors holds numpy arrays; or not a torch archive),
                or the saved agent has other dimensions.
        """
        try:
            st: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a foreign or damaged blob fails in many ways: one refusal
            raise ValueError(f"saved DDPG agent cannot be read ({type(exc).__name__}: {_load_reason(exc)})") from exc
        st["buffer"] = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in st["buffer"].items()}
        if tuple(st["dims"]) != (self.state_dim, self.action_dim):
            raise ValueError(f"saved DDPG agent is {tuple(st['dims'])} (state, action), this one "
                             f"{(self.state_dim, self.action_dim)}")
        for k, v in st["nets"].items():
            getattr(self, k).load_state_dict(v)
        self.noise.set_state(st["noise"])
        self.rng.bit_generator.state = st["rng"]
        self.buffer.load_state_dict(st["buffer"])
        self.updates = int(st["updates"])
