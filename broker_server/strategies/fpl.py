"""FPL, server half (Huang, Ye, Du, CVPR 2023; SPECS.md §6.3; RethinkFL ``models/fpl.py``).

Each round:

* the model: FedAvg, w = Σ_k (n_k / n) w_k (RethinkFL weights by local data size);
* per class c, the prototypes {p_i^c} of the clients that have class c are clustered with
  **FINCH** (Sarfraz, Sharma, Stiefelhagen, "Efficient Parameter-free Clustering Using First
  Neighbor Relations", CVPR 2019) under the cosine distance; each cluster's mean is a
  **cluster prototype** P_c^j and their unweighted mean is the **unbiased prototype**
  P̄_c = (1/J_c) Σ_j P_c^j. A class reported by one client has that prototype as its only
  cluster.

Which FINCH partition: FINCH returns a hierarchy of partitions (first-neighbour graph,
connected components, then the same on the cluster means, until one cluster is left or no
merge happens; the all-in-one partition is never returned). RethinkFL takes the **last**
returned one, ``c[:, -1]``, with ``ensure_early_exit=False`` — the coarsest partition that still
has more than one cluster, or the first partition when that one already has a single cluster
(always the case for two prototypes, which are each other's first neighbour). We do the same.

FINCH is the maintained ``finch-clust`` package (the authors' code on PyPI, MIT). Its
stopping rule drops a level that merges only one cluster where RethinkFL's 2019 copy kept it;
without ``ensure_early_exit`` a level at least halves the cluster count (every cluster is
joined to its first neighbour), so the two rules differ only on a 2 → 1 merge, which both drop:
the partitions agree.

Broadcast extras: ``cluster_protos`` float32 [K, d], ``cluster_classes`` int64 [K] (ascending by
class, then by FINCH's cluster label), ``unbiased_protos`` float32 [C', d],
``unbiased_classes`` int64 [C'] (ascending). Hyperparameter: ``tau`` (InfoNCE temperature, 0.02),
sent to the clients.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from ._base import ClientResult, GlobalUpdate, RoundPlan, fold
from ._registry import register_strategy
from .fedavg import FedAvg, FedAvgAccumulator
from .fedproto import check_prototype_extras


def finch_partition(points: np.ndarray) -> np.ndarray:
    """Cluster labels of the FINCH partition FPL uses (module docstring): the last partition
    FINCH (cosine distance, ``ensure_early_exit=False``) returns.

    Args:
        points: float [n, d], n ≥ 1, finite.

    Returns:
        int64 [n], labels 0 … J−1 (FINCH's numbering: connected components in order of first
        appearance). One point gives ``[0]``.

    Raises:
        ValueError: ``points`` is not a non-empty 2-D array.
    """
    x = np.asarray(points, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] < 1:
        raise ValueError(f"points must be [n >= 1, d], got {x.shape}")
    if x.shape[0] == 1:
        return np.zeros(1, np.int64)
    with warnings.catch_warnings():  # the package warns at import that the optional pynndescent is absent
        warnings.filterwarnings("ignore", message=".*pynndescent.*")
        try:
            from finch.finch import FINCH
        except ImportError as exc:  # the optional extra fedfleet[fpl]
            raise ImportError("FPL's clustering needs the finch-clust package: pip install 'fedfleet[fpl]' "
                              f"({exc})") from exc
    c, _num_clust, _ = FINCH(x, distance="cosine", ensure_early_exit=False, verbose=False)
    return np.asarray(c)[:, -1].astype(np.int64)


def fpl_prototypes(prototypes: Sequence[np.ndarray], classes: Sequence[np.ndarray]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """FPL's cluster and unbiased prototypes from the clients' class prototypes (module docstring).

    Args:
        prototypes: per client, float [k_i, d].
        classes: per client, int [k_i], unique.

    Returns:
        (cluster_protos float32 [K, d], cluster_classes int64 [K], unbiased_protos float32 [C', d],
        unbiased_classes int64 [C']); C' = number of classes reported; empty arrays ([0, 0], [0])
        when nothing was reported.

    Raises:
        ValueError: mismatched lengths or shapes, or prototypes of different widths.
    """
    if len(prototypes) != len(classes):
        raise ValueError(f"{len(prototypes)} prototype arrays but {len(classes)} class arrays")
    by_class: dict[int, list[np.ndarray]] = {}
    dim = None
    for p, c in zip(prototypes, classes, strict=False):
        p, c = np.asarray(p, dtype=np.float32), np.asarray(c)
        if p.ndim != 2 or c.shape != (p.shape[0],):
            raise ValueError(f"prototypes [k, d] with classes [k] expected, got {p.shape} and {c.shape}")
        if p.shape[0] and dim is not None and p.shape[1] != dim:
            raise ValueError(f"prototype width {p.shape[1]} differs from {dim}")
        dim = p.shape[1] if p.shape[0] else dim
        for row, cls in zip(p, c, strict=False):
            by_class.setdefault(int(cls), []).append(row)
    if not by_class:
        e = np.zeros((0, 0), np.float32), np.zeros(0, np.int64)
        return e[0], e[1], e[0].copy(), e[1].copy()
    cluster_protos, cluster_classes, unbiased = [], [], []
    for cls in sorted(by_class):
        pts = np.stack(by_class[cls]).astype(np.float64)
        labels = finch_partition(pts)
        means = np.stack([pts[labels == j].mean(axis=0) for j in np.unique(labels)])
        cluster_protos.append(means)
        cluster_classes += [cls] * means.shape[0]
        unbiased.append(means.mean(axis=0))
    return (np.concatenate(cluster_protos).astype(np.float32), np.asarray(cluster_classes, np.int64),
            np.stack(unbiased).astype(np.float32), np.asarray(sorted(by_class), np.int64))


@register_strategy("fpl")
class FPL(FedAvg):
    """FPL strategy: FedAvg of the model plus FINCH cluster prototypes and unbiased prototypes.

    Args:
        tau: InfoNCE temperature τ > 0 (default 0.02, RethinkFL), sent in ``round_start.config``.
        participation_rate, min_clients, train_config: as :class:`FedAvg`.

    Raises:
        ValueError: ``tau`` not > 0; FedAvg's checks.
    """

    name = "fpl"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()


    def __init__(self, *, tau: float = 0.02, **base: object) -> None:
        super().__init__(**base)  # type: ignore[arg-type]
        if not (np.isfinite(tau) and tau > 0):
            raise ValueError(f"tau must be finite and > 0, got {tau}")
        self.tau = float(tau)
        self.extras: dict[str, np.ndarray] = {}

    def configure_round(self, round: int, available: Sequence[str], rng: np.random.Generator) -> RoundPlan:
        """FedAvg's client selection; ``tau`` added to the round's config."""
        plan = super().configure_round(round, available, rng)
        return RoundPlan(selected=plan.selected, config={**plan.config, "tau": self.tau})

    def validate(self, result: ClientResult) -> str | None:
        """Refuse malformed prototype extras (:func:`~broker_server.strategies.fedproto.check_prototype_extras`):
        the width must be the classifier's input width F and the class ids lie in [0, C), with
        [C, F] the shape of the update's classifier weight (its last 2-D tensor; the model is
        shared, so these are known from round 1 on, before any prototype was broadcast)."""
        head = next((t.shape for t in reversed(result.tensors) if np.ndim(t) == 2), None)
        dim = head[1] if head is not None else (self.extras["cluster_protos"].shape[1] if self.extras else None)
        return check_prototype_extras(result.extras, dim=dim, num_classes=head[0] if head is not None else None)

    def accumulator(self, round: int, current: Sequence[np.ndarray]) -> FPLAccumulator:
        """Streams the model (FedAvg running sums); keeps the round's prototypes (k_i × d floats
        per client) for FINCH at the end."""
        return FPLAccumulator(self)

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        """FedAvg of the models and the new prototypes (the update's ``extras`` and ``state``).
        ``None`` (model and prototypes unchanged) when nothing came back."""
        return fold(self.accumulator(round, current), results)

    def global_extras(self) -> dict[str, np.ndarray]:
        """``cluster_protos``, ``cluster_classes``, ``unbiased_protos``, ``unbiased_classes``;
        ``{}`` before the first aggregation."""
        return dict(self.extras)

    def state_dict(self) -> dict:
        """The last broadcast prototypes (for ``--resume``)."""
        return dict(self.extras)

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.extras = {k: np.asarray(v) for k, v in state.items()}


class FPLAccumulator:
    """One round of :class:`FPL`: FedAvg running sums of the model plus the clients' prototypes;
    :meth:`result` runs :func:`fpl_prototypes` on them in client-id order (FINCH's clusters and
    their means depend on the order of its input, and updates arrive in whatever order the
    devices finish) and returns the new model and broadcast extras, with the metrics
    ``fpl_clusters`` (:func:`fpl_metrics`) for the round that commits them."""

    def __init__(self, strategy: FPL) -> None:
        self.strategy = strategy
        self.model = FedAvgAccumulator(strategy.model_weighting)
        self.uploads: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def add(self, result: ClientResult) -> None:
        self.model.add(result)
        self.uploads[result.client_id] = (np.asarray(result.extras["prototypes"]),
                                          np.asarray(result.extras["proto_classes"]))

    def result(self) -> GlobalUpdate | None:
        if not self.uploads:
            return None
        order = sorted(self.uploads)
        cp, cc, up, uc = fpl_prototypes([self.uploads[c][0] for c in order], [self.uploads[c][1] for c in order])
        extras = {"cluster_protos": cp, "cluster_classes": cc, "unbiased_protos": up,
                  "unbiased_classes": uc} if cc.size else {}
        model = self.model.result()
        return GlobalUpdate(tensors=None if model is None else model.tensors, extras=extras,
                            state={"extras": extras}, metrics=fpl_metrics(extras))


def fpl_metrics(extras: dict[str, np.ndarray]) -> dict:
    """``{"fpl_clusters": {class id (str): J_c}}``, the number of cluster prototypes per class
    in FPL's broadcast ``extras`` (``{}`` when there are none)."""
    if not extras:
        return {}
    cls, n = np.unique(extras["cluster_classes"], return_counts=True)
    return {"fpl_clusters": {str(int(c)): int(k) for c, k in zip(cls, n, strict=False)}}
