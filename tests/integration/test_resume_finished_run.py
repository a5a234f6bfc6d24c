"""``--resume`` of a run with no round left (embedded broker, digits, one 1-round run copied for
each case): ``fedfleet simulate`` and ``fedfleet server`` say so in one line, exit 0 and leave
every file of the run folder as it was (the ledger's rows and bytes among them: no broker, no
agent joined); a run stopped while finishing (after its last metrics line and checkpoint, before
``summary.json``) gets the final files the end of a run writes, the same model and figures as
the uninterrupted run's, again without a broker or agents."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

from broker_server import cli
from broker_server.config import load
from broker_server.server_main import run_server
from broker_server.simulate import simulate

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.toml"
FINAL = ("summary.json", "model_final.pt", "model_final.onnx")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 1-round, 2-client quickstart run (never modified: each test copies it)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert cli.main(["simulate", "--config", str(QUICKSTART), "--rounds", "1", "--clients", "2", "--out", str(run),
                     "-q"]) == 0
    return run


def _copy(finished: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    return run


def _files(run: Path) -> dict[str, str]:
    """Every file below ``run`` → the SHA-256 of its bytes."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def _ledger(run: Path) -> tuple[int, int]:
    """(rows, wire bytes) of the run's ledger, summed here with SQL."""
    db = sqlite3.connect(f"{(run / 'ledger.sqlite').resolve().as_uri()}?mode=ro", uri=True)
    try:
        return db.execute("SELECT COUNT(*), COALESCE(SUM(mqtt_header_bytes + topic_bytes + payload_bytes), 0) "
                          "FROM messages").fetchone()
    finally:
        db.close()


@pytest.mark.parametrize("command", ["simulate", "server"])
def test_resuming_a_finished_run_says_so_and_touches_nothing(finished: Path, tmp_path: Path, command: str,
                                                            capsys: pytest.CaptureFixture) -> None:
    run = _copy(finished, tmp_path)
    files, ledger = _files(run), _ledger(run)
    assert ledger[0] > 0
    (last,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    capsys.readouterr()
    assert cli.main([command, "--resume", str(run)]) == 0
    out = capsys.readouterr().out
    assert out == (f"fedfleet {command}: run {run} has finished its 1 round; nothing to resume (final test accuracy "
                   f"{last['accuracy']:.4f}; more rounds: fedfleet {command} --resume {run} --rounds 2 or more)\n")
    assert _ledger(run) == ledger
    assert _files(run) == files  # summary.json, checkpoints, the broker's folder: byte for byte


def test_the_python_entry_points_read_a_finished_run_back(finished: Path, tmp_path: Path) -> None:
    """``simulate(resume=True)`` and ``run_server(resume=True)`` of a finished run: its result from
    its files (no agent ran: no agent summaries), nothing written."""
    run = _copy(finished, tmp_path)
    files = _files(run)
    (last,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    cfg = load(run / "config.toml")
    res = simulate(cfg, run_dir=run, resume=True)
    assert (res.rounds_completed, res.final_accuracy, res.agents, res.metrics) == (1, last["accuracy"], [], [last])
    said: list[str] = []
    served = run_server(cfg, run_dir=run, resume=True, say=said.append)
    assert (served.summary.rounds_completed, served.summary.final_accuracy) == (1, last["accuracy"])
    assert len(said) == 1 and "nothing to resume" in said[0]
    assert _files(run) == files


@pytest.mark.parametrize("command", ["simulate", "server"])
def test_a_run_stopped_while_finishing_gets_its_final_files_on_resume(finished: Path, tmp_path: Path, command: str,
                                                                     capsys: pytest.CaptureFixture) -> None:
    run = _copy(finished, tmp_path)
    for name in FINAL:
        (run / name).unlink()
    others, ledger = _files(run), _ledger(run)
    capsys.readouterr()
    assert cli.main([command, "--resume", str(run)]) == 0
    out = capsys.readouterr().out
    assert (f"fedfleet {command}: run {run} had finished 1 of 1 rounds but not its final files (stopped while "
            "finishing): ") in out, out
    assert "without a broker or agents" in out and "waiting for 2 agent" not in out and "resuming" not in out
    assert _ledger(run) == ledger  # no connection, no join: not a row more
    now = _files(run)
    assert {k: v for k, v in now.items() if k not in FINAL and k != "checkpoints.sqlite"} == \
        {k: v for k, v in others.items() if k != "checkpoints.sqlite"}
    # the same final model as the uninterrupted run's end wrote, tensor for tensor
    a, b = torch.load(finished / "model_final.pt"), torch.load(run / "model_final.pt")
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    was, new = (json.loads((r / "summary.json").read_text()) for r in (finished, run))
    same = ("federation", "final_accuracy", "rounds_completed", "dataset", "clients", "client_test",
            "client_test_fraction", "refusals", "onnx_accuracy", "onnx_loss", "onnx_providers")
    assert {k: new[k] for k in same} == {k: was[k] for k in same}
    assert new["rounds_completed"] == 1 and "onnx_accuracy" in new and "finished_on_resume" in new
    assert new["resumed_after"] == 1
    if command == "simulate":
        assert (new["broker"], new["agent_errors"], new["profiles"]) == (was["broker"], [], was["profiles"])
    # and now the run is complete: a second resume has nothing to do
    files = _files(run)
    assert cli.main([command, "--resume", str(run)]) == 0
    assert "nothing to resume" in capsys.readouterr().out
    assert _files(run) == files


def test_more_rounds_of_a_finished_simulation_say_what_its_devices_start_afresh(tmp_path: Path) -> None:
    """A finished simulation's device state file is removed, so ``--rounds`` more restarts what
    its devices kept: the hint says so for an algorithm that keeps something (FedProto: its whole
    model), names nothing for FedAvg, and never for ``server`` (real devices keep their own)."""
    from broker_server.config import from_dict
    from broker_server.run_end import FinishedRun, nothing_to_resume
    from broker_server.simulate import kept_device_state

    fin = FinishedRun(run_dir=tmp_path, rounds=2, metrics=[], summary=None)
    raw = {"run": {"name": "t", "rounds": 2}, "data": {"dataset": "digits", "clients": 2}}
    proto = kept_device_state(from_dict({**raw, "train": {"algorithm": "fedproto"}}, "<t>"))
    assert proto and kept_device_state(from_dict({**raw, "train": {"algorithm": "fedavg"}}, "<t>")) == []
    said = nothing_to_resume(fin, 2, "simulate", proto)
    assert said.endswith(f"--rounds 3 or more, where its simulated devices start {proto[0]} afresh: a finished run "
                         "keeps no device state)")
    plain = f"fedfleet simulate: run {tmp_path} has finished all 2 rounds; nothing to resume (more rounds: " \
            f"fedfleet simulate --resume {tmp_path} --rounds 3 or more)"
    assert nothing_to_resume(fin, 2, "simulate", []) == plain
    assert "afresh" not in nothing_to_resume(fin, 2, "server", proto)
