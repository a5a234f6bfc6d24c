"""A ``round_start`` the broker drops (:class:`protocol.memory_transport.MemoryBroker`'s
``drop_deliveries``, as Mosquitto drops a message for a client whose queue is full): the agent
holds the round's ``global`` and no ``round_start`` of its round, asks the server for it (its
``online`` with its holdings) after ``round_start_wait_s``, and the server answers on the
agent's own topic; every count is of the PUBLISHes the broker received (``hub.published``)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from helpers.memory_federation import Device, federation_server, start_agents
from helpers.waiting import wait_for

from broker_server.strategies.fedavg import FedAvg
from edge_agent.agent import MAX_ROUND_START_ASKS, ROUND_START_WAIT_S, EdgeAgent
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol import topics
from protocol.channel import Channel, Received
from protocol.memory_transport import MemoryBroker
from protocol.messages import Global, Join, Kind, Receipt, RoundStart, Status, decode

FED = "mem"


def _statuses(hub: MemoryBroker, cid: str) -> list[Status]:
    """The ``status`` bodies ``cid`` published, in order (its last will aside)."""
    return [env.body for m in hub.published if m.sender == cid and m.topic == topics.status(FED, cid)
            and isinstance((env := decode(m.payload).envelope).body, Status)]


def _kinds(hub: MemoryBroker, cid: str) -> list[tuple[str, int]]:
    """(kind, round) of every message ``cid`` published, in order."""
    return [((env := decode(m.payload).envelope).kind.label, env.round) for m in hub.published if m.sender == cid]


def test_a_dropped_round_start_is_asked_for_once_answered_once_and_trained(tmp_path, digits, memory_hub) -> None:
    """Two devices, FedAvg selecting both, quorum 2, two rounds. The broker drops the broadcast
    round_start of round 1 for dev-a only. dev-a asks once (holdings: global 1, round_start 0, no
    update awaiting a receipt), the server sends it round 1's round_start alone on
    ``down/dev-a/round_start`` naming only it, dev-a trains: round 1 closes with both updates
    (``resent_to`` [dev-a], one ask and one round_start re-sent, in ``metrics.jsonl`` as in the
    server's metrics). dev-b, and dev-a in round 2, whose round_starts arrive, send nothing extra:
    their messages are exactly online, join, then per round the global's receipt and the update,
    then offline."""
    hub = memory_hub
    hub.drop_deliveries(lambda client, m: client == "dev-a" and m.topic == topics.down(FED, Kind.ROUND_START)
                        and decode(m.payload).envelope.round == 1)
    devices = {cid: Device(FedAvgClient(), digits.train.x[40 * i:40 * i + 40], digits.train.y[40 * i:40 * i + 40])
               for i, cid in enumerate(("dev-a", "dev-b"))}
    server = federation_server(tmp_path, hub, FedAvg(train_config={"lr": 0.05}), digits.test, rounds=2, clients=2,
                               quorum=2)
    agents, threads, errors = start_agents(hub, devices)
    a, b = agents
    a.round_start_wait_s = 1.0  # dev-b keeps the default
    assert b.round_start_wait_s == ROUND_START_WAIT_S
    summary = server.run()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert summary.rounds_completed == 2
    # the broker dropped exactly the one delivery
    assert [(cid, m.topic, decode(m.payload).envelope.round) for cid, m in hub.dropped] == [
        ("dev-a", topics.down(FED, Kind.ROUND_START), 1)]
    # the ask: one online naming round 1's global and no round_start of it
    asks = [s for s in _statuses(hub, "dev-a") if s.state == "online" and s.holds != (0, 0, 0)]
    assert [s.holds for s in asks] == [(1, 0, 0)] and "no round_start of round 1" in asks[0].detail
    assert (a.round_start_asks, b.round_start_asks) == ({1: 1}, {})
    # the answer: round 1's round_start on dev-a's own topic, naming only dev-a; none to dev-b
    answers = [decode(m.payload).envelope for m in hub.published if m.topic == topics.down_to(FED, "dev-a",
                                                                                              Kind.ROUND_START)]
    assert [(e.round, e.body.selected, e.body.members) for e in answers] == [(1, ("dev-a",), b"")]
    assert 0 < answers[0].body.deadline_s <= 60
    assert not [m for m in hub.published if m.topic == topics.down_to(FED, "dev-b", Kind.ROUND_START)]
    # both trained both rounds
    assert (a.rounds_trained, b.rounds_trained) == (2, 2)
    lines = [(m["skipped"], m["clients_reported"], m["resent_to"], m["round_start_asks"], m["round_start_resends"])
             for m in server.metrics]
    assert lines == [(False, 2, ["dev-a"], {"dev-a": 1}, {"dev-a": 1}), (False, 2, [], {}, {})]
    # nothing extra from a device whose round_start arrived
    normal = [("status", 0), ("join", 0), ("receipt", 1), ("update", 1), ("receipt", 2), ("update", 2), ("status", 0)]
    assert _kinds(hub, "dev-b") == normal
    assert [s.state for s in _statuses(hub, "dev-b")] == ["online", "offline"]
    assert _kinds(hub, "dev-a") == normal[:2] + [("receipt", 1), ("status", 0)] + normal[3:]
    # what the ask and the answer cost on the wire (payload bytes), said in the test's output
    ask_bytes = [len(m.payload) for m in hub.published if m.sender == "dev-a" and m.topic == topics.status(FED, "dev-a")
                 and decode(m.payload).envelope.body.holds == (1, 0, 0)]
    answer_bytes = [len(m.payload) for m in hub.published
                    if m.topic == topics.down_to(FED, "dev-a", Kind.ROUND_START)]
    print(f"ask {ask_bytes} B, answer {answer_bytes} B (payloads)")
    assert len(ask_bytes) == len(answer_bytes) == 1


class _SilentServer:
    """A server that sends round 1's global (``down/global``) and a round_start that the broker
    drops for every device, answers joins, and never answers anything else."""

    def __init__(self, hub: MemoryBroker) -> None:
        self.transport = hub.connect("server")
        self.channel = Channel(self.transport, node_id="server", side="server", federation=FED, ledger=None)
        self.transport.subscribe(topics.server_filters(FED))

    def answer_join(self) -> str:
        while True:
            item = self.channel.receive(30.0)
            assert item is not None, "no join came"
            if isinstance(item, Received) and isinstance(item.envelope.body, Join):
                env = item.envelope
                self.channel.send(topics.down_to(FED, env.sender, Kind.RECEIPT),
                                  Receipt(ref_kind=int(Kind.JOIN), ref_seq=env.seq, accepted=True), round=0,
                                  recipient=env.sender)
                return env.sender


def _agent(hub: MemoryBroker, digits, cid: str = "dev-a") -> EdgeAgent:
    model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
    return EdgeAgent(channel=Channel(hub.connect(cid), node_id=cid, side="agent", federation=FED, ledger=None),
                     model=model, algorithm=FedAvgClient(), x=digits.train.x[:20], y=digits.train.y[:20],
                     num_classes=10, train_defaults=TrainConfig(local_epochs=1, batch_size=16), idle_timeout_s=60,
                     round_start_wait_s=0.2)


@contextlib.contextmanager
def _agent_given_global_of_round_1(hub: MemoryBroker, digits, selected: tuple[str, ...]) -> Iterator[EdgeAgent]:
    """A running agent ``dev-a`` whose join :class:`_SilentServer` answered, sent round 1's
    global and a broadcast round_start selecting ``selected``; stopped on exit."""
    server = _SilentServer(hub)
    agent = _agent(hub, digits)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        server.answer_join()
        wait_for(lambda: agent.joined, 30)
        model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
        server.channel.send(topics.down(FED, Kind.GLOBAL), Global(tensors=tuple(state_arrays(model))), round=1)
        server.channel.send(topics.down(FED, Kind.ROUND_START), RoundStart(selected, 60.0), round=1)
        yield agent
    finally:
        agent.stop()
        thread.join(10)


def test_asks_stop_after_the_limit_when_nothing_answers(digits, memory_hub) -> None:
    """Nothing answers (every round_start is dropped): the agent asks
    :data:`~edge_agent.agent.MAX_ROUND_START_ASKS` times for round 1, each time naming the
    global of round 1 and no round_start, then no more; it trains nothing."""
    hub = memory_hub
    hub.drop_deliveries(lambda client, m: m.topic.endswith("/round_start"))
    with _agent_given_global_of_round_1(hub, digits, ("dev-a",)) as agent:
        assert wait_for(lambda: agent.round_start_asks.get(1) == MAX_ROUND_START_ASKS, 30)
        time.sleep(8 * agent.round_start_wait_s)  # the next ask would be due after 8 waits more
        asks = [s for s in _statuses(hub, "dev-a") if s.state == "online" and s.holds == (1, 0, 0)]
        assert len(asks) == MAX_ROUND_START_ASKS == 3 and agent.round_start_asks == {1: 3}
        assert agent.rounds_trained == 0


def test_no_ask_with_the_round_start_of_the_round_held_even_naming_others(digits, memory_hub) -> None:
    """The round_start of round 1 arrives but selects another device: the agent holds a
    round_start of its global's round, so it does not ask; nothing but its online, its join and
    the global's receipt."""
    hub = memory_hub
    with _agent_given_global_of_round_1(hub, digits, ("dev-z",)) as agent:
        assert wait_for(lambda: any(m.sender == "dev-a" and m.topic.endswith("/receipt") for m in hub.published), 30)
        time.sleep(8 * agent.round_start_wait_s)  # two asks would be due by now
        assert agent.round_start_asks == {}
        assert _kinds(hub, "dev-a") == [("status", 0), ("join", 0), ("receipt", 1)]
