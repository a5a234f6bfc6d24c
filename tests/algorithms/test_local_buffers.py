"""``buffers = "local"`` end to end in memory: two agents train a BatchNorm network (the zoo's
resnet8) under a FedAvg whose both halves keep the buffers on the device. No ``global`` and no
``update`` carries a buffer entry, each device keeps its own running statistics, and the server
averages exactly the non-buffer entries (checked against a weighted mean worked out here from the
updates as they crossed the broker). With ``buffers = "average"`` the same run averages the
statistics too."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from broker_server.checkpoint import CheckpointStore
from broker_server.server import AggregationServer, ServerSettings
from broker_server.strategies.fedavg import FedAvg
from edge_agent.agent import EdgeAgent
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.data import ArraySplit
from edge_agent.models import build_model
from protocol.channel import Channel
from protocol.messages import Global, Update, decode

#: samples per device (the FedAvg weights) and the mean of each device's inputs (so the
#: BatchNorm statistics the devices see differ)
DEVICES = {"dev-a": (20, 0.0), "dev-b": (30, 2.0)}
MEAN = "backbone.bn1.running_mean"


class LocalStatsFedAvg(FedAvg):
    buffers = "local"


class LocalStatsFedAvgClient(FedAvgClient):
    buffers = "local"


def model():
    return build_model("resnet8", in_channels=1, image_size=8, num_classes=10)


def run(memory_hub, tmp_path, buffers: str):
    strategy = LocalStatsFedAvg(train_config={"lr": 0.05}) if buffers == "local" else FedAvg(train_config={"lr": 0.05})
    client = LocalStatsFedAvgClient if buffers == "local" else FedAvgClient
    server = AggregationServer(
        channel=Channel(memory_hub.connect("server"), node_id="server", side="server", federation="mem",
                        ledger=None),
        strategy=strategy, model=model(),
        test=ArraySplit(np.zeros((4, 1, 8, 8), np.float32), np.zeros(4, np.int64), 10),
        settings=ServerSettings(rounds=2, quorum=2, round_deadline_s=120, join_timeout_s=60, expected_clients=2),
        run_dir=tmp_path)
    rng = np.random.default_rng(0)
    agents = {}
    for i, (cid, (n, mu)) in enumerate(DEVICES.items()):
        agents[cid] = EdgeAgent(
            channel=Channel(memory_hub.connect(cid), node_id=cid, side="agent", federation="mem", ledger=None),
            model=model(), algorithm=client(), x=(mu + rng.standard_normal((n, 1, 8, 8))).astype(np.float32),
            y=rng.integers(0, 10, n), num_classes=10, client_index=i, idle_timeout_s=60,
            train_defaults=TrainConfig(local_epochs=1, batch_size=10))
    errors: list[BaseException] = []

    def guarded(fn):
        def go():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001  (reported by the assertion below)
                errors.append(exc)
        return go

    threads = [threading.Thread(target=guarded(a.run), daemon=True) for a in agents.values()]
    for t in threads:
        t.start()
    summary = server.run()
    for t in threads:
        t.join(30)
    assert not errors and summary.rounds_completed == 2
    assert [m["clients_reported"] for m in summary.metrics] == [2, 2]
    bodies = [(m.topic, decode(m.payload).envelope) for m in memory_hub.published]
    updates = {(env.round, env.sender): env.body for _, env in bodies if isinstance(env.body, Update)}
    globals_ = [env.body for _, env in bodies if isinstance(env.body, Global)]
    return server, agents, updates, globals_


@pytest.mark.parametrize("buffers", ["local", "average"])
def test_buffers_stay_on_the_device_or_are_averaged(memory_hub, tmp_path, buffers) -> None:
    server, agents, updates, globals_ = run(memory_hub, tmp_path, buffers)
    names = list(server.model.state_dict())
    buffer_names = {n for n, _ in server.model.named_buffers()}
    assert MEAN in buffer_names and len(buffer_names) >= 9
    travels = [i for i, n in enumerate(names) if buffers == "average" or n not in buffer_names]
    assert len(travels) == (len(names) if buffers == "average" else len(names) - len(buffer_names))

    # what crossed the broker: exactly the travelling entries, in both directions
    assert sorted(updates) == [(r, c) for r in (1, 2) for c in sorted(DEVICES)]
    for upd in updates.values():
        assert len(upd.tensors) == len(travels)
        assert [t.shape for t in upd.tensors] == [tuple(server.model.state_dict()[names[i]].shape) for i in travels]
    assert len(globals_) == 2 and all(len(g.tensors) == len(travels) for g in globals_)

    # the server's global = Σ n_k w_k / Σ n_k of round 2's updates (float64 here)
    n = {c: DEVICES[c][0] for c in DEVICES}
    for j, i in enumerate(travels):
        ref = server.model.state_dict()[names[i]]
        if not ref.is_floating_point():
            continue
        want = sum(n[c] * updates[(2, c)].tensors[j].astype(np.float64) for c in DEVICES) / sum(n.values())
        np.testing.assert_allclose(server.global_tensors[i], want, rtol=1e-5, atol=1e-6, err_msg=names[i])

    # the round-2 checkpoint holds the whole server model: the averaged entries and its own buffers
    store = CheckpointStore(tmp_path / "checkpoints.sqlite")
    ckpt = store.load(2)
    store.close()
    assert ckpt is not None and len(ckpt.tensors) == len(names)
    for a, b in zip(ckpt.tensors, server.global_tensors, strict=True):
        np.testing.assert_array_equal(a, b)

    server_mean = server.model.state_dict()[MEAN].numpy()
    device_mean = {c: a.model.state_dict()[MEAN].detach().cpu().numpy() for c, a in agents.items()}
    # each device's statistics after round 2 are what it computed itself (uploaded under "average")
    if buffers == "local":
        assert not np.allclose(device_mean["dev-a"], device_mean["dev-b"])
        for c in DEVICES:
            assert not np.allclose(device_mean[c], server_mean)
        np.testing.assert_array_equal(server_mean, model().state_dict()[MEAN].numpy())  # never changed
    else:
        k = travels.index(names.index(MEAN))
        for c in DEVICES:
            np.testing.assert_array_equal(updates[(2, c)].tensors[k], device_mean[c])
        want = (n["dev-a"] * device_mean["dev-a"].astype(np.float64)
                + n["dev-b"] * device_mean["dev-b"].astype(np.float64)) / sum(n.values())
        np.testing.assert_allclose(server_mean, want, rtol=1e-5, atol=1e-6)
        assert not np.allclose(server_mean, model().state_dict()[MEAN].numpy())


def test_every_model_sharing_client_algorithm_honours_a_local_buffers_declaration() -> None:
    """Declaring ``buffers = "local"`` on any registered client algorithm that shares model
    tensors is enough: it loads and uploads the non-buffer entries only, and its BatchNorm
    statistics are the ones its own training left (never overwritten by the global)."""
    import torch

    from edge_agent.algorithms import (
        get_client_algorithm_class,
        list_client_algorithms,
        shared_indices,
    )

    x = torch.from_numpy((1.0 + np.random.default_rng(1).standard_normal((12, 1, 8, 8))).astype(np.float32))
    y = torch.from_numpy(np.arange(12) % 10)
    checked = []
    for name in list_client_algorithms():
        base = get_client_algorithm_class(name)
        if base.share == "none" or not base.__module__.startswith("edge_agent.algorithms."):
            continue  # shares nothing, or a probe another test module registered
        algo = type(f"Local{base.__name__}", (base,), {"buffers": "local"})()
        m = model()
        names = list(m.state_dict())
        idx = shared_indices(names, base.share, {n for n, _ in m.named_buffers()})
        mine = m.state_dict()[MEAN].clone() + 5.0  # this device's own statistics
        m.state_dict()[MEAN].copy_(mine)
        glob = tuple(np.zeros_like(m.state_dict()[names[i]].numpy()) for i in idx)  # a global of zeros
        params: dict = {}
        extras: dict = {}
        if name == "fedcross":  # trains the middleware model its instruction names (here: slot 0, zeros too)
            from edge_agent.algorithms.fedcross import SLOT_KEY, extras_name, flatten_state

            params, extras = {SLOT_KEY: 0}, {extras_name(0): flatten_state(glob)}
        result = algo.local_round(m, glob, x, y, TrainConfig(local_epochs=1, batch_size=6), round=1, client_id="d",
                                  client_index=0, device=torch.device("cpu"), params=params,
                                  **({"global_extras": extras} if extras else {}))
        assert len(result.tensors) == len(idx), name
        assert [t.shape for t in result.tensors] == [tuple(m.state_dict()[names[i]].shape) for i in idx], name
        # two batches with BatchNorm momentum 0.1: 0.81·(own ≥ 5) + 0.19·(batch means), far from
        # the 0.19·(batch means) left had the zero global overwritten them
        after = m.state_dict()[MEAN].numpy()
        assert np.all(after > 2.5), name
        checked.append(name)
    assert {"fedavg", "fedprox", "scaffold", "feddyn", "fedper", "fedrep"} <= set(checked)


def test_what_a_restarted_device_loses_is_named_per_algorithm() -> None:
    """restarted_device_state, by hand from each class's declarations: FedAvg's device keeps
    nothing between rounds (its whole model comes with every global), FedBN-style local buffers
    are its BatchNorm statistics, FedPer keeps its unshared head, FedProto its whole model,
    SCAFFOLD its c_i, MOON its previous model, and a user's class that declares both parts gets
    both, in that order."""
    from edge_agent.algorithms import get_client_algorithm_class, restarted_device_state

    assert restarted_device_state(FedAvgClient) == []
    assert restarted_device_state(FedAvgClient, buffers="local") == ["its BatchNorm statistics (buffers = 'local')"]
    assert restarted_device_state(LocalStatsFedAvgClient) == ["its BatchNorm statistics (buffers = 'local')"]
    assert restarted_device_state(get_client_algorithm_class("fedper")) == [
        "the model entries it never sends (share = 'backbone')"]
    assert restarted_device_state(get_client_algorithm_class("fedproto")) == [
        "its whole model (share = 'none': nothing of it leaves the device)"]
    assert restarted_device_state(get_client_algorithm_class("scaffold")) == ["its control variate c_i"]
    assert restarted_device_state(get_client_algorithm_class("moon")) == [
        "its previous local model (the contrastive negative)"]

    class Both(LocalStatsFedAvgClient):
        share = "backbone"
        device_state = "its own counter"

    assert restarted_device_state(Both) == ["the model entries it never sends (share = 'backbone')",
                                            "its BatchNorm statistics (buffers = 'local')", "its own counter"]
