"""A ``round_start`` the broker drops, over a real Mosquitto (digits, 4 agents, participation 0.5,
quorum 2, 3 rounds, the global broadcast).

The broker's ACL lets every client publish on ``down/round_start`` but lets none read it (every
other topic of the federation is read and written freely): Mosquitto acknowledges the server's
broadcast ``round_start`` and delivers it to nobody, as it drops a message for a client whose
queue is full (``max_queued_messages``), only every time. Each device then holds each round's
``global`` (broadcast: the unselected ones too) and no ``round_start``. Before the agents asked,
every round waited for its deadline and was skipped ("global confirmed: yes; round sent again:
0x"). Now each device asks once per round (its ``online`` with its holdings, after
``round_start_wait_s``, here 1 s) and the server answers on the device's own topic: the
selected ones with the round's ``round_start`` (they train), the others with one naming nobody
(they stop asking). Expected values are counted from the setup, not from the run: every device
gets every broadcast global and no broadcast round_start, so every device asks exactly once per
round and gets exactly one ``round_start`` copy; 2 of the 4 are selected per round.

Round deadlines are 60 s; no assertion is on wall-clock time."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
from helpers.brokers import require_mosquitto
from helpers.federation import read_metrics, read_summary, small_config

from broker_server.embedded_broker import EmbeddedBroker
from broker_server.simulate import simulate
from protocol.messages import Kind

pytestmark = [pytest.mark.slow, pytest.mark.mosquitto]

ROUNDS = 3
CLIENTS = ("client-000", "client-001", "client-002", "client-003")


def _acl(path: Path) -> Path:
    """An ACL that lets clients read and write every topic of any federation but read no
    broadcast ``round_start`` (``down/round_start`` is write-only)."""
    lines = ["topic readwrite fedfleet/v1/+/up/#", "topic readwrite fedfleet/v1/+/status/#",
             "topic readwrite fedfleet/v1/+/down/+/+"]
    lines += [f"topic readwrite fedfleet/v1/+/down/{k.label}" for k in Kind if k != Kind.ROUND_START]
    lines.append("topic write fedfleet/v1/+/down/round_start")
    path.write_text("\n".join(lines) + "\n")
    return path


def _rows(run_dir: Path, where: str) -> list[sqlite3.Row]:
    db = sqlite3.connect(f"file:{run_dir / 'ledger.sqlite'}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        return list(db.execute(f"SELECT * FROM messages WHERE {where} ORDER BY id"))
    finally:
        db.close()


def test_devices_ask_for_the_dropped_round_start_and_every_round_completes(tmp_path: Path, caplog) -> None:
    require_mosquitto()
    cfg = small_config(run={"name": "lost", "rounds": ROUNDS}, data={"clients": len(CLIENTS)},
                       broker={"kind": "mosquitto"},
                       server={"round_deadline_s": 60.0, "participation_rate": 0.5, "quorum": 2,
                               "global_delivery": "broadcast"})
    agents = []

    def hook(i, agent):
        agent.round_start_wait_s = 1.0
        agents.append(agent)

    run_dir = tmp_path / "run"
    acl = _acl(tmp_path / "acl")
    with (caplog.at_level(logging.WARNING),
          EmbeddedBroker(kind="mosquitto", workdir=tmp_path / "broker", extra_config=(f"acl_file {acl}",)) as broker):
        res = simulate(cfg, broker_url=broker.url, run_dir=run_dir, agent_hook=hook)
    m = read_metrics(run_dir)
    assert res.rounds_completed == ROUNDS and read_summary(run_dir)["agent_errors"] == []
    # the broker delivered no broadcast round_start (the ACL), and every device every global
    assert _rows(run_dir, "side = 'agent' AND event = 'received' AND topic LIKE '%/down/round_start'") == []
    for cid in CLIENTS:
        got = _rows(run_dir, f"side = 'agent' AND node = '{cid}' AND event = 'received' AND kind = 'global'")
        assert [r["round"] for r in got] == list(range(1, ROUNDS + 1))
    every = dict.fromkeys(CLIENTS, 1)
    for line in m:
        assert (line["skipped"], line["clients_selected"], line["clients_reported"]) == (False, 2, 2), line
        assert line["round_start_asks"] == every and line["round_start_resends"] == every
        assert len(line["resent_to"]) == 2  # the selected ones; the other two got a round_start naming nobody
    for a in agents:
        assert a.round_start_asks == dict.fromkeys(range(1, ROUNDS + 1), 1)
        # one answer per round on its own topic, none on the broadcast topic
        own = _rows(run_dir, f"side = 'agent' AND node = '{a.client_id}' AND event = 'received' "
                             f"AND kind = 'round_start' AND topic LIKE '%/down/{a.client_id}/round_start'")
        assert [r["round"] for r in own] == list(range(1, ROUNDS + 1))
        # it trained exactly the rounds the server sent it the round in (resent_to)
        assert a.rounds_trained == sum(a.client_id in line["resent_to"] for line in m)
    assert sum(a.rounds_trained for a in agents) == 2 * ROUNDS
    said = [r.getMessage() for r in caplog.records]
    assert sum("asks the server for it" in s for s in said) == len(CLIENTS) * ROUNDS
    assert sum("lacks the round_start" in s and "sending it" in s for s in said) == len(CLIENTS) * ROUNDS
