"""What a device that comes back says it holds of the rounds decides what the server sends it
again, message by message on the in-process broker (``helpers.memory_server``).

A device's ``online`` carries (global_round, start_round, update_round)
(:attr:`protocol.messages.Status.holds`). While round 1 is open and waits for it, the server
sends it on its own topics the round's ``global`` only when it lacks it (with the round_start),
the ``round_start`` alone when it holds the global but not the round_start or its update of the
round awaits a receipt the server never gave, and nothing when it holds both; an update the
server counted gets its receipt again instead. A retained ``online`` the server never handled
(published while its own link was down) is taken up once. After the server's own reconnect the
round_start goes again to the devices it still awaits only, and the global to none of them that
say what they hold. Deadlines are 600 s: a round closes because it stopped waiting."""

from __future__ import annotations

import hashlib
import time
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from helpers.memory_server import incoming, memory_server, receipts_to, sent_on, status_payload, update_payload

from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol.messages import Kind, RoundStart
from protocol.transport_base import Incoming

FED = "mem"


def _model():
    model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    return model, list(state_arrays(model))


@pytest.mark.parametrize(("holds", "globals_", "starts"), [
    ((1, 1, 0), 0, 0),  # holds round 1's global and round_start: it trains, nothing to send
    ((0, 0, 0), 1, 1),  # holds nothing of round 1: both
    ((0, 1, 0), 1, 1),  # the round_start without the global: both (one small message more)
    ((1, 0, 0), 0, 1),  # the global without the round_start: the round_start alone
    ((1, 1, 1), 0, 1),  # trained, its update not counted: the round_start alone (it decides to send again)
    (None, 1, 1),  # an older agent that does not say: both, as before
], ids=["holds-both", "holds-nothing", "start-only", "global-only", "update-unanswered", "does-not-say"])
def test_online_gets_only_what_the_device_lacks(tmp_path: Path, holds, globals_: int, starts: int) -> None:
    model, like = _model()
    rng = np.random.default_rng(0)
    steps: deque = deque([lambda: incoming(*status_payload(FED, "client-a", "online", "reconnected", seq=7,
                                                           holds=holds)),
                          lambda: incoming(*update_payload(FED, "client-a", 1, 8, like, rng)),
                          lambda: incoming(*update_payload(FED, "client-b", 1, 2, like, rng))])
    srv = memory_server(tmp_path, model=model, clients=["client-a", "client-b"], rounds=1, fed=FED,
                        feed=lambda: steps.popleft()() if steps else None)
    m = srv.run_round(1)
    tr = srv.channel.transport
    assert len(sent_on(tr, "/down/client-a/global")) == globals_
    assert len(sent_on(tr, "/down/client-a/round_start")) == starts
    assert len(sent_on(tr, "/down/global")) == 1  # the round's broadcast, never again
    assert sent_on(tr, "/down/client-b/global") == sent_on(tr, "/down/client-b/round_start") == []
    assert m["clients_reported"] == 2 and m["resent_to"] == (["client-a"] if starts else [])
    for (start,) in [sent_on(tr, "/down/client-a/round_start")] if starts else []:
        assert isinstance(start.body, RoundStart) and start.body.selected == ("client-a",)
        assert 0 < start.body.deadline_s <= 600.0


def test_online_naming_a_counted_update_gets_its_receipt_again_not_the_round(tmp_path: Path) -> None:
    """A's update (seq 4) is counted and answered; A's link broke before the receipt reached it,
    and its ``online`` says round 1's update has no receipt: the server sends the receipt again
    (ref_seq 4, the SHA-256 of the payload it counted), and no global or round_start."""
    model, like = _model()
    rng = np.random.default_rng(1)
    a_update = update_payload(FED, "client-a", 1, 4, like, rng)
    steps: deque = deque([lambda: incoming(*a_update),
                          lambda: incoming(*status_payload(FED, "client-a", "online", "reconnected", seq=5,
                                                           holds=(1, 1, 1))),
                          lambda: incoming(*update_payload(FED, "client-b", 1, 2, like, rng))])
    srv = memory_server(tmp_path, model=model, clients=["client-a", "client-b"], rounds=1, fed=FED,
                        feed=lambda: steps.popleft()() if steps else None)
    m = srv.run_round(1)
    tr = srv.channel.transport
    answers = [b for _, b in receipts_to(tr, "client-a") if b.ref_kind == Kind.UPDATE]
    digest = hashlib.sha256(a_update[1]).digest()
    assert [(b.ref_seq, b.accepted, b.reason, b.sha256) for b in answers] == [(4, True, "", digest)] * 2
    assert sent_on(tr, "/down/client-a/global") == sent_on(tr, "/down/client-a/round_start") == []
    assert (m["clients_reported"], m["duplicates"], m["resent_to"]) == (2, 0, [])


def test_a_retained_online_the_server_never_handled_is_taken_up_once(tmp_path: Path) -> None:
    """A was back before the server after a broker restart: its ``online`` (holding nothing of
    round 1) reaches the server as a retained copy. The server never handled that payload, so it
    sends A the round (1 global, 1 round_start); the same retained payload handed over again (a
    second re-subscription) is a copy of one handled: nothing more. An older agent's retained
    ``online`` (no holdings) is taken for a copy, as before: B gets nothing."""
    model, like = _model()
    rng = np.random.default_rng(2)
    a_online = status_payload(FED, "client-a", "online", "reconnected", seq=3, holds=(0, 0, 0))
    b_online = status_payload(FED, "client-b", "online", "reconnected", seq=3)

    def retained(topic_payload):  # a scripted arrival (received_at in the future) is handed over as is
        return Incoming(topic_payload[0], topic_payload[1], 1, True, time.monotonic() + 1.0)

    steps: deque = deque([lambda: retained(a_online), lambda: retained(a_online), lambda: retained(b_online),
                          lambda: incoming(*update_payload(FED, "client-a", 1, 4, like, rng)),
                          lambda: incoming(*update_payload(FED, "client-b", 1, 2, like, rng))])
    srv = memory_server(tmp_path, model=model, clients=["client-a", "client-b"], rounds=1, fed=FED,
                        feed=lambda: steps.popleft()() if steps else None)
    m = srv.run_round(1)
    tr = srv.channel.transport
    assert (len(sent_on(tr, "/down/client-a/global")), len(sent_on(tr, "/down/client-a/round_start"))) == (1, 1)
    assert sent_on(tr, "/down/client-b/global") == sent_on(tr, "/down/client-b/round_start") == []
    assert m["clients_reported"] == 2 and m["resent_to"] == ["client-a"]


@pytest.mark.parametrize("c_says", [True, False], ids=["all-say", "c-does-not-say"])
def test_after_its_reconnect_the_server_names_only_the_devices_it_awaits(tmp_path: Path, c_says: bool) -> None:
    """Round 1 asks A, B and C; A's update is counted; B and C hold the round (B's ``online`` says
    so, and C's too, or C never said, as an older agent). The server's link breaks and comes
    back: it sends one broadcast ``round_start`` naming B and C only (A would otherwise send its
    counted update again), with the time left, and the global again only when an awaited device
    (C) does not say what it holds: 1 broadcast global in all, or 2."""
    model, like = _model()
    rng = np.random.default_rng(5)
    phase = [0]
    say = [c for c in ("client-b", "client-c") if c == "client-b" or c_says]
    steps: deque = deque([lambda: incoming(*update_payload(FED, "client-a", 1, 4, like, rng)),
                          *(lambda c=c: incoming(*status_payload(FED, c, "online", "", seq=1, holds=(1, 1, 0)))
                            for c in say)])

    def feed():
        if steps:
            return steps.popleft()()
        if phase[0] == 0:
            phase[0] = 1
            srv.channel.transport.drop_link()  # the server's link breaks and comes back: it re-sends
            return None
        if phase[0] == 1 and srv.resyncs == 1:
            phase[0] = 2
            return [incoming(*update_payload(FED, c, 1, 5, like, rng)) for c in ("client-b", "client-c")]
        return None

    srv = memory_server(tmp_path, model=model, clients=["client-a", "client-b", "client-c"], rounds=1, fed=FED,
                        feed=feed)
    m = srv.run_round(1)
    tr = srv.channel.transport
    assert srv.resyncs == 1
    starts = sent_on(tr, "/down/round_start")
    assert len(starts) == 2
    assert sorted(starts[0].body.selected) == ["client-a", "client-b", "client-c"]
    assert starts[1].body.selected == ("client-b", "client-c") and starts[1].body.members == b""
    assert 0 < starts[1].body.deadline_s <= 600.0
    assert len(sent_on(tr, "/down/global")) == (1 if c_says else 2)
    assert [t for t, _ in tr.sent if "/down/client-" in t and not t.endswith("/receipt")] == []
    assert (m["clients_reported"], m["duplicates"]) == (3, 0)
