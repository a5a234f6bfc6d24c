"""The ledger commits on its own (timer, round ends), records how its writer ended, and the signal
handlers of protocol.lifecycle commit it and stop the process in order."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from protocol import lifecycle
from protocol.errors import LedgerError
from protocol.ledger import Ledger, LedgerRow, flush_open_ledgers, ledger_closed_cleanly, open_ledgers, read_meta

ROOT = Path(__file__).resolve().parents[2]


def _row(kind: str = "status", event: str = "sent", seq: int = 0) -> LedgerRow:
    return LedgerRow(federation="f", side="agent", node="c0", event=event, direction="up", kind=kind, round=0,
                     client="c0", sender="c0", seq=seq, topic="fedfleet/v1/f/status/c0", topic_bytes=23,
                     mqtt_header_bytes=4, envelope_bytes=10, body_bytes=5, payload_bytes=15, qos=1)


def _committed(path: Path) -> int:
    """Rows another connection sees: only committed rows are visible outside the writer."""
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
    finally:
        db.close()


def _wait_for(cond, bound_s: float = 20.0) -> bool:
    """Poll ``cond`` until it holds or ``bound_s`` passed (a bound, not a timing assertion)."""
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_rows_are_committed_without_flush_or_close(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path, commit_interval_s=0.05)  # batch 256: the old ledger kept these 3 rows uncommitted
    try:
        for i in range(3):
            led.record(_row(seq=i))
        assert _wait_for(lambda: _committed(path) == 3)
    finally:
        led.close()


def test_round_end_rows_are_committed_at_once(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path, commit_interval_s=3600.0)  # the timer cannot be what commits here
    try:
        led.record(_row("status"))
        assert _committed(path) == 0
        led.record(_row("update", "sent"))  # the agent's end of its round commits both rows
        assert _committed(path) == 2
        led.record(_row("round_start", "received", seq=1))
        assert _committed(path) == 3
        led.record(_row("update", "received", seq=2))  # the server's side: its round end calls flush()
        assert _committed(path) == 3
        led.flush()
        assert _committed(path) == 4
    finally:
        led.close()


def test_clean_close_is_recorded_and_reset_by_the_next_writer(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path)
    assert ledger_closed_cleanly(path) is False  # a writer has it open
    assert read_meta(path)["writer_pid"] == str(os.getpid())
    led.close()
    led.close()  # idempotent
    assert ledger_closed_cleanly(path) is True
    assert float(read_meta(path)["closed_at"]) > 0
    led = Ledger(path)  # reopened (a resumed run): open again until closed again
    assert ledger_closed_cleanly(path) is False
    assert "closed_at" not in read_meta(path)
    led.close()
    db = sqlite3.connect(path)  # a ledger from before closes were recorded
    db.execute("DELETE FROM meta WHERE key = 'closed_cleanly'")
    db.commit()
    db.close()
    assert ledger_closed_cleanly(path) is None
    with pytest.raises(LedgerError, match="no ledger"):
        ledger_closed_cleanly(tmp_path / "missing.sqlite")


def test_writing_to_a_closed_ledger_says_so(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "ledger.sqlite")
    led.close()
    with pytest.raises(LedgerError, match="is closed"):
        led.record(_row())
    with pytest.raises(LedgerError, match="closed"):
        led.set_meta("k", "v")
    led.flush()  # a no-op, not an error: close paths may flush twice


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="commit_interval_s"):
        Ledger(tmp_path / "a.sqlite", commit_interval_s=0)
    with pytest.raises(ValueError, match="batch"):
        Ledger(tmp_path / "b.sqlite", batch=0)


def test_flush_open_ledgers_commits_and_names_the_signal(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path, commit_interval_s=3600.0)
    try:
        assert led in open_ledgers()
        led.record(_row())
        assert _committed(path) == 0
        assert flush_open_ledgers(stop_signal="SIGTERM") >= 1
        assert _committed(path) == 1
        assert read_meta(path)["stop_signal"] == "SIGTERM"
    finally:
        led.close()
    assert led not in open_ledgers()


def test_a_signal_inside_atomic_waits_for_it_to_return(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle, "_received", [])
    monkeypatch.setattr(lifecycle, "_held", [])
    old = signal.getsignal(signal.SIGTERM)
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path, commit_interval_s=3600.0)
    done = []

    @lifecycle.atomic
    def publish_and_record() -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (the main) thread at once
        done.append("published")
        led.record(_row())
        done.append("recorded")

    try:
        assert lifecycle.install_signal_handlers((signal.SIGTERM,))
        with pytest.raises(SystemExit) as info:
            publish_and_record()
        assert info.value.code == 128 + signal.SIGTERM
        assert done == ["published", "recorded"]
        assert lifecycle.stop_signals_received() == ("SIGTERM",)
        assert read_meta(path)["stop_signal"] == "SIGTERM"
    finally:
        signal.signal(signal.SIGTERM, old)
        led.close()
    assert _committed(path) == 1


def test_install_outside_the_main_thread_changes_nothing() -> None:
    import threading

    result = []
    t = threading.Thread(target=lambda: result.append(lifecycle.install_signal_handlers()))
    t.start()
    t.join()
    assert result == [False]


_CHILD = textwrap.dedent("""
    import sys, time
    from protocol.lifecycle import install_signal_handlers
    from protocol.ledger import Ledger, LedgerRow
    install_signal_handlers()
    led = Ledger(sys.argv[1], commit_interval_s=3600.0)
    row = LedgerRow(federation="f", side="agent", node="c0", event="sent", direction="up", kind="status",
                    round=0, client="c0", sender="c0", seq=0, topic="t", topic_bytes=1, mqtt_header_bytes=4,
                    envelope_bytes=10, body_bytes=5, payload_bytes=15, qos=1)
    try:
        for _ in range(int(sys.argv[2])):
            led.record(row)
        print("ready", flush=True)
        while True:
            time.sleep(0.05)
    finally:
        if sys.argv[3] == "close":
            led.close()
        else:  # a shutdown that hangs: only a second signal gets the process out
            while True:
                time.sleep(0.05)
""")


@pytest.mark.parametrize("ending", ["close", "hang"])
def test_sigterm_commits_and_closes_a_real_process(tmp_path: Path, ending: str) -> None:
    path = tmp_path / "ledger.sqlite"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), "7", ending], stdout=subprocess.PIPE,
                            env=env, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert _committed(path) == 0  # the interval is an hour and nothing ends a round
        proc.send_signal(signal.SIGTERM)
        if ending == "hang":
            assert _wait_for(lambda: read_meta(path).get("stop_signal") == "SIGTERM")
            assert _committed(path) == 7  # committed by the first signal, before the hang
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert _committed(path) == 7
    assert read_meta(path)["stop_signal"] == "SIGTERM"
    assert ledger_closed_cleanly(path) is (ending == "close")


def test_interpreter_exit_commits_a_ledger_left_open(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    code = textwrap.dedent("""
        import sys
        from protocol.ledger import Ledger, LedgerRow
        led = Ledger(sys.argv[1], commit_interval_s=3600.0)
        for i in range(5):
            led.record(LedgerRow(federation="f", side="agent", node="c0", event="sent", direction="up",
                                 kind="status", round=0, client="c0", sender="c0", seq=i, topic="t", topic_bytes=1,
                                 mqtt_header_bytes=4, envelope_bytes=10, body_bytes=5, payload_bytes=15, qos=1))
        sys.exit(3)  # never closed: the atexit hook commits, but it was not a clean close
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    assert subprocess.run([sys.executable, "-c", code, str(path)], env=env, timeout=120).returncode == 3
    assert _committed(path) == 5
    assert ledger_closed_cleanly(path) is False


def test_a_ledger_two_writers_share_reads_clean_only_once_both_closed(tmp_path: Path) -> None:
    """The first of two writers to close does not mark the file clean while the other still
    writes (it may yet be killed, losing its last rows)."""
    path = tmp_path / "ledger.sqlite"
    first, second = Ledger(path), Ledger(path)
    first.close()
    assert ledger_closed_cleanly(path) is False  # the second writer has it open
    second.close()
    assert ledger_closed_cleanly(path) is True


def test_a_second_writer_killed_after_the_first_closed_leaves_the_ledger_unclean(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    first = Ledger(path)
    code = f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from protocol.ledger import Ledger
        led = Ledger({str(path)!r})
        print("open", flush=True)
        sys.stdin.readline()
        os.kill(os.getpid(), signal.SIGKILL)
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
        first.close()  # while the other process still has it open
        proc.stdin.write("\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        assert proc.wait(timeout=120) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    assert ledger_closed_cleanly(path) is False
    again = Ledger(path)  # a later session: the killed writer no longer counts once it is gone
    again.close()
    assert ledger_closed_cleanly(path) is True
