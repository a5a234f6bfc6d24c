"""FedDO, server half: a DSAC-T agent gives every device its own data-usage ratio d_k ∈ [0, 1]
each round (FedDO, ECCV 2026; SPECS §4; the agent is :mod:`broker_server.rl.dsac_t`).

Round t (SPECS §4.1):

1. **State** s_t = [o_t (K values), φ_{t−1}, min(ℓ_{t−1}, 10)/10, min((t−1)/H, 1), |K_{t−1}|/K]
   (:func:`build_state`): o_t^k = ‖w^k − w‖₂, the parameter drift of device k's last upload from
   the global model it started from, divided by max_j o^j (so in [0, 1]); φ and ℓ the global
   model's validation accuracy and loss after round t−1; H = ``horizon``; |K_{t−1}| the devices
   active in round t−1.
2. **Action** a_t ~ π(s_t) ∈ (−1, 1)^K (tanh-squashed Gaussian), d_t^k = max(a_t^k, 0)
   (SPECS §4.1 option (a): the tanh Gaussian never reaches 0 by itself).
3. The active set K_t = {k : d_t^k > 0} is asked to train; each gets ``data_ratio`` = d_t^k as
   its own instruction and trains on round(d_t^k·|D_k|) samples (:func:`edge_agent.algorithms.
   feddo.subset_size`), uniform without replacement.
4. **Aggregation** w_{t+1} = Σ_{k∈K_t} (|S_t^k| / Σ_j |S_t^j|)·w_t^k (the reported
   ``num_samples`` = |S_t^k|).
5. **Reward** r_t from the validation accuracy φ ∈ [0, 1] (:func:`feddo_reward`, Ξ = 64):
   ``"seed"`` — Ξ^(φ_t − φ_{t−1}) if φ_t ≥ φ_{t−1}, else −Ξ^(φ_{t−1} − φ_t) (as the paper writes
   it: r jumps from −1 to +1 at Δ = 0); ``"continuous"`` — the same minus 1 in magnitude,
   sign(Δ)·(Ξ^|Δ| − 1) (FAVOR's Ξ^Δ − 1 form, continuous at 0).
6. The transition (s_t, a_t, r_t, s_{t+1}, done) is stored when s_{t+1} is built (the next round's
   planning), and the agent takes ``updates_per_round`` DSAC-T steps after its warm-up
   (``learn = true``: it keeps learning in deployment, SPECS §4.3 leaves it open).

Choices SPECS leaves open, each an ``[algorithm]`` key (default, reason):

* ``num_devices`` (0): K, the action width; 0 = the pre-trained policy's, else the number of
  devices available in round 1. Devices get slots in the order they are first seen (sorted ids
  within a round). **A federation of another size than K**: with a pre-trained ``policy`` a
  device beyond its K is an error (:class:`~broker_server.errors.RunError` when that device
  would get a slot: the policy's inputs and outputs are K devices wide, and the device would
  never train; ``fedfleet simulate`` and ``fedfleet feddo pretrain``, whose ``[data] clients``
  is the fleet, refuse ``[data] clients`` > K before anything runs, through
  :attr:`~broker_server.strategies.Strategy.max_devices`); fewer devices than K is allowed
  (devices that have not joined yet, or have left: the agent sees their slots as offline
  devices) and logged as a warning each time the number of filled slots changes; without a policy
  a device beyond K (``num_devices``, or the devices of round 1) is never asked (logged once per
  device). Every round's line records ``feddo_slots`` (K), ``feddo_slots_filled`` (devices holding
  a slot) and ``feddo_unslotted`` (devices seen that hold none and are never asked).
* ``drift_missing`` (``"last"``): what a device that did not train contributes to o_t — its
  last measured drift (``"last"``; 0 before it ever trained), or 0 (``"zero"``). Keeping each
  device's last *model* would cost K model copies on the server; its last drift costs K numbers.
* ``reward`` (``"seed"``) and ``xi`` (64.0): step 5.
* ``horizon`` (100): H of the round feature (the run's rounds are not known to a strategy).
* ``min_ratio`` (0.05): when fewer than ``min_clients`` ([server] quorum) devices get d > 0, the
  ones with the largest actions are made active with d = max(d, min_ratio), so a round can close;
  the replay buffer keeps the policy's action.
* ``val_size`` (500) and ``val_source`` (``"train"``): the server's validation set (its size is
  not in the paper): a seeded sample of the training split (``"train"``; no test sample feeds
  the reward) or of the test split (``"test"``).
* ``policy`` (``""``): a file of ``fedfleet feddo pretrain`` (:meth:`DSACTAgent.save_policy`);
  empty = an untrained agent. ``learn`` (true), ``deterministic`` (false: sample π; true: tanh μ).
* ``mode`` (``"agent"``): ``"random"`` replaces the policy by the control of the paper's claim:
  each device active with probability ``random_active`` (0.25) and d ~ U[max(0, 2m − 1),
  min(1, 2m)] with m = ``random_mean`` (0.85), so E[d | active] = m. ``"full"`` replaces it by
  no decision at all: every online device trains on its whole shard (d = 1), so the aggregate
  is Σ (|D_k| / Σ|D|)·w_k, FedAvg's at participation 1.0 (the reference a decision is measured
  against). In both the agent still observes the transitions (and learns, with ``learn``).
* Agent sizes: ``hidden`` (256) wide ``layers`` (3) MLPs, ``rank`` (96: the low-rank r is not given;
  96 gives about the paper's per-device slope of the low-rank agent, §4.3), ``batch_size`` (64),
  ``warmup`` (64 transitions: a deployed run has one per round), ``capacity`` (100,000),
  ``updates_per_round`` (1), ``lr_actor``/``lr_critic`` (1e-4), ``lr_alpha`` (3e-4), ``gamma``
  (0.99), ``tau`` (0.005), ``critic_layer_norm`` (true: a LayerNorm in each hidden layer of the
  critics, which DSAC-T does not have; see below). With a pre-trained ``policy`` the architecture
  keys (``hidden``, ``layers``, ``rank``, ``critic_layer_norm``) must be the policy's (a ValueError
  names both; the weights have that shape), and the learning keys (``batch_size``, ``warmup``,
  ``capacity``, the three learning rates, ``gamma``, ``tau``) are this run's: the loaded agent goes
  on learning with them (its optimisers' rates set to them), each one that differs from the
  pre-training's logged.
* **The critics' LayerNorm** (``critic_layer_norm``, true; in neither DSAC-T nor the paper): a
  LayerNorm between each hidden layer's linear map and its GELU in both critics (Ball et al.,
  "Efficient Online Reinforcement Learning with Offline Data", ICML 2023, §4), which bounds the
  critic's output whatever the input (|Q| ≤ Σ_i |w_i|(|γ_i|√(H − 1) + |β_i|) + |b|). Measured
  without it (Fashion-MNIST Dir(0.5), 100 devices, 10,000 images, 75-round episodes, 50 updates a
  round: ``tools/reproduce_feddo.py``'s pre-training): the critics diverged. Their mean Q on
  replayed transitions rose from ≈ 1,100 after episode 1 to ≈ 3.9·10⁵ in episode 6, where the
  policy's entropy was −305 nats, so the true soft value was negative (α·H ≈ −3,800 a round
  against rewards of about ±1). The actor followed that critic's gradient to saturated means
  (|μ| > 3 on a quarter of the devices), and the temperature, which cannot restore the entropy
  against it, climbed from 1.35 (episode 2) to 44 (episode 8). On a fixed replay buffer of 450
  such transitions, from fresh networks, the plain critics reached Q ≈ 4.7·10⁷ after 17,500
  updates and the LayerNorm critics stayed at ≈ 570 after 14,500. With it, the same pre-training
  kept Q below 690 throughout and the temperature fell as DSAC-T intends, to 0.017 after episode
  10 (Dir(0.1) alike), the entropy then −84 nats against the target −100 (Dir(0.1): −12) and the
  policy's mean |μ| 0.99 (0.78; 0.05 at the first update). The key is swept off in ``tools/reproduce_feddo.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from edge_agent.algorithms.feddo import RATIO_KEY, subset_size

from ..aggregate import weighted_average
from ..errors import RunError
from ..rl.dsac_t import DSACTAgent, DSACTConfig
from ._base import ClientResult, GlobalUpdate, RoundPlan, Scalar, Strategy
from ._registry import register_strategy

log = logging.getLogger(__name__)

REWARDS = ("seed", "continuous")
DRIFT_MISSING = ("last", "zero")
MODES = ("agent", "random", "full")
#: the DSAC-T keys a deployed run sets for a loaded policy (its architecture keys must match).
LEARNING_KEYS = ("batch_size", "warmup", "capacity", "lr_actor", "lr_critic", "lr_alpha", "gamma", "tau")
#: global features after the K drifts in the state (:func:`build_state`).
GLOBAL_FEATURES = 4


def feddo_reward(phi: float, phi_prev: float, xi: float = 64.0, variant: str = "seed") -> float:
    """The asymmetric exponential reward of FedDO (module docstring, step 5).

    Args:
        phi, phi_prev: validation accuracy after and before the round, fractions in [0, 1].
        xi: the base Ξ (> 1).
        variant: ``"seed"`` (±Ξ^|Δ|, discontinuous at Δ = 0: r(0) = +1) or ``"continuous"``
            (sign(Δ)·(Ξ^|Δ| − 1), r(0) = 0).

    Raises:
        ValueError: an accuracy outside [0, 1] (a percentage makes 64^Δ explode), Ξ ≤ 1, an
            unknown variant.
    """
    for name, v in (("phi", phi), ("phi_prev", phi_prev)):
        if not (math.isfinite(v) and 0.0 <= v <= 1.0):
            raise ValueError(f"{name} = {v!r}: the FedDO reward needs an accuracy in [0, 1]")
    if not xi > 1:
        raise ValueError(f"xi = {xi!r} must be > 1")
    if variant not in REWARDS:
        raise ValueError(f"reward = {variant!r} must be one of {REWARDS}")
    delta = phi - phi_prev
    mag = xi ** abs(delta)
    if variant == "continuous":
        return math.copysign(mag - 1.0, delta) if delta != 0 else 0.0
    return mag if delta >= 0 else -mag


def build_state(drift: np.ndarray, accuracy: float, loss: float, round_fraction: float,
                active_fraction: float) -> np.ndarray:
    """s = [drift / max(drift) (K; zeros when all are 0), accuracy, min(loss, 10)/10,
    round_fraction, active_fraction] as float32 [K + 4]. Every global feature is clipped to
    [0, 1]."""
    d = np.asarray(drift, np.float64)
    top = float(d.max()) if d.size else 0.0
    o = d / top if top > 0 else np.zeros_like(d)
    g = [accuracy, min(max(loss, 0.0), 10.0) / 10.0, round_fraction, active_fraction]
    return np.concatenate([o, np.clip(np.asarray(g, np.float64), 0.0, 1.0)]).astype(np.float32)


def ratios_from_action(action: np.ndarray, min_active: int, min_ratio: float) -> np.ndarray:
    """d = max(a, 0); when fewer than ``min_active`` entries are > 0, the largest actions among
    the rest become max(a, min_ratio) until ``min_active`` are (ties: the lower index)."""
    a = np.asarray(action, np.float64)
    d = np.maximum(a, 0.0)
    short = min(min_active, a.size) - int((d > 0).sum())
    if short > 0:
        idle = [i for i in np.argsort(-a, kind="stable") if d[i] == 0][:short]
        d[idle] = np.maximum(a[idle], min_ratio)
    return d


def _flat_drift(update: Sequence[np.ndarray], current: Sequence[np.ndarray]) -> float:
    """‖w_k − w‖₂ over every floating tensor (float64 sums)."""
    s = 0.0
    for a, b in zip(update, current, strict=True):
        if np.issubdtype(np.asarray(a).dtype, np.floating):
            s += float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return math.sqrt(s)


#: the default size of a reward-driven strategy's validation set (FedDO, FedAA: ``val_size``)
VAL_SIZE = 500


def validation_split(dataset: Any, params: Mapping[str, object], seed: int,
                     device_samples: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The server's validation set of a reward-driven strategy (FedDO, FedAA): ``val_size``
    (default 500) samples of the ``val_source`` split (``"train"``, default, so no test sample
    feeds the reward; or ``"test"``), drawn without replacement by a generator of ``seed``.

    With ``"train"`` the set is **held out** (SPECS §4.1: "a held-out validation set"): drawn
    from the training images no device holds, the complement of ``device_samples`` (the indices
    the devices' shards come from, :func:`~edge_agent.partition.split_dataset`'s subset; ``None``
    = the whole split). When the devices hold every training image, the set is drawn from all of
    them and a warning says that it overlaps the devices' training data (``[data]
    train_samples`` below the split's size, or ``val_source = "test"``, avoids it).

    Returns:
        ``(x float32 [V, C, H, W], y int64 [V])``, V = min(val_size, pool size) (a smaller set than
        ``val_size`` is logged as a warning).

    Raises:
        ValueError: ``val_size`` < 1.
    """
    train = str(params.get("val_source", "train")) == "train"
    src = dataset.train if train else dataset.test
    n = len(src.y)
    want = int(params.get("val_size", VAL_SIZE))  # type: ignore[call-overload]
    if want < 1:
        raise ValueError(f"val_size = {want} must be >= 1 (validation samples)")
    pool = np.arange(n)
    where = "test images in the split" if not train else "training images in the split"
    if train:
        held = np.setdiff1d(pool, np.arange(n) if device_samples is None else np.asarray(device_samples, np.int64))
        if held.size:
            pool, where = held, "training images are held by no device"
        else:
            log.warning("the validation set (%d images) is drawn from training images the devices also train on "
                        "(they hold all %d): set [data] train_samples below %d, or [algorithm] val_source = "
                        "\"test\", for a held-out one", min(want, n), n, n)
    if pool.size < want:
        log.warning("the validation set has %d images, not val_size = %d: only %d %s", pool.size, want, pool.size,
                    where)
    idx = np.sort(np.random.default_rng(seed + 104729).choice(pool, min(want, pool.size), replace=False))
    return np.asarray(src.x[idx], np.float32), np.asarray(src.y[idx], np.int64)


def _config_record(config: DSACTConfig) -> dict[str, Any]:
    """``config`` as plain values (a checkpoint's record of the agent's configuration)."""
    return {**dataclasses.asdict(config), "hidden": list(config.hidden)}


def validate_model(model: torch.nn.Module, validation: tuple[np.ndarray, np.ndarray]) -> tuple[float, float]:
    """Accuracy (fraction) and mean cross-entropy of ``model`` on ``validation`` = (x float32
    [V, ...], y int64 [V]), in batches of 1000; the model's train/eval mode is restored."""
    x, y = validation
    was = model.training
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(y), 1000):
            xb, yb = torch.from_numpy(x[i:i + 1000]), torch.from_numpy(y[i:i + 1000])
            logits = model(xb)
            loss += float(F.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(1) == yb).sum())
    model.train(was)
    return correct / max(1, len(y)), loss / max(1, len(y))


@register_strategy("feddo")
class FedDO(Strategy):
    """FedDO strategy (see the module docstring for the round and every key)."""

    name = "feddo"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = (RATIO_KEY,)
    path_keys = ("policy",)  # made absolute when a run starts: a --resume from elsewhere finds it
    setup_keys = ("validation", "run_seed", "run_data")  # from setup_kwargs, not [algorithm] keys
    #: the reward r_t and φ_t of the next state s_{t+1} come from :meth:`evaluate` of round t
    plans_from_evaluation = True

    def __init__(self, *, min_clients: int = 1, train_config: Mapping[str, Scalar] | None = None,
                 num_devices: int = 0, policy: str = "", learn: bool = True, deterministic: bool = False,
                 reward: str = "seed", xi: float = 64.0, horizon: int = 100, drift_missing: str = "last",
                 min_ratio: float = 0.05, val_size: int = VAL_SIZE, val_source: str = "train", mode: str = "agent",
                 random_active: float = 0.25, random_mean: float = 0.85, hidden: int = 256, layers: int = 3,
                 rank: int = 96, batch_size: int = 64, warmup: int = 64, capacity: int = 100_000,
                 updates_per_round: int = 1, lr_actor: float = 1e-4, lr_critic: float = 1e-4,
                 lr_alpha: float = 3e-4, gamma: float = 0.99, tau: float = 0.005, critic_layer_norm: bool = True,
                 validation: tuple[np.ndarray, np.ndarray] | None = None, run_seed: int = 0,
                 run_data: Mapping[str, object] | None = None, resuming: bool = False) -> None:
        problems = []
        if reward not in REWARDS:
            problems.append(f"reward = {reward!r} must be one of {REWARDS}")
        if drift_missing not in DRIFT_MISSING:
            problems.append(f"drift_missing = {drift_missing!r} must be one of {DRIFT_MISSING}")
        if mode not in MODES:
            problems.append(f"mode = {mode!r} must be one of {MODES}")
        if not 0 < min_ratio <= 1:
            problems.append(f"min_ratio = {min_ratio} must be in (0, 1]")
        if not 0 < random_active <= 1 or not 0 < random_mean <= 1:
            problems.append(f"random_active = {random_active}, random_mean = {random_mean} must be in (0, 1]")
        if horizon < 1 or num_devices < 0 or updates_per_round < 0 or val_size < 1:
            problems.append(f"horizon ({horizon}) and val_size ({val_size}) must be >= 1, num_devices "
                            f"({num_devices}) and updates_per_round ({updates_per_round}) >= 0")
        if layers < 1 or hidden < 1:
            problems.append(f"layers ({layers}) and hidden ({hidden}) must be >= 1")
        if val_source not in ("train", "test"):
            problems.append(f"val_source = {val_source!r} must be 'train' or 'test'")
        if not xi > 1:
            problems.append(f"xi = {xi} must be > 1")
        if problems:
            raise ValueError("; ".join(problems))
        self.min_clients = max(1, int(min_clients))
        self.train_config = dict(train_config or {})
        self.learn, self.deterministic, self.reward, self.xi = bool(learn), bool(deterministic), reward, float(xi)
        self.horizon, self.drift_missing, self.min_ratio = int(horizon), drift_missing, float(min_ratio)
        self.mode, self.random_active, self.random_mean = mode, float(random_active), float(random_mean)
        self.updates_per_round = int(updates_per_round)
        self.agent_config = DSACTConfig(hidden=(int(hidden),) * int(layers), rank=int(rank),
                                        batch_size=int(batch_size), warmup=int(warmup), capacity=int(capacity),
                                        lr_actor=lr_actor, lr_critic=lr_critic, lr_alpha=lr_alpha, gamma=gamma, tau=tau,
                                        critic_layer_norm=bool(critic_layer_norm))
        self.run_seed = int(run_seed)
        self.validation = None if validation is None else (np.array(validation[0], np.float32, copy=True),
                                                            np.array(validation[1], np.int64, copy=True))
        self.policy_path = policy
        self.agent: DSACTAgent | None = None
        self.num_devices = int(num_devices)
        self._run_data = dict(run_data or {})
        self.policy_record: dict[str, Any] = {}  # the loaded policy file's identity (run_summary)
        # a resumed run's agent is its checkpoint's (load_state_dict): the policy file is read only
        # if no checkpoint holds one, when the first round is planned
        self._policy_deferred = bool(policy) and resuming
        if policy and not resuming:
            self._load_policy()
        self.slots: list[str] = []
        self.shard_sizes: dict[str, int] = {}
        self._warned: set[str] = set()
        self._filled_warned = -1  # the filled-slot count last warned about (a policy's K not reached)
        self.reset_episode()

    def _load_policy(self) -> None:
        """The agent from :attr:`policy_path`, fitted to this run (:meth:`_adopt_run_config`); K
        and :attr:`max_devices` from it; other data settings than the run's said in a warning.

        Raises:
            ValueError: an unreadable or damaged file, or one that does not fit ``num_devices``
                or the ``[algorithm]`` architecture (the message names the file).
        """
        policy = self.policy_path
        self._policy_deferred = False
        self.agent, meta, digest = DSACTAgent.load_policy(policy, seed=self.run_seed)
        self.policy_record = {"path": str(Path(policy).resolve()), "file_sha256": digest,
                              "metadata": {k: v for k, v in meta.items() if isinstance(v, (int, float, str, bool))
                                           or v is None}}
        if "interrupted_episode" in meta:
            log.warning("FedDO: the policy %s is from a pre-training stopped %s episode %s: %s of %s episodes "
                        "whole", policy, "in" if meta.get("interrupted_round") else "before",
                        meta["interrupted_episode"], meta.get("episodes"), meta.get("episodes_planned"))
        k = int(meta.get("num_devices", self.agent.action_dim))
        if self.num_devices and self.num_devices != k:
            raise ValueError(f"num_devices = {self.num_devices} but policy {policy} was trained for {k} devices")
        if self.agent.state_dim != k + GLOBAL_FEATURES:
            raise ValueError(f"policy {policy}: state width {self.agent.state_dim}, expected {k} + {GLOBAL_FEATURES}")
        self.num_devices = k
        self.max_devices = k  # a device beyond the policy's K would never train (module docstring)
        self._adopt_run_config(policy)
        # α only where both are Dirichlet partitions (a policy of an older pretrain records one for
        # any partition)
        run_data = self._run_data
        dirichlet = run_data.get("partition") == meta.get("partition") == "dirichlet"
        other = {key: (meta[key], want) for key, want in run_data.items()
                 if key in meta and meta[key] != want and (key != "alpha" or dirichlet)
                 # more devices than K: the fleet-size refusal that follows says it
                 and not (key == "clients" and isinstance(want, int) and want > k)}
        if other:
            log.warning("FedDO: the policy %s was pre-trained on other data settings than this run's (%s): its "
                        "ratios were learnt for another federation", policy,
                        "; ".join(f"{key} {a!r} there, {b!r} here" for key, (a, b) in other.items()))

    def _adopt_run_config(self, policy: str) -> None:
        """The loaded policy's agent set to this run's ``[algorithm]`` agent keys: the architecture
        checked against the policy's, the learning keys (:data:`LEARNING_KEYS`) replacing the
        pre-training's (the optimisers' rates included), an empty replay buffer of this run's
        ``capacity``.

        Raises:
            ValueError: ``hidden``/``layers``/``rank`` other than the policy's (the message names
                both sets and how to fix it).
        """
        assert self.agent is not None
        saved, want = self.agent.config, self.agent_config
        if (saved.hidden, saved.rank, saved.critic_layer_norm) != (want.hidden, want.rank, want.critic_layer_norm):
            def sizes(c: DSACTConfig) -> str:
                return (f"hidden = {c.hidden[0] if c.hidden else 0}, layers = {len(c.hidden)}, rank = {c.rank}, "
                        f"critic_layer_norm = {str(c.critic_layer_norm).lower()}")
            raise ValueError(f"policy {policy} was pre-trained with {sizes(saved)}, but [algorithm] asks "
                             f"{sizes(want)} (256, 3, 96 and true where not set): set them to the policy's, or "
                             "pre-train a policy with these (fedfleet feddo pretrain); a policy saved before "
                             "critic_layer_norm existed has critics without LayerNorm")
        changed = [f"{k} {getattr(saved, k)} → {getattr(want, k)}" for k in LEARNING_KEYS
                   if getattr(saved, k) != getattr(want, k)]
        self.agent.config = dataclasses.replace(saved, **{k: getattr(want, k) for k in LEARNING_KEYS})
        for opt, lr in ((self.agent.actor_opt, want.lr_actor), *((o, want.lr_critic) for o in self.agent.critic_opts),
                        (self.agent.alpha_opt, want.lr_alpha)):
            for group in opt.param_groups:
                group["lr"] = lr
        self.agent.buffer = type(self.agent.buffer)(want.capacity, self.agent.state_dim, self.agent.action_dim)
        if changed:
            log.info("FedDO: policy %s goes on learning with this run's %s (pre-trained with the former)",
                     policy, ", ".join(changed))

    # ------------------------------------------------------------------ setup

    @classmethod
    def header_files(cls, params: Mapping[str, object], resumed_after: int | None = None) -> str:
        """``policy PATH`` for a fresh run (or a resume of a run checkpointed before its first
        round: the policy file is read then); a resume after round N takes its agent from that
        checkpoint (:meth:`load_state_dict`), whatever the file now holds or whether it is there:
        ``agent from the checkpoint of round N; started from policy PATH``."""
        policy = params.get("policy")
        if not resumed_after:
            return super().header_files(params, resumed_after)
        return (f"agent from the checkpoint of round {resumed_after}"
                + (f"; started from policy {policy}" if policy else ""))

    @classmethod
    def setup_kwargs(cls, dataset: Any, params: Mapping[str, object], seed: int,
                     device_samples: np.ndarray | None = None,
                     data_settings: Mapping[str, object] | None = None) -> dict:
        """The validation set (:func:`validation_split`, held out from ``device_samples``), the
        run seed and the run's data settings (compared with a pre-trained policy's)."""
        return {"validation": validation_split(dataset, params, seed, device_samples), "run_seed": seed,
                "run_data": dict(data_settings or {})}

    def reset_episode(self) -> None:
        """Forget the per-run state (drifts, φ, the pending transition), keep the agent and its
        buffer: the start of a run, or of a pre-training episode."""
        k = max(self.num_devices, len(self.slots))
        self.drift = np.zeros(k, np.float64)
        self.phi, self.val_loss, self.active_fraction = 0.0, 0.0, 0.0
        self.pending: dict[str, Any] | None = None  # {"s", "a", "r"}: the last round's transition so far
        self.ratios: dict[str, float] = {}
        self.last_update: dict[str, float] = {}

    def bind_model(self, model: torch.nn.Module) -> None:
        """φ_0 and ℓ_0: the initial model on the validation set."""
        self.phi, self.val_loss = self._validate_model(model)

    def on_join(self, client_id: str, profile: str, num_samples: int) -> None:
        """Keep |D_k| (to check each update's |S_k|)."""
        self.shard_sizes[client_id] = int(num_samples)

    # ------------------------------------------------------------------ the agent

    def _ensure_agent(self, k: int) -> DSACTAgent:
        if self.agent is None:
            if k < 1:
                raise ValueError("FedDO has no device to plan for")
            self.num_devices = k
            self.agent = DSACTAgent(k + GLOBAL_FEATURES, k, self.agent_config, seed=self.run_seed)
            log.info("FedDO: DSAC-T agent for %d devices, %s parameters", k, self.agent.parameter_counts())
        if self.drift.size != self.num_devices:
            self.drift = np.resize(self.drift, self.num_devices) * 0
        return self.agent

    def _slot_ids(self, available: Sequence[str]) -> list[str]:
        """The slots after giving each new device of ``available`` one (module docstring,
        ``num_devices``).

        Raises:
            RunError: a pre-trained policy's K slots are all taken and a new device would get
                none (the message names the policy, K, the devices seen and those left out).
        """
        for cid in sorted(available):
            if cid in self.slots:
                continue
            if self.num_devices and len(self.slots) >= self.num_devices:
                if self.policy_path:
                    seen = set(self.slots) | set(available) | set(self.shard_sizes)
                    out = sorted(seen - set(self.slots))
                    raise RunError(
                        f"FedDO: the policy {self.policy_path} was trained for {self.num_devices} devices, but "
                        f"{len(seen)} devices have joined; {len(out)} of them ({', '.join(out[:3])}"
                        f"{', …' if len(out) > 3 else ''}) would get no slot and never train. Pre-train a policy for "
                        f"this federation (fedfleet feddo pretrain with [data] clients = {len(seen)}) or run it "
                        f"with {self.num_devices} devices")
                if cid not in self._warned:
                    self._warned.add(cid)
                    log.warning("FedDO: %s is beyond the agent's %d devices and is never asked", cid, self.num_devices)
                continue
            self.slots.append(cid)
        if self.policy_path and len(self.slots) < self.num_devices and len(self.slots) != self._filled_warned:
            self._filled_warned = len(self.slots)
            log.warning("FedDO: the policy %s was trained for %d devices; %d have joined: %d of its slots stay "
                        "empty (the agent sees them as offline devices) until more devices join", self.policy_path,
                        self.num_devices, len(self.slots), self.num_devices - len(self.slots))
        return self.slots

    def state(self, round: int) -> np.ndarray:
        """s_t for ``round`` (module docstring, step 1)."""
        return build_state(self.drift, self.phi, self.val_loss, min((round - 1) / self.horizon, 1.0),
                           self.active_fraction)

    def configure_round(self, round: int, available: Sequence[str], rng: np.random.Generator) -> RoundPlan:
        """Build s_t, store the previous transition and learn, act, and ask the devices with d > 0."""
        if self._policy_deferred:  # a resume whose checkpoint held no agent: the policy file, as a fresh run
            self._load_policy()
        slots = self._slot_ids(available)
        agent = self._ensure_agent(len(slots) if not self.num_devices else self.num_devices)
        s = self.state(round)
        self.last_update = {}
        if self.pending is not None and self.pending.get("r") is not None:
            agent.observe(self.pending["s"], self.pending["a"], self.pending["r"], s, False)
            if self.learn:
                self.last_update = agent.update(self.updates_per_round)
        k = self.num_devices
        online = np.zeros(k, bool)
        for i, cid in enumerate(slots[:k]):
            online[i] = cid in set(available)
        if self.mode == "random":
            active = rng.random(k) < self.random_active
            lo, hi = max(0.0, 2 * self.random_mean - 1), min(1.0, 2 * self.random_mean)
            a = np.where(active, rng.uniform(lo, hi, k), -1.0).astype(np.float32)
        elif self.mode == "full":
            a = np.ones(k, np.float32)
        else:
            a = agent.act(s, deterministic=self.deterministic)
        d = ratios_from_action(np.where(online, a, -1.0), min(self.min_clients, int(online.sum())), self.min_ratio)
        d[~online] = 0.0  # an offline device cannot train
        self.ratios = {slots[i]: float(d[i]) for i in range(min(k, len(slots))) if d[i] > 0}
        self.pending = {"s": s, "a": np.asarray(a, np.float32), "r": None}
        selected = tuple(sorted(self.ratios))
        return RoundPlan(selected=selected, config=dict(self.train_config),
                         instructions={c: {RATIO_KEY: self.ratios[c]} for c in selected})

    def validate(self, result: ClientResult) -> str | None:
        """Refuse an update whose ``num_samples`` is not round(d_k·|D_k|) of its device (when
        |D_k| is known from its join)."""
        n = self.shard_sizes.get(result.client_id)
        d = self.ratios.get(result.client_id)
        if n is None or d is None:
            return None
        want = subset_size(d, n)
        if result.num_samples != want:
            return f"num_samples {result.num_samples} != round({d:.6g} x {n}) = {want} samples asked for"
        return None

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        """w = Σ (|S_k|/Σ|S|)·w_k, and each reporting device's new drift ‖w_k − w_t‖."""
        if not results:
            return None
        drift = np.array(self.drift, np.float64, copy=True)
        if self.drift_missing == "zero":
            drift[:] = 0.0
        index = {c: i for i, c in enumerate(self.slots)}
        for r in results:
            if r.client_id in index and index[r.client_id] < drift.size:
                drift[index[r.client_id]] = _flat_drift(r.tensors, current)
        total = sum(r.num_samples for r in results)
        weights = {r.client_id: r.num_samples / total for r in results}
        return GlobalUpdate(
            tensors=weighted_average([r.tensors for r in results], [r.num_samples for r in results]),
            state={"drift": drift, "active_fraction": len(results) / max(1, self.num_devices)},
            metrics={"feddo_weights": weights, "feddo_samples": {r.client_id: r.num_samples for r in results}})

    def evaluate(self, round: int, model: torch.nn.Module) -> Mapping[str, Any]:
        """φ_t on the validation set and the round's reward r_t (step 5)."""
        phi, loss = self._validate_model(model)
        r = feddo_reward(phi, self.phi, self.xi, self.reward)
        if self.pending is not None:
            self.pending["r"] = r
        self.phi, self.val_loss = phi, loss
        return {"feddo_val_accuracy": phi, "feddo_reward": r}

    def end_episode(self, round: int) -> None:
        """Store the last transition with done = 1 (pre-training episodes end; a deployed run
        never calls this)."""
        if self.agent is not None and self.pending is not None and self.pending.get("r") is not None:
            self.agent.observe(self.pending["s"], self.pending["a"], self.pending["r"], self.state(round + 1), True)
            if self.learn:
                self.last_update = self.agent.update(self.updates_per_round)
        self.pending = None

    def _validate_model(self, model: torch.nn.Module) -> tuple[float, float]:
        if self.validation is None:
            raise ValueError("FedDO has no validation set (built by setup_kwargs from the data set)")
        return validate_model(model, self.validation)

    def round_metrics(self) -> dict:
        """Active devices, their mean ratio, the replay size, the slots (K, those filled, the
        devices seen without one: the module docstring's ``num_devices``) and the agent's last
        losses."""
        d = list(self.ratios.values())
        out: dict[str, Any] = {"feddo_active": len(d), "feddo_mean_ratio": float(np.mean(d)) if d else 0.0,
                               "feddo_replay": len(self.agent.buffer) if self.agent is not None else 0,
                               "feddo_slots": self.num_devices, "feddo_slots_filled": len(self.slots),
                               "feddo_unslotted": len(self._warned)}
        out.update({f"feddo_{k}": v for k, v in self.last_update.items()})
        return out

    # ------------------------------------------------------------------ checkpoints

    def run_summary(self) -> dict:
        """``summary.json``'s ``strategy``: the mode; the pre-trained policy the run started from
        (``policy``: its path, the SHA-256 of the file as it was read, its pre-training's
        metadata; ``None`` without one), carried through a resume by the checkpoint; and the
        agent at the end (DSAC-T updates made, transitions stored, entropy temperature α,
        trainable parameters)."""
        agent = self.agent
        return {"algorithm": "feddo", "mode": self.mode, "learn": self.learn,
                "policy": dict(self.policy_record) or None,
                "agent": None if agent is None else {
                    "devices": self.num_devices, "updates": int(agent.updates), "replay": len(agent.buffer),
                    "alpha": float(agent.alpha), "parameters": agent.parameter_counts()["agent"]}}

    def state_dict(self) -> dict:
        """The agent (networks, optimisers, generators: bytes), the replay buffer (arrays), the
        slots, drifts, φ and the pending transition."""
        pending = None if self.pending is None else {"s": self.pending["s"], "a": self.pending["a"],
                                                     "r": self.pending["r"]}
        shape = {} if self.agent is None else {"agent_config": _config_record(self.agent.config),
                                                "state_dim": self.agent.state_dim, "max_devices": self.max_devices}
        return {**shape, "policy_record": dict(self.policy_record),
                "agent": self.agent.to_bytes() if self.agent is not None else b"",
                "replay": self.agent.buffer.state_dict() if self.agent is not None else {},
                "num_devices": self.num_devices, "slots": list(self.slots), "drift": np.asarray(self.drift),
                "phi": self.phi, "val_loss": self.val_loss, "active_fraction": self.active_fraction,
                "pending": pending, "ratios": dict(self.ratios)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (``{}``: nothing). The agent is rebuilt from the checkpoint's
        own record of its configuration, so a resume needs no policy file: the one the run started
        from may have been moved or pre-trained again since (a checkpoint written before that
        record existed builds it as the run started, from the policy file or ``[algorithm]``)."""
        if not state:
            return
        self.num_devices = int(state["num_devices"])
        self.slots = list(state["slots"])
        if state.get("policy_record"):
            self.policy_record = dict(state["policy_record"])
        if state["agent"] and "agent_config" in state:
            conf = dict(state["agent_config"])
            conf["hidden"] = tuple(conf["hidden"])
            self.agent = DSACTAgent(int(state["state_dim"]), self.num_devices, DSACTConfig(**conf), seed=self.run_seed)
            self.max_devices = None if state.get("max_devices") is None else int(state["max_devices"])
            self._policy_deferred = False
        elif state["agent"] and self._policy_deferred:
            self._load_policy()
        if state["agent"]:
            agent = self._ensure_agent(self.num_devices)
            try:
                agent.load_bytes(state["agent"])
            except RuntimeError as exc:  # torch's state-dict error: missing keys, size mismatches
                c = agent.config
                raise ValueError(
                    "FedDO: the checkpoint's DSAC-T agent does not fit the one [algorithm] builds (hidden = "
                    f"{c.hidden[0] if c.hidden else 0}, layers = {len(c.hidden)}, rank = {c.rank}, critic_layer_norm = "
                    f"{str(c.critic_layer_norm).lower()}): set these keys in the run folder's config.toml to the "
                    "run's own; a run checkpointed before critic_layer_norm existed has critics without LayerNorm "
                    f"(critic_layer_norm = false) ({str(exc).splitlines()[0]})") from exc
            agent.buffer.load_state_dict(state["replay"])
        self.drift = np.asarray(state["drift"], np.float64)
        self.phi, self.val_loss = float(state["phi"]), float(state["val_loss"])
        self.active_fraction = float(state["active_fraction"])
        p = state.get("pending")
        self.pending = None if p is None else {"s": np.asarray(p["s"], np.float32), "a": np.asarray(p["a"], np.float32),
                                               "r": p["r"]}
        self.ratios = {str(k): float(v) for k, v in state.get("ratios", {}).items()}
