"""Counting, subsampling and splitting labels: class histograms, the seeded stratified split of
one-file sets, the stratified per-domain cap, and the public proxy split.

Every draw here is seeded (``numpy.random.default_rng``), so the same call gives the same
indices on every machine.
"""

from __future__ import annotations

import functools

import numpy as np

from edge_agent.data._records import ArraySplit, RawSplits, check_label_range, describe_array
from edge_agent.errors import DataError

TEST_FRACTION = 0.2
"""Share of each class put in the test split for sets stored as one file (digits, PACS)."""


SPLIT_SEED = 0
"""Seed of ``numpy.random.default_rng`` for the stratified split of one-file sets."""

_CACHE_SIZE = 8  # proxy splits kept per process


def class_histogram(y: np.ndarray, num_classes: int) -> list[int]:
    """Count the samples of each class.

    Args:
        y: integer labels ``[N]`` (any integer dtype), each in ``[0, num_classes)``.
        num_classes: number of classes K >= 1.

    Returns:
        ``K`` Python ints: entry k is the number of samples with label k (0 for an absent class).

    Raises:
        DataError: ``y`` is not a 1-D integer array, ``num_classes`` < 1, or a label is out of
            range.
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, int | np.integer):
        raise DataError(f"num_classes must be an int, got {num_classes!r}")
    if num_classes < 1:
        raise DataError(f"num_classes must be >= 1, got {num_classes}")
    labels = np.asarray(y)
    if labels.ndim != 1 or (labels.size and not np.issubdtype(labels.dtype, np.integer)):
        raise DataError(f"labels must be a 1-D integer array, got {describe_array(labels)}")
    check_label_range(labels, int(num_classes), where="labels")
    counts = np.bincount(labels.astype(np.int64, copy=False), minlength=int(num_classes))
    return [int(c) for c in counts]


def check_cap(name: str, value: object) -> int:
    """Return ``value`` as an int; :class:`DataError` naming ``name`` unless it is an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise DataError(f"{name} must be an int >= 0 (0 = no cap), got {value!r}")
    return int(value)


def stratified_subsample(y: np.ndarray, cap: int, seed: int = SPLIT_SEED) -> np.ndarray:
    """Indices of a seeded, class-stratified subsample of at most ``cap`` samples.

    Class c (of the ``n_c`` samples among N) gets the quota ``floor(cap · n_c / N)``; the
    ``cap − Σ quotas`` samples left over go one each to the classes with the largest remainders
    ``cap · n_c mod N`` (ties: lower class id first), i.e. the largest-remainder (Hamilton)
    apportionment, so every class keeps its share to within one sample. Then, for each class in
    increasing label order, its indices are permuted with one ``numpy.random.default_rng(seed)``
    and the first quota are kept.

    Args:
        y: integer labels ``[N]``.
        cap: at most this many samples are kept (int >= 0); 0, or ``cap >= N``, keeps all.
        seed: seed of the generator (default :data:`SPLIT_SEED`, so a capped set is fixed).

    Returns:
        int64 ``[min(cap, N)]`` (``[N]`` when ``cap`` is 0) sorted indices into ``y`` (the
        samples keep their file order).

    Raises:
        DataError: ``cap`` is not an int >= 0, or ``y`` is not a 1-D integer array.
    """
    labels = np.asarray(y)
    if labels.ndim != 1 or (labels.size and not np.issubdtype(labels.dtype, np.integer)):
        raise DataError(f"labels must be a 1-D integer array, got {describe_array(labels)}")
    cap = check_cap("cap", cap)
    n = int(labels.size)
    if cap == 0 or cap >= n:
        return np.arange(n, dtype=np.int64)
    classes, counts = np.unique(labels, return_counts=True)
    quota = cap * counts // n
    remainder = cap * counts % n
    left = cap - int(quota.sum())
    quota[np.argsort(-remainder, kind="stable")[:left]] += 1
    rng = np.random.default_rng(seed)
    keep = [rng.permutation(np.flatnonzero(labels == c))[:q] for c, q in zip(classes, quota, strict=True)]
    return np.sort(np.concatenate(keep)).astype(np.int64)


def stratified_split(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The fixed 80/20 split of a one-file set (digits, PACS), as the docstring of
    :mod:`edge_agent.data` writes it: per class in increasing label order, the class's indices
    permuted by one ``numpy.random.default_rng(SPLIT_SEED)``, the first
    ``floor(TEST_FRACTION · n_class + 0.5)`` to test.

    Returns:
        ``(train, test)``: sorted int64 indices into ``y``, disjoint, together all of it.
    """
    rng = np.random.default_rng(SPLIT_SEED)
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for label in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == label))
        n_test = int(np.floor(TEST_FRACTION * members.size + 0.5))
        test.append(members[:n_test])
        train.append(members[n_test:])
    tr = np.sort(np.concatenate(train)).astype(np.int64) if train else np.zeros(0, np.int64)
    te = np.sort(np.concatenate(test)).astype(np.int64) if test else np.zeros(0, np.int64)
    return tr, te


def split_whole(x: np.ndarray, y: np.ndarray) -> RawSplits:
    """``(x_train, y_train, x_test, y_test)`` of a one-file set by :func:`stratified_split`
    (``x`` ``[N, ...]`` and ``y`` ``[N]``, indexed, so the samples keep their file order)."""
    tr, te = stratified_split(y)
    return x[tr], y[tr], x[te], y[te]


PROXY_SIZE = 1000
"""Default size of the public proxy set (FedMCP++, SPECS.md §5.2: 1000 test samples)."""


def proxy_split(test: ArraySplit, size: int = PROXY_SIZE, seed: int = 0) -> tuple[ArraySplit, ArraySplit]:
    """Split a test split into a public proxy set and the rest (the samples left to evaluate on).

    The proxy set of knowledge-exchange methods (FedMCP++, EnsKD; SPECS.md §5.2: "1000 random
    samples from the dataset's test split, shared and labelled; evaluation should exclude them")
    is drawn here so that the server and every agent derive the same one from the same seed.

    Draw: ``numpy.random.default_rng(seed).permutation(N)``; its first ``size`` entries, sorted,
    are the proxy indices, the other ``N − size``, sorted, the rest. The draw is uniform, **not
    stratified** (the seed says "random samples"): a class may be under-represented or, for a
    tiny ``size``, absent from the proxy set. Both parts keep the split's file order. The two
    index sets are disjoint and together cover the split exactly once.

    Results are cached per ``(test, size, seed)`` (by the identity of ``test``: loaded data
    sets are themselves cached), so the many virtual agents of one process share one copy; the
    arrays returned are read-only, like those of :func:`load_dataset` (take ``np.array(...)``
    for a writable copy).

    Args:
        test: the split to draw from (normally ``Dataset.test``), N samples.
        size: samples in the proxy set P, ``1 <= size < N`` (something must be left to
            evaluate on).
        seed: seed of the draw (the run seed unless the configuration names another).

    Returns:
        ``(proxy, rest)``: :class:`ArraySplit` s with ``x`` float32 ``[P, C, H, W]`` and
        ``[N − P, C, H, W]``, ``y`` int64 ``[P]`` and ``[N − P]``, the same ``num_classes``.

    Raises:
        DataError: ``test`` is not an :class:`ArraySplit`; ``size`` or ``seed`` is not an int;
            ``size`` is outside ``[1, N)``; ``seed`` is negative.
    """
    if not isinstance(test, ArraySplit):
        raise DataError(f"proxy_split needs an ArraySplit, got {type(test).__name__}")
    for name, value in (("size", size), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise DataError(f"proxy_split: {name} must be an int, got {value!r}")
    if not 1 <= size < len(test):
        raise DataError(
            f"proxy_split: size must be in [1, {len(test)}) for a split of {len(test)} samples "
            f"(the rest is the evaluation set), got {size}"
        )
    if seed < 0:
        raise DataError(f"proxy_split: seed must be >= 0, got {seed}")
    return _proxy_split_cached(test, int(size), int(seed))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _proxy_split_cached(test: ArraySplit, size: int, seed: int) -> tuple[ArraySplit, ArraySplit]:
    perm = np.random.default_rng(seed).permutation(len(test))
    parts = []
    for idx in (np.sort(perm[:size]), np.sort(perm[size:])):
        part = test.subset(idx)
        part.x.flags.writeable = False
        part.y.flags.writeable = False
        parts.append(part)
    return parts[0], parts[1]


def clear_proxy_cache() -> None:
    """Drop every proxy split cached by :func:`proxy_split`."""
    _proxy_split_cached.cache_clear()
