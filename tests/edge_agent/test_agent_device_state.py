"""An agent with a device state file (edge_agent/state_store.py), SCAFFOLD over an in-memory
broker: the state after a round is written unsettled when its update goes out and settled by
the receipt (dropped on a refusal); a restarted agent carries on from its newest settled state,
takes an update whose answer it never read as accepted when the server has gone past that round,
drops it when the server runs that round again, and goes back to an older state when the
server's round is not newer than the one it holds."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers.waiting import wait_for

from edge_agent.agent import EdgeAgent
from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.scaffold import ScaffoldClient
from edge_agent.models import build_model
from edge_agent.state import state_arrays
from edge_agent.state_store import DeviceStateStore
from protocol import topics
from protocol.channel import Channel
from protocol.memory_transport import MemoryBroker
from protocol.messages import Finish, Global, Kind, Receipt, RoundStart, Update, decode

FED = "mem"
DEV = "dev-s"


class Federation:
    """One SCAFFOLD agent (its store at ``path``) and a server channel on a memory broker; the
    algorithm's c_i at the start of each local round is recorded in ``control_at_start``."""

    def __init__(self, path) -> None:
        self.hub = MemoryBroker()
        self.model = build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)
        self.alg = ScaffoldClient()
        self.control_at_start: dict[int, np.ndarray | None] = {}
        real = self.alg.local_round

        def local_round(*a, round: int, **kw):
            self.control_at_start[round] = None if self.alg.control is None else self.alg.control.copy()
            return real(*a, round=round, **kw)

        self.alg.local_round = local_round  # type: ignore[method-assign]
        rng = np.random.default_rng(0)
        self.store = DeviceStateStore(path)
        self.agent = EdgeAgent(channel=Channel(self.hub.connect(DEV), node_id=DEV, side="agent", federation=FED,
                                               ledger=None),
                               model=self.model, algorithm=self.alg,
                               x=rng.standard_normal((20, 1, 8, 8)).astype(np.float32), y=rng.integers(0, 10, 20),
                               num_classes=10, idle_timeout_s=120, train_defaults=TrainConfig(batch_size=10),
                               state_store=self.store)
        self.server = Channel(self.hub.connect("server"), node_id="server", side="server", federation=FED,
                              ledger=None)
        self.server.transport.subscribe(topics.server_filters(FED))
        self.thread = threading.Thread(target=self.agent.run, daemon=True)
        self.thread.start()

    def updates(self) -> list:
        envs = [decode(m.payload).envelope for m in self.hub.published if m.topic.startswith(f"fedfleet/v1/{FED}/up")]
        return [e for e in envs if isinstance(e.body, Update)]

    def round(self, rnd: int) -> object:
        """Start round ``rnd`` for the device and wait for its update (the envelope)."""
        n = len(self.updates())
        self.server.send(topics.down(FED, Kind.GLOBAL), Global(tensors=state_arrays(self.model),
                         meta={"manifest_hash": self.agent.manifest_hash}), round=rnd)
        self.server.send(topics.down(FED, Kind.ROUND_START), RoundStart(selected=(DEV,), deadline_s=600.0, config={}),
                         round=rnd)
        assert wait_for(lambda: len(self.updates()) > n)
        return self.updates()[-1]

    def answer(self, env, accepted: bool) -> None:
        self.server.send(topics.down_to(FED, DEV, Kind.RECEIPT), Receipt(ref_kind=int(Kind.UPDATE), ref_seq=env.seq,
                         accepted=accepted, reason="" if accepted else "refused by the test"), round=env.round,
                         recipient=DEV)

    def close(self) -> None:
        self.server.send(topics.down(FED, Kind.FINISH), Finish(reason="completed", rounds_completed=9), round=9)
        self.thread.join(60)
        self.store.close()


def test_the_state_is_written_with_the_update_and_settled_by_its_answer(tmp_path) -> None:
    f = Federation(tmp_path / "s.sqlite")
    assert f.store.rounds(DEV) == [0]  # the initial state
    up1 = f.round(1)
    unsettled = f.store.newest(DEV, settled=False)
    assert unsettled[0] == 1 and f.store.unsettled(DEV) == 1
    np.testing.assert_array_equal(unsettled[1]["control"], f.alg.control)  # the state this update goes with
    f.answer(up1, True)
    assert wait_for(lambda: f.store.rounds(DEV) == [0, 1])
    assert f.store.unsettled(DEV) is None
    np.testing.assert_array_equal(f.store.newest(DEV)[1]["control"], f.alg.committed_control)
    up2 = f.round(2)
    f.answer(up2, False)  # refused: its state is dropped, the device is back at round 1's
    assert wait_for(lambda: f.store.unsettled(DEV) is None and f.alg.pending_round is None)
    assert f.store.rounds(DEV) == [0, 1]
    np.testing.assert_array_equal(f.alg.control, f.store.newest(DEV)[1]["control"])
    f.close()


@pytest.mark.parametrize(("next_round", "start_state", "taken"), [
    (3, "unsettled 2", 2),   # the server finished round 2: the update whose answer was never read counts
    (2, "settled 1", None),  # the server runs round 2 again: that update's state is dropped
    (1, "settled 0", None),  # the server runs round 1 again: back to the state before it
])
def test_a_restarted_agent_carries_on_from_the_state_the_server_counted(tmp_path, next_round: int,
                                                                         start_state: str, taken) -> None:
    p = sum(t.numel() for t in build_model("lightcnn", in_channels=1, image_size=8, num_classes=10).parameters())
    rng = np.random.default_rng(1)
    c1, c2 = rng.standard_normal(p), rng.standard_normal(p)
    store = DeviceStateStore(tmp_path / "s.sqlite")  # what the device kept before it stopped
    store.put(DEV, 0, {})
    store.put(DEV, 1, {"control": c1})
    store.put(DEV, 2, {"control": c2}, settled=False)
    store.close()
    f = Federation(tmp_path / "s.sqlite")
    assert f.agent.restored_round == 1
    np.testing.assert_array_equal(f.alg.committed_control, c1)
    f.round(next_round)
    want = {"unsettled 2": c2, "settled 1": c1, "settled 0": None}[start_state]
    got = f.control_at_start[next_round]
    assert (got is None) if want is None else np.array_equal(got, want)
    assert f.agent.taken_as_accepted == taken
    # what is kept now: settled rows up to the state trained from (later ones are forgotten: the
    # server runs those rounds again), and this round's update, unsettled
    assert f.store.rounds(DEV) == {3: [1, 2], 2: [0, 1], 1: [0]}[next_round]  # the newest KEEP = 2
    assert f.store.unsettled(DEV) == next_round
    f.close()
