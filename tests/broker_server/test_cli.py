"""The ``fedfleet`` command line's small promises: ``-v`` after the command, the header's
grammar and security, ``keys list`` without a key folder, and a broker error that leaves no
half-made run folder behind."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from broker_server import cli
from broker_server.config import load
from broker_server.server_main import security_text
from broker_server.simulate import discard_unstarted, run_folder_entries

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


def test_a_broker_error_leaves_no_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "runs" / "trial"
    code = cli.main(["simulate", "--config", str(QUICKSTART), "--rounds", "1", "--broker",
                     f"mqtt://127.0.0.1:{_closed_port()}", "--out", str(out)])
    assert code == cli.EXIT_BROKER
    assert "broker error" in capsys.readouterr().err
    assert not out.exists() and (tmp_path / "runs").is_dir()  # the folder --out named, only


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
    assert (out / "config.toml").exists()  # a checkpoint: resumable, left alone
    assert run_folder_entries(tmp_path / "absent") is None
