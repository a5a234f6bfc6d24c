"""FedPGP, server half: FedAvg of the models and the global prototype pool (SPECS.md §2.2;
the client half and every key's reason: :mod:`edge_agent.algorithms.fedpgp`).

Each round, over the clients that reported (the ``participation_rate`` of those available):

* the model: FedAvg, w = Σ_k (n_k/n)·w_k (the seed: FedPGP is "compatible with existing
  aggregation" and compared with FedAvg);
* the pool, per class c: the mixed prototypes {(π_j, n_j)} of class c uploaded this round
  (concatenated in client-id order, each client's in its upload order) are permuted with a
  generator seeded by ``(pool_seed, round)`` and cut by ``numpy.array_split`` into
  min(G, M_c) groups ("random partition"); group g's pool prototype is the count-weighted mean
  Σ_{j∈g} n_j π_j / Σ_{j∈g} n_j with count Σ_{j∈g} n_j ("sample-size-weighted aggregation").
  So the pool has ≤ G prototypes per class and ≤ C·G·d floats in all. A class nobody uploaded
  this round has no pool prototype next round (the pool is rebuilt each round, as FedProto's
  global prototypes).

``pool_groups`` G = 4 by default (SPECS §2.2's small-scale guess: 4 prototypes per class keep
some intra-class diversity, which the seed says the partition is for, at 4·C·d floats down);
``pool_seed`` (0) seeds the partition. Both are server-only keys; the client keys
(``proto_layer``, ``mix_size``, ``pool_weighting``, ``gp_every``, ``projection``,
``projection_unit``) are checked here and sent in every ``round_start.config``.

Broadcast extras: ``pool_protos`` float32 [P, d], ``pool_classes`` int64 [P] (ascending),
``pool_counts`` int64 [P]. Per-round metrics (``metrics.jsonl``, the round that commits them):
``pgp_pool_size`` (P), ``pgp_pool_bytes`` (the pool's tensor data, 4·P·d + 16·P bytes),
``pgp_mixed_prototypes`` (M uploaded), and, over the clients' ``pgp_*`` counts,
``pgp_projected_share`` = Σ projected / Σ layer-steps and ``pgp_conflict_share`` = Σ conflicts
/ Σ layer-steps (absent before the first pool, when no step met one).

Aggregation buffers the round's prototypes (a deterministic partition needs them all; M ≤
n_k/2 per client, so at most half a shard's representations), the model streams.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from edge_agent.algorithms.fedpgp import (
    MIX_SIZE,
    MIXED_CLASSES,
    MIXED_COUNTS,
    MIXED_PROTOS,
    POOL_CLASSES,
    POOL_COUNTS,
    POOL_GROUPS,
    POOL_PROTOS,
    PGPSettings,
)

from ._base import ClientResult, GlobalUpdate, classifier_shape, fold
from ._registry import register_strategy
from .fedavg import FedAvg, FedAvgAccumulator

if TYPE_CHECKING:
    import torch

MIXED_NAMES = (MIXED_PROTOS, MIXED_CLASSES, MIXED_COUNTS)


def build_pool(protos: np.ndarray, classes: np.ndarray, counts: np.ndarray, groups: int,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The global prototype pool (module docstring) from the round's mixed prototypes.

    Args:
        protos: float [M, d]; classes: int [M]; counts: int [M] (≥ 1), in upload order.
        groups: G ≥ 1, the most pool prototypes per class.
        rng: the partition's generator (one permutation per class, classes ascending).

    Returns:
        (pool float32 [P, d], classes int64 [P] ascending, counts int64 [P]); P = 0 gives
        [0, d], [0], [0].

    Raises:
        ValueError: shapes disagree, G < 1, or a count < 1.
    """
    p = np.asarray(protos, np.float64)
    c = np.asarray(classes).astype(np.int64)
    n = np.asarray(counts).astype(np.int64)
    if p.ndim != 2 or c.shape != (p.shape[0],) or n.shape != (p.shape[0],):
        raise ValueError(f"prototypes [M, d], classes [M], counts [M] expected, got {p.shape}, {c.shape}, {n.shape}")
    if groups < 1:
        raise ValueError(f"pool_groups must be >= 1, got {groups}")
    if n.size and n.min() < 1:
        raise ValueError(f"counts must be >= 1, got {n.min()}")
    out_p, out_c, out_n = [], [], []
    for cls in np.unique(c):
        rows = np.flatnonzero(c == cls)
        for part in np.array_split(rng.permutation(rows), min(groups, rows.size)):
            w = n[part].astype(np.float64)
            out_p.append((w[:, None] * p[part]).sum(axis=0) / w.sum())
            out_c.append(int(cls))
            out_n.append(int(n[part].sum()))
    if not out_p:
        return np.zeros((0, p.shape[1]), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.stack(out_p).astype(np.float32), np.asarray(out_c, np.int64), np.asarray(out_n, np.int64)


@register_strategy("fedpgp")
class FedPGP(FedAvg):
    """FedPGP strategy: FedAvg + the global prototype pool (module docstring).

    Args:
        proto_layer, mix_size, pool_weighting, gp_every, projection, projection_unit: the
            client keys (:mod:`edge_agent.algorithms.fedpgp`), checked here, sent to clients.
        pool_groups: G ≥ 1 (default 4). pool_seed: the partition's seed (int ≥ 0, default 0).
        participation_rate, min_clients, train_config: as :class:`FedAvg`.

    Raises:
        ValueError: a key out of its range.

    State (``state_dict``): the pool. Bound to the server's model (:meth:`bind_model`), class
    ids are checked against its classifier's C.
    """

    name = "fedpgp"
    share = "all"
    buffers = "average"
    model_requirement = "manifest"
    instructions = ()

    def __init__(self, *, proto_layer: str = "", mix_size: int = MIX_SIZE, pool_weighting: str = "count",
                 gp_every: str = "step", projection: str = "conflict", projection_unit: str = "module",
                 pool_groups: int = POOL_GROUPS, pool_seed: int = 0, **kw) -> None:
        super().__init__(**kw)
        client: dict[str, float | int | str] = {
            "proto_layer": proto_layer, "mix_size": mix_size, "pool_weighting": pool_weighting, "gp_every": gp_every,
            "projection": projection, "projection_unit": projection_unit}
        PGPSettings.from_params(client)  # raises ValueError on a bad value
        for key, value in (("pool_groups", pool_groups), ("pool_seed", pool_seed)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "pool_groups" else 0):
                raise ValueError(f"{key} must be an int >= {1 if key == 'pool_groups' else 0}, got {value!r}")
        self.pool_groups, self.pool_seed = pool_groups, pool_seed
        self.train_config.update(client)
        self.pool_protos = np.zeros((0, 0), np.float32)
        self.pool_classes = np.zeros(0, np.int64)
        self.pool_counts = np.zeros(0, np.int64)
        self.num_classes: int | None = None

    def bind_model(self, model: torch.nn.Module) -> None:
        """C from the model's classifier (class ids of uploads are checked against it)."""
        shape = classifier_shape(model)
        self.num_classes = None if shape is None else shape[0]

    def validate(self, result: ClientResult) -> str | None:
        """Refuse an update whose extras are not exactly the mixed prototypes: ``mixed_protos``
        float32 [M, d] finite, ``mixed_classes`` int [M] in [0, C), ``mixed_counts`` int [M] ≥ 1
        summing to at most ``num_samples``; d = the pool's width once a pool exists."""
        if set(result.extras) != set(MIXED_NAMES):
            return f"FedPGP updates carry exactly the extras {list(MIXED_NAMES)}, got {sorted(result.extras)}"
        p, c, n = (np.asarray(result.extras[k]) for k in MIXED_NAMES)
        if p.ndim != 2 or p.dtype != np.float32:
            return f"{MIXED_PROTOS} must be float32 [M, d], got {p.dtype} {p.shape}"
        if c.shape != (p.shape[0],) or n.shape != (p.shape[0],):
            return f"{MIXED_CLASSES} {c.shape} and {MIXED_COUNTS} {n.shape} must both be [{p.shape[0]}]"
        if not (np.issubdtype(c.dtype, np.integer) and np.issubdtype(n.dtype, np.integer)):
            return f"{MIXED_CLASSES} and {MIXED_COUNTS} must be integer arrays, got {c.dtype} and {n.dtype}"
        if c.size and (c.min() < 0 or (self.num_classes is not None and c.max() >= self.num_classes)):
            return f"{MIXED_CLASSES} out of range [0, {self.num_classes}): {sorted(set(c.tolist()))}"
        if n.size and n.min() < 1:
            return f"{MIXED_COUNTS} must be >= 1, got {n.min()}"
        total = sum(int(v) for v in n)
        if total > result.num_samples:
            return f"{MIXED_COUNTS} sum to {total}, more than the update's num_samples {result.num_samples}"
        if p.shape[0] and self.pool_classes.size and p.shape[1] != self.pool_protos.shape[1]:
            return f"mixed prototypes of width {p.shape[1]}, the pool's is {self.pool_protos.shape[1]}"
        if not np.isfinite(p).all():
            return f"{MIXED_PROTOS} holds NaN/Inf"
        return None

    def accumulator(self, round: int, current: Sequence[np.ndarray]) -> FedPGPAccumulator:
        """The model streams (FedAvg); the mixed prototypes are kept for the partition."""
        return FedPGPAccumulator(self, round)

    def aggregate(self, round: int, current: Sequence[np.ndarray],
                  results: Sequence[ClientResult]) -> GlobalUpdate | None:
        """FedAvg of the models and the pool from ``results`` (``None`` when there are none)."""
        return fold(self.accumulator(round, current), results)

    def global_extras(self) -> dict[str, np.ndarray]:
        """The pool (``{}`` before the first aggregation, or when it is empty)."""
        return self.pool_extras(self.pool_protos, self.pool_classes, self.pool_counts)

    @staticmethod
    def pool_extras(protos: np.ndarray, classes: np.ndarray, counts: np.ndarray) -> dict[str, np.ndarray]:
        """``{pool_protos, pool_classes, pool_counts}``, or ``{}`` for an empty pool."""
        if not classes.size:
            return {}
        return {POOL_PROTOS: protos, POOL_CLASSES: classes, POOL_COUNTS: counts}

    def state_dict(self) -> dict:
        return {"pool_protos": self.pool_protos, "pool_classes": self.pool_classes, "pool_counts": self.pool_counts}

    def load_state_dict(self, state: dict) -> None:
        self.pool_protos = np.asarray(state.get("pool_protos", np.zeros((0, 0))), np.float32)
        self.pool_classes = np.asarray(state.get("pool_classes", np.zeros(0)), np.int64)
        self.pool_counts = np.asarray(state.get("pool_counts", np.zeros(0)), np.int64)


class FedPGPAccumulator:
    """One round of :class:`FedPGP`: FedAvg's running sums, the uploaded mixed prototypes by
    client, and the clients' projection counts."""

    def __init__(self, strategy: FedPGP, round: int) -> None:
        self.strategy, self.round = strategy, round
        self.model = FedAvgAccumulator(strategy.model_weighting)
        self.uploads: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.counts = {"pgp_layer_steps": 0.0, "pgp_conflicts": 0.0, "pgp_projected": 0.0}
        self.width: int | None = None

    def add(self, result: ClientResult) -> None:
        """Fold in one update.

        Raises:
            ValueError: its prototypes' width differs from the round's earlier ones (the driver
                refuses the update; nothing of it is kept).
        """
        p, c, n = (np.asarray(result.extras[k]) for k in MIXED_NAMES)
        if p.shape[0]:
            if self.width is not None and p.shape[1] != self.width:
                raise ValueError(f"mixed prototypes of width {p.shape[1]}, this round's are {self.width}")
            self.width = p.shape[1]
        self.model.add(result)
        self.uploads[result.client_id] = (p, c, n)
        for k in self.counts:
            self.counts[k] += float(_number(result.metrics, k))

    def result(self) -> GlobalUpdate | None:
        model = self.model.result()
        if model is None:
            return None
        s = self.strategy
        order = sorted(self.uploads)
        width = self.width or 0
        protos = np.concatenate([self.uploads[k][0].reshape(-1, width) for k in order]) if order else np.zeros((0, 0))
        classes = np.concatenate([self.uploads[k][1] for k in order]).astype(np.int64)
        counts = np.concatenate([self.uploads[k][2] for k in order]).astype(np.int64)
        pool, pool_c, pool_n = build_pool(protos, classes, counts, s.pool_groups,
                                          np.random.default_rng([s.pool_seed, self.round]))
        metrics: dict[str, float | int] = {"pgp_pool_size": int(pool_c.size),
                                           "pgp_pool_bytes": int(pool.size * 4 + pool_c.size * 16),
                                           "pgp_mixed_prototypes": int(classes.size)}
        steps = self.counts["pgp_layer_steps"]
        if steps > 0:
            metrics["pgp_projected_share"] = self.counts["pgp_projected"] / steps
            metrics["pgp_conflict_share"] = self.counts["pgp_conflicts"] / steps
        return GlobalUpdate(tensors=model.tensors, extras=FedPGP.pool_extras(pool, pool_c, pool_n),
                            state={"pool_protos": pool, "pool_classes": pool_c, "pool_counts": pool_n},
                            metrics=metrics)


def _number(metrics: Mapping[str, object], key: str) -> float:
    """``float(metrics[key])`` when it is a finite number ≥ 0, else 0 (a client that did not
    report the count adds nothing)."""
    v = metrics.get(key, 0.0)
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return f if np.isfinite(f) and f >= 0 else 0.0
