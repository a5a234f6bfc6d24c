"""The client test protocol on the server side: the round's client figures (the sample-weighted
mean against a hand computation from per-client counts) and the ``[data] client_test`` keys of
the configuration (range checks, the checks across sections, the agent command line)."""

from __future__ import annotations

import shlex

import pytest

from broker_server import config as config_mod
from broker_server.errors import ConfigError
from broker_server.runtime import expected_data
from broker_server.server import client_eval_figures
from broker_server.server_main import agent_command
from edge_agent.agent import data_announcement
from edge_agent.cli import build_parser


def test_the_weighted_mean_is_correct_over_samples_of_the_whole_fleet() -> None:
    """Three devices: 45 of 50, 10 of 40 and 3 of 10 correct. Weighted: (45 + 10 + 3) / 100 =
    0.58; unweighted: (0.9 + 0.25 + 0.3) / 3 = 0.48333…; worst 0.25, best 0.9."""
    reports = [{"eval_accuracy": 0.9, "eval_macro_f1": 0.8, "eval_samples": 50, "train_seconds": 1.0},
               {"eval_accuracy": 0.25, "eval_macro_f1": 0.2, "eval_samples": 40},
               {"eval_accuracy": 0.3, "eval_macro_f1": 0.5, "eval_samples": 10},
               {"train_seconds": 2.0}]  # a device that did not evaluate counts nowhere
    got = client_eval_figures(reports)
    assert got["client_accuracy_weighted"] == pytest.approx(0.58)
    assert got["client_accuracy_mean"] == pytest.approx(1.45 / 3)
    assert got["client_accuracy_worst"] == 0.25 and got["client_accuracy_best"] == 0.9
    assert got["client_f1_mean"] == pytest.approx(0.5)
    assert got["clients_evaluated"] == 3 and got["client_eval_samples"] == 100
    # population std of (0.9, 0.25, 0.3) around 0.48333: sqrt((0.41667² + 0.23333² + 0.18333²) / 3)
    assert got["client_accuracy_std"] == pytest.approx(((0.9 - 1.45 / 3) ** 2 + (0.25 - 1.45 / 3) ** 2
                                                        + (0.3 - 1.45 / 3) ** 2) ** 0.5 / 3 ** 0.5)


def test_no_weighted_mean_without_every_devices_count() -> None:
    got = client_eval_figures([{"eval_accuracy": 0.5, "eval_samples": 10}, {"eval_accuracy": 1.0},
                               {"eval_accuracy": 0.0, "eval_samples": True}])
    assert got["client_accuracy_weighted"] is None and got["client_eval_samples"] is None
    assert got["client_accuracy_mean"] == pytest.approx(0.5) and got["client_f1_mean"] is None
    assert client_eval_figures([{"train_seconds": 1.0}]) == {}


def _cfg(**data) -> config_mod.Config:
    return config_mod.from_dict({"data": {"dataset": "digits", "clients": 3, **data},
                                 "server": {"client_eval": True}}, "<test>")


def test_client_test_keys_are_range_checked() -> None:
    assert _cfg().data.client_test == "shared" and _cfg().data.client_test_fraction == 0.25
    with pytest.raises(ConfigError, match=r"\[data\] client_test = 'global' is not one of shared, local"):
        _cfg(client_test="global")
    for bad in (0.0, 0.95):
        with pytest.raises(ConfigError, match=r"\[data\] client_test_fraction = .* outside the allowed range "
                                              r"\[0.01, 0.9\]"):
            _cfg(client_test="local", client_test_fraction=bad)
    with pytest.raises(ConfigError, match="expected a number"):
        _cfg(client_test_fraction="0.25")


def test_local_tests_need_someone_to_evaluate_on_them_and_no_shared_cap() -> None:
    with pytest.raises(ConfigError, match="client_eval_max = 2000 caps the shared test split"):
        config_mod.from_dict({"data": {"dataset": "digits", "client_test": "local"},
                              "server": {"client_eval": True, "client_eval_max": 2000}}, "<test>")
    with pytest.raises(ConfigError, match="client-side evaluation, but it is off"):
        config_mod.from_dict({"data": {"dataset": "digits", "client_test": "local"}}, "<test>")
    # a prototype-only method is always evaluated on the devices: no client_eval needed
    cfg = config_mod.from_dict({"data": {"dataset": "digits", "client_test": "local"},
                                "train": {"algorithm": "fedproto"}}, "<test>")
    assert cfg.data.client_test == "local"


def test_the_printed_agent_command_announces_the_local_protocol() -> None:
    cfg = _cfg(client_test="local", client_test_fraction=0.3, partition="iid")
    words = shlex.split(agent_command(cfg, "mqtt://127.0.0.1:1883", "fed-x"))
    args = build_parser().parse_args([w.replace("i/", "0/") for w in words[1:]])
    assert (args.client_test, args.client_test_fraction) == ("local", 0.3)
    ann = data_announcement(dataset=args.dataset, partition=args.partition, alpha=args.alpha, seed=args.seed,
                            shards=3, min_samples=args.min_samples, train_samples=args.train_samples,
                            algorithm=args.algorithm, client_test=args.client_test,
                            client_test_fraction=args.client_test_fraction)
    assert ann == expected_data(cfg)
    assert (ann["client_test"], ann["client_test_fraction"]) == ("local", "0.3")
    shared = expected_data(_cfg(partition="iid"))
    assert (shared["client_test"], shared["client_test_fraction"]) == ("shared", "-")
    assert "--client-test" not in agent_command(_cfg(partition="iid"), "mqtt://127.0.0.1:1883", "fed-x")


def test_a_shard_too_small_for_its_local_test_set_gets_one_piece_of_advice() -> None:
    """300 digits over 3 iid clients: 100 samples a client, at most 14 of a class. A fraction of
    0.01 rounds every class's 0.06–0.14 down to 0 held out, so the split is refused; the error
    names the subset (300 of 1,438 training samples) and tells to raise the fraction or the
    shards, not also (as a partition failure would) to lower min_samples."""
    from broker_server.simulate import client_data
    from edge_agent.data import load_dataset

    cfg = _cfg(partition="iid", client_test="local", client_test_fraction=0.01, train_samples=300)
    with pytest.raises(ConfigError) as err:
        client_data(load_dataset("digits"), cfg)
    text = str(err.value)
    assert "digits (300 of its 1,438 training samples)" in text
    assert "client 0: a local test fraction of 0.01 of its 100 samples" in text and "leaves no test sample" in text
    assert "raise client_test_fraction or min_samples" in text and "smaller [data] min_samples" not in text
    # a partition that fails for itself keeps its advice
    with pytest.raises(ConfigError, match=r"smaller \[data\] min_samples"):
        client_data(load_dataset("digits"), _cfg(partition="dirichlet", alpha=0.01, min_samples=600))
