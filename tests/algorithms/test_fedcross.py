"""FedCross: collaborator choice and cross-aggregation by hand; a federation in memory (digits,
three devices, three middleware models, two rounds) whose global equals the sample-weighted mean
of the uploads and whose next middleware models (on the wire, in the next global's extras) equal
the hand-computed cross-aggregation of the uploads."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.memory_federation import Device, run_federation, wire

from broker_server.strategies.fedcross import FedCross, chunk_similarity, collaborators, cross_aggregate
from edge_agent.algorithms.fedcross import FedCrossClient, flatten_state, unflatten_state
from protocol.messages import Global, RoundStart, Update


def _m(w, b):
    return [np.array(w, np.float32), np.array(b, np.float32)]


def test_collaborators_and_cross_aggregation_by_hand() -> None:
    models = [_m([1, 0], [0]), _m([0, 1], [0]), _m([1, 0.1], [0])]
    # one chunk (weight, bias): cos(0,1) = 0, cos(0,2) = 1/√1.01, cos(1,2) = 0.1/√1.01
    assert chunk_similarity(models[0], models[2]) == pytest.approx(1 / np.sqrt(1.01))
    assert collaborators(models, "least", 1) == [1, 0, 1]
    assert collaborators(models, "most", 1) == [2, 2, 0]
    assert collaborators(models, "round_robin", 1) == [2, 0, 1]  # offset 1 mod 2 + 1 = 2
    new = cross_aggregate(models, [1, 0, 1], 0.9)
    np.testing.assert_allclose(new[0][0], [0.9, 0.1])
    np.testing.assert_allclose(new[2][0], [0.9, 0.19])
    np.testing.assert_allclose(models[0][0], [1, 0])  # inputs unchanged
    flat = flatten_state(models[2])
    assert flat.tolist() == pytest.approx([1, 0.1, 0])
    back = unflatten_state(flat, models[0])
    np.testing.assert_allclose(back[0], [1, 0.1])
    assert back[1].tolist() == [0.0] and back[0].dtype == np.float32


def test_fedcross_federation_matches_the_hand_computed_cross_aggregation(tmp_path, digits, memory_hub) -> None:
    sizes = {"dev-a": 30, "dev-b": 50, "dev-c": 40}
    devices, start = {}, 0
    for cid, n in sizes.items():
        devices[cid] = Device(FedCrossClient(), digits.train.x[start:start + n], digits.train.y[start:start + n])
        start += n
    strategy = FedCross(train_config={"lr": 0.05}, models=3, alpha=0.9)
    server = run_federation(tmp_path, memory_hub, strategy, devices, digits.test, rounds=2)
    msgs = wire(memory_hub)
    globals_ = {env.round: env.body for s, _, env in msgs if s == "server" and isinstance(env.body, Global)}
    for r in (1, 2):
        slots = {t.split("/")[-2]: env.body.instructions["cross_slot"] for s, t, env in msgs
                 if s == "server" and env.round == r and isinstance(env.body, RoundStart)}
        assert sorted(slots.values()) == [0, 1, 2]
        ups = {s: env.body for s, _, env in msgs if env.round == r and isinstance(env.body, Update)}
        assert set(ups) == set(sizes)
        trained = [None] * 3
        for c, body in ups.items():
            trained[slots[c]] = [np.asarray(t) for t in body.tensors]
        total = sum(b.num_samples for b in ups.values())
        mean = [sum(np.asarray(b.tensors[i], np.float64) * b.num_samples / total for b in ups.values())
                for i in range(len(trained[0]))]
        # by hand: cosine over (weight, bias) chunks, the least similar other model, 0.9/0.1 mix
        def sim(a, b):
            s = 0.0
            for i in range(0, len(a), 2):
                x, y = np.concatenate([t.ravel() for t in a[i:i + 2]]), np.concatenate([t.ravel() for t in b[i:i + 2]])
                s += float(x.astype(np.float64) @ y) / (np.linalg.norm(x.astype(np.float64)) * np.linalg.norm(y))
            return s
        collab = [min((j for j in range(3) if j != i), key=lambda j, i=i: sim(trained[i], trained[j]))
                  for i in range(3)]
        assert server.metrics[r - 1]["fedcross_collaborators"] == collab
        want = [[0.9 * trained[i][k].astype(np.float64) + 0.1 * trained[collab[i]][k] for k in range(len(mean))]
                for i in range(3)]
        if r == 1:  # the next round's global: the mean as tensors, the middleware models as extras
            nxt = globals_[2]
            for k, t in enumerate(nxt.tensors):
                np.testing.assert_allclose(np.asarray(t), mean[k], rtol=1e-5, atol=1e-6)
            for i in range(3):
                np.testing.assert_allclose(np.asarray(nxt.extras[f"cross_{i}"]),
                                           np.concatenate([w.ravel() for w in want[i]]), rtol=1e-5, atol=1e-6)
        else:
            for i in range(3):
                np.testing.assert_allclose(flatten_state(strategy.middleware[i]),
                                           np.concatenate([w.ravel() for w in want[i]]), rtol=1e-5, atol=1e-6)
