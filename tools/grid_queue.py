#!/usr/bin/env python3
"""Run the committed reproduction grids one after another, each resuming from its committed
records, and fold what ran back into ``benchmarks/``: the one command a session on a fresh machine
needs to go on with the grids.

    python tools/grid_queue.py --list               # per grid: records committed, portable, in its folder
    python tools/grid_queue.py --hours 2.5          # the grids in QUEUE order, stopped after 2.5 h
    python tools/grid_queue.py --only fedpgp        # one grid (comma list)
    python tools/grid_queue.py --merge              # no cell: fold what ran in and regenerate the reports
                                                    # (from the committed records alone where no grid ran)

Per grid (:data:`QUEUE`), in ``runs/grids/<name>/`` (git-ignored):

1. **seed**: a folder without ``results.jsonl`` gets the committed records (``benchmarks/results/``)
   made with portable CPU numerics (:mod:`broker_server.numerics`), which re-run to the same bits
   here; the others are left out, so their cells run again, now portable; a committed re-run check
   (``<name>.verify.md``) that passed on seeded records comes in as its ``verify.md``, so it is not
   run again; the grid's extra folders (FedDO's ``pretrain.json``) are copied in too;
2. **run**: the grid's script with its committed options (the report's ``Command`` line), into the
   folder, ``--workers`` processes; when every cell is on record and the folder has no
   ``verify.md``, ``--verify K`` re-runs its first K cells and compares;
3. **merge** (after each grid, and on ``--merge``): per cell the better of the folder's record and
   the committed one is committed (portable over native over failed; the folder's on a tie), so
   the committed records of cells not yet re-run are kept, and counted in the report as not
   portable; the folder's ``verify.md`` is committed as ``benchmarks/results/<name>.verify.md``
   and the extra folders are copied back (only the files the grid keeps: FedDO's ``pretrain.json``,
   not its 9-MB policies, which a later session pre-trains again and checks by their SHA-256;
   where the grid names a :attr:`Grid.fold_option`, its script first folds the committed folder
   into the grid's, before anything is committed: FedDO keeps every pre-training's cost, not only
   the last, and a fold that fails commits nothing of the grid folder); the
   committed report is regenerated from the merged
   records and that re-run check with ``--report-only`` (in a temporary folder, never the live
   one), its ``Command`` line naming the queue.

The queue exits 1 when a script failed, a cell's record is an error, a re-run check failed or a
report could not be regenerated (each named on stderr), 130 on Ctrl-C or SIGINT (after merging
what finished; also when started in the background with SIGINT ignored), else 0.

``--hours`` is a hard end: the grids' stop time (``FEDFLEET_GRID_STOP_AT``,
:func:`broker_server.experiments.run_grid`) is 5 minutes before it, so no cell starts that would
end after that (by the mean time × 1.25 of the recorded cells of its method and data set),
the running ones finish, and what finished
is merged; a cell still running at the deadline is stopped with SIGINT (not recorded; the next
invocation runs it); no grid or re-run check starts in its last 15 minutes. The grids' CPU plans are in
their reports; the whole queue is several sessions of 2 cores. Run it from a frozen checkout
(``git worktree add --detach ../grid HEAD``) so that edits made meanwhile do not change the code
under a running grid (each record carries the commit that made it), and copy
``benchmarks/results/`` and the reports back from there.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from broker_server.experiments import EXIT_STOPPED, STOP_AT_ENV, load_results  # noqa: E402
from broker_server.metrics_file import strict_json  # noqa: E402
from broker_server.numerics import portable_record  # noqa: E402
from protocol.files import write_atomically  # noqa: E402

#: where the committed reports and, in ``results/``, their records are
REPORTS = ROOT / "benchmarks"
RESULTS = REPORTS / "results"


@dataclass(frozen=True)
class Grid:
    """One committed grid: its script, the options its report was made with, and where its
    records, report and extra folders are committed."""

    name: str
    script: str
    options: tuple[str, ...]
    results: str
    report: str
    #: folder in the grid folder → committed folder (copied in at seeding, back at merging)
    extra_dirs: dict[str, str] = field(default_factory=dict)
    #: the files of the extra folders that are committed (glob patterns; empty: all of them)
    extra_keep: tuple[str, ...] = ()
    #: cells re-run by ``--verify`` once the grid is whole
    verify: int = 3
    #: the script's option that folds a committed extra folder into the grid folder's before it is
    #: copied back (``SCRIPT OPTION COMMITTED_DIR --out GRID_FOLDER``; FedDO's keeps every
    #: pre-training's cost, where a wholesale copy kept only the last); empty: copied as it is
    fold_option: str = ""


#: the grids, in the order they run (the FedPGP issue's two reports first, then FedOCP and FedDO)
QUEUE: tuple[Grid, ...] = (
    Grid("fedpad", "tools/reproduce_fedpad.py", (), "fedpad.jsonl", "fedpad.md"),
    Grid("fedpgp", "tools/reproduce_fedpgp.py",
         ("--rounds", "15", "--train-samples", "6000", "--epochs", "2", "--datasets", "MNIST,Fashion-MNIST,CIFAR-10"),
         "fedpgp.jsonl", "fedpgp.md"),
    Grid("fedpad-resnet8", "tools/reproduce_fedpad.py",
         ("--model", "resnet8", "--bench", "PACS", "--methods", "FedAvg,FedAvg uniform,FedPAD,FedPAD λ=0",
          "--no-sweep"),
         "fedpad-resnet8.jsonl", "fedpad-resnet8.md", verify=1),
    # FedOCP: CIFAR-10 whole (10 methods and the sweep), then Fashion-MNIST's baselines and FedOCP
    Grid("fedocp", "tools/reproduce_fedocp.py", ("--datasets", "CIFAR-10,Fashion-MNIST"), "fedocp.jsonl",
         "fedocp.md"),
    Grid("feddo", "tools/reproduce_feddo.py", (), "feddo.jsonl", "feddo.md",
         # the policies' pretrain.json (cost, episodes, each agent's SHA-256), not the policies (9 MB
         # each): a later session pre-trains again the ones its cells need and checks the bits
         extra_dirs={"policies": "feddo-policies"}, extra_keep=("*.json",), verify=2, fold_option="--fold-pretrain"),
)


def _not_kept(grid: Grid):
    """A ``shutil.copytree`` ``ignore``: the files of ``grid``'s extra folders that
    :attr:`Grid.extra_keep` does not name (folders are walked)."""
    def ignore(folder: str, names: list[str]) -> set[str]:
        if not grid.extra_keep:
            return set()
        return {n for n in names if not (Path(folder) / n).is_dir()
                and not any(fnmatch.fnmatch(n, pat) for pat in grid.extra_keep)}
    return ignore


def queue_command_line(grid: Grid, text: str) -> str:
    """``text`` (a report) with its command line — ``Command (records and report): …`` or, in
    FedDO's report, ``Command: …``, at the start of a line — naming the queue and the grid's own
    options instead of the temporary folder the report was regenerated in."""
    command = " ".join(shlex.quote(x) for x in (grid.script, *grid.options))
    return re.sub(r"(?m)^Command(?: \(records and report\))?: .*$",
                  f"Command (records and report): `python tools/grid_queue.py --only {grid.name}` (it runs "
                  f"`python {command} --out runs/grids/{grid.name}`, then this report with `--report-only`)", text)


def read_records(path: Path) -> list[dict]:
    """The records of a JSON-lines file (``[]`` when absent), one per key (a later line of a key
    replaces an earlier one), read as a grid folder's ``results.jsonl`` is
    (:func:`broker_server.experiments.load_results`)."""
    if not path.is_file():
        return []
    if path.name == "results.jsonl":
        return list(load_results(path.parent).values())
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(path, Path(tmp) / "results.jsonl")
        return list(load_results(tmp).values())


def _write_jsonl(path: Path, records: list[dict]) -> None:
    """Write ``records`` as strict JSON lines (spelt as :func:`broker_server.experiments.run_grid`
    spells them: :func:`broker_server.metrics_file.strict_json`) through a temporary file renamed
    over ``path``: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, "".join(strict_json(r) + "\n" for r in records).encode("utf-8"))


def portable(record: dict) -> bool:
    """Whether a record finished with portable CPU numerics, every library pinned
    (:func:`broker_server.numerics.portable_record`)."""
    return "error" not in record and portable_record(record.get("machine"))


def seed_records(committed: list[dict]) -> list[dict]:
    """The committed records a fresh grid folder starts from: the portable ones (the others'
    cells run again)."""
    return [r for r in committed if portable(r)]


def _rank(record: dict) -> int:
    """A record's worth for its cell: 2 finished with portable numerics, 1 finished otherwise,
    0 failed."""
    return 0 if "error" in record else 2 if portable(record) else 1


def merged_records(folder: list[dict], committed: list[dict]) -> list[dict]:
    """What is committed after a grid ran: per cell, the better of the folder's record and the
    committed one (portable over native over failed, :func:`_rank`; the folder's on a tie); the
    folder's cells first, in its order, then the committed cells it has not, in theirs."""
    best: dict[str, dict] = {}
    for r in folder:
        best[r["key"]] = r
    for r in committed:
        if r["key"] not in best or _rank(r) > _rank(best[r["key"]]):
            best[r["key"]] = r
    order = dict.fromkeys([r["key"] for r in folder] + [r["key"] for r in committed])  # folder's cells first
    return [best[k] for k in order]


def passed_verify(path: Path, seeded: set[str]) -> bool:
    """Whether the committed re-run check at ``path``
    (:func:`broker_server.experiments.verify_records`'s lines) passed on records that are all among
    the ``seeded`` keys: it names at least one cell, none of its cells **differs** or failed to
    re-run, and every cell it names is seeded; such a check is carried into a new grid folder
    instead of re-running its cells (they would re-run to the same bits)."""
    if not path.is_file():
        return False
    cells = [line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("- ")]
    keys = {line[2:].split(": recorded ", 1)[0] for line in cells}
    return bool(cells) and all("**differs**" not in line and ": recorded " in line for line in cells) and keys <= seeded


def _folder(grid: Grid, base: Path) -> Path:
    return base / grid.name


def seed(grid: Grid, base: Path) -> Path:
    """The grid folder, seeded when new (module docstring, step 1)."""
    out = _folder(grid, base)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "results.jsonl").exists():
        records = seed_records(read_records(RESULTS / grid.results))
        _write_jsonl(out / "results.jsonl", records)
        print(f"{grid.name}: seeded {out} with {len(records)} portable committed records", flush=True)
        if passed_verify(_verify_file(grid), {r["key"] for r in records}):
            shutil.copyfile(_verify_file(grid), out / "verify.md")
            print(f"{grid.name}: the committed re-run check {_verify_file(grid).name} passed on records seeded "
                  "here: it is kept (no --verify runs again)", flush=True)
    for inside, committed in grid.extra_dirs.items():
        src = RESULTS / committed
        if src.is_dir() and not (out / inside).exists():
            shutil.copytree(src, out / inside, ignore=_not_kept(grid))
    return out


#: seconds a stopped grid gets to end after its SIGINT, and again after a SIGTERM, before SIGKILL
STOP_GRACE_S = 120.0
#: seconds before ``--hours``' deadline by which a grid's cells are to end (its stop time): a cell
#: slower than expected has them before the SIGINT at the deadline
OVERRUN_S = 300.0
#: a grid (or its re-run check) is not started with less than this many seconds to the deadline
#: (with no cell on record its cells' time is unknown, and a cell cut off is lost)
MIN_START_S = 900.0


def _default_sigint() -> None:
    """In the child, before it runs: SIGINT back to its default (a queue started in the
    background by a non-interactive shell has it ignored, and a child would inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run(cmd: list[str], deadline: float | None) -> tuple[int, bool]:
    """Run ``cmd`` (in the repository root) until it ends or ``deadline`` (monotonic seconds).
    The script gets ``deadline`` − :data:`OVERRUN_S` as its grid's stop time
    (:data:`~broker_server.experiments.STOP_AT_ENV`; one set in this process's environment is not
    passed on): it starts no cell that would end after it and exits with
    :data:`~broker_server.experiments.EXIT_STOPPED` once its running cells are recorded. A cell
    still running at the deadline (one slower than its expected time by more than the margin and
    :data:`OVERRUN_S`) is stopped: SIGINT (unfinished cells are not recorded), then SIGTERM and
    SIGKILL after :data:`STOP_GRACE_S` each. A KeyboardInterrupt here stops it the same way and
    goes on.

    Returns:
        (its return code, whether it was stopped, at its stop time or by a signal).
    """
    print("+ " + " ".join(cmd), flush=True)
    env = {k: v for k, v in os.environ.items() if k != STOP_AT_ENV}  # only the queue's own deadline
    if deadline is not None:  # the cells end OVERRUN_S before the deadline, where SIGINT would come
        env[STOP_AT_ENV] = f"{time.time() + deadline - OVERRUN_S - time.monotonic():.0f}"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, preexec_fn=_default_sigint if os.name == "posix" else None)
    try:
        while True:
            try:
                rc = proc.wait(timeout=5)
                return rc, rc == EXIT_STOPPED
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() >= deadline:
                    print(f"deadline reached: stopping {cmd[1]}", flush=True)
                    return _stop(proc), True
    except KeyboardInterrupt:
        print(f"interrupted: stopping {cmd[1]}", flush=True)
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen) -> int:
    """SIGINT, then SIGTERM, then SIGKILL, :data:`STOP_GRACE_S` apart; the return code."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        proc.send_signal(sig)
        try:
            return proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def _verify_file(grid: Grid) -> Path:
    """Where a grid's re-run check (its folder's ``verify.md``) is committed."""
    return RESULTS / f"{Path(grid.results).stem}.verify.md"


def merge(grid: Grid, base: Path) -> bool:
    """Step 3 of the module docstring; with no grid folder, only the report is regenerated from
    the committed records (after a change to its script's report). Where the grid has a
    :attr:`Grid.fold_option`, its extra folders are folded first, and a fold that fails commits
    nothing of the grid folder. Returns whether the report was regenerated (False too when a fold
    failed; True when there are no records at all, and so nothing to do)."""
    out = _folder(grid, base)
    committed_path = RESULTS / grid.results
    has_folder = (out / "results.jsonl").is_file()
    if has_folder and grid.fold_option:  # folded first: a failed fold commits nothing of this grid
        for inside, committed_dir in grid.extra_dirs.items():
            if (out / inside).is_dir() and (RESULTS / committed_dir).is_dir():
                rc, _ = _run([sys.executable, grid.script, grid.fold_option, str(RESULTS / committed_dir),
                              "--out", str(out)], None)
                if rc != 0:
                    print(f"{grid.name}: {grid.fold_option} failed (exit {rc}): nothing of {out} committed, the "
                          "report left as it is", file=sys.stderr, flush=True)
                    return False
    if not has_folder:
        if not committed_path.is_file():
            print(f"{grid.name}: no grid folder {out} and no committed records: nothing to merge", flush=True)
            return True
        print(f"{grid.name}: no grid folder {out}: the report is regenerated from the committed records", flush=True)
        records = read_records(committed_path)
    else:
        records = merged_records(read_records(out / "results.jsonl"), read_records(committed_path))
        _write_jsonl(committed_path, records)
    if (out / "verify.md").is_file():
        shutil.copyfile(out / "verify.md", _verify_file(grid))
    for inside, committed_dir in grid.extra_dirs.items():
        if has_folder and (out / inside).is_dir():
            shutil.copytree(out / inside, RESULTS / committed_dir, dirs_exist_ok=True, ignore=_not_kept(grid))
    report = REPORTS / grid.report
    with tempfile.TemporaryDirectory() as tmp:
        _write_jsonl(Path(tmp) / "results.jsonl", records)
        if _verify_file(grid).is_file():
            shutil.copyfile(_verify_file(grid), Path(tmp) / "verify.md")
        for inside, committed_dir in grid.extra_dirs.items():  # as committed now (the grid folder's, folded)
            if (RESULTS / committed_dir).is_dir():
                shutil.copytree(RESULTS / committed_dir, Path(tmp) / inside, ignore=_not_kept(grid))
        rc, _ = _run([sys.executable, grid.script, *grid.options, "--out", tmp, "--report", str(report),
                      "--report-only"], None)
    if rc == 0 and report.is_file():  # the Command line names the queue, not the temporary folder
        report.write_text(queue_command_line(grid, report.read_text(encoding="utf-8")), encoding="utf-8")
    n = sum(1 for r in records if portable(r))
    print(f"{grid.name}: {committed_path} holds {len(records)} records ({n} portable); "
          f"report {'regenerated' if rc == 0 else f'NOT regenerated (exit {rc})'}", flush=True)
    return rc == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma list of grid names (default: all, in order)")
    ap.add_argument("--hours", type=float, default=0.0, help="stop after this many hours (0: no limit)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--base", default=str(ROOT / "runs" / "grids"), help="where the grid folders are")
    ap.add_argument("--merge", action="store_true", help="run no cell: merge the grid folders and regenerate")
    ap.add_argument("--list", action="store_true", help="per grid: committed records and how many are portable")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    known = {g.name: g for g in QUEUE}
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown grid(s) {', '.join(unknown)}; the queue is {', '.join(known)}")
    if args.hours < 0 or args.workers < 1:
        ap.error("--hours must be >= 0 and --workers >= 1")
    grids = [known[n] for n in names] if names else list(QUEUE)
    base = Path(args.base).resolve()  # the scripts run in the repository root
    if args.list:
        for g in grids:
            committed = read_records(RESULTS / g.results)
            folder = read_records(_folder(g, base) / "results.jsonl")
            print(f"{g.name}: {len(committed)} committed records, {sum(map(portable, committed))} portable; "
                  f"grid folder: {len(folder)} records")
        return 0
    if args.merge:
        return 0 if all([merge(g, base) for g in grids]) else 1
    # SIGINT stops the queue (merging what finished) even when it was started in the background
    # of a shell without job control, which starts it with SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    deadline = time.monotonic() + args.hours * 3600 if args.hours else None
    failures: list[str] = []
    for g in grids:
        if deadline is not None and time.monotonic() >= deadline - MIN_START_S:
            break
        out = seed(g, base)
        run = [sys.executable, g.script, *g.options, "--out", str(out), "--workers", str(args.workers)]
        try:
            rc, stopped = _run(run, deadline)
            failed = [r["key"] for r in read_records(out / "results.jsonl") if "error" in r]
            if rc != 0 and not stopped:
                failures.append(f"{g.name}: {g.script} exited with {rc}")
            if failed:
                failures.append(f"{g.name}: {len(failed)} cell(s) failed (first {failed[0]})")
            late = deadline is not None and time.monotonic() >= deadline - MIN_START_S
            if rc == 0 and not stopped and not failed and g.verify and not (out / "verify.md").exists() and not late:
                vrc, stopped = _run([*run, "--verify", str(g.verify)], deadline)
                if vrc != 0 and not stopped:
                    failures.append(f"{g.name}: --verify {g.verify} exited with {vrc}")
        except KeyboardInterrupt:  # what finished is kept: merge it, then stop
            merge(g, base)
            return 130
        if not merge(g, base):
            failures.append(f"{g.name}: the report was not regenerated")
        if stopped or (deadline is not None and time.monotonic() >= deadline - MIN_START_S):
            break
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
