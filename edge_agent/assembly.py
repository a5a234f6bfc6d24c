"""One agent assembly, for the real device (``fedfleet-agent``) and every virtual agent of
``fedfleet simulate``: from an :class:`AgentSpec` (who the device is, which shard, algorithm and
model) and a loaded data set to a ready :class:`~edge_agent.agent.EdgeAgent`.

Two steps, so that a real device finds bad data or settings before it connects to a broker:

1. :func:`prepare_agent` — the shard (the seeded partition every device and the server compute
   alike), the model (:func:`edge_agent.models.make_model`, initialised from ``seed + 1 + shard``),
   the client algorithm with its data-dependent setup, the evaluation split and the ``join.info``
   announcement (data, algorithm, model name, ``feature_dim``, ``num_classes``, domain).
2. :func:`build_agent` — the :class:`EdgeAgent` on a connected channel.

Also the two things both callers need around the channel: :func:`offline_will` (the retained
``offline`` status the broker publishes when the link drops) and :func:`channel_limits` (chunk
and packet sizes fitted to the firmware profile). This module never imports ``broker_server``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from .errors import EdgeAgentError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from protocol.channel import Channel
    from protocol.security import ChannelSecurity
    from protocol.transport import Will

    from .agent import EdgeAgent
    from .algorithms import ClientAlgorithm, LocalResult, TrainConfig
    from .data import ArraySplit, Dataset
    from .partition import ClientSplits
    from .runtime import AgentRuntime
    from .slots import TrainingSlots
    from .state_store import DeviceStateStore

__all__ = ["AgentSpec", "PreparedAgent", "build_agent", "channel_limits", "offline_will", "prepare_agent"]

_FULL_TEST = object()


@dataclass(frozen=True)
class AgentSpec:
    """Everything that decides one agent, whether a device or a virtual one.

    Attributes:
        client_id: the device's id (A-Za-z0-9_.-, at most 64 characters).
        shard, shards: shard ``i`` of the ``n``-way partition (``0 <= i < n``; ``n`` is the
            server's ``[data] clients``).
        dataset, partition, alpha, min_samples, train_samples, domain_clients,
        domain_train_cap, domain_test_cap, client_test, client_test_fraction, seed: the server's
            ``[data]`` settings and ``[run] seed`` (announced in the join; the server refuses a
            mismatch).
        algorithm, algorithm_params: ``[train] algorithm`` and the ``[algorithm]`` table.
        model: zoo name or ``"package.module:function"`` of this device's architecture.
        feature_dim: the agreed prototype width d (``[model] feature_dim``).
        idle_timeout_s: give up after this many seconds without a message from the server.
        info: further scalars for ``join.info`` (``virtual``, ``torch`` …).

    Raises:
        ValueError: a shard outside ``0 <= i < n``, or a non-positive ``feature_dim``.
    """

    client_id: str
    shard: int
    shards: int
    dataset: str = "mnist"
    partition: str = "iid"
    alpha: float = 0.5
    min_samples: int = 10
    train_samples: int = 0
    domain_clients: str = ""
    domain_train_cap: int = 0
    domain_test_cap: int = 0
    client_test: str = "shared"
    client_test_fraction: float = 0.25
    seed: int = 0
    algorithm: str = "fedavg"
    algorithm_params: Mapping[str, Any] = field(default_factory=dict)
    model: str = "lightcnn"
    feature_dim: int = 64
    idle_timeout_s: float = 3600.0
    info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.shard < self.shards:
            raise ValueError(f"shard {self.shard}/{self.shards}: need 0 <= i < n")
        if self.feature_dim < 1:
            raise ValueError(f"feature_dim must be >= 1, got {self.feature_dim}")

    def announcement(self) -> dict[str, str]:
        """The data and algorithm part of ``join.info`` (:func:`edge_agent.agent.data_announcement`)."""
        from .agent import data_announcement

        return data_announcement(dataset=self.dataset, partition=self.partition, alpha=self.alpha, seed=self.seed,
                                 shards=self.shards, min_samples=self.min_samples, train_samples=self.train_samples,
                                 domain_clients=self.domain_clients, domain_train_cap=self.domain_train_cap,
                                 domain_test_cap=self.domain_test_cap, algorithm=self.algorithm,
                                 algorithm_params=dict(self.algorithm_params), client_test=self.client_test,
                                 client_test_fraction=self.client_test_fraction)

    def load_dataset(self, data_dir: str | None = None) -> Dataset:
        """The spec's data set (:func:`edge_agent.data.load_dataset` with its domain caps).

        Raises:
            DataError: the data set cannot be found or read.
        """
        from .data import load_dataset

        return load_dataset(self.dataset, data_dir=data_dir, domain_train_cap=self.domain_train_cap,
                            domain_test_cap=self.domain_test_cap)

    def client_splits(self, ds: Dataset) -> ClientSplits:
        """Every shard's training indices and, under ``client_test = "local"``, its held-out
        local test set (:func:`edge_agent.partition.client_splits`): the same seeded split on
        every device and on the server.

        Raises:
            PartitionError: the partition or the hold-out is impossible for the data.
        """
        from .partition import client_splits

        return client_splits(ds, self.shards, client_test=self.client_test,
                             client_test_fraction=self.client_test_fraction, scheme=self.partition, seed=self.seed,
                             alpha=self.alpha, min_samples=self.min_samples, train_samples=self.train_samples,
                             domain_clients=self.domain_clients)

    def split(self, ds: Dataset) -> list[np.ndarray]:
        """Every shard's training indices (:meth:`client_splits`: under ``client_test =
        "local"`` without the held-out test samples).

        Raises:
            PartitionError: the partition is impossible for the data.
        """
        return self.client_splits(ds).train


@dataclass
class PreparedAgent:
    """What :func:`prepare_agent` made: all of an agent but its channel.

    Attributes:
        spec: the spec.
        dataset: the loaded data set.
        indices: the shard's training indices, int64 ``[n_i]``.
        model: the device model (float32, CPU, training mode).
        algorithm: the client algorithm.
        eval_split: the split the device evaluates its own model on, or ``None``.
        info: ``join.info`` scalars (spec info, data/algorithm announcement, model, domain).
    """

    spec: AgentSpec
    dataset: Dataset
    indices: np.ndarray
    model: torch.nn.Module
    algorithm: ClientAlgorithm
    eval_split: ArraySplit | None
    info: dict[str, Any]


def prepare_agent(spec: AgentSpec, dataset: Dataset, *, precision: str = "fp32", indices: np.ndarray | None = None,
                  eval_split: Any = _FULL_TEST) -> PreparedAgent:
    """Everything of the agent that needs no broker.

    Args:
        spec: the agent's spec.
        dataset: the loaded data set (``spec.load_dataset()``).
        precision: the device plan's precision (``"fp32"`` / ``"fp16"``) for the client algorithm.
        indices: the shard's training indices when the caller already split (a simulated fleet
            splits once); ``None``: ``spec.client_splits(dataset)``'s of ``spec.shard``.
        eval_split: the device's evaluation split; by default, under ``spec.client_test =
            "local"`` its held-out local test set (``dataset.train`` at
            ``spec.client_splits(dataset).test[spec.shard]``), else the algorithm's
            (:func:`edge_agent.algorithms.evaluation_split`: the test split minus what it reserves).

    Returns:
        The prepared agent. The model is made first, from ``torch.manual_seed(seed + 1 + shard)``,
        then the algorithm (whose own modules draw from the global RNG after it).

    Raises:
        DataError, PartitionError: the shard cannot be drawn.
        ModelError: the model is unknown or does not fit (:func:`edge_agent.models.make_model`).
        EdgeAgentError, TypeError, ValueError: an unknown algorithm or an ``[algorithm]`` value it refuses.
    """
    from .algorithms import algorithm_setup, build_client_algorithm, evaluation_split
    from .models import make_model

    need_splits = indices is None or (eval_split is _FULL_TEST and spec.client_test == "local")
    splits = spec.client_splits(dataset) if need_splits else None
    if indices is None:
        assert splits is not None
        indices = splits.train[spec.shard]
    idx = np.asarray(indices)
    params = dict(spec.algorithm_params)
    setup = algorithm_setup(spec.algorithm, dataset, params, spec.seed)
    if eval_split is not _FULL_TEST:
        evals = eval_split
    elif splits is not None and splits.test is not None:
        evals = dataset.train.subset(splits.test[spec.shard])
    else:
        evals = evaluation_split(spec.algorithm, dataset, params, spec.seed)
    model = make_model(spec.model, in_channels=dataset.channels, image_size=dataset.image_size,
                       num_classes=dataset.num_classes, feature_dim=spec.feature_dim, seed=spec.seed + 1 + spec.shard)
    algorithm = build_client_algorithm(spec.algorithm, precision=precision, setup=setup)
    info: dict[str, Any] = {**dict(spec.info), **spec.announcement(),
                            "model": spec.model, "feature_dim": int(spec.feature_dim),
                            "num_classes": int(dataset.num_classes)}
    domains = getattr(dataset, "train_domains", None)
    if domains is not None and len(idx):
        info["domain"] = "+".join(dataset.domain_names[d] for d in np.unique(np.asarray(domains)[idx]))
    return PreparedAgent(spec=spec, dataset=dataset, indices=idx, model=model, algorithm=algorithm,
                         eval_split=evals, info=info)


def build_agent(prepared: PreparedAgent, channel: Channel, *, runtime: AgentRuntime,
                train_defaults: TrainConfig | None = None, device: torch.device | None = None,
                train_lock: threading.Semaphore | threading.Lock | None = None, emulate_link: bool = False,
                on_trained: Callable[[int, LocalResult, int], None] | None = None,
                slots: TrainingSlots | None = None, state_store: DeviceStateStore | None = None,
                receipt_timeout_s: float = 10.0, max_resends: int = 3,
                round_start_wait_s: float = 10.0) -> EdgeAgent:
    """The :class:`~edge_agent.agent.EdgeAgent` of a prepared agent on ``channel``.

    Args:
        prepared: from :func:`prepare_agent`.
        channel: the agent's channel (connected transport, its ledger and security).
        runtime: the firmware profile resolved against the hardware
            (:func:`edge_agent.runtime.agent_runtime`); its join info is announced.
        train_defaults: local training settings until a ``round_start`` says otherwise; default
            ``TrainConfig(seed=spec.seed, batch_size=the plan's batch size)``.
        device: where the model trains (a real device: ``runtime.plan.device``); ``None``: CPU.
        train_lock: a semaphore shared by agents that must not train at once (a simulated fleet).
        emulate_link: make every transfer take the time the profile's link needs.
        on_trained: called after each local round with ``(round, result, bytes sent)``.
        slots: a simulated fleet's training slots (:mod:`edge_agent.slots`): the agent trains on
            their threads, and on their working model when its algorithm declares
            ``borrows_model`` (the prepared model is then given up after its private entries are
            copied).
        state_store: the device's state file (:class:`~edge_agent.agent.EdgeAgent`'s
            ``state_store``): what it keeps between rounds survives a restart.
        receipt_timeout_s: seconds after the broker acknowledged an update's last copy before,
            without a receipt, it is sent again (``fedfleet-agent --receipt-timeout-s``).
        max_resends: at most this many such re-sends (``fedfleet-agent --max-resends``).
        round_start_wait_s: seconds holding a round's global without its ``round_start`` before
            asking the server for it (``fedfleet-agent --round-start-wait-s``; the agent's
            :data:`~edge_agent.agent.ROUND_START_WAIT_S`).

    Raises:
        ValueError: ``round_start_wait_s`` is not > 0.
    """
    from .agent import EdgeAgent
    from .algorithms import TrainConfig

    spec, ds, idx = prepared.spec, prepared.dataset, prepared.indices
    if train_defaults is None:
        train_defaults = TrainConfig(seed=spec.seed, batch_size=runtime.plan.batch_size)
    evals = prepared.eval_split
    return EdgeAgent(channel=channel, model=prepared.model, algorithm=prepared.algorithm,
                     eval_x=None if evals is None else evals.x, eval_y=None if evals is None else evals.y,
                     x=ds.train.x, y=ds.train.y, indices=idx, num_classes=ds.num_classes,
                     train_defaults=train_defaults, client_index=spec.shard, profile=runtime.profile.name,
                     device=device, runtime=runtime, emulate_link=emulate_link, train_lock=train_lock,
                     idle_timeout_s=spec.idle_timeout_s, info=dict(prepared.info), on_trained=on_trained,
                     slots=slots, state_store=state_store, receipt_timeout_s=receipt_timeout_s,
                     max_resends=max_resends,
                     round_start_wait_s=round_start_wait_s)


def offline_will(federation: str, client_id: str, security: ChannelSecurity | None = None) -> Will:
    """The MQTT last will of an agent: its retained ``offline`` status (QoS 1), sealed with the
    agent's keys when it signs.

    Raises:
        EdgeAgentError: the ids are not valid topic levels.
    """
    from protocol import topics
    from protocol.messages import Envelope, Status, encode, valid_id
    from protocol.transport import Will

    if not valid_id(client_id) or not valid_id(federation):
        raise EdgeAgentError("the client id and federation must be 1-64 chars of A-Za-z0-9_.-")
    topic = topics.status(federation, client_id)
    payload = encode(Envelope(round=0, sender=client_id, seq=0, body=Status("offline", "connection lost"))).payload
    if security is not None:
        payload = security.seal(topic, payload).payload
    return Will(topic, payload, qos=1, retain=True)


class ChannelLimits(TypedDict):
    """Keyword arguments of :class:`~protocol.channel.Channel` set by :func:`channel_limits` (bytes)."""

    chunk_bytes: int
    max_packet_bytes: int


def channel_limits(runtime: AgentRuntime, *, chunk_bytes: int = 0, max_packet_bytes: int = 0) -> ChannelLimits:
    """``chunk_bytes`` and ``max_packet_bytes`` (bytes) for an agent's channel: the configured
    ones (0 = none given) but never above the firmware profile's."""
    return ChannelLimits(chunk_bytes=min(chunk_bytes or runtime.chunk_bytes, runtime.chunk_bytes),
                         max_packet_bytes=min(max_packet_bytes or runtime.max_packet_bytes, runtime.max_packet_bytes))
