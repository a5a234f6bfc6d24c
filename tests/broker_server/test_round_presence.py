"""The open round and the presence of its selected devices, message by message on the in-process
broker (``helpers.memory_server``): a device whose link dropped and that says ``online`` again
gets the round's ``global`` and ``round_start`` again, to it alone, and its update counts; a
device whose last will arrives and that does not return within the grace period is dropped, so
the round closes on the others' updates.

Deadlines are 600 s (far beyond pytest's timeout): a round that closes at all closed because it
stopped waiting, not because its deadline passed."""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from pathlib import Path

import numpy as np
from helpers.memory_server import (
    incoming,
    memory_server,
    receipts_to,
    sent_on,
    status_payload,
    update_payload,
)

from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol import topics
from protocol.messages import Envelope, Global, Kind, Receipt, RoundStart, encode
from protocol.transport_base import Incoming

FED = "mem"


def _model():
    model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    return model, list(state_arrays(model))


def _global_receipt(cid: str, payload: bytes, seq: int, env_seq: int) -> Incoming:
    """``cid`` confirms the global whose payload (as it arrived) is ``payload`` and whose seq is ``env_seq``."""
    body = Receipt(ref_kind=int(Kind.GLOBAL), ref_seq=env_seq, accepted=True, sha256=hashlib.sha256(payload).digest())
    payload_out = encode(Envelope(round=1, sender=cid, seq=seq, body=body)).payload
    return incoming(topics.up(FED, cid, Kind.RECEIPT), payload_out)


def test_a_round_short_of_its_quorum_waits_for_a_device_that_went_offline_to_come_back(tmp_path: Path,
                                                                                         caplog) -> None:
    """Quorum 2 of 2: round 1 both report; then B's last will arrives (``offline``) before round 2
    selects, and B is back (``online``) a moment later, while the server waits. Round 2 waits for
    it (at most offline_grace_s = 30 s from B's offline status), selects both and is not skipped.
    Before, round 2 selected A alone at once and was skipped (1 update < quorum 2) though B came
    back seconds later. A device gone longer than the grace is not waited for again: round 3,
    with B offline for good and its status older than the grace (set back by hand), starts at once
    with A alone and is skipped."""
    import dataclasses

    torch_model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    like = list(state_arrays(torch_model))
    rng = np.random.default_rng(0)
    fed = "mem"
    feed: deque = deque()

    def next_message():  # an update once its round is open (as a device sends it after its round_start)
        if not feed or (feed[0][0] and srv.open.collecting != feed[0][0]):
            return None
        return feed.popleft()[1]

    srv = memory_server(tmp_path, model=torch_model, clients=["client-a", "client-b"], rounds=3, feed=next_message,
                        fed=fed)
    srv.settings = dataclasses.replace(srv.settings, quorum=2)
    feed.extend([(1, incoming(*update_payload(fed, "client-a", 1, 2, like, rng))),
                 (1, incoming(*update_payload(fed, "client-b", 1, 2, like, rng)))])
    assert srv.run_round(1)["clients_reported"] == 2
    feed.append((0, incoming(*status_payload(fed, "client-b", "offline", "connection lost", seq=3))))
    srv._drain(until=lambda: not feed and "client-b" not in srv._online())
    srv._drain()
    assert srv._online() == ["client-a"]
    caplog.set_level(logging.INFO, logger="broker_server.server")
    feed.extend([(0, incoming(*status_payload(fed, "client-b", "online", "back", seq=4))),
                 (2, incoming(*update_payload(fed, "client-a", 2, 5, like, rng))),
                 (2, incoming(*update_payload(fed, "client-b", 2, 6, like, rng)))])
    m2 = srv.run_round(2)
    assert "round 2 waits up to" in caplog.text and "1 of 2 joined are online, the quorum is 2" in caplog.text
    assert (m2["clients_selected"], m2["clients_reported"], m2["skipped"]) == (2, 2, False)
    feed.append((0, incoming(*status_payload(fed, "client-b", "offline", "connection lost", seq=7))))
    srv._drain(until=lambda: not feed and "client-b" not in srv._online())
    srv._drain()
    srv.devices.get("client-b").last_seen -= 31.0  # offline for longer than the grace
    caplog.clear()
    feed.append((3, incoming(*update_payload(fed, "client-a", 3, 8, like, rng))))
    m3 = srv.run_round(3)
    assert "round 3 waits" not in caplog.text
    assert (m3["clients_selected"], m3["clients_reported"], m3["skipped"]) == (1, 1, True)


def test_device_back_online_mid_round_gets_the_round_again_alone_and_its_update_counts(tmp_path: Path) -> None:
    """Round 1 asks A and B. A's last will (offline) arrives, then A says online again
    ("reconnected"). The server sends A alone a copy of the round's global on
    ``down/client-a/global`` (same tensors as the broadcast) and a ``round_start`` on
    ``down/client-a/round_start`` naming only A, with the time left (0 < deadline_s ≤ 600) and
    the broadcast's config; nothing is broadcast again. A confirms its copy, B the broadcast
    (``global_receipts`` = 2 devices); both updates count and the round closes on them."""
    model, like = _model()
    rng = np.random.default_rng(0)
    steps: deque = deque([status_payload(FED, "client-a", "offline", "connection lost"),
                          status_payload(FED, "client-a", "online", "reconnected", seq=2)])
    answered = []

    def feed():
        if steps:
            return incoming(*steps.popleft())
        copies = [(t, p) for t, p in srv.channel.transport.sent if t.endswith("/down/client-a/global")]
        if copies and not answered:
            answered.append(1)
            (_, copy), = copies
            broadcast = next(p for t, p in srv.channel.transport.sent if t.endswith("/down/global"))
            return [_global_receipt("client-a", copy, 3, sent_on(srv.channel.transport, "/client-a/global")[0].seq),
                    _global_receipt("client-b", broadcast, 2, sent_on(srv.channel.transport, "/down/global")[0].seq),
                    incoming(*update_payload(FED, "client-b", 1, 3, like, rng)),
                    incoming(*update_payload(FED, "client-a", 1, 4, like, rng))]
        return None

    srv = memory_server(tmp_path, model=model, clients=["client-a", "client-b"], rounds=1, feed=feed, fed=FED)
    m = srv.run_round(1)
    tr = srv.channel.transport
    (bcast,) = sent_on(tr, "/down/global")
    (copy,) = sent_on(tr, "/down/client-a/global")
    assert sent_on(tr, "/down/client-b/global") == []
    assert isinstance(copy.body, Global) and copy.round == 1
    assert all(np.array_equal(a, b) for a, b in zip(copy.body.tensors, bcast.body.tensors, strict=True))
    (start_all,) = sent_on(tr, "/down/round_start")
    (start_a,) = sent_on(tr, "/down/client-a/round_start")
    assert isinstance(start_a.body, RoundStart) and isinstance(start_all.body, RoundStart)
    assert start_a.body.selected == ("client-a",)
    assert 0 < start_a.body.deadline_s <= 600.0
    assert dict(start_a.body.config) == dict(start_all.body.config)
    assert (m["clients_reported"], m["skipped"]) == (2, False)
    assert (m["resent_to"], m["dropped"], m["unreported"]) == (["client-a"], [], [])
    assert m["global_receipts"] == 2
    answers = [b for r, b in receipts_to(tr, "client-a") if b.ref_kind == Kind.UPDATE]
    assert [(a.ref_seq, a.accepted) for a in answers] == [(4, True)]


def test_last_will_not_followed_by_online_within_grace_drops_the_device(tmp_path: Path, caplog) -> None:
    """Round 1 asks A and B; B reports, A's last will arrives and A stays away. With a 0.2 s
    grace the round stops waiting for A and closes on B's update (quorum 1): 1 reported, not
    skipped, ``dropped`` = [A], and the log names A as dropped."""
    model, like = _model()
    rng = np.random.default_rng(1)
    steps: deque = deque([incoming(*update_payload(FED, "client-b", 1, 2, like, rng)),
                          incoming(*status_payload(FED, "client-a", "offline", "connection lost"))])
    srv = memory_server(tmp_path, model=model, clients=["client-a", "client-b"], rounds=1, fed=FED,
                        feed=lambda: steps.popleft() if steps else None, offline_grace_s=0.2)
    with caplog.at_level(logging.WARNING, logger="broker_server.server"):
        m = srv.run_round(1)
    assert (m["clients_reported"], m["skipped"], m["dropped"], m["unreported"]) == (1, False, ["client-a"], [])
    assert any("client-a dropped" in r.getMessage() for r in caplog.records)
    assert srv.refusal_totals()["dropped"] == {"1": ["client-a"]}


def test_update_of_a_dropped_device_that_arrives_before_the_close_still_counts(tmp_path: Path) -> None:
    """A is dropped (last will, 0.2 s grace) while B has not reported yet; A's update then
    arrives before B's: the round counts both, and A is not listed as dropped."""
    model, like = _model()
    rng = np.random.default_rng(2)
    t_will: list[float] = []
    a_update = update_payload(FED, "client-a", 1, 3, like, rng)
    b_update = update_payload(FED, "client-b", 1, 2, like, rng)

    def feed():
        if not t_will:
            t_will.append(time.monotonic())
            return incoming(*status_payload(FED, "client-a", "offline", "connection lost"))
        if "client-a" in srv.open.dropped and not srv.open.results:
            return incoming(*a_update)
        if srv.open.results and len(srv.open.results) == 1:
            return incoming(*b_update)
        return None

    srv = memory_server(tmp_path, model=model, clients=["client-a", "client-b"], rounds=1, fed=FED, feed=feed,
                        offline_grace_s=0.2)
    m = srv.run_round(1)
    assert (m["clients_reported"], m["dropped"]) == (2, [])


def test_online_from_a_device_that_reported_or_a_retained_copy_sends_nothing_again(tmp_path: Path) -> None:
    """A reports, then says online (a reconnect after its update): it needs nothing, so nothing is
    sent to it again. B's ``online`` arrives as a retained copy (what a server that re-subscribes
    after a reconnect gets for every device): no per-device copy either. B then reports."""
    model, like = _model()
    rng = np.random.default_rng(3)
    a_online = status_payload(FED, "client-a", "online", "reconnected", seq=5)
    b_online = status_payload(FED, "client-b", "online", "", seq=1)
    a_update, b_update = (update_payload(FED, c, 1, 2, like, rng) for c in ("client-a", "client-b"))
    steps: deque = deque([lambda: incoming(*a_update), lambda: incoming(*a_online),
                          # a scripted arrival (received_at in the future) is handed over as is: retained
                          lambda: Incoming(b_online[0], b_online[1], 1, True, time.monotonic() + 1.0),
                          lambda: incoming(*b_update)])
    srv = memory_server(tmp_path, model=model, clients=["client-a", "client-b"], rounds=1, fed=FED,
                        feed=lambda: steps.popleft()() if steps else None)
    m = srv.run_round(1)
    tr = srv.channel.transport
    assert m["clients_reported"] == 2 and m["resent_to"] == []
    assert [t for t, _ in tr.sent if "/down/client-" in t and not t.endswith("/receipt")] == []


def test_a_flapping_device_is_sent_the_round_at_most_max_round_resends_times(tmp_path: Path, caplog) -> None:
    """A's link flaps: five offline/online pairs arrive while round 1 waits for it. The server
    sends A its own copy of the round for the first MAX_ROUND_RESENDS (3) returns only — 3
    per-device globals and 3 per-device round_starts, counted by hand from the transport — says
    once that it stops, and the round still closes on A's and B's updates."""
    from broker_server.server import MAX_ROUND_RESENDS

    model, like = _model()
    rng = np.random.default_rng(4)
    flaps = [status_payload(FED, "client-a", state, detail, seq=seq)
             for i in range(5)
             for state, detail, seq in (("offline", "connection lost", 0), ("online", "reconnected", 10 + i))]
    steps: deque = deque([*(lambda p=p: incoming(*p) for p in flaps),
                          lambda: incoming(*update_payload(FED, "client-a", 1, 20, like, rng)),
                          lambda: incoming(*update_payload(FED, "client-b", 1, 2, like, rng))])
    srv = memory_server(tmp_path, model=model, clients=["client-a", "client-b"], rounds=1, fed=FED,
                        feed=lambda: steps.popleft()() if steps else None)
    with caplog.at_level(logging.WARNING, logger="broker_server.server"):
        m = srv.run_round(1)
    tr = srv.channel.transport
    assert MAX_ROUND_RESENDS == 3
    assert len(sent_on(tr, "/down/client-a/global")) == 3
    assert len(sent_on(tr, "/down/client-a/round_start")) == 3
    assert (m["clients_reported"], m["resent_to"]) == (2, ["client-a"])
    stops = [r for r in caplog.records if "nothing more is sent to it this round" in r.getMessage()]
    assert len(stops) == 1


def test_a_device_back_while_the_previous_round_is_evaluated_is_sent_the_time_left(tmp_path: Path) -> None:
    """Evaluation overlap: round 2's messages are out while round 1 is still being evaluated,
    and the messages that arrived meanwhile are handled before round 2 waits for updates. A's
    last will and its ``online`` come then: the round_start sent to A again carries the time
    left of round 2 (0 < deadline_s ≤ 600), not an infinite one, which every agent refuses as
    not finite (seen with a real agent restarted between rounds: its round closed at the
    deadline without it)."""
    model, like = _model()
    rng = np.random.default_rng(0)
    script: deque = deque([
        [incoming(*update_payload(FED, "client-a", 1, 3, like, rng)),
         incoming(*update_payload(FED, "client-b", 1, 3, like, rng))],
        "round 2 is out",
        [incoming(*status_payload(FED, "client-a", "offline", "connection lost")),
         incoming(*status_payload(FED, "client-a", "online", "reconnected", seq=5))],
        [incoming(*update_payload(FED, "client-a", 2, 6, like, rng)),
         incoming(*update_payload(FED, "client-b", 2, 6, like, rng))],
    ])

    def feed():
        if not script:
            return None
        if script[0] == "round 2 is out":  # held until round 2's round_start is on the wire
            if not sent_on(srv.channel.transport, "/down/round_start")[1:]:
                return None
            script.popleft()
        return script.popleft()

    srv = memory_server(tmp_path, model=model, clients=["client-a", "client-b"], rounds=2, feed=feed, fed=FED)
    pending = srv._run_round(1, previous=None, defer=True)
    m = srv._run_round(2, previous=pending, defer=False)
    (start_a,) = sent_on(srv.channel.transport, "/down/client-a/round_start")
    assert start_a.round == 2 and start_a.body.selected == ("client-a",)
    assert 0 < start_a.body.deadline_s <= 600.0
    assert (m["round"], m["clients_reported"], m["resent_to"]) == (2, 2, ["client-a"])
