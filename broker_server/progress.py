"""Progress while a round runs, for ``fedfleet simulate`` and ``fedfleet server``.

The server tells an observer what happens through one narrow callback,
:attr:`AggregationServer.on_event <broker_server.server.AggregationServer.on_event>`, called on
its round-loop thread as ``on_event(kind, round, client, info)``:

========================  =======================================================================
kind                      when (``info`` keys besides ``up``/``down``, the server link's wire
                          bytes received/sent so far, from the channel's ledger accounting)
========================  =======================================================================
``waiting``               before round 1, waiting for joins (``want``, ``timeout_s``)
``joined``                a join was admitted (``profile``, ``samples``, ``online``)
``back``                  a resumed server first heard again from a device its checkpoint knew,
                          by something else than a join (its ``online`` status, retained or
                          live, or a message of the run): ``profile``, ``samples``, ``online``,
                          ``how``; a device that joins again is ``joined``
``round_open``            the round's ``global`` and ``round_start`` went out (``selected``,
                          ``deadline_s``, ``rounds``, ``start_up``/``start_down``: the link's
                          bytes when the round began, before its ``global``)
``model_received``        a selected device confirmed the round's ``global`` (its receipt)
``reported``              an update was accepted (``samples``, ``train_s``)
``withdrew``              a selected device said it has nothing to send (``reason``)
``refused``               an update was refused (``reason``)
``late``                  an update arrived after the round's deadline
========================  =======================================================================

Everything shown comes from messages the protocol sends anyway (joins, global receipts,
updates, idle status): the display costs **no extra wire message**. A device's progress inside
its local training (epoch, batch) would need one, and is not sent.

Two displays share one state (:class:`RoundProgress`):

- :class:`LiveProgress` on a terminal: one live line (rich), redrawn twice a second, with
  devices reported / selected, the server link's bytes in this round, elapsed seconds and the
  deadline; with ``verbose`` a line per selected device under it. Events that matter
  (withdrawals, refusals, late updates; joins of a real fleet) are printed above it.
- :class:`PlainProgress` when stdout is not a terminal (a log file, CI): one line per event that
  matters, never a redraw: the round's start, withdrawals, refusals and late updates (and joins,
  and the devices back at a resumed server, when ``show_joins``); with ``verbose`` also each
  device's model receipt and report.

Each round ends with the caller's round line (``round_line``, e.g.
:func:`broker_server.simulate.progress_printer`), printed after the live line is cleared.
"""

from __future__ import annotations

import io
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

__all__ = ["LiveProgress", "PlainProgress", "RoundProgress", "make_progress"]

#: Event kinds the server emits (see the module docstring).
EVENTS = ("waiting", "joined", "back", "round_open", "model_received", "reported", "withdrew", "refused", "late")


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB"


def _member_line(kind: str, client: str | None, info: dict[str, Any]) -> str:
    """The line of a ``joined`` or ``back`` event: ``joined: pi-07 (rpi4, 1,234 samples), 3 online``."""
    return (f"{kind}: {client} ({info.get('profile')}, {int(info.get('samples', 0)):,} samples), "
            f"{info.get('online')} online")


@dataclass
class _Round:
    number: int
    selected: tuple[str, ...]
    deadline_s: float
    started: float
    up0: int
    down0: int
    state: dict[str, str] = field(default_factory=dict)  # client → what the server last heard of it


class RoundProgress:
    """What the server has said so far about the open round (or the wait for joins), as text.

    Args:
        rounds: the run's last round number (for ``round r/T``).
        clock: seconds, monotonic (a test passes its own).

    :meth:`on_event` takes the server's events (any thread; guarded by a lock); :meth:`line`
    and :meth:`device_lines` render the current state.
    """

    def __init__(self, rounds: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rounds = rounds
        self.clock = clock
        self._lock = threading.Lock()
        self._round: _Round | None = None
        self._waiting: tuple[float, int, float] | None = None  # (since, want, timeout_s)
        self._online = 0
        self._up = 0
        self._down = 0

    def on_event(self, kind: str, rnd: int, client: str | None, info: dict[str, Any]) -> None:
        """Record one server event (see the module docstring). Unknown kinds are ignored."""
        with self._lock:
            self._up, self._down = int(info.get("up", self._up)), int(info.get("down", self._down))
            if kind == "waiting":
                self._waiting = (self.clock(), int(info.get("want", 0)), float(info.get("timeout_s", 0.0)))
            elif kind in ("joined", "back"):
                self._online = int(info.get("online", self._online + 1))
            elif kind == "round_open":
                self._waiting = None
                selected = tuple(info.get("selected", ()))
                self._round = _Round(rnd, selected, float(info.get("deadline_s", 0.0)), self.clock(),
                                     int(info.get("start_up", self._up)), int(info.get("start_down", self._down)),
                                     {c: "waiting for the global" for c in selected})
            elif self._round is not None and client is not None and rnd == self._round.number:
                text = {"model_received": "has the global, training",
                        "reported": "reported" + _report_detail(info),
                        "withdrew": f"withdrew: {info.get('reason', '')}",
                        "refused": f"refused: {info.get('reason', '')}",
                        "late": "late (after the deadline)"}.get(kind)
                if text is not None and (kind != "model_received"
                                         or self._round.state.get(client, "").startswith("waiting")):
                    self._round.state[client] = text

    def open_round(self) -> int:
        """The number of the round last opened (``round_open``), 0 before any."""
        with self._lock:
            return self._round.number if self._round is not None else 0

    def counts(self) -> dict[str, int]:
        """``selected``, ``reported``, ``withdrew``, ``refused`` of the open round (zeros when none)."""
        with self._lock:
            r = self._round
            states = list(r.state.values()) if r is not None else []
            return {"selected": len(r.selected) if r is not None else 0,
                    "reported": sum(s.startswith("reported") for s in states),
                    "withdrew": sum(s.startswith("withdrew") for s in states),
                    "refused": sum(s.startswith("refused") for s in states)}

    def round_bytes(self) -> tuple[int, int]:
        """Server-link wire bytes ``(up, down)`` since the open round started (``(0, 0)`` when none)."""
        with self._lock:
            r = self._round
            return (self._up - r.up0, self._down - r.down0) if r is not None else (0, 0)

    def line(self) -> str:
        """The live line: ``round r/T  reported k/n  server link: up … down … (this round)  elapsed
        e s / deadline d s``; before round 1, the wait for joins."""
        c = self.counts()
        with self._lock:
            r, waiting, now = self._round, self._waiting, self.clock()
            if r is None:
                if waiting is None:
                    return f"{self._online} agent(s) joined"
                since, want, timeout_s = waiting
                return (f"waiting for agents: {self._online}/{want} joined  elapsed {now - since:.0f} s / "
                        f"join timeout {timeout_s:g} s")
            up, down = self._up - r.up0, self._down - r.down0
            extra = "".join(f", {c[k]} {k}" for k in ("withdrew", "refused") if c[k])
            return (f"round {r.number}/{self.rounds}  reported {c['reported']}/{c['selected']}{extra}  "
                    f"server link this round: up {_kib(up)}, down {_kib(down)}  "
                    f"elapsed {now - r.started:.0f} s / deadline {r.deadline_s:g} s")

    def device_lines(self) -> list[str]:
        """One line per selected device of the open round: what the server last heard of it."""
        with self._lock:
            r = self._round
            if r is None:
                return []
            width = max((len(c) for c in r.selected), default=0)
            return [f"  {c:<{width}}  {r.state.get(c, '')}" for c in r.selected]


def _report_detail(info: dict[str, Any]) -> str:
    parts = []
    if info.get("samples") is not None:
        parts.append(f"{int(info['samples']):,} samples")
    if isinstance(info.get("train_s"), (int, float)):
        parts.append(f"trained {float(info['train_s']):.1f} s")
    return f" ({', '.join(parts)})" if parts else ""


class PlainProgress:
    """One line per event that matters, for a stream that is not a terminal.

    Args:
        rounds: the run's last round.
        stream: where the lines go.
        verbose: also each device's model receipt and accepted update.
        show_joins: a line per admitted join, and per device back at a resumed server (a real
            fleet: who is there).
        round_line: prints the round's closing line (called by :meth:`on_round`).
    """

    def __init__(self, rounds: int, *, stream: TextIO | None = None, verbose: bool = False, show_joins: bool = False,
                 round_line: Callable[[dict], None] | None = None) -> None:
        self.state = RoundProgress(rounds)
        self.stream = stream if stream is not None else sys.stdout  # as it is now, not at import
        self.verbose = verbose
        self.show_joins = show_joins
        self.round_line = round_line

    def _say(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def on_event(self, kind: str, rnd: int, client: str | None, info: dict[str, Any]) -> None:
        """Record the event and print its line when it matters (see the class docstring)."""
        self.state.on_event(kind, rnd, client, info)
        c = self.state.counts()
        up = _kib(self.state.round_bytes()[0])
        progress = f"{c['reported']}/{c['selected']} reported, server link up {up} this round"
        if kind == "waiting":
            self._say(f"waiting for {info.get('want')} agent(s) to join (join timeout {info.get('timeout_s', 0):g} s)")
        elif kind in ("joined", "back") and (self.show_joins or self.verbose):
            self._say(_member_line(kind, client, info))
        elif kind == "round_open":
            self._say(f"round {rnd}/{self.state.rounds} started: {len(info.get('selected', ()))} device(s) selected, "
                      f"deadline {float(info.get('deadline_s', 0)):g} s")
        elif kind in ("withdrew", "refused"):
            self._say(f"  round {rnd}: {client} {kind}: {info.get('reason', '')}  ({progress})")
        elif kind == "late":
            self._say(f"  round {rnd}: {client}'s update arrived after the deadline")
        elif kind == "reported" and self.verbose:
            self._say(f"  round {rnd}: {client} reported{_report_detail(info)}  ({progress})")
        elif kind == "model_received" and self.verbose:
            self._say(f"  round {rnd}: {client} has the round's global")

    def on_round(self, metrics: dict) -> None:
        """The round closed: its line."""
        if self.round_line is not None:
            self.round_line(metrics)

    def close(self) -> None:
        """Nothing to clean up (for symmetry with :class:`LiveProgress`)."""

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _AboveLive(io.TextIOBase):
    """A text stream that prints each complete line above a rich live display (through its
    console), so log records do not run into the live line."""

    def __init__(self, console: Any) -> None:
        super().__init__()
        self.console = console
        self._buf = ""

    def write(self, s: str) -> int:
        self._buf += s
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
        return len(s)

    def flush(self) -> None:
        pass


def _console_log_handlers() -> list[logging.StreamHandler]:
    """The root logger's handlers that write to the process's stderr (``logging.basicConfig``'s)."""
    return [h for h in logging.getLogger().handlers
            if type(h) is logging.StreamHandler and h.stream in (sys.stderr, sys.__stderr__)]


class LiveProgress(PlainProgress):
    """The live line (rich) on a terminal, plus a line per device with ``verbose``.

    Args:
        console: a ``rich.console.Console`` (default: one on ``stream``).
        refresh_per_second: redraws per second (the elapsed time moves on between events).
        Other arguments as :class:`PlainProgress`.

    Lines that matter (withdrawals, refusals, late updates, joins and devices back with
    ``show_joins``) are printed above the live line; the round's line is printed once the live
    line is cleared.
    """

    def __init__(self, rounds: int, *, stream: TextIO | None = None, verbose: bool = False, show_joins: bool = False,
                 round_line: Callable[[dict], None] | None = None, console: Any = None,
                 refresh_per_second: float = 2.0) -> None:
        super().__init__(rounds, stream=stream, verbose=verbose, show_joins=show_joins, round_line=round_line)
        from rich.console import Console

        self.console = console or Console(file=self.stream)
        self.refresh_per_second = refresh_per_second
        self._live: Any = None
        self._log_streams: list[tuple[logging.StreamHandler, Any]] = []

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.text import Text

        lines = [Text(self.state.line(), style="bold")]
        if self.verbose:
            lines += [Text(d) for d in self.state.device_lines()]
        return Group(*lines)

    def _start(self) -> None:
        if self._live is None:
            from rich.live import Live

            self._live = Live(self, console=self.console, refresh_per_second=self.refresh_per_second,
                              transient=True, redirect_stdout=False, redirect_stderr=False)
            self._live.start()
            # log records (-v) go above the live line while it is shown, not into it
            above = _AboveLive(self.console)
            self._log_streams = [(h, h.setStream(above)) for h in _console_log_handlers()]

    def _say(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def on_event(self, kind: str, rnd: int, client: str | None, info: dict[str, Any]) -> None:
        """Record the event, print it above the live line when it matters, redraw."""
        self.state.on_event(kind, rnd, client, info)
        if kind in ("joined", "back") and self.show_joins:
            self._say(_member_line(kind, client, info))
        elif kind in ("withdrew", "refused"):
            self._say(f"  round {rnd}: {client} {kind}: {info.get('reason', '')}")
        elif kind == "late":
            self._say(f"  round {rnd}: {client}'s update arrived after the deadline")
        if kind in ("waiting", "round_open"):
            self._start()
        if self._live is not None:
            self._live.refresh()

    def on_round(self, metrics: dict) -> None:
        """Clear the live line, then print the round's line; the live line comes back when a later
        round is open already (a round evaluated while the next one trains)."""
        self.close()
        if self.round_line is not None:
            self.round_line(metrics)
        if self.state.open_round() > int(metrics.get("round", 0)):
            self._start()

    def close(self) -> None:
        """Stop the live display (the line is cleared); safe to call twice."""
        if self._live is not None:
            live, self._live = self._live, None
            for handler, stream in self._log_streams:
                handler.setStream(stream)
            self._log_streams = []
            live.stop()


def make_progress(rounds: int, *, verbose: bool = False, show_joins: bool = False, stream: TextIO | None = None,
                  round_line: Callable[[dict], None] | None = None) -> PlainProgress:
    """:class:`LiveProgress` when ``stream`` (default stdout) is a terminal, else :class:`PlainProgress`."""
    stream = stream if stream is not None else sys.stdout
    tty = bool(getattr(stream, "isatty", lambda: False)())
    cls = LiveProgress if tty else PlainProgress
    return cls(rounds, stream=stream, verbose=verbose, show_joins=show_joins, round_line=round_line)
