"""Training slots (edge_agent.slots) and the agents that train on them: work runs on the slots'
own threads; each slot thread builds one working model per architecture; an agent whose algorithm
borrows a model keeps only its private state entries; a federation trained on slots is
bit-identical to the same federation whose agents train their own models on their own threads;
agents that received the same global payload share one decoded copy."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest
import torch
from helpers.memory_federation import Device, digits_model, run_federation

from broker_server.strategies import get_strategy
from edge_agent.agent import AgentError, EdgeAgent, shared_global
from edge_agent.algorithms import TrainConfig, get_client_algorithm, private_entries
from edge_agent.slots import SlotsClosed, TrainingSlots
from protocol.channel import Channel
from protocol.memory_transport import MemoryBroker


def test_work_runs_on_the_slots_threads_and_returns_or_raises() -> None:
    with TrainingSlots(2, name="slot-test") as slots:
        names = {slots.run(lambda: threading.current_thread().name) for _ in range(6)}
        assert len(names) <= 2 and all(n.startswith("slot-test") for n in names)
        assert threading.current_thread().name not in names
        assert slots.run(lambda: 6 * 7) == 42

        def boom() -> None:
            raise ValueError("bad hyperparameter")

        with pytest.raises(ValueError, match="bad hyperparameter"):
            slots.run(boom)
    with pytest.raises(SlotsClosed):
        slots.run(lambda: 1)


def test_a_slot_thread_builds_one_working_model_per_architecture_copied_from_the_template() -> None:
    template = digits_model()
    with TrainingSlots(1) as slots:
        slots.offer_template("lightcnn", template)
        slots.offer_template("lightcnn", digits_model())  # a second offer for the key is not kept
        assert slots.template("lightcnn") is template
        first = slots.run(lambda: slots.working_model("lightcnn"))
        again = slots.run(lambda: slots.working_model("lightcnn"))
        assert first is again and first is not template and slots.models_built == 1
        assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), template.state_dict().values(),
                                                     strict=True))
        with pytest.raises(RuntimeError, match="slots' own threads"):
            slots.working_model("lightcnn")  # not from the caller's thread: it could be in training


def _agent(algorithm: str, slots: TrainingSlots | None, x: np.ndarray, y: np.ndarray,
           indices: np.ndarray | None = None) -> EdgeAgent:
    hub = MemoryBroker()
    return EdgeAgent(channel=Channel(hub.connect("dev-a"), node_id="dev-a", side="agent", federation="mem",
                                     ledger=None), model=digits_model(), algorithm=get_client_algorithm(algorithm),
                     x=x, y=y, indices=indices, num_classes=10, train_defaults=TrainConfig(), slots=slots,
                     info={"model": "lightcnn"})


def test_an_agent_on_slots_keeps_only_the_entries_the_global_does_not_overwrite(digits) -> None:
    reference = digits_model().state_dict()
    head = [n for n in reference if not n.startswith("backbone.")]
    assert head == ["classifier.weight", "classifier.bias"]
    rows = np.arange(0, 300, 3)  # not one run of rows: the shard is gathered per round, never kept
    with TrainingSlots(1) as slots:
        fedavg = _agent("fedavg", slots, digits.train.x, digits.train.y, rows)
        assert fedavg.borrows_model and fedavg._private == {}  # no model held between rounds
        assert np.shares_memory(fedavg.x.numpy(), digits.train.x)  # the shared data set, not a copy
        assert fedavg.y.tolist() == digits.train.y[rows].tolist()
        with pytest.raises(AgentError, match="keep_model"):
            _ = fedavg.model
        fedper = _agent("fedper", slots, digits.train.x, digits.train.y, rows)
        assert list(fedper._private) == head == list(private_entries(digits_model(), "backbone"))
        assert all(torch.equal(fedper._private[n], reference[n]) for n in head)
        fedproto = _agent("fedproto", slots, digits.train.x, digits.train.y, rows)  # share = "none": all private
        rebuilt = fedproto.model.state_dict()
        assert list(rebuilt) == list(reference) and all(torch.equal(rebuilt[n], reference[n]) for n in reference)
    own = _agent("fedavg", None, digits.train.x, digits.train.y, rows)  # a real device: its own model
    assert not own.borrows_model and isinstance(own.model, torch.nn.Module)


def _devices(digits, algorithm: str) -> dict[str, Device]:
    sizes = {"dev-a": 40, "dev-b": 60, "dev-c": 50}
    devices, start = {}, 0
    for cid, n in sizes.items():
        devices[cid] = Device(get_client_algorithm(algorithm), digits.train.x[start:start + n],
                              digits.train.y[start:start + n])
        start += n
    return devices


@pytest.mark.parametrize("algorithm", ["fedavg", "fedper", "scaffold"])
def test_a_federation_on_slots_trains_bit_identically_to_agents_with_their_own_models(tmp_path, digits,
                                                                                      algorithm) -> None:
    """The reference: each agent trains its own model on its own thread (a real device's way).
    On two slots, with borrowed models and private entries only, the server's model after two
    rounds and every device's own model are the same to the bit."""
    own_agents: list[EdgeAgent] = []
    own = run_federation(tmp_path / "own", MemoryBroker(), get_strategy(algorithm, train_config={"lr": 0.05}),
                         _devices(digits, algorithm), digits.test, rounds=2, quorum=3, agents_out=own_agents)
    slot_agents: list[EdgeAgent] = []
    with TrainingSlots(2) as slots:
        lent = run_federation(tmp_path / "slots", MemoryBroker(), get_strategy(algorithm, train_config={"lr": 0.05}),
                              _devices(digits, algorithm), digits.test, rounds=2, quorum=3, slots=slots,
                              agents_out=slot_agents)
        assert all(a.borrows_model for a in slot_agents) and slots.models_built <= 2
        assert all(a._global is not None and a._global[1].tensors == () for a in slot_agents)  # dropped once trained
        for a, b in zip(own_agents, slot_agents, strict=True):
            if algorithm == "fedper":  # the private head is all a FedPer device keeps: it equals the own model's
                mine = a.model.state_dict()
                assert all(torch.equal(mine[n], t) for n, t in b._private.items()) and len(b._private) == 2
    ref, got = own.model.state_dict(), lent.model.state_dict()
    assert list(ref) == list(got) and all(torch.equal(ref[n], got[n]) for n in ref)
    assert [m["accuracy"] for m in own.metrics] == [m["accuracy"] for m in lent.metrics]


def test_agents_that_received_the_same_global_payload_share_one_read_only_copy() -> None:
    payload = b"the same broadcast"
    digest = hashlib.sha256(payload).digest()
    a = shared_global(digest, (np.arange(4, dtype=np.float32),), {"protos": np.ones((2, 3), np.float32)})
    b = shared_global(digest, (np.zeros(4, dtype=np.float32),), {})  # a second agent's own decode: dropped
    assert b is a and a.tensors[0].tolist() == [0.0, 1.0, 2.0, 3.0] and not a.tensors[0].flags.writeable
    assert not a.extras["protos"].flags.writeable
    other = shared_global(hashlib.sha256(b"a per-device copy").digest(), (np.zeros(4, np.float32),), {})
    assert other is not a and other.tensors[0].tolist() == [0.0] * 4


def test_a_holder_keeps_a_slot_so_no_training_runs_beside_it():
    """With one slot, work done on the calling thread inside ``with slots.holder():`` and a
    training submitted meanwhile never run at once: the training starts only after the block."""
    import threading

    from edge_agent.slots import SlotsClosed, TrainingSlots

    slots = TrainingSlots(1)
    hold = slots.holder()
    order: list[str] = []
    with hold:
        order.append("hold start")
        t = threading.Thread(target=lambda: slots.run(lambda: order.append("training")))
        t.start()
        t.join(0.3)  # the training cannot have started: the only slot is held
        order.append("hold end")
    t.join(10)
    with hold:  # reusable
        order.append("hold again")
    assert order == ["hold start", "hold end", "training", "hold again"]
    slots.close()
    try:
        with hold:
            raise AssertionError("entered a holder of closed slots")
    except SlotsClosed:
        pass
