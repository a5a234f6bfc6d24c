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
    assert cli.main(["simulate", "--resume", str(run), "--rounds", "2", "-q"]) == 0
    out = capsys.readouterr().out
    assert f"fedfleet simulate: resuming {run} after round 1 of 2 (rounds 2..2 to go)" in out
    assert "finished 2 rounds of 2 (1 in this session, resumed after round 1)" in out
    assert _rounds(run) == [1, 2]

    # the server link's summary: the ledger's server-side rows, summed here with SQL
    db = sqlite3.connect(run / "ledger.sqlite")
    up, down = (db.execute("SELECT COALESCE(SUM(mqtt_header_bytes + topic_bytes + payload_bytes), 0) FROM messages "
                           "WHERE side = 'server' AND event IN ('sent', 'received', 'rejected') "
                           f"AND (direction = 'up') = {d}").fetchone()[0] for d in (1, 0))
    db.close()
    text = server_byte_summary(run)
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
