"""FedAvg's model weighting: sample counts (McMahan et al. 2017) or equal weights
(``[algorithm] weighting = "uniform"``), in the whole-list and the streaming form, and through
the ``[algorithm]`` table."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.federation import small_config

from broker_server.errors import ConfigError
from broker_server.runtime import make_strategy
from broker_server.strategies import ClientResult
from broker_server.strategies._base import fold
from broker_server.strategies.fedavg import FedAvg
from broker_server.strategies.fedprox import FedProx
from edge_agent.data import load_dataset


def _results() -> list[ClientResult]:
    # client a: [0, 4] from 1 sample; client b: [4, 8] from 3 samples; client c: [8, 0] from 4 samples
    rows = [("a", [0.0, 4.0], 1), ("b", [4.0, 8.0], 3), ("c", [8.0, 0.0], 4)]
    return [ClientResult(cid, (np.array(v, np.float32),), n, 0.0) for cid, v, n in rows]


def test_samples_weighting_is_the_sample_weighted_mean_by_hand() -> None:
    # (1·[0, 4] + 3·[4, 8] + 4·[8, 0]) / 8 = ([0 + 12 + 32, 4 + 24 + 0]) / 8 = [5.5, 3.5]
    s = FedAvg()
    assert s.model_weighting == "samples"
    out = s.aggregate(1, [np.zeros(2, np.float32)], _results())
    np.testing.assert_array_equal(out.tensors[0], np.array([5.5, 3.5], np.float32))


def test_uniform_weighting_is_the_plain_mean_by_hand() -> None:
    # ([0, 4] + [4, 8] + [8, 0]) / 3 = [12/3, 12/3] = [4, 4], whatever the sample counts
    s = FedAvg(weighting="uniform")
    whole = s.aggregate(1, [np.zeros(2, np.float32)], _results())
    np.testing.assert_array_equal(whole.tensors[0], np.array([4.0, 4.0], np.float32))
    streamed = fold(s.accumulator(1, [np.zeros(2, np.float32)]), list(reversed(_results())))
    np.testing.assert_array_equal(streamed.tensors[0], whole.tensors[0])


def test_subclasses_that_stream_through_fedavg_follow_the_weighting() -> None:
    out = fold(FedProx(weighting="uniform").accumulator(1, [np.zeros(2, np.float32)]), _results())
    np.testing.assert_array_equal(out.tensors[0], np.array([4.0, 4.0], np.float32))


def test_weighting_comes_from_the_algorithm_table() -> None:
    digits = load_dataset("digits")
    cfg = small_config(train={"algorithm": "fedavg"}, algorithm={"weighting": "uniform"})
    assert make_strategy(cfg, digits).model_weighting == "uniform"
    bad = small_config(train={"algorithm": "fedavg"}, algorithm={"weighting": "count"})
    with pytest.raises(ConfigError, match="weighting must be one of"):
        make_strategy(bad, digits)
    # Local aggregates nothing: the key is not taken (an unknown key names itself)
    local = small_config(train={"algorithm": "local"}, algorithm={"weighting": "uniform"})
    with pytest.raises(ConfigError, match="weighting"):
        make_strategy(local, digits)


def test_fedrep_takes_the_weighting_of_fedper_it_extends() -> None:
    """FedPer takes ``weighting``; FedRep (FedPer plus head epochs) took no such key and refused it
    as unknown. Its backbone average is FedPer's: uniform gives the plain mean [4, 4]."""
    from broker_server.strategies.fedrep import FedRep

    digits = load_dataset("digits")
    cfg = small_config(train={"algorithm": "fedrep"}, algorithm={"weighting": "uniform", "head_epochs": 2})
    s = make_strategy(cfg, digits)
    assert isinstance(s, FedRep) and s.model_weighting == "uniform" and s.head_epochs == 2
    out = fold(FedRep(weighting="uniform").accumulator(1, [np.zeros(2, np.float32)]), _results())
    np.testing.assert_array_equal(out.tensors[0], np.array([4.0, 4.0], np.float32))
    with pytest.raises(ConfigError, match="weighting must be one of"):
        make_strategy(small_config(train={"algorithm": "fedrep"}, algorithm={"weighting": "count"}), digits)
