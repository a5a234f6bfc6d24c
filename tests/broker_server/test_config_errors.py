"""Configuration problems are configuration errors: ``ConfigError`` from the checks, exit code 2
with a message from the ``fedfleet`` CLI (broker_server/cli.py's contract), never a traceback;
and what the checks accept, the agents can use.

Cases: partitions that cannot be made, ``--clients`` overrides checked after they apply, the
``[protocol] extras_codec`` text (parsed as the agent parses it), FedMCP's ``[algorithm]`` keys, a
key put under the wrong section (the error names the section it belongs to), and
``fedfleet-agent --client-test-fraction`` taking the range ``[data] client_test_fraction`` takes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.federation import small_config

from broker_server.cli import _load, build_parser
from broker_server.cli import main as fedfleet_main
from broker_server.errors import ConfigError
from broker_server.runtime import make_strategy
from edge_agent.agent import extras_codecs
from edge_agent.data import load_dataset
from protocol.tensors import Codec

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.toml"


@pytest.mark.parametrize("extra, clients", [("", 200), ("alpha_override", 10)])
def test_impossible_partition_is_a_configuration_error(tmp_path: Path, capsys, extra: str, clients: int) -> None:
    """200 clients with ``min_samples = 10`` of digits, or Dirichlet ``alpha = 0.01``: exit code 2
    and a message naming ``min_samples``."""
    cfg = QUICKSTART.read_text()
    if extra == "alpha_override":
        cfg = cfg.replace("alpha = 1.0", "alpha = 0.01")
    path = tmp_path / "cfg.toml"
    path.write_text(cfg)
    code = fedfleet_main(["simulate", "--config", str(path), "--clients", str(clients), "--rounds", "1",
                          "--out", str(tmp_path / "run"), "-q"])
    assert code == 2
    assert "min_samples" in capsys.readouterr().err


def test_clients_override_is_applied_before_the_quorum_is_checked(tmp_path: Path) -> None:
    """``quorum = 9`` in a 4-client file plus ``--clients 12`` is a valid 12-client configuration."""
    path = tmp_path / "cfg.toml"
    path.write_text(QUICKSTART.read_text().replace("quorum = 2", "quorum = 9"))
    args = build_parser().parse_args(["simulate", "--config", str(path), "--clients", "12"])
    cfg = _load(args)
    assert cfg.data.clients == 12 and cfg.server.quorum == 9


@pytest.mark.parametrize("text", ["int8,soft_predictions=fp16", "int8,fp16", " , ", "prototypes=int8, ",
                                  "soft_predictions=int8,=fp16", "a/b=int8", "p=int8,p=fp16"])
def test_extras_codec_the_agents_cannot_read_is_refused_by_the_config(text: str) -> None:
    """The whole text is parsed as the agent parses it: a second default, an empty entry, a bad
    name or a repeated name is a ConfigError naming ``extras_codec``."""
    with pytest.raises(ConfigError, match="extras_codec"):
        small_config(protocol={"extras_codec": text})


@pytest.mark.parametrize("text", ["", "int8", "fp16+zstd", "soft_predictions=int8+zstd,prototypes=fp16+zstd",
                                  " prototypes = fp16 "])
def test_extras_codec_that_the_config_accepts_the_agent_reads(text: str) -> None:
    small_config(protocol={"extras_codec": text})
    ex = {"soft_predictions": np.zeros(2, np.float32), "prototypes": np.zeros(2, np.float32)}
    extras_codecs(text, ex, Codec.parse("fp32"))


@pytest.mark.parametrize("params", [{"proxy_size": "x"}, {"proxy_size": 100, "proxy_seed": "x"}])
def test_fedmcp_bad_proxy_keys_are_a_config_error(params: dict) -> None:
    """FedMCP's data setup reads ``[algorithm] proxy_size`` / ``proxy_seed``: a value of the wrong
    type is a ConfigError naming the section."""
    cfg = small_config(train={"algorithm": "fedmcp"}, algorithm=params)
    with pytest.raises(ConfigError, match=r"\[algorithm\]"):
        make_strategy(cfg, load_dataset("digits"))


@pytest.mark.parametrize(("algorithm", "params", "named"), [
    # the type of the constructor's annotation: an OverflowError or "cannot convert float NaN to
    # integer" (naming no key) before
    ("feddo", {"capacity": float("inf")}, "capacity = inf must be an integer"),
    ("feddo", {"hidden": float("nan")}, "hidden = nan must be an integer"),
    ("fedcross", {"models": float("inf")}, "models = inf must be an integer"),
    ("fedpgp", {"mix_size": float("inf")}, "mix_size = inf must be an integer"),
    ("feddo", {"lr_actor": float("inf")}, "lr_actor = inf must be a finite number"),
    ("feddo", {"xi": "x"}, "xi = 'x' must be a finite number"),
    ("feddo", {"learn": "x"}, "learn = 'x' must be true or false"),  # was taken as true
    ("moon", {"mu": "x"}, "mu = 'x' must be a finite number"),
    ("oort", {"clip_bound": float("nan")}, "clip_bound = nan must be a finite number"),
    ("oort", {"duration": 3}, "duration = 3 must be a string"),
    # ranges the constructors did not check (a negative quantile indexed the sorted list from its end)
    ("oort", {"clip_bound": -1.5}, r"clip_bound = -1.5 must be in \[0, 1\]"),
    ("oort", {"round_threshold": -1.0}, r"round_threshold = -1.0 must be in \[0, 100\]"),
    ("oort", {"cut_off_util": -0.5}, r"cut_off_util = -0.5 must be in \[0, inf\]"),
    ("fedcross", {"first_stage_bound": -1}, "first_stage_bound = -1 must be >= 0"),
    ("feddo", {"val_size": -1}, "val_size = -1 must be >= 1"),  # "negative dimensions are not allowed"
    ("feddo", {"layers": 0}, r"layers \(0\) and hidden \(256\) must be >= 1"),
])
def test_algorithm_values_of_the_wrong_type_or_range_name_the_key(algorithm: str, params: dict, named: str) -> None:
    cfg = small_config(train={"algorithm": algorithm}, algorithm=params)
    with pytest.raises(ConfigError, match=rf"\[algorithm\] for '{algorithm}': .*{named}"):
        make_strategy(cfg, load_dataset("digits"))


def test_an_integer_is_a_number_for_a_float_key() -> None:
    """TOML's ``mu = 1`` is an integer: a float-annotated key takes it."""
    cfg = small_config(train={"algorithm": "moon"}, algorithm={"mu": 1, "tau": 1})
    assert make_strategy(cfg, load_dataset("digits")).mu == 1.0


@pytest.mark.parametrize(("sections", "hint"), [
    # a [data] key under [algorithm]: the algorithm's own message, then where the key belongs
    ({"algorithm": {"client_test": "local"}}, "FedAvg takes weighting; did you mean [data] client_test?"),
    # a key of two other sections names both
    ({"data": {"name": "x"}}, "unknown key [data] name; allowed: dataset, data_dir, partition, alpha, clients, "
                              "min_samples, train_samples, domain_clients, domain_train_cap, domain_test_cap, "
                              "classes_per_client, client_test, client_test_fraction; "
                              "did you mean [run] name or [model] name?"),
    # the configured algorithm's hyperparameter put under [train]
    ({"train": {"algorithm": "fedprox", "mu": 0.01}}, "unknown key [train] mu; allowed: algorithm, local_epochs, "
                                                      "batch_size, lr, momentum, weight_decay; did you mean "
                                                      "[algorithm] mu (a hyperparameter of 'fedprox')?"),
])
def test_a_key_in_the_wrong_section_says_where_it_belongs(sections: dict, hint: str) -> None:
    with pytest.raises(ConfigError) as info:  # a section's key: from the loader; an [algorithm] key: the strategy
        make_strategy(small_config(**sections), load_dataset("digits"))
    assert hint in str(info.value)


def test_a_key_known_nowhere_gets_no_hint() -> None:
    with pytest.raises(ConfigError) as info:
        small_config(data={"clientz": 3})
    assert "did you mean" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        make_strategy(small_config(algorithm={"weightin": "uniform"}), load_dataset("digits"))
    assert str(info.value).endswith("unknown key weightin: FedAvg takes weighting")


@pytest.mark.parametrize(("value", "accepted"), [("0.01", True), ("0.25", True), ("0.9", True),
                                                 ("0.009", False), ("0.95", False), ("0", False), ("nan", False)])
def test_the_agent_takes_the_client_test_fractions_the_configuration_takes(
        value: str, accepted: bool, capsys: pytest.CaptureFixture) -> None:
    """``fedfleet-agent --client-test-fraction`` and ``[data] client_test_fraction`` allow the same
    [0.01, 0.9] (the agent took 0.95, which no server configuration can announce)."""
    from edge_agent.cli import build_parser as agent_parser

    args = ["--broker", "mqtt://h:1", "--federation", "f", "--client-id", "c", "--client-test", "local"]
    if accepted:
        assert agent_parser().parse_args([*args, "--client-test-fraction", value]).client_test_fraction == float(value)
        assert small_config(data={"client_test_fraction": float(value)}).data.client_test_fraction == float(value)
        return
    with pytest.raises(SystemExit) as stop:
        agent_parser().parse_args([*args, "--client-test-fraction", value])
    assert stop.value.code == 2
    assert "--client-test-fraction" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="client_test_fraction"):
        small_config(data={"client_test_fraction": float(value)})


def test_the_agent_help_states_the_configuration_range(capsys: pytest.CaptureFixture) -> None:
    from edge_agent.cli import build_parser as agent_parser

    with pytest.raises(SystemExit):
        agent_parser().parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(0.01 <= F <= 0.9)" in help_text and "0 < F < 1" not in help_text


# the constructor keywords each shipped strategy's setup_kwargs supplies, written out by hand
SETUP_KEYS = {"feddo": {"validation", "run_seed", "run_data"}, "fedaa": {"validation", "run_seed"},
              "fedmcp": {"proxy_y", "num_classes"}, "enskd": {"proxy_y", "num_classes"}}


@pytest.mark.parametrize("algorithm", sorted(SETUP_KEYS))
def test_setup_keys_name_what_setup_kwargs_supplies(algorithm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The keys ``setup_kwargs`` returns when the runtime builds the strategy are its declared
    ``setup_keys`` (which the configuration check keeps out of ``[algorithm]``)."""
    from broker_server.strategies import get_strategy_class

    cls = get_strategy_class(algorithm)
    returned: list[set[str]] = []
    original = cls.setup_kwargs.__func__  # type: ignore[attr-defined]

    def recording(klass, *args, **kw):  # the real setup_kwargs, its answer noted
        out = original(klass, *args, **kw)
        returned.append(set(out))
        return out

    monkeypatch.setattr(cls, "setup_kwargs", classmethod(recording))
    small = {"proxy_size": 100} if algorithm in ("fedmcp", "enskd") else {}  # digits' test split has 359 samples
    make_strategy(small_config(train={"algorithm": algorithm}, algorithm=small), load_dataset("digits"))
    assert returned == [SETUP_KEYS[algorithm]]
    assert set(cls.setup_keys) == SETUP_KEYS[algorithm]


@pytest.mark.parametrize("algorithm", sorted(SETUP_KEYS))
def test_a_setup_key_is_no_algorithm_key(algorithm: str) -> None:
    """A misspelt key's message lists the [algorithm] keys without those setup_kwargs supplies;
    a setup key set in [algorithm] is refused as supplied by setup_kwargs (it was a TypeError
    about a keyword given twice), and one put in another section gets no hint to move it there."""
    ds = load_dataset("digits")
    with pytest.raises(ConfigError) as info:
        make_strategy(small_config(train={"algorithm": algorithm}, algorithm={"no_such_key": 1}), ds)
    listed = str(info.value).split(" takes ", 1)[1]
    assert not any(key in listed.split(", ") for key in SETUP_KEYS[algorithm])
    for key in SETUP_KEYS[algorithm]:
        with pytest.raises(ConfigError, match=f": {key} is supplied by .*setup_kwargs from the data set and the run, "
                                              r"not an \[algorithm\] key"):
            make_strategy(small_config(train={"algorithm": algorithm}, algorithm={key: 1}), ds)
        with pytest.raises(ConfigError) as info:
            small_config(train={"algorithm": algorithm}, server={key: 1})
        assert "did you mean" not in str(info.value)


def test_a_user_strategy_s_undeclared_setup_key_in_algorithm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's strategy whose setup_kwargs supplies a keyword it does not declare in
    ``setup_keys``: setting that keyword in [algorithm] names the clash."""
    from broker_server.strategies._registry import _REGISTRY
    from broker_server.strategies.fedavg import FedAvg

    class Seeded(FedAvg):
        name = "seeded-setup-test"

        def __init__(self, *, run_seed: int = 0, **kw) -> None:
            super().__init__(**kw)
            self.run_seed = run_seed

        @classmethod
        def setup_kwargs(cls, dataset, params, seed):
            return {"run_seed": seed}

    monkeypatch.setitem(_REGISTRY._classes, Seeded.name, Seeded)  # registered for this test only
    with pytest.raises(ConfigError, match=r"run_seed is supplied by .*Seeded\.setup_kwargs from the data set and "
                                          r"the run, not an \[algorithm\] key"):
        make_strategy(small_config(train={"algorithm": "seeded-setup-test"}, algorithm={"run_seed": 4}),
                      load_dataset("digits"))
