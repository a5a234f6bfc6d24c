"""Tests of the aggregation math, client selection, the FedAvg strategy and the algorithm registries.

Every mean is compared with an independent calculation: a hand-worked example, or
``np.average(..., weights=...)`` on float64 copies of the inputs (STYLE.md 16).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from broker_server.aggregate import RunningWeightedSum, all_finite, select_clients, weighted_average
from broker_server.errors import ConfigError
from broker_server.strategies import ClientResult, RoundPlan, get_strategy, list_strategies, register_strategy
from broker_server.strategies.fedavg import FedAvg

REPO = Path(__file__).resolve().parents[2]
SHAPES = [(7,), (3, 4), (2, 3, 5), (1, 1, 1, 6)]


def random_clients(rng: np.random.Generator, k: int, dtype=np.float32) -> list[list[np.ndarray]]:
    return [[rng.standard_normal(s).astype(dtype) for s in SHAPES] for _ in range(k)]


def reference_mean(clients: list[list[np.ndarray]], weights: list[float]) -> list[np.ndarray]:
    """``np.average`` over the client axis, per tensor, in float64."""
    return [np.average(np.stack([c[i].astype(np.float64) for c in clients]), axis=0, weights=np.asarray(weights))
            for i in range(len(clients[0]))]


def copies(clients: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    return [[a.copy() for a in c] for c in clients]


# ------------------------------------------------------------------------------------------
# weighted_average


def test_hand_worked_example() -> None:
    # (1·[0, 4] + 3·[4, 8]) / 4 = [12/4, 28/4] = [3, 7]
    out = weighted_average([[np.array([0.0, 4.0], np.float32)], [np.array([4.0, 8.0], np.float32)]], [1, 3])
    assert len(out) == 1
    np.testing.assert_array_equal(out[0], np.array([3.0, 7.0], np.float32))


def test_hand_worked_example_with_two_tensors_and_sample_counts() -> None:
    # McMahan et al. 2017, Alg. 1: w = Σ n_k/n · w_k; n = 100 + 300 + 600 = 1000
    a = [np.array([[1.0, 2.0]], np.float32), np.array([10.0], np.float32)]
    b = [np.array([[3.0, 2.0]], np.float32), np.array([20.0], np.float32)]
    c = [np.array([[5.0, 2.0]], np.float32), np.array([30.0], np.float32)]
    out = weighted_average([a, b, c], [100, 300, 600])
    np.testing.assert_allclose(out[0], [[0.1 * 1 + 0.3 * 3 + 0.6 * 5, 2.0]], rtol=1e-7)
    np.testing.assert_allclose(out[1], [0.1 * 10 + 0.3 * 20 + 0.6 * 30], rtol=1e-7)


@pytest.mark.parametrize("k", [2, 3, 10])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_np_average(k: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    clients = random_clients(rng, k)
    weights = list(rng.integers(1, 1000, size=k))
    out = weighted_average(clients, weights)
    want = reference_mean(clients, weights)
    assert len(out) == len(SHAPES)
    for got, ref, shape in zip(out, want, SHAPES, strict=True):
        assert got.shape == shape and got.dtype == np.float32
        np.testing.assert_allclose(got, ref.astype(np.float32), rtol=1e-6, atol=1e-7)


def test_float64_inputs_match_np_average_closely() -> None:
    rng = np.random.default_rng(3)
    clients = random_clients(rng, 5, dtype=np.float64)
    weights = [0.5, 1.5, 2.0, 3.25, 10.0]
    for got, ref in zip(weighted_average(clients, weights), reference_mean(clients, weights), strict=True):
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, ref, rtol=1e-13)


def test_single_client_returns_its_arrays() -> None:
    rng = np.random.default_rng(4)
    (client,) = random_clients(rng, 1)
    for w in (1, 7, 0.3):
        out = weighted_average([client], [w])
        for got, want in zip(out, client, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_zero_weight_client_has_no_influence() -> None:
    rng = np.random.default_rng(5)
    clients = random_clients(rng, 3)
    poison = [np.full(s, 1e30, np.float32) for s in SHAPES]
    with_zero = weighted_average([*clients, poison], [2, 3, 5, 0])
    without = weighted_average(clients, [2, 3, 5])
    for a, b in zip(with_zero, without, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("clients", "weights"), [
    pytest.param([], [], id="empty"),
    pytest.param([[np.ones(2)], [np.ones(2)]], [0, 0], id="all-zero-weights"),
    pytest.param([[np.ones(2)], [np.ones(2)]], [1, -1], id="negative-weight"),
    pytest.param([[np.ones(2)], [np.ones(2)]], [1, float("nan")], id="nan-weight"),
    pytest.param([[np.ones(2)], [np.ones(2)]], [1, float("inf")], id="inf-weight"),
    pytest.param([[np.ones(2)], [np.ones(3)]], [1, 1], id="shape-mismatch"),
    pytest.param([[np.ones((2, 3))], [np.ones((3, 2))]], [1, 1], id="transposed-shape"),
    pytest.param([[np.ones(2)], [np.ones(2), np.ones(2)]], [1, 1], id="tensor-count-mismatch"),
    pytest.param([[np.ones(2)], [np.ones(2)]], [1], id="weight-count-mismatch"),
])
def test_invalid_input_raises_value_error(clients: list, weights: list) -> None:
    with pytest.raises(ValueError):
        weighted_average(clients, weights)


def test_dtype_preserved_per_tensor() -> None:
    clients = [[np.ones(3, np.float32), np.ones(2, np.float16), np.ones(2, np.float64)] for _ in range(2)]
    out = weighted_average(clients, [1, 2])
    assert [a.dtype for a in out] == [np.float32, np.float16, np.float64]


def test_inputs_not_mutated() -> None:
    rng = np.random.default_rng(6)
    clients = random_clients(rng, 4)
    before = copies(clients)
    weights = [1.0, 2.0, 3.0, 4.0]
    out = weighted_average(clients, weights)
    assert weights == [1.0, 2.0, 3.0, 4.0]
    for c, b in zip(clients, before, strict=True):
        for x, y in zip(c, b, strict=True):
            np.testing.assert_array_equal(x, y)
    for o in out:
        assert not any(np.shares_memory(o, a) for c in clients for a in c)


def test_read_only_inputs_are_accepted() -> None:
    # decoded tensors are read-only views on the payload
    a = np.frombuffer(np.array([1.0, 2.0], np.float32).tobytes(), np.float32)
    b = np.frombuffer(np.array([3.0, 4.0], np.float32).tobytes(), np.float32)
    assert not a.flags.writeable
    np.testing.assert_array_equal(weighted_average([[a], [b]], [1, 1])[0], [2.0, 3.0])


def test_mixed_dtypes_across_clients_raise() -> None:
    with pytest.raises(ValueError):
        weighted_average([[np.zeros(2, np.float32)], [np.ones(2, np.float64)]], [1, 1])


def test_zero_dim_tensor_mean_is_an_ndarray() -> None:
    out = weighted_average([[np.array(1.0, np.float32)], [np.array(3.0, np.float32)]], [1, 1])
    assert isinstance(out[0], np.ndarray)
    assert out[0].shape == () and out[0].dtype == np.float32 and out[0] == 2.0


# ------------------------------------------------------------------------------------------
# RunningWeightedSum


def test_running_sum_streaming_equals_batch() -> None:
    rng = np.random.default_rng(8)
    clients = random_clients(rng, 6)
    weights = [5, 1, 0, 12, 3, 7]
    acc = RunningWeightedSum()
    for c, w in zip(clients, weights, strict=True):
        acc.add(c, w)
    assert acc.count == 6
    assert acc.total_weight == sum(weights)
    streamed = acc.mean()
    batch = weighted_average(clients, weights)
    for s, b, ref in zip(streamed, batch, reference_mean(clients, weights), strict=True):
        np.testing.assert_array_equal(s, b)
        np.testing.assert_allclose(s, ref.astype(np.float32), rtol=1e-6, atol=1e-7)


def test_running_sum_mean_can_be_read_repeatedly_and_between_adds() -> None:
    acc = RunningWeightedSum()
    acc.add([np.array([0.0, 4.0], np.float32)], 1)
    np.testing.assert_array_equal(acc.mean()[0], [0.0, 4.0])
    np.testing.assert_array_equal(acc.mean()[0], [0.0, 4.0])
    acc.add([np.array([4.0, 8.0], np.float32)], 3)
    np.testing.assert_array_equal(acc.mean()[0], [3.0, 7.0])


def test_running_sum_without_weight_has_no_mean() -> None:
    acc = RunningWeightedSum()
    with pytest.raises(ValueError):
        acc.mean()
    acc.add([np.ones(2)], 0)
    with pytest.raises(ValueError):
        acc.mean()


@pytest.mark.parametrize("weight", [-1.0, float("nan"), float("inf")])
def test_running_sum_refuses_bad_weight_and_keeps_its_state(weight: float) -> None:
    acc = RunningWeightedSum()
    acc.add([np.array([1.0, 2.0])], 2)
    with pytest.raises(ValueError):
        acc.add([np.array([100.0, 100.0])], weight)
    assert acc.count == 1 and acc.total_weight == 2
    np.testing.assert_array_equal(acc.mean()[0], [1.0, 2.0])


def test_running_sum_rejected_add_leaves_no_trace() -> None:
    acc = RunningWeightedSum()
    acc.add([np.zeros(2, np.float32), np.zeros(3, np.float32)], 1)
    with pytest.raises(ValueError):
        acc.add([np.full(2, 10.0, np.float32), np.zeros(4, np.float32)], 1)
    assert acc.count == 1 and acc.total_weight == 1
    np.testing.assert_array_equal(acc.mean()[0], [0.0, 0.0])


# ------------------------------------------------------------------------------------------
# all_finite


@pytest.mark.parametrize(("arrays", "expected"), [
    pytest.param([], True, id="empty"),
    pytest.param([np.zeros(3, np.float32), np.ones((2, 2))], True, id="finite-floats"),
    pytest.param([np.array([np.iinfo(np.int64).max]), np.array([True])], True, id="ints-and-bools"),
    pytest.param([np.zeros(0, np.float32)], True, id="zero-size"),
    pytest.param([np.float32(np.finfo(np.float32).max) * np.ones(2, np.float32)], True, id="float32-max"),
    pytest.param([np.ones(3), np.array([1.0, np.nan])], False, id="nan-in-second"),
    pytest.param([np.array([np.inf], np.float32)], False, id="inf"),
    pytest.param([np.array([-np.inf], np.float16)], False, id="neg-inf-f16"),
    pytest.param([np.array(np.nan)], False, id="nan-0-d"),
])
def test_all_finite(arrays: list, expected: bool) -> None:
    assert all_finite(arrays) is expected


# ------------------------------------------------------------------------------------------
# select_clients

IDS = [f"client-{i:03d}" for i in range(10)]


def test_rate_one_returns_all_sorted() -> None:
    shuffled = list(reversed(IDS))
    out = select_clients(shuffled, 1.0, 1, np.random.default_rng(0))
    assert out == IDS
    assert shuffled == list(reversed(IDS)), "input not mutated"


@pytest.mark.parametrize(("rate", "minimum", "expected"), [
    (0.3, 1, 3), (0.1, 1, 1), (0.5, 1, 5), (0.3, 5, 5), (0.3, 50, 10), (0.01, 1, 1), (0.99, 1, 10),
])
def test_selection_size(rate: float, minimum: int, expected: int) -> None:
    for seed in range(5):
        out = select_clients(IDS, rate, minimum, np.random.default_rng(seed))
        assert len(out) == expected
        assert len(set(out)) == expected, "no client twice"
        assert set(out) <= set(IDS)
        assert out == sorted(out)


def test_same_seed_same_selection_and_seeds_vary() -> None:
    picks = [tuple(select_clients(IDS, 0.3, 1, np.random.default_rng(seed))) for seed in range(20)]
    again = [tuple(select_clients(IDS, 0.3, 1, np.random.default_rng(seed))) for seed in range(20)]
    assert picks == again
    assert len(set(picks)) > 1


def test_selection_is_independent_of_the_order_of_available() -> None:
    a = select_clients(IDS, 0.4, 1, np.random.default_rng(9))
    b = select_clients(list(reversed(IDS)), 0.4, 1, np.random.default_rng(9))
    assert a == b


def test_no_available_clients_selects_none() -> None:
    assert select_clients([], 0.5, 3, np.random.default_rng(0)) == []


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.5, float("nan")])
def test_bad_rate_raises(rate: float) -> None:
    with pytest.raises(ValueError):
        select_clients(IDS, rate, 1, np.random.default_rng(0))


# ------------------------------------------------------------------------------------------
# FedAvg strategy


def result(cid: str, tensors: list[np.ndarray], n: int) -> ClientResult:
    return ClientResult(client_id=cid, tensors=tuple(tensors), num_samples=n, train_loss=0.1)


def test_configure_round_includes_train_config_and_selection() -> None:
    train = {"local_epochs": 2, "lr": 0.05, "batch_size": 32}
    strategy = FedAvg(participation_rate=0.3, min_clients=2, train_config=train)
    plan = strategy.configure_round(1, IDS, np.random.default_rng(0))
    assert isinstance(plan, RoundPlan)
    assert dict(plan.config) == train
    assert plan.selected == tuple(select_clients(IDS, 0.3, 2, np.random.default_rng(0)))
    assert len(plan.selected) == 3


def test_configure_round_config_is_a_copy() -> None:
    train = {"lr": 0.05}
    strategy = FedAvg(train_config=train)
    train["lr"] = 1.0  # the caller's dict changes after construction
    plan = strategy.configure_round(1, IDS, np.random.default_rng(0))
    assert plan.config == {"lr": 0.05}
    plan.config["lr"] = 9.0  # type: ignore[index]
    assert strategy.configure_round(2, IDS, np.random.default_rng(0)).config == {"lr": 0.05}


def test_fedavg_aggregate_without_results_is_no_change() -> None:
    current = [np.ones(3, np.float32)]
    assert FedAvg().step(1, current, []) is None


def test_fedavg_aggregate_is_weighted_by_num_samples() -> None:
    rng = np.random.default_rng(10)
    clients = random_clients(rng, 3)
    ns = [100, 300, 600]
    results = [result(f"c{i}", c, n) for i, (c, n) in enumerate(zip(clients, ns, strict=True))]
    current = [np.zeros(s, np.float32) for s in SHAPES]
    before_current = [a.copy() for a in current]
    before_clients = copies(clients)

    out = FedAvg().step(1, current, results)

    assert out is not None
    for got, want, ref in zip(out, weighted_average(clients, ns), reference_mean(clients, ns), strict=True):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(got, ref.astype(np.float32), rtol=1e-6, atol=1e-7)
    for a, b in zip(current, before_current, strict=True):
        np.testing.assert_array_equal(a, b)
    for c, b in zip(clients, before_clients, strict=True):
        for x, y in zip(c, b, strict=True):
            np.testing.assert_array_equal(x, y)
    assert not any(np.shares_memory(o, a) for o in out for a in current)


def test_fedavg_hand_worked_through_the_strategy() -> None:
    results = [result("a", [np.array([0.0, 4.0], np.float32)], 1), result("b", [np.array([4.0, 8.0], np.float32)], 3)]
    out = FedAvg().step(2, [np.zeros(2, np.float32)], results)
    np.testing.assert_array_equal(out[0], [3.0, 7.0])


def test_fedavg_constructor_is_keyword_only_and_checks_rate() -> None:
    with pytest.raises(TypeError):
        FedAvg(0.5)  # type: ignore[misc]
    for rate in (0.0, 1.5):
        with pytest.raises(ValueError):
            FedAvg(participation_rate=rate)


def test_fedavg_state_dict_round_trip() -> None:
    s = FedAvg()
    assert s.state_dict() == {}
    s.load_state_dict({})


# ------------------------------------------------------------------------------------------
# Registries


def test_every_algorithm_has_both_halves() -> None:
    """One algorithm = one name and two halves in files with the same stem (a registered variant
    such as fedproto-avg lives in its base's files)."""
    from broker_server.strategies import get_strategy_class
    from edge_agent.algorithms import get_client_algorithm_class, list_client_algorithms

    assert list_strategies() == list_client_algorithms()
    assert list_strategies() == sorted(list_strategies())
    assert "fedavg" in list_strategies()
    for name in list_strategies():
        s_mod, c_mod = get_strategy_class(name).__module__, get_client_algorithm_class(name).__module__
        if s_mod.rsplit(".", 1)[-1].startswith("test_") and c_mod.rsplit(".", 1)[-1].startswith("test_"):
            continue  # a probe registered by a test module (tests.integration.test_… under importlib)
        assert s_mod.startswith("broker_server.strategies.") and c_mod.startswith("edge_agent.algorithms."), name
        stem = s_mod.rsplit(".", 1)[1]
        assert c_mod.rsplit(".", 1)[1] == stem, (name, s_mod, c_mod)
        assert (REPO / "broker_server" / "strategies" / f"{stem}.py").is_file()
        assert (REPO / "edge_agent" / "algorithms" / f"{stem}.py").is_file()


def test_every_registry_entry_follows_the_conventions() -> None:
    """Every algorithm builds from a data set and an empty [algorithm] table (plus the proxy size
    the 8x8 digits' 360 test images allow), and has the interface's methods."""
    from broker_server.strategies import get_strategy_class
    from edge_agent.algorithms import algorithm_setup, get_client_algorithm, list_client_algorithms
    from edge_agent.data import load_dataset
    from edge_agent.plugins import accepted_keywords

    ds = load_dataset("digits")
    params = {"proxy_size": 100}
    for name in list_strategies():
        cls = get_strategy_class(name)
        extra = cls.setup_kwargs(ds, params, 0)  # the base's default: {}
        # as broker_server.runtime.make_strategy does: the [algorithm] table and the data setup
        # (the [algorithm] keys this class takes: make_strategy refuses the others)
        names, _ = accepted_keywords(cls)
        strategy = get_strategy(name, **({**{k: v for k, v in params.items() if k in names}, **extra} if extra else {}))
        assert strategy.name == name
        for method in ("configure_round", "aggregate", "state_dict", "load_state_dict"):
            assert callable(getattr(strategy, method))
        assert getattr(strategy, "share", "all") in ("all", "backbone", "none")
    for name in list_client_algorithms():
        algo = get_client_algorithm(name, **algorithm_setup(name, ds, params, 0))
        assert algo.name == name
        assert callable(algo.local_round)
        assert getattr(algo, "share", "all") == getattr(get_strategy_class(name), "share", "all"), name


def test_get_strategy_passes_keyword_config() -> None:
    s = get_strategy("fedavg", participation_rate=0.5, min_clients=2, train_config={"lr": 0.1})
    assert isinstance(s, FedAvg)
    assert (s.participation_rate, s.min_clients, s.train_config) == (0.5, 2, {"lr": 0.1})


def test_duplicate_strategy_name_raises() -> None:
    before = list_strategies()
    with pytest.raises(ValueError, match="fedavg"):
        @register_strategy("fedavg")
        class Again:  # noqa: F841
            pass
    assert list_strategies() == before
    assert isinstance(get_strategy("fedavg"), FedAvg)


def test_duplicate_client_algorithm_name_raises() -> None:
    from edge_agent.algorithms import get_client_algorithm, list_client_algorithms, register_client_algorithm

    before = list_client_algorithms()
    original = type(get_client_algorithm("fedavg"))
    with pytest.raises(ValueError, match="fedavg"):
        @register_client_algorithm("fedavg")
        class Again:  # noqa: F841
            pass
    assert list_client_algorithms() == before
    assert type(get_client_algorithm("fedavg")) is original


def test_unknown_strategy_lists_known_names() -> None:
    with pytest.raises(ConfigError) as info:
        get_strategy("fedprox-typo")
    msg = str(info.value)
    assert "fedprox-typo" in msg
    for name in list_strategies():
        assert name in msg


def test_unknown_client_algorithm_lists_known_names() -> None:
    from edge_agent.algorithms import get_client_algorithm, list_client_algorithms
    from edge_agent.errors import EdgeAgentError

    with pytest.raises(EdgeAgentError) as info:
        get_client_algorithm("fedprox-typo")
    msg = str(info.value)
    assert "fedprox-typo" in msg
    for name in list_client_algorithms():
        assert name in msg
