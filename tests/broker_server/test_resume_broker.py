"""Which broker a resumed ``fedfleet server`` goes on with.

A server session records its broker in the run folder's ``broker.json`` once it is connected:
the URL without user name or password, and whether it was the embedded broker it started
itself. ``--resume`` without ``--broker`` goes on with a recorded broker it was given (said in
one line naming the URL; refused, naming the ``--broker`` option to pass, when the URL's
credentials are needed and not kept); a run whose own embedded broker stopped with it starts a
new one and says in a WARNING that the agents must be started again with its URL, naming both;
a ``--broker`` other than the recorded one is said in a WARNING naming both; a run folder
without a record (written before it was kept), or with one that cannot be read, is said to have
an unknown broker, with what the session does instead. A user name or password in the broker's
URL is in nothing a session prints, logs or writes (the run folder's config.toml included): where
a resume needs them, the command it is told asks for them in placeholders.

The servers here are real (``fedfleet server`` through :func:`broker_server.cli.main`, on the
embedded broker or one started by the test): each session stops as Ctrl-C would once its
fleet would have joined (``AggregationServer.run`` replaced: the round-0 checkpoint written,
then ``KeyboardInterrupt``), so no agent is needed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

import pytest
from helpers.brokers import require_mosquitto

from broker_server import cli
from broker_server.config import load
from broker_server.embedded_broker import EmbeddedBroker
from broker_server.errors import ConfigError
from broker_server.persistence import (
    BrokerRecord,
    broker_record,
    read_broker_record,
    read_summary,
    write_broker_record,
)
from broker_server.server import AggregationServer, RunSummary
from broker_server.server_main import session_broker
from protocol.broker_url import has_login, login_placeholder_url, public_broker_url, shown_broker_url

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml"


def _serve(*argv: str) -> int:
    return cli.main(["server", *argv])


def _record(run: Path) -> dict:
    return json.loads((run / "broker.json").read_text(encoding="utf-8"))


def _served_on(out: str, run: Path) -> str:
    """The broker URL of the session's ``federation 'NAME' on URL`` line."""
    found = re.findall(rf"federation '{run.name}' on (\S+) \(unsigned\)", out)
    assert len(found) == 1, out
    return found[0]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    said = [r.getMessage() for r in caplog.records if r.name == "broker_server.server_main"
            and r.levelno == logging.WARNING]
    caplog.clear()
    return said


def _files(run: Path) -> dict[str, str]:
    """Each file's SHA-256 but SQLite's shared-memory index (``-shm``: a reader of a store an
    interrupted session left in WAL mode changes it, not the store)."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file() and not p.name.endswith("-shm")}


def test_a_resume_of_a_run_on_its_own_embedded_broker_names_the_old_and_the_new_url(
        tmp_path: Path, stopped_after_joins: None, capsys: pytest.CaptureFixture,
        caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    assert _serve("--config", str(QUICKSTART), "--out", str(run)) == cli.EXIT_INTERRUPTED
    old = _served_on(capsys.readouterr().out, run)
    assert re.fullmatch(r"mqtt://127\.0\.0\.1:\d+", old)
    assert _record(run) == {"url": old, "embedded": True, "credentials_removed": False}
    assert _warnings(caplog) == []

    assert _serve("--resume", str(run)) == cli.EXIT_INTERRUPTED
    out = capsys.readouterr().out
    new = _served_on(out, run)
    assert new != old and "going on with the run's broker" not in out
    assert _record(run) == {"url": new, "embedded": True, "credentials_removed": False}
    assert _warnings(caplog) == [
        f"--resume {run}: the run's earlier session used its own embedded broker {old}, which stopped with it; this "
        f"session started a new embedded broker on {new}: agents still running against {old} will not reach this "
        f"server; start each again with --broker {new}"]


def test_a_resume_goes_on_with_the_broker_the_run_was_given_and_a_moved_one_is_said(
        tmp_path: Path, stopped_after_joins: None, capsys: pytest.CaptureFixture,
        caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    with EmbeddedBroker(workdir=tmp_path / "fleet-broker") as fleet, \
            EmbeddedBroker(workdir=tmp_path / "moved-broker") as moved:
        assert _serve("--config", str(QUICKSTART), "--broker", fleet.url, "--out", str(run)) == cli.EXIT_INTERRUPTED
        first = capsys.readouterr().out
        assert _served_on(first, run) == fleet.url
        assert f"fedfleet server --resume {run} --broker {fleet.url}" in first  # the interruption's hint
        assert _record(run) == {"url": fleet.url, "embedded": False, "credentials_removed": False}
        assert not (run / "broker").exists()  # no embedded broker was started

        # without --broker: the recorded broker, named in one line before the server connects
        assert _serve("--resume", str(run)) == cli.EXIT_INTERRUPTED
        out = capsys.readouterr().out
        note = (f"fedfleet server: --resume without --broker: going on with the run's broker {fleet.url}, which its "
                "earlier session used (broker.json) and its agents are on; --broker URL to use another")
        assert [line for line in out.splitlines() if "--resume without --broker" in line] == [note]
        assert out.index(note) < out.index(f"federation '{run.name}' on")
        assert _served_on(out, run) == fleet.url
        assert _record(run) == {"url": fleet.url, "embedded": False, "credentials_removed": False}
        assert not (run / "broker").exists() and _warnings(caplog) == []

        # the recorded broker given again: nothing to say
        assert _serve("--resume", str(run), "--broker", fleet.url) == cli.EXIT_INTERRUPTED
        assert "--resume without --broker" not in capsys.readouterr().out and _warnings(caplog) == []

        # another broker (the fleet's moved): allowed, said with both URLs, and recorded
        assert _serve("--resume", str(run), "--broker", moved.url) == cli.EXIT_INTERRUPTED
        assert _served_on(capsys.readouterr().out, run) == moved.url
        assert _warnings(caplog) == [
            f"--resume {run}: --broker {moved.url} is not the broker of the run's earlier session ({fleet.url}; "
            f"broker.json): unless that broker moved there, agents still running against {fleet.url} will not reach "
            f"this server; start each again with --broker {moved.url}"]
        assert _record(run) == {"url": moved.url, "embedded": False, "credentials_removed": False}


def _login_seen(run: Path, *said: str) -> list[str]:
    """Where the login ``fleet-op`` / ``s3cr@t`` (``s3cr%40t`` in its URL) shows: in ``said`` (the
    texts printed and logged), or in a file of the run folder."""
    seen = [text for text in said if "fleet-op" in text or "s3cr" in text]
    return seen + [str(p) for p in sorted(run.rglob("*")) if p.is_file()
                   and (b"fleet-op" in (data := p.read_bytes()) or b"s3cr" in data)]


def test_a_login_in_the_brokers_url_is_in_nothing_a_session_prints_logs_or_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        caplog: pytest.LogCaptureFixture) -> None:
    """The server session given ``--broker mqtt://USER:PASSWORD@HOST:PORT`` names the broker as
    ``mqtt://HOST:PORT`` where it says where it runs, in the agent command (which asks for each
    agent's own login, in placeholders, and says so in a line) and in ``summary.json``; no line
    it prints or logs (at DEBUG) and no file of its run folder holds the user name or password."""
    require_mosquitto()  # a broker that takes any user name and password (amqtt's may not)
    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(AggregationServer, "run", lambda self: RunSummary(0, float("nan"), float("nan"), []))
    run = tmp_path / "run"
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "fleet-broker") as fleet:
        login = f"mqtt://fleet-op:s3cr%40t@127.0.0.1:{fleet.port}"
        assert _serve("--config", str(QUICKSTART), "--broker", login, "--out", str(run)) == cli.EXIT_OK
    out, err = capsys.readouterr()
    lines = out.splitlines()
    start = lines.index(f"fedfleet server: federation 'run' on {fleet.url} (unsigned); data digits from sklearn; "
                        "waiting for 4 agents (join timeout 60 s). Start each agent i = 0..3 with")
    assert lines[start + 1:start + 3] == [
        f"  fedfleet-agent --broker {fleet.url} --username USER --password-file PASSWORD_FILE --federation run "
        "--client-id DEVICE_ID --dataset digits --shard i/4 --partition dirichlet --alpha 1.0 --min-samples 10 "
        "--seed 0 --algorithm fedavg",
        "  the broker's user name and password are left out: USER is each agent's MQTT user name, PASSWORD_FILE a "
        "file holding its password"]
    assert read_summary(run)["broker"] == fleet.url
    assert _record(run) == {"url": fleet.url, "embedded": False, "credentials_removed": True}
    assert _login_seen(run, out, err, *(r.getMessage() for r in caplog.records)) == []


def test_credentials_are_not_recorded_and_a_resume_that_needs_them_is_refused_naming_the_option(
        tmp_path: Path, stopped_after_joins: None, capsys: pytest.CaptureFixture,
        caplog: pytest.LogCaptureFixture) -> None:
    require_mosquitto()  # a broker that takes any user name and password (amqtt's may not)
    run = tmp_path / "run"
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "fleet-broker") as fleet:
        port = fleet.url.rsplit(":", 1)[1]
        login = f"mqtt://fleet-op:s3cr%40t@127.0.0.1:{port}"
        assert _serve("--config", str(QUICKSTART), "--broker", login, "--out", str(run)) == cli.EXIT_INTERRUPTED
        out = capsys.readouterr().out
        assert out.endswith("fedfleet server: interrupted; the run continues from its last checkpoint with\n"
                            f"  fedfleet server --resume {run} --broker mqtt://USER:PASSWORD@127.0.0.1:{port}\n")
        assert _login_seen(run, out) == []
        text = (run / "broker.json").read_text(encoding="utf-8")
        assert json.loads(text) == {"url": fleet.url, "embedded": False, "credentials_removed": True}
        # the interrupted session closed its checkpoint store (no -wal left for a later garbage
        # collection to fold in, which changed checkpoints.sqlite under the refused resume below)
        assert not (run / "checkpoints.sqlite-wal").exists()
        assert "fleet-op" not in text and "s3cr" not in text
        files = _files(run)

        assert _serve("--resume", str(run)) == cli.EXIT_USAGE
        out, err = capsys.readouterr()
        assert err == (f"fedfleet: configuration error: --resume {run}: the run's broker {fleet.url} (broker.json) was "
                       "given with a user name or password in its URL, which the run folder does not keep; pass it "
                       f"again: --broker mqtt://USER:PASSWORD@127.0.0.1:{port}\n")
        assert "federation" not in out and _files(run) == files  # no broker, no ledger session, nothing written
        with pytest.raises(ConfigError, match=r"pass it again: --broker mqtt://USER:PASSWORD@127\.0\.0\.1:"):
            session_broker(load(run / "config.toml"), run, resume=True)

        # passed again as the message says: the same broker, nothing more to say
        assert _serve("--resume", str(run), "--broker", login) == cli.EXIT_INTERRUPTED
        capsys.readouterr()
        assert _warnings(caplog) == []
        assert _record(run) == {"url": fleet.url, "embedded": False, "credentials_removed": True}


def test_a_login_in_the_configurations_broker_url_is_left_out_of_the_run_folder_and_a_resume_asks_for_it(
        tmp_path: Path, stopped_after_joins: None, capsys: pytest.CaptureFixture) -> None:
    """``[broker] url`` with a user name and password: the run folder's config.toml names the
    broker without them, under a comment naming the ``--broker`` a resume needs; the run's own
    config.toml naming that broker without its login, a ``--resume`` without ``--broker`` is
    refused as for a ``--broker`` that had one, and goes on with the login passed again."""
    require_mosquitto()  # a broker that takes any user name and password (amqtt's may not)
    run = tmp_path / "run"
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "fleet-broker") as fleet:
        login = f"mqtt://fleet-op:s3cr%40t@127.0.0.1:{fleet.port}"
        asks = f"--broker mqtt://USER:PASSWORD@127.0.0.1:{fleet.port}"
        config = tmp_path / "fleet.toml"
        config.write_text(f'{QUICKSTART.read_text(encoding="utf-8")}\n[broker]\nurl = "{login}"\n', encoding="utf-8")
        assert _serve("--config", str(config), "--out", str(run)) == cli.EXIT_INTERRUPTED
        out = capsys.readouterr().out
        assert out.endswith(f"  fedfleet server --resume {run} {asks}\n")  # the interruption's hint
        text = (run / "config.toml").read_text(encoding="utf-8")
        assert ("\n[broker]\n# url: the user name and password it was given with are left out of this copy; a "
                f'--resume needs {asks}\nurl = "{fleet.url}"\nkind = "auto"\n') in text
        assert load(run / "config.toml").broker.url == fleet.url and _login_seen(run, out) == []
        files = _files(run)

        assert _serve("--resume", str(run)) == cli.EXIT_USAGE
        assert capsys.readouterr().err == (
            f"fedfleet: configuration error: --resume {run}: the run's broker {fleet.url} (broker.json) was given "
            f"with a user name or password in its URL, which the run folder does not keep; pass it again: {asks}\n")
        assert _files(run) == files  # nothing written

        assert _serve("--resume", str(run), "--broker", login) == cli.EXIT_INTERRUPTED
        assert _served_on(capsys.readouterr().out, run) == fleet.url


def test_a_run_folder_without_a_usable_record_is_said_to_have_an_unknown_broker(
        tmp_path: Path, stopped_after_joins: None, capsys: pytest.CaptureFixture,
        caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    assert _serve("--config", str(QUICKSTART), "--out", str(run)) == cli.EXIT_INTERRUPTED
    capsys.readouterr()
    (run / "broker.json").unlink()  # as a run folder written before the broker was recorded
    assert _serve("--resume", str(run)) == cli.EXIT_INTERRUPTED
    new = _served_on(capsys.readouterr().out, run)
    assert _warnings(caplog) == [
        f"--resume {run}: the broker of the run's earlier session is unknown (no broker.json: a run folder from before "
        f"the broker was recorded); this session started a new embedded broker on {new}: agents still running against "
        f"the earlier session's broker will not reach this server; start each again with --broker {new}, or resume "
        "with --broker URL of the broker they are on"]
    assert _record(run) == {"url": new, "embedded": True, "credentials_removed": False}  # recorded from now on

    (run / "broker.json").write_text('{"url": "mqtt://127.0.0.1:1883", "embedded": "yes"}', encoding="utf-8")
    with EmbeddedBroker(workdir=tmp_path / "fleet-broker") as fleet:
        assert _serve("--resume", str(run), "--broker", fleet.url) == cli.EXIT_INTERRUPTED
        assert _served_on(capsys.readouterr().out, run) == fleet.url
    assert _warnings(caplog) == [
        f"--resume {run}: the broker of the run's earlier session is unknown ({run / 'broker.json'} cannot be read: "
        f"'embedded' must be true or false, got 'yes'); this session uses --broker {fleet.url}, as given"]
    assert _record(run) == {"url": fleet.url, "embedded": False, "credentials_removed": False}


def test_a_record_that_cannot_be_written_is_said_and_the_session_goes_on(
        tmp_path: Path, stopped_after_joins: None, capsys: pytest.CaptureFixture,
        caplog: pytest.LogCaptureFixture) -> None:
    """A folder where broker.json should be: unreadable (an unknown broker, said) and unwritable
    (said, naming what a resume needs), and the session goes on: no traceback, no exit 1."""
    run = tmp_path / "run"
    assert _serve("--config", str(QUICKSTART), "--out", str(run)) == cli.EXIT_INTERRUPTED
    capsys.readouterr()
    _warnings(caplog)
    (run / "broker.json").unlink()
    (run / "broker.json").mkdir()
    with EmbeddedBroker(workdir=tmp_path / "fleet-broker") as fleet:
        login = fleet.url.replace("mqtt://", "mqtt://fleet-op:s3cret@")
        assert _serve("--resume", str(run), "--broker", login) == cli.EXIT_INTERRUPTED
        assert _served_on(capsys.readouterr().out, run) == fleet.url
    said = _warnings(caplog)
    assert len(said) == 2 and "cannot be read" in said[0], said
    assert said[1].startswith(f"{run / 'broker.json'} cannot be written (")
    assert said[1].endswith("): a --resume of this run will not know its broker and needs --broker "
                            f"{login_placeholder_url(login)}"), said[1]
    assert "s3cret" not in " ".join(said)
    assert (run / "broker.json").is_dir() and not list(run.glob(".broker.json.*"))

    assert _serve("--resume", str(run)) == cli.EXIT_INTERRUPTED  # its own embedded broker this time
    capsys.readouterr()
    said = _warnings(caplog)
    assert len(said) == 2 and said[1].endswith("a --resume of this run will not know its broker and starts a new "
                                               "embedded broker, as this session did"), said


@pytest.mark.parametrize(("url", "public", "removed"), [
    ("mqtt://127.0.0.1:1883", "mqtt://127.0.0.1:1883", False),
    ("mqtt://fleet:pw@Broker.Example.org:1884/", "mqtt://broker.example.org:1884", True),
    ("mqtt://fleet@broker.example.org", "mqtt://broker.example.org:1883", True),
    ("MQTTS://broker.example.org", "mqtts://broker.example.org:8883", False),
    ("mqtt://u:p@[::1]:1883", "mqtt://[::1]:1883", True),
])
def test_the_record_keeps_the_address_and_never_the_credentials(tmp_path: Path, url: str, public: str,
                                                                removed: bool) -> None:
    rec = broker_record(url, embedded=False)
    assert rec == BrokerRecord(url=public, embedded=False, credentials_removed=removed)
    assert public_broker_url(url) == shown_broker_url(url) == public and has_login(url) == removed
    scheme, address = public.split("://")
    assert login_placeholder_url(url) == f"{scheme}://USER:PASSWORD@{address}"
    write_broker_record(tmp_path, rec)
    assert json.loads((tmp_path / "broker.json").read_text()) == {"url": public, "embedded": False,
                                                                  "credentials_removed": removed}
    assert read_broker_record(tmp_path) == rec


@pytest.mark.parametrize(("text", "error"), [
    ("{", "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ("[]", "expected a JSON object, got list"),
    ('{"embedded": true}', "'url' must be a string, got null"),
    ('{"url": "http://h:1", "embedded": true}',
     "unsupported broker URL 'http://h:1': scheme must be 'mqtt' or 'mqtts', got 'http'"),
    ('{"url": "mqtt://h:1", "embedded": true, "credentials_removed": 1}',
     "'credentials_removed' must be true or false, got 1"),
])
def test_a_damaged_record_says_why(tmp_path: Path, text: str, error: str) -> None:
    assert read_broker_record(tmp_path) is None
    (tmp_path / "broker.json").write_text(text, encoding="utf-8")
    with pytest.raises(ValueError) as exc:
        read_broker_record(tmp_path)
    assert str(exc.value) == error


@pytest.mark.parametrize(("url", "public"), [
    ("mqtt://fleet-op:s3cr%40t@broker.lan:1884", "mqtt://broker.lan:1884"),
    ("mqtt://fleet-op@Broker.lan", "mqtt://broker.lan:1883"),
    ("mqtts://fleet-op:s3cr@[::1]", "mqtts://[::1]:8883"),
    # malformed logins: a password without a user name, a '/' or '#' not percent-encoded (still a login)
    ("mqtt://:s3cr@h:1", "mqtt://h:1"),
    ("mqtt://fleet-op:s3/cr@h:1", "mqtt://h:1"),
    ("mqtt://fleet-op:s3cr#x/y@h", "mqtt://h:1883"),
])
@pytest.mark.parametrize("removed", [False, True])
def test_an_edited_record_whose_url_holds_a_login_is_read_as_one_that_had_a_login(
        tmp_path: Path, url: str, public: str, removed: bool) -> None:
    (tmp_path / "broker.json").write_text(json.dumps({"url": url, "embedded": False, "credentials_removed": removed}),
                                          encoding="utf-8")
    rec = read_broker_record(tmp_path)
    assert rec == BrokerRecord(url=public, embedded=False, credentials_removed=True, login_in_file=True)
    assert "fleet-op" not in repr(rec) and "s3cr" not in repr(rec)
    with pytest.raises(ConfigError) as caught:  # resumed without --broker: the login is asked for, not taken
        session_broker(load(QUICKSTART), tmp_path, resume=True)
    scheme, address = public.split("://")
    assert str(caught.value) == (
        f"--resume {tmp_path}: the run's broker {public} (broker.json) is recorded with a user name or password in "
        "its url, which fedfleet never writes there and does not take from the file; pass the login with the option: "
        f"--broker {scheme}://USER:PASSWORD@{address}")


@pytest.mark.parametrize(("text", "error"), [
    ('{"url": "mqtt://fleet-op:s3cr@h:99999", "embedded": false}',
     "broker URL 'mqtt://h:99999' has a bad port (Port out of range 0-65535); expected an integer in 1..65535 (its "
     "user name and password left out here)"),
    ('{"url": "mqtt://fleet-op:s3cr@h:1/x", "embedded": false}',
     "broker URL 'mqtt://h:1' has a path, query or fragment (not shown here); an MQTT broker URL is "
     "mqtt://[USER[:PASSWORD]@]HOST[:PORT] (its user name and password left out here)"),
    ('{"url": "mqtt://fleet-op:s3cr@h:1?s3cr", "embedded": false}',
     "broker URL 'mqtt://h:1' has a path, query or fragment (not shown here); an MQTT broker URL is "
     "mqtt://[USER[:PASSWORD]@]HOST[:PORT] (its user name and password left out here)"),
    ('{"url": ["mqtt://fleet-op:s3cr@h:1"], "embedded": false}', "'url' must be a string, got a list"),
    ('{"url": {"user": "fleet-op"}, "embedded": false}', "'url' must be a string, got an object"),
])
def test_a_damaged_record_holding_a_login_says_why_without_it(tmp_path: Path, text: str, error: str) -> None:
    (tmp_path / "broker.json").write_text(text, encoding="utf-8")
    with pytest.raises(ValueError) as exc:
        read_broker_record(tmp_path)
    assert str(exc.value) == error


SECRET = "Zq9SECRETpw"


def test_a_record_that_cannot_be_read_or_holds_a_malformed_login_is_refused_and_kept(
        tmp_path: Path, stopped_after_joins: None, capsys: pytest.CaptureFixture,
        caplog: pytest.LogCaptureFixture) -> None:
    """``broker.json`` edited by hand: a ``url`` with a query (a password in it), a malformed login
    (a password without a user name, a ``#`` not percent-encoded), not JSON. A ``--resume`` without
    ``--broker`` is refused (exit 2) before anything is written: a malformed login as a clean one
    (the login neither shown nor used), an unreadable record naming the file and why; the record
    is never replaced by a new embedded broker's. The secret is in no output."""
    run = tmp_path / "run"
    assert _serve("--config", str(QUICKSTART), "--out", str(run)) == cli.EXIT_INTERRUPTED
    capsys.readouterr()
    caplog.clear()
    placeholder = "mqtt://USER:PASSWORD@127.0.0.1:18833"
    login_refusal = (f"fedfleet: configuration error: --resume {run}: the run's broker mqtt://127.0.0.1:18833 "
                     "(broker.json) is recorded with a user name or password in its url, which fedfleet never writes "
                     f"there and does not take from the file; pass the login with the option: --broker {placeholder}\n")

    def unreadable(why: str) -> str:
        return (f"fedfleet: configuration error: --resume {run}: {run / 'broker.json'}, the record of the broker the "
                f"run's agents are on, cannot be read ({why}); a resume without --broker would go on with another "
                "broker and replace the record: pass --broker URL of the run's broker (this session's record then "
                "replaces the file), or move broker.json away to go on as a run whose broker is unknown\n")

    said: list[str] = []
    for url, err in [
        (f"mqtt://127.0.0.1:18833?password={SECRET}", unreadable(
            "broker URL 'mqtt://127.0.0.1:18833' has a path, query or fragment (not shown here); an MQTT broker URL "
            "is mqtt://[USER[:PASSWORD]@]HOST[:PORT]")),
        (f"mqtt://127.0.0.1:18833/{SECRET}#{SECRET}", unreadable(
            "broker URL 'mqtt://127.0.0.1:18833' has a path, query or fragment (not shown here); an MQTT broker URL "
            "is mqtt://[USER[:PASSWORD]@]HOST[:PORT]")),
        (f"mqtt://fleet-op:{SECRET}@127.0.0.1:18833/x", unreadable(
            "broker URL 'mqtt://127.0.0.1:18833' has a path, query or fragment (not shown here); an MQTT broker URL "
            "is mqtt://[USER[:PASSWORD]@]HOST[:PORT] (its user name and password left out here)")),
        (f"mqtt://fleet-op:{SECRET}", unreadable(
            "broker URL 'mqtt://fleet-op:***' has a bad port (not a number); expected an integer in 1..65535")),
        (f"mqtt://:{SECRET}@127.0.0.1:18833", login_refusal),
        (f"mqtt://fleet-op:{SECRET}#x/y@127.0.0.1:18833", login_refusal),
        (None, unreadable("not valid JSON (Expecting value: line 1 column 1 (char 0))")),
    ]:
        text = json.dumps({"url": url, "embedded": False}) if url is not None else f"password={SECRET}"
        (run / "broker.json").write_text(text, encoding="utf-8")
        files = _files(run)
        assert _serve("--resume", str(run)) == cli.EXIT_USAGE, url
        out, got = capsys.readouterr()
        assert got == err, url
        assert _files(run) == files  # nothing written: the record is the one edited
        said += [out, got, *(r.getMessage() for r in caplog.records)]
        caplog.clear()
    assert [text for text in said if SECRET in text] == []


def test_a_resume_of_a_run_whose_record_was_edited_to_hold_a_login_asks_for_it_and_never_shows_it(
        tmp_path: Path, stopped_after_joins: None, capsys: pytest.CaptureFixture,
        caplog: pytest.LogCaptureFixture) -> None:
    """``broker.json`` edited by hand to hold the broker's login in its ``url``: a ``--resume``
    without ``--broker`` is refused as for a recorded login, naming the ``--broker`` to pass (exit
    2, nothing written); with ``--broker`` it goes on, a WARNING naming the file says the login
    there is not used, and the session's record leaves it out. The login is in no output."""
    run = tmp_path / "run"
    with EmbeddedBroker(workdir=tmp_path / "fleet-broker") as fleet:
        assert _serve("--config", str(QUICKSTART), "--broker", fleet.url, "--out", str(run)) == cli.EXIT_INTERRUPTED
        capsys.readouterr()
        _warnings(caplog)
        edited = fleet.url.replace("mqtt://", "mqtt://fleet-op:s3cr%40t@")
        (run / "broker.json").write_text(json.dumps({"url": edited, "embedded": False}), encoding="utf-8")
        files = _files(run)

        assert _serve("--resume", str(run)) == cli.EXIT_USAGE
        out, err = capsys.readouterr()
        assert err == (f"fedfleet: configuration error: --resume {run}: the run's broker {fleet.url} (broker.json) is "
                       "recorded with a user name or password in its url, which fedfleet never writes there and does "
                       "not take from the file; pass the login with the option: --broker "
                       f"{login_placeholder_url(fleet.url)}\n")
        assert _files(run) == files and _warnings(caplog) == []  # nothing written, one line
        said = [out, err]

        assert _serve("--resume", str(run), "--broker", fleet.url) == cli.EXIT_INTERRUPTED
        out, err = capsys.readouterr()
        assert _served_on(out, run) == fleet.url
        warnings = _warnings(caplog)
        assert warnings == [
            f"{run / 'broker.json'}: its url holds a user name or password, which fedfleet never writes there (an "
            f"edited record): read as the broker {fleet.url} with a login, not taken from the file; the record this "
            "session writes once connected leaves it out"]
        assert _record(run) == {"url": fleet.url, "embedded": False, "credentials_removed": False}
    assert _login_seen(run, *said, out, err, *warnings) == []


def test_the_configurations_broker_url_is_used_when_it_names_the_recorded_broker(tmp_path: Path) -> None:
    """``[broker] url`` in the run's config.toml naming the recorded broker: its URL (with the
    credentials the record does not keep) is the one used; naming another, the recorded broker
    is, and the line says the configuration's is not; an embedded record with ``[broker] url``
    set (the config edited since) is said as a broker other than the earlier one."""
    write_broker_record(tmp_path, broker_record("mqtt://op:pw@fleet.example:1883", embedded=False))
    same = session_broker(load(QUICKSTART, {("broker", "url"): "mqtt://op:pw@fleet.example"}), tmp_path, resume=True)
    assert (same.url, same.given) == ("mqtt://op:pw@fleet.example", "broker.json")
    assert same.note == ("fedfleet server: --resume without --broker: going on with the run's broker "
                         "mqtt://fleet.example:1883, which its earlier session used (broker.json) and its agents are "
                         "on; --broker URL to use another")
    assert same.warning("mqtt://op:pw@fleet.example") is None

    write_broker_record(tmp_path, broker_record("mqtt://fleet.example:1883", embedded=False))
    other = session_broker(load(QUICKSTART, {("broker", "url"): "mqtt://old.example"}), tmp_path, resume=True)
    assert other.url == "mqtt://fleet.example:1883"
    assert other.note == ("fedfleet server: --resume without --broker: going on with the run's broker "
                          "mqtt://fleet.example:1883 (not [broker] url mqtt://old.example:1883 of its config.toml), "
                          "which its earlier session used (broker.json) and its agents are on; --broker URL to use "
                          "another")

    write_broker_record(tmp_path, broker_record("mqtt://127.0.0.1:40001", embedded=True))
    edited = session_broker(load(QUICKSTART, {("broker", "url"): "mqtt://fleet.example"}), tmp_path, resume=True)
    assert (edited.url, edited.given, edited.note) == ("mqtt://fleet.example", "[broker] url", None)
    assert edited.warning("mqtt://fleet.example") == (
        f"--resume {tmp_path}: [broker] url mqtt://fleet.example:1883 (its config.toml) is not the broker of the "
        "run's earlier session (its own embedded broker mqtt://127.0.0.1:40001, which stopped with it; broker.json): "
        "agents still running against mqtt://127.0.0.1:40001 will not reach this server; start each again with "
        "--broker mqtt://fleet.example:1883")

    fresh = session_broker(load(QUICKSTART), tmp_path)  # not a resume: the record is not read, nothing said
    assert (fresh.url, fresh.given, fresh.note, fresh.warning("mqtt://127.0.0.1:40002")) == (None, "", None, None)
