"""FedMCP++, server half: an accuracy-weighted teacher of soft predictions and prototypes.

SPECS.md §5.3 [seed]. Each client i uploads its soft predictions ``p_i`` ``[P, C]`` on the public
proxy set and its class prototypes ``P_i`` ``[C, d]`` (``edge_agent/algorithms/fedmcp.py``).
The server, which knows the proxy labels, scores each client by its proxy accuracy
``a_i = mean_n [argmax_c p_i[n, c] = y_n]`` (SPECS §5.2 [guess]: computed here, so nothing extra
is uploaded), and forms

    ω_i = a_i / Σ_j a_j,    p_T = Σ_i ω_i p_i,    P_T = Σ_i ω_i P_i

over the clients that reported in the round. The teacher is broadcast as the extras
``teacher_soft_predictions`` and ``teacher_prototypes`` of the next round's ``global``; no model
tensor ever travels (``share = "none"``). With ``weighting = "uniform"`` the weights are
``ω_i = 1/K`` — the EnsKD baseline (a subclass only needs ``default_weighting = "uniform"``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from edge_agent.algorithms.fedmcp import TEACHER_EXTRAS, UPLOAD_EXTRAS, FedMCPParams, proxy_digest, proxy_sets
from edge_agent.data import PROXY_SIZE, Dataset

from ..aggregate import RunningWeightedSum
from ._base import ClientResult, GlobalUpdate, RoundPlan, classifier_shape, fold
from ._registry import register_strategy
from .fedavg import FedAvg

if TYPE_CHECKING:
    import torch

#: Teacher weightings: ``"accuracy"`` (FedMCP++, ω_i ∝ a_i) and ``"uniform"`` (EnsKD, ω_i = 1/K).
WEIGHTINGS = ("accuracy", "uniform")


def proxy_accuracy(soft_predictions: np.ndarray, proxy_labels: np.ndarray) -> float:
    """a_i: the fraction of proxy samples whose top soft prediction is the label (SPECS §5.2).

    Args:
        soft_predictions: float ``[P, C]``.
        proxy_labels: int ``[P]``.

    Returns:
        A fraction in [0, 1] (argmax ties go to the lowest class index).

    Raises:
        ValueError: shapes disagree or P = 0.
    """
    p = np.asarray(soft_predictions)
    y = np.asarray(proxy_labels)
    if p.ndim != 2 or y.shape != (p.shape[0],) or p.shape[0] == 0:
        raise ValueError(f"soft predictions [P, C] and labels [P] with P > 0 expected, got {p.shape} and {y.shape}")
    return float(np.mean(p.argmax(axis=1) == y))


def teacher_weights(accuracies: Sequence[float], weighting: str = "accuracy") -> np.ndarray:
    """ω_i of the teacher (SPECS §5.3): ``a_i / Σ_j a_j`` for ``"accuracy"``, ``1/K`` for
    ``"uniform"``. When every ``a_j`` is 0 the accuracy weighting is undefined and falls back to
    uniform (every client is equally useless on the proxy set).

    Args:
        accuracies: a_i ∈ [0, 1], one per reporting client, K ≥ 1.
        weighting: one of :data:`WEIGHTINGS`.

    Returns:
        float64 ``[K]``, non-negative, summing to 1.

    Raises:
        ValueError: unknown weighting, K = 0, an accuracy outside [0, 1] or not finite.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    a = np.asarray(accuracies, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError("at least one client accuracy is needed")
    if not np.all(np.isfinite(a)) or np.any(a < 0) or np.any(a > 1):
        raise ValueError(f"accuracies must lie in [0, 1], got {a.tolist()}")
    if weighting == "uniform" or a.sum() == 0:
        return np.full(a.size, 1.0 / a.size)
    return a / a.sum()


@register_strategy("fedmcp")
class FedMCP(FedAvg):
    """FedMCP++ strategy (client selection as :class:`~broker_server.strategies.fedavg.FedAvg`).

    Args:
        participation_rate, min_clients, train_config: as FedAvg.
        proxy_y: the proxy labels, int64 ``[P]`` (from :meth:`setup_kwargs`).
        num_classes: C.
        weighting: one of :data:`WEIGHTINGS`; default :attr:`default_weighting`.
        proxy_size, proxy_seed: the ``[algorithm]`` keys that drew the proxy set
            (:func:`~edge_agent.algorithms.fedmcp.proxy_sets`); checked against ``proxy_y``.
        row_sum_tolerance: largest accepted ``|Σ_c p_i[n, c] − 1|`` of an uploaded row (0.05:
            int8 soft predictions of 10 classes are off by at most 10/254 ≈ 0.039).
        **hyperparameters: the :class:`~edge_agent.algorithms.fedmcp.FedMCPParams` fields
            (``kd``, ``temperature``, ``tau_nce``, ``alpha_proto`` …), sent to the clients in
            every round's config together with ``proxy_size`` and ``proxy_digest``.

    Raises:
        TypeError: an unknown keyword (a typo in ``[algorithm]``).
        ValueError: a bad hyperparameter; labels that are not int64 ``[P]``; ``proxy_size``
            different from P.

    The prototype width d is the bound model's feature width (:meth:`bind_model`, called by the
    server before round 1); unbound, it is the current teacher's (in round 1 any d is accepted).
    """

    name = "fedmcp"
    share = "none"
    buffers = "average"
    model_requirement = "prototype"
    instructions = ()
    #: The client hyperparameters (:class:`~edge_agent.algorithms.fedmcp.FedMCPParams`) come
    #: through ``**hyperparameters`` and are checked by the constructor.
    extra_keys = tuple(FedMCPParams.__dataclass_fields__)
    setup_keys = ("proxy_y", "num_classes")  # from setup_kwargs, not [algorithm] keys
    #: Teacher weighting when the configuration names none (EnsKD: ``"uniform"``).
    default_weighting = "accuracy"
    #: Defaults of :class:`~edge_agent.algorithms.fedmcp.FedMCPParams` that a subclass changes.
    hyperparameter_defaults: Mapping[str, object] = {}

    def __init__(self, *, participation_rate: float = 1.0, min_clients: int = 1,
                 train_config: Mapping[str, float | int | str | bool] | None = None, proxy_y: np.ndarray,
                 num_classes: int, weighting: str | None = None, proxy_size: int = PROXY_SIZE,
                 proxy_seed: int | None = None, row_sum_tolerance: float = 0.05, **hyperparameters: object) -> None:
        super().__init__(participation_rate=participation_rate, min_clients=min_clients, train_config=train_config)
        unknown = set(hyperparameters) - set(FedMCPParams.__dataclass_fields__)
        if unknown:
            known = sorted([*FedMCPParams.__dataclass_fields__, "weighting", "proxy_size", "proxy_seed",
                            "row_sum_tolerance"])
            raise TypeError(f"unknown {self.name} parameter(s): {', '.join(sorted(unknown))}; known: "
                            f"{', '.join(known)}")
        self.params = FedMCPParams.from_mapping(hyperparameters, self.hyperparameter_defaults)
        self.weighting = self.default_weighting if weighting is None else weighting
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if not isinstance(proxy_y, np.ndarray) or proxy_y.dtype != np.int64 or proxy_y.ndim != 1:
            raise ValueError("proxy_y must be an int64 array [P]")
        if proxy_size != len(proxy_y):
            raise ValueError(f"proxy_size = {proxy_size} but the proxy set has {len(proxy_y)} labels")
        if not 0 < row_sum_tolerance < 1:
            raise ValueError(f"row_sum_tolerance must be in (0, 1), got {row_sum_tolerance}")
        self.proxy_y = proxy_y
        self.num_classes = int(num_classes)
        self.proxy_seed = proxy_seed
        self.row_sum_tolerance = float(row_sum_tolerance)
        self.digest = proxy_digest(proxy_y)
        self.teacher_soft: np.ndarray | None = None
        self.teacher_protos: np.ndarray | None = None
        self.feature_dim: int | None = None  # d of the bound model

    def bind_model(self, model: torch.nn.Module) -> None:
        """d = the input width of the model's classifier ``[C, d]``
        (:func:`~broker_server.strategies._base.classifier_shape`; a model without one leaves d
        unbound). Called by the server before round 1.

        Raises:
            ValueError: the classifier has a C other than ``num_classes``.
        """
        head = classifier_shape(model)
        if head is None:
            return
        if head[0] != self.num_classes:
            raise ValueError(f"the model's classifier has {head[0]} classes, the data set {self.num_classes}")
        self.feature_dim = head[1]

    @classmethod
    def setup_kwargs(cls, dataset: Dataset, params: Mapping[str, object], seed: int) -> dict:
        """Data-dependent constructor arguments: the proxy labels and the class count."""
        proxy, _ = proxy_sets(dataset, params, seed)
        return {"proxy_y": proxy.y, "num_classes": dataset.num_classes}

    def configure_round(self, round: int, available: Sequence[str], rng: np.random.Generator) -> RoundPlan:
        """FedAvg's selection; the config adds the hyperparameters, ``proxy_size`` and ``proxy_digest``."""
        plan = super().configure_round(round, available, rng)
        return RoundPlan(selected=plan.selected, config={**plan.config, **self.params.as_config(),
                                                         "proxy_size": len(self.proxy_y), "proxy_digest": self.digest})

    def validate(self, result: ClientResult) -> str | None:
        """A reason to refuse a malformed upload, or None. Checks: no model tensors; exactly
        the extras ``soft_predictions`` ``[P, C]`` (values in [0, 1], each row summing to 1
        within ``row_sum_tolerance``) and ``prototypes`` ``[C, d]`` (d the bound model's feature
        width, else the current teacher's when there is one). Finiteness was checked by the server."""
        if len(result.tensors):
            return f"{self.name} shares no model tensors, got {len(result.tensors)}"
        names = set(result.extras)
        if names != set(UPLOAD_EXTRAS):
            return f"extras must be exactly {sorted(UPLOAD_EXTRAS)}, got {sorted(names)}"
        soft, protos = result.extras["soft_predictions"], result.extras["prototypes"]
        if soft.shape != (len(self.proxy_y), self.num_classes):
            return f"soft_predictions {list(soft.shape)}, expected [{len(self.proxy_y)}, {self.num_classes}]"
        if not np.issubdtype(soft.dtype, np.floating) or not np.issubdtype(protos.dtype, np.floating):
            return "soft_predictions and prototypes must be floating point"
        if soft.min() < 0 or soft.max() > 1:
            return f"soft_predictions must lie in [0, 1], got [{soft.min():g}, {soft.max():g}]"
        err = float(np.abs(soft.sum(axis=1, dtype=np.float64) - 1).max())
        if err > self.row_sum_tolerance:
            return f"soft_predictions rows must sum to 1 (off by up to {err:.4f} > {self.row_sum_tolerance})"
        d = self.feature_dim if self.feature_dim is not None else (
            None if self.teacher_protos is None else self.teacher_protos.shape[1])
        if (protos.ndim != 2 or protos.shape[0] != self.num_classes or protos.shape[1] < 1
                or d not in (None, protos.shape[1])):
            return f"prototypes {list(protos.shape)}, expected [{self.num_classes}, {d or 'd'}]"
        return None

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        """The teacher from ``results`` (in the given order), as the update's ``extras`` and
        ``state``; the model (nothing shared) never changes (``tensors=None``). No results:
        ``None``, the previous teacher is kept."""
        return fold(self.accumulator(round, current), results)

    def accumulator(self, round: int, current: Sequence[np.ndarray]) -> TeacherAccumulator:
        """Streaming form of :meth:`aggregate` (memory: two teachers, whatever the fleet size)."""
        return TeacherAccumulator(self)

    def global_extras(self) -> dict[str, np.ndarray]:
        """``{"teacher_soft_predictions": [P, C], "teacher_prototypes": [C, d]}`` (float32),
        or ``{}`` before the first aggregation."""
        if self.teacher_soft is None or self.teacher_protos is None:
            return {}
        return dict(zip(TEACHER_EXTRAS, (self.teacher_soft, self.teacher_protos), strict=False))

    def state_dict(self) -> dict:
        """The current teacher (for ``--resume``)."""
        return dict(self.global_extras())

    def load_state_dict(self, state: dict) -> None:
        """Restore the teacher saved by :meth:`state_dict` (``{}``: none yet)."""
        if all(name in state for name in TEACHER_EXTRAS):
            self.teacher_soft, self.teacher_protos = (np.asarray(state[n], dtype=np.float32) for n in TEACHER_EXTRAS)
        else:
            self.teacher_soft = self.teacher_protos = None


class TeacherAccumulator:
    """Running sums of one round's uploads: ``Σ a_i·(p_i, P_i)`` and ``Σ (p_i, P_i)``.

    :meth:`result` divides by ``Σ a_i`` (accuracy weighting) or K (uniform weighting, or all
    ``a_i`` = 0) — ``p_T = Σ_i ω_i p_i``, ``P_T = Σ_i ω_i P_i`` with ω of :func:`teacher_weights`
    (SPECS §5.3) — and returns the teacher and the round's metrics as one :class:`GlobalUpdate`:
    ``teacher_weights`` {client: ω_i}, ``client_proxy_accuracy`` {client: a_i} and
    ``teacher_proxy_accuracy`` (argmax p_T vs the proxy labels, a fraction), logged for the round
    that commits it only.
    """

    def __init__(self, strategy: FedMCP) -> None:
        self.strategy = strategy
        self._weighted = RunningWeightedSum()
        self._uniform = RunningWeightedSum()
        self._accuracy: dict[str, float] = {}

    def add(self, result: ClientResult) -> None:
        arrays = [np.asarray(result.extras[n], dtype=np.float32) for n in UPLOAD_EXTRAS]
        a = proxy_accuracy(arrays[0], self.strategy.proxy_y)
        self._uniform.add(arrays, 1.0)
        self._weighted.add(arrays, a)
        self._accuracy[result.client_id] = a

    def result(self) -> GlobalUpdate | None:
        if not self._accuracy:
            return None
        s = self.strategy
        use = self._weighted if s.weighting == "accuracy" and self._weighted.total_weight > 0 else self._uniform
        soft, protos = use.mean()
        omega = teacher_weights(list(self._accuracy.values()), s.weighting)
        metrics = {"teacher_weights": dict(zip(self._accuracy, omega.tolist(), strict=False)),
                   "client_proxy_accuracy": dict(self._accuracy),
                   "teacher_proxy_accuracy": proxy_accuracy(soft, s.proxy_y)}
        return GlobalUpdate(tensors=None, extras=dict(zip(TEACHER_EXTRAS, (soft, protos), strict=False)),
                            state={"teacher_soft": soft, "teacher_protos": protos}, metrics=metrics)
