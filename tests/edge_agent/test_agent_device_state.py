"""An agent with a device state file (edge_agent/state_store.py), SCAFFOLD over an in-memory
broker: the state after a round is written unsettled when its update goes out and settled by
the receipt (dropped on a refusal); a restarted agent carries on from its newest settled state,
takes an update whose answer it never read as accepted when the server has gone past that round,
drops it when the server runs that round again, and goes back to an older state when the
server's round is not newer than the one it holds."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.one_agent import OneAgent
from helpers.waiting import wait_for

from edge_agent.algorithms.scaffold import ScaffoldClient
from edge_agent.models import build_model
from edge_agent.state_store import DeviceStateStore

FED = "mem"
DEV = "dev-s"


class Federation(OneAgent):
    """One SCAFFOLD agent (its store at ``path``) and a server channel on a memory broker; the
    algorithm's c_i at the start of each local round is recorded in ``control_at_start``."""

    def __init__(self, path) -> None:
        alg = ScaffoldClient()
        self.control_at_start: dict[int, np.ndarray | None] = {}
        real = alg.local_round

        def local_round(*a, round: int, **kw):
            self.control_at_start[round] = None if alg.control is None else alg.control.copy()
            return real(*a, round=round, **kw)

        alg.local_round = local_round  # type: ignore[method-assign]
        super().__init__(path, model=build_model("lightcnn", in_channels=1, image_size=8, num_classes=10),
                         algorithm=alg, fed=FED, device=DEV)


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
    assert f.store.rounds(DEV) == {3: [0, 1, 2], 2: [0, 1], 1: [0]}[next_round]  # round 0 and the newest KEEP = 2
    assert f.store.unsettled(DEV) == next_round
    f.close()


def test_a_new_run_under_the_same_federation_id_goes_back_to_the_initial_state(tmp_path) -> None:
    """Rows of rounds 4 and 5 of an earlier run under the same federation id (its agent --out
    reused): the new run's round 1 sends the device back to its initial state (round 0's row,
    which is never pruned) and forgets the old rows."""
    p = sum(t.numel() for t in build_model("lightcnn", in_channels=1, image_size=8, num_classes=10).parameters())
    store = DeviceStateStore(tmp_path / "s.sqlite")
    store.put(DEV, 0, {})
    for r in (3, 4, 5):
        store.put(DEV, r, {"control": np.full(p, float(r))})
    assert store.rounds(DEV) == [0, 4, 5]
    store.close()
    f = Federation(tmp_path / "s.sqlite")
    assert f.agent.restored_round == 5
    f.round(1)
    assert f.control_at_start[1] is None  # zeros: the initial state, not the old run's c_i
    assert f.agent.restored_round == 0 and f.store.rounds(DEV) == [0] and f.store.unsettled(DEV) == 1
    f.close()


def test_an_unread_answer_is_dropped_when_the_server_runs_that_round_without_the_device(tmp_path) -> None:
    """The device stopped holding an unsettled update of round 2; the resumed server runs round 2
    again without it (so that update was never counted), then selects it for round 3: it trains
    round 3 from its settled state of round 1, and takes nothing as accepted."""
    p = sum(t.numel() for t in build_model("lightcnn", in_channels=1, image_size=8, num_classes=10).parameters())
    c1, c2 = np.full(p, 1.0), np.full(p, 2.0)
    store = DeviceStateStore(tmp_path / "s.sqlite")
    store.put(DEV, 0, {})
    store.put(DEV, 1, {"control": c1})
    store.put(DEV, 2, {"control": c2}, settled=False)
    store.close()
    f = Federation(tmp_path / "s.sqlite")
    f.round_without_it(2)
    assert wait_for(lambda: f.store.unsettled(DEV) is None)  # dropped: round 2 runs again
    f.round(3)
    np.testing.assert_array_equal(f.control_at_start[3], c1)
    assert f.agent.taken_as_accepted is None
    f.close()


def test_a_state_file_that_fails_mid_run_is_said_and_the_device_goes_on(tmp_path, monkeypatch) -> None:
    """The state file stops taking writes (a full disk): the agent logs it, keeps the reason in
    state_store_error and goes on training with its state in memory (its update still goes out)."""
    from edge_agent.state_store import StateStoreError

    f = Federation(tmp_path / "s.sqlite")

    def full(*a, **kw):
        raise StateStoreError(f"device state file {f.store.path}: cannot be written (database or disk is full)")

    monkeypatch.setattr(f.store, "put", full)
    up = f.round(1)
    assert up.round == 1
    assert f.agent.state_store is None and "disk is full" in f.agent.state_store_error
    f.answer(up, True)  # settled in memory only: nothing raises
    assert wait_for(lambda: f.alg.pending_round is None)
    f.close()


def test_a_kept_state_of_another_model_is_refused_at_start_naming_the_file(tmp_path) -> None:
    """A c_i kept for a model with other parameters (another architecture wrote the file): the
    agent refuses to start, naming the file and both sizes, instead of resetting it silently."""
    from edge_agent.agent import AgentError

    store = DeviceStateStore(tmp_path / "s.sqlite")
    store.put(DEV, 0, {})
    store.put(DEV, 1, {"control": np.zeros(7)})
    store.close()
    with pytest.raises(AgentError, match=r"round 1 \(.*s\.sqlite\): the kept c_i has 7 entries, this model \d+"):
        Federation(tmp_path / "s.sqlite")
