"""Tests of edge_agent.partition: coverage, disjointness, sizes, skew, seeds, argument checks.

Skew is measured independently with the total-variation distance between a client's class
distribution and the global one, computed here with plain loops over the labels.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_agent import partition as P
from edge_agent.errors import EdgeAgentError, PartitionError

# MANIFEST.md class counts of mnist/train.npz.
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


@pytest.fixture(scope="module")
def mnist_labels() -> np.ndarray:
    """The MNIST train labels (from the shared npz if present, else the same class counts)."""
    here = Path(__file__).resolve().parents[2]
    for folder in (here.parent / "shared" / "data", here / "shared" / "data"):
        path = folder / "mnist" / "train.npz"
        if path.is_file():
            with np.load(path) as z:
                return z["y"]
    rng = np.random.default_rng(123)
    return rng.permutation(np.repeat(np.arange(10), MNIST_TRAIN_COUNTS)).astype(np.int64)


def _check_is_partition(parts: list[np.ndarray], n: int) -> None:
    for part in parts:
        assert part.dtype == np.int64 and part.ndim == 1
        assert np.all(np.diff(part) > 0), "each client's indices are sorted and unique"
    allidx = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    assert allidx.size == n, "disjoint: no index given twice"
    np.testing.assert_array_equal(np.sort(allidx), np.arange(n))


def _tv_distances(parts: list[np.ndarray], labels: np.ndarray, num_classes: int) -> list[float]:
    total = len(labels)
    glob = [sum(1 for v in labels if v == k) / total for k in range(num_classes)]
    out = []
    for part in parts:
        counts = [0] * num_classes
        for v in labels[part]:
            counts[int(v)] += 1
        local = [c / len(part) for c in counts]
        out.append(0.5 * sum(abs(a - b) for a, b in zip(local, glob, strict=True)))
    return out


# ---------------------------------------------------------------------------- iid


@pytest.mark.parametrize(("n", "k"), [(1, 1), (10, 10), (10, 3), (1000, 7), (60000, 100)])
def test_iid_covers_and_balances(n: int, k: int) -> None:
    parts = P.iid(n, k, seed=0)
    assert len(parts) == k
    _check_is_partition(parts, n)
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert sorted(sizes, reverse=True) == [n // k + (1 if i < n % k else 0) for i in range(k)]


def test_iid_seeds() -> None:
    a = P.iid(500, 5, seed=7)
    b = P.iid(500, 5, seed=7)
    c = P.iid(500, 5, seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


@given(n=st.integers(1, 400), k=st.integers(1, 50), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_iid_property(n: int, k: int, seed: int) -> None:
    if k > n:
        with pytest.raises(PartitionError):
            P.iid(n, k, seed=seed)
        return
    parts = P.iid(n, k, seed=seed)
    _check_is_partition(parts, n)
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1


# ---------------------------------------------------------------------------- dirichlet


def test_dirichlet_large_alpha_is_near_global(mnist_labels: np.ndarray) -> None:
    parts = P.dirichlet(mnist_labels, 10, alpha=1e6, seed=0)
    _check_is_partition(parts, len(mnist_labels))
    tv = _tv_distances(parts, mnist_labels, 10)
    assert max(tv) < 0.1


def test_dirichlet_small_alpha_is_skewed(mnist_labels: np.ndarray) -> None:
    parts = P.dirichlet(mnist_labels, 10, alpha=0.1, seed=0)
    _check_is_partition(parts, len(mnist_labels))
    tv = _tv_distances(parts, mnist_labels, 10)
    assert sum(tv) / len(tv) > 0.3
    assert min(p.size for p in parts) >= 10


def test_dirichlet_infinite_alpha_splits_each_class_evenly() -> None:
    labels = np.repeat(np.arange(3), [30, 31, 7])
    labels = np.random.default_rng(1).permutation(labels)
    k = 4
    parts = P.dirichlet(labels, k, alpha=math.inf, seed=3, min_samples=0)
    _check_is_partition(parts, labels.size)
    for c, n_c in enumerate([30, 31, 7]):
        per_client = [int(np.sum(labels[p] == c)) for p in parts]
        assert sum(per_client) == n_c
        assert max(per_client) - min(per_client) <= 1


def test_dirichlet_min_samples_respected(mnist_labels: np.ndarray) -> None:
    binding = 0
    for seed in range(6):
        first = P.dirichlet(mnist_labels, 30, alpha=0.1, seed=seed, min_samples=0)
        binding += min(p.size for p in first) < 50
        parts = P.dirichlet(mnist_labels, 30, alpha=0.1, seed=seed, min_samples=50)
        _check_is_partition(parts, len(mnist_labels))
        assert min(p.size for p in parts) >= 50
    assert binding > 0, "the constraint should have forced a redraw for some seed"


def test_dirichlet_seeds(mnist_labels: np.ndarray) -> None:
    a = P.dirichlet(mnist_labels, 20, alpha=0.5, seed=1)
    b = P.dirichlet(mnist_labels, 20, alpha=0.5, seed=1)
    c = P.dirichlet(mnist_labels, 20, alpha=0.5, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_dirichlet_noncontiguous_labels() -> None:
    labels = np.array([5, 5, 9, 9, 9, 2, 2, 5, 9, 2] * 10)
    parts = P.dirichlet(labels, 3, alpha=1.0, seed=0, min_samples=5)
    _check_is_partition(parts, labels.size)


def test_dirichlet_gives_up_after_max_tries() -> None:
    labels = np.repeat([0, 1], 50)
    with pytest.raises(PartitionError, match="tries"):
        P.dirichlet(labels, 10, alpha=1e-3, seed=0, min_samples=10, max_tries=5)


@given(
    n=st.integers(1, 300),
    k=st.integers(1, 12),
    classes=st.integers(1, 6),
    alpha=st.sampled_from([0.05, 0.5, 5.0, math.inf]),
    seed=st.integers(0, 10_000),
)
@settings(max_examples=60, deadline=None)
def test_dirichlet_property(n: int, k: int, classes: int, alpha: float, seed: int) -> None:
    labels = np.random.default_rng(seed).integers(0, classes, size=n)
    if k > n:
        with pytest.raises(PartitionError):
            P.dirichlet(labels, k, alpha=alpha, seed=seed, min_samples=0)
        return
    parts = P.dirichlet(labels, k, alpha=alpha, seed=seed, min_samples=0)
    assert len(parts) == k
    _check_is_partition(parts, n)


# ---------------------------------------------------------------------------- dispatch & errors


def test_partition_dispatch_matches_direct_calls(mnist_labels: np.ndarray) -> None:
    a = P.partition(mnist_labels, 10, scheme="iid", seed=4)
    b = P.iid(len(mnist_labels), 10, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    c = P.partition(mnist_labels, 10, scheme="dirichlet", seed=4, alpha=0.3)
    d = P.dirichlet(mnist_labels, 10, alpha=0.3, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(c, d, strict=True))


def test_unknown_scheme_lists_valid_ones() -> None:
    with pytest.raises(PartitionError) as info:
        P.partition(np.zeros(20, np.int64), 2, scheme="shards", seed=0)
    assert "iid" in str(info.value) and "dirichlet" in str(info.value)
    assert isinstance(info.value, EdgeAgentError)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"num_clients": 0, "scheme": "iid"}, id="zero_clients"),
        pytest.param({"num_clients": 101, "scheme": "iid", "min_samples": 0}, id="too_many"),
        pytest.param({"num_clients": True, "scheme": "iid"}, id="bool_clients"),
        pytest.param({"num_clients": 2.0, "scheme": "iid"}, id="float_clients"),
        pytest.param({"num_clients": 2, "scheme": "iid", "seed": -1}, id="negative_seed"),
        pytest.param({"num_clients": 2, "scheme": "iid", "alpha": 0.5}, id="iid_with_alpha"),
        pytest.param({"num_clients": 20, "scheme": "iid"}, id="iid_below_min_samples"),
        pytest.param({"num_clients": 2, "scheme": "dirichlet"}, id="missing_alpha"),
        pytest.param({"num_clients": 2, "scheme": "dirichlet", "alpha": 0.0}, id="alpha_zero"),
        pytest.param({"num_clients": 2, "scheme": "dirichlet", "alpha": -1.0}, id="alpha_neg"),
        pytest.param({"num_clients": 2, "scheme": "dirichlet", "alpha": math.nan}, id="alpha_nan"),
        pytest.param(
            {"num_clients": 11, "scheme": "dirichlet", "alpha": 1.0}, id="min_samples_impossible"
        ),
    ],
)
def test_bad_arguments(kwargs: dict[str, object]) -> None:
    labels = np.arange(100) % 4
    kwargs = {"seed": 0, **kwargs}
    with pytest.raises(PartitionError):
        P.partition(labels, **kwargs)  # type: ignore[arg-type]


def test_bad_labels() -> None:
    with pytest.raises(PartitionError):
        P.partition(np.zeros((4, 2), np.int64), 2, scheme="iid", seed=0, min_samples=0)
    with pytest.raises(PartitionError):
        P.partition(np.zeros(4, np.float32), 2, scheme="dirichlet", alpha=1.0, seed=0)
    with pytest.raises(PartitionError):
        P.partition(np.zeros(0, np.int64), 1, scheme="iid", seed=0)
    with pytest.raises(PartitionError):
        P.iid(0, 1, seed=0)


# ---------------------------------------------------------------------------- describe


def test_describe_counts(mnist_labels: np.ndarray) -> None:
    parts = P.partition(mnist_labels, 5, scheme="dirichlet", alpha=0.5, seed=9)
    rows = P.describe(parts, mnist_labels, 10)
    assert [r["client"] for r in rows] == list(range(5))
    assert sum(r["samples"] for r in rows) == len(mnist_labels)  # type: ignore[misc]
    for row, part in zip(rows, parts, strict=True):
        manual = [0] * 10
        for i in part:
            manual[int(mnist_labels[i])] += 1
        assert row["histogram"] == manual and row["samples"] == len(part)
    totals = np.sum([r["histogram"] for r in rows], axis=0).tolist()
    assert totals == MNIST_TRAIN_COUNTS
    with pytest.raises(PartitionError):
        P.describe([np.array([0, 100_000])], mnist_labels, 10)
    with pytest.raises(PartitionError):
        P.describe(parts, mnist_labels, 5)
