"""The device state file (edge_agent/state_store.py): rows per device and round, the newest
before a round, the newest KEEP kept, arrays back bit for bit, and a damaged or foreign row
refused without running anything; and each algorithm's device state written and read back
(SCAFFOLD's committed c_i, FedDyn's ∇L_k, MOON's previous model)."""

from __future__ import annotations

import copy
import io
import pickle
import sqlite3

import numpy as np
import pytest
import torch

from edge_agent.algorithms import TrainConfig
from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.algorithms.feddyn import FedDynClient
from edge_agent.algorithms.moon import MoonClient
from edge_agent.algorithms.scaffold import ScaffoldClient
from edge_agent.models import build_model
from edge_agent.state import state_arrays
from edge_agent.state_store import KEEP, DeviceStateStore, StateStoreError


def test_rows_per_device_and_round_the_newest_before_a_round_and_the_newest_kept(tmp_path) -> None:
    store = DeviceStateStore(tmp_path / "s.sqlite")
    a = {"control": np.arange(5, dtype=np.float64) / 7, "model.head.weight": np.ones((2, 3), np.float32)}
    for r in range(KEEP + 2):
        store.put("client-000", r, {k: v + r for k, v in a.items()})
    store.put("client-001", 4, {"x": np.array([1, 2], np.int64)})
    assert store.rounds("client-000") == [0, *range(2, KEEP + 2)]  # the initial state and the newest KEEP
    rnd, got = store.newest("client-000")
    assert rnd == KEEP + 1
    for k, v in a.items():
        assert got[k].dtype == v.dtype
        np.testing.assert_array_equal(got[k], v + (KEEP + 1))  # bit for bit
    assert store.newest("client-000", before=KEEP + 1)[0] == KEEP
    assert store.newest("client-000", before=2)[0] == 0  # round 1's is gone, the initial state stays
    assert store.newest("client-000", before=0) is None
    assert store.newest("client-002") is None
    store.close()
    again = DeviceStateStore(tmp_path / "s.sqlite")  # on disk: a restarted process reads it
    np.testing.assert_array_equal(again.newest("client-001")[1]["x"], [1, 2])
    again.put("client-001", 5, {"x": np.array([3], np.int64)}, settled=False)  # sent, not yet answered
    assert again.unsettled("client-001") == 5 and again.rounds("client-001") == [4]
    np.testing.assert_array_equal(again.newest("client-001", settled=False)[1]["x"], [3])
    again.settle("client-001", 5, True)
    assert again.unsettled("client-001") is None and again.rounds("client-001") == [4, 5]
    again.put("client-001", 6, {"x": np.array([4], np.int64)}, settled=False)
    again.settle("client-001", 6, False)  # refused: dropped
    assert again.unsettled("client-001") is None and again.rounds("client-001") == [4, 5]
    again.put("client-001", 3, {}, settled=False)  # older than a settled row: not an unread answer
    assert again.unsettled("client-001") is None
    again.forget_from("client-001", 5)  # a server runs round 5 again
    assert again.rounds("client-001") == [4] and again.newest("client-001", settled=False)[0] == 3
    again.clear()
    assert again.rounds("client-001") == []
    again.close()


def test_bad_rows_and_files_are_refused_and_nothing_in_them_runs(tmp_path) -> None:
    store = DeviceStateStore(tmp_path / "s.sqlite")
    with pytest.raises(ValueError, match="object array"):
        store.put("c", 1, {"x": np.array([object()], dtype=object)})
    with pytest.raises(ValueError, match="round must be >= 0"):
        store.put("c", -1, {})
    ran: list[int] = []

    class Payload:
        def __reduce__(self):
            return (ran.append, (1,))

    npz = io.BytesIO()
    np.savez(npz, allow_pickle=True, x=np.array([Payload()], dtype=object))  # an npz whose array is a pickle
    for blob in (npz.getvalue(), pickle.dumps({"x": Payload()}), b"cut sh"):
        db = sqlite3.connect(tmp_path / "s.sqlite")
        db.execute("INSERT OR REPLACE INTO device_state VALUES ('c', 2, ?, 1)", (blob,))
        db.commit()
        db.close()
        with pytest.raises(StateStoreError, match="c's state of round 2 cannot be read"):
            store.newest("c")
    assert ran == []
    store.close()
    (tmp_path / "not.sqlite").write_bytes(b"this is no SQLite file at all" * 100)
    with pytest.raises(StateStoreError, match="cannot be opened"):
        DeviceStateStore(tmp_path / "not.sqlite")


def test_a_file_that_cannot_be_written_is_refused_when_it_is_opened(tmp_path, monkeypatch) -> None:
    """A read-only state file is said when the store opens, not at the first round's update
    (root ignores file modes: SQLite's read-only open stands in for them)."""
    path = tmp_path / "s.sqlite"
    DeviceStateStore(path).close()
    real = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda p, **kw: real(f"file:{p}?mode=ro", uri=True, **kw))
    with pytest.raises(StateStoreError, match=r"s\.sqlite: cannot be (written|opened)"):
        DeviceStateStore(path)


def _round(alg, model, seed: int, rnd: int):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
    glob = state_arrays(model)
    return alg.local_round(model, glob, x, y, TrainConfig(local_epochs=1, batch_size=8, lr=0.1, seed=seed),
                           round=rnd, client_index=0, device=torch.device("cpu"))


def _model():
    torch.manual_seed(0)
    return build_model("lightcnn", in_channels=1, image_size=8, num_classes=10)


@pytest.mark.parametrize("cls", [ScaffoldClient, FedDynClient])
def test_the_committed_state_is_written_not_the_one_awaiting_its_answer(cls) -> None:
    """Round 1 accepted, round 2 trained but unanswered: the arrays are round 1's state; a fresh
    device loaded with them holds exactly that state, committed; refused, a device goes back to it."""
    alg, model = cls(), _model()
    assert alg.device_state_arrays() == {}  # nothing before round 1
    _round(alg, model, 1, 1)
    alg.on_update_receipt(1, True)
    after1 = {k: v.copy() for k, v in alg.device_state_arrays().items()}
    _round(alg, model, 2, 2)
    now = alg.state_to_arrays(getattr(alg, alg.state_attr))
    assert any(not np.array_equal(now[k], after1[k]) for k in after1)  # round 2 changed the state …
    for k, v in alg.device_state_arrays().items():  # … but round 1's is the committed one
        np.testing.assert_array_equal(v, after1[k])
    fresh = cls()
    fresh.load_device_state_arrays(after1)
    assert fresh.pending_round is None
    for k, v in fresh.device_state_arrays().items():
        np.testing.assert_array_equal(v, after1[k])
        assert v.dtype == after1[k].dtype
    fresh.load_device_state_arrays({})
    assert fresh.committed_state is None
    with pytest.raises(ValueError):
        fresh.load_device_state_arrays({"something_else": np.zeros(3)})


def test_moon_rebuilds_its_previous_model_from_the_kept_entries() -> None:
    """A MOON device whose previous model comes back from the arrays trains its next round
    exactly as the device that kept it in memory (same loss, same resulting weights)."""
    alg, model = MoonClient(), _model()
    _round(alg, model, 1, 1)
    kept = alg.device_state_arrays()
    assert set(kept) == {f"previous.{k}" for k in model.state_dict()}
    restarted, model2 = MoonClient(), copy.deepcopy(model)
    restarted.load_device_state_arrays(kept)
    assert restarted.device_state_arrays().keys() == kept.keys()  # kept again before it is rebuilt
    a = _round(alg, model, 2, 2)
    b = _round(restarted, model2, 2, 2)
    assert a.train_loss == b.train_loss
    for x, y in zip(a.tensors, b.tensors, strict=True):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="previous"):
        restarted.load_device_state_arrays({"control": np.zeros(2)})


def test_an_algorithm_without_device_state_keeps_nothing() -> None:
    alg = FedAvgClient()
    assert alg.device_state_arrays() == {} and FedAvgClient.keeps_device_state_on_disk()
    alg.load_device_state_arrays({})
    with pytest.raises(ValueError, match="keeps no device state"):
        alg.load_device_state_arrays({"x": np.zeros(1)})
