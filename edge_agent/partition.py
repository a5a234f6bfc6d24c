"""Seeded partitioners that split a training set among federated clients.

Every partitioner is a pure function: it reads labels (or a sample count) and a seed and returns
``list[np.ndarray]``, one int64 index array per client, indexing the *train* split. The arrays are
disjoint, each sorted in increasing order, and together they cover every index. Randomness comes
only from ``numpy.random.default_rng(seed)`` created inside the call, so the same arguments give
the same partition on every call and every machine (for a given NumPy version).

Schemes (:func:`partition` dispatches on the name):

- ``"iid"``: :func:`iid`, uniform random shards whose sizes differ by at most one.
- ``"dirichlet"``: :func:`dirichlet`, label skew by per-class Dirichlet proportions
  (Hsu, Qi & Brown 2019, "Measuring the effects of non-identical data distribution for
  federated visual classification", arXiv:1909.06335, Sec. 3; the same redraw-until-
  ``min_samples`` loop as PFLlib ``utils/dataset_utils.py::separate_data``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from edge_agent.errors import PartitionError

__all__ = ["SCHEMES", "describe", "dirichlet", "iid", "partition"]

SCHEMES: tuple[str, ...] = ("dirichlet", "iid")
"""Names accepted by :func:`partition`, sorted."""


def iid(num_samples: int, num_clients: int, *, seed: int) -> list[np.ndarray]:
    """Shuffle ``range(num_samples)`` and cut it into ``num_clients`` near-equal shards.

    Args:
        num_samples: N, number of training samples (>= 1).
        num_clients: K, number of clients, ``1 <= K <= N``.
        seed: seed of ``numpy.random.default_rng`` (int >= 0).

    Returns:
        K int64 arrays, each sorted; sizes are ``N // K`` or ``N // K + 1`` (the first
        ``N % K`` clients get the extra sample); disjoint, covering ``0 .. N-1``.

    Raises:
        PartitionError: N < 1, K < 1, K > N, a non-integer argument, or a negative seed.
    """
    n = _check_int("num_samples", num_samples, minimum=1)
    k = _check_num_clients(num_clients, n)
    rng = _rng(seed)
    order = rng.permutation(n)
    return [np.sort(part).astype(np.int64) for part in np.array_split(order, k)]


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    *,
    alpha: float,
    seed: int,
    min_samples: int = 10,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Label-skewed partition: each class is split among clients by Dirichlet proportions.

    For each class c present in ``labels`` (in increasing order), the class's indices are
    shuffled, proportions ``p ~ Dir(alpha · 1_K)`` are drawn, and the shuffled indices are cut at
    ``floor(cumsum(p)[:-1] · n_c)``: client i gets about ``p_i · n_c`` samples of class c. If any
    client ends with fewer than ``min_samples`` samples the whole draw is repeated (with the same
    generator, so the result stays reproducible), at most ``max_tries`` times. Unlike PFLlib's
    ``separate_data`` no balancing trick (zeroing the proportion of clients already above N/K)
    is applied, so the draw is exactly Hsu et al.'s.

    ``alpha = inf`` is the IID-proportional limit: each class is split as evenly as possible
    (sizes differ by at most one per class) after shuffling, so every client gets nearly the
    global class proportions. Small alpha (0.1) gives each client a few dominant classes.

    Args:
        labels: integer class labels of the train split, shape ``[N]`` (any integer dtype;
            the class ids need not be contiguous).
        num_clients: K, ``1 <= K <= N``.
        alpha: concentration alpha > 0 (float, may be ``math.inf``); not NaN.
        seed: seed of ``numpy.random.default_rng`` (int >= 0).
        min_samples: smallest allowed client size (int >= 0); ``K · min_samples`` must not
            exceed N.
        max_tries: maximum number of draws (int >= 1).

    Returns:
        K int64 arrays, each sorted, disjoint, covering ``0 .. N-1``, each of length
        >= ``min_samples``.

    Raises:
        PartitionError: invalid arguments (as above), or no draw within ``max_tries`` gave every
            client ``min_samples`` samples (the message gives the smallest size reached).
    """
    y = _check_labels(labels)
    n = int(y.shape[0])
    k = _check_num_clients(num_clients, n)
    a = _check_alpha(alpha)
    m = _check_int("min_samples", min_samples, minimum=0)
    tries = _check_int("max_tries", max_tries, minimum=1)
    if k * m > n:
        raise PartitionError(
            f"cannot give each of {k} clients min_samples={m} samples out of {n} "
            f"(needs {k * m}); lower min_samples or num_clients"
        )
    rng = _rng(seed)
    class_members = [np.flatnonzero(y == c) for c in np.unique(y)]

    best = -1
    for _ in range(tries):
        shards: list[list[np.ndarray]] = [[] for _ in range(k)]
        for members in class_members:
            shuffled = rng.permutation(members)
            if math.isinf(a):
                pieces = np.array_split(shuffled, k)
            else:
                proportions = rng.dirichlet(np.full(k, a))
                cuts = (np.cumsum(proportions)[:-1] * shuffled.size).astype(np.int64)
                pieces = np.split(shuffled, cuts)
            for i, piece in enumerate(pieces):
                shards[i].append(piece)
        parts = [np.sort(np.concatenate(s)).astype(np.int64) for s in shards]
        smallest = min(p.size for p in parts)
        if smallest >= m:
            return parts
        best = max(best, smallest)
    raise PartitionError(
        f"dirichlet(alpha={a}) gave no partition of {n} samples over {k} clients with every "
        f"client holding >= {m} samples in {tries} tries (best smallest client: {best}); "
        "raise alpha, lower num_clients or min_samples, or raise max_tries"
    )


def partition(
    labels: np.ndarray,
    num_clients: int,
    *,
    scheme: str,
    seed: int,
    alpha: float | None = None,
    min_samples: int = 10,
) -> list[np.ndarray]:
    """Partition a train split among clients by scheme name.

    Args:
        labels: integer class labels of the train split, shape ``[N]``.
        num_clients: K, ``1 <= K <= N``.
        scheme: one of :data:`SCHEMES` (``"iid"``, ``"dirichlet"``).
        seed: seed of ``numpy.random.default_rng`` (int >= 0).
        alpha: Dirichlet concentration, required for ``"dirichlet"`` and must be None for
            ``"iid"`` (a value there is almost certainly a configuration mistake).
        min_samples: smallest allowed client size. For ``"iid"`` it is checked against
            ``N // K``; for ``"dirichlet"`` it drives the redraw loop of :func:`dirichlet`.

    Returns:
        K sorted, disjoint int64 index arrays covering ``0 .. N-1`` (see :func:`iid`,
        :func:`dirichlet`).

    Raises:
        PartitionError: unknown scheme (the message lists :data:`SCHEMES`), ``alpha`` missing
            or superfluous, or any error of the chosen partitioner.
    """
    y = _check_labels(labels)
    n = int(y.shape[0])
    k = _check_num_clients(num_clients, n)
    if scheme == "iid":
        if alpha is not None:
            raise PartitionError(f"scheme 'iid' takes no alpha (got alpha={alpha!r})")
        m = _check_int("min_samples", min_samples, minimum=0)
        if n // k < m:
            raise PartitionError(
                f"iid: {n} samples over {k} clients gives {n // k} per client, "
                f"below min_samples={m}"
            )
        return iid(n, k, seed=seed)
    if scheme == "dirichlet":
        if alpha is None:
            raise PartitionError("scheme 'dirichlet' needs alpha (> 0, or math.inf)")
        return dirichlet(y, k, alpha=alpha, seed=seed, min_samples=min_samples)
    raise PartitionError(f"unknown partition scheme {scheme!r}; valid: {', '.join(SCHEMES)}")


def describe(
    parts: Sequence[np.ndarray], labels: np.ndarray, num_classes: int
) -> list[dict[str, object]]:
    """Summarise a partition for logging.

    Args:
        parts: K integer index arrays into ``labels`` (as returned by :func:`partition`).
        labels: integer class labels ``[N]``, each in ``[0, num_classes)``.
        num_classes: number of classes C >= 1.

    Returns:
        K dicts ``{"client": i, "samples": n_i, "histogram": [count of class 0, ..., class
        C-1]}`` with Python ints, in client order.

    Raises:
        PartitionError: an index is out of range or not an integer, a label is outside
            ``[0, num_classes)``, or ``num_classes`` < 1.
    """
    y = _check_labels(labels, allow_empty=True)
    c = _check_int("num_classes", num_classes, minimum=1)
    if y.size and (y.min() < 0 or y.max() >= c):
        raise PartitionError(f"labels lie in [{y.min()}, {y.max()}], expected [0, {c})")
    out: list[dict[str, object]] = []
    for i, part in enumerate(parts):
        idx = np.asarray(part)
        if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
            raise PartitionError(f"client {i}: indices must be a 1-D integer array")
        if idx.size and (idx.min() < 0 or idx.max() >= y.size):
            raise PartitionError(f"client {i}: indices must lie in [0, {y.size})")
        hist = np.bincount(y[idx].astype(np.int64), minlength=c)
        out.append({"client": i, "samples": int(idx.size), "histogram": [int(v) for v in hist]})
    return out


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise PartitionError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise PartitionError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_num_clients(num_clients: object, num_samples: int) -> int:
    k = _check_int("num_clients", num_clients, minimum=1)
    if k > num_samples:
        raise PartitionError(
            f"num_clients={k} exceeds the number of samples {num_samples}; "
            "every client needs at least one sample"
        )
    return k


def _check_alpha(alpha: object) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float | np.integer | np.floating):
        raise PartitionError(f"alpha must be a number > 0 (or math.inf), got {alpha!r}")
    a = float(alpha)
    if math.isnan(a) or a <= 0:
        raise PartitionError(f"alpha must be > 0 (or math.inf), got {alpha!r}")
    return a


def _check_labels(labels: object, *, allow_empty: bool = False) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise PartitionError(f"labels must be a 1-D array, got shape {y.shape}")
    if y.size == 0:
        if allow_empty:
            return y.astype(np.int64)
        raise PartitionError("labels is empty: there is nothing to partition")
    if not np.issubdtype(y.dtype, np.integer):
        raise PartitionError(f"labels must have an integer dtype, got {y.dtype}")
    return y


def _rng(seed: object) -> np.random.Generator:
    s = _check_int("seed", seed, minimum=0)
    return np.random.default_rng(s)
