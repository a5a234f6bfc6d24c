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
from test_chaos import incoming, memory_server, receipts_to, update_payload

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
