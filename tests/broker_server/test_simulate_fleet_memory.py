"""What a simulated fleet's virtual agents hold: shards that are views of the one cached data set,
no model of their own under FedAvg (they train on the training slots' working models, on the
slots' threads), one shared copy of each round's broadcast global, and no global once trained."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
from helpers.federation import small_config

from broker_server.simulate import simulate
from edge_agent.data import load_dataset


def test_virtual_agents_hold_views_of_the_data_and_borrow_the_slots_models(tmp_path: Path) -> None:
    cfg = small_config(run={"rounds": 2}, data={"clients": 4, "partition": "iid", "min_samples": 5},
                       server={"quorum": 4}, agents={"train_slots": 2})
    agents: list = []
    seen: list[tuple[int, str, str, int, int]] = []  # (round, client, thread, id(model), id(global array))
    lock = threading.Lock()
    plans: list = []

    def hook(i: int, agent) -> None:
        agents.append(agent)
        inner = agent.algorithm.local_round

        def spy(model, global_tensors, *args, round: int, **kw):
            with lock:
                seen.append((round, agent.client_id, threading.current_thread().name, id(model),
                             id(global_tensors[0])))
            return inner(model, global_tensors, *args, round=round, **kw)

        agent.algorithm.local_round = spy

    res = simulate(cfg, run_dir=tmp_path / "run", agent_hook=hook, on_plan=plans.append)
    assert res.rounds_completed == 2 and all(m["clients_reported"] == 4 for m in res.metrics)
    slots = plans[0].train_slots
    data = load_dataset("digits")  # the cached set simulate split
    sizes = []
    for a in agents:
        assert np.shares_memory(a.x.numpy(), data.train.x)  # a view of the data set, never a copy
        assert a.borrows_model and a._model is None and a._private == {}  # FedAvg: no model between rounds
        assert a._global is not None and a._global[1].tensors == ()  # the last global let go once trained
        sizes.append(len(a.y))
    assert sum(sizes) == len(data.train.y)  # IID: every training sample in exactly one shard
    assert len(seen) == 8
    for rnd in (1, 2):
        calls = [s for s in seen if s[0] == rnd]
        assert len({s[4] for s in calls}) == 1  # every agent trained from the one shared global array
        assert len({s[3] for s in calls}) <= slots  # on at most one working model per slot
        assert not any(s[2] == s[1] for s in calls)  # on a slot's thread, not the agent's own
    assert agents[0].slots.models_built <= slots

