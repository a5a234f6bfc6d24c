"""Pure aggregation math: arrays and weights in, arrays out (no I/O, no clock, no logging)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class RunningWeightedSum:
    """Streaming weighted mean of lists of arrays: memory is one model, whatever the client count.

    ``add(arrays, w)`` accumulates ``Σ w_k · a_k`` in float64 and ``Σ w_k``; :meth:`mean` returns
    ``Σ w_k a_k / Σ w_k`` cast back to each tensor's dtype.

    Raises:
        ValueError: from :meth:`add` on a negative or non-finite weight or a shape/count mismatch;
            from :meth:`mean` when nothing (or only zero weight) was added.
    """

    def __init__(self) -> None:
        self._sums: list[np.ndarray] | None = None
        self._dtypes: list[np.dtype] = []
        self.total_weight = 0.0
        self.count = 0

    def add(self, arrays: Sequence[np.ndarray], weight: float) -> None:
        """Add ``weight · arrays``; on any error nothing is added (the sum stays consistent)."""
        w = float(weight)
        if not np.isfinite(w) or w < 0:
            raise ValueError(f"weight must be finite and ≥ 0, got {weight}")
        arrs = [np.asarray(a) for a in arrays]
        if self._sums is not None:
            if len(arrs) != len(self._sums):
                raise ValueError(f"{len(arrs)} tensors, expected {len(self._sums)}")
            for i, (s, a, dt) in enumerate(zip(self._sums, arrs, self._dtypes)):
                if s.shape != a.shape:
                    raise ValueError(f"tensor {i}: shape {a.shape} does not match {s.shape}")
                if a.dtype != dt:
                    raise ValueError(f"tensor {i}: dtype {a.dtype} differs from the first client's {dt}")
        else:
            self._sums = [np.zeros(a.shape, dtype=np.float64) for a in arrs]
            self._dtypes = [a.dtype for a in arrs]
        for s, a in zip(self._sums, arrs):
            s += w * a.astype(np.float64, copy=False)
        self.total_weight += w
        self.count += 1

    def mean(self) -> list[np.ndarray]:
        if self._sums is None or self.total_weight <= 0:
            raise ValueError("no weight was added: the weighted mean is undefined")
        return [np.asarray(s / self.total_weight).astype(dt, copy=False) for s, dt in zip(self._sums, self._dtypes)]


def weighted_average(arrays_per_client: Sequence[Sequence[np.ndarray]],
                     weights: Sequence[float] | np.ndarray) -> list[np.ndarray]:
    """FedAvg aggregation: w = Σ_k (n_k / n) · w_k (McMahan et al., AISTATS 2017, Algorithm 1).

    Args:
        arrays_per_client: per client, the same list of arrays (same shapes, manifest order).
        weights: per client, its weight n_k (sample count), ≥ 0, not all zero.

    Returns:
        The weighted mean of each tensor, in the input dtype.

    Raises:
        ValueError: empty input, length mismatch, shape or dtype mismatch, negative/non-finite
            weights or a zero total weight.
    """
    if len(arrays_per_client) == 0:
        raise ValueError("no client results to aggregate")
    if len(arrays_per_client) != len(weights):
        raise ValueError(f"{len(arrays_per_client)} results but {len(weights)} weights")
    acc = RunningWeightedSum()
    for arrays, w in zip(arrays_per_client, weights):
        acc.add(arrays, w)
    return acc.mean()


def all_finite(arrays: Sequence[np.ndarray]) -> bool:
    """True when no array holds NaN or ±Inf (integer arrays are always finite)."""
    return all(not np.issubdtype(np.asarray(a).dtype, np.floating) or bool(np.isfinite(a).all()) for a in arrays)


def select_clients(available: Sequence[str], participation_rate: float, minimum: int,
                   rng: np.random.Generator) -> list[str]:
    """Sample ``max(minimum, round(rate · K))`` of the K available clients without replacement.

    Args:
        available: ids of the clients that can take part (online, joined).
        participation_rate: fraction C of clients per round, in (0, 1].
        minimum: lower bound on the number selected (the quorum), capped at K.
        rng: the server's seeded generator (its state is checkpointed).

    Returns:
        Selected ids, sorted.

    Raises:
        ValueError: rate outside (0, 1].
    """
    if not 0 < participation_rate <= 1:
        raise ValueError(f"participation_rate must be in (0, 1], got {participation_rate}")
    k = len(available)
    m = min(k, max(minimum, int(round(participation_rate * k))))
    if m == k:
        return sorted(available)
    pool = sorted(available)
    picks = rng.choice(k, size=m, replace=False)
    return sorted(pool[i] for i in picks)
