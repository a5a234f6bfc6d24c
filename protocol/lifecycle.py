"""How a fedfleet process stops: SIGTERM and SIGINT end it in order, with every ledger committed.

``fedfleet-agent``, ``fedfleet server`` and ``fedfleet simulate`` call :func:`install_signal_handlers`
once at start. On the first SIGTERM or SIGINT the handler

1. commits every open :class:`~protocol.ledger.Ledger` of the process and stores the signal's name
   in its ``meta`` table (``stop_signal``), so the rows are on disk even if what follows hangs;
2. unwinds the main thread: ``SystemExit(128 + signum)`` for SIGTERM (exit status 143, as a shell
   reports a process that SIGTERM ended), ``KeyboardInterrupt`` for SIGINT (Python's default), so
   the program's ``finally`` blocks close the channels (DISCONNECT, the messages that had arrived
   are ledgered) and the ledger (``closed_cleanly='1'``).

A signal that arrives while the main thread is inside a function marked :func:`atomic` (a
message being published and ledgered, or decoded and ledgered) is held until that function
returns, so that no message the process handed to the broker misses its ledger row (also a
DSAC-T update, so a stopped pre-training saves whole networks); the warning then says a second
signal would not wait. A second signal while the first is being handled commits the ledgers
again, removes the temporary files of whole-file writes under way
(:func:`protocol.files.remove_partial_files`) and ends the process at once (``os._exit``) — the
way out of a shutdown that hangs.

Only the main thread can install handlers (a Python rule); elsewhere :func:`install_signal_handlers`
does nothing and returns ``False``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from .files import remove_partial_files
from .ledger import flush_open_ledgers

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

#: The signals :func:`install_signal_handlers` handles by default.
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)

_MAIN = threading.main_thread().ident
_state = threading.local()  # depth of atomic() calls on this thread
_held: list[int] = []  # a signal that arrived inside atomic(), raised when the outermost call returns
_received: list[int] = []  # every stop signal handled so far


def _depth() -> int:
    return getattr(_state, "depth", 0)


def _unwind(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def _handler(signum: int, frame: object) -> None:
    name = signal.Signals(signum).name
    _received.append(signum)
    ledgers = flush_open_ledgers(stop_signal=name)
    committed = f"{ledgers} ledger{'s' if ledgers != 1 else ''} committed" if ledgers else "no ledger open"
    if len(_received) > 1:  # the orderly stop did not finish: leave now
        remove_partial_files()
        log.warning("second %s: exiting at once (%s)", name, committed)
        os._exit(128 + signum)
    if _depth() > 0:
        log.warning("%s received: stopping once the step under way ends (%s); a second %s exits at once, "
                    "without what that step would keep", name, committed, name)
        _held.append(signum)
        return
    log.warning("%s received: stopping (%s)", name, committed)
    _unwind(signum)


def install_signal_handlers(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> bool:
    """Handle ``signals`` as the module docstring says (idempotent).

    Args:
        signals: the signals to handle (SIGTERM and SIGINT).

    Returns:
        ``True`` when the handlers are installed, ``False`` when called from a thread other than
        the main thread (a Python rule: nothing is changed then).
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in signals:
        signal.signal(sig, _handler)
    return True


def stop_signals_received() -> tuple[str, ...]:
    """Names of the stop signals this process has handled, in order (``("SIGTERM",)``)."""
    return tuple(signal.Signals(s).name for s in _received)


def atomic(fn: F) -> F:
    """Decorator: a stop signal arriving while ``fn`` runs on the main thread takes effect when
    ``fn`` returns (or raises), never half-way through it. Costs one attribute read and write per
    call; calls on other threads are never interrupted anyway (signals run on the main thread)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _state.depth = _depth() + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _state.depth -= 1
            if _state.depth == 0 and _held and threading.get_ident() == _MAIN:
                _unwind(_held.pop())

    return wrapper  # type: ignore[return-value]


class PipeSafeStream:
    """A text stream (stdout) that survives its reader going away: the first write or flush that
    fails with a broken pipe (``fedfleet simulate … | head -1``, a ``tee`` that was killed) says
    so once on ``notice`` (stderr), points the stream's file descriptor at ``/dev/null`` (so that
    neither later writes nor the interpreter's flush at exit raise) and drops what follows. The
    process goes on: a run keeps training and writing its run folder, which a broken display
    must not cost.

    Everything else (``isatty``, ``fileno``, ``encoding`` …) is the wrapped stream's.

    Args:
        stream: the stream wrapped (``sys.stdout``).
        notice: where the one-line notice goes (``sys.stderr``); its own failure is ignored.
        what: the program's name, for the notice.
    """

    def __init__(self, stream: Any, notice: Any, what: str = "fedfleet") -> None:
        self._stream, self._notice, self._what = stream, notice, what
        self.broken = False

    def _broke(self) -> None:
        self.broken = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)
        except (OSError, ValueError, AttributeError):  # no file descriptor (a StringIO): writes are dropped anyway
            pass
        try:
            self._notice.write(f"{self._what}: standard output was closed (broken pipe): no more output there; "
                               "the run goes on (its folder has every result)\n")
            self._notice.flush()
        except (OSError, ValueError):
            pass

    def write(self, text: str) -> int:
        """Write ``text``; after a broken pipe, drop it (returns its length either way)."""
        if not self.broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._broke()
        return len(text)

    def flush(self) -> None:
        """Flush; a broken pipe switches the stream off (see the class docstring)."""
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._broke()

    def isatty(self) -> bool:
        """False once broken, else the wrapped stream's."""
        return not self.broken and bool(self._stream.isatty())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def guard_stdout(what: str = "fedfleet") -> Iterator[PipeSafeStream]:
    """``sys.stdout`` wrapped in a :class:`PipeSafeStream` for the ``with`` block (the stream it
    was is put back after it; an already wrapped one is kept)."""
    import sys

    before = sys.stdout
    guarded = before if isinstance(before, PipeSafeStream) else PipeSafeStream(before, sys.stderr, what)
    sys.stdout = guarded
    try:
        yield guarded
    finally:
        if sys.stdout is guarded:
            sys.stdout = before
