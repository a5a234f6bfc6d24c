"""FedCross: collaborator choice and cross-aggregation by hand; a federation in memory (digits,
three devices, three middleware models, two rounds) whose global equals the sample-weighted mean
of the uploads and whose next middleware models (on the wire: in the next broadcast global's
extras, or, delivered per device, as the tensors of each device's own copy) equal the
hand-computed cross-aggregation of the uploads; per-device delivery moves one model per device
(the model's parameter count × 4 bytes, 1/(M + 1) of the broadcast) and reaches the broadcast
run's aggregate, deltas included."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.memory_federation import Device, digits_model, run_federation, wire

from broker_server.checkpoint import CheckpointStore
from broker_server.strategies._base import parameter_count
from broker_server.strategies.fedcross import FedCross, chunk_similarity, collaborators, cross_aggregate
from edge_agent.algorithms.fedcross import FedCrossClient, flatten_state, unflatten_state
from protocol.ledger import Ledger
from protocol.memory_transport import MemoryBroker
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


@pytest.mark.parametrize("delivery", ["broadcast", "per_device"])
def test_fedcross_federation_matches_the_hand_computed_cross_aggregation(tmp_path, digits, memory_hub,
                                                                         delivery) -> None:
    sizes = {"dev-a": 30, "dev-b": 50, "dev-c": 40}
    devices, start = {}, 0
    for cid, n in sizes.items():
        devices[cid] = Device(FedCrossClient(), digits.train.x[start:start + n], digits.train.y[start:start + n])
        start += n
    strategy = FedCross(train_config={"lr": 0.05}, models=3, alpha=0.9)
    server = run_federation(tmp_path, memory_hub, strategy, devices, digits.test, rounds=2, global_delivery=delivery)
    assert [m["global_delivery"] for m in server.metrics] == [delivery] * 2
    msgs = wire(memory_hub)
    globals_ = {env.round: env.body for s, t, env in msgs if s == "server" and isinstance(env.body, Global)
                and t.endswith("/down/global")}
    copies = {(env.round, t.split("/")[-2]): env.body for s, t, env in msgs if s == "server"
              and isinstance(env.body, Global) and not t.endswith("/down/global")}
    assert (set(globals_), len(copies)) == (({1, 2}, 0) if delivery == "broadcast" else (set(), 6))
    slots_of = {r: {t.split("/")[-2]: env.body.instructions["cross_slot"] for s, t, env in msgs
                    if s == "server" and env.round == r and isinstance(env.body, RoundStart)}
                for r in (1, 2)}
    for r in (1, 2):
        slots = slots_of[r]
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
        if r == 1 and delivery == "per_device":  # each device's round-2 copy: its own slot's model, nothing else
            for c, slot in slots_of[2].items():
                assert dict(copies[(2, c)].extras) == {}
                np.testing.assert_allclose(flatten_state(copies[(2, c)].tensors),
                                           np.concatenate([w.ravel() for w in want[slot]]), rtol=1e-5, atol=1e-6)
            store = CheckpointStore(tmp_path / "checkpoints.sqlite")  # the global of round 1: not on the wire
            ckpt = store.load(1)
            store.close()
            assert ckpt is not None and len(ckpt.tensors) == len(mean)
            for k, t in enumerate(ckpt.tensors):
                np.testing.assert_allclose(np.asarray(t), mean[k], rtol=1e-5, atol=1e-6)
        elif r == 1:  # the next round's global: the mean as tensors, the middleware models as extras
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


def test_per_device_globals_move_one_model_each_and_reach_the_broadcast_aggregate(tmp_path, digits) -> None:
    """Four devices, M = 2 middleware models (two devices a round), two rounds, delta updates:
    broadcast vs per-device delivery of the same seeded run. By hand: a broadcast global carries
    the mean and both middleware models, 3 × 4·P bytes of fp32 values (P = the light CNN's
    parameter count, every state entry a parameter); a device's own copy carries its slot's model
    only, 4·P (1/(M + 1) of the broadcast, 1/M of its middleware bytes). The unselected devices
    get no global, only the round_start naming nobody. Deltas are resolved against the copy each
    device got, so both runs reach the same global and middleware models."""
    model = digits_model()
    p = parameter_count(model)
    assert p == sum(v.numel() for v in model.state_dict().values())  # no buffers: the state is the parameters
    sizes = {"dev-a": 30, "dev-b": 50, "dev-c": 40, "dev-d": 35}
    runs = {}
    for delivery in ("broadcast", "per_device"):
        devices, start = {}, 0
        for cid, n in sizes.items():
            devices[cid] = Device(FedCrossClient(), digits.train.x[start:start + n], digits.train.y[start:start + n])
            start += n
        ledger = Ledger(tmp_path / f"{delivery}.sqlite")
        hub = MemoryBroker()
        strategy = FedCross(train_config={"lr": 0.05, "delta": True}, models=2, alpha=0.9)
        server = run_federation(tmp_path / delivery, hub, strategy, devices, digits.test, rounds=2,
                                global_delivery=delivery, agent_ledger=ledger)
        ledger.flush()
        rows = ledger.rows("side = 'agent' AND event = 'received' AND direction = 'down'")
        ledger.close()
        selected = {r: {s for s, _, env in wire(hub) if env.round == r and isinstance(env.body, Update)}
                    for r in (1, 2)}
        runs[delivery] = (server, rows, selected)
    (b_srv, b_rows, b_sel), (d_srv, d_rows, d_sel) = runs["broadcast"], runs["per_device"]
    assert b_sel == d_sel and all(len(s) == 2 for s in b_sel.values())  # the same seeded draws
    for r in (1, 2):
        b_glob = [x for x in b_rows if x.kind == "global" and x.round == r]
        d_glob = [x for x in d_rows if x.kind == "global" and x.round == r]
        assert sorted(x.client for x in b_glob) == sorted(sizes)  # the broadcast reaches every device
        assert {x.raw_bytes for x in b_glob} == {3 * 4 * p}
        assert sorted(x.client for x in d_glob) == sorted(d_sel[r])  # the copies, the selected only
        assert {x.raw_bytes for x in d_glob} == {4 * p}
        idle = set(sizes) - d_sel[r]
        assert {x.client for x in d_rows if x.kind == "round_start" and x.round == r} == set(sizes)
        assert not [x for x in d_rows if x.round == r and x.client in idle and x.kind not in ("round_start", "finish")]
    assert [m["global_receipts"] for m in d_srv.metrics] == [2, 2]
    for a, b in zip(b_srv.global_tensors, d_srv.global_tensors, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    for wa, wb in zip(b_srv.strategy.middleware, d_srv.strategy.middleware, strict=True):
        for a, b in zip(wa, wb, strict=True):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
