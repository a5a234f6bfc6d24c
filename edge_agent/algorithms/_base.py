"""What every client algorithm receives and returns."""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, SupportsFloat, SupportsIndex, SupportsInt, cast

import numpy as np
import torch

from ..errors import ModelError

log = logging.getLogger(__name__)

#: Which model tensors an algorithm exchanges: every state entry, the feature extractor only
#: (entries named ``backbone.*``; FedPer/FedRep keep the classifier private), or none
#: (FedProto, FedMCP++: only prototypes / soft predictions travel).
SHARES = ("all", "backbone", "none")


#: What happens to registered buffers (BatchNorm running statistics …): averaged with the model
#: (``"average"``) or kept on the device and never sent, either direction (``"local"``, FedBN).
BUFFERS = ("average", "local")

#: What ``int()`` / ``float()`` accept. A hyperparameter from the wire is a plain ``object``; it is
#: converted by ``int()`` / ``float()``, whose TypeError/ValueError is the error for a bad value.
IntLike = str | SupportsInt | SupportsIndex
FloatLike = str | SupportsFloat | SupportsIndex


class FeatureModel(Protocol):
    """The model interface of the prototype and distillation methods (FedProto, FPL, FedPAD,
    FedMCP++), met by :class:`~edge_agent.models.LightCNN` and the zoo models: ``features`` float32
    ``[N, C, H, W]`` -> ``[N, feature_dim]``, ``head`` ``[N, feature_dim]`` -> logits
    ``[N, num_classes]``, ``classifier`` the ``Linear(feature_dim, num_classes)`` of the head.
    ``nn.Module`` types its attributes as ``Tensor | Module``; ``typing.cast(FeatureModel, model)``
    names the ones these methods use (no runtime check)."""

    num_classes: int
    feature_dim: int
    classifier: torch.nn.Linear

    def features(self, x: torch.Tensor) -> torch.Tensor: ...

    def head(self, z: torch.Tensor) -> torch.Tensor: ...


def shared_indices(names: Sequence[str], share: str, exclude: Collection[str] = ()) -> tuple[int, ...]:
    """Positions in the model manifest of the tensors an algorithm with ``share`` exchanges.

    Args:
        names: state_dict entry names in manifest order.
        share: one of :data:`SHARES`.
        exclude: entry names that never travel (the model's buffers under ``buffers = "local"``,
            :func:`local_entries`).

    Raises:
        ValueError: unknown ``share``; ``"backbone"`` for a model without ``backbone.*`` entries.
    """
    if share == "all":
        idx = tuple(range(len(names)))
    elif share == "none":
        return ()
    elif share == "backbone":
        idx = tuple(i for i, n in enumerate(names) if n.startswith("backbone."))
        if not idx:
            raise ValueError("share='backbone' needs a model whose feature extractor is named backbone.*")
    else:
        raise ValueError(f"share must be one of {SHARES}, got {share!r}")
    return tuple(i for i in idx if names[i] not in exclude) if exclude else idx


def local_entries(model: torch.nn.Module, buffers: str) -> frozenset[str]:
    """State entry names kept on the device under ``buffers``: every registered buffer of
    ``model`` (BatchNorm ``running_mean``/``running_var``/``num_batches_tracked``) for
    ``"local"``, none for ``"average"``.

    Raises:
        ValueError: ``buffers`` not one of :data:`BUFFERS`.
    """
    if buffers not in BUFFERS:
        raise ValueError(f"buffers must be one of {BUFFERS}, got {buffers!r}")
    return frozenset(n for n, _ in model.named_buffers()) if buffers == "local" else frozenset()


def private_entries(model: torch.nn.Module, share: str, buffers: str = "average") -> tuple[str, ...]:
    """State entry names of ``model`` that the round's global does not overwrite under ``share`` and
    ``buffers`` (:meth:`ClientAlgorithm.load_global`): what a device's model carries from one round
    to the next. None under ``share = "all"`` with averaged buffers; the non-``backbone.*`` entries
    (the personal head) under ``"backbone"``; every entry under ``"none"``; the buffers too under
    ``buffers = "local"``. In state-dict order.

    Raises:
        ValueError: as :func:`shared_indices`.
    """
    names = list(model.state_dict())
    shared = set(shared_indices(names, share, local_entries(model, buffers)))
    return tuple(n for i, n in enumerate(names) if i not in shared)


def shared_arrays(model: torch.nn.Module, share: str, buffers: str = "average") -> tuple[np.ndarray, ...]:
    """Copies (CPU numpy, manifest order) of the state entries exchanged under ``share`` and
    ``buffers``."""
    state = model.state_dict()
    keep = set(shared_indices(list(state), share, local_entries(model, buffers)))
    return tuple(t.detach().to("cpu", copy=True).numpy() for i, t in enumerate(state.values()) if i in keep)


def load_shared(model: torch.nn.Module, arrays: Sequence[np.ndarray], share: str, buffers: str = "average") -> None:
    """Copy the exchanged subset ``arrays`` into ``model`` in place; private entries (and, with
    ``buffers="local"``, the buffers) are kept.

    Raises:
        ModelError: wrong number of tensors for ``share``, or a shape that differs from the model's.
    """
    state = model.state_dict()
    names = list(state)
    idx = shared_indices(names, share, local_entries(model, buffers))
    if len(arrays) != len(idx):
        if len(idx) == len(names):
            raise ModelError(f"{len(arrays)} tensors received, the model has {len(names)}")
        raise ModelError(f"{len(arrays)} tensors received, {len(idx)} expected for share={share!r}"
                         + (", buffers='local'" if buffers == "local" else ""))
    new = {}
    for i, arr in zip(idx, arrays, strict=True):
        ref = state[names[i]]
        if tuple(arr.shape) != tuple(ref.shape):
            raise ModelError(f"tensor {names[i]}: shape {tuple(arr.shape)} received, "
                             f"the model has {tuple(ref.shape)}")
        dtype = ref.detach().cpu().numpy().dtype
        new[names[i]] = torch.from_numpy(np.array(arr, dtype=dtype, copy=True)).to(ref.device)
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
    def from_mapping(cls, base: TrainConfig, overrides: Mapping[str, object]) -> TrainConfig:
        """``base`` with the known keys of ``overrides`` applied (unknown keys are ignored:
        tolerant on the wire).

        Raises:
            ValueError: a known key whose value cannot be used (naming the key and the value): not
                a number (a bool counts as none), not finite, ``local_epochs`` or ``seed`` below 0,
                ``batch_size`` below 1, ``lr`` or ``weight_decay`` below 0, ``momentum`` outside [0, 1).
        """
        kw: dict[str, int | float] = {}

        def number(name: str) -> float:
            value = overrides[name]
            try:
                if isinstance(value, bool):
                    raise TypeError("a bool")
                out = float(cast(FloatLike, value))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"round config {name} = {value!r} is not a number") from exc
            if not math.isfinite(out):
                raise ValueError(f"round config {name} = {value!r} is not finite")
            return out

        lowest = {"local_epochs": 0, "batch_size": 1, "seed": 0}
        for name in ("local_epochs", "batch_size", "seed"):
            if name in overrides:
                v = number(name)
                if v != int(v) or v < lowest[name]:
                    raise ValueError(f"round config {name} = {overrides[name]!r} must be a whole number "
                                     f">= {lowest[name]}")
                kw[name] = int(v)
        for name in ("lr", "momentum", "weight_decay"):
            if name in overrides:
                v = number(name)
                if v < 0 or (name == "momentum" and v >= 1):
                    raise ValueError(f"round config {name} = {overrides[name]!r} must be "
                                     + ("in [0, 1)" if name == "momentum" else ">= 0"))
                kw[name] = v
        return TrainConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, **kw})


@dataclass(frozen=True, slots=True)
class LocalResult:
    """What a client algorithm produced in one round.

    Attributes:
        tensors: model arrays to upload: the subset the algorithm shares (:func:`shared_indices`),
            in model-manifest order; ``()`` for algorithms that share no parameters.
        num_samples: samples trained on (the FedAvg weight).
        train_loss: mean loss over the last local epoch.
        metrics: extra scalars (``train_seconds``, ``train_accuracy`` …; FedMCP++ adds the string
            ``soft_predictions_backend``).
        extras: named non-model arrays to upload (prototypes [C, d] float32 with their class
            ids, soft predictions [P, C], control-variate deltas …).
    """

    tensors: tuple[np.ndarray, ...]
    num_samples: int
    train_loss: float
    metrics: dict[str, float | str] = field(default_factory=dict)
    extras: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StepContext:
    """What the shared local SGD loop (:func:`edge_agent.algorithms.fedavg.sgd_epochs`) tells
    :meth:`ClientAlgorithm.before_step` about the step about to be taken.

    Attributes:
        epoch: local epoch, from 0.
        step: optimizer step within the round, from 0.
        loss: this batch's loss (a detached scalar tensor).
        round: the federated round.
    """

    epoch: int
    step: int
    loss: torch.Tensor
    round: int = 0


class ClientAlgorithm(ABC):
    """The client half of an algorithm: the base every client algorithm subclasses. Every hook the
    agent (:class:`edge_agent.agent.EdgeAgent`) or the shared training loop calls is declared
    here with its default; nothing is found by ``getattr``.

    Class attributes (must equal the server half's, checked by the registry test):

    * ``name``: the registry name.
    * ``share``: which model tensors travel (:data:`SHARES`); ``global_tensors`` and
      :attr:`LocalResult.tensors` hold that subset only.
    * ``buffers``: registered buffers averaged with the model (``"average"``) or kept on the
      device (``"local"``, FedBN; :func:`local_entries`).

    * ``borrows_model``: whether the device's model between rounds is nothing but its state entries
      that :meth:`load_global` does not overwrite (:func:`private_entries`): ``local_round`` keeps
      no reference to the model object, its parameters or modules for a later round, and sets
      nothing on the model beyond its state, training and ``requires_grad`` flags. Then a virtual
      agent of a simulated fleet may keep just those entries (none at all for ``share = "all"``)
      and train on a training slot's working model (:mod:`edge_agent.slots`), with the same
      results. ``False`` (the base's default): the agent keeps its own model. The built-in
      algorithms declare ``True``; a subclass of one that keeps the model object between rounds
      must declare ``False``.

    * ``device_state``: what the device keeps between rounds besides its model, in words
      (``""``: nothing; SCAFFOLD's control variate c_i, FedDyn's gradient state, MOON's previous
      local model). The agent keeps it in the device's state file through
      :meth:`device_state_arrays` and :meth:`load_device_state_arrays` (:mod:`edge_agent.state_store`),
      so a restarted device carries on from it; a class that declares it without overriding
      those starts it afresh on a restart, which the agent and a resumed simulation say
      (:func:`restarted_device_state`).

    One instance serves one device for the whole run and may keep per-device state between
    rounds (as tensors or arrays of its own, never as references to the model it was given).
    """

    name: ClassVar[str] = ""
    share: ClassVar[str] = "all"
    buffers: ClassVar[str] = "average"
    borrows_model: ClassVar[bool] = False
    device_state: ClassVar[str] = ""

    @classmethod
    def setup_kwargs(cls, dataset, params: Mapping[str, object], seed: int) -> dict:
        """Data-dependent constructor arguments (FedMCP++'s public proxy set), called before the
        algorithm is built with the data set, the ``[algorithm]`` table and the run seed.
        Default ``{}``."""
        return {}

    @classmethod
    def eval_split(cls, dataset, params: Mapping[str, object], seed: int):
        """The test samples a device evaluates its own model on (``client_eval``). Default: the
        data set's test split (FedMCP++ removes its proxy set)."""
        return dataset.test

    @abstractmethod
    def local_round(self, model: torch.nn.Module, global_tensors: tuple[np.ndarray, ...], x: torch.Tensor,
                    y: torch.Tensor, config: TrainConfig, *, round: int, client_id: str = "", client_index: int,
                    device: torch.device, params: Mapping[str, object] | None = None,
                    global_extras: Mapping[str, np.ndarray] | None = None) -> LocalResult:
        """One round of local work, called by the agent once it holds the round's ``global`` and
        its ``round_start``.

        Args:
            model: the device's model (on ``device``), trained in place.
            global_tensors: the ``share`` subset of the global model (``()`` for ``"none"``).
            x, y: the local shard, float32 [N, C, H, W] and int64 [N] (CPU).
            config: training settings: ``round_start.config`` and this device's instructions
                over the device's defaults.
            round: the round number.
            client_id: this device's id (the agent's node id).
            client_index: its position in the fleet (seeds private generators).
            device: where to train.
            params: the round's config merged with this device's instructions (the strategy's
                hyperparameters, ``client_eval`` …).
            global_extras: the named arrays of the round's ``global`` (``{}`` when none).

        Returns:
            A :class:`LocalResult`; ``num_samples`` 0 means nothing to send.
        """

    def load_global(self, model: torch.nn.Module, global_tensors: Sequence[np.ndarray]) -> None:
        """Copy the round's ``global_tensors`` into ``model`` in place under this algorithm's
        declared ``share`` and ``buffers`` (:func:`load_shared`): what every ``local_round``
        calls first, so that an algorithm declaring ``buffers = "local"`` keeps its BatchNorm
        statistics without saying so again.

        Raises:
            ModelError: not the tensor count of the declared subset, or a shape that differs.
        """
        load_shared(model, global_tensors, self.share, self.buffers)

    def upload_tensors(self, model: torch.nn.Module) -> tuple[np.ndarray, ...]:
        """The model arrays to upload (:attr:`LocalResult.tensors`): copies of the declared
        ``share`` subset without the buffers under ``buffers = "local"`` (:func:`shared_arrays`),
        manifest order, each in its state dtype."""
        return shared_arrays(model, self.share, self.buffers)

    def before_step(self, model: torch.nn.Module, context: StepContext) -> None:
        """Called by the shared local SGD loop once per batch, after ``backward()`` and before
        ``optimizer.step()``, with true (unscaled) gradients in ``p.grad``, to edit them in place
        (SCAFFOLD's correction, a gradient projection). Default: nothing."""
        return None  # a default hook: nothing to do

    def predict(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Class scores [N, C] for client-side evaluation. Default ``model(x)`` (logits);
        FedProto classifies by the nearest global prototype."""
        return model(x)

    def on_update_receipt(self, round: int, accepted: bool) -> None:
        """The server's definite answer to the update of ``round``: the agent calls it at most
        once per round it trained, with ``accepted=True`` on an accepted receipt and ``False`` on
        a refusal, when nothing was sent (no samples, non-finite result) or when no definite
        receipt came before the next round. Default: nothing (:class:`StateOnReceipt` keeps or
        rolls back per-device state)."""
        return None  # a default hook: nothing to do

    def device_state_arrays(self, *, settled: bool = True) -> dict[str, np.ndarray]:
        """:attr:`device_state` as named numeric arrays (copies), as of the last update the
        server accepted (``settled=False``: after the last local round, whatever the answer to
        its update), for the device's state file (:mod:`edge_agent.state_store`); the
        model's private entries are kept by the agent, not here. Default ``{}``: the algorithm
        keeps nothing beyond its model. An algorithm that declares :attr:`device_state`
        overrides this and :meth:`load_device_state_arrays` (the agent warns when it does not:
        that state would start afresh after a restart)."""
        return {}

    def load_device_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore :meth:`device_state_arrays` (``{}``: the initial state, as before round 1).

        Raises:
            ValueError: ``arrays`` names state this algorithm does not keep.
        """
        if arrays:
            raise ValueError(f"{type(self).__name__} keeps no device state, got {sorted(arrays)}")

    def check_device_state(self, model: torch.nn.Module) -> None:
        """After :meth:`load_device_state_arrays`: whether the loaded state fits ``model`` (the
        device's architecture; only its shapes are read). Default: nothing to check.

        Raises:
            ValueError: the state was kept for another model (says which shapes differ).
        """
        return None  # a default hook: nothing to check

    @classmethod
    def keeps_device_state_on_disk(cls) -> bool:
        """Whether the class can write and read its :attr:`device_state` (it overrides
        :meth:`device_state_arrays` when it declares any)."""
        return not cls.device_state or cls.device_state_arrays is not ClientAlgorithm.device_state_arrays


def step_hook(algorithm: ClientAlgorithm):
    """``algorithm.before_step`` when its class overrides the base's no-op, else ``None``: what
    the local loops pass to :func:`~edge_agent.algorithms.fedavg.sgd_epochs` as ``before_step``
    (so an algorithm without a step hook trains exactly as before, with no fp16 unscale)."""
    return None if type(algorithm).before_step is ClientAlgorithm.before_step else algorithm.before_step


def algorithm_share(algorithm: ClientAlgorithm) -> str:
    """The declared ``share`` of a client algorithm or server strategy."""
    return str(algorithm.share)


def predict_scores(algorithm: ClientAlgorithm, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Class scores [N, C] of ``model`` on ``x`` through the algorithm's :meth:`~ClientAlgorithm.predict`."""
    return algorithm.predict(model, x)


class StateOnReceipt(ClientAlgorithm):
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
        result = super().local_round(*args, round=round, **kw)  # type: ignore[safe-super]  # a mixin: super() is the concrete algorithm after it in the MRO
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

    @abstractmethod
    def state_to_arrays(self, state: object) -> dict[str, np.ndarray]:
        """The state held in :attr:`state_attr` (not ``None``) as named arrays (copies), for the
        device's state file; each algorithm names its own layout (SCAFFOLD ``control``, FedDyn
        ``grad_state.000`` …)."""

    @abstractmethod
    def state_from_arrays(self, arrays: Mapping[str, np.ndarray]) -> object:
        """The inverse of :meth:`state_to_arrays` (``arrays`` not empty).

        Raises:
            ValueError: arrays of another layout.
        """

    def device_state_arrays(self, *, settled: bool = True) -> dict[str, np.ndarray]:
        """The committed state (:attr:`committed_state`; ``settled=False``: the state after the
        last local round) as named arrays; ``{}`` before round 1."""
        state = self.committed_state if settled else getattr(self, self.state_attr)
        return {} if state is None else self.state_to_arrays(state)

    def load_device_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Make ``arrays`` the committed state (``{}``: ``None``, zeros before round 1); a round
        awaiting its answer is dropped with the state it produced.

        Raises:
            ValueError: arrays of another layout than :meth:`state_to_arrays` writes.
        """
        setattr(self, self.state_attr, self.state_from_arrays(arrays) if arrays else None)
        self._unsettled = None


def restarted_device_state(cls: type[ClientAlgorithm], buffers: str | None = None) -> list[str]:
    """What a device of algorithm ``cls`` keeps between rounds and loses when it restarts, one
    phrase per part (``[]``: nothing, as FedAvg: its whole model comes with every global): the
    model entries it never sends (``share`` other than ``"all"``: FedProto's whole model,
    FedPer's head), its BatchNorm statistics under ``buffers = "local"`` (``buffers``: the
    server half's setting, default the class's), and :attr:`ClientAlgorithm.device_state`.
    The agent keeps these in the device's state file (:mod:`edge_agent.state_store`); a resumed
    simulation whose run folder has none (:func:`broker_server.simulate.simulate`) starts them
    again from their initial values and says so."""
    parts = []
    if cls.share == "none":
        parts.append("its whole model (share = 'none': nothing of it leaves the device)")
    elif cls.share != "all":
        parts.append(f"the model entries it never sends (share = {cls.share!r})")
    if (buffers or cls.buffers) == "local":
        parts.append("its BatchNorm statistics (buffers = 'local')")
    if cls.device_state:
        parts.append(cls.device_state)
    return parts
