"""The harness the reproduction scripts share (broker_server/experiments.py): resuming only cells
made with the same configuration (however the grid folder is spelt), the records' stamps, a
records file cut short, formatting, per-round lookups, the re-run comparison, option parsing,
the ``--out`` check (and the modes that exclude each other: ``--report-only`` with
``--estimate-only`` or ``--verify``, ``--estimate-only`` with ``--verify``) and the scripts'
exit on Ctrl-C or unusable records."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest

from broker_server.experiments import (
    NOT_RECORDED,
    Job,
    RecordsError,
    attach_round_series,
    cell_rounds_to_target,
    check_out_dir,
    claim_verdict,
    config_fingerprint,
    final_differences,
    int_list,
    load_results,
    metrics_only_in_one,
    name_list,
    pm,
    read_metrics,
    round_series,
    rounds_to_target,
    run_grid,
    script_exit,
    series_lines,
)
from broker_server.metrics_file import metrics_line

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
    # a figure computed from the line: round 1's 0.3 + 0.1 = 0.4 is the first to reach 0.35
    assert rounds_to_target(got, 0.35, lambda m: None if "accuracy_worst" not in m
                            else m["accuracy"] + m["accuracy_worst"]) == 1



def test_a_cell_whose_rounds_carry_no_figure_is_not_recorded_not_never(tmp_path: Path) -> None:
    # three cells: one that reaches 0.5 in round 2, one that stays below it, one whose rounds hold
    # no accuracy at all (a record made without the series) and one with no rounds on hand
    _write(tmp_path, {"key": "a/b/s0", "per_round": {"round": [1, 2], "accuracy": [0.4, 0.6]}},
           {"key": "a/b/s1", "per_round": {"round": [1, 2], "accuracy": [0.3, 0.4]}},
           {"key": "a/b/s2", "per_round": {"round": [1, 2], "loss": [2.0, 1.5]}},
           {"key": "a/b/s3", "final": {"accuracy": 0.9}})
    assert cell_rounds_to_target(tmp_path, "a/b/s0", 0.5) == 2
    assert cell_rounds_to_target(tmp_path, "a/b/s1", 0.5) is None
    assert cell_rounds_to_target(tmp_path, "a/b/s2", 0.5) == NOT_RECORDED
    assert cell_rounds_to_target(tmp_path, "a/b/s3", 0.5) == NOT_RECORDED
    # the loss is there: a target on it is judged (first round with loss ≥ 1.8 is round 1)
    assert cell_rounds_to_target(tmp_path, "a/b/s2", 1.8, "loss") == 1

LINES: list[dict] = [{"round": 1, "accuracy": 0.3, "seconds": 4.2, "phase_s": {"publish": 0.1}, "share": "all",
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



def test_a_diverged_cells_record_is_strict_json_and_reads_back_as_nan(tmp_path: Path) -> None:
    # a cell whose loss went NaN in round 2: its run folder's lines (strict, as the server writes
    # them) are attached to its record; the rewritten results.jsonl is strict JSON too
    run = tmp_path / "runs" / "g__x__s0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(metrics_line({"round": 1, "accuracy": 0.5, "loss": 1.5})
                                       + metrics_line({"round": 2, "accuracy": 0.1, "loss": float("nan")}),
                                       encoding="utf-8")
    _write(tmp_path, {"key": "g/x/s0", "final": {"accuracy": 0.1, "loss": float("inf")}})
    assert attach_round_series(tmp_path) == 1
    text = (tmp_path / "results.jsonl").read_text(encoding="utf-8")
    def refuse(token: str) -> None:
        raise ValueError(token)
    # worked out by hand: final.loss and per_round.loss[1] are the two non-finite numbers
    assert json.loads(text, parse_constant=refuse)["non_finite"] == {"/final/loss": "inf",
                                                                     "/per_round/loss/1": "nan"}
    rec = load_results(tmp_path)["g/x/s0"]
    assert rec["final"]["loss"] == float("inf") and rec["per_round"]["loss"][0] == 1.5
    assert rec["per_round"]["loss"][1] != rec["per_round"]["loss"][1] and "non_finite" not in rec
    # a damaged table before the last line is a damaged file, named
    (tmp_path / "results.jsonl").write_text('{"key": "a", "final": {"loss": 1.0}, "non_finite": {"/final/loss": "nan"}}'
                                            '\n{"key": "b"}\n', encoding="utf-8")
    with pytest.raises(RecordsError, match="line 1 is not a record .*'/final/loss', which is not null"):
        load_results(tmp_path)

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
    # a diverged cell re-run to the same NaN loss (last round and its column) is the same result;
    # a NaN against a number is not
    nan = float("nan")
    da = {"final": {"accuracy": 0.1, "loss": nan}, "per_round": {"loss": [1.5, nan], "acc": [[0.1, nan]]}}
    db = {"final": {"accuracy": 0.1, "loss": nan}, "per_round": {"loss": [1.5, nan], "acc": [[0.1, nan]]}}
    assert final_differences(da, db) == []
    dc = {"final": {"accuracy": 0.1, "loss": 2.0}, "per_round": {"loss": [1.5, 2.0], "acc": [[0.1, 0.2]]}}
    assert final_differences(da, dc) == ["loss", "per_round.acc", "per_round.loss"]


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


def _lines(*records: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


@pytest.mark.parametrize("tail", ['{"key": "g/fedavg/s2", "final": {"accur', "\x00" * 64,
                                  # whole JSON with a key, but a table naming a field it lacks: left out
                                  # by the reader, so cut off by the writer too (not kept to break the file
                                  # once a record follows it)
                                  '{"key": "g/fedavg/s2", "final": {"loss": null}, "non_finite": {"/final/los": '
                                  '"nan"}}\n'],
                         ids=["partial line", "NUL bytes", "malformed non_finite table"])
def test_an_unfinished_last_line_is_left_out_then_cut_off(tmp_path: Path, tail: str) -> None:
    """A write cut short (a killed grid, a power cut) leaves a partial last line or NUL bytes: the
    records before it are read, the line is left out (its cell is not on record), and the next grid
    run cuts it off before appending, so the file is whole again."""
    job = Job("g/fedavg/s0", CONFIG)
    whole = [{"key": "g/fedavg/s0", "final": {"accuracy": 0.5}, "config_sha256": config_fingerprint(CONFIG)},
             {"key": "g/fedavg/s1", "final": {"accuracy": 0.25}}]
    path = tmp_path / "results.jsonl"
    path.write_text(_lines(*whole) + tail, encoding="utf-8")
    assert load_results(tmp_path) == {r["key"]: r for r in whole}
    assert attach_round_series(tmp_path) == 0  # no run folders: nothing to attach, no error
    seen: list[dict] = []
    assert run_grid([job], tmp_path, on_result=seen.append) == {r["key"]: r for r in whole}
    assert seen == []  # the cell on record is skipped
    assert path.read_text(encoding="utf-8") == _lines(*whole)  # the unfinished line is gone, nothing else
    # a whole last record that lost only its newline keeps the record and gets the newline back
    path.write_text(_lines(*whole).rstrip("\n"), encoding="utf-8")
    run_grid([job], tmp_path)
    assert path.read_text(encoding="utf-8") == _lines(*whole)


def test_a_damaged_line_before_the_last_is_named(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    path.write_text(_lines({"key": "a"}) + '{"key": "b", broken\n' + _lines({"key": "c"}), encoding="utf-8")
    with pytest.raises(RecordsError, match=r"results.jsonl: line 2 is not a record"):
        load_results(tmp_path)
    with pytest.raises(RecordsError, match="line 2"):
        run_grid([Job("a", CONFIG)], tmp_path)
    path.write_text(_lines({"key": "a"}) + "[1, 2]\n" + _lines({"key": "c"}), encoding="utf-8")
    with pytest.raises(RecordsError, match="line 2 is not a record .not an object with a 'key'"):
        load_results(tmp_path)


def test_fingerprint_counts_a_path_in_the_grid_folder_relative_to_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A FedDO cell names its policy as ``OUT/policies/...``: relative or absolute spelling of
    ``OUT``, or a copy of the folder elsewhere, is the same configuration; a policy outside the
    folder is not rewritten."""
    monkeypatch.chdir(tmp_path)

    def cfg(policy: str) -> dict:
        return {**CONFIG, "algorithm": {"rank": 4, "policy": policy}}

    absolute = config_fingerprint(cfg(str(tmp_path / "grid" / "policies" / "p.pt")), tmp_path / "grid")
    assert config_fingerprint(cfg("grid/policies/p.pt"), "grid") == absolute
    assert config_fingerprint(cfg("./grid/../grid/policies/p.pt"), "grid/") == absolute
    assert config_fingerprint(cfg("copy/policies/p.pt"), "copy") == absolute
    # the value by hand: canonical JSON without the data folder, the policy as OUT/policies/p.pt
    by_hand = {**CONFIG, "data": {k: v for k, v in CONFIG["data"].items() if k != "data_dir"},
               "algorithm": {"rank": 4, "policy": "OUT/policies/p.pt"}}
    assert absolute == hashlib.sha256(json.dumps(by_hand, sort_keys=True).encode("utf-8")).hexdigest()
    # outside the folder, or without a folder: the path as written
    outside = cfg("elsewhere/policies/p.pt")
    assert config_fingerprint(outside, "grid") == config_fingerprint(outside)
    assert config_fingerprint(cfg("grid/policies/p.pt")) != absolute


def test_resume_takes_a_record_made_with_the_folder_spelt_otherwise(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    made = {**CONFIG, "algorithm": {"policy": str(tmp_path / "grid" / "policies" / "p.pt")}}
    rec = {"key": "g/feddo/s0", "final": {"accuracy": 0.5},
           "config_sha256": config_fingerprint(made, tmp_path / "grid")}
    _write(tmp_path / "grid", rec)
    seen: list[dict] = []
    resumed = Job("g/feddo/s0", {**CONFIG, "algorithm": {"policy": "grid/policies/p.pt"}})
    assert run_grid([resumed], "grid", on_result=seen.append) == {rec["key"]: rec} and seen == []
    # a record made before the folder was left out of the fingerprint: taken when spelt as then
    legacy = {**rec, "config_sha256": config_fingerprint(resumed.config)}
    _write(tmp_path / "grid", legacy)
    assert run_grid([resumed], "grid", on_result=seen.append) == {rec["key"]: legacy} and seen == []


def test_check_out_dir_says_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser(prog="repro")
    (tmp_path / "afile").write_text("", encoding="utf-8")
    for out, kw, said in ((tmp_path / "afile", {"report_only": False}, "is a file, not a folder"),
                          (tmp_path / "afile", {"report_only": True}, "is a file, not a folder"),
                          (tmp_path / "afile" / "sub", {"report_only": False}, "cannot write the records there"),
                          (tmp_path / "none", {"report_only": True}, "results.jsonl does not exist"),
                          (tmp_path / "g", {"report_only": False, "report": tmp_path}, "is a folder, not a file"),
                          (tmp_path / "g", {"report_only": False, "report": tmp_path / "afile" / "r.md"},
                           "cannot be written")):
        with pytest.raises(SystemExit) as exc:
            check_out_dir(p, out, **kw)
        assert exc.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "none").exists()  # --report-only makes nothing
    # a grid's folder is made, with an empty records file; then --report-only accepts it
    check_out_dir(p, tmp_path / "new" / "grid", report_only=False, report=tmp_path / "new" / "reports" / "r.md")
    assert (tmp_path / "new" / "grid" / "results.jsonl").read_text(encoding="utf-8") == ""
    check_out_dir(p, tmp_path / "new" / "grid", report_only=True)


def test_modes_that_exclude_each_other_are_refused_not_one_left_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each combination used to run one mode and leave the other out without a word (the FedPGP
    and FedOCP scripts reported and verified nothing; the FedDO one ran the estimate's cell)."""
    p = argparse.ArgumentParser(prog="repro")
    grid = tmp_path / "grid"
    grid.mkdir()
    (grid / "results.jsonl").write_text("", encoding="utf-8")
    for kw, said in (({"report_only": True, "estimate_only": True}, "--report-only runs no cell: it does not go "
                      "with --estimate-only"),
                     ({"report_only": True, "verify": 3}, "--report-only runs no cell: it does not go with --verify 3"),
                     ({"report_only": False, "estimate_only": True, "verify": 2},
                      "--estimate-only stops after its estimate: --verify 2 would not run")):
        with pytest.raises(SystemExit) as exc:
            check_out_dir(p, grid, **kw)
        assert exc.value.code == 2 and said in capsys.readouterr().err
    for kw in ({"report_only": True}, {"report_only": False, "estimate_only": True},
               {"report_only": False, "verify": 2}):
        check_out_dir(p, grid, **kw)  # each mode alone is taken


def test_script_exit_turns_ctrl_c_and_unusable_records_into_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted() -> int:
        raise KeyboardInterrupt

    def refused() -> int:
        raise RecordsError("OUT/results.jsonl: line 2 is not a record")

    assert script_exit(interrupted) == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted:") and "resumes" in err and err.count("\n") == 1
    assert script_exit(refused) == 1
    assert capsys.readouterr().err == "error: OUT/results.jsonl: line 2 is not a record\n"
    assert script_exit(lambda: 0) == 0


def test_claim_verdict_thresholds() -> None:
    """claim_verdict: the paper's gain reached, positive but smaller, zero or negative; a mean
    within the spread of its paired differences is not reproduced (and says why)."""
    assert claim_verdict(2.6, 2.55) == "reproduced"
    assert claim_verdict(0.4, 2.55) == "direction only"
    assert claim_verdict(-0.1, 2.55) == "not reproduced" and claim_verdict(0.0, 2.55) == "not reproduced"
    assert claim_verdict(0.1, None) == "reproduced" and claim_verdict(-0.1, None) == "not reproduced"
    assert claim_verdict(float("nan"), 1.0) == "no data"
    # three seeds whose differences are +0.2, -0.5, +1.0 pp: mean 0.23, population std 0.62
    diffs = [0.2, -0.5, 1.0]
    m = sum(diffs) / 3
    sd = (sum((d - m) ** 2 for d in diffs) / 3) ** 0.5
    noisy = "not reproduced (a positive mean within the spread: mean ≤ std of the paired differences)"
    assert claim_verdict(m, 2.55, sd, 3) == noisy
    assert claim_verdict(m, 2.55, sd, 1) == "direction only"  # one seed: no spread to compare with
    assert claim_verdict(0.9, 2.55, 0.3, 3) == "direction only"
    # a mean past the paper's gain but no larger than the seeds' spread shows no gain, nor a direction
    assert claim_verdict(3.89, 1.34, 7.06, 3) == noisy and claim_verdict(0.5, None, 0.6, 3) == noisy
    assert claim_verdict(3.89, 1.34, 7.06, 1) == "reproduced"  # one seed: no spread to compare with
