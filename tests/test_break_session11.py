"""Break-it session 11: SCAFFOLD/FedDyn commit-on-receipt (server and device state kept equal).

Each test states the defect it found; the invariant is the one of
``broker_server/strategies/scaffold.py`` / ``feddyn.py`` ("Dropped updates"): the server's c (h)
is the mean over the N clients of the state each device has committed.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from test_chaos import incoming, memory_server, receipts_to, update_payload
from test_scaffold_resync import TOL, Fleet, _cfg, _gap, _server_state, _size

from broker_server.server import AggregationServer
from broker_server.simulate import simulate
from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol.messages import Kind
from protocol.transport import Incoming


def test_copy_of_a_counted_update_arriving_after_the_deadline_is_acknowledged(tmp_path: Path) -> None:
    """Defect: ``_on_update`` tested "arrived after the deadline" before "already counted" while
    the round was still open (the server drains what arrived before the deadline, and a copy
    can arrive meanwhile). A copy of an update the round had already counted (an agent's resend
    after a lost receipt, a QoS 1 redelivery) was answered *refused*, so the device rolled its
    SCAFFOLD/FedDyn state back although the server had counted it (c no longer the mean of the
    c_i). The answer must be the one the round already gave: accepted, a duplicate, never late."""
    torch_model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    like = list(state_arrays(torch_model))
    rng = np.random.default_rng(0)
    fed = "mem"
    feed: deque[Incoming] = deque()
    srv = memory_server(tmp_path, model=torch_model, clients=["client-a", "client-b"], rounds=1,
                        feed=lambda: feed.popleft() if feed else None, fed=fed)
    a1 = update_payload(fed, "client-a", 1, 2, like, rng)
    after_deadline = time.monotonic() + 10 * srv.settings.round_deadline_s
    feed.extend([incoming(*a1),
                 Incoming(a1[0], a1[1], 1, False, after_deadline),  # the same update again, late
                 incoming(*update_payload(fed, "client-b", 1, 2, like, rng))])
    m1 = srv.run_round(1)
    assert m1["clients_reported"] == 2 and not m1["skipped"]
    answers = [b for r, b in receipts_to(srv.channel.transport, "client-a") if r == 1 and b.ref_kind == Kind.UPDATE]
    assert len(answers) == 2 and answers[0].accepted
    assert answers[1].accepted, f"the copy of a counted update was answered: {answers[1].reason!r}"
    assert (srv.totals["late"], srv.totals["duplicates"]) == (0, 1)
    assert (m1["late"], m1["duplicates"]) == (0, 1)


def _crash_and_resume_before_checkpoint(monkeypatch: pytest.MonkeyPatch, crash_round: int) -> None:
    """Emulate ``kill -9`` of the server after round ``crash_round``'s updates were accepted and
    acknowledged but before that round's checkpoint, then ``fedfleet server --resume`` with the
    agents still running: the server's state goes back to the checkpoint of the round before
    (as :meth:`AggregationServer.resume` of a fresh process loads it; a fresh process also has
    no memory of whom it counted), the agents' retained ``online`` statuses mark them online,
    and the run loop runs ``crash_round`` again. (With real processes, see the report: the
    resumed round got 0 updates, the devices had all 3 acknowledged.)"""
    real = AggregationServer._checkpoint
    crashed: list[bool] = []

    def checkpoint(self: AggregationServer, accuracy) -> None:
        if self.round == crash_round and not crashed:
            crashed.append(True)
            self.resume(self.checkpoints.load(crash_round - 1))
            self._counted.clear()
            for rec in self.registry.values():
                rec.online = True
            return
        real(self, accuracy)

    monkeypatch.setattr(AggregationServer, "_checkpoint", checkpoint)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["scaffold", "feddyn"])
def test_server_resumed_mid_round_keeps_the_devices_committed_state(tmp_path: Path, monkeypatch,
                                                                    algorithm: str) -> None:
    """Defect: the server dies during round 2 after accepting (and acknowledging) every update,
    before its checkpoint of round 2; the resumed server runs round 2 again from the checkpoint
    of round 1. The devices had committed their round-2 c_i / ∇L_k on the accepted receipts and
    ignored the re-sent round 2 (already trained), so the resumed round got no update, was
    skipped, and the server's c / h lacked every device's round-2 change for the rest of the run
    (gap ≈ 8e-3 for c, measured). A device whose last update was not refused sends it again
    when its round is started again: the same server answers "duplicate: already counted", a
    resumed one counts it, and c / h is again the mean of the committed device states."""
    _crash_and_resume_before_checkpoint(monkeypatch, 2)
    fleet = Fleet()
    cfg = _cfg(algorithm, clients=3, quorum=2, rounds=3).replace("server", round_deadline_s=10.0)
    res = simulate(cfg, run_dir=tmp_path / "run", agent_hook=fleet)
    m = res.metrics
    assert [x["round"] for x in m] == [1, 2, 3]
    # the resumed round 2 is made of the devices' counted round-2 updates, sent again
    assert [x["clients_reported"] for x in m] == [3, 3, 3] and not any(x["skipped"] for x in m)
    assert all(a.pending_round is None for a in fleet.algs.values())
    size = _size(fleet)
    assert np.abs(fleet.mean_committed(2, size) - fleet.mean_committed(1, size)).max() > 1e-4  # round 2 moved them
    gaps = [_gap(res.run_dir, algorithm, fleet, r, size) for r in (1, 2, 3)]
    assert max(gaps) < TOL, gaps
    server2, n = _server_state(res.run_dir, algorithm, 2)
    assert n == 3
    np.testing.assert_allclose(server2, fleet.mean_committed(2, size), atol=TOL)
