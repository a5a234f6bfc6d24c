"""The ``fedfleet`` command line's small promises: ``-v`` after the command, the header's
grammar and security, ``keys list`` without a key folder, a broker or configuration error that
leaves no half-made run folder behind, a broker not reachable at the start said as such (its URL
without its login, exit 4), the printed agent command and ``--resume`` asking for the broker's
login without showing it, and ``fedfleet server`` refusing what only a simulation
runs (``[data] partition = "classes"``), and the end-of-run line naming the final accuracy by
where it came from (the global model, the devices' own models, the algorithm's own evaluation;
none measured said in words, not ``nan``)."""

from __future__ import annotations

import pickle
import shlex
import socket
from pathlib import Path

import numpy as np
import pytest
from helpers.brokers import password_file, require_mosquitto

from broker_server import cli
from broker_server import simulate as simulate_mod
from broker_server.checkpoint import Checkpoint, CheckpointError, CheckpointStore
from broker_server.config import load
from broker_server.embedded_broker import EmbeddedBroker
from broker_server.persistence import read_summary
from broker_server.server import AggregationServer
from broker_server.server_main import (
    agent_command,
    agent_login_note,
    local_agents_hint,
    resume_broker_option,
    security_text,
    simulation_only_settings,
)
from broker_server.simulate import discard_unstarted, run_folder_entries
from edge_agent.cli import build_parser as agent_parser

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.toml"


def test_verbose_after_the_command_is_accepted_and_listed(capsys: pytest.CaptureFixture) -> None:
    p = cli.build_parser()
    for command in ("simulate", "server"):
        args = p.parse_args([command, "-v", "--config", "x.toml"])
        assert (args.verbose, args.sub_verbose) == (0, 1)
        args = p.parse_args(["-v", command, "-vv", "--config", "x.toml"])
        assert args.verbose + args.sub_verbose == 3
        with pytest.raises(SystemExit):
            p.parse_args([command, "--help"])
        assert "-v, --verbose" in capsys.readouterr().out


def test_header_grammar_and_security() -> None:
    one = load(QUICKSTART, {("data", "clients"): 1, ("run", "rounds"): 1, ("server", "quorum"): 1})
    assert cli.run_header(one) == "fedfleet simulate: digits, 1 client (dirichlet, α=1), fedavg, 1 round, unsigned"
    two = load(QUICKSTART, {("data", "clients"): 2, ("run", "rounds"): 3, ("server", "quorum"): 1,
                            ("security", "sign"): True, ("security", "encrypt"): True})
    assert cli.run_header(two, "server") == ("fedfleet server: digits, 2 clients (dirichlet, α=1), fedavg, 3 rounds, "
                                             "signed (Ed25519) + encrypted uploads (AES-256-GCM)")
    signed = load(QUICKSTART, {("security", "sign"): True})
    assert security_text(signed) == "signed (Ed25519)"
    # the file a path key names (FedDO's pre-trained policy) is in the header; none without one
    feddo = load(QUICKSTART, {("train", "algorithm"): "feddo", ("algorithm", "policy"): "/p/k100.pt"})
    assert cli.run_header(feddo) == ("fedfleet simulate: digits, 4 clients (dirichlet, α=1), feddo "
                                     "(policy /p/k100.pt), 5 rounds, unsigned")
    assert ", feddo, " in cli.run_header(load(QUICKSTART, {("train", "algorithm"): "feddo"}))
    # resumed after round N, FedDO's agent is the checkpoint's (the policy file is not read): said so;
    # a checkpoint of round 0 holds no agent yet (the file is read in round 1); other strategies as before
    assert cli.run_header(feddo, resumed_after=2) == (
        "fedfleet simulate: digits, 4 clients (dirichlet, α=1), feddo (agent from the checkpoint of round 2; started "
        "from policy /p/k100.pt), 5 rounds, unsigned")
    assert cli.run_header(feddo, resumed_after=0) == cli.run_header(feddo)
    assert ", feddo (agent from the checkpoint of round 3), " in cli.run_header(
        load(QUICKSTART, {("train", "algorithm"): "feddo"}), resumed_after=3)
    assert cli.run_header(one, resumed_after=2) == cli.run_header(one)


def test_keys_list_without_a_key_folder_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "no-keys"
    assert cli.main(["keys", "list", "--server-dir", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"server key folder {missing} does not exist" in err
    assert cli.main(["keys", "gen", "--out", str(tmp_path / "server")]) == 0
    capsys.readouterr()
    assert cli.main(["keys", "list", "--server-dir", str(tmp_path / "server")]) == 0
    cap = capsys.readouterr()
    assert cap.out == "" and f"no device is enrolled in {tmp_path / 'server'}" in cap.err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once the with ends: nobody listens there


def _unreachable(port: int) -> str:
    """What ``fedfleet`` says of a broker at 127.0.0.1:``port``, where nothing listens, at the start."""
    return (f"fedfleet: broker error: the server could not connect to the broker at mqtt://127.0.0.1:{port}: cannot "
            f"reach the MQTT broker at 127.0.0.1:{port}: Connection refused. Is the broker running, and are the host "
            "and port right?\n")


def test_a_broker_error_leaves_no_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "runs" / "trial"
    port = _closed_port()
    code = cli.main(["simulate", "--config", str(QUICKSTART), "--rounds", "1", "--broker",
                     f"mqtt://fleet-op:s3cret@127.0.0.1:{port}", "--out", str(out)])
    assert code == cli.EXIT_BROKER
    captured = capsys.readouterr()
    assert captured.err == _unreachable(port)  # the URL without its login
    assert "s3cret" not in captured.out and "stopped by the broker link" not in captured.out
    assert not out.exists() and (tmp_path / "runs").is_dir()  # the folder --out named, only


def test_a_broker_the_server_cannot_reach_at_the_start_is_said_so_not_as_a_stopped_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Nothing listens at the ``--broker`` given: ``fedfleet server`` says, in one line, that it
    could not connect to the broker at that URL (its login left out) and why, and exits 4; a
    ``--resume`` (a run folder holding a checkpoint) is no run "stopped by the broker link", and
    gets no line saying how to continue it (it did not start)."""
    header = "fedfleet server: digits, 4 clients (dirichlet, α=1), fedavg, 5 rounds, unsigned\n"
    run = tmp_path / "run"
    port = _closed_port()
    login = f"mqtt://fleet-op:s3cret@127.0.0.1:{port}"
    assert cli.main(["server", "--config", str(QUICKSTART), "--broker", login, "--out", str(run)]) == cli.EXIT_BROKER
    assert capsys.readouterr() == (header, _unreachable(port))
    assert not run.exists()

    def stop_after_joins(self: AggregationServer):
        self._checkpoint(accuracy=None)
        raise KeyboardInterrupt

    monkeypatch.setattr(AggregationServer, "run", stop_after_joins)
    assert cli.main(["server", "--config", str(QUICKSTART), "--out", str(run)]) == cli.EXIT_INTERRUPTED
    assert "fedfleet server: interrupted;" in capsys.readouterr().out  # a run folder with its round-0 checkpoint
    assert cli.main(["server", "--resume", str(run), "--broker", login]) == cli.EXIT_BROKER
    assert capsys.readouterr() == (header, _unreachable(port))


def test_a_wrong_password_is_said_as_the_brokers_refusal_not_as_a_timeout(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Mosquitto with a password file refuses the server's wrong password at once: ``fedfleet
    server`` says the broker refused the login, with its CONNACK's reason and no time limit (none
    was waited out), exits 4 and leaves no run folder; neither the user name nor the password is
    printed."""
    require_mosquitto()
    pw = password_file(tmp_path / "passwd", "fleet-op", "s3cret-pw")
    run = tmp_path / "run"
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "broker",
                        extra_config=[f"password_file {pw}", "allow_anonymous false"]) as broker:
        login = f"mqtt://fleet-op:wr0ng-pw@127.0.0.1:{broker.port}"
        code = cli.main(["server", "--config", str(QUICKSTART), "--broker", login, "--out", str(run)])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_BROKER
    assert err == (f"fedfleet: broker error: the server could not connect to the broker at {broker.url}: the MQTT "
                   f"broker at 127.0.0.1:{broker.port} refused the login of 'run:server': Not authorized (MQTT 5 "
                   "CONNACK reason code 0x87); check the user name and password it was given (neither is shown "
                   "here) and the broker's password file and ACL\n")
    assert "fleet-op" not in out + err and "wr0ng" not in out + err and not run.exists()


def test_the_agent_command_leaves_the_brokers_login_out_and_asks_for_each_agents_own() -> None:
    cfg = load(QUICKSTART)
    login = "mqtt://fleet-op:s3cr%40t@Broker.lan:1884"
    words = shlex.split(agent_command(cfg, login, "fed"))
    assert words[:9] == ["fedfleet-agent", "--broker", "mqtt://broker.lan:1884", "--username", "USER",
                         "--password-file", "PASSWORD_FILE", "--federation", "fed"]
    args = agent_parser().parse_args(words[1:])  # the agent takes them as they are printed
    assert (args.broker, args.username, args.password_file) == ("mqtt://broker.lan:1884", "USER", "PASSWORD_FILE")
    note = ("  the broker's user name and password are left out: USER is each agent's MQTT user name, PASSWORD_FILE "
            "a file holding its password")
    assert agent_login_note(cfg, login) == note
    # the server's login from [broker] username / password_file: its agents need one too
    by_file = load(QUICKSTART, {("broker", "username"): "fleet-op", ("broker", "password_file"): "/etc/fed/pw"})
    assert shlex.split(agent_command(by_file, "mqtt://broker.lan:1884", "fed"))[:7] == words[:7]
    assert agent_login_note(by_file, "mqtt://broker.lan:1884") == note
    # no login: none asked for
    plain = agent_command(cfg, "mqtt://broker.lan", "fed")
    assert plain.startswith("fedfleet-agent --broker mqtt://broker.lan:1883 --federation fed --client-id DEVICE_ID ")
    assert "--username" not in plain and agent_login_note(cfg, "mqtt://broker.lan") == ""


def test_a_simulation_over_a_broker_with_a_login_names_the_broker_without_it(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``[broker] url`` with a user name and password: ``fedfleet simulate``'s lines, its
    ``summary.json`` and every file of its run folder name the broker without them; a
    ``--resume`` it prints asks for them in placeholders."""
    require_mosquitto()  # a broker that takes any user name and password (amqtt's may not)
    run = tmp_path / "run"
    config = tmp_path / "login.toml"
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "broker") as broker:
        config.write_text(f'{QUICKSTART.read_text(encoding="utf-8")}\n[broker]\n'
                          f'url = "mqtt://fleet-op:s3cr%40t@127.0.0.1:{broker.port}"\n', encoding="utf-8")
        code = cli.main(["simulate", "--config", str(config), "--rounds", "1", "--clients", "2", "--out", str(run),
                         "-q"])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_OK, err
    assert f" s over {broker.url}; final " in out and read_summary(run)["broker"] == broker.url
    seen = [p.name for p in run.rglob("*")
            if p.is_file() and (b"fleet-op" in (data := p.read_bytes()) or b"s3cr" in data)]
    assert seen == [] and "s3cr" not in out + err and "fleet-op" not in out + err
    assert cli._login_broker_option(load(config)) == f" --broker mqtt://USER:PASSWORD@127.0.0.1:{broker.port}"
    assert cli._login_broker_option(load(QUICKSTART)) == ""


@pytest.mark.parametrize(("url", "option"), [
    ("mqtt://fleet-op:s3cret@broker.lan:1884", "mqtt://USER:PASSWORD@broker.lan:1884"),
    ("mqtts://fleet-op@broker.lan", "mqtts://USER:PASSWORD@broker.lan:8883"),
    ("mqtt://broker.lan", "mqtt://broker.lan:1883"),
    ("http://fleet-op:s3cret@broker.lan", "http://fleet-op:***@broker.lan"),  # not a broker URL: no password either
])
def test_a_printed_resume_asks_for_the_brokers_login_without_showing_it(url: str, option: str) -> None:
    assert resume_broker_option(url) == option


def test_discard_unstarted_removes_only_what_the_run_wrote(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = run_folder_entries(out)
    (out / "config.toml").write_text("x")
    (out / "broker").mkdir()
    (out / "broker" / "mosquitto.conf").write_text("x")
    discard_unstarted(out, before)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    (out / "checkpoints.sqlite").write_text("a run that started")
    (out / "config.toml").write_text("x")
    discard_unstarted(out, before)
    assert (out / "config.toml").exists()  # a store that cannot be read: kept as a run's
    assert run_folder_entries(tmp_path / "absent") is None


def test_an_empty_checkpoint_store_is_no_started_run(tmp_path: Path) -> None:
    """The server opens ``checkpoints.sqlite`` as it is built, before its first checkpoint (round 0,
    written once the fleet joined): a start-up failure after that removes the folder; a store
    holding a checkpoint keeps it."""
    for rows, kept in ((0, False), (1, True)):
        out = tmp_path / f"run{rows}"
        out.mkdir()
        (out / "config.toml").write_text("x")
        store = CheckpointStore(out / "checkpoints.sqlite")
        for _ in range(rows):
            store.save(Checkpoint(round=0, tensors=[], strategy_state={}, rng_state={}, registry=[], meta={}))
        store.close()
        discard_unstarted(out, None)
        assert out.exists() == kept
        if kept:
            assert sorted(p.name for p in out.iterdir()) == ["checkpoints.sqlite", "config.toml"]


def test_the_latest_checkpoints_round_and_meta_are_read_without_writing(tmp_path: Path) -> None:
    """``CheckpointStore.latest_round`` / ``latest_meta`` read a store left open (a killed server's,
    in WAL mode) through a read-only connection: the newest round and its meta, no file written."""
    path = tmp_path / "checkpoints.sqlite"
    assert CheckpointStore.latest_meta(path) is None and CheckpointStore.latest_round(path) is None
    store = CheckpointStore(path)
    assert CheckpointStore.latest_meta(path) is None and CheckpointStore.latest_round(path) is None  # no row
    for r, meta in ((0, {}), (2, {"accuracy": 0.5}), (1, {"pending_line": {"round": 1}})):
        store.save(Checkpoint(round=r, tensors=[np.zeros(3, np.float32)], strategy_state={}, rng_state={},
                              registry=[], meta=meta))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert CheckpointStore.latest_meta(path) == (2, {"accuracy": 0.5}) and CheckpointStore.latest_round(path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == files
    store.close()
    (tmp_path / "bad.sqlite").write_bytes(b"not a database at all" * 10)
    with pytest.raises(CheckpointError, match="cannot read the checkpoints in"):
        CheckpointStore.latest_meta(tmp_path / "bad.sqlite")


def _toml(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "cfg.toml"
    path.write_text(QUICKSTART.read_text() + extra)
    return path


@pytest.mark.parametrize("command", ["simulate", "server"])
def test_a_missing_key_folder_is_said_before_the_run_folder_is_made(tmp_path: Path, command: str,
                                                                    capsys: pytest.CaptureFixture) -> None:
    cfg = _toml(tmp_path, f'\n[security]\nsign = true\nkey_dir = "{tmp_path / "nokeys"}"\n')
    out = tmp_path / "runs" / "trial"
    assert cli.main([command, "--config", str(cfg), "--rounds", "1", "--out", str(out)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"{cfg}: [security] key_dir = '{tmp_path / 'nokeys'}': key folder {tmp_path / 'nokeys'} does not exist" \
        in err, err
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_a_configuration_error_after_the_run_folder_was_made_removes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The key folder's check skipped: the same error comes from the fleet's keys, once
    config.toml and partition.json are written; the run never started, so they go, as after a
    broker error."""
    monkeypatch.setattr(simulate_mod, "check_server_keys", lambda cfg, simulated: None)
    cfg = _toml(tmp_path, f'\n[security]\nsign = true\nkey_dir = "{tmp_path / "nokeys"}"\n')
    out = tmp_path / "runs" / "trial"
    assert cli.main(["simulate", "--config", str(cfg), "--rounds", "1", "--out", str(out)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"{cfg}: [security]: key folder {tmp_path / 'nokeys'} does not exist" in err, err
    assert not out.exists() and (tmp_path / "runs").is_dir()  # the folder --out named, only


def test_the_server_refuses_a_simulation_only_partition(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``partition = "classes"``: refused at start naming the key, the value and exactly the
    schemes ``fedfleet-agent --partition`` takes; nothing is written. ``simulate`` takes it."""
    cfg = _toml(tmp_path, "").read_text().replace('partition = "dirichlet"', 'partition = "classes"')
    (tmp_path / "cfg.toml").write_text(cfg)
    out = tmp_path / "runs" / "trial"
    assert cli.main(["server", "--config", str(tmp_path / "cfg.toml"), "--out", str(out)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    choices = next(a.choices for a in agent_parser()._actions if "--partition" in a.option_strings)
    assert sorted(choices) == ["dirichlet", "domain-silo", "iid"]
    assert (f"{tmp_path / 'cfg.toml'}: [data] partition = 'classes' is simulation-only (fedfleet simulate): a fleet "
            "of fedfleet-agent devices takes 'dirichlet', 'domain-silo', 'iid'") in err, err
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_the_server_names_its_unused_agents_settings_as_the_configuration_file_writes_them(tmp_path: Path) -> None:
    """``fedfleet server``'s warning and ``summary.json``'s ``ignored_settings`` quote each unused
    ``[agents]`` setting in TOML, as the file has it (``true``, a double-quoted string), so that
    the text can be found in the file and pasted back: each one reads back as the same value."""
    import tomllib

    path = tmp_path / "fleet.toml"
    path.write_text('[data]\ndataset = "digits"\n[agents]\nprofile = "rpi4"\ntrain_slots = 2\n'
                    'emulate_link = true\n', encoding="utf-8")
    texts = simulation_only_settings(load(path))
    assert texts == ['profile = "rpi4"', "train_slots = 2", "emulate_link = true"]
    assert tomllib.loads("\n".join(texts)) == {"profile": "rpi4", "train_slots": 2, "emulate_link": True}
    assert simulation_only_settings(load(QUICKSTART)) == []


def _fake_audit(run_dir) -> dict:
    """The part of an audit report the end-of-run lines read (bytes of the device links)."""
    side = {"wire_bytes": 1000}
    return {"totals": {"device": {"up": side, "down": side, "all": {"overhead_share": 0.0}}}, "by_kind": []}


@pytest.mark.parametrize(("source", "accuracy", "said"), [
    ("global", 0.8125, "final test accuracy 0.8125"),
    ("clients", 0.8125, "final test accuracy of the devices' own models (mean over clients) 0.8125"),
    ("strategy", 0.25, "final accuracy from the algorithm's own evaluation 0.2500"),
    (None, float("nan"), "no accuracy was measured"),
])
def test_the_end_of_a_run_names_where_its_final_accuracy_came_from(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, source, accuracy, said) -> None:
    import broker_server.audit as audit_mod

    monkeypatch.setattr(audit_mod, "audit_report", _fake_audit)
    cli._print_summary(tmp_path, accuracy, 3, 1.0, "amqtt", accuracy_source=source, total_rounds=3)
    first = [line for line in capsys.readouterr().out.splitlines() if line.startswith("finished")]
    assert first == [f"finished 3 rounds of 3 in 1.0 s over amqtt; {said}"]


def test_a_damaged_device_state_file_on_resume_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A SCAFFOLD run stopped after round 1 (its on_round raises), its devices' state file then
    overwritten with a row of another model: ``--resume`` exits 1 with one line naming the file
    and what does not fit, no traceback."""
    import sqlite3

    from edge_agent.state_store import DeviceStateStore

    cfg = load(QUICKSTART, {("data", "clients"): 2, ("run", "rounds"): 2, ("server", "quorum"): 2,
                            ("train", "algorithm"): "scaffold", ("data", "dataset"): "digits"})
    run = tmp_path / "run"

    def stop(m) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        simulate_mod.simulate(cfg, run_dir=run, on_round=stop)
    state = run / simulate_mod.DEVICE_STATE_FILE
    store = DeviceStateStore(state)
    assert store.rounds("client-000")  # kept while the run is unfinished
    store.put("client-000", 1, {"control": np.zeros(5)})
    store.close()
    capsys.readouterr()
    code = cli.main(["simulate", "--resume", str(run)])
    err = capsys.readouterr().err
    assert code == cli.EXIT_FAILED, err
    assert "Traceback" not in err
    assert f"({state})" in err and "the kept c_i has 5 entries" in err
    con = sqlite3.connect(state)
    assert con.execute("select count(*) from device_state").fetchone()[0] > 0  # nothing was thrown away
    con.close()


@pytest.mark.parametrize("command", ["simulate", "server"])
def test_resume_of_a_folder_that_is_not_a_run_says_which(tmp_path: Path, command: str,
                                                          capsys: pytest.CaptureFixture) -> None:
    """``--resume`` of a missing folder, or of a folder without the config.toml a run writes, exits 2
    naming the folder and what is wrong with it (not a missing configuration file), and makes nothing."""
    missing = tmp_path / "runs" / "nonexistent"
    assert cli.main([command, "--resume", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--resume {missing}: no such run folder" in err, err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main([command, "--resume", str(empty)]) == 2
    err = capsys.readouterr().err
    assert f"--resume {empty}: the folder holds no config.toml" in err, err
    assert not missing.exists() and list(empty.iterdir()) == []
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x", encoding="utf-8")
    assert cli.main([command, "--resume", str(a_file)]) == 2
    assert f"--resume {a_file}: a file, not a run folder" in capsys.readouterr().err
    # an empty path is refused, never taken as no --resume (with --config, a fresh run would start)
    assert cli.main([command, "--resume", ""]) == 2
    assert "--resume : an empty path" in capsys.readouterr().err


def test_resume_of_a_folder_this_user_may_not_enter_is_one_line(tmp_path: Path, monkeypatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """A run folder the user may not enter (chmod 000 as another user: root enters any, so the
    denial is made here) is a configuration error naming the reason, not a traceback."""
    run = tmp_path / "locked"
    run.mkdir()
    real = Path.is_file

    def denied(self: Path) -> bool:
        if self.parent == run:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "is_file", denied)
    assert cli.main(["simulate", "--resume", str(run)]) == 2
    assert f"--resume {run}: the run folder cannot be read (Permission denied)" in capsys.readouterr().err


def test_a_relative_path_key_is_made_absolute_for_the_run_folder(tmp_path: Path, monkeypatch) -> None:
    """FedDO's policy (a strategy's path_keys) is written into the run's configuration as an
    absolute path against the current folder, ``~`` expanded; other algorithms and keys are left."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    text = QUICKSTART.read_text(encoding="utf-8").replace('algorithm = "fedavg"', 'algorithm = "feddo"')
    for given, want in (("p/feddo_policy.pt", tmp_path / "p" / "feddo_policy.pt"),
                        ("~/pol.pt", tmp_path / "home" / "pol.pt"), ("/abs/pol.pt", Path("/abs/pol.pt"))):
        path = tmp_path / "c.toml"
        path.write_text(text + f'\n[algorithm]\npolicy = "{given}"\n', encoding="utf-8")
        made = cli.absolute_path_keys(load(path))
        assert made.algorithm["policy"] == str(want)
        # a relative one remembers how it was given and the folder it was read from (an error
        # reading it says so); the run's config.toml gets the absolute path, and a copy keeps both
        relative = not given.startswith(("~", "/"))
        assert (getattr(made.algorithm["policy"], "given", None), getattr(made.algorithm["policy"], "folder", None)) \
            == ((given, str(tmp_path)) if relative else (None, None))
        assert f'policy = "{want}"' in made.to_toml()
        copied = pickle.loads(pickle.dumps(made.algorithm["policy"]))
        assert (copied, getattr(copied, "given", None)) == (str(want), given if relative else None)
    plain = load(QUICKSTART)
    assert cli.absolute_path_keys(plain) is plain


def test_the_configuration_s_own_file_keys_are_made_absolute_for_a_resume_from_elsewhere(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    """The broker's login and TLS files, the key folder and the data folder are read from the
    current folder: the run's config.toml names them absolute, so a ``--resume`` started from
    another folder still finds them; absolute and empty ones are left as given."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "c.toml"
    path.write_text(QUICKSTART.read_text(encoding="utf-8")
                    + '\n[broker]\nusername = "op"\npassword_file = "pw"\nca_file = "/etc/ca.pem"\n'
                      '[security]\nkey_dir = "../keys"\n', encoding="utf-8")
    made = cli.absolute_path_keys(load(path))
    assert (made.broker.password_file, made.broker.ca_file, made.broker.cert_file) == (
        str(tmp_path / "pw"), "/etc/ca.pem", "")
    assert made.security.key_dir == str(tmp_path.parent / "keys")
    assert getattr(made.broker.password_file, "given", None) == "pw"
    assert f'password_file = "{tmp_path / "pw"}"' in made.to_toml()


@pytest.mark.parametrize(("url", "agents", "cores"), [
    ("mqtt://127.0.0.1:1883", 4, 2),
    ("mqtt://LOCALHOST.:1883", 4, 16),  # host names are matched in lower case, a final dot dropped
    ("mqtts://[::1]:8883", 1, 8),
    ("mqtt://127.0.0.2:1883", 2, 4),    # all of 127/8 is loopback
    ("mqtt://[::ffff:127.0.0.1]:1883", 4, 2),  # IPv4-mapped
])
def test_the_server_tells_agents_on_its_machine_to_train_on_one_thread(url, agents, cores) -> None:
    text = local_agents_hint(url, agents, cores)
    assert "add --torch-threads 1 to each" in text
    assert f"otherwise train on all {cores} cores, and {agents} agent{'s' if agents > 1 else ''} beside" in text


@pytest.mark.parametrize("url", ["mqtt://broker.lan:1883", "mqtt://10.0.0.5:1883", "mqtts://user@192.168.1.2"])
def test_no_thread_hint_for_a_broker_on_another_host(url) -> None:
    assert local_agents_hint(url, 4, 2) == ""


@pytest.mark.parametrize(("argv", "error"), [
    (["simulate", "--config", "x.toml", "--rouns", "1"],
     "fedfleet simulate: error: unrecognized arguments: --rouns 1; did you mean --rounds?"),
    (["server", "--resume", "r", "--rouns=1", "--sed", "3"],
     "fedfleet server: error: unrecognized arguments: --rouns=1 --sed 3; did you mean --rounds (for --rouns), "
     "--seed (for --sed)?"),
    (["simulate", "--config", "x.toml", "--frobnicate"],
     "fedfleet simulate: error: unrecognized arguments: --frobnicate"),
    (["keys", "gen", "--out", "d", "--forse"],
     "fedfleet keys gen: error: unrecognized arguments: --forse; did you mean --force?"),
], ids=["simulate", "server-two", "no-suggestion", "nested-command"])
def test_an_unknown_option_is_reported_by_its_command_with_a_suggestion(argv: list[str], error: str,
                                                                        capsys: pytest.CaptureFixture) -> None:
    """The command's parser reports what it does not know, with its own usage (not ``fedfleet``'s,
    which lists the commands only) and the option of its own that is closest to a misspelt one."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    command = error.split(":")[0]
    assert err.startswith(f"usage: {command} [-h]"), err
    assert err.endswith(f"\n{error}\n"), err


def test_every_exit_code_is_explained_in_the_module_docstring() -> None:
    """Numbered codes are never reused: each ``EXIT_*`` of ``fedfleet`` has its help text."""
    codes = {k: v for k, v in vars(cli).items() if k.startswith("EXIT_") and isinstance(v, int)}
    assert sorted(codes.values()) == [*range(6), 130]
    for value in codes.values():
        assert f"; {value} " in cli.__doc__ or f": {value} " in cli.__doc__, value
        assert f" {value} " in cli.EXIT_CODES_HELP, value
    assert cli.EXIT_CODES_HELP in " ".join(cli.build_parser().format_help().split())  # fedfleet --help lists them
