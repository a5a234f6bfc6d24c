"""A broker restart in the middle of a round costs no device a second model download and no
update a second upload, whichever side connects again first.

Three FedAvg agents and the server on the in-process broker; the broker restarts
(:meth:`protocol.memory_transport.MemoryBroker.restart`: every link breaks, no last will,
retained messages lost, the clients back one by one) while round 2 waits for dev-c, whose
training of round 2 is held until the server has handled its own reconnect. dev-a and dev-b had
their round-2 updates acknowledged before the restart; all three held round 2's global and
round_start. Counted from the agents' ledger (a shared one, a row per message per node), worked
out by hand:

* round 2's ``global``: received once by each device (the broadcast before the restart), and
  never sent again by the server (no re-broadcast, no copy for a device that holds it);
* round 2's ``update``: sent once by each device (dev-a's and dev-b's receipts arrived before the
  restart; dev-c sends its own after it, on the link the server hears);
* rounds 1 and 3 as without a restart: one global and one update per device each.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from helpers.memory_federation import Device, federation_server, start_agents
from helpers.waiting import wait_for

from broker_server.strategies.fedavg import FedAvg
from edge_agent.algorithms.fedavg import FedAvgClient
from protocol.ledger import Ledger
from protocol.memory_transport import MemoryBroker

CIDS = ["dev-a", "dev-b", "dev-c"]


def _restart_mid_round(tmp: Path, digits, order: list[str]) -> tuple[Ledger, object]:
    """Run 3 rounds; restart the broker during round 2 with the clients back in ``order``.
    Returns (the closed-over ledger, the server)."""
    entered, release = threading.Event(), threading.Event()
    devices = {cid: Device(FedAvgClient(), digits.train.x[30 * i:30 * i + 30], digits.train.y[30 * i:30 * i + 30])
               for i, cid in enumerate(CIDS)}
    real = devices["dev-c"].algorithm.local_round

    def held(*args, **kwargs):  # dev-c trains round 2 only once the restart is over
        if kwargs.get("round") == 2:
            entered.set()
            release.wait(60)
        return real(*args, **kwargs)

    devices["dev-c"].algorithm.local_round = held
    ledger = Ledger(tmp / "ledger.sqlite")
    hub = MemoryBroker()
    server = federation_server(tmp / "run", hub, FedAvg(train_config={"lr": 0.05}), digits.test, rounds=3,
                               clients=3, server_ledger=ledger)
    agents, threads, errors = start_agents(hub, devices, agent_ledger=ledger)
    by_id = {a.client_id: a for a in agents}
    out: dict = {}
    runner = threading.Thread(target=lambda: out.setdefault("summary", server.run()), daemon=True)
    runner.start()
    try:
        assert entered.wait(60), "dev-c never started round 2"
        # dev-a and dev-b: round 2's update counted and its receipt read before the restart
        assert wait_for(lambda: all(by_id[c].receipts_accepted == 2 for c in ("dev-a", "dev-b")))
        hub.restart(order)
        assert wait_for(lambda: server.resyncs == 1)  # the server handled its reconnect
    finally:
        release.set()
    runner.join(120)
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert out["summary"].rounds_completed == 3
    ledger.flush()
    return ledger, server


def _per_device(ledger: Ledger, where: str) -> dict[tuple[str, int], int]:
    """(node, round) → rows of the agents' side matching ``where``."""
    counts: dict[tuple[str, int], int] = {}
    for r in ledger.rows(f"side = 'agent' AND {where}"):
        counts[(r.node, r.round)] = counts.get((r.node, r.round), 0) + 1
    return counts


@pytest.mark.parametrize("order", [["server", *CIDS], [*CIDS, "server"], ["dev-a", "server", "dev-b", "dev-c"]],
                         ids=["server-first", "server-last", "server-between"])
def test_broker_restart_mid_round_costs_no_second_download_or_upload(tmp_path: Path, digits,
                                                                     order: list[str]) -> None:
    ledger, server = _restart_mid_round(tmp_path, digits, order)
    try:
        once = {(c, r): 1 for c in CIDS for r in (1, 2, 3)}
        assert _per_device(ledger, "event = 'received' AND kind = 'global'") == once
        assert _per_device(ledger, "event = 'sent' AND kind = 'update'") == once
        sent = ledger.rows("side = 'server' AND event = 'sent' AND kind = 'global' AND round = 2")
        assert len(sent) == 1  # the broadcast that opened round 2, nothing after the restart
        assert [m["clients_reported"] for m in server.metrics] == [3, 3, 3]
        assert [m["duplicates"] for m in server.metrics] == [0, 0, 0]
    finally:
        ledger.close()
