"""Progress while a round runs (:mod:`broker_server.progress`): the state and its text from a
scripted event sequence (a fake clock), the plain lines for a stream that is not a terminal, the
live line on a (forced) terminal, the lines of devices back at a resumed server, and the events
the real server emits in a round on the in-process broker, with the bytes they carry checked
against the MQTT framing of the messages;
``fedfleet simulate``'s round line for a round the server evaluated, one it did not
(``[server] eval_every``: ``-`` and a note, not ``n/a``), and a personalised round without
client evaluation (``n/a``)."""

from __future__ import annotations

import io
from collections import deque
from pathlib import Path

import numpy as np
from helpers.memory_server import incoming, memory_server, update_payload

from broker_server.progress import LiveProgress, PlainProgress, RoundProgress, make_progress
from broker_server.simulate import progress_printer
from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol.mqtt_bytes import publish_size


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _script(p) -> None:
    """A round of three selected devices: two report, one withdraws; the server link grows from
    1,000/2,000 bytes to 1,000 + 3·1,024 up and 2,000 + 2,048 down."""
    p.on_event("waiting", 0, None, {"want": 3, "timeout_s": 60.0, "up": 0, "down": 0})
    for i, c in enumerate(("a", "b", "c"), start=1):
        p.on_event("joined", 0, c, {"profile": "rpi4", "samples": 500 * i, "online": i, "up": 1000, "down": 2000})
    p.on_event("round_open", 1, None, {"selected": ("a", "b", "c"), "deadline_s": 30.0, "rounds": 4,
                                       "up": 1000, "down": 2000 + 2048, "start_up": 1000, "start_down": 2000})
    p.on_event("model_received", 1, "a", {"up": 1000, "down": 4048})
    p.on_event("reported", 1, "a", {"samples": 500, "train_s": 1.25, "up": 1000 + 2048, "down": 4048})
    p.on_event("withdrew", 1, "c", {"reason": "no training samples", "up": 1000 + 3072, "down": 4048})


def test_round_state_text_from_events() -> None:
    clock = Clock()
    p = RoundProgress(4, clock=clock)
    assert p.line() == "0 agent(s) joined"
    p.on_event("waiting", 0, None, {"want": 3, "timeout_s": 60.0, "up": 0, "down": 0})
    clock.t = 107.4
    p.on_event("joined", 0, "a", {"online": 1, "up": 10, "down": 0})
    assert p.line() == "waiting for agents: 1/3 joined  elapsed 7 s / join timeout 60 s"
    p = RoundProgress(4, clock=clock)
    _script(p)
    clock.t = 119.6  # 12.2 s after the round opened at 107.4
    # this round: up 3,072 B = 3.0 KiB (1,000 → 4,072); down 2,048 B = 2.0 KiB, the global (2,000 → 4,048)
    assert p.line() == ("round 1/4  reported 1/3, 1 withdrew  server link this round: up 3.0 KiB, down 2.0 KiB  "
                        "elapsed 12 s / deadline 30 s")
    assert p.device_lines() == ["  a  reported (500 samples, trained 1.2 s)",
                                "  b  waiting for the global",
                                "  c  withdrew: no training samples"]
    assert p.counts() == {"selected": 3, "reported": 1, "withdrew": 1, "refused": 0}
    # an event of another round (a late copy) does not touch this one
    p.on_event("reported", 0, "b", {"up": 5000, "down": 4048})
    assert p.device_lines()[1] == "  b  waiting for the global"


def test_plain_lines_one_per_event_that_matters() -> None:
    out = io.StringIO()
    closed: list[dict] = []
    p = PlainProgress(4, stream=out, round_line=closed.append)
    _script(p)
    p.on_round({"round": 1})
    assert out.getvalue().splitlines() == [
        "waiting for 3 agent(s) to join (join timeout 60 s)",
        "round 1/4 started: 3 device(s) selected, deadline 30 s",
        "  round 1: c withdrew: no training samples  (1/3 reported, server link up 3.0 KiB this round)",
    ]
    assert closed == [{"round": 1}]

    out = io.StringIO()
    p = PlainProgress(4, stream=out, verbose=True)
    _script(p)
    lines = out.getvalue().splitlines()
    assert lines[1:4] == [f"joined: {c} (rpi4, {n:,} samples), {i} online"
                          for i, (c, n) in enumerate((("a", 500), ("b", 1000), ("c", 1500)), start=1)]
    assert lines[5:7] == ["  round 1: a has the round's global",
                          "  round 1: a reported (500 samples, trained 1.2 s)  (1/3 reported, server link up 2.0 KiB "
                          "this round)"]


def test_devices_back_at_a_resumed_server_are_lines_like_joins_and_count_online() -> None:
    """``back`` (a device of the checkpoint heard from again) prints as a join does, with
    ``show_joins`` (``fedfleet server``), on a terminal and off it, and sets the online count the
    wait for joins shows; without ``show_joins`` (a simulation) it prints nothing."""
    from rich.console import Console

    events = [("back", "pi-07", {"profile": "rpi4", "samples": 1234, "online": 1, "how": "its online status"}),
              ("joined", "pi-08", {"profile": "rpi5", "samples": 50, "online": 2})]
    clock = Clock()
    state = RoundProgress(4, clock=clock)
    state.on_event("waiting", 0, None, {"want": 3, "timeout_s": 60.0})
    state.on_event("back", 0, "pi-07", {**events[0][2], "up": 0, "down": 0})
    assert state.line() == "waiting for agents: 1/3 joined  elapsed 0 s / join timeout 60 s"
    want = ["back: pi-07 (rpi4, 1,234 samples), 1 online", "joined: pi-08 (rpi5, 50 samples), 2 online"]
    out = io.StringIO()
    plain = PlainProgress(4, stream=out, show_joins=True)
    quiet = io.StringIO()
    simulated = PlainProgress(4, stream=quiet)
    buf = io.StringIO()
    live = LiveProgress(4, show_joins=True, console=Console(file=buf, force_terminal=True, width=200,
                                                             color_system=None))
    for kind, client, info in events:
        for p in (plain, simulated, live):
            p.on_event(kind, 0, client, {**info, "up": 0, "down": 0})
    live.close()
    assert out.getvalue().splitlines() == want
    assert quiet.getvalue() == ""
    assert buf.getvalue().splitlines() == want


def test_make_progress_picks_plain_lines_off_a_terminal() -> None:
    assert type(make_progress(3, stream=io.StringIO())) is PlainProgress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert type(make_progress(3, stream=Tty())) is LiveProgress


def test_live_line_is_drawn_then_cleared_before_the_round_line() -> None:
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=200, color_system=None)
    p = LiveProgress(4, verbose=True, console=console, refresh_per_second=1,
                     round_line=lambda m: console.print(f"ROUND LINE {m['round']}"))
    _script(p)
    p.on_round({"round": 1})
    p.close()  # a second close is a no-op
    text = buf.getvalue()
    assert "round 1/4  reported 1/3, 1 withdrew" in text
    assert "  a  reported (500 samples, trained 1.2 s)" in text  # the per-device lines with verbose
    assert "  round 1: c withdrew: no training samples" in text  # printed above the live line
    assert text.rstrip().endswith("ROUND LINE 1")  # after the live line was cleared


def test_server_emits_the_round_events_with_its_link_bytes(tmp_path: Path) -> None:
    """A real AggregationServer round on the in-process broker: two selected clients, one
    update each. The events come in order, and each ``reported`` event's ``up`` grew by exactly
    that update's PUBLISH size (header + topic + payload, MQTT 3.1.1, QoS 1)."""
    torch_model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    like = list(state_arrays(torch_model))
    rng = np.random.default_rng(0)
    feed: deque = deque()
    srv = memory_server(tmp_path, model=torch_model, clients=["client-a", "client-b"], rounds=1,
                        feed=lambda: feed.popleft() if feed else None)
    events: list[tuple[str, int, str | None, dict]] = []
    srv.on_event = lambda *e: events.append(e)
    ups = [update_payload("mem", c, 1, 2, like, rng) for c in ("client-a", "client-b")]
    feed.extend(incoming(*u) for u in ups)
    up0 = srv.channel.wire_bytes_received
    m = srv.run_round(1)
    kinds = [(k, r, c) for k, r, c, _ in events]
    assert kinds == [("round_open", 1, None), ("reported", 1, "client-a"), ("reported", 1, "client-b")]
    opened, rep_a, rep_b = (info for _, _, _, info in events)
    assert opened["selected"] == ("client-a", "client-b") and opened["deadline_s"] == 600.0
    assert opened["up"] == up0 == opened["start_up"]
    size = [publish_size(topic, len(payload), 1).packet_bytes for topic, payload in ups]
    assert rep_a["up"] - opened["up"] == size[0]
    assert rep_b["up"] - rep_a["up"] == size[1]
    assert rep_a["samples"] == 100
    assert m["clients_reported"] == 2 and m["bytes_up"] == sum(size)
    # the global went out before round_open, b's receipt before b's event: the whole round's downlink
    assert rep_b["down"] - opened["start_down"] == m["bytes_down"] > opened["down"] - opened["start_down"] > 0


def test_a_failing_observer_is_switched_off_not_the_round(tmp_path: Path) -> None:
    torch_model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    like = list(state_arrays(torch_model))
    feed: deque = deque([incoming(*update_payload("mem", "client-a", 1, 2, like, np.random.default_rng(1)))])
    srv = memory_server(tmp_path, model=torch_model, clients=["client-a"], rounds=1,
                        feed=lambda: feed.popleft() if feed else None)

    def broken(*_: object) -> None:
        raise RuntimeError("display gone")

    srv.on_event = broken
    m = srv.run_round(1)
    assert m["clients_reported"] == 1 and srv.on_event is None


def test_log_records_print_above_the_live_line_and_go_back_to_stderr_after(monkeypatch) -> None:
    """With ``-v`` the root logger writes to stderr (``logging.basicConfig``); while the live line is
    shown its records go through the live console, each on its own line (not glued onto the live
    line), and the handler writes to stderr again once the line is cleared."""
    import logging
    import sys

    from rich.console import Console

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("LOG %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        buf = io.StringIO()
        console = Console(file=buf, force_terminal=True, width=200, color_system=None)
        p = LiveProgress(4, console=console, refresh_per_second=1)
        _script(p)  # starts the live line
        logging.getLogger("broker_server.server").warning("join: client-000")
        p.close()
        logging.getLogger("broker_server.server").warning("after the round")
    finally:
        root.removeHandler(handler)
    lines = buf.getvalue().splitlines()
    assert any(line.endswith("LOG join: client-000") and "round 1/4" not in line for line in lines), lines
    assert "join: client-000" not in err.getvalue()
    assert err.getvalue() == "LOG after the round\n"
    assert handler.stream is err


def test_the_round_line_tells_a_round_not_evaluated_from_a_figure_not_measured() -> None:
    base = {"clients_reported": 3, "clients_selected": 3, "bytes_up": 2048, "bytes_down": 1024, "seconds": 0.5,
            "skipped": False}
    lines = [
        {"round": 1, **base, "test_evaluated": False},  # eval_every = 2: no accuracy, loss or source
        {"round": 2, **base, "accuracy": 0.83287, "loss": 0.5, "accuracy_source": "global", "test_evaluated": True},
        {"round": 3, **base, "accuracy": None, "loss": None, "accuracy_source": "clients", "test_evaluated": False},
    ]
    buf = io.StringIO()
    show = progress_printer(3, stream=buf)
    for m in lines:
        show(m)
    out = [line.split("  (elapsed")[0] + " | " + line.split(" s)", 1)[1] for line in buf.getvalue().splitlines()]
    link = "clients 3/3  server link: up 2.0 KiB, down 1.0 KiB  0.5 s"
    assert out == [
        f"round   1/3  acc      -  loss      -  {link} |   (not evaluated this round: [server] eval_every)",
        f"round   2/3  acc 0.8329  loss 0.5000  {link} | ",
        f"round   3/3  acc    n/a (clients' own models)  loss    n/a  {link} | ",
    ]
