"""Reproducer (tester): an agent that falls behind trains every superseded round, one after the
other, even after the server has published ``finish``.

``EdgeAgent.run`` handles one queued message at a time and calls ``_maybe_train`` after each:
when round r+1, r+2 … and ``finish`` queued up while it trained round r, it trains r+1, then
r+2 …, publishing updates the server rejects as late (or never reads: it has already left),
and only then reaches ``finish``. ``round_start.deadline_s`` is never consulted. On a device this
is wasted battery and a backlog that never drains when the deadline is shorter than training.
Observed with examples/quickstart-style digits, 10 clients, round_deadline_s = 0.3, 4 rounds:
the server finished after 2.6 s; agents kept training for 10 more seconds (40 updates, 0 counted).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from broker_server import config as config_mod
from broker_server.simulate import simulate

pytestmark = pytest.mark.slow

TRAIN_S = 1.0


def test_agent_does_not_train_rounds_that_are_already_over(tmp_path: Path) -> None:
    def hook(i, agent):
        original = agent.algorithm.local_round

        def slow(*args, **kwargs):
            time.sleep(TRAIN_S)  # a slow device: training takes longer than the round deadline
            return original(*args, **kwargs)

        agent.algorithm.local_round = slow

    cfg = config_mod.from_dict({
        "run": {"name": "brk", "seed": 1, "rounds": 4},
        "data": {"dataset": "digits", "partition": "iid", "clients": 3},
        "train": {"local_epochs": 1, "batch_size": 16},
        "server": {"quorum": 1, "round_deadline_s": 0.5, "join_timeout_s": 30.0},
        "agents": {"train_slots": 3},
        "broker": {"kind": "amqtt"},
    }, "<test_break>")
    run_dir = tmp_path / "run"
    simulate(cfg, run_dir=run_dir, agent_hook=hook)
    db = sqlite3.connect(run_dir / "ledger.sqlite")
    (finish_ts,) = db.execute("SELECT ts FROM messages WHERE side='server' AND event='sent' AND kind='finish'").fetchone()
    after = dict(db.execute("SELECT node, COUNT(*) FROM messages WHERE side='agent' AND event='sent' "
                            "AND kind='update' AND ts > ? GROUP BY node", (finish_ts,)).fetchall())
    db.close()
    # what should happen: at most the one training in progress when 'finish' was published is
    # completed; no agent starts training a round that is already closed
    assert all(n <= 1 for n in after.values()), f"updates published after the server's finish: {after}"
