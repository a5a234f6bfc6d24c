"""The [model] table of broker_server.config: parsing, the model group, its checks, round trips,
and the server's printed agent command."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker_server import config as C
from broker_server.errors import ConfigError
from broker_server.server_main import agent_command, model_assignment


def _cfg(model: dict, algorithm: str = "fedproto") -> C.Config:
    return C.from_dict({"model": model, "train": {"algorithm": algorithm}})


def test_defaults_are_the_light_cnn() -> None:
    m = C.Config().model
    assert (m.name, m.feature_dim, m.group) == ("lightcnn", 64, ())
    assert m.architecture(5, "rpi4") == "lightcnn" and m.architectures() == ["lightcnn"]


def test_a_list_group_is_round_robin_by_shard_index() -> None:
    m = _cfg({"group": ["lightcnn", "resnet8", "inception_small"]}).model
    assert m.group == ("lightcnn", "resnet8", "inception_small")
    assert [m.architecture(i, "x86-cpu") for i in range(4)] == ["lightcnn", "resnet8", "inception_small", "lightcnn"]


def test_a_table_group_is_by_firmware_profile() -> None:
    m = _cfg({"name": "resnet8", "group": {"rpi4": "lightcnn", "jetson-orin-nano": "resnet18"}}).model
    assert m.group == (("rpi4", "lightcnn"), ("jetson-orin-nano", "resnet18"))
    assert m.architecture(0, "rpi4") == "lightcnn"
    assert m.architecture(0, "jetson-orin-nano") == "resnet18"
    assert m.architecture(0, "x86-cpu") == "resnet8"  # a profile the table does not name runs [model] name
    assert m.architectures() == ["resnet8", "lightcnn", "resnet18"]


def test_a_group_name_becomes_the_named_group() -> None:
    m = _cfg({"group": "htfe4-cpu"}).model
    assert m.group == ("lightcnn", "resnet8", "mobilenet_v2_small", "inception_small")
    assert [m.architecture(i, "x86-cpu") for i in (0, 5)] == ["lightcnn", "resnet8"]
    f = _cfg({"name": "resnet8", "group": "fleet"}).model
    assert f.architecture(0, "rpi4") == "lightcnn" and f.architecture(0, "jetson-orin-nano") == "resnet18"


@pytest.mark.parametrize(("model", "algorithm", "pattern"), [
    ({"name": "resnet1000"}, "fedavg", r"\[model\]: unknown model 'resnet1000'; the zoo has .*resnet18"),
    ({"name": "no_such_pkg.mod:fn"}, "fedavg", r"\[model\]: model factory .*cannot import module 'no_such_pkg.mod'"),
    ({"group": ["lightcnn", "nope"]}, "fedproto", r"unknown model 'nope'"),
    ({"group": "resnet8"}, "fedproto", r"\[model\] group: unknown model group 'resnet8'; the named groups are fleet"),
    ({"group": 3}, "fedproto", r"\[model\] group = 3: expected a list"),
    ({"group": [1, 2]}, "fedproto", r"expected a list of model names"),
    ({"group": {"rpi-4": "resnet8"}}, "fedproto", r"unknown firmware profile 'rpi-4'"),
    ({"feature_dim": 0}, "fedavg", r"\[model\] feature_dim = 0 is outside"),
    ({"feature_dim": 64.0}, "fedavg", r"\[model\] feature_dim: expected an integer"),
    ({"size": 3}, "fedavg", r"unknown key \[model\] size; allowed: name, feature_dim, group"),
    ({"group": ["lightcnn", "resnet8"]}, "fedavg",
     r"several architectures \(lightcnn, resnet8\) but \[train\] algorithm = 'fedavg' averages parameters, which needs "
     r"one architecture on every device.*fedproto"),
    ({"name": "resnet8", "group": {"rpi4": "lightcnn"}}, "fedper", r"several architectures \(resnet8, lightcnn\)"),
])
def test_bad_model_tables_are_refused_clearly(model: dict, algorithm: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        _cfg(model, algorithm)


def test_one_architecture_named_twice_is_fine_for_averaging() -> None:
    m = _cfg({"name": "resnet8", "group": ["resnet8", "resnet8"]}, "fedavg").model
    assert m.architectures() == ["resnet8"]


def test_resolved_toml_round_trips_both_group_forms(tmp_path: Path) -> None:
    for model in ({"group": ["lightcnn", "resnet8"]}, {"name": "resnet8", "feature_dim": 32,
                                                       "group": {"rpi4": "lightcnn", "jetson-orin-nano": "resnet18"}}):
        cfg = _cfg(model)
        path = tmp_path / "resolved.toml"
        path.write_text(cfg.to_toml(), encoding="utf-8")
        assert C.load(path).model == cfg.model


def test_agent_command_names_the_model() -> None:
    assert "--model" not in agent_command(C.Config(), "mqtt://h:1883", "fed")
    one = _cfg({"name": "resnet8", "feature_dim": 32}, "fedavg")
    assert agent_command(one, "mqtt://h:1883", "fed").endswith("--algorithm fedavg --model resnet8 --feature-dim 32")
    assert model_assignment(one) == ""
    group = _cfg({"group": ["lightcnn", "resnet8"]})
    assert agent_command(group, "mqtt://h:1883", "fed").endswith("--model MODEL")
    assert model_assignment(group) == ("MODEL by shard index i: i % 2 = 0 -> --model lightcnn, "
                                       "i % 2 = 1 -> --model resnet8")


def test_the_example_configuration_loads() -> None:
    cfg = C.load(Path(__file__).resolve().parents[2] / "examples" / "hetero-fedproto.toml")
    assert cfg.train.algorithm == "fedproto" and cfg.model.architectures() == ["lightcnn", "resnet8", "inception_small"]
