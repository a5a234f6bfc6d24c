"""Users' own algorithms, data sets and models named by import path or entry point: what fits
is found, what does not is refused with an error naming the key and what was wrong; and the
example project's trimmed mean and schedule against hand computations."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import example_project as ex

from broker_server import config as config_mod
from broker_server.errors import ConfigError
from broker_server.runtime import make_strategy
from broker_server.strategies import ClientResult, get_strategy_class, round_config
from edge_agent.algorithms import get_client_algorithm_class
from edge_agent.data import load_dataset
from edge_agent.errors import DataError, EdgeAgentError, ModelError
from edge_agent.models import resolve_model


@pytest.fixture(autouse=True)
def _example_on_path() -> None:
    ex.on_path()


def _cfg(**algorithm):
    raw = {"run": {"rounds": 3}, "data": {"dataset": "shapesfl.data:shapes", "partition": "iid", "clients": 4},
           "train": {"algorithm": "shapesfl.algorithm:trimmed", "lr": 0.1},
           "model": {"name": "shapesfl.model:make", "feature_dim": 32}, "algorithm": algorithm}
    return config_mod.from_dict(raw, "<test>")


def test_the_trimmed_mean_by_hand() -> None:
    from shapesfl.server import trimmed_mean

    stack = [np.array([1.0, 5.0]), np.array([10.0, 6.0]), np.array([2.0, -7.0]), np.array([3.0, 8.0])]
    np.testing.assert_allclose(trimmed_mean(stack, 1), [(2 + 3) / 2, (5 + 6) / 2])
    np.testing.assert_allclose(trimmed_mean(stack, 0), [16 / 4, 12 / 4])
    np.testing.assert_allclose(trimmed_mean(stack[:2], 1), [5.5, 5.5])  # n = 2: nothing can be trimmed


def test_the_example_strategy_aggregates_one_round_as_by_hand() -> None:
    ds = load_dataset("shapesfl.data:shapes")
    strategy = make_strategy(_cfg(trim=1), ds)
    rng = np.random.default_rng(0)
    current = [np.zeros((2, 3), np.float32), np.zeros(3, np.float32)]
    results = [ClientResult(f"c{i}", tuple(rng.normal(size=t.shape).astype(np.float32) for t in current), 10 + i, 0.5)
               for i in range(5)]
    update = strategy.aggregate(1, current, results)
    for i in range(2):
        values = np.stack([r.tensors[i] for r in results]).astype(np.float64)
        hand = np.sort(values, axis=0)[1:4].mean(axis=0)  # 5 values, one dropped at each end
        np.testing.assert_allclose(update.tensors[i], hand, rtol=1e-6)
    assert update.metrics == {"trimmed_per_side": 1}


def test_the_schedule_reaches_the_round_config() -> None:
    ds = load_dataset("shapesfl.data:shapes")
    strategy = make_strategy(_cfg(lr_decay=0.5, clip_norm=1.5), ds)
    plan = strategy.configure_round(3, ["a", "b"], np.random.default_rng(0))
    cfg = round_config(strategy, 3, plan.config)
    assert cfg["lr"] == pytest.approx(0.1 * 0.5 ** 2) and cfg["clip_norm"] == 1.5 and cfg["local_epochs"] == 1


def test_an_unknown_or_bad_algorithm_key_names_itself() -> None:
    ds = load_dataset("shapesfl.data:shapes")
    with pytest.raises(ConfigError, match=r"\[algorithm\] for 'shapesfl.algorithm:trimmed': unknown key trimm: "
                                          r"TrimmedMean takes clip_norm, lr_decay, trim, val_size"):
        make_strategy(_cfg(trimm=1), ds)
    with pytest.raises(ConfigError, match=r"lr_decay must be in \(0, 1\], got 2"):
        make_strategy(_cfg(lr_decay=2), ds)
    with pytest.raises(ConfigError, match="quorum"):
        make_strategy(_cfg(min_clients=2), ds)
    with pytest.raises(ConfigError, match=r"\[algorithm\] for 'fedavg': unknown key mu: FedAvg takes weighting"):
        make_strategy(config_mod.from_dict({"algorithm": {"mu": 0.1}}, "<test>"), ds)


USER_MODULE = '''
from fedfleet import Algorithm, ClientAlgorithm, FedAvg, Strategy

class Client(ClientAlgorithm):
    def local_round(self, model, global_tensors, x, y, config, *, round, client_id="", client_index, device,
                    params=None, global_extras=None):
        raise NotImplementedError

class NoAggregate(Strategy):
    pass

class Backbone(FedAvg):
    share = "backbone"

class BadHook(FedAvg):
    def configure_round(self, round):
        raise NotImplementedError

class BadSchedule(FedAvg):
    def config_for_round(self, round):
        return {"lr": -0.5 if round == 2 else 0.1}

fine = Algorithm(client=Client, strategy=FedAvg, name="fine")
not_a_strategy = Algorithm(client=Client, strategy=dict)
abstract = Algorithm(client=Client, strategy=NoAggregate)
disagree = Algorithm(client=Client, strategy=Backbone)
bad_hook = Algorithm(client=Client, strategy=BadHook)
bad_schedule = Algorithm(client=Client, strategy=BadSchedule)
client_abstract = Algorithm(client=ClientAlgorithm, strategy=FedAvg)
missing = Algorithm(client="userpkg_algos:Nope", strategy=FedAvg)
plain = 42
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "userpkg_algos.py").write_text(USER_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "userpkg_algos"


@pytest.mark.parametrize(("attr", "message"), [
    ("not_a_strategy", "server half <class 'dict'> is not a subclass of fedfleet.Strategy"),
    ("abstract", "server half NoAggregate does not implement aggregate"),
    ("disagree", "the halves disagree: Backbone.share = 'backbone' but the client half Client.share = 'all'"),
    ("bad_hook", r"configure_round\(\) cannot be called as the base's configure_round\(round: 'int', available"),
    ("client_abstract", "client half ClientAlgorithm does not implement local_round"),
    ("missing", "module 'userpkg_algos' has no attribute 'Nope'"),
    ("plain", "is a int, not a fedfleet.Algorithm"),
    ("absent", "module 'userpkg_algos' has no attribute 'absent'"),
])
def test_an_algorithm_that_does_not_fit_is_refused_naming_what(user_module, attr, message) -> None:
    with pytest.raises(ConfigError, match=message):
        get_strategy_class(f"{user_module}:{attr}")


def test_a_fitting_user_algorithm_resolves_on_both_sides(user_module) -> None:
    from fedfleet import FedAvg

    assert get_strategy_class(f"{user_module}:fine") is FedAvg
    client = get_client_algorithm_class(f"{user_module}:fine")
    assert client.__name__ == "Client" and client.name == "fine"
    with pytest.raises(EdgeAgentError, match="does not implement local_round"):
        get_client_algorithm_class(f"{user_module}:client_abstract")
    with pytest.raises(EdgeAgentError, match="unknown algorithm 'fedavgg'.*package.module:name"):
        get_client_algorithm_class("fedavgg")


def test_a_schedule_no_device_can_use_stops_before_the_run(user_module) -> None:
    raw = {"run": {"rounds": 3}, "train": {"algorithm": f"{user_module}:bad_schedule"}}
    with pytest.raises(ConfigError, match=r"round 2: round config lr = -0.5 must be >= 0 \(from BadSchedule"):
        make_strategy(config_mod.from_dict(raw, "<test>"), load_dataset("digits"))


DATA_MODULE = '''
import numpy as np
from fedfleet import dataset_factory

def undeclared(data_dir):
    return ()

@dataset_factory(num_classes=3, channels=1, image_size=4)
def floats(data_dir):
    x = np.zeros((6, 4, 4), np.float32)
    return x, np.zeros(6, np.int64), x, np.zeros(6, np.int64)

@dataset_factory(num_classes=3, channels=1, image_size=4)
def tiny(data_dir):
    x = np.full((6, 4, 4), 255, np.uint8)
    return x, np.arange(6, dtype=np.int64) % 3, x[:3], np.arange(3, dtype=np.int64)
'''


def test_a_dataset_factory_is_found_and_checked(tmp_path, monkeypatch) -> None:
    (tmp_path / "userpkg_data.py").write_text(DATA_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    ds = load_dataset("userpkg_data:tiny")
    assert ds.train.x.shape == (6, 1, 4, 4) and float(ds.train.x.max()) == 1.0 and ds.num_classes == 3
    with pytest.raises(DataError, match=r"userpkg_data:undeclared.*not declared with @fedfleet.dataset_factory"):
        load_dataset("userpkg_data:undeclared")
    with pytest.raises(DataError, match=r"userpkg_data:floats.*\(train\)"):
        load_dataset("userpkg_data:floats")
    with pytest.raises(ConfigError, match=r"\[data\] dataset: data set factory 'userpkg_data:nope'"):
        config_mod.from_dict({"data": {"dataset": "userpkg_data:nope"}}, "<test>")


def test_entry_points_name_the_example_once_installed(tmp_path, monkeypatch) -> None:
    """A dist-info folder on sys.path is what ``pip install -e examples/custom`` leaves behind:
    its entry points are found by name, for each kind."""
    dist = tmp_path / "fedfleet_example_shapes-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fedfleet-example-shapes\nVersion: 0.1.0\n")
    eps = (ex.EXAMPLE / "pyproject.toml").read_text()
    table = "\n".join(line for line in eps.splitlines() if line.startswith(("[project.entry-points", "trimmed-mean",
                                                                             "shapes =", "shapes-cnn")))
    (dist / "entry_points.txt").write_text(table.replace("project.entry-points.", "").replace('"', ""))
    monkeypatch.syspath_prepend(str(tmp_path))
    from shapesfl.client import ClippedSGD
    from shapesfl.model import make
    from shapesfl.server import TrimmedMean

    assert get_strategy_class("trimmed-mean") is TrimmedMean
    assert get_client_algorithm_class("trimmed-mean") is ClippedSGD
    assert resolve_model("shapes-cnn") is make
    assert load_dataset("shapes").train.x.shape == (1200, 1, 12, 12)
    with pytest.raises(ModelError, match="unknown model 'shapes-cnnn'.*shapes-cnn"):
        resolve_model("shapes-cnnn")
    cfg = config_mod.load(ex.EXAMPLE / "shapes-names.toml")
    assert (cfg.train.algorithm, cfg.data.dataset, cfg.model.name) == ("trimmed-mean", "shapes", "shapes-cnn")


def test_a_device_resolves_the_client_half_without_server_code() -> None:
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ex.REPO)!r}, {str(ex.EXAMPLE)!r}]
        from edge_agent.algorithms import build_client_algorithm
        algo = build_client_algorithm("shapesfl.algorithm:trimmed")
        print(type(algo).__name__, algo.name, sorted(m for m in sys.modules if m.startswith("broker_server")))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ClippedSGD", "trimmed-mean", "[]"]
