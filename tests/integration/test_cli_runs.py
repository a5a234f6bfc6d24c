"""Whole ``fedfleet simulate`` runs through the command line (embedded broker, digits): a resumed
run says it resumes and counts the whole run's rounds; Ctrl-C says how to resume; the server
link's byte summary that ``fedfleet server`` ends with equals the ledger's server rows. (A resume
with no round left: test_resume_finished_run.py.)"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.brokers import require_mosquitto

from broker_server import cli
from broker_server.server_main import server_byte_summary

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.toml"

pytestmark = pytest.mark.slow


def _rounds(run: Path) -> list[int]:
    return [json.loads(line)["round"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_run_says_so_and_counts_the_whole_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    assert cli.main(["simulate", "--config", str(QUICKSTART), "--rounds", "1", "--out", str(run), "-q"]) == 0
    capsys.readouterr()
    assert json.loads((run / "summary.json").read_text())["resumed_after"] is None
    assert cli.main(["simulate", "--resume", str(run), "--rounds", "2", "-q"]) == 0
    out = capsys.readouterr().out
    assert f"fedfleet simulate: resuming {run} after round 1 of 2 (rounds 2..2 to go)" in out
    assert "finished 2 rounds of 2 (1 in this session, resumed after round 1)" in out
    assert _rounds(run) == [1, 2]
    assert json.loads((run / "summary.json").read_text())["resumed_after"] == 1

    # the server link's summary: the ledger's server-side rows, summed here with SQL
    db = sqlite3.connect(run / "ledger.sqlite")
    up, down = (db.execute("SELECT COALESCE(SUM(mqtt_header_bytes + topic_bytes + payload_bytes), 0) FROM messages "
                           "WHERE side = 'server' AND event IN ('sent', 'received', 'rejected') "
                           f"AND (direction = 'up') = {d}").fetchone()[0] for d in (1, 0))
    # and its packets: the messages apart from the MQTT control packets (CONNACK, PUBACK … from the broker)
    counts = {d: db.execute("SELECT COUNT(*), COALESCE(SUM(kind IN ('CONNECT', 'CONNACK', 'SUBSCRIBE', 'SUBACK', "
                            "'PUBACK', 'PINGREQ', 'PINGRESP', 'DISCONNECT') OR reason = 'control'), 0) FROM messages "
                            "WHERE side = 'server' AND event IN ('sent', 'received', 'rejected') "
                            f"AND (direction = 'up') = {d}").fetchone() for d in (1, 0)}
    db.close()
    text = server_byte_summary(run)
    for d, verb in ((1, "received"), (0, "sent")):
        n, ctl = counts[d]
        assert 0 < ctl < n and f"({n - ctl:,} messages {verb}, {ctl:,} MQTT control packets" in text, text
    assert text.startswith("bytes on the server link: up ")
    shown_up = int(text.split("up ")[1].split(" ")[0].replace(",", ""))
    shown_down = int(text.split("down ")[1].split(" ")[0].replace(",", ""))
    assert (shown_up, shown_down) == (up, down), text


def test_ctrl_c_says_how_to_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "broker_server.cli", "simulate", "--config", str(QUICKSTART),
                             "--rounds", "50", "--out", str(run), "-q"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        end = time.monotonic() + 240
        while time.monotonic() < end and not ((run / "metrics.jsonl").exists()
                                               and (run / "metrics.jsonl").read_text().strip()):
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == cli.EXIT_INTERRUPTED == 128 + signal.SIGINT, err
    assert f"interrupted; continue the run from its last checkpoint with\n  fedfleet simulate --resume {run}" in out


def test_a_broker_that_stops_acknowledging_ends_the_run_with_a_resume_hint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Mosquitto stopped (SIGSTOP) once round 1 is on record: its TCP connections stay up but no
    acknowledgement comes. The server's link, with room for one unacknowledged message and
    0.5 s to wait for more (the defaults are 1,000 and 60 s), gives up at its next publish:
    ``fedfleet simulate`` exits with the broker error code, says what failed, and says how to
    resume from the checkpoint it holds."""
    import threading

    import protocol.transport as transport
    from broker_server.embedded_broker import EmbeddedBroker
    from protocol.topics import node_of

    init = transport.MqttTransport.__init__

    def small_server_buffer(self, client_id, *a, **kw):
        if node_of(client_id) == "server":
            kw.update(max_buffered_messages=1, full_wait_s=0.5)
        init(self, client_id, *a, **kw)

    monkeypatch.setattr(transport.MqttTransport, "__init__", small_server_buffer)
    cfg = tmp_path / "run.toml"
    cfg.write_text(QUICKSTART.read_text().replace("rounds = 5", "rounds = 40").replace("round_deadline_s = 60.0",
                                                                                       "round_deadline_s = 3.0"))
    run = tmp_path / "run"
    require_mosquitto()  # a broker process that can be stopped alone
    with EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "broker") as broker:
        assert broker.pid is not None and broker.kind == "mosquitto"
        stopped = threading.Event()

        def stop_after_round_1() -> None:
            end = time.monotonic() + 240
            while time.monotonic() < end and not ((run / "metrics.jsonl").exists()
                                                   and (run / "metrics.jsonl").read_text().strip()):
                time.sleep(0.05)
            os.kill(broker.pid, signal.SIGSTOP)
            stopped.set()

        watcher = threading.Thread(target=stop_after_round_1, daemon=True)
        watcher.start()
        try:
            code = cli.main(["simulate", "--config", str(cfg), "--broker", broker.url, "--out", str(run), "-q"])
        finally:
            watcher.join(5)
            if stopped.is_set():
                os.kill(broker.pid, signal.SIGCONT)
    captured = capsys.readouterr()
    assert stopped.is_set() and code == cli.EXIT_BROKER, captured.err[-2000:]
    assert "fedfleet: broker link error: " in captured.err and "wait for acknowledgement (link up" in captured.err
    assert (f"stopped by the broker link; continue the run from its last checkpoint with\n"
            f"  fedfleet simulate --resume {run}") in captured.out
    assert (run / "checkpoints.sqlite").exists() and 1 <= len(_rounds(run)) < 40


def test_a_damaged_metrics_file_is_refused_before_the_run_folder_is_touched(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture) -> None:
    """``--resume`` over a metrics.jsonl damaged before its last line: one line naming the file,
    the line and what to do (exit 2), and the run folder byte for byte as it was (no broker
    session in the ledger, no config.toml rewritten). Its last line cut short where the checkpoint
    of that round holds no line to write again (the round's line precedes its checkpoint, so only
    a hand or a disk can do this): refused too, the same way, not finished with the round
    before's accuracy."""
    import hashlib

    run = tmp_path / "run"
    assert cli.main(["simulate", "--config", str(QUICKSTART), "--rounds", "2", "--out", str(run), "-q"]) == 0
    capsys.readouterr()
    path = run / "metrics.jsonl"
    good = path.read_bytes()
    lines = good.decode().splitlines(keepends=True)

    def folder() -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.iterdir()) if p.is_file()}

    path.write_bytes((lines[0][:20] + "\n" + lines[1]).encode())
    before = folder()
    assert cli.main(["simulate", "--resume", str(run), "--rounds", "3", "-q"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:1: not valid JSON" in err and "repair or delete that line" in err
    assert folder() == before

    path.write_bytes((lines[0] + lines[1][:-40]).encode())
    before = folder()
    assert cli.main(["simulate", "--resume", str(run), "--rounds", "2", "-q"]) == 2
    err = capsys.readouterr().err
    assert f"--resume: {path} has no line for round 2, and its checkpoint holds none to write again" in err
    assert folder() == before
    assert json.loads((run / "summary.json").read_text())["final_accuracy"] == json.loads(lines[1])["accuracy"]

    # the checkpoint store emptied (or a folder in its place) beside a metrics.jsonl with lines: refused, untouched
    path.write_bytes(good)
    store = run / "checkpoints.sqlite"
    kept_store = store.read_bytes()
    store.write_bytes(b"")
    before = folder()
    assert cli.main(["simulate", "--resume", str(run), "--rounds", "3", "-q"]) == 2
    assert f"--resume: {store} holds no checkpoint, but {path} has the lines of 2 rounds" in capsys.readouterr().err
    assert folder() == before
    store.unlink()
    store.mkdir()
    assert cli.main(["simulate", "--resume", str(run), "--rounds", "3", "-q"]) == 2
    assert f"--resume: {store} is not a file" in capsys.readouterr().err
    store.rmdir()
    store.write_bytes(kept_store)

    # round 1's line deleted (as the refusal above says a damaged line may be): the run goes on, the loss said
    path.write_bytes(lines[1].encode())
    assert cli.main(["simulate", "--resume", str(run), "--rounds", "3", "-q"]) == 0
    assert _rounds(run) == [2, 3]
    assert json.loads((run / "summary.json").read_text())["metrics_lines_missing"] == [1]
