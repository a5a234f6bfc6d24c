"""What the aggregation server says in its log when its link to the broker breaks and comes back,
on the in-process broker (``MemoryTransport.drop_link`` of its connection): a ``WARNING`` when it
is lost, an ``INFO`` when it is back (connection 2, the seconds down on the server's link clock,
scripted: lost at 30 s, back at 34.5 s). The round re-sent after the return:
test_server_rounds.py; the agent's side: tests/edge_agent/test_agent_link_log.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from helpers.memory_server import memory_server

from edge_agent.models import build_model


def test_the_server_logs_its_lost_link_and_its_return(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="broker_server.server")
    srv = memory_server(tmp_path, model=build_model("lightcnn", in_channels=1, image_size=28, num_classes=10),
                        clients=["client-a"], rounds=1)
    ticks = iter([30.0, 34.5])
    srv.link_log.clock = lambda: next(ticks)
    srv.channel.transport.drop_link()
    records = [(r.levelno, r.getMessage()) for r in caplog.records
               if r.name == "broker_server.server" and "link to the broker" in r.getMessage()]
    assert records == [
        (logging.WARNING, "link to the broker lost (connection 1: link dropped (MemoryTransport.drop_link)); no "
                          "message awaiting acknowledgement; reconnecting"),
        (logging.INFO, "link to the broker back (connection 2), 4.5 s after it was lost")]
    assert (srv.link_log.losses, srv.link_log.down_s) == (1, 4.5)
