"""The FedPGP reproduction report on hand-made records: means over seeds, rounds to target from the
records' own rounds (``n/r`` where a record has none), the projection's share over all rounds,
controls and claims compared over the seeds both sides have, the sweep table; the sweep on a
split whose name holds a ``/``; options that cannot make a grid are usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.tools import load_tool


def _tool():
    return load_tool("reproduce_fedpgp")


SETTINGS = {"rounds": 3, "epochs": 1, "clients": 4, "train_samples": 0, "participation": 0.7, "lr": 0.01}


def _rec(method: str, seed: int, acc: float, curve: list[float] | None = None, share: list[float] | None = None,
         grid: str = "main", **tags) -> dict:
    key = f"{grid}/MNIST/Dir_0.1/{method}/s{seed}" + (f"/{tags.get('sweep_key')}={tags.get('value')}"
                                                      if grid == "sweep" else "")
    final = {"accuracy": acc}
    rec = {"key": key, "grid": grid, "dataset": "MNIST", "split": "Dir(0.1)", "method": method, "seed": seed,
           "rounds": 3, "seconds": 10.0, "up_bytes_per_client_round": 100.0, "down_bytes_per_client_round": 200.0,
           "commit": "abc1234", **tags}
    if share is not None:
        final.update(pgp_projected_share=share[-1], pgp_pool_size=40, pgp_pool_bytes=10880)
    rec["final"] = final
    if curve is not None:
        rec["per_round"] = {"round": list(range(1, len(curve) + 1)), "accuracy": curve,
                            **({"pgp_projected_share": share} if share is not None else {})}
    return rec


def test_report_figures_from_records(tmp_path: Path) -> None:
    t = _tool()
    recs = [
        _rec("FedAvg", 0, 0.80, [0.5, 0.85, 0.80]),
        _rec("FedAvg", 1, 0.84, [0.6, 0.7, 0.84]),
        # FedPGP: seed 0's rounds recorded, seed 1's not (a record from before records carried them)
        _rec("FedPGP", 0, 0.90, [0.88, 0.91, 0.90], share=[0.2, 0.4, 0.6]),
        _rec("FedPGP", 1, 0.70, None, share=[0.5]),
        # the control has seed 0 only: compared with FedPGP's seed 0 (0.90), not its mean (0.80)
        _rec("FedPGP no projection (g+g_p)", 0, 0.95, [0.9, 0.95, 0.95]),
        _rec("FedPGP", 0, 0.92, [0.9, 0.91, 0.92], grid="sweep", sweep_key="mix_size", value=32),
        _rec("FedPGP", 1, 0.74, None, grid="sweep", sweep_key="mix_size", value=32),
    ]
    # as in --report-only: the records in OUT/results.jsonl, no run folders
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    results = {r["key"]: r for r in recs}
    methods = ["FedAvg", "FedPGP", "FedPGP no projection (g+g_p)"]
    text = t.report(results, out=tmp_path, datasets=["MNIST"], splits=["Dir(0.1)"], methods=methods, seeds=[0, 1],
                    settings=SETTINGS, wall_s=None, commit="def5678", verify=[])
    # FedAvg: (80 + 84) / 2 = 82, population std 2; first round ≥ 90 %: never in either seed
    assert "| FedAvg | 82.00 ± 2.00 | never · never |" in text
    # FedPGP (90, 70) → 80 ± 10; rounds to 90 %: round 2 in seed 0, not recorded in seed 1
    assert "| FedPGP | 80.00 ± 10.00 | 2 · n/r |" in text
    assert "| FedPGP no projection (g+g_p) | 95.00 (1 of 2 seeds) | 1 |" in text
    # the projection's share: seed 0's mean over its rounds (0.2 + 0.4 + 0.6) / 3 = 40 %, the one
    # seed with rounds (1 of 2); last round (60, 50) → 55 ± 5
    assert "| MNIST Dir(0.1) | 2 | 40.0 % (1 of 2) | 55.0 ± 5.0 % | 40 ± 0 | 10880 ± 0 |" in text
    # claims paired per seed FedPGP and FedAvg share: 90 − 80 = +10, 70 − 84 = −14 pp: mean −2, population
    # std 12; the one setting's mean is negative, so it is not ahead there
    assert ("'+5.64 pp over FedAvg on average': -2.00 ± 12.00 pp over 2 (setting, seed) pairs in 1 settings, "
            "ahead in 0 of 1 settings → **not reproduced**") in text
    # the control against FedPGP on their shared seed 0: 95 − 90 = +5 pp
    assert ("control 'FedPGP no projection (g+g_p)' − FedPGP: +5.00 pp per setting (mean over its seeds), "
            "+5.00 ± 0.00 pp over the (setting, seed) pairs, ahead in 1 of 1 settings.") in text
    assert "- reading: adding g_p to the batch gradient without projecting did better than FedPGP's projection " \
        "(+5.00 pp on average)" in text
    # FedPGP's mean (80) is below FedAvg's (82) in the one setting: best in 0 of 1, FedAvg the one baseline run
    assert ("'best in 10 of 12 settings': best in 0 of 1 (among FedPGP and the 1 of 7 baselines on record: FedAvg) "
            "→ **not reproduced**") in text
    # the sweep: the default row is main FedPGP on the swept seeds 0, 1 (90, 70 → 80 ± 10); mix_size 32
    # (92, 74 → 83 ± 9), Δ paired per seed +2, +4 → +3 ± 1
    assert "| mix_size | 8 (default) | 80.00 ± 10.00 | – | 2 |" in text
    assert "| mix_size | 32 | 83.00 ± 9.00 | +3.00 ± 1.00 | 2 |" in text
    assert "Records made at commit(s) `abc1234`." in text and "commit `def5678`" in text


def test_the_sweep_runs_on_a_split_whose_name_holds_a_slash() -> None:
    """``--sweep-bench "MNIST/2 classes/client"``: the data set is before the first ``/``."""
    kw = {"rounds": 1, "epochs": 1, "clients": 4, "train_samples": 0, "participation": 0.7, "lr": 0.01, "data_dir": ""}
    jobs = _tool().make_jobs(["MNIST"], ["Dir(0.1)"], ["FedAvg"], [0], sweep="MNIST/2 classes/client", **kw)
    sweep = [j for j in jobs if j.tags["grid"] == "sweep"]
    # every non-default value of every key: 3 + 3 + 2 + 1 + 1 + 1
    assert len(sweep) == 11 and sweep[0].key == "sweep/MNIST/2_classes_client/mix_size=2/s0"
    assert {j.tags["split"] for j in sweep} == {"2 classes/client"}
    assert sweep[0].config["data"]["partition"] == "classes" and sweep[0].config["data"]["classes_per_client"] == 2


@pytest.mark.parametrize("argv", [["--rounds", "-1"], ["--rounds", "0"], ["--clients", "0"], ["--epochs", "0"],
                                  ["--workers", "0"], ["--verify", "-1"], ["--train-samples", "-5"],
                                  ["--participation", "0"], ["--lr", "0"], ["--seeds", "x"], ["--methods", "Nope"],
                                  ["--sweep-bench", "MNIST/Dir(0.3)"], ["--sweep-bench", "MNIST"],
                                  ["--estimate-only", "--verify", "2"], ["--report-only", "--verify", "1"],
                                  ["--report-only", "--estimate-only"]])
def test_bad_options_are_usage_errors(argv: list[str], tmp_path: Path) -> None:
    """Each used to reach the grid: a traceback, or every cell recorded as a ConfigError and exit 0."""
    with pytest.raises(SystemExit) as exc:
        _tool().main([*argv, "--out", str(tmp_path / "grid"), "--report", str(tmp_path / "r.md")])
    assert exc.value.code == 2
    assert not (tmp_path / "grid").exists()  # refused before any folder or cell was made


def test_report_only_refuses_records_of_other_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--report-only`` describes the command line's options; a record of the same key made with
    another ``--rounds`` would be reported under a protocol it did not run, so it is refused."""
    from broker_server.experiments import config_fingerprint

    t = _tool()
    out, report = tmp_path / "grid", tmp_path / "r.md"
    kw = {"rounds": 3, "epochs": 1, "clients": 4, "train_samples": 0, "participation": 0.7, "lr": 0.01, "data_dir": ""}
    job = t.make_jobs(["MNIST"], ["Dir(0.1)"], ["FedAvg"], [0], sweep=None, **kw)[0]
    rec = {**_rec("FedAvg", 0, 0.8, [0.5, 0.7, 0.8]), "key": job.key,
           "config_sha256": config_fingerprint(job.config, out)}
    out.mkdir()
    (out / "results.jsonl").write_text(json.dumps(rec) + "\n", encoding="utf-8")
    argv = ["--out", str(out), "--report", str(report), "--report-only", "--datasets", "MNIST", "--splits",
            "Dir(0.1)", "--methods", "FedAvg", "--seeds", "0", "--no-sweep", "--epochs", "1", "--clients", "4"]
    assert t.script_exit(lambda: t.main([*argv, "--rounds", "5"])) == 1
    assert "other options than these" in capsys.readouterr().err and not report.exists()
    assert t.script_exit(lambda: t.main([*argv, "--rounds", "3"])) == 0
    assert "| FedAvg | 80.00 |" in report.read_text(encoding="utf-8")
