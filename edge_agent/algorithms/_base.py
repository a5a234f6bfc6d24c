"""What every client algorithm receives and returns."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ..errors import ModelError

log = logging.getLogger(__name__)

#: Which model tensors an algorithm exchanges: every state entry, the feature extractor only
#: (entries named ``backbone.*``; FedPer/FedRep keep the classifier private), or none
#: (FedProto, FedMCP++: only prototypes / soft predictions travel).
SHARES = ("all", "backbone", "none")


def shared_indices(names: Sequence[str], share: str) -> tuple[int, ...]:
    """Positions in the model manifest of the tensors an algorithm with ``share`` exchanges.

    Args:
        names: state_dict entry names in manifest order.
        share: one of :data:`SHARES`.

    Raises:
        ValueError: unknown ``share``; ``"backbone"`` for a model without ``backbone.*`` entries.
    """
    if share == "all":
        return tuple(range(len(names)))
    if share == "none":
        return ()
    if share == "backbone":
        idx = tuple(i for i, n in enumerate(names) if n.startswith("backbone."))
        if not idx:
            raise ValueError("share='backbone' needs a model whose feature extractor is named backbone.*")
        return idx
    raise ValueError(f"share must be one of {SHARES}, got {share!r}")


def shared_arrays(model: torch.nn.Module, share: str) -> tuple[np.ndarray, ...]:
    """Copies (CPU numpy, manifest order) of the state entries exchanged under ``share``."""
    state = model.state_dict()
    keep = set(shared_indices(list(state), share))
    return tuple(t.detach().to("cpu", copy=True).numpy() for i, t in enumerate(state.values()) if i in keep)


def load_shared(model: torch.nn.Module, arrays: Sequence[np.ndarray], share: str) -> None:
    """Copy the exchanged subset ``arrays`` into ``model`` in place; private entries are kept.

    Raises:
        ModelError: wrong number of tensors for ``share``, or a shape that differs from the model's.
    """
    state = model.state_dict()
    names = list(state)
    idx = shared_indices(names, share)
    if len(arrays) != len(idx):
        raise ModelError(f"{len(arrays)} tensors received, {len(idx)} expected for share={share!r}")
    new = {}
    for i, arr in zip(idx, arrays):
        ref = state[names[i]]
        if tuple(arr.shape) != tuple(ref.shape):
            raise ModelError(f"tensor {names[i]}: shape {tuple(arr.shape)} received, the model has {tuple(ref.shape)}")
        new[names[i]] = torch.from_numpy(np.array(arr, dtype=ref.detach().cpu().numpy().dtype, copy=True)).to(ref.device)
    model.load_state_dict(new, strict=False)


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Local training settings for one round (from ``round_start.config`` over the config defaults).

    Attributes:
        local_epochs: passes over the local shard (E).
        batch_size: samples per SGD step (B).
        lr: SGD learning rate.
        momentum: SGD momentum (0 = plain SGD).
        weight_decay: L2 penalty coefficient.
        seed: base seed; each round's shuffling uses a private generator seeded from it.
    """

    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0

    @classmethod
    def from_mapping(cls, base: "TrainConfig", overrides: Mapping[str, object]) -> "TrainConfig":
        """``base`` with the known keys of ``overrides`` applied (unknown keys are ignored:
        tolerant on the wire)."""
        kw = {}
        for name in ("local_epochs", "batch_size", "seed"):
            if name in overrides:
                kw[name] = int(overrides[name])  # type: ignore[arg-type]
        for name in ("lr", "momentum", "weight_decay"):
            if name in overrides:
                kw[name] = float(overrides[name])  # type: ignore[arg-type]
        return TrainConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, **kw})


@dataclass(frozen=True, slots=True)
class LocalResult:
    """What a client algorithm produced in one round.

    Attributes:
        tensors: model arrays to upload: the subset the algorithm shares (:func:`shared_indices`),
            in model-manifest order; ``()`` for algorithms that share no parameters.
        num_samples: samples trained on (the FedAvg weight).
        train_loss: mean loss over the last local epoch.
        metrics: extra scalars (``train_seconds``, ``train_accuracy`` …).
        extras: named non-model arrays to upload (prototypes [C, d] float32 with their class
            ids, soft predictions [P, C], control-variate deltas …).
    """

    tensors: tuple[np.ndarray, ...]
    num_samples: int
    train_loss: float
    metrics: dict[str, float] = field(default_factory=dict)
    extras: dict[str, np.ndarray] = field(default_factory=dict)


class ClientAlgorithm(Protocol):
    """The client half of an algorithm.

    ``share`` (class attribute, default ``"all"``) says which model tensors travel;
    ``global_tensors`` and :attr:`LocalResult.tensors` hold that subset only. ``params`` is the
    round's ``round_start.config`` (the strategy puts the algorithm's hyperparameters there);
    ``global_extras`` the named arrays of the round's ``global`` (``{}`` when none). One instance
    serves one device for the whole run and may keep per-device state between rounds. An
    optional ``predict(model, x) -> scores [N, C]`` replaces ``model(x)`` in client-side
    evaluation (FedProto classifies by the nearest global prototype).

    An optional ``on_update_receipt(round, accepted) -> None`` hears the server's definite
    answer to the update of ``round``: the agent (:class:`edge_agent.agent.EdgeAgent`) calls it
    at most once per round it sent, with ``accepted=True`` on an accepted receipt and
    ``accepted=False`` on a refusal, when the update was never sent (no samples, non-finite
    result) or when no definite receipt came before the device trains its next round (logged
    as a warning). Algorithms whose per-device state mirrors server state (SCAFFOLD's c_i,
    FedDyn's ∇L_k) keep a round's new state only when the server took the update
    (:class:`StateOnReceipt`); the others do not define it.
    """

    name: str

    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_index: int,
                    device: torch.device, params: Mapping[str, object] = ...,
                    global_extras: Mapping[str, np.ndarray] = ...) -> LocalResult: ...


def algorithm_share(algorithm: object) -> str:
    """The ``share`` of a client algorithm or server strategy (``"all"`` when it declares none)."""
    return str(getattr(algorithm, "share", "all"))


def predict_scores(algorithm: object, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Class scores [N, C] of ``model`` on ``x`` through the algorithm's ``predict`` when it has
    one, else ``model(x)`` (logits)."""
    pred = getattr(algorithm, "predict", None)
    return pred(model, x) if pred is not None else model(x)


class StateOnReceipt:
    """Mixin for a client algorithm whose per-device state must match what the server counted
    (SCAFFOLD's c_i, FedDyn's ∇L_k): the state a round produces stands only if the server
    accepted that round's update.

    The attribute named :attr:`state_attr` holds the state after the last local round, and the
    state before it is kept as ``(round, previous)`` until :meth:`on_update_receipt` settles the
    round: accepted → the new state is committed; refused (or never answered, which the agent
    reports as refused before the next round) → the previous state is restored. The delta a
    round sends is always taken against the committed state, since the agent settles every
    round before it trains the next. Used without receipts (a unit test calling
    ``local_round`` directly), each round's state stands, as under reliable delivery. Put the
    mixin before the algorithm's base class (it wraps ``local_round``).
    """

    #: name of the attribute holding the per-device state (``None`` = zeros, before round 1).
    state_attr: str = ""

    _unsettled: tuple[int, object] | None = None

    def local_round(self, *args, round: int, **kw) -> LocalResult:
        """The base class's round; the state it leaves awaits :meth:`on_update_receipt` for ``round``."""
        before = getattr(self, self.state_attr)
        result = super().local_round(*args, round=round, **kw)  # type: ignore[misc]
        self._unsettled = (round, before)
        return result

    @property
    def pending_round(self) -> int | None:
        """The round whose new state awaits the server's answer (``None`` when settled)."""
        return None if self._unsettled is None else self._unsettled[0]

    @property
    def committed_state(self) -> object:
        """The state as of the last update the server accepted (the current one when settled)."""
        return getattr(self, self.state_attr) if self._unsettled is None else self._unsettled[1]

    def on_update_receipt(self, round: int, accepted: bool) -> None:
        """Commit (``accepted``) or roll back the state of ``round``; a round that is not the
        one awaiting an answer (already settled, or superseded) is ignored."""
        if self._unsettled is None or self._unsettled[0] != round:
            log.debug("%s: answer for round %d ignored (awaiting %s)", type(self).__name__, round,
                      self.pending_round)
            return
        if not accepted:
            setattr(self, self.state_attr, self._unsettled[1])
        self._unsettled = None
