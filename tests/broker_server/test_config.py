"""Tests of broker_server.config: example files, strict checking of keys/types/ranges, TOML round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import tomllib

from broker_server import config as C
from broker_server.errors import ConfigError, FedfleetServerError

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.toml"))
SECTIONS = ("run", "data", "train", "server", "broker", "protocol", "agents", "security", "model", "tracking")


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def assert_same_sections(a: C.Config, b: C.Config) -> None:
    for sec in SECTIONS:
        assert getattr(a, sec) == getattr(b, sec), sec
        for f in dataclasses.fields(getattr(a, sec)):
            assert type(getattr(getattr(a, sec), f.name)) is type(getattr(getattr(b, sec), f.name)), (sec, f.name)


# ------------------------------------------------------------------------------------------
# Example files


def test_both_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {"mnist-fedavg.toml", "quickstart.toml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads(path: Path) -> None:
    cfg = C.load(path)
    assert cfg.source == str(path)
    # every key written in the file is what the loader returns
    raw = tomllib.loads(path.read_text(encoding="utf-8"))
    for sec, table in raw.items():
        section = getattr(cfg, sec)
        for key, value in table.items():
            got = section[key] if isinstance(section, dict) else getattr(section, key)  # [algorithm] is a dict
            if (sec, key) == ("model", "group"):  # stored as a tuple; as written: a list, or a table by profile
                got = section.group_spec()
            assert got == value, (sec, key)


def test_mnist_example_values() -> None:
    cfg = C.load(REPO / "examples" / "mnist-fedavg.toml")
    assert cfg.data.dataset == "mnist"
    assert cfg.data.clients == 10
    assert cfg.data.partition == "dirichlet"
    assert cfg.data.alpha == 0.5
    assert cfg.train.local_epochs == 1
    assert cfg.run.rounds == 10
    assert cfg.train.algorithm == "fedavg"


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    cfg = C.load(write(tmp_path, ""))
    assert_same_sections(cfg, C.Config())


# ------------------------------------------------------------------------------------------
# Refusals


def test_unknown_section(tmp_path: Path) -> None:
    p = write(tmp_path, "[trian]\nlr = 0.1\n")
    with pytest.raises(ConfigError) as info:
        C.load(p)
    msg = str(info.value)
    assert str(p) in msg and "trian" in msg
    for sec in SECTIONS:
        assert sec in msg


def test_unknown_key_names_file_section_key_and_allowed_keys(tmp_path: Path) -> None:
    p = write(tmp_path, "[train]\nlocal_epoch = 2\n")
    with pytest.raises(ConfigError) as info:
        C.load(p)
    msg = str(info.value)
    assert str(p) in msg
    assert "[train]" in msg
    assert "local_epoch" in msg
    for key in ("algorithm", "local_epochs", "batch_size", "lr", "momentum", "weight_decay"):
        assert key in msg


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[server\]"):
        C.load(write(tmp_path, "server = 5\n"))


@pytest.mark.parametrize(("text", "where"), [
    pytest.param('[run]\nrounds = "10"\n', "[run] rounds", id="string-for-int"),
    pytest.param("[run]\nrounds = true\n", "[run] rounds", id="bool-for-int"),
    pytest.param("[run]\nrounds = 10.0\n", "[run] rounds", id="float-for-int"),
    pytest.param("[train]\nlr = true\n", "[train] lr", id="bool-for-float"),
    pytest.param('[train]\nlr = "0.1"\n', "[train] lr", id="string-for-float"),
    pytest.param("[run]\nname = 5\n", "[run] name", id="int-for-string"),
    pytest.param("[data]\nclients = [10]\n", "[data] clients", id="array-for-int"),
])
def test_wrong_type(tmp_path: Path, text: str, where: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        C.load(p)
    assert where in str(info.value) and str(p) in str(info.value)


@pytest.mark.parametrize(("text", "where"), [
    pytest.param("[data]\nalpha = 0.0\n", "[data] alpha", id="alpha-0"),
    pytest.param("[data]\nalpha = -1.0\n", "[data] alpha", id="alpha-negative"),
    pytest.param("[run]\nrounds = 0\n", "[run] rounds", id="rounds-0"),
    pytest.param("[server]\nparticipation_rate = 1.5\n", "[server] participation_rate", id="rate-1.5"),
    pytest.param("[server]\nparticipation_rate = 0.0\n", "[server] participation_rate", id="rate-0"),
    pytest.param("[protocol]\nqos = 2\n", "[protocol] qos", id="qos-2"),
    pytest.param('[protocol]\ncodec = "fp17"\n', "[protocol] codec", id="unknown-codec"),
    pytest.param('[data]\npartition = "shards"\n', "[data] partition", id="unknown-partition"),
    pytest.param('[broker]\nkind = "emqx"\n', "[broker] kind", id="unknown-broker-kind"),
    pytest.param('[server]\nglobal_delivery = "multicast"\n', "[server] global_delivery",
                 id="unknown-global-delivery"),
    pytest.param('[server]\noverlap_evaluation = "on"\n', "[server] overlap_evaluation",
                 id="unknown-overlap-evaluation"),
    pytest.param("[train]\nlr = nan\n", "[train] lr", id="lr-nan"),
    pytest.param("[train]\nmomentum = 1.5\n", "[train] momentum", id="momentum-1.5"),
    pytest.param("[server]\nround_deadline_s = inf\n", "[server] round_deadline_s", id="deadline-inf"),
    pytest.param("[data]\nclients = 0\n", "[data] clients", id="clients-0"),
    pytest.param("[server]\neval_every = 0\n", "[server] eval_every", id="eval-every-0"),
    pytest.param("[server]\neval_every = -3\n", "[server] eval_every", id="eval-every-negative"),
    pytest.param("[server]\neval_every = 2.5\n", "[server] eval_every", id="eval-every-float"),
])
def test_out_of_range(tmp_path: Path, text: str, where: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        C.load(p)
    assert where in str(info.value) and str(p) in str(info.value)


NOTE = " (the file's own value, checked although the command line overrides it)"


@pytest.mark.parametrize(("text", "override", "message"), [
    pytest.param('[run]\nrounds = "3"\n', (("run", "rounds"), 1), "[run] rounds: expected an integer, got '3'",
                 id="string-rounds"),
    pytest.param("[run]\nseed = -1\n", (("run", "seed"), 7),
                 f"[run] seed = -1 is outside the allowed range [0, {2**63 - 1}]", id="negative-seed"),
    pytest.param("[data]\nclients = 2.0\n", (("data", "clients"), 3), "[data] clients: expected an integer, got 2.0",
                 id="float-clients"),
    pytest.param("[data]\ndata_dir = 5\n", (("data", "data_dir"), "/d"), "[data] data_dir: expected a string, got 5",
                 id="int-data-dir"),
    pytest.param('[tracking]\ntensorboard = "yes"\n', (("tracking", "tensorboard"), True),
                 "[tracking] tensorboard: expected true/false, got 'yes'", id="string-tensorboard"),
])
def test_a_bad_value_is_refused_even_where_an_override_replaces_it(tmp_path: Path, text: str, override: tuple,
                                                                  message: str) -> None:
    """The file's own value is checked (type, range) before an override (a command-line option)
    replaces it: ``rounds = "3"`` is as wrong with ``--rounds 1`` as without."""
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as plain:
        C.load(p)
    assert str(plain.value) == f"{p}: {message}"
    with pytest.raises(ConfigError) as over:
        C.load(p, dict([override]))
    assert str(over.value) == f"{p}: {message}{NOTE}"


def test_the_command_line_refuses_a_bad_value_it_overrides(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from broker_server import cli

    p = write(tmp_path, '[run]\nrounds = "3"\n[data]\nclients = 3\n')
    assert cli.main(["simulate", "--config", str(p), "--rounds", "1", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (f"fedfleet: configuration error: {p}: [run] rounds: expected an integer, got "
                                       f"'3'{NOTE}\n")
    assert not (tmp_path / "run").exists()


def test_an_override_may_still_make_the_file_consistent(tmp_path: Path) -> None:
    """Only each value on its own is checked before the overrides: ``quorum = 5`` over the file's
    ``clients = 4`` is made consistent by ``clients = 5``."""
    p = write(tmp_path, "[data]\nclients = 4\n[server]\nquorum = 5\n")
    assert C.load(p, {("data", "clients"): 5}).server.quorum == 5


def test_eval_every_is_read_and_a_bad_value_says_what_is_allowed(tmp_path: Path) -> None:
    assert C.load(write(tmp_path, "[run]\nrounds = 7\n")).server.eval_every == 1  # every round by default
    assert C.load(write(tmp_path, "[server]\neval_every = 5\n")).server.eval_every == 5
    p = write(tmp_path, "[server]\neval_every = 0\n")
    with pytest.raises(ConfigError) as info:
        C.load(p)
    assert str(info.value) == f"{p}: [server] eval_every = 0 is outside the allowed range [1, {1 << 30}]"


def test_quorum_above_clients(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="quorum"):
        C.load(write(tmp_path, "[data]\nclients = 4\n[server]\nquorum = 5\n"))
    assert C.load(write(tmp_path, "[data]\nclients = 5\n[server]\nquorum = 5\n")).server.quorum == 5


def test_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        C.load(p)
    assert str(p) in str(info.value)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        C.load(tmp_path)


def test_invalid_toml(tmp_path: Path) -> None:
    p = write(tmp_path, "[run\nrounds = = 3\n")
    with pytest.raises(ConfigError) as info:
        C.load(p)
    assert str(p) in str(info.value)
    assert isinstance(info.value.__cause__, tomllib.TOMLDecodeError)


def test_config_error_is_a_server_error() -> None:
    assert issubclass(ConfigError, FedfleetServerError)


def test_replace_revalidates() -> None:
    cfg = C.Config()
    assert cfg.replace("train", lr=0.1).train.lr == 0.1
    assert cfg.train.lr == 0.05, "replace returns a copy"
    with pytest.raises(ConfigError):
        cfg.replace("protocol", qos=2)


# ------------------------------------------------------------------------------------------
# Coercion and TOML round trip


def test_int_for_float_key_is_accepted(tmp_path: Path) -> None:
    cfg = C.load(write(tmp_path, "[train]\nlr = 1\n[server]\nround_deadline_s = 60\n"))
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float
    assert cfg.server.round_deadline_s == 60.0 and type(cfg.server.round_deadline_s) is float


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_to_toml_round_trips_examples(tmp_path: Path, path: Path) -> None:
    cfg = C.load(path)
    text = cfg.to_toml()
    again = C.load(write(tmp_path, text, "resolved.toml"))
    assert_same_sections(again, cfg)
    assert again.algorithm == cfg.algorithm
    # the resolved file names every section and every key (and [algorithm] when the file has one)
    raw = tomllib.loads(text)
    assert tuple(raw) == SECTIONS + (("algorithm",) if cfg.algorithm else ())
    for sec in SECTIONS:
        assert set(raw[sec]) == {f.name for f in dataclasses.fields(getattr(cfg, sec))}


def test_to_toml_round_trips_defaults_and_awkward_values(tmp_path: Path) -> None:
    cfg = C.from_dict({
        "run": {"name": 'say "hi" \\ there', "seed": 2**63 - 1, "out": "C:\\runs\\é"},
        "data": {"alpha": 1e-6, "clients": 3},
        "train": {"lr": 1, "weight_decay": 5e-4},
        "server": {"participation_rate": 1e-9, "quorum": 3, "round_deadline_s": 0.1},
        "broker": {"url": "mqtts://broker.example:8883", "password_file": "/etc/fed/pw"},
    })
    again = C.load(write(tmp_path, cfg.to_toml()))
    assert_same_sections(again, cfg)
    default_again = C.load(write(tmp_path, C.Config().to_toml(), "defaults.toml"))
    assert_same_sections(default_again, C.Config())


@pytest.mark.parametrize(("url", "written"), [
    ("mqtt://fleet-op:s3cr%40t@Broker.lan:1884",
     '# url: the user name and password it was given with are left out of this copy; a --resume needs --broker '
     'mqtt://USER:PASSWORD@broker.lan:1884\nurl = "mqtt://broker.lan:1884"\n'),
    ("mqtts://fleet-op@broker.lan",
     '# url: the user name and password it was given with are left out of this copy; a --resume needs --broker '
     'mqtts://USER:PASSWORD@broker.lan:8883\nurl = "mqtts://broker.lan:8883"\n'),
    ("mqtt://broker.lan", 'url = "mqtt://broker.lan:1883"\n'),
    ("http://fleet-op:s3cret@broker.lan", 'url = "http://fleet-op:***@broker.lan"\n'),  # the transport refuses it
])
def test_to_toml_leaves_the_brokers_login_out(url: str, written: str) -> None:
    """The run folder's copy of a configuration holds no broker password: ``[broker] url`` without
    its user name and password, under a comment naming what a --resume needs instead."""
    text = C.load(REPO / "examples" / "quickstart.toml", {("broker", "url"): url}).to_toml()
    assert f"\n[broker]\n{written}kind = " in text
    assert "s3cr" not in text


def test_to_toml_round_trips_control_characters(tmp_path: Path) -> None:
    cfg = C.load(write(tmp_path, '[run]\nname = "line1\\nline2\\u0001"\n'))
    assert cfg.run.name == "line1\nline2\x01"
    again = C.load(write(tmp_path, cfg.to_toml(), "resolved.toml"))
    assert_same_sections(again, cfg)
