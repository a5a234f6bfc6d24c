"""FedProto, server half (Tan et al., AAAI 2022; SPECS.md §6.1; HtFLlib/PFLlib ``serverproto.py``).

Class-wise prototype aggregation: for each class c reported by at least one client,

    P_c = Σ_{i ∈ N_c} w_i^c · p_i^c / Σ_{i ∈ N_c} w_i^c,     N_c = clients that sent class c,

with w_i^c = 1 (``weighting = "uniform"``, the HtFLlib/PFLlib code: an unweighted mean over the
clients having the class) or w_i^c = n_i^c, the client's sample count of class c
(``weighting = "count"``, the paper's formula, which weights by |D_{i,c}|). A class no client
reported in the round has no global prototype in the next one (never a zero row): the global
prototypes are rebuilt from each round's uploads, as in HtFLlib ``serverproto``. The global
prototypes are broadcast as the extras ``prototypes`` float32 [K, d] and ``proto_classes`` int64 [K] (ascending).

``fedproto`` exchanges no model tensors (``share = "none"``); ``fedproto-avg`` (RethinkFL's
FedProto, the variant in FedPAD's comparison) also FedAvg-averages the whole model
(``share = "all"``, weights n_k as in :class:`~broker_server.strategies.fedavg.FedAvg`).
Aggregation streams: per-class running sums, so server memory does not grow with the fleet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..aggregate import RunningWeightedSum
from ._base import ClientResult, GlobalUpdate, RoundPlan, classifier_shape, fold
from ._prototype_net import mean_interclass_cosine
from ._registry import register_strategy
from .fedavg import FedAvg, FedAvgAccumulator

if TYPE_CHECKING:
    import torch

#: How client prototypes of one class are weighted.
WEIGHTINGS = ("uniform", "count")


def check_prototype_extras(extras: Mapping[str, np.ndarray], *, dim: int | None = None,
                           num_classes: int | None = None) -> str | None:
    """Why an update's prototype extras are malformed, or ``None`` when they are fine.

    Expected: exactly ``prototypes`` float [k, d], ``proto_classes`` int [k] (unique, ≥ 0, and
    < ``num_classes`` when given), ``proto_counts`` int [k] (≥ 1), all finite; d = ``dim`` when
    given.
    """
    missing = [n for n in ("prototypes", "proto_classes", "proto_counts") if n not in extras]
    if missing:
        return f"prototype extras missing: {', '.join(missing)}"
    unknown = sorted(set(extras) - {"prototypes", "proto_classes", "proto_counts"})
    if unknown:  # nothing else is read: refused rather than carried (FedPAD buffers whole updates)
        return f"unexpected extras {unknown}: prototype updates carry prototypes, proto_classes, proto_counts"
    p, c, n = (np.asarray(extras[k]) for k in ("prototypes", "proto_classes", "proto_counts"))
    if p.ndim != 2 or not np.issubdtype(p.dtype, np.floating):
        return f"prototypes must be a float [k, d] array, got {p.dtype} {p.shape}"
    if c.shape != (p.shape[0],) or n.shape != (p.shape[0],):
        return f"proto_classes {c.shape} and proto_counts {n.shape} must both be [{p.shape[0]}]"
    if not (np.issubdtype(c.dtype, np.integer) and np.issubdtype(n.dtype, np.integer)):
        return f"proto_classes and proto_counts must be integer arrays, got {c.dtype} and {n.dtype}"
    if c.size and (c.min() < 0 or np.unique(c).size != c.size):
        return f"proto_classes must be unique and >= 0, got {c.tolist()}"
    if num_classes is not None and c.size and c.max() >= num_classes:
        return f"proto_classes out of range [0, {num_classes}): {c.tolist()}"
    if n.size and n.min() < 1:
        return f"proto_counts must be >= 1, got {n.tolist()}"
    if dim is not None and p.shape[0] and p.shape[1] != dim:
        return f"prototype width {p.shape[1]} differs from the global prototypes' {dim}"
    if not np.isfinite(p).all():
        return "prototypes contain NaN or Inf"
    return None


class PrototypeAccumulator:
    """Streaming class-wise weighted mean of client prototypes (the rule of the module docstring).

    Args:
        weighting: ``"uniform"`` (w = 1) or ``"count"`` (w = the client's class count).

    Raises:
        ValueError: unknown ``weighting``; from :meth:`add`, mismatched shapes or widths.
    """

    def __init__(self, weighting: str = "uniform") -> None:
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        self.weighting = weighting
        self._sums: dict[int, RunningWeightedSum] = {}
        self.dim: int | None = None

    def add(self, prototypes: np.ndarray, classes: np.ndarray, counts: np.ndarray | None = None, *,
            weight: float = 1.0) -> None:
        """Fold in one client's prototypes float [k, d], classes int [k] and counts int [k]
        (``counts`` is needed for ``"count"`` weighting only). ``weight`` (≥ 0) multiplies every
        row's weight: a per-client weight such as FedPAD's θ_i, with ``"uniform"``."""
        p = np.asarray(prototypes, dtype=np.float32)
        c = np.asarray(classes).astype(np.int64)
        if p.ndim != 2 or c.shape != (p.shape[0],):
            raise ValueError(f"prototypes [k, d] with classes [k] expected, got {p.shape} and {c.shape}")
        if self.weighting == "count":
            if counts is None or np.asarray(counts).shape != c.shape:
                raise ValueError("count weighting needs proto_counts [k]")
            w = float(weight) * np.asarray(counts, dtype=np.float64)
        else:
            w = np.full(c.shape[0], float(weight))
        if p.shape[0] and self.dim is not None and p.shape[1] != self.dim:
            raise ValueError(f"prototype width {p.shape[1]} differs from the earlier {self.dim}")
        for row, cls, weight in zip(p, c, w, strict=False):
            self._sums.setdefault(int(cls), RunningWeightedSum()).add([row], float(weight))
        if p.shape[0]:
            self.dim = p.shape[1]

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(global prototypes float32 [K, d], classes int64 [K] ascending) over the classes with a
        positive total weight; K = 0 gives shapes [0, 0] and [0]."""
        classes = sorted(c for c, acc in self._sums.items() if acc.total_weight > 0)
        if not classes:
            return np.zeros((0, 0), np.float32), np.zeros(0, np.int64)
        protos = np.stack([self._sums[c].mean()[0] for c in classes]).astype(np.float32)
        return protos, np.asarray(classes, dtype=np.int64)


def aggregate_prototypes(prototypes: Sequence[np.ndarray], classes: Sequence[np.ndarray],
                         counts: Sequence[np.ndarray] | None = None, *,
                         weighting: str = "uniform") -> tuple[np.ndarray, np.ndarray]:
    """FedProto's global prototypes from the clients' (module docstring formula).

    Args:
        prototypes: per client, float [k_i, d].
        classes: per client, int [k_i], unique.
        counts: per client, int [k_i] sample counts (needed for ``weighting="count"``).
        weighting: ``"uniform"`` (HtFLlib code) or ``"count"`` (paper).

    Returns:
        (float32 [K, d], int64 [K] ascending) over the union of the clients' classes.

    Raises:
        ValueError: unknown weighting, mismatched lengths or shapes, missing counts.
    """
    if len(prototypes) != len(classes) or (counts is not None and len(counts) != len(classes)):
        raise ValueError("prototypes, classes and counts need one entry per client")
    acc = PrototypeAccumulator(weighting)
    for i, (p, c) in enumerate(zip(prototypes, classes, strict=False)):
        acc.add(p, c, None if counts is None else counts[i])
    return acc.result()


@register_strategy("fedproto")
class FedProto(FedAvg):
    """FedProto strategy: class-wise prototype aggregation, no model exchange.

    Args:
        lambda_proto: λ of the client loss CE + λ·MSE(z, P_y), ≥ 0 (default 1; HtFLlib's
            scripts use 10); sent to the clients in ``round_start.config``.
        weighting: ``"uniform"`` (default, the code) or ``"count"`` (the paper).
        participation_rate, min_clients, train_config: as :class:`FedAvg`.

    Raises:
        ValueError: ``lambda_proto`` < 0 or not finite; unknown ``weighting``; FedAvg's checks.

    The server binds its model (:meth:`bind_model`): from then on the prototype width d and the
    class count C are the model's, from round 1 on. Unbound, d is the last global prototypes'
    (none in round 1: any width) and class ids are only checked ≥ 0.
    """

    name = "fedproto"
    share = "none"
    buffers = "average"
    model_requirement = "prototype"
    instructions = ()


    def __init__(self, *, lambda_proto: float = 1.0, weighting: str = "uniform", **base: object) -> None:
        super().__init__(**base)  # type: ignore[arg-type]
        if not (np.isfinite(lambda_proto) and lambda_proto >= 0):
            raise ValueError(f"lambda_proto must be finite and >= 0, got {lambda_proto}")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        self.lambda_proto = float(lambda_proto)
        self.weighting = weighting
        self.prototypes = np.zeros((0, 0), np.float32)
        self.proto_classes = np.zeros(0, np.int64)
        self.head: tuple[int, int] | None = None  # (C, d) of the bound model's classifier

    def bind_model(self, model: torch.nn.Module) -> None:
        """Take the class count C and the prototype width d from the model's classifier
        ``[C, d]`` (:func:`~broker_server.strategies._base.classifier_shape`; a model without
        one leaves the strategy unbound). Called by the server before round 1."""
        self.head = classifier_shape(model)

    def configure_round(self, round: int, available: Sequence[str], rng: np.random.Generator) -> RoundPlan:
        """FedAvg's client selection; ``lambda_proto`` added to the round's config."""
        plan = super().configure_round(round, available, rng)
        return RoundPlan(selected=plan.selected, config={**plan.config, "lambda_proto": self.lambda_proto})

    def validate(self, result: ClientResult) -> str | None:
        """Refuse malformed prototype extras (:func:`check_prototype_extras`): width d and class
        ids in [0, C) from the bound model (:meth:`bind_model`), else the width of the last
        global prototypes; and counts that stand for more samples than the update does.

        The client counts every feature it averaged, over all the round's epochs (SPECS §6.1;
        :class:`~edge_agent.algorithms.fedproto.PrototypeClient`), so Σ_c n_i^c =
        num_samples × max(1, E) with E = the ``local_epochs`` this strategy sends; a larger sum
        is refused (with ``weighting = "count"`` it would buy the client the global prototypes).
        No count bound when the strategy sends no ``local_epochs`` (the device's default applies).
        """
        num_classes: int | None
        dim: int | None
        if self.head is not None:
            num_classes, dim = self.head
        else:
            num_classes, dim = None, self.prototypes.shape[1] if self.proto_classes.size else None
        reason = check_prototype_extras(result.extras, dim=dim, num_classes=num_classes)
        epochs = self.train_config.get("local_epochs")
        if reason is None and epochs is not None:
            bound = result.num_samples * max(1, int(epochs))
            total = sum(int(x) for x in np.asarray(result.extras["proto_counts"]))  # Python ints: no int64 wrap
            if total > bound:
                return (f"proto_counts sum to {total}, more than num_samples × local_epochs = "
                        f"{result.num_samples} × {max(1, int(epochs))} = {bound}")
        return reason

    def accumulator(self, round: int, current: Sequence[np.ndarray]) -> FedProtoAccumulator:
        """Streaming aggregation: prototypes by class (and, for ``share = "all"``, FedAvg sums)."""
        return FedProtoAccumulator(self)

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        """Global prototypes from ``results`` (the update's ``extras`` and ``state``) and the new
        shared tensors (``[]`` for ``share = "none"``), or ``None`` when nothing came back (the
        previous global prototypes are kept)."""
        return fold(self.accumulator(round, current), results)

    def global_extras(self) -> dict[str, np.ndarray]:
        """``prototypes`` [K, d] float32 and ``proto_classes`` [K] int64; ``{}`` before the first
        aggregation."""
        if not self.proto_classes.size:
            return {}
        return {"prototypes": self.prototypes, "proto_classes": self.proto_classes}

    def state_dict(self) -> dict:
        """The global prototypes (restored by :meth:`load_state_dict` on ``--resume``)."""
        return {"prototypes": self.prototypes, "proto_classes": self.proto_classes}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (an empty state keeps no prototypes)."""
        self.prototypes = np.asarray(state.get("prototypes", np.zeros((0, 0))), dtype=np.float32)
        self.proto_classes = np.asarray(state.get("proto_classes", np.zeros(0)), dtype=np.int64)


class FedProtoAccumulator:
    """One round of :class:`FedProto`: class-wise prototype sums, plus FedAvg's running weighted
    sum of the model when the strategy shares it. :meth:`result` returns the new global
    prototypes (and model) as one :class:`GlobalUpdate`, whose metrics ``prototype_classes`` (how
    many classes have a global prototype) and ``global_prototype_cosine`` (the mean cosine between
    the global prototypes of different classes, with two or more) are logged for the round that
    commits it."""

    def __init__(self, strategy: FedProto) -> None:
        self.strategy = strategy
        self.protos = PrototypeAccumulator(strategy.weighting)
        self.model = FedAvgAccumulator(strategy.model_weighting) if strategy.share != "none" else None
        self.count = 0

    def add(self, result: ClientResult) -> None:
        e = result.extras
        # prototypes first: their add can refuse the update (a width clash) and adds nothing then;
        # the model's shapes were checked by the server, so once the prototypes are in, it goes in too
        self.protos.add(e["prototypes"], e["proto_classes"], e.get("proto_counts"))
        if self.model is not None:
            self.model.add(result)
        self.count += 1

    def result(self) -> GlobalUpdate | None:
        if not self.count:
            return None
        protos, classes = self.protos.result()
        model = self.model.result() if self.model is not None else GlobalUpdate(tensors=[])
        extras = {"prototypes": protos, "proto_classes": classes} if classes.size else {}
        metrics: dict[str, float | int] = {"prototype_classes": int(classes.size)}
        if classes.size >= 2:
            metrics["global_prototype_cosine"] = mean_interclass_cosine(protos)
        return GlobalUpdate(tensors=None if model is None else model.tensors, extras=extras,
                            state={"prototypes": protos, "proto_classes": classes}, metrics=metrics)


@register_strategy("fedproto-avg")
class FedProtoAvg(FedProto):
    """FedProto as run in RethinkFL and FedPAD's comparison: the same prototype aggregation, and
    the whole model FedAvg-averaged (weights n_k); the server evaluates the global model with its
    head. A separate name because ``share`` is a class attribute."""

    name = "fedproto-avg"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()

