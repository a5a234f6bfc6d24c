"""The pathological 'classes' partition: each client holds its round-robin classes only, each
class split evenly among its holders; the configuration and the simulator pass the count on."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.errors import PartitionError
from edge_agent.partition import classes_per_client, partition


def test_each_client_holds_its_two_round_robin_classes() -> None:
    """10 classes × 12 samples, 20 clients, s = 2: client i holds classes 2i mod 10 and
    2i + 1 mod 10; each class has 4 holders, so each holder gets 12 / 4 = 3 of its samples."""
    y = np.repeat(np.arange(10), 12)
    parts = classes_per_client(y, 20, classes=2, seed=0)
    assert len(parts) == 20
    for i, p in enumerate(parts):
        assert sorted(set(y[p].tolist())) == sorted({(2 * i) % 10, (2 * i + 1) % 10})
        assert np.bincount(y[p], minlength=10).max() == 3 and p.size == 6
    allidx = np.concatenate(parts)
    assert np.unique(allidx).size == allidx.size == y.size  # disjoint and covering
    again = partition(y, 20, scheme="classes", seed=0, min_samples=1)
    assert [p.tolist() for p in parts] == [p.tolist() for p in again]


def test_classes_nobody_holds_are_left_out_and_bad_arguments_refused() -> None:
    y = np.repeat(np.arange(10), 5)
    parts = classes_per_client(y, 2, classes=2, seed=1)  # classes 0–3 only
    assert sorted(set(np.concatenate(parts).tolist()) - set(np.flatnonzero(y < 4).tolist())) == []
    with pytest.raises(PartitionError, match="exceeds the 10 classes"):
        classes_per_client(y, 2, classes=11, seed=0)
    with pytest.raises(PartitionError, match="takes no alpha"):
        partition(y, 2, scheme="classes", seed=0, alpha=0.5)
    with pytest.raises(PartitionError, match="below min_samples"):
        classes_per_client(y, 10, classes=1, seed=0, min_samples=6)


def test_the_simulator_partitions_with_classes_per_client() -> None:
    from broker_server import config as config_mod
    from broker_server.simulate import split_clients
    from edge_agent.data import load_dataset

    cfg = config_mod.from_dict({"data": {"dataset": "digits", "partition": "classes", "clients": 5,
                                         "classes_per_client": 3}}, "<t>")
    ds = load_dataset("digits")
    parts = split_clients(ds, cfg)
    y = np.asarray(ds.train.y)
    assert [sorted(set(y[p].tolist())) for p in parts] == [sorted((3 * i + j) % 10 for j in range(3)) for i in range(5)]
