"""Ctrl-C (SIGINT) to a ``fedfleet-agent`` process ends it cleanly: no Python traceback, one line
saying it stopped and where the run was, its offline status published (a clean DISCONNECT fires
no last will), exit 130 (128 + SIGINT), as ``fedfleet server`` does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.scripted_server import ScriptedServer
from helpers.waiting import wait_for

from broker_server.embedded_broker import EmbeddedBroker
from edge_agent.cli import EXIT_INTERRUPTED, interrupted_line

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "FEDFLEET_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
FED = "fed-ctrl-c"


def test_ctrl_c_to_an_agent_awaiting_its_join_answer_ends_it_in_one_line_with_exit_130(tmp_path: Path) -> None:
    with EmbeddedBroker(kind="auto", workdir=tmp_path / "broker") as broker:
        listener = ScriptedServer(broker.port, FED, "listen")
        proc = subprocess.Popen([sys.executable, "-m", "edge_agent.cli", "--broker", broker.url, "--federation", FED,
                                 "--client-id", "dev-1", "--dataset", "digits", "--shard", "0/2", "--seed", "3",
                                 "--out", str(tmp_path / "dev-1")], cwd=tmp_path, env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert wait_for(lambda: listener.joins >= 1 or proc.poll() is not None, 120)
            assert proc.poll() is None, proc.communicate()
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=120)
            stopped = (0, "offline", "stopped by a signal")  # (round, state, detail): before any round
            assert wait_for(lambda: stopped in listener.statuses, 30), listener.statuses
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            listener.close()
    assert "Traceback" not in err, err[-3000:]
    assert proc.returncode == EXIT_INTERRUPTED == 128 + signal.SIGINT, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("fedfleet-agent:")]
    assert said == ["fedfleet-agent: dev-1 stopped by Ctrl-C before the server answered its join; 0 rounds trained, "
                    "0 updates acknowledged"], err[-3000:]


def _agent(joined: bool, holdings: tuple[int, int, int], trained: int, acked: int) -> SimpleNamespace:
    return SimpleNamespace(client_id="pi-7", joined=joined, holdings=lambda: holdings, rounds_trained=trained,
                           receipts_accepted=acked)


@pytest.mark.parametrize(("agent", "line"), [
    (None, "fedfleet-agent: stopped by Ctrl-C before it joined"),
    (_agent(True, (0, 0, 0), 0, 0), "fedfleet-agent: pi-7 stopped by Ctrl-C before its first round; 0 rounds trained, "
                                     "0 updates acknowledged"),
    (_agent(True, (2, 3, 0), 2, 2), "fedfleet-agent: pi-7 stopped by Ctrl-C in round 3; 2 rounds trained, "
                                    "2 updates acknowledged"),
    (_agent(True, (3, 3, 3), 3, 2), "fedfleet-agent: pi-7 stopped by Ctrl-C in round 3 (its update awaits its "
                                    "receipt); 3 rounds trained, 2 updates acknowledged"),
    (_agent(True, (1, 1, 0), 1, 1), "fedfleet-agent: pi-7 stopped by Ctrl-C in round 1; 1 round trained, "
                                    "1 update acknowledged"),
], ids=["before-joining", "idle-before-round-1", "training-round-3", "round-3-awaiting-receipt", "singular"])
def test_the_ctrl_c_line_says_where_the_run_was(agent, line: str) -> None:
    assert interrupted_line(agent) == line
