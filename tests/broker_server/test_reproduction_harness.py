"""The harness the reproduction scripts share (broker_server/experiments.py): resuming only cells
made with the same configuration, the records' stamps, formatting, per-round lookups, the re-run
comparison and option parsing."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from broker_server.experiments import (
    Job,
    attach_round_series,
    config_fingerprint,
    final_differences,
    int_list,
    metrics_only_in_one,
    name_list,
    pm,
    read_metrics,
    round_series,
    rounds_to_target,
    run_grid,
    series_lines,
)

CONFIG = {"run": {"name": "g", "seed": 0, "rounds": 2},
          "data": {"dataset": "digits", "partition": "iid", "clients": 2, "data_dir": "/a/shared/data"},
          "train": {"algorithm": "fedavg", "local_epochs": 1, "batch_size": 16, "lr": 0.05}}


def _write(out: Path, *records: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def test_fingerprint_ignores_the_data_folder_and_key_order_but_not_values() -> None:
    moved = {**CONFIG, "data": {**CONFIG["data"], "data_dir": "/b/shared/data"}}
    reordered = {k: CONFIG[k] for k in reversed(list(CONFIG))}
    assert config_fingerprint(moved) == config_fingerprint(CONFIG) == config_fingerprint(reordered)
    other = {**CONFIG, "train": {**CONFIG["train"], "lr": 0.01}}
    assert config_fingerprint(other) != config_fingerprint(CONFIG)
    assert CONFIG["data"]["data_dir"] == "/a/shared/data"  # the caller's dict is not changed


def test_resume_skips_a_cell_of_the_same_configuration_and_refuses_another(tmp_path: Path) -> None:
    job = Job("g/fedavg/s0", CONFIG)
    same = {"key": job.key, "final": {"accuracy": 0.5}, "config_sha256": config_fingerprint(CONFIG)}
    _write(tmp_path / "a", same)
    seen: list[dict] = []
    assert run_grid([job], tmp_path / "a", on_result=seen.append) == {job.key: same}
    assert seen == []  # nothing ran
    legacy = {"key": job.key, "final": {"accuracy": 0.5}}  # written before records had a fingerprint
    _write(tmp_path / "b", legacy)
    assert run_grid([job], tmp_path / "b") == {job.key: legacy}
    _write(tmp_path / "c", {**same, "config_sha256": "0" * 64})
    with pytest.raises(ValueError, match="another configuration"):
        run_grid([job], tmp_path / "c")


def test_pm_formats_population_std_and_leaves_out_missing_values() -> None:
    # values 0.2 and 0.4: mean 30 %, population std sqrt((10² + 10²) / 2) = 10
    assert pm([0.2, None, 0.4]) == "30.00 ± 10.00"
    assert pm([0.5], plain_single=True) == "50.00" and pm([0.5]) == "50.00 ± 0.00"
    assert pm([1.25, 1.75], 1.0, 3) == "1.500 ± 0.250"
    assert pm([]) == "–" and pm([None]) == "–"


def test_rounds_to_target_reads_the_run_folder(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "a__b__s0"
    run.mkdir(parents=True)
    lines = [{"round": 1, "accuracy": 0.3, "accuracy_worst": 0.1}, {"round": 2, "accuracy": None},
             {"round": 3, "accuracy": 0.7, "accuracy_worst": 0.25}, {"round": 4, "accuracy": 0.9}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines), encoding="utf-8")
    got = read_metrics(tmp_path, "a/b/s0")
    assert got == lines and read_metrics(tmp_path, "a/b/s1") == []
    assert rounds_to_target(got, 0.7) == 3 and rounds_to_target(got, 0.95) is None
    assert rounds_to_target(got, 0.2, "accuracy_worst") == 3


LINES = [{"round": 1, "accuracy": 0.3, "seconds": 4.2, "phase_s": {"publish": 0.1}, "share": "all",
          "dropped": [], "alpha": [0.5, 0.5], "skipped": False},
         {"round": 2, "accuracy": None, "seconds": 3.9, "phase_s": {"publish": 0.2}, "share": "all",
          "dropped": ["dev-3"], "alpha": [0.25, 0.75], "skipped": True, "pool": 40}]


def test_round_series_keeps_numbers_and_short_number_lists_as_columns() -> None:
    s = round_series(LINES)
    # timings, strings, dicts and a list that once held a device name are left out; a field that a
    # round lacks is None there
    assert s == {"round": [1, 2], "accuracy": [0.3, None], "alpha": [[0.5, 0.5], [0.25, 0.75]],
                 "skipped": [False, True], "pool": [None, 40]}
    assert series_lines(s) == [{"round": 1, "accuracy": 0.3, "alpha": [0.5, 0.5], "skipped": False},
                               {"round": 2, "alpha": [0.25, 0.75], "skipped": True, "pool": 40}]
    assert round_series([]) == {} and series_lines({}) == []
    long = [{"round": 1, "per_device": list(range(65))}]  # longer than SERIES_LIST_MAX = 64
    assert round_series(long) == {"round": [1]}


def test_read_metrics_falls_back_to_the_records_rounds(tmp_path: Path) -> None:
    # a fresh checkout: the records are there, the run folders are not
    rec = {"key": "a/b/s0", "final": {"accuracy": 0.9}, "per_round": {"round": [1, 2], "accuracy": [0.4, 0.9]}}
    old = {"key": "a/b/s1", "final": {"accuracy": 0.8}}  # made before records carried their rounds
    _write(tmp_path, rec, old)
    assert read_metrics(tmp_path, "a/b/s0") == [{"round": 1, "accuracy": 0.4}, {"round": 2, "accuracy": 0.9}]
    assert rounds_to_target(read_metrics(tmp_path, "a/b/s0"), 0.5) == 2
    assert read_metrics(tmp_path, "a/b/s1") == [] and read_metrics(tmp_path, "nope") == []
    # a run folder on disk wins over the record
    run = tmp_path / "runs" / "a__b__s0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"round": 1, "accuracy": 0.95}) + "\n", encoding="utf-8")
    assert read_metrics(tmp_path, "a/b/s0") == [{"round": 1, "accuracy": 0.95}]
    # the records file changed: read again, not served from the cache
    _write(tmp_path, {**old, "per_round": {"round": [1], "accuracy": [0.1]}})
    assert read_metrics(tmp_path, "a/b/s1") == [{"round": 1, "accuracy": 0.1}]


def test_attach_round_series_fills_only_records_without_rounds(tmp_path: Path) -> None:
    have = {"key": "g/x/s0", "per_round": {"round": [1], "accuracy": [0.2]}}
    lacks = {"key": "g/y/s0", "final": {}}
    gone = {"key": "g/z/s0", "final": {}}  # no run folder either
    failed = {"key": "g/w/s0", "error": "RuntimeError: boom"}
    _write(tmp_path, have, lacks, gone, failed)
    for key in ("g__x__s0", "g__y__s0", "g__w__s0"):
        (tmp_path / "runs" / key).mkdir(parents=True)
        (tmp_path / "runs" / key / "metrics.jsonl").write_text(
            "".join(json.dumps(m) + "\n" for m in LINES), encoding="utf-8")
    assert attach_round_series(tmp_path) == 1
    recs = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["key"] for r in recs] == ["g/x/s0", "g/y/s0", "g/z/s0", "g/w/s0"]  # order and count kept
    assert recs[0] == have and recs[2] == gone and recs[3] == failed
    assert recs[1]["per_round"] == round_series(LINES)
    assert attach_round_series(tmp_path) == 0  # nothing left to attach: the file is not rewritten
    assert attach_round_series(tmp_path / "empty") == 0


def test_final_differences_leave_out_timings_only() -> None:
    a = {"final": {"accuracy": 0.5, "seconds": 3.0, "phase_s": {"collect": 1.0}, "loss": 1.0}}
    b = {"final": {"accuracy": 0.5, "seconds": 9.0, "phase_s": {"collect": 4.0}, "loss": 1.0}}
    assert final_differences(a, b) == []
    assert final_differences(a, {"final": {**b["final"], "loss": 1.1, "extra": 1}}) == ["extra", "loss"]
    assert final_differences(a, {}) == ["final"]
    # the same last round reached by another path: the differing round column is named
    ra = {**a, "per_round": {"round": [1, 2], "accuracy": [0.3, 0.5], "pool": [1, 2]}}
    rb = {**b, "per_round": {"round": [1, 2], "accuracy": [0.4, 0.5], "late": [0, 0]}}
    assert final_differences(ra, rb) == ["per_round.accuracy"]
    assert final_differences(ra, b) == []  # one side without rounds: only the last round compared
    # a metric the code added since the record: named apart, not a changed value
    assert metrics_only_in_one(a, {"final": {**b["final"], "extra": 1}}) == ["extra"]
    assert metrics_only_in_one(a, b) == []


def test_option_lists_name_what_was_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser(prog="repro")
    assert int_list(p, "--seeds", "0,1,,2") == [0, 1, 2]
    assert name_list(p, "--methods", "FedAvg,,FedPAD", ["FedAvg", "FedPAD"]) == ["FedAvg", "FedPAD"]
    for call, said in ((lambda: int_list(p, "--seeds", "0,x"), "--seeds takes comma-separated integers"),
                       (lambda: int_list(p, "--clients", "0", 1), "each >= 1"),
                       (lambda: name_list(p, "--methods", "FedAvg,Nope", ["FedAvg"]), "unknown ['Nope']")):
        with pytest.raises(SystemExit) as exc:
            call()
        assert exc.value.code == 2 and said in capsys.readouterr().err


def test_tags_may_not_replace_the_records_own_fields() -> None:
    """run_job writes ``{"key": job.key, **job.tags, ...}``: a tag ``key`` used to replace the cell's
    key in its record (a sweep's key name), so resuming never found the cell."""
    for name in ("key", "error", "config_sha256"):
        with pytest.raises(ValueError, match="reserved"):
            Job("g/fedavg/s0", CONFIG, tags={name: "x"})
    assert Job("g/fedavg/s0", CONFIG, tags={"sweep_key": "gamma"}).tags == {"sweep_key": "gamma"}
