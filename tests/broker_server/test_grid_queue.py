"""The grid queue (tools/grid_queue.py): which committed records seed a grid folder, what is
committed after a grid ran, and a seed-then-merge round trip whose report is regenerated from
the merged records."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.tools import load_tool

PORTABLE = {"cpu": "AMD EPYC", "arch": "x86_64", "torch": "2.14.1+cu130", "numpy": "2.4.6", "cpu_capability": "AVX2",
            "torch_threads": 1, "numerics": "portable"}
NATIVE = {**PORTABLE, "cpu_capability": "AVX512", "numerics": "native"}


def test_a_grid_folder_is_seeded_with_the_portable_records_only() -> None:
    q = load_tool("grid_queue")
    before_numpy = {k: v for k, v in PORTABLE.items() if k != "numpy"}  # torch pinned, numpy not yet
    recs = [{"key": "a", "machine": PORTABLE}, {"key": "b", "machine": NATIVE}, {"key": "c"},
            {"key": "d", "machine": PORTABLE, "error": "boom"}, {"key": "e", "machine": before_numpy}]
    assert [r["key"] for r in q.seed_records(recs)] == ["a"]


def test_a_committed_rerun_check_is_carried_only_when_it_passed_on_seeded_records(tmp_path: Path) -> None:
    q = load_tool("grid_queue")
    head = "Re-ran 2 recorded cells at commit `abc`; the records were made at `def`.\n\n"
    path = tmp_path / "g.verify.md"
    path.write_text(head + "- a: recorded 0.5, re-run 0.5 → same\n"
                    "- b: recorded 0.7, re-run 0.7 → same training; the wire differs (up_bytes)\n", encoding="utf-8")
    assert q.passed_verify(path, {"a", "b", "c"})
    assert not q.passed_verify(path, {"a", "c"})  # b's record is not seeded: its check says nothing here
    path.write_text(head + "- a: recorded 0.5, re-run 0.6 → **differs** (accuracy)\n", encoding="utf-8")
    assert not q.passed_verify(path, {"a"})
    path.write_text(head, encoding="utf-8")  # no cell re-ran
    assert not q.passed_verify(path, {"a"})
    assert not q.passed_verify(tmp_path / "absent.verify.md", {"a"})


def test_merged_records_by_hand() -> None:
    """Per cell the better record (portable over native over failed; the folder's on a tie), the
    folder's cells first in its order, then the committed cells it has not."""
    q = load_tool("grid_queue")
    folder = [{"key": "b", "v": 2}, {"key": "x", "error": "boom"}, {"key": "y", "error": "boom"},
              {"key": "p", "v": 2, "machine": NATIVE}, {"key": "n", "v": 2, "machine": PORTABLE}]
    committed = [{"key": "a", "v": 1}, {"key": "b", "v": 1}, {"key": "x", "v": 1},
                 {"key": "p", "v": 1, "machine": PORTABLE}, {"key": "n", "v": 1, "machine": NATIVE}]
    assert q.merged_records(folder, committed) == [
        {"key": "b", "v": 2}, {"key": "x", "v": 1}, {"key": "y", "error": "boom"},
        {"key": "p", "v": 1, "machine": PORTABLE}, {"key": "n", "v": 2, "machine": PORTABLE}, {"key": "a", "v": 1}]


def _record(t, method: str, acc: float, machine: dict, out: Path) -> dict:
    from broker_server.experiments import config_fingerprint

    kw = {"rounds": 3, "epochs": 1, "clients": 4, "train_samples": 0, "participation": 0.7, "lr": 0.01, "data_dir": ""}
    job = t.make_jobs(["MNIST"], ["Dir(0.1)"], [method], [0], sweep=None, **kw)[0]
    return {"key": job.key, "grid": "main", "dataset": "MNIST", "split": "Dir(0.1)", "method": method, "seed": 0,
            "rounds": 3, "seconds": 10.0, "up_bytes_per_client_round": 100.0, "down_bytes_per_client_round": 200.0,
            "commit": "abc1234", "final": {"accuracy": acc}, "machine": machine,
            "per_round": {"round": [1, 2, 3], "accuracy": [acc / 2, acc * 0.9, acc]},
            "config_sha256": config_fingerprint(job.config, out)}


def test_seed_run_and_merge_round_trip(tmp_path: Path, monkeypatch) -> None:
    """A committed native FedAvg record is left out of the new folder and a portable FedPGP one
    is carried in; after a portable FedAvg record lands in the folder, the committed file holds
    it and the FedPGP one, and the report, regenerated from them, shows the new accuracy."""
    q = load_tool("grid_queue")
    t = load_tool("reproduce_fedpgp")
    reports, base = tmp_path / "benchmarks", tmp_path / "grids"
    monkeypatch.setattr(q, "REPORTS", reports)
    monkeypatch.setattr(q, "RESULTS", reports / "results")
    grid = q.Grid("pgp", "tools/reproduce_fedpgp.py",
                  ("--datasets", "MNIST", "--splits", "Dir(0.1)", "--methods", "FedAvg,FedPGP", "--seeds", "0",
                   "--no-sweep", "--epochs", "1", "--clients", "4", "--rounds", "3"), "pgp.jsonl", "pgp.md")
    out = base / "pgp"
    old = _record(t, "FedAvg", 0.5, NATIVE, out)
    kept = _record(t, "FedPGP", 0.7, PORTABLE, out)
    (reports / "results").mkdir(parents=True)
    (reports / "results" / "pgp.jsonl").write_text(json.dumps(old) + "\n" + json.dumps(kept) + "\n", encoding="utf-8")
    (reports / "results" / "pgp.verify.md").write_text(
        f"Re-ran 1 recorded cell.\n\n- {kept['key']}: recorded 0.7, re-run 0.7 → same\n", encoding="utf-8")
    assert q.seed(grid, base) == out
    assert [r["key"] for r in q.read_records(out / "results.jsonl")] == [kept["key"]]
    assert (out / "verify.md").read_text(encoding="utf-8").endswith("→ same\n")  # passed on a seeded record
    new = _record(t, "FedAvg", 0.9, PORTABLE, out)
    with open(out / "results.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(new) + "\n")
    q.merge(grid, base)
    merged = q.read_records(reports / "results" / "pgp.jsonl")
    assert [(r["key"], r["final"]["accuracy"]) for r in merged] == [(kept["key"], 0.7), (new["key"], 0.9)]
    text = (reports / "pgp.md").read_text(encoding="utf-8")
    assert "| FedAvg | 90.00 |" in text and "| FedPGP | 70.00 |" in text
    assert "2 of 2 records were made with portable CPU numerics" in text
    assert "Command (records and report): `python tools/grid_queue.py --only pgp`" in text
    assert str(tmp_path) not in text.split("## Protocol")[0].split("Command")[1]  # no temporary folder named
    # by hand: FedPGP − FedAvg on seed 0 = 70 − 90 pp, one (setting, seed) pair
    assert ("'+5.64 pp over FedAvg on average': -20.00 ± 0.00 pp over 1 (setting, seed) pairs in 1 settings, "
            "ahead in 0 of 1 settings → **not reproduced**") in text
    # no grid folder (a report script changed, nothing re-run): the report comes from the committed records
    shutil.rmtree(out)
    (reports / "pgp.md").unlink()
    assert q.merge(grid, base)
    assert (reports / "pgp.md").read_text(encoding="utf-8") == text
    assert q.read_records(reports / "results" / "pgp.jsonl") == merged


def test_a_grid_is_stopped_at_the_deadline_even_when_the_queue_ignores_sigint(monkeypatch) -> None:
    """A queue started in the background by a non-interactive shell has SIGINT ignored; the
    script it runs still gets SIGINT's default at the deadline and ends (exit -2 or 130), and
    the call says it was stopped."""
    import signal
    import sys
    import time

    q = load_tool("grid_queue")
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        rc, stopped = q._run([sys.executable, "-c", "import time; time.sleep(60)"], time.monotonic() + 1.0)
    finally:
        signal.signal(signal.SIGINT, old)
    assert stopped and rc in (-signal.SIGINT, 130)
    rc, stopped = q._run([sys.executable, "-c", "raise SystemExit(3)"], None)
    assert (rc, stopped) == (3, False)


def test_the_deadline_reaches_the_script_as_its_grids_stop_time(tmp_path: Path, monkeypatch) -> None:
    """The script runs with FEDFLEET_GRID_STOP_AT = the deadline − OVERRUN_S as a Unix time
    (within a second or two of 1 h − 5 min from now here); a script that ends with EXIT_STOPPED
    (its grid left cells unstarted) counts as stopped; without a deadline no stop time is passed
    on, not even one set in the queue's own environment."""
    import sys
    import time

    from broker_server.experiments import EXIT_STOPPED, STOP_AT_ENV

    q = load_tool("grid_queue")
    seen = tmp_path / "stop_at"
    show = (f"import os, sys; open({str(seen)!r}, 'w').write(os.environ.get({STOP_AT_ENV!r}, 'unset')); "
            f"sys.exit({EXIT_STOPPED})")
    want = time.time() + 3600 - 300
    assert q.OVERRUN_S == 300
    assert q._run([sys.executable, "-c", show], time.monotonic() + 3600) == (EXIT_STOPPED, True)
    assert abs(float(seen.read_text()) - want) <= 1.5
    monkeypatch.setenv(STOP_AT_ENV, "12345")  # left over in the shell: not the queue's deadline
    assert q._run([sys.executable, "-c", show.replace(str(EXIT_STOPPED), "0")], None) == (0, False)
    assert seen.read_text() == "unset"


def test_a_grid_stopped_at_its_stop_time_is_merged_and_ends_the_queue(tmp_path: Path, monkeypatch) -> None:
    """Two grids whose script exits EXIT_STOPPED: the first is run once (no re-run check after a
    stop), merged, and the queue ends without starting the second (exit 0: a stop is no failure);
    with less than MIN_START_S to the deadline no grid starts at all."""

    from broker_server.experiments import EXIT_STOPPED

    q = load_tool("grid_queue")
    calls = tmp_path / "calls"
    stub = tmp_path / "stub.py"
    stub.write_text(f"import sys\nopen({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
                    f"sys.exit({EXIT_STOPPED})\n", encoding="utf-8")
    grids = [q.Grid(name, str(stub), ("--grid", name), f"{name}.jsonl", f"{name}.md", verify=2) for name in "ab"]
    monkeypatch.setattr(q, "QUEUE", grids)
    monkeypatch.setattr(q, "seed", lambda g, base: tmp_path / g.name)
    merged: list[str] = []
    monkeypatch.setattr(q, "merge", lambda g, base: merged.append(g.name) or True)
    assert q.main(["--hours", "1", "--base", str(tmp_path)]) == 0
    assert calls.read_text().splitlines() == [f"--grid a --out {tmp_path / 'a'} --workers 2"]
    assert merged == ["a"]
    calls.unlink()
    assert q.main(["--hours", f"{(q.MIN_START_S - 60) / 3600}", "--base", str(tmp_path)]) == 0
    assert not calls.exists() and merged == ["a"]


def test_only_the_kept_files_of_an_extra_folder_are_committed(tmp_path: Path) -> None:
    """FedDO's policies folder: pretrain.json is committed, the 9-MB policy files are not."""
    q = load_tool("grid_queue")
    src = tmp_path / "policies"
    (src / "sub").mkdir(parents=True)
    for name in ("pretrain.json", "a.pt", "sub/b.json", "sub/c.pt"):
        (src / name).write_text(name, encoding="utf-8")
    feddo = next(g for g in q.QUEUE if g.name == "feddo")
    assert feddo.extra_dirs == {"policies": "feddo-policies"} and feddo.extra_keep == ("*.json",)
    shutil.copytree(src, tmp_path / "kept", ignore=q._not_kept(feddo))
    assert sorted(p.relative_to(tmp_path / "kept").as_posix() for p in (tmp_path / "kept").rglob("*")) == [
        "pretrain.json", "sub", "sub/b.json"]
    every = q.Grid("x", "tools/x.py", (), "x.jsonl", "x.md", extra_dirs={"policies": "x-policies"})
    shutil.copytree(src, tmp_path / "all", ignore=q._not_kept(every))
    assert len(list((tmp_path / "all").rglob("*"))) == 5


FOLDING_SCRIPT = r"""
import json, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--out") + 1])
if "--report-only" in args:
    Path(args[args.index("--report") + 1]).write_text((out / "policies" / "pretrain.json").read_text(encoding="utf-8"),
                                                      encoding="utf-8")
elif "--fold" in args:
    if "fail" in args[args.index("--fold") + 1]:
        raise SystemExit(2)
    committed = json.loads((Path(args[args.index("--fold") + 1]) / "pretrain.json").read_text(encoding="utf-8"))
    folder = json.loads((out / "policies" / "pretrain.json").read_text(encoding="utf-8"))
    (out / "policies" / "pretrain.json").write_text(json.dumps({**folder, **{k: v + ["folded"] for k, v in
        committed.items()}}), encoding="utf-8")
"""


@pytest.mark.parametrize("fails", [False, True])
def test_a_grids_fold_option_folds_the_committed_extra_folder_in_before_the_copy_back(tmp_path: Path, monkeypatch,
                                                                                     fails: bool) -> None:
    """The merge runs ``SCRIPT FOLD_OPTION COMMITTED_DIR --out GRID_FOLDER`` before anything is
    committed: what is committed, and what the report is made from, is the folded file; a fold
    that fails commits nothing of the grid folder (its records, its extra folder, the report) and
    the merge says so (False: the queue exits 1)."""
    q = load_tool("grid_queue")
    reports = tmp_path / ("fail" if fails else "ok") / "benchmarks"
    monkeypatch.setattr(q, "REPORTS", reports)
    monkeypatch.setattr(q, "RESULTS", reports / "results")
    script = tmp_path / "fold.py"
    script.write_text(FOLDING_SCRIPT, encoding="utf-8")
    grid = q.Grid("x", str(script), (), "x.jsonl", "x.md", extra_dirs={"policies": "x-policies"},
                  extra_keep=("*.json",), fold_option="--fold")
    committed = reports / "results" / "x-policies"
    committed.mkdir(parents=True)
    (committed / "pretrain.json").write_text(json.dumps({"p": ["first make"]}), encoding="utf-8")
    out = tmp_path / "grids" / "x"
    (out / "policies").mkdir(parents=True)
    (out / "results.jsonl").write_text(json.dumps({"key": "x/1", "final": {"accuracy": 0.5}}) + "\n",
                                       encoding="utf-8")
    (out / "policies" / "pretrain.json").write_text(json.dumps({"p": ["re-make"], "q": ["new"]}), encoding="utf-8")
    (out / "policies" / "q.pt").write_bytes(b"9 MB")
    assert q.merge(grid, tmp_path / "grids") is (not fails)
    got = json.loads((committed / "pretrain.json").read_text(encoding="utf-8"))
    assert got == ({"p": ["first make"]} if fails else {"p": ["first make", "folded"], "q": ["new"]})
    if fails:
        assert not (reports / "x.md").exists() and not (reports / "results" / "x.jsonl").exists()
    else:
        assert json.loads((reports / "x.md").read_text(encoding="utf-8")) == got  # the fake report: what it was given
        assert [r["key"] for r in q.read_records(reports / "results" / "x.jsonl")] == ["x/1"]
    assert not (committed / "q.pt").exists()


def test_the_regenerated_reports_command_line_names_the_queue_in_either_spelling() -> None:
    q = load_tool("grid_queue")
    grid = q.Grid("feddo", "tools/reproduce_feddo.py", ("--datasets", "a b"), "feddo.jsonl", "feddo.md")
    want = ("Command (records and report): `python tools/grid_queue.py --only feddo` (it runs "
            "`python tools/reproduce_feddo.py --datasets 'a b' --out runs/grids/feddo`, then this report with "
            "`--report-only`)")
    for line in ("Command: `python tools/reproduce_feddo.py --out /tmp/tmpx1`",  # FedDO's report
                 "Command (records and report): `python tools/reproduce_fedpgp.py --out /tmp/x`"):
        text = f"# Report\n\n{line}\n\nA Command: in prose is left alone.\n"
        assert q.queue_command_line(grid, text) == f"# Report\n\n{want}\n\nA Command: in prose is left alone.\n"


QUEUE_IGNORING_SIGINT = r"""
import signal, sys
from pathlib import Path
sys.path.insert(0, "tools")
import grid_queue as q
tmp = Path(sys.argv[1])
q.RESULTS, q.REPORTS = tmp / "benchmarks" / "results", tmp / "benchmarks"
q.QUEUE = (q.Grid("slow", str(tmp / "slow.py"), (), "slow.jsonl", "slow.md"),)
raise SystemExit(q.main(["--only", "slow", "--base", str(tmp / "grids")]))
"""

SLOW_GRID = r"""
import sys, time
from pathlib import Path
if "--report-only" in sys.argv:
    raise SystemExit(0)
out = Path(sys.argv[sys.argv.index("--out") + 1])
(out / "started").write_text("1")
time.sleep(600)
"""


def test_sigint_stops_a_queue_started_with_sigint_ignored(tmp_path: Path) -> None:
    """A queue started in the background by a shell without job control inherits SIGINT ignored;
    it installs Python's handler itself, so its documented stop (SIGINT) stops it: its script is
    stopped, what finished is merged, and it exits 130."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "slow.py").write_text(SLOW_GRID, encoding="utf-8")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", QUEUE_IGNORING_SIGINT, str(tmp_path)], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        started = tmp_path / "grids" / "slow" / "started"
        while not started.exists() and proc.poll() is None:  # its grid is running
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=200)
    finally:  # a queue that did not stop leaves nothing behind: it and its grid are killed
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out
    assert "interrupted: stopping" in out
