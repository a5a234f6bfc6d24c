"""The strategy interface and the records it exchanges with the server driver."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """What the driver sends for one round.

    Attributes:
        selected: client ids asked to train.
        config: scalars for ``round_start.config`` (local_epochs, lr, …).
    """

    selected: tuple[str, ...]
    config: Mapping[str, float | int | str | bool] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ClientResult:
    """One accepted update.

    Attributes:
        client_id: sender.
        tensors: the shared model arrays (the strategy's ``share`` subset of the manifest, in
            manifest order; already validated: shapes, dtypes, finite; deltas resolved).
        num_samples: the client's sample count n_k (> 0).
        train_loss: the client's reported training loss.
        metrics: the client's other scalars.
        extras: the update's named non-model arrays (finite; checked by the strategy's
            optional ``validate``).
    """

    client_id: str
    tensors: tuple[np.ndarray, ...]
    num_samples: int
    train_loss: float
    metrics: Mapping[str, float | int | str | bool] = field(default_factory=dict)
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)


class Accumulator(Protocol):
    """Collects one round's accepted results as they arrive (streaming aggregation)."""

    def add(self, result: ClientResult) -> None: ...

    def result(self) -> list[np.ndarray] | None: ...


class BufferedAccumulator:
    """For strategies without a streaming rule: keeps the results, calls ``aggregate`` at the end.

    Memory grows with the number of clients; streaming strategies (FedAvg) avoid it.
    """

    def __init__(self, strategy: "Strategy", round: int, current: Sequence[np.ndarray]) -> None:
        self.strategy, self.round, self.current = strategy, round, current
        self.results: list[ClientResult] = []

    def add(self, result: ClientResult) -> None:
        self.results.append(result)

    def result(self) -> list[np.ndarray] | None:
        return self.strategy.aggregate(self.round, self.current, sorted(self.results, key=lambda r: r.client_id))


def _defined_by(cls: type, attr: str) -> type | None:
    return next((k for k in cls.__mro__ if attr in k.__dict__), None)


def accumulator_for(strategy: "Strategy", round: int, current: Sequence[np.ndarray]) -> Accumulator:
    """The strategy's streaming accumulator when it has one, else a :class:`BufferedAccumulator`.

    A streaming ``accumulator`` is used only when the class that defines it also defines the
    strategy's ``aggregate``: a subclass that overrides ``aggregate`` (FedAdam over FedAvg, say)
    without its own ``accumulator`` is aggregated by its own rule, from buffered results.
    """
    make = getattr(strategy, "accumulator", None)
    cls = type(strategy)
    if make is not None and _defined_by(cls, "accumulator") is _defined_by(cls, "aggregate"):
        return make(round, current)
    return BufferedAccumulator(strategy, round, current)


def classifier_shape(model: "torch.nn.Module") -> tuple[int, int] | None:
    """(C, d) of the model's classifier: the shape of its ``classifier.weight`` state entry
    (the light CNN's head ``Linear(d, C)``: C classes, feature width d); ``None`` when the model
    has no 2-D ``classifier.weight``. For :meth:`Strategy.bind_model` implementations."""
    w = model.state_dict().get("classifier.weight")
    if w is None or w.dim() != 2:
        return None
    return int(w.shape[0]), int(w.shape[1])


def parameter_count(model: "torch.nn.Module") -> int:
    """P, the model's trainable parameter count (Σ numel over ``model.parameters()``, the layout of
    flat control variates: :mod:`edge_agent.algorithms.scaffold`). For ``bind_model``."""
    return sum(int(p.numel()) for p in model.parameters())


class Strategy(Protocol):
    """Server half of an algorithm.

    Besides the methods below a strategy may declare ``share`` (``"all"``, ``"backbone"`` or
    ``"none"``: which model tensors travel; ``current`` and every result's ``tensors`` are that
    subset) and define ``global_extras() -> dict[str, ndarray]`` (named arrays broadcast with each
    round's ``global``), ``round_metrics() -> dict`` (merged into the round's ``metrics.jsonl``
    line), ``validate(result) -> str | None`` (a reason to refuse a malformed update),
    ``accumulator(round, current)`` (streaming aggregation), ``skipped_round(round, accumulator)
    -> None`` (called when a round with accepted updates is closed without aggregation for want
    of a quorum, with the round's :class:`Accumulator`, which holds those updates: a strategy
    whose state mirrors per-device state, SCAFFOLD's c or FedDyn's h, takes them into that state,
    since their devices got accepted receipts and kept theirs; the global model stays as it is)
    and ``bind_model(model) -> None``:
    called once by the server (``AggregationServer.__init__``) with its global ``torch.nn.Module``,
    before any round, so that the shapes of shared non-model arrays (a parameter count P, the
    feature width d and class count C of :func:`classifier_shape`) come from the model and are
    never learnt from the first update of round 1; a strategy that was never bound (a unit test)
    keeps its unbound behaviour.
    """

    name: str

    def configure_round(self, round: int, available: Sequence[str], rng: np.random.Generator) -> RoundPlan: ...

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> list[np.ndarray] | None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...
