"""Training slots (edge_agent.slots) and the agents that train on them: work runs on the slots'
own threads; each slot thread builds one working model per architecture; an agent whose algorithm
borrows a model keeps only its private state entries; a federation trained on slots is
bit-identical to the same federation whose agents train their own models on their own threads;
agents that received the same global payload share one decoded copy."""

from __future__ import annotations

import hashlib
import os
import signal
import threading

import numpy as np
import pytest
import torch
from helpers.memory_federation import Device, digits_model, run_federation

import edge_agent.slots as S
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


def _queue_behind_a_gate(slots: TrainingSlots, costs: list[tuple[str, float]],
                         order: list[str]) -> tuple[threading.Event, list[threading.Thread]]:
    """Occupy the only slot with a gated task, then submit ``costs`` (name, cost) one after
    another from their own threads, each waiting in the queue before the next is submitted;
    returns the gate (set it to let the queue run) and the submitting threads."""
    gate, started = threading.Event(), threading.Event()

    def gated() -> None:
        started.set()
        gate.wait()

    threading.Thread(target=lambda: slots.run(gated), daemon=True).start()
    assert started.wait(10)
    threads = []
    for name, cost in costs:
        waiting_before = len(slots._queue)
        threads.append(threading.Thread(target=lambda n=name, c=cost: slots.run(lambda: order.append(n), cost=c),
                                        daemon=True))
        threads[-1].start()
        while len(slots._queue) == waiting_before:  # the submit has reached the queue
            threading.Event().wait(0.001)
    return gate, threads


def test_the_costliest_waiting_training_runs_first_and_equal_costs_in_arrival_order() -> None:
    """Longest processing time first: queued costs 5, 11, 2, 11, 7 (arrival a..e) run as b, d
    (the two 11s in arrival order), e, a, c."""
    slots = TrainingSlots(1)
    order: list[str] = []
    gate, threads = _queue_behind_a_gate(slots, [("a", 5), ("b", 11), ("c", 2), ("d", 11), ("e", 7)], order)
    gate.set()
    for t in threads:
        t.join(10)
    slots.close()
    assert order == ["b", "d", "e", "a", "c"]


def test_a_holder_goes_before_every_waiting_training() -> None:
    """The evaluation's hold is queued after three trainings of cost 100 but takes the slot first."""
    slots = TrainingSlots(1)
    order: list[str] = []
    gate, threads = _queue_behind_a_gate(slots, [("t1", 100), ("t2", 100), ("t3", 100)], order)
    held = threading.Event()

    def hold() -> None:
        with slots.holder():
            order.append("hold")
        held.set()

    threading.Thread(target=hold, daemon=True).start()
    while len(slots._queue) < 4:
        threading.Event().wait(0.001)
    gate.set()
    assert held.wait(10)
    for t in threads:
        t.join(10)
    slots.close()
    assert order == ["hold", "t1", "t2", "t3"]


def test_closing_refuses_the_waiting_trainings_and_lets_the_running_one_finish() -> None:
    slots = TrainingSlots(1)
    order: list[str] = []
    outcomes: list[str] = []
    gate, _ = _queue_behind_a_gate(slots, [], order)

    def waiting() -> None:
        try:
            slots.run(lambda: order.append("never"))
            outcomes.append("ran")
        except SlotsClosed:
            outcomes.append("refused")

    t = threading.Thread(target=waiting)
    t.start()
    while len(slots._queue) < 1:
        threading.Event().wait(0.001)
    closer = threading.Thread(target=slots.close)
    closer.start()
    gate.set()  # the running task ends; close() returns once it has
    closer.join(10)
    t.join(10)
    assert not closer.is_alive() and outcomes == ["refused"] and order == []
    assert all(not th.is_alive() for th in slots._threads)


def test_a_hold_interrupted_while_it_waits_leaves_no_slot_held_and_close_returns() -> None:
    """Ctrl-C (SIGINT on the main thread) while the evaluation waits for the only slot, busy with
    a training: the KeyboardInterrupt reaches the holder, and the hold it had queued never keeps
    a slot: the training after it still runs, and ``close()`` returns (before, the queued hold
    took the slot once the training ended and waited for a release that no one would give, so
    ``close()``, which a run's cleanup calls, never returned)."""
    slots = TrainingSlots(1)
    order: list[str] = []
    gate, threads = _queue_behind_a_gate(slots, [], order)

    def interrupt_once_queued() -> None:
        while len(slots._queue) < 1:  # the hold waits in the queue
            threading.Event().wait(0.001)
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_once_queued, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            with slots.holder():
                order.append("held")  # never: interrupted before a slot came free
    finally:
        signal.signal(signal.SIGINT, previous)
    gate.set()
    after = threading.Thread(target=lambda: slots.run(lambda: order.append("after")), daemon=True)
    after.start()
    after.join(10)
    closer = threading.Thread(target=slots.close, daemon=True)
    closer.start()
    closer.join(10)
    assert order == ["after"] and not closer.is_alive()


def test_a_training_hands_its_freed_heap_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each training on a slot ends with one ``malloc_trim(0)``, also when it raised."""
    calls: list[int] = []
    monkeypatch.setattr(S, "_MALLOC_TRIM", lambda pad: calls.append(pad) or 1)
    with TrainingSlots(1) as slots:
        slots.run(lambda: None)
        with pytest.raises(ValueError):
            slots.run(lambda: (_ for _ in ()).throw(ValueError("x")))
    assert calls == [0, 0]


@pytest.mark.skipif(S._MALLOC_TRIM is None, reason="no malloc_trim in this C library (not glibc)")
def test_malloc_trim_returns_freed_heap_pages() -> None:
    """On glibc the real call returns the pages of 64 MiB of freed heap blocks that a live block
    above them keeps from being trimmed by free() itself: RSS drops by at least 48 MiB."""
    S.release_free_heap()

    def rss_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    blocks = [bytearray(64 * 1024) for _ in range(1024)]  # below the mmap threshold: on the heap
    for b in blocks:
        b[::4096] = b"\x01" * len(b[::4096])  # touch every page
    pin = bytearray(1024)  # a live block above them
    before = rss_mib()
    del blocks
    assert S.release_free_heap() is True
    assert before - rss_mib() >= 48, (before, rss_mib())
    del pin
