"""An agent's error-feedback residuals (``[protocol] error_feedback`` with a lossy update codec)
in its device state file: FedAvg keeps nothing else between rounds, so the file is opened when
the first residual appears; the residual kept is what the codec held back (the trained weights
minus what the server decodes), a restarted agent carries it on and adds it to its next update,
and a refused update's residual goes back with the state, in memory and on disk."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.one_agent import OneAgent
from helpers.waiting import wait_for

from edge_agent.algorithms.fedavg import FedAvgClient
from edge_agent.models import build_model
from edge_agent.state_store import DeviceStateStore
from protocol.tensors import Codec, ErrorFeedback

FED = "mem-ef"
DEV = "dev-ef"
EF = {"update_codec": "topk:0.1", "error_feedback": True}


class Federation(OneAgent):
    """One FedAvg agent (its state file at ``path``) on 40 images; each round's trained weights
    are kept in ``trained``."""

    def __init__(self, path) -> None:
        torch.manual_seed(0)
        alg = FedAvgClient()
        self.trained: dict[int, tuple[np.ndarray, ...]] = {}
        real = alg.local_round

        def local_round(model, *a, round: int, **kw):
            out = real(model, *a, round=round, **kw)
            self.trained[round] = tuple(np.array(t, copy=True) for t in out.tensors)
            return out

        alg.local_round = local_round  # type: ignore[method-assign]
        super().__init__(path, model=build_model("lightcnn", in_channels=1, image_size=8, num_classes=10),
                         algorithm=alg, fed=FED, device=DEV, samples=40)


def _sent(env) -> list[np.ndarray]:
    """What the server decodes from an update (float32 arrays)."""
    return [np.asarray(t) for t in env.body.tensors]


def _kept(store: DeviceStateStore, **kw) -> dict[int, np.ndarray]:
    row = store.newest(DEV, **kw)
    assert row is not None
    return {int(k.removeprefix("ef.")): v for k, v in row[1].items() if k.startswith("ef.")}


def test_a_codec_without_error_feedback_keeps_no_state_file_rows(tmp_path) -> None:
    f = Federation(tmp_path / "s.sqlite")
    up = f.round(1, {"update_codec": "topk:0.1"})
    f.answer(up, True)
    assert wait_for(lambda: f.agent.receipts_accepted == 1)
    assert f.store.rounds(DEV) == [] and f.store.unsettled(DEV) is None and f.agent.state_store is None
    f.close()


def test_the_kept_residual_is_what_the_codec_held_back_and_a_restart_carries_it_on(tmp_path) -> None:
    path = tmp_path / "s.sqlite"
    f = Federation(path)
    up1 = f.round(1, EF)
    x1, sent1 = f.trained[1], _sent(up1)
    # top-10 %: most of each weight tensor is held back; e1 = x1 − C(x1) (no residual before round 1)
    e1 = [x - s for x, s in zip(x1, sent1, strict=True)]
    assert sum(int(np.count_nonzero(s)) for s in sent1) < 0.2 * sum(s.size for s in sent1)
    assert wait_for(lambda: f.store.unsettled(DEV) == 1)
    kept = _kept(f.store, settled=False)
    assert sorted(kept) == list(range(len(x1)))
    for i, e in enumerate(e1):
        np.testing.assert_allclose(kept[i], e, rtol=0, atol=1e-7)
    f.answer(up1, True)
    assert wait_for(lambda: f.store.rounds(DEV) == [0, 1] and f.store.unsettled(DEV) is None)
    assert _kept(f.store, settled=True).keys() == kept.keys()
    f.close()

    g = Federation(path)  # the device restarts: its residual is back before any round
    assert g.agent.restored_round == 1
    for i, e in enumerate(e1):
        np.testing.assert_allclose(g.agent.error_feedback.residual(i), e, rtol=0, atol=1e-7)
    up2 = g.round(2, EF)
    # round 2 sends C(x2 + e1): an independent error feedback given e1 compresses x2 to the same values
    ref = ErrorFeedback()
    ref.load_state_dict(dict(enumerate(np.asarray(e, dtype=np.float32) for e in _kept_after(path, 1))))
    codec = Codec.parse("topk:0.1")
    want = [ref.compress(i, x, codec)[1] for i, x in enumerate(g.trained[2])]
    for got, w in zip(_sent(up2), want, strict=True):
        np.testing.assert_array_equal(got, w)
    g.close()


def _kept_after(path, rnd: int) -> list[np.ndarray]:
    store = DeviceStateStore(path)
    try:
        row = store.newest(DEV, before=rnd + 1)
        assert row is not None and row[0] == rnd
        return [row[1][f"ef.{i}"] for i in range(sum(k.startswith("ef.") for k in row[1]))]
    finally:
        store.close()


def test_a_refused_update_puts_the_residual_back(tmp_path) -> None:
    f = Federation(tmp_path / "s.sqlite")
    up1 = f.round(1, EF)
    f.answer(up1, True)
    assert wait_for(lambda: f.store.rounds(DEV) == [0, 1])
    e1 = {i: f.agent.error_feedback.residual(i) for i in range(len(f.trained[1]))}
    up2 = f.round(2, EF)
    assert wait_for(lambda: f.store.unsettled(DEV) == 2)
    assert any(not np.array_equal(f.agent.error_feedback.residual(i), e1[i]) for i in e1)  # round 2 moved it
    f.answer(up2, False)
    assert wait_for(lambda: f.store.unsettled(DEV) is None)
    assert f.store.rounds(DEV) == [0, 1]
    for i, e in e1.items():  # back to round 1's, in memory and in the newest settled row
        np.testing.assert_array_equal(f.agent.error_feedback.residual(i), e)
        np.testing.assert_array_equal(_kept(f.store)[i], e)
    f.close()


def test_rows_of_an_earlier_run_without_residuals_are_dropped_when_the_first_one_is_kept(tmp_path) -> None:
    """The file holds rounds 3 and 4 of an earlier run under the same federation id that kept no
    residual: the agent opens it at its first error-feedback round, drops them and keeps this
    run's rounds (the old ones, newer by number, would otherwise have pruned them as they settle)."""
    store = DeviceStateStore(tmp_path / "s.sqlite")
    for r in (0, 3, 4):
        store.put(DEV, r, {})
    store.close()
    f = Federation(tmp_path / "s.sqlite")
    assert f.agent.state_store is None and f.agent.restored_round is None  # nothing of value kept
    for r in (1, 2):
        f.answer(f.round(r, EF), True)
        assert wait_for(lambda r=r: f.store.rounds(DEV) == list(range(r + 1)))
    assert sorted(_kept(f.store)) == list(range(len(f.trained[2])))
    f.close()


@pytest.mark.parametrize("other", ["shape", "dtype"])
def test_residuals_of_another_model_are_said_and_start_afresh(tmp_path, caplog, other: str) -> None:
    """A kept residual of another model's shapes or precision (a run of another architecture
    under the same federation id): the device carries on from that row, and at its first
    error-feedback round says in the log that the residuals fit another model, naming the file,
    and starts them at zero; its update still goes out, and the residual kept afterwards is this
    model's."""
    path = tmp_path / "s.sqlite"
    first = next(iter(build_model("lightcnn", in_channels=1, image_size=8, num_classes=10).state_dict().values()))
    kept_residual = (np.ones((3, 3), np.float32) if other == "shape"
                     else np.ones(tuple(first.shape), np.float64))  # this model's shape, another dtype
    store = DeviceStateStore(path)
    store.put(DEV, 0, {})
    store.put(DEV, 1, {"ef.0": kept_residual})
    store.close()
    f = Federation(path)
    assert f.agent.restored_round == 1
    with caplog.at_level("ERROR", logger="edge_agent.agent"):
        up = f.round(2, EF)
    said = [r.getMessage() for r in caplog.records if "fit another model" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0]
    assert f"kept {kept_residual.shape} {kept_residual.dtype}" in said[0]
    # what the server decodes is C(x2): no residual was added
    codec = Codec.parse("topk:0.1")
    want = [ErrorFeedback().compress(i, x, codec)[1] for i, x in enumerate(f.trained[2])]
    for got, w in zip(_sent(up), want, strict=True):
        np.testing.assert_array_equal(got, w)
    assert wait_for(lambda: f.store.unsettled(DEV) == 2)
    kept = _kept(f.store, settled=False)
    assert [kept[i].shape for i in sorted(kept)] == [x.shape for x in f.trained[2]]
    f.close()
