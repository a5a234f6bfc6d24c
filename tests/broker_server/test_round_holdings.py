"""What a device that comes back says it holds of the rounds decides what the server sends it
again, message by message on the in-process broker (``helpers.memory_server``).

A device's ``online`` carries (global_round, start_round, update_round)
(:attr:`protocol.messages.Status.holds`). While round 1 is open and waits for it, the server
sends it on its own topics the round's ``global`` only when it lacks it (with the round_start),
the ``round_start`` alone when it holds the global but not the round_start or its update of the
round awaits a receipt the server never gave, and nothing when it holds both; an update the
server counted gets its receipt again instead. A retained ``online`` the server never handled
(published while its own link was down) is taken up once; a global sent after the server's own
reconnect, which a device back before it still gets, is copied only to a device that does not
confirm it in time. After the server's own reconnect the round_start goes again, on each one's
own topic, to the devices it still awaits only, and the global to none of them that say what they
hold. Deadlines are 600 s: a round closes because it stopped waiting."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from helpers.memory_server import incoming, memory_server, receipts_to, sent_on, status_payload, update_payload

from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol import topics
from protocol.messages import Envelope, Kind, Receipt, RoundStart, encode
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
def test_after_its_reconnect_the_server_sends_the_round_start_to_each_awaited_device(tmp_path: Path,
                                                                                     c_says: bool) -> None:
    """Round 1 asks A, B and C; A's update is counted; B and C hold the round (B's ``online`` says
    so, and C's too, or C never said, as an older agent). The server's link breaks and comes
    back: it sends a ``round_start`` on B's and on C's own topic, each naming only that device,
    with the time left, and none to A (it would send its counted update again); the global
    again only to an awaited device that does not say what it holds (C's own copy): nothing is
    broadcast again (1 broadcast global, 1 broadcast round_start in all)."""
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
    assert len(sent_on(tr, "/down/round_start")) == len(sent_on(tr, "/down/global")) == 1
    assert sent_on(tr, "/down/client-a/round_start") == []
    for c in ("client-b", "client-c"):
        (start,) = sent_on(tr, f"/down/{c}/round_start")
        assert start.body.selected == (c,) and start.body.members == b""
        assert 0 < start.body.deadline_s <= 600.0
    assert len(sent_on(tr, "/down/client-c/global")) == (0 if c_says else 1)
    assert sent_on(tr, "/down/client-a/global") == sent_on(tr, "/down/client-b/global") == []
    assert (m["clients_reported"], m["duplicates"], m["resent_to"]) == (3, 0, [])


@pytest.mark.parametrize("confirms", [True, False], ids=["confirms-the-broadcast", "never-confirms"])
def test_a_global_sent_after_the_servers_reconnect_is_not_copied_to_a_device_it_may_still_reach(
        tmp_path: Path, confirms: bool) -> None:
    """The server's link broke and came back before round 1 opened, so round 1's broadcast went
    out on the new connection; A's ``online`` (holding nothing of round 1) arrives after it: A
    may have subscribed in time for that broadcast or not, which its ``online`` cannot say. The
    server sends no copy at once: A confirms the broadcast (its hash) and never gets a copy
    (``global_confirm_s`` 600 s); or A never confirms, and once ``global_confirm_s`` (0 s from
    A's ``online`` on) passed it gets exactly one copy with a round_start. B confirms the
    broadcast in both cases (so the round's global is not taken for dropped and re-broadcast
    smaller)."""
    model, like = _model()
    rng = np.random.default_rng(6)

    def confirm(cid: str, seq: int) -> Incoming:
        (topic, payload) = next((t, p) for t, p in srv.channel.transport.sent if t.endswith("/down/global"))
        env = sent_on(srv.channel.transport, "/down/global")[0]
        body = Receipt(ref_kind=int(Kind.GLOBAL), ref_seq=env.seq, accepted=True,
                       sha256=hashlib.sha256(payload).digest())
        return incoming(topics.up(FED, cid, Kind.RECEIPT),
                        encode(Envelope(round=1, sender=cid, seq=seq, body=body)).payload)

    def a_online() -> Incoming:
        if not confirms:  # from now on, no wait (B's confirmation is in: the broadcast is not taken for dropped)
            srv.settings = dataclasses.replace(srv.settings, global_confirm_s=0.0)
        return incoming(*status_payload(FED, "client-a", "online", "reconnected", seq=3, holds=(0, 0, 0)))

    steps: deque = deque([lambda: confirm("client-b", 2), a_online,
                          *([lambda: confirm("client-a", 4)] if confirms else []),
                          lambda: incoming(*update_payload(FED, "client-b", 1, 5, like, rng))])

    def feed():
        if steps:
            return steps.popleft()()
        if not confirms and sent_on(srv.channel.transport, "/down/client-a/round_start") and phase[0] == 0:
            phase[0] = 1
            return incoming(*update_payload(FED, "client-a", 1, 6, like, rng))
        if confirms and phase[0] == 0:
            phase[0] = 1
            return incoming(*update_payload(FED, "client-a", 1, 6, like, rng))
        return None

    phase = [0]
    srv = memory_server(tmp_path, model=model, clients=["client-a", "client-b"], rounds=1, fed=FED, feed=feed)
    srv.settings = dataclasses.replace(srv.settings, global_confirm_s=600.0)
    srv.channel.transport.drop_link()  # before round 1: its messages go out on connection 2
    m = srv.run_round(1)
    tr = srv.channel.transport
    assert srv.resyncs == 0  # no round was open at the reconnect
    copies = (len(sent_on(tr, "/down/client-a/global")), len(sent_on(tr, "/down/client-a/round_start")))
    assert copies == ((0, 0) if confirms else (1, 1))
    assert len(sent_on(tr, "/down/global")) == 1 and m["global_resends"] == 0
    assert m["clients_reported"] == 2 and m["global_receipts"] == (2 if confirms else 1)


@pytest.mark.parametrize("selected", [True, False], ids=["selected", "not-selected"])
def test_asks_for_a_lost_round_start_are_answered_at_most_max_round_resends_times(tmp_path: Path,
                                                                                  selected: bool) -> None:
    """Five asks for round 1's round_start (live ``online`` statuses holding global 1 and
    round_start 0, from a device the server holds online: an agent whose round_start the broker
    dropped). The server answers at most ``MAX_ROUND_RESENDS`` (3) of them, each with a
    round_start on the device's own topic (naming it when it is selected, nobody when not:
    client-c joins after round 1's selection), never with the global, and counts the five asks
    (``round_start_asks``) and the three answers (``round_start_resends``)."""
    from broker_server.server import MAX_ROUND_RESENDS
    from protocol.messages import Join

    model, like = _model()
    rng = np.random.default_rng(9)
    asker = "client-a" if selected else "client-c"
    holder: dict = {}

    def join_c():
        srv = holder["srv"]
        body = Join(profile="x86-cpu", manifest_hash=srv.manifest_hash, num_samples=100,
                    class_histogram=(100,) + (0,) * 9)
        return incoming(topics.up(FED, "client-c", Kind.JOIN),
                        encode(Envelope(round=0, sender="client-c", seq=1, body=body)).payload)

    asks = [lambda k=k: incoming(*status_payload(FED, asker, "online", "no round_start of round 1", seq=10 + k,
                                                 holds=(1, 0, 0))) for k in range(5)]
    steps: deque = deque([*([] if selected else [join_c]), *asks,
                          lambda: incoming(*update_payload(FED, "client-a", 1, 30, like, rng)),
                          lambda: incoming(*update_payload(FED, "client-b", 1, 2, like, rng))])
    srv = memory_server(tmp_path, model=model, clients=["client-a", "client-b"], rounds=1, fed=FED,
                        feed=lambda: steps.popleft()() if steps else None)
    holder["srv"] = srv
    m = srv.run_round(1)
    tr = srv.channel.transport
    starts = sent_on(tr, f"/down/{asker}/round_start")
    assert len(starts) == MAX_ROUND_RESENDS == 3
    assert {(e.round, e.body.selected, e.body.members) for e in starts} == {(1, (asker,) if selected else (), b"")}
    assert all(0 < e.body.deadline_s <= 600.0 for e in starts)
    assert sent_on(tr, f"/down/{asker}/global") == []
    assert m["round_start_asks"] == {asker: 5} and m["round_start_resends"] == {asker: 3}
    assert m["resent_to"] == ([asker] if selected else [])
    assert m["clients_reported"] == 2 and not m["skipped"]
