"""protocol.link_log: the records :class:`LinkLog` makes of a transport's link events, lost
(``WARNING``: the MQTT client's reason, whether the broker sent DISCONNECT, the messages awaiting
acknowledgement, the node's own words) and back (``INFO``: the connection's number, the seconds
down on the given clock).

Each expected message is written out by hand from the event; the clock is scripted."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from protocol.link_log import LinkLog
from protocol.memory_transport import MemoryBroker
from protocol.transport_base import LinkLost

LOG = "fedfleet.test.link_log"


def _clock(*values: float) -> Callable[[], float]:
    """A clock that reads ``values`` in turn (an extra read fails the test)."""
    it = iter(values)
    return lambda: next(it)


def _records(caplog: pytest.LogCaptureFixture, name: str = LOG) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == name]


def test_a_loss_and_its_reconnect_are_one_warning_and_one_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOG)
    link = LinkLog(logging.getLogger(LOG), prefix="pi-07: ", clock=_clock(100.0, 112.5),
                   pending=lambda: "its update of round 3 awaits its receipt")
    link.on_lost(LinkLost(1, "Unspecified error", False, 2, 1234))
    assert link.lost_at == 100.0
    link.on_connect(2)
    assert _records(caplog) == [
        (logging.WARNING, "pi-07: link to the broker lost (connection 1: Unspecified error); 2 message(s) (1,234 "
                          "bytes) not yet acknowledged, sent again once it is back; its update of round 3 awaits its "
                          "receipt; reconnecting"),
        (logging.INFO, "pi-07: link to the broker back (connection 2), 12.5 s after it was lost")]
    assert (link.losses, link.down_s, link.lost_at) == (1, 12.5, None)


def test_the_broker_disconnect_no_reason_and_nothing_pending_are_said_as_such(caplog) -> None:
    """The broker's MQTT 5 DISCONNECT is named; without a reason only the connection is; nothing
    awaiting acknowledgement is said; words ``pending`` cannot give (it raised) are left out; the
    down times add up over the losses."""
    caplog.set_level(logging.INFO, logger=LOG)

    def broken() -> str:
        raise RuntimeError("no words")

    link = LinkLog(logging.getLogger(LOG), clock=_clock(10.0, 11.0, 20.0, 23.5), pending=broken)
    link.on_lost(LinkLost(3, "Server shutting down", True))
    link.on_connect(4)
    link.on_lost(LinkLost(4))
    link.on_connect(5)
    assert _records(caplog) == [
        (logging.WARNING, "link to the broker lost (connection 3: DISCONNECT from the broker: Server shutting down); "
                          "no message awaiting acknowledgement; reconnecting"),
        (logging.INFO, "link to the broker back (connection 4), 1.0 s after it was lost"),
        (logging.WARNING, "link to the broker lost (connection 4); no message awaiting acknowledgement; "
                          "reconnecting"),
        (logging.INFO, "link to the broker back (connection 5), 3.5 s after it was lost")]
    assert (link.losses, link.down_s) == (2, 4.5)


def test_the_first_connection_says_nothing_and_an_untold_loss_is_back_without_a_time(caplog) -> None:
    caplog.set_level(logging.INFO, logger=LOG)
    link = LinkLog(logging.getLogger(LOG), prefix="dev: ", clock=_clock())
    link.on_connect(1)
    link.on_connect(2)
    assert _records(caplog) == [(logging.INFO, "dev: link to the broker back (connection 2)")]


def test_records_below_the_loggers_level_are_not_made(caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOG)
    link = LinkLog(logging.getLogger(LOG), clock=_clock(1.0, 2.0))
    link.on_lost(LinkLost(1, "Keep alive timeout"))
    link.on_connect(2)
    assert _records(caplog) == [(logging.WARNING, "link to the broker lost (connection 1: Keep alive timeout); no "
                                                  "message awaiting acknowledgement; reconnecting")]


def test_attach_listens_to_the_memory_transports_drop_link(caplog) -> None:
    caplog.set_level(logging.INFO, logger=LOG)
    tr = MemoryBroker().connect("dev")
    link = LinkLog(logging.getLogger(LOG), prefix="dev: ", clock=_clock(5.0, 5.5))
    assert link.attach(tr)
    tr.drop_link()
    assert _records(caplog) == [
        (logging.WARNING, "dev: link to the broker lost (connection 1: link dropped (MemoryTransport.drop_link)); no "
                          "message awaiting acknowledgement; reconnecting"),
        (logging.INFO, "dev: link to the broker back (connection 2), 0.5 s after it was lost")]
    assert link.down_s == 0.5
    assert not LinkLog(logging.getLogger(LOG)).attach(object())  # no link events: nothing to listen to
