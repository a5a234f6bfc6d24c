"""Standard output whose reader goes away (``fedfleet simulate | head -1``): the program's
output stops there, with one notice on stderr, and the program goes on."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from protocol.lifecycle import PipeSafeStream, guard_stdout

ROOT = Path(__file__).resolve().parents[2]


def test_a_write_to_a_closed_pipe_is_dropped_once_noticed_and_the_descriptor_silenced() -> None:
    r, w = os.pipe()
    os.close(r)  # the reader is gone: a write raises BrokenPipeError (Python ignores SIGPIPE)
    raw = os.fdopen(w, "w", buffering=1)
    notice = io.StringIO()
    out = PipeSafeStream(raw, notice, "fedfleet")
    assert out.write("round 1\n") == len("round 1\n")  # no exception
    out.write("round 2\n")
    out.flush()
    assert out.broken and not out.isatty()
    assert notice.getvalue().count("broken pipe") == 1  # said once
    assert notice.getvalue().startswith("fedfleet: standard output was closed")
    # the descriptor now points at /dev/null: the interpreter's own flush at exit cannot fail
    assert os.path.samestat(os.fstat(w), os.stat(os.devnull))
    raw.write("more\n")
    raw.flush()
    raw.close()


def test_guard_puts_the_stream_back_and_passes_writes_through() -> None:
    before = sys.stdout
    with guard_stdout("x") as g:
        assert sys.stdout is g and isinstance(g, PipeSafeStream)
        with guard_stdout("x") as again:  # nested: the same wrapper
            assert again is g
    assert sys.stdout is before


def test_the_cli_exits_0_when_its_reader_has_gone() -> None:
    """``fedfleet profiles`` writing into a pipe whose reader closed at once: exit 0 and the
    notice, not a BrokenPipeError traceback (before: exit 1 with a traceback; a simulation died
    in its start-up print and left a half-made run folder)."""
    r, w = os.pipe()
    os.close(r)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        p = subprocess.run([sys.executable, "-m", "broker_server.cli", "profiles"], stdout=w,
                           stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, timeout=60)
    finally:
        os.close(w)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and "broken pipe" in p.stderr
