"""Local test sets held out of each client's shard (``[data] client_test = "local"``): per-class
round-half-up counts worked out by hand, disjoint from training, seeded per (seed, client), and
the same through the assembly a device uses."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.assembly import AgentSpec, prepare_agent
from edge_agent.data import load_dataset
from edge_agent.errors import PartitionError
from edge_agent.partition import client_splits, hold_out_local_tests, split_dataset

# one client's shard: class 0 ×2, 1 ×6, 2 ×5, 3 ×1, 4 ×4 (18 samples), interleaved with other labels
LABELS = np.array([0, 9, 1, 1, 2, 1, 3, 2, 1, 4, 0, 2, 4, 1, 2, 4, 9, 1, 2, 4, 9])
SHARD = np.flatnonzero(LABELS != 9)


@pytest.mark.parametrize("fraction, want", [
    # t_c = min(floor(f·n_c + 1/2), n_c − 1): f = 0.25 → 0.5→1, 1.5→2, 1.25→1, 0.25→0, 1.0→1
    (0.25, {0: 1, 1: 2, 2: 1, 3: 0, 4: 1}),
    # f = 0.5 → 1.0→1, 3.0→3, 2.5→3 (half up), 0.5→1 capped at n_c − 1 = 0, 2.0→2
    (0.5, {0: 1, 1: 3, 2: 3, 3: 0, 4: 2}),
])
def test_the_held_out_counts_per_class_are_rounded_half_up(fraction: float, want: dict[int, int]) -> None:
    (train,), (test,) = hold_out_local_tests(LABELS, [SHARD], fraction=fraction, seed=4)
    got = {c: int((LABELS[test] == c).sum()) for c in range(5)}
    assert got == want
    counts = {0: 2, 1: 6, 2: 5, 3: 1, 4: 4}
    assert {c: int((LABELS[train] == c).sum()) for c in range(5)} == {c: counts[c] - want[c] for c in counts}
    assert np.intersect1d(train, test).size == 0
    assert np.array_equal(np.sort(np.concatenate([train, test])), SHARD)
    assert np.array_equal(train, np.sort(train)) and np.array_equal(test, np.sort(test))
    assert train.dtype == test.dtype == np.int64


def test_a_clients_draw_depends_only_on_the_seed_and_its_own_shard() -> None:
    y = np.repeat(np.arange(4), 40)
    a, b, c = np.arange(0, 160, 2), np.arange(1, 160, 4), np.arange(3, 160, 4)
    one = hold_out_local_tests(y, [a, b], fraction=0.25, seed=7)
    two = hold_out_local_tests(y, [a, c], fraction=0.25, seed=7)
    again = hold_out_local_tests(y, [a, b], fraction=0.25, seed=7)
    assert np.array_equal(one[1][0], two[1][0])  # client 0 is not moved by client 1's shard
    assert all(np.array_equal(p, q) for p, q in zip(one[1], again[1], strict=True))
    other = hold_out_local_tests(y, [a, b], fraction=0.25, seed=8)
    assert not np.array_equal(one[1][0], other[1][0])
    # 80 samples of client 0 = 20 per class: 5 of each held out
    assert np.bincount(y[one[1][0]]).tolist() == [5, 5, 5, 5]


def test_bad_fractions_and_empty_local_tests_are_refused() -> None:
    for bad in (0.0, 1.0, -0.1, True, "0.25"):
        with pytest.raises(PartitionError, match="fraction must be a number in"):
            hold_out_local_tests(LABELS, [SHARD], fraction=bad, seed=0)  # type: ignore[arg-type]
    y = np.array([0, 0, 0, 0, 0, 1, 2, 3, 4])  # client 1 holds one sample of each class: nothing to hold out
    with pytest.raises(PartitionError, match=r"client 1: .* 5 samples \(per class: \{0: 1, 1: 1, 2: 1, 3: 1, 4: 1\}\) "
                                             "leaves no test sample"):
        hold_out_local_tests(y, [np.arange(4), np.arange(4, 9)], fraction=0.25, seed=0)
    with pytest.raises(PartitionError, match="client_test must be one of"):
        client_splits(load_dataset("digits"), 2, client_test="global", scheme="iid", seed=0)


def test_shared_keeps_the_partition_and_local_splits_it() -> None:
    ds = load_dataset("digits")
    parts = split_dataset(ds, 3, scheme="dirichlet", seed=2, alpha=0.5, min_samples=10)
    shared = client_splits(ds, 3, client_test="shared", scheme="dirichlet", seed=2, alpha=0.5, min_samples=10)
    assert shared.test is None and shared.fraction is None
    assert all(np.array_equal(p, q) for p, q in zip(parts, shared.train, strict=True))
    local = client_splits(ds, 3, client_test="local", client_test_fraction=0.25, scheme="dirichlet", seed=2,
                          alpha=0.5, min_samples=10)
    assert local.test is not None and local.fraction == 0.25
    want = hold_out_local_tests(ds.train.y, parts, fraction=0.25, seed=2)
    for i in range(3):
        assert np.array_equal(local.train[i], want[0][i]) and np.array_equal(local.test[i], want[1][i])
        assert np.array_equal(np.sort(np.concatenate([local.train[i], local.test[i]])), parts[i])


def test_a_device_assembled_with_local_tests_trains_and_evaluates_on_its_two_parts() -> None:
    """``prepare_agent`` without given indices (a ``fedfleet-agent``): the shard minus its local
    test set to train on, the local test set (``ds.train`` rows, not the test split) to evaluate."""
    ds = load_dataset("digits")
    spec = AgentSpec(client_id="pi-1", shard=1, shards=3, dataset="digits", partition="iid", seed=5,
                     client_test="local", client_test_fraction=0.25)
    prepared = prepare_agent(spec, ds)
    splits = spec.client_splits(ds)
    assert splits.test is not None
    assert np.array_equal(prepared.indices, splits.train[1])
    assert prepared.eval_split is not None
    assert np.array_equal(prepared.eval_split.y, ds.train.y[splits.test[1]])
    assert np.array_equal(prepared.eval_split.x, ds.train.x[splits.test[1]])
    assert prepared.info["client_test"] == "local" and prepared.info["client_test_fraction"] == "0.25"
    plain = prepare_agent(AgentSpec(client_id="pi-1", shard=1, shards=3, dataset="digits", partition="iid", seed=5),
                          ds)
    assert plain.eval_split is ds.test and plain.info["client_test_fraction"] == "-"
    assert np.array_equal(np.sort(np.concatenate([prepared.indices, splits.test[1]])), plain.indices)
