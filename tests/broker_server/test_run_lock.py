"""One process at a time in a run folder (:mod:`broker_server.run_lock`).

A ``fedfleet server`` (and ``fedfleet simulate``, and a reproduction grid on its grid folder)
holds an ``flock`` on the folder's ``run.lock`` for its life and writes its command, pid, host and
start time there. A second server, resume or simulation in that folder is refused at once, before
it prints or writes anything, naming the folder and the holder, with exit 5; the kernel releases
the lock of a killed holder, so its folder can be resumed (the stale record is taken over). The
holder of the first test is a real ``fedfleet server`` process waiting for its agents, the
refused one a real second process, the killed one SIGKILLed.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker_server import cli
from broker_server.config import load
from broker_server.errors import ConfigError, RunFolderBusy
from broker_server.experiments import run_grid
from broker_server.run_lock import LOCK_NAME, Holder, RunFolderLock, check_not_held, hold_run_folder
from broker_server.server_main import run_server
from broker_server.simulate import simulate

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.toml"


def _holder(run: Path) -> Holder | None:
    try:
        data = json.loads((run / LOCK_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return Holder(**data)


def _busy(run: Path, holder: Holder) -> str:
    """What ``fedfleet`` prints on stderr when ``holder`` holds ``run``."""
    return (f"fedfleet: run folder {run} is in use by another process ({holder.command}, pid {holder.pid} on host "
            f"{holder.host}, started {holder.started}); one process at a time writes a run folder: wait for that "
            "one to end or stop it (a killed one frees the folder at once), then try again\n")


def _fedfleet(*argv: str, **kw) -> subprocess.Popen:  # noqa: ANN003
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "FEDFLEET_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "broker_server.cli", *argv], cwd=REPO, env=env, text=True, **kw)


def test_a_second_server_is_refused_while_the_first_runs_and_a_killed_ones_folder_resumes(
        tmp_path: Path, stopped_after_joins: None, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    assert cli.main(["server", "--config", str(QUICKSTART), "--out", str(run)]) == cli.EXIT_INTERRUPTED
    capsys.readouterr()
    assert not (run / LOCK_NAME).exists()  # a session that ended gave its lock back
    config = (run / "config.toml").read_text(encoding="utf-8")
    assert "\njoin_timeout_s = 60.0\n" in config
    (run / "config.toml").write_text(config.replace("\njoin_timeout_s = 60.0\n", "\njoin_timeout_s = 900.0\n"),
                                     encoding="utf-8")  # the first server waits for its agents all along the test

    # the run's server, resumed, waits for its agents (60 s join timeout) on its own embedded broker
    first = _fedfleet("server", "--resume", str(run), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while (holder := _holder(run)) is None or holder.pid != first.pid:
            assert first.poll() is None, first.communicate()[1]
            assert time.monotonic() < deadline, "the first server never took the run folder's lock"
            time.sleep(0.2)
        assert holder.command == "fedfleet server" and holder.host == os.uname().nodename

        second = _fedfleet("server", "--resume", str(run), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = second.communicate(timeout=180)
        assert (second.returncode, out, err) == (cli.EXIT_BUSY, "", _busy(run, holder))  # before its first line
        # simulate takes the same lock; the library call refuses too (not only the command line's check)
        assert cli.main(["simulate", "--resume", str(run)]) == cli.EXIT_BUSY
        assert capsys.readouterr() == ("", _busy(run, holder))
        with pytest.raises(RunFolderBusy) as caught:
            run_server(load(run / "config.toml"), run_dir=run, resume=True)
        assert (caught.value.run_dir, caught.value.holder) == (run, holder)
        assert first.poll() is None and _holder(run) == holder  # the holder goes on
    finally:
        first.send_signal(signal.SIGKILL)  # no clean-up of its own: the kernel gives the lock back
        first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL
    assert _holder(run) == holder  # its record is left, stale: no lock holds it

    assert cli.main(["server", "--resume", str(run)]) == cli.EXIT_INTERRUPTED
    out = capsys.readouterr().out
    assert f"fedfleet server: resuming {run} after round 0 of 5" in out
    assert not (run / LOCK_NAME).exists()


def test_the_lock_file_names_its_holder_while_held_and_goes_with_it(tmp_path: Path) -> None:
    run = tmp_path / "new" / "run"
    with hold_run_folder(run, "fedfleet simulate") as lock:
        assert lock.held and run.is_dir()
        holder = _holder(run)
        assert holder is not None and (holder.command, holder.pid) == ("fedfleet simulate", os.getpid())
        with pytest.raises(RunFolderBusy) as caught:  # another open file of this process is refused too
            RunFolderLock(run, "fedfleet server").acquire()
        assert caught.value.holder == holder
        with pytest.raises(RunFolderBusy):
            check_not_held(run)
    assert not (tmp_path / "new").exists()  # the folders it made, left empty, go
    check_not_held(run)  # nothing there: not held, nothing made

    kept = tmp_path / "kept"
    kept.mkdir()
    with hold_run_folder(kept, "fedfleet server"):
        (kept / "metrics.jsonl").write_text("{}\n")
    assert sorted(p.name for p in kept.iterdir()) == ["metrics.jsonl"]
    with hold_run_folder(kept / "a" / "b", "fedfleet server"):
        (kept / "a" / "notes.txt").write_text("")
    assert sorted(p.name for p in (kept / "a").iterdir()) == ["notes.txt"]  # a parent with a file stays


def test_a_stale_record_of_a_dead_holder_does_not_block(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).write_text(json.dumps({"command": "fedfleet server", "pid": 999999, "host": "gone",
                                                  "started": "2020-01-01T00:00:00+00:00"}) + "\n")
    check_not_held(tmp_path)
    with hold_run_folder(tmp_path, "fedfleet server"):
        holder = _holder(tmp_path)
        assert holder is not None and holder.pid == os.getpid() and holder.host != "gone"
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_holder_that_has_not_written_itself_yet_is_said_so(tmp_path: Path) -> None:
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked, its record not written yet
        with pytest.raises(RunFolderBusy) as caught:
            RunFolderLock(tmp_path, "fedfleet server").acquire()
    finally:
        os.close(fd)
    assert caught.value.holder is None
    assert str(caught.value) == (
        f"run folder {tmp_path} is in use by another process (starting: it has not written its pid, host and start "
        "time yet); one process at a time writes a run folder: wait for that one to end or stop it (a killed one "
        "frees the folder at once), then try again")


def test_a_folder_that_cannot_be_made_is_a_configuration_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"file/run: the run folder cannot be made \(Not a directory\)"):
        RunFolderLock(tmp_path / "file" / "run", "fedfleet server").acquire()
    with pytest.raises(ConfigError, match="file: a file, not a run folder"):
        RunFolderLock(tmp_path / "file", "fedfleet server").acquire()


def test_simulate_and_a_grid_hold_their_folders(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A fresh simulation into a folder another process holds is refused before anything (its
    configuration checks included) runs; so is a second grid in a grid folder: no
    ``results.jsonl`` is made or mended there."""
    run = tmp_path / "run"
    with hold_run_folder(run, "fedfleet server"):
        holder = _holder(run)
        assert holder is not None
        with pytest.raises(RunFolderBusy):
            simulate(load(QUICKSTART), run_dir=run)
        assert cli.main(["simulate", "--config", str(QUICKSTART), "--out", str(run)]) == cli.EXIT_BUSY
        assert capsys.readouterr() == ("", _busy(run, holder))
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]
    grid = tmp_path / "grid"
    with hold_run_folder(grid, "a reproduction grid"):
        with pytest.raises(RunFolderBusy, match=r"\(a reproduction grid, pid "):
            run_grid([], grid)
        assert sorted(p.name for p in grid.iterdir()) == [LOCK_NAME]
    assert run_grid([], grid) == {}  # free again


@pytest.mark.parametrize("how", ["resume", "fresh"])
def test_a_symlinked_lock_file_is_refused_and_its_target_left_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture, how: str) -> None:
    """A ``run.lock`` that is a symbolic link is never followed: the file it points to is neither
    truncated nor written (nor made, when it is missing); the command says what is there (exit 2)."""
    run = tmp_path / "run"
    if how == "resume":
        run.mkdir()
        (run / "config.toml").write_text(QUICKSTART.read_text(encoding="utf-8"), encoding="utf-8")
        argv = ["simulate", "--resume", str(run)]
    else:
        run.mkdir()
        argv = ["simulate", "--config", str(QUICKSTART), "--out", str(run)]
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n", encoding="utf-8")
    (run / LOCK_NAME).symlink_to(victim)
    refusal = (f"fedfleet: configuration error: {run / LOCK_NAME}: the run folder's lock file is a symbolic link "
               f"(to {victim}), not a regular file; fedfleet neither follows nor writes it: remove it (or choose "
               "another run folder) and try again\n")
    assert cli.main(argv) == cli.EXIT_USAGE
    assert capsys.readouterr() == ("", refusal)
    assert victim.read_text(encoding="utf-8") == "precious\n"
    for call in (lambda: RunFolderLock(run, "fedfleet server").acquire(), lambda: check_not_held(run)):
        with pytest.raises(ConfigError, match="lock file is a symbolic link"):
            call()
    assert victim.read_text(encoding="utf-8") == "precious\n"
    victim.unlink()  # a dangling link: the open does not make its target
    with pytest.raises(ConfigError, match="lock file is a symbolic link"):
        RunFolderLock(run, "fedfleet server").acquire()
    assert not victim.exists() and (run / LOCK_NAME).is_symlink()


def test_a_fifo_lock_file_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO in place of ``run.lock`` is refused without waiting for a writer (an open that blocked
    would hang the command for ever); the process bound is only a guard against that hang."""
    os.mkfifo(tmp_path / LOCK_NAME)
    code = ("import sys\nfrom broker_server.errors import ConfigError\n"
            "from broker_server.run_lock import RunFolderLock, check_not_held\n"
            "for call in (lambda: check_not_held(sys.argv[1]), lambda: RunFolderLock(sys.argv[1], 'x').acquire()):\n"
            "    try:\n        call()\n    except ConfigError as exc:\n        print(exc)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    refusal = (f"{tmp_path / LOCK_NAME}: the run folder's lock file is a FIFO (named pipe), not a regular file; "
               "fedfleet neither follows nor writes it: remove it (or choose another run folder) and try again")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{refusal}\n{refusal}\n", "")


def test_a_held_folder_that_holds_a_run_is_refused_as_busy_not_as_a_run(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A fresh ``simulate --out F`` or ``server --out F`` into a folder another process holds is
    refused as busy (exit 5, naming the holder) even once the folder holds a run (its
    ``metrics.jsonl``): the lock is checked before the folder is read."""
    run = tmp_path / "run"
    code = ("import sys, time\nfrom pathlib import Path\nfrom broker_server.run_lock import hold_run_folder\n"
            "run = Path(sys.argv[1])\nwith hold_run_folder(run, 'fedfleet server'):\n"
            "    (run / 'metrics.jsonl').write_text('{}\\n')\n    print('held', flush=True)\n    sys.stdin.read()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    holder_proc = subprocess.Popen([sys.executable, "-c", code, str(run)], env=env, text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder_proc.stdout is not None and holder_proc.stdout.readline() == "held\n"
        holder = _holder(run)
        assert holder is not None and holder.pid == holder_proc.pid
        for command in ("simulate", "server"):
            assert cli.main([command, "--config", str(QUICKSTART), "--out", str(run)]) == cli.EXIT_BUSY
            assert capsys.readouterr() == ("", _busy(run, holder))
        with pytest.raises(RunFolderBusy):
            simulate(load(QUICKSTART), run_dir=run)
        with pytest.raises(RunFolderBusy):
            run_server(load(QUICKSTART), run_dir=run)
        assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", LOCK_NAME]
    finally:
        holder_proc.communicate("", timeout=60)
    assert holder_proc.returncode == 0
    assert cli.main(["simulate", "--config", str(QUICKSTART), "--out", str(run)]) == cli.EXIT_USAGE  # free now
    assert capsys.readouterr().err == (f"fedfleet: configuration error: {run} already holds a run (metrics.jsonl); "
                                       "choose another --out, or --resume it\n")
