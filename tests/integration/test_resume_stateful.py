"""kill -9 and ``--resume`` of the stateful strategies: the resumed server continues from the
checkpoint's strategy state, checked against the messages a spy saw on the broker.

- SCAFFOLD's c, FedPAD's global prototypes, FedMCP's teacher: the resumed round-2 global
  carries exactly the extras the checkpoint's state yields;
- FedAdam: m_2 = β1·m_1 + (1−β1)·Δ_2 from the checkpoint's m_1 and the resumed round's updates;
- FedDyn: h_2 = h_1 − (α/N)·Σ_i (w_i − w_g) from the checkpoint's h_1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.checkpoints import checkpoint_round, kill_when
from helpers.federation import Spy, small_config
from helpers.federation import read_metrics as _metrics
from helpers.federation import read_summary as _summary

from broker_server.checkpoint import CheckpointStore
from broker_server.embedded_broker import EmbeddedBroker
from broker_server.runtime import make_strategy
from broker_server.simulate import DEVICE_STATE_FILE, simulate
from edge_agent.algorithms.fedcross import flatten_state
from edge_agent.data import load_dataset
from protocol.errors import ProtocolError
from protocol.messages import decode

pytestmark = pytest.mark.slow


def _kill_and_resume(tmp_path: Path, cfg, *, kill_after: int = 1, agent_hook=None, drop_device_state: bool = False):
    """Run ``fedfleet simulate`` in a subprocess against a broker of this process, SIGKILL it once
    its checkpoint of round ``kill_after`` is written, then ``simulate(..., resume=True)`` here
    with a spy on the broker. Returns (result, checkpoint at the kill, the spied messages of the
    resumed session, the run folder). A subprocess that ends before that checkpoint fails the
    test with its log; one that never writes it is stopped by pytest-timeout. ``agent_hook`` goes
    to the resumed ``simulate``; ``drop_device_state`` deletes the devices' state file before
    the resume (a run folder of a version that kept none)."""
    repo = Path(__file__).resolve().parents[2]
    toml = tmp_path / "cfg.toml"
    toml.write_text(cfg.to_toml(), encoding="utf-8")
    run = tmp_path / "run"
    with EmbeddedBroker(kind="amqtt", workdir=tmp_path / "broker") as broker:
        log = open(tmp_path / "crashed.log", "wb")
        p = subprocess.Popen([sys.executable, "-m", "broker_server.cli", "simulate", "--config", str(toml), "--out",
                              str(run), "--broker", broker.url, "-q"], cwd=repo, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, "FEDFLEET_OFFLINE": "1"})
        log.close()
        kill_when(p, lambda: checkpoint_round(run / "checkpoints.sqlite") >= kill_after, tmp_path / "crashed.log")
        store = CheckpointStore(run / "checkpoints.sqlite")
        ckpt = store.load()
        store.close()
        if drop_device_state:
            for f in run.glob(DEVICE_STATE_FILE + "*"):  # with its WAL
                f.unlink()
        spy = Spy(broker.host, broker.port)
        try:
            res = simulate(cfg, broker_url=broker.url, run_dir=run, resume=True, agent_hook=agent_hook)
            time.sleep(0.3)
        finally:
            spy.close()
    msgs = []
    for topic, payload, _ in spy.messages:
        if payload:
            try:
                msgs.append((topic, decode(payload).envelope))
            except ProtocolError:
                pass
    return res, ckpt, msgs, run


def _resume_cfg(name: str, **over):
    sections = {"run": {"rounds": 2}, "data": {"clients": 2}, "train": {"algorithm": name},
                # rounds start once both agents joined; a wide join window for a loaded machine (no agent had
                # joined a resumed run within the default 60 s there)
                "server": {"quorum": 2, "round_deadline_s": 30.0, "join_timeout_s": 300.0}}
    for k, v in over.items():
        sections.setdefault(k, {}).update(v)
    return small_config(**sections)


def _globals(msgs, rnd):
    return [env.body for _, env in msgs if type(env.body).__name__ == "Global" and env.round == rnd]


#: what the devices of each algorithm keep between rounds: kept in the run folder's device state
#: file, so a resumed simulation carries on from it; lost only where that file is gone
#: (summary.json's device_state_restarted; none for the algorithms whose devices keep nothing)
DEVICE_STATE = {"scaffold": ["its control variate c_i"], "feddyn": ["its gradient state ∇L_k"],
                "fedmcp": ["its whole model (share = 'none': nothing of it leaves the device)"]}


def _check_resumed(res, ckpt, run, algorithm: str = "", *, rounds: int = 2, dropped: bool = False):
    assert ckpt.round >= 1
    assert res.rounds_completed == rounds
    assert [m["round"] for m in _metrics(run)] == list(range(1, rounds + 1))
    summary = _summary(run)
    assert summary["agent_errors"] == []
    assert all(m["clients_reported"] == 2 and not m["skipped"] for m in _metrics(run))
    # the devices kept their state in the run folder until the run finished its rounds
    assert not (run / DEVICE_STATE_FILE).exists()
    # lost only when that file was gone: said in summary.json, naming the devices (a run killed
    # after its last round is finished without devices: nothing restarted)
    lost = DEVICE_STATE.get(algorithm) if ckpt.round < rounds and dropped else None
    assert summary.get("device_state_restarted") == (
        {"after_rounds": [ckpt.round], "state": lost, "devices": ["client-000", "client-001"]} if lost else None)
    # the server heard it too: devices it had counted updates of joined again announcing no kept state
    assert summary.get("devices_rejoined_without_state") == (
        {"client-000": ckpt.round, "client-001": ckpt.round} if lost else None)


def _flat(state) -> np.ndarray:
    """c_i (an array) or ∇L_k (a list of tensors) as one float64 vector."""
    if isinstance(state, np.ndarray):
        return state.astype(np.float64).reshape(-1)
    return np.concatenate([np.asarray(t.detach().cpu() if isinstance(t, torch.Tensor) else t, np.float64).reshape(-1)
                           for t in state])


def test_resumed_feddyn_devices_carry_on_from_their_kept_state_and_h_continues(tmp_path: Path) -> None:
    """FedDyn, kill -9 after round 1's checkpoint of a 3-round run; the resumed devices carry on
    from their state file, so at the end the server's h is still the mean of the devices'
    committed ∇L_k, as in an uninterrupted run (module docstring of
    broker_server/strategies/feddyn.py; SCAFFOLD's c is checked with real agent processes in
    test_real_fleet.py). Devices restarted from zeros would leave the server's state holding
    their pre-kill contributions: the gap was 9e-3 (SCAFFOLD) against 1e-6. The resumed round's
    h is h_c+1 = h_c − (α/N)·Σ_i (w_i − w_g) from the checkpoint's h_c and the updates the spy
    saw."""
    agents = {}
    res, ckpt, msgs, run = _kill_and_resume(tmp_path, _resume_cfg("feddyn", run={"rounds": 3}),
                                            agent_hook=lambda i, a: agents.setdefault(i, a))
    _check_resumed(res, ckpt, run, "feddyn", rounds=3)
    if ckpt.round >= 3:
        pytest.skip(reason="the server was killed after the last round: no device was restarted")
    # each device carried on from its state as of the checkpoint's round, or of the round after it
    # (accepted before the kill, not yet aggregated: rolled back when the server ran it again), or
    # took the update it sent in the checkpoint's round as accepted (killed before it read the answer)
    carried = {a.client_id: max(a.restored_round, a.taken_as_accepted or 0) for a in agents.values()}
    assert all(r in (ckpt.round, ckpt.round + 1) for r in carried.values()), carried
    summary = _summary(run)
    assert {c: max(r, summary["device_state_taken_as_accepted"].get(c, 0))
            for c, r in summary["device_state_restored"].items()} == carried
    store = CheckpointStore(run / "checkpoints.sqlite")
    resumed, final = store.load(ckpt.round + 1).strategy_state, store.load(3).strategy_state
    store.close()
    assert int(final["clients_seen"]) == len(agents) == 2
    server = _flat(final["h"])
    mean = np.mean([_flat(a.algorithm.committed_state) for a in agents.values()], axis=0)
    assert np.abs(server).max() > 1e-4  # a state worth checking
    np.testing.assert_allclose(server, mean, rtol=0, atol=1e-6)
    # the resumed round's h from the checkpoint's
    ups = [env.body for _, env in msgs if type(env.body).__name__ == "Update" and env.round == ckpt.round + 1]
    assert len(ups) == 2
    alpha, n = 0.01, resumed["clients_seen"]
    for i, (h1, h2) in enumerate(zip(ckpt.strategy_state["h"], resumed["h"], strict=True)):
        step = sum(np.asarray(u.tensors[i], np.float64) - ckpt.tensors[i] for u in ups)
        np.testing.assert_allclose(h2, h1 - alpha / n * step, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("algorithm,over,extras", [
    ("scaffold", {}, ("control",)),
    ("fedpad", {}, ("prototypes", "proto_classes")),
    ("fedmcp", {"algorithm": {"proxy_size": 100}, "server": {"client_eval": True, "client_eval_max": 50}},
     ("teacher_soft_predictions", "teacher_prototypes")),
])
def test_resume_broadcasts_the_restored_state(tmp_path: Path, algorithm: str, over: dict, extras: tuple) -> None:
    """kill -9 after round 1's checkpoint; the resumed server's round-2 global carries exactly the
    strategy state of that checkpoint (SCAFFOLD c, FedPAD's global prototypes, FedMCP's teacher)."""
    dropped = algorithm == "fedmcp"  # its devices' state file gone: the restart is said out loud
    res, ckpt, msgs, run = _kill_and_resume(tmp_path, _resume_cfg(algorithm, **over), drop_device_state=dropped)
    _check_resumed(res, ckpt, run, algorithm, dropped=dropped)
    if ckpt.round >= 2:
        pytest.skip(reason="the server was killed after the last round: there is no round-2 global to check")
    g = _globals(msgs, 2)
    assert g, "no round-2 global seen"

    s = make_strategy(_resume_cfg(algorithm, **over), load_dataset("digits"))
    s.load_state_dict(ckpt.strategy_state)
    want = s.global_extras()
    assert set(want) == set(extras) and set(g[-1].extras) == set(extras)
    for name in extras:
        np.testing.assert_array_equal(g[-1].extras[name], want[name])


def test_resume_sends_each_device_its_restored_fedcross_model(tmp_path: Path) -> None:
    """FedCross, three devices, M = 2 middleware models (two devices a round, so ``auto`` sends
    each its own global): kill -9 after round 1's checkpoint; in the resumed round 2 each selected
    device's copy on ``down/{client}/global`` carries exactly the checkpoint's middleware model of
    its ``cross_slot`` and no extras, the third device gets no global, only the round_start naming
    nobody."""
    cfg = _resume_cfg("fedcross", data={"clients": 3}, algorithm={"models": 2})
    res, ckpt, msgs, run = _kill_and_resume(tmp_path, cfg)
    _check_resumed(res, ckpt, run, "fedcross")
    if ckpt.round >= 2:
        pytest.skip(reason="the server was killed after the last round: there is no round-2 global to check")
    assert [m["global_delivery"] for m in _metrics(run)] == ["per_device"] * 2
    slots = {t.split("/")[-2]: int(env.body.instructions["cross_slot"]) for t, env in msgs
             if type(env.body).__name__ == "RoundStart" and env.round == 2 and env.body.instructions}
    assert sorted(slots.values()) == [0, 1]
    copies = {t.split("/")[-2]: env.body for t, env in msgs if type(env.body).__name__ == "Global" and env.round == 2}
    assert set(copies) == set(slots)  # the unselected device got none
    idle = [env.body for t, env in msgs if t.endswith("/down/round_start") and env.round == 2]
    assert idle and all(b.selected == () and not b.members for b in idle)
    for c, slot in slots.items():
        assert dict(copies[c].extras) == {}
        np.testing.assert_array_equal(flatten_state(copies[c].tensors), ckpt.strategy_state["middleware"][slot])


def test_resume_fedadam_keeps_its_moments(tmp_path: Path) -> None:
    """FedAdam after kill -9 + resume: the step count and the moments continue from the checkpoint
    (m_2 = β1·m_1 + (1−β1)·Δ_2 with Δ_2 from the resumed round's updates)."""
    res, ckpt, msgs, run = _kill_and_resume(tmp_path, _resume_cfg("fedadam"))
    _check_resumed(res, ckpt, run, "fedadam")
    store = CheckpointStore(run / "checkpoints.sqlite")
    final = store.load(2).strategy_state
    store.close()
    assert final["steps"] == 2 and ckpt.strategy_state["steps"] == ckpt.round
    if ckpt.round == 1:
        ups = {env.sender: env.body for _, env in msgs if type(env.body).__name__ == "Update" and env.round == 2}
        n = sum(u.num_samples for u in ups.values())
        mean = [sum(u.num_samples * np.asarray(u.tensors[i], np.float64) for u in ups.values()) / n
                for i in range(len(ckpt.tensors))]
        delta = [m - np.asarray(w, np.float64) for m, w in zip(mean, ckpt.tensors, strict=True)]
        m2 = [0.9 * m1 + 0.1 * d for m1, d in zip(ckpt.strategy_state["m"], delta, strict=True)]
        for a, b in zip(m2, final["m"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)


def test_resumed_fedavg_devices_carry_on_their_error_feedback_residuals(tmp_path: Path) -> None:
    """FedAvg keeps nothing between rounds but, under top-k with error feedback, what its codec
    held back: a killed simulation's devices kept it in the run folder's state file, and each
    resumed device's first update adds exactly the residual that file held for the round it
    carried on from (its newest settled one, or an update it took as accepted), not zeros; the
    run ends on every round as before."""
    from edge_agent.state_store import DeviceStateStore

    agents: dict = {}
    kept: dict = {}
    first: dict = {}  # device → the residuals its first resumed update started from

    def hook(i, agent):
        agents.setdefault(i, agent)
        if not kept:  # the file as the killed run left it, read before any resumed device writes to it
            store = DeviceStateStore(tmp_path / "run" / DEVICE_STATE_FILE)
            for c in ("client-000", "client-001"):
                kept[c] = {r: store.newest(c, before=r + 1) for r in range(1, 4)}
                unsettled = store.newest(c, settled=False)
                if unsettled is not None:
                    kept[c][("unsettled", unsettled[0])] = unsettled
            store.close()
        encode = agent._encode_update

        def wrapped(config, tensors, global_tensors, **kw):
            ef = agent.error_feedback
            first.setdefault(agent.client_id, {} if ef is None else ef.state_dict())
            return encode(config, tensors, global_tensors, **kw)

        agent._encode_update = wrapped

    cfg = _resume_cfg("fedavg", run={"rounds": 3}, protocol={"update_codec": "topk:0.1", "error_feedback": True})
    res, ckpt, _, run = _kill_and_resume(tmp_path, cfg, agent_hook=hook)
    _check_resumed(res, ckpt, run, rounds=3)
    if ckpt.round >= 3:
        pytest.skip(reason="the server was killed after the last round: no device was restarted")
    assert len(agents) == 2 and len(first) == 2  # both devices restarted, and each sent an update
    for a in agents.values():
        taken = a.taken_as_accepted
        assert a.restored_round is not None or taken is not None
        row = (kept[a.client_id][("unsettled", taken)] if taken is not None
               else kept[a.client_id][a.restored_round])
        assert row is not None and row[0] == (taken if taken is not None else a.restored_round) >= 1
        want = {int(k.removeprefix("ef.")): v for k, v in row[1].items() if k.startswith("ef.")}
        got = first[a.client_id]
        assert want and sorted(got) == sorted(want)
        assert sum(float(np.abs(v).sum()) for v in want.values()) > 0  # top-10 %: most of each update held back
        for i, v in want.items():
            np.testing.assert_array_equal(got[i], v)


def test_a_resumed_fleet_without_residuals_is_not_said_to_have_lost_them(tmp_path: Path) -> None:
    """error_feedback on with a lossless codec: no device ever holds a residual, so none has a
    row in the state file, and the resume says nothing was lost (a zero residual is its state)."""
    cfg = _resume_cfg("fedavg", run={"rounds": 3}, protocol={"update_codec": "fp32", "error_feedback": True})
    res, ckpt, _, run = _kill_and_resume(tmp_path, cfg)
    _check_resumed(res, ckpt, run, rounds=3)
    summary = _summary(run)
    assert summary.get("device_state_restarted") is None
    assert summary.get("devices_rejoined_without_state") is None
