"""Per-device instructions end to end in memory: a strategy gives two devices different
``local_epochs``; each device gets its own ``round_start`` carrying only its instructions, trains
that many epochs (counted through the training-step hook), and the ledger prices each message."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from broker_server.errors import RunError
from broker_server.registry import ClientRecord
from broker_server.round_state import RoundState
from broker_server.server import AggregationServer, ServerSettings
from broker_server.strategies import RoundPlan
from broker_server.strategies.fedavg import FedAvg
from edge_agent.agent import EdgeAgent
from edge_agent.algorithms import StepContext, TrainConfig
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.data import ArraySplit
from edge_agent.models import build_model
from protocol.channel import Channel
from protocol.ledger import Ledger
from protocol.messages import Global, Status, decode

EPOCHS = {"dev-a": 1, "dev-b": 3}
N, BATCH = 20, 10  # 2 optimizer steps per epoch


class PerDeviceEpochs(FedAvg):
    """FedAvg whose plan gives each device its own ``local_epochs``."""

    instructions = ("local_epochs",)

    def configure_round(self, round, available, rng):
        plan = super().configure_round(round, available, rng)
        return RoundPlan(plan.selected, plan.config, {c: {"local_epochs": EPOCHS[c]} for c in plan.selected})


class StepCounter(FedAvgClient):
    """FedAvg client recording, per round, the epochs and steps its training-step hook saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, list[StepContext]] = {}
        self.client_ids: set[str] = set()

    def local_round(self, *args, client_id: str = "", **kw):
        self.client_ids.add(client_id)
        return super().local_round(*args, client_id=client_id, **kw)

    def before_step(self, model, context: StepContext) -> None:
        self.seen.setdefault(context.round, []).append(context)


def test_each_device_trains_its_own_epochs(memory_hub, tmp_path) -> None:
    rng = np.random.default_rng(0)

    def model():
        return build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)

    ledger = Ledger(tmp_path / "ledger.sqlite")
    server = AggregationServer(
        channel=Channel(memory_hub.connect("server"), node_id="server", side="server", federation="mem",
                        ledger=ledger),
        strategy=PerDeviceEpochs(train_config={"lr": 0.05}), model=model(),
        test=ArraySplit(np.zeros((4, 1, 8, 8), np.float32), np.zeros(4, np.int64), 10),
        settings=ServerSettings(rounds=2, quorum=2, round_deadline_s=60, join_timeout_s=30, expected_clients=2),
        run_dir=tmp_path)
    algos, agents = {}, []
    for i, cid in enumerate(EPOCHS):
        algos[cid] = StepCounter()
        agents.append(EdgeAgent(
            channel=Channel(memory_hub.connect(cid), node_id=cid, side="agent", federation="mem", ledger=None),
            model=model(), algorithm=algos[cid], x=rng.standard_normal((N, 1, 8, 8)).astype(np.float32),
            y=rng.integers(0, 10, N), num_classes=10, client_index=i, idle_timeout_s=60,
            train_defaults=TrainConfig(local_epochs=1, batch_size=BATCH)))
    errors: list[BaseException] = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # reported by the assertion below
                errors.append(exc)
        return run

    threads = [threading.Thread(target=guarded(a.run), daemon=True) for a in agents]
    for t in threads:
        t.start()
    summary = server.run()
    for t in threads:
        t.join(30)
    assert not errors and summary.rounds_completed == 2
    assert [m["clients_reported"] for m in summary.metrics] == [2, 2]

    for cid, algo in algos.items():
        assert algo.client_ids == {cid}  # local_round is told its client id
        for r in (1, 2):
            ctx = algo.seen[r]
            assert sorted({c.epoch for c in ctx}) == list(range(EPOCHS[cid]))
            assert len(ctx) == EPOCHS[cid] * N // BATCH  # epochs × steps per epoch

    # every round_start went to one device on its own topic, carrying only its instructions
    published = [(m.topic, m.payload) for m in memory_hub.published
                 if m.sender == "server" and m.topic.endswith("/round_start")]
    starts = [(topic, decode(payload).envelope) for topic, payload in published]
    assert len(starts) == 4
    for topic, env in starts:
        cid = topic.split("/")[-2]
        assert topic == f"fedfleet/v1/mem/down/{cid}/round_start"
        assert env.body.selected == (cid,)
        assert dict(env.body.instructions) == {"local_epochs": EPOCHS[cid]}
        assert dict(env.body.config) == {"lr": 0.05}
    # the ledger prices each of them, with the instructions field
    rows = ledger.rows("side = 'server' AND kind = 'round_start' AND event = 'sent'")
    assert sorted((r.round, r.client) for r in rows) == [(1, "dev-a"), (1, "dev-b"), (2, "dev-a"), (2, "dev-b")]
    by_payload = {(env.round, env.body.selected[0]): len(p)
                  for (_, p), (_, env) in zip(published, starts, strict=True)}
    for r in rows:
        assert r.payload_bytes == by_payload[(r.round, r.client)]
        assert "instructions" in r.fields
    ledger.close()


def test_resync_sends_every_per_device_round_start_again(memory_hub, tmp_path) -> None:
    """After a reconnect the open round's global (each awaited device its own copy: neither said
    what it holds) and both per-device round_starts, with their instructions, go out again."""
    server = AggregationServer(
        channel=Channel(memory_hub.connect("server"), node_id="server", side="server", federation="mem",
                        ledger=None),
        strategy=PerDeviceEpochs(), model=build_model("lightcnn", in_channels=1, image_size=8, num_classes=10),
        test=ArraySplit(np.zeros((2, 1, 8, 8), np.float32), np.zeros(2, np.int64), 10),
        settings=ServerSettings(rounds=1), run_dir=tmp_path)
    plan = server.strategy.configure_round(1, list(EPOCHS), np.random.default_rng(0))
    server.open = RoundState(collecting=1, selected=set(plan.selected))
    server.open.messages = (Global(tensors=()), server._round_starts(plan.selected, dict(plan.config),
                                                                    dict(plan.instructions)))
    server._on_reconnect(2)
    server._resync_round()
    sent = [(m.topic, decode(m.payload).envelope.body) for m in memory_hub.published if m.sender == "server"]
    # first the server's retained online status, said once at construction (down/status)
    assert [t.rsplit("/", 2)[-2:] for t, _ in sent] == [["down", "status"], ["dev-a", "global"], ["dev-b", "global"],
                                                       ["dev-a", "round_start"], ["dev-b", "round_start"]]
    assert sent[0][1] == Status("online", "serving", global_round=0, start_round=0, update_round=0)
    assert [dict(b.instructions) for _, b in sent[3:]] == [{"local_epochs": 1}, {"local_epochs": 3}]
    assert server.resyncs == 1


def test_a_plan_cannot_instruct_an_unselected_device() -> None:
    with pytest.raises(ValueError, match="not selected"):
        RoundPlan(("a",), {}, {"b": {"local_epochs": 2}})
    with pytest.raises(ValueError, match="scalar"):
        RoundPlan(("a",), {}, {"a": {"local_epochs": [2]}})


def test_an_undeclared_instruction_stops_the_run(memory_hub, tmp_path) -> None:
    class Undeclared(PerDeviceEpochs):
        instructions = ()


    server = AggregationServer(
        channel=Channel(memory_hub.connect("server"), node_id="server", side="server", federation="mem",
                        ledger=None),
        strategy=Undeclared(), model=build_model("lightcnn", in_channels=1, image_size=8, num_classes=10),
        test=ArraySplit(np.zeros((2, 1, 8, 8), np.float32), np.zeros(2, np.int64), 10),
        settings=ServerSettings(rounds=1), run_dir=tmp_path)
    server.devices.records.update({c: ClientRecord(c) for c in EPOCHS})
    with pytest.raises(RunError, match="local_epochs"):
        server.run_round(1)
