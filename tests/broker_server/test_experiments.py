"""The reproduction grid runner: resumable results, bytes per client per round from the ledger,
the ensemble (GAcc) score checked against a second computation, and an interrupted or killed
grid stopping its workers."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import broker_server.experiments as experiments
from broker_server.experiments import (
    EXIT_STOPPED,
    STOP_AT_ENV,
    GridStopped,
    Job,
    config_fingerprint,
    earlier_verify,
    like_cells_seconds,
    load_results,
    mean_std,
    run_grid,
    run_with_estimate,
    script_exit,
    verify_records,
)
from broker_server.numerics import portable_supported


def _config(algorithm: str, clients: int, seed: int) -> dict:
    return {"run": {"name": "g", "seed": seed, "rounds": 2},
            "data": {"dataset": "digits", "partition": "iid", "clients": clients},
            "train": {"algorithm": algorithm, "local_epochs": 1, "batch_size": 16, "lr": 0.05},
            "server": {"quorum": clients, "round_deadline_s": 60.0, "join_timeout_s": 60.0, "client_eval": True,
                       "client_eval_max": 300},
            "broker": {"kind": "amqtt"}}


def _one_client(seed: int) -> Job:
    return Job(f"g/fedavg/s{seed}", _config("fedavg", 1, seed))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A grid folder with two one-client FedAvg cells on record (``g/fedavg/s0`` and ``s1``, made
    at commit ``abc1234``), run once for the module: a test copies the records it starts from
    (:func:`_seed_records`), never writes here."""
    out = tmp_path_factory.mktemp("recorded")
    res = run_grid([_one_client(0), _one_client(1)], out, workers=2, stamp={"commit": "abc1234"})
    assert all("error" not in r for r in res.values()), res
    return out


def _seed_records(recorded: Path, out: Path, keys: set[str]) -> list[dict]:
    """Write the records of ``keys`` from the module's grid folder into ``out``'s results.jsonl;
    returns them."""
    recs = [json.loads(x) for x in (recorded / "results.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["key"] in keys]
    assert {r["key"] for r in recs} == keys
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return recs


def test_grid_runs_resumes_and_accounts(tmp_path: Path) -> None:
    jobs = [Job("digits/c1/fedavg/s0", _config("fedavg", 1, 0), ensemble=True, tags={"method": "fedavg"}),
            Job("digits/c2/fedavg/s1", _config("fedavg", 2, 1), tags={"method": "fedavg"})]
    res = run_grid(jobs, tmp_path, workers=2, stamp={"commit": "abc1234"})
    assert set(res) == {j.key for j in jobs}
    # each new record names the configuration it was made with and carries the caller's stamp
    assert all(res[j.key]["config_sha256"] == config_fingerprint(j.config) for j in jobs)
    assert {r["commit"] for r in res.values()} == {"abc1234"}
    assert all("error" not in r for r in res.values()), res
    one = res["digits/c1/fedavg/s0"]
    # one client: the ensemble of its probabilities classifies like the client's own model
    assert one["ensemble_accuracy"] == pytest.approx(one["final"]["client_accuracy_mean"])
    # bytes per client per round: recomputed from the ledger rows of rounds >= 1, device side
    two = res["digits/c2/fedavg/s1"]
    con = sqlite3.connect(tmp_path / "runs" / "digits__c2__fedavg__s1" / "ledger.sqlite")
    up = con.execute("select sum(mqtt_header_bytes + topic_bytes + payload_bytes) from messages where side='agent' "
                     "and direction='up' and event in ('sent') and round >= 1").fetchone()[0]
    assert two["up_bytes_per_client_round"] == pytest.approx(up / (2 * 2))
    assert two["method"] == "fedavg"
    # the record carries its rounds: the accuracy curve of the run folder's metrics.jsonl
    curve = [json.loads(x)["accuracy"] for x in
             (tmp_path / "runs" / "digits__c2__fedavg__s1" / "metrics.jsonl").read_text().splitlines()]
    assert len(curve) == 2 and two["per_round"]["accuracy"] == curve and two["per_round"]["round"] == [1, 2]
    body = con.execute("select avg(body_bytes), avg(payload_bytes) from messages where side='agent' and kind='update' "
                       "and event='sent'").fetchone()
    assert sum(two["update_field_bytes_mean"].values()) + 1 == pytest.approx(body[0])  # + the body array header
    assert two["update_payload_bytes_mean"] == pytest.approx(body[1])
    # rerun: nothing new is run
    seen: list[dict] = []
    again = run_grid(jobs, tmp_path, workers=2, on_result=seen.append)
    assert seen == [] and set(again) == set(res)
    assert len(load_results(tmp_path)) == 2
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2


def test_an_interrupted_grid_stops_its_queued_cells(tmp_path: Path) -> None:
    """Ctrl-C in the grid's process (here: raised by the first record's callback) stops the grid:
    the cell running in the worker is ended and the queued one never starts. (Leaving the pool's
    block used to wait for every queued cell to run to its end, none of them recorded.)"""
    bad = {**_config("fedavg", 1, 0), "train": {**_config("fedavg", 1, 0)["train"], "algorithm": "no-such"}}
    jobs = [Job("g/bad/s0", bad), Job("g/fedavg/s1", _config("fedavg", 2, 1)),
            Job("g/fedavg/s2", _config("fedavg", 2, 2))]

    def interrupt(rec: dict) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_grid(jobs, tmp_path, workers=1, on_result=interrupt)
    # the first cell (failed at once on its configuration) is on record; nothing after it
    assert [r["key"] for r in load_results(tmp_path).values()] == ["g/bad/s0"]
    assert not (tmp_path / "runs" / "g__fedavg__s2").exists()  # queued: never started
    assert not (tmp_path / "runs" / "g__fedavg__s1" / "metrics.jsonl").exists() or \
        len((tmp_path / "runs" / "g__fedavg__s1" / "metrics.jsonl").read_text().splitlines()) < 2  # ended early
    assert multiprocessing.active_children() == []  # no worker left
    # the same grid again resumes: the two cells not on record run, the failed one runs again
    res = run_grid(jobs[1:], tmp_path, workers=1)
    assert all("error" not in res[j.key] for j in jobs[1:]) and res["g/fedavg/s2"]["rounds"] == 2


def test_a_resumed_grid_takes_its_estimate_from_the_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str], recorded: Path) -> None:
    """A fresh grid hands every cell to the workers at once and prints the estimate when its first
    cell finishes; a resumed one prints the mean time of the cells on record first and hands
    every missing cell to the workers at once (a cell run alone first would leave a worker idle
    for a cell's time); only --estimate-only runs one cell alone."""
    calls: list[tuple[list[str], int]] = []
    real = experiments.run_grid

    def counting(jobs: list[Job], out_dir: Path, *, workers: int, **kw: object) -> dict:
        calls.append(([j.key for j in jobs], workers))
        return real(jobs, out_dir, workers=workers, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(experiments, "run_grid", counting)
    first = [Job("g/fedavg/s0", _config("fedavg", 1, 0))]
    run_with_estimate(first, tmp_path / "estimate", workers=2, estimate_only=True)
    assert calls == [(["g/fedavg/s0"], 1)]  # --estimate-only: the first cell alone, nothing more
    assert capsys.readouterr().out.startswith("first cell ")
    calls.clear()
    seen: list[str] = []
    run_with_estimate(first, tmp_path, workers=2, on_result=lambda r: seen.append(r["key"]))
    assert calls == [(["g/fedavg/s0"], 2)] and seen == ["g/fedavg/s0"]  # fresh: straight to the workers
    took = load_results(tmp_path)["g/fedavg/s0"]["seconds"]
    assert capsys.readouterr().out.splitlines() == [  # the estimate, once the first cell is on record
        f"first cell {took:.0f} s; 0 more cells ≈ 0.0 CPU-hours, ≈ 0.0 h wall on 2 workers"]
    calls.clear()
    resumed = tmp_path / "resumed"
    on_record = _seed_records(recorded, resumed, {"g/fedavg/s0", "g/fedavg/s1"})
    more = [_one_client(i) for i in range(3)]
    run_with_estimate(more, resumed, workers=2)
    assert calls == [([j.key for j in more], 2)]  # straight to the workers (the grid skips those on record)
    mean = sum(r["seconds"] for r in on_record) / 2
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith(f"2 cells on record (mean {mean:.0f} s); 1 to run")
    assert all("error" not in r for r in load_results(resumed).values()) and len(load_results(resumed)) == 3


def test_a_grid_starts_no_cell_that_would_end_after_its_stop_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str],
                                                                   recorded: Path) -> None:
    """FEDFLEET_GRID_STOP_AT: a stop time already past starts nothing; with one cell on record
    (its time s), a stop time s/2 away starts nothing either (1.25 s > s/2: the next cell would
    end after it), leaving that cell unrecorded and saying how many were not started; an hour
    away, the grid goes on. A reproduction script stopped so exits with EXIT_STOPPED and a line."""
    jobs = [_one_client(i) for i in range(2)]
    monkeypatch.setenv(STOP_AT_ENV, f"{time.time() - 1:.0f}")
    with pytest.raises(GridStopped, match=r"2 cell\(s\) not started: each would have ended after the stop time"):
        run_grid(jobs, tmp_path, workers=2)
    assert load_results(tmp_path) == {}
    first = _seed_records(recorded, tmp_path, {"g/fedavg/s0"})[0]
    monkeypatch.setenv(STOP_AT_ENV, f"{time.time() + first['seconds'] / 2:.3f}")
    with pytest.raises(GridStopped, match=r"1 cell\(s\) not started.*the 0 that ran are on record"):
        run_grid(jobs, tmp_path, workers=2)
    assert set(load_results(tmp_path)) == {"g/fedavg/s0"}
    monkeypatch.setenv(STOP_AT_ENV, f"{time.time() + 3600:.0f}")
    assert set(run_grid(jobs, tmp_path, workers=2)) == {"g/fedavg/s0", "g/fedavg/s1"}
    monkeypatch.setenv(STOP_AT_ENV, "tomorrow")
    with pytest.raises(ValueError, match=f"{STOP_AT_ENV} must be a Unix time in seconds, got 'tomorrow'"):
        run_grid(jobs, tmp_path, workers=2)

    def stopped() -> int:
        raise GridStopped("OUT: 3 cell(s) not started")

    assert script_exit(stopped) == EXIT_STOPPED == 75
    assert capsys.readouterr().err == "stopped: OUT: 3 cell(s) not started\n"


def _grid_clock(monkeypatch: pytest.MonkeyPatch, *, stop_in_s: float) -> dict[str, float]:
    """Replace experiments' wall clock by one the test holds (``clock["now"]``, from 1e9 s; the test
    may move it) and set the grid's stop time ``stop_in_s`` after it; returns the clock."""
    clock = {"now": 1.0e9}

    class Clock:  # experiments' time module, its wall clock the test's
        def __getattr__(self, name: str) -> object:
            return getattr(time, name)

        @staticmethod
        def time() -> float:
            return clock["now"]

    monkeypatch.setattr(experiments, "time", Clock())
    monkeypatch.setenv(STOP_AT_ENV, f"{clock['now'] + stop_in_s:.0f}")
    return clock


def test_a_cell_is_expected_to_take_as_long_as_the_recorded_cells_of_its_method_and_data_set() -> None:
    """like_cells_seconds, worked by hand: a FedAvg MNIST cell expects the FedAvg MNIST records
    (10, 20 s), not the FedDO one (900 s) nor the CIFAR one (300 s); with no FedAvg MNIST record
    it takes FedAvg's records on any data set; a method never recorded takes the grid's records;
    records with an error and the folder's records of other grids count only when the grid has none."""
    def rec(method: str, dataset: str, secs: float, **extra: object) -> dict:
        return {"method": method, "dataset": dataset, "seconds": secs, **extra}

    done = {"a": rec("FedAvg", "mnist", 10.0), "b": rec("FedAvg", "mnist", 20.0), "c": rec("FedDO", "mnist", 900.0),
            "d": rec("FedAvg", "cifar10", 300.0), "e": rec("FedAvg", "mnist", 5000.0, error="boom"),
            "other": rec("FedAvg", "mnist", 7000.0)}
    mine = {"a", "b", "c", "d", "e"}

    def job(method: str, dataset: str) -> Job:
        return Job("new", {}, tags={"method": method, "dataset": dataset})

    assert like_cells_seconds(job("FedAvg", "mnist"), done, mine) == [10.0, 20.0]
    assert like_cells_seconds(job("FedDO", "mnist"), done, mine) == [900.0]
    assert like_cells_seconds(job("FedAvg", "fmnist"), done, mine) == [10.0, 20.0, 300.0]
    assert like_cells_seconds(job("MOON", "mnist"), done, mine) == [10.0, 20.0, 900.0, 300.0]
    assert like_cells_seconds(Job("untagged", {}), done, mine) == [10.0, 20.0, 900.0, 300.0]
    assert like_cells_seconds(job("FedAvg", "mnist"), done, set()) == [10.0, 20.0, 900.0, 300.0, 7000.0]
    assert like_cells_seconds(job("FedAvg", "mnist"), {}, mine) == []


def test_a_long_method_s_cell_is_held_back_where_a_short_one_still_fits_before_the_stop_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two methods on record: "slow" at 2,000 s, "fast" at 100 s; the stop time 1,000 s away on
    the grid's clock. The grid's mean (1,050 s) would start neither; by method, the slow cell is
    held back (1.25 × 2,000 s > 1,000 s) and the fast one, listed after it, starts and is
    recorded (1.25 × 100 s fits); the grid then says 1 cell was not started."""
    def job(method: str, seed: int) -> Job:
        return Job(f"g/{method}/s{seed}", _config("fedavg", 1, seed), tags={"method": method, "dataset": "digits"})

    on_record = [(job("slow", 0), 2000.0), (job("fast", 0), 100.0)]
    with open(tmp_path / "results.jsonl", "w", encoding="utf-8") as f:
        for j, secs in on_record:
            f.write(json.dumps({"key": j.key, "seconds": secs, "final": {"accuracy": 0.5}, **j.tags,
                                "config_sha256": config_fingerprint(j.config, tmp_path)}) + "\n")
    _grid_clock(monkeypatch, stop_in_s=1000)
    jobs = [j for j, _ in on_record] + [job("slow", 1), job("fast", 1)]
    with pytest.raises(GridStopped, match=r"1 cell\(s\) not started.*the 1 that ran are on record"):
        run_grid(jobs, tmp_path, workers=1)
    assert set(load_results(tmp_path)) == {"g/slow/s0", "g/fast/s0", "g/fast/s1"}
    assert load_results(tmp_path)["g/fast/s1"]["method"] == "fast"


def test_a_running_cell_finishes_and_is_recorded_when_the_stop_time_comes(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker, three cells, the first on record at 100 s, the stop time 1,000 s away on the
    grid's clock: the second starts (1.25 × 100 s ends in time); while it runs the clock moves
    past the stop time (each record moves it 2,000 s on), so the third does not start. The
    second is recorded whole, the third is not, and the grid says 1 cell was not started and 1
    ran; the first cell's 100 s (not the folder's other cell, an hour long) set the expectation."""
    jobs = [Job(f"g/fedavg/s{i}", _config("fedavg", 1, i)) for i in range(3)]
    other = Job("other/fedavg/s0", _config("fedavg", 1, 5))
    with open(tmp_path / "results.jsonl", "w", encoding="utf-8") as f:
        for job, secs in ((jobs[0], 100.0), (other, 3600.0)):
            f.write(json.dumps({"key": job.key, "seconds": secs, "final": {"accuracy": 0.5},
                                "config_sha256": config_fingerprint(job.config, tmp_path)}) + "\n")
    clock = _grid_clock(monkeypatch, stop_in_s=1000)
    ran: list[str] = []

    def later(rec: dict) -> None:
        ran.append(rec["key"])
        clock["now"] += 2000

    with pytest.raises(GridStopped, match=r"1 cell\(s\) not started.*the 1 that ran are on record"):
        run_grid(jobs, tmp_path, workers=1, on_result=later)
    assert ran == ["g/fedavg/s1"]
    on_record = load_results(tmp_path)
    assert set(on_record) == {"g/fedavg/s0", "other/fedavg/s0", "g/fedavg/s1"}
    assert "error" not in on_record["g/fedavg/s1"] and on_record["g/fedavg/s1"]["rounds"] == 2


def native_capability() -> str:
    """The ATen kernel build a process without the portable settings runs here (this one's)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def test_a_cell_re_runs_to_its_record_and_a_changed_record_is_named(tmp_path: Path, recorded: Path) -> None:
    """``verify_records``: a cell run again at the same code gives its record's every last-round
    metric and every round's figures (the grids' determinism); a record whose accuracy was changed
    by hand, and its machine fingerprint to native numerics on another CPU, re-runs with native
    numerics and is reported as differing, naming the field and the numerics difference; the
    lines are kept for a later report."""
    jobs = [_one_client(0), _one_client(1)]
    recs = _seed_records(recorded, tmp_path, {j.key for j in jobs})
    changed = next(r for r in recs if r["key"] == "g/fedavg/s1")
    changed["final"]["accuracy"] += 0.01
    portable = portable_supported()  # Linux x86-64 with AVX2: the workers ran the portable kernels
    assert changed["machine"]["numerics"] == ("portable" if portable else "native")
    here = changed["machine"]["cpu_capability"]
    changed["machine"] = {**changed["machine"], "cpu": "Other CPU", "cpu_capability": "OTHER", "numerics": "native"}
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    lines = verify_records(jobs, tmp_path, 2, workers=2, commit="def5678", headline=lambda r: r["final"]["accuracy"])
    assert lines[0].startswith("Re-ran 2 recorded cells at commit `def5678` on "
                               + ("portable" if portable else "native") + " numerics (")
    assert "the records were made at `abc1234`." in lines[0]
    same = next(x for x in lines if x.startswith("- g/fedavg/s0"))
    differs = next(x for x in lines if x.startswith("- g/fedavg/s1"))
    assert same.endswith("→ same"), same
    assert "**differs** (accuracy" in differs, differs  # with native kernels other figures differ too
    # the changed record re-ran with its own (native) numerics, on this machine's kernels
    assert differs.endswith(f"numerics differ: cpu_capability OTHER vs {native_capability()}"), differs
    assert "numerics differ" not in same and here
    assert earlier_verify(tmp_path)[2:] == lines and "OUT/verify.md" in earlier_verify(tmp_path)[0]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tmp")]  # the re-runs' folder is gone


def test_a_re_run_whose_only_differences_are_the_wires_says_so(tmp_path: Path, monkeypatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A re-run that resent an update (a late receipt on a loaded machine) differs in bytes and
    resends only: its line says the training is the same and names the delivery figures; one
    that also differs in accuracy is **differs**."""
    base = {"final": {"accuracy": 0.5, "loss": 1.0, "bytes_up": 100, "global_resends": 0},
            "per_round": {"round": [1], "accuracy": [0.5], "bytes_up": [100]}}
    recs = {"g/a": {"key": "g/a", **base}, "g/b": {"key": "g/b", **base}}
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs.values()), encoding="utf-8")
    again = {"g/a": {"key": "g/a", "final": {**base["final"], "bytes_up": 140, "global_resends": 1},
                     "per_round": {**base["per_round"], "bytes_up": [140]}},
             "g/b": {"key": "g/b", "final": {**base["final"], "accuracy": 0.6, "bytes_up": 140},
                     "per_round": base["per_round"]}}
    monkeypatch.setattr(experiments, "run_grid", lambda jobs, out, **kw: {j.key: again[j.key] for j in jobs})
    jobs = [Job("g/a", {}), Job("g/b", {})]
    lines = verify_records(jobs, tmp_path, 2, workers=1, commit="abc", headline=lambda r: r["final"]["accuracy"])
    wire = next(x for x in lines if x.startswith("- g/a"))
    assert wire.endswith("→ same training; the wire differs (bytes_up, global_resends, per_round.bytes_up)"), wire
    trained = next(x for x in lines if x.startswith("- g/b"))
    assert "→ **differs** (accuracy, bytes_up)" in trained, trained
    # printed too: neither cell is "same" (one differs on the wire only), then both lines
    assert capsys.readouterr().out.splitlines() == [
        f"re-run check ({tmp_path / 'verify.md'}): 0 of 2 cells the same", wire, trained]
    assert experiments.delivery_only(["bytes_down", "per_round.duplicates"])
    assert not experiments.delivery_only([]) and not experiments.delivery_only(["per_round.loss"])



def test_a_re_run_with_a_metric_the_record_predates_counts_as_the_same(tmp_path: Path, monkeypatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A metric added after the record was made (``samples_trained``) is named as in one of the two
    only; every shared figure equal, the cell is *same* and counted so in the printed line."""
    base = {"final": {"accuracy": 0.5, "loss": 1.0}, "per_round": {"round": [1], "accuracy": [0.5]}}
    (tmp_path / "results.jsonl").write_text(json.dumps({"key": "g/a", **base}) + "\n", encoding="utf-8")
    again = {"key": "g/a", "final": {**base["final"], "samples_trained": 40}, "per_round": base["per_round"]}
    monkeypatch.setattr(experiments, "run_grid", lambda jobs, out, **kw: {"g/a": again})
    lines = verify_records([Job("g/a", {})], tmp_path, 1, workers=1, commit="abc",
                           headline=lambda r: r["final"]["accuracy"])
    line = next(x for x in lines if x.startswith("- g/a"))
    assert line.endswith("→ same; metrics in only one of the two: samples_trained"), line
    assert capsys.readouterr().out.splitlines()[0] == f"re-run check ({tmp_path / 'verify.md'}): 1 of 1 cells the same"

def test_mean_std() -> None:
    assert mean_std([1.0, 3.0]) == (2.0, 1.0)
    m, s = mean_std([])
    assert m != m and s != s


_ORPHAN_SCRIPT = """
import multiprocessing, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from broker_server.experiments import die_with_parent
if __name__ == "__main__":
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=die_with_parent)
    print(pool.submit(os.getpid).result(), flush=True)
    pool.submit(time.sleep, 120)
    time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_grid_workers_die_with_a_killed_grid_process(tmp_path: Path) -> None:
    """A reproduction killed with SIGKILL (no chance to shut its pool down) takes its workers
    with it: the worker, busy in a 120 s job, is gone soon after its parent."""
    script = tmp_path / "grid.py"
    script.write_text(_ORPHAN_SCRIPT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(30)
        for _ in range(300):  # the kernel's signal is immediate; the loop only bounds a failure
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                break
            with contextlib.suppress(ChildProcessError):
                os.waitpid(worker, os.WNOHANG)
            time.sleep(0.1)
        else:
            os.kill(worker, signal.SIGKILL)
            pytest.fail(f"worker {worker} outlived its killed grid process")
    finally:
        parent.kill()


def test_code_commit_is_dirty_for_code_changes_not_for_records(tmp_path: Path) -> None:
    """A changed record or report under ``benchmarks/`` leaves the commit clean; a changed code
    file makes it ``+dirty``; outside a checkout it is ``unknown``."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()

    from broker_server.experiments import code_commit

    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "r.md").write_text("a\n", encoding="utf-8")
    (tmp_path / "code.py").write_text("x = 1\n", encoding="utf-8")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git("rev-parse", "--short", "HEAD")
    assert code_commit(tmp_path) == head
    (tmp_path / "benchmarks" / "r.md").write_text("b\n", encoding="utf-8")
    assert code_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n", encoding="utf-8")
    assert code_commit(tmp_path) == head + "+dirty"
    assert code_commit(tmp_path / "benchmarks" / "none") == "unknown"
