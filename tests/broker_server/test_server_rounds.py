"""The aggregation server's rounds, message by message, on the in-process broker
(:mod:`protocol.memory_transport`, through ``helpers.memory_server``): what each receipt says and
what the round's metrics count when copies of updates arrive late, after the round closed, or
after the server's link came back, or while the server's thread is busy.

The server is the real ``AggregationServer`` (FedAvg, quorum 1, LightCNN 1×28×28); the devices
are scripted: each upload is published on the broker when the server's queue runs empty."""

from __future__ import annotations

import hashlib
import time
from collections import deque
from pathlib import Path

import numpy as np
from helpers.memory_server import incoming, memory_server, receipts_to, update_payload

from broker_server.server import AggregationServer, _is_fraction
from edge_agent.models import build_model
from edge_agent.state import state_arrays
from protocol import topics
from protocol.channel import Rejected
from protocol.messages import Envelope, Kind, Receipt, decode, encode
from protocol.transport import Incoming


def _two_clients(tmp_path: Path) -> tuple[AggregationServer, deque[Incoming], list, np.random.Generator]:
    """The server of these tests with clients A and B joined (2 rounds), the queue its feed reads
    and what an update's arrays look like, with a seeded generator for them."""
    torch_model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    feed: deque[Incoming] = deque()
    srv = memory_server(tmp_path, model=torch_model, clients=["client-a", "client-b"], rounds=2,
                        feed=lambda: feed.popleft() if feed else None, fed="mem")
    return srv, feed, list(state_arrays(torch_model)), np.random.default_rng(0)


def test_counted_update_resent_after_its_round_closed_is_acknowledged(tmp_path: Path) -> None:
    """Round 1: client A's update is counted (its receipt is lost on the way). Round 2 is open when
    A's copy of the same update arrives again: the receipt says accepted ('duplicate: already
    counted', the update is in round 1's aggregate) and the metrics count a duplicate, not a
    late update."""
    fed = "mem"
    srv, feed, like, rng = _two_clients(tmp_path)
    tr = srv.channel.transport
    a1 = update_payload(fed, "client-a", 1, 2, like, rng)
    feed.extend([incoming(*a1), incoming(*update_payload(fed, "client-b", 1, 2, like, rng))])
    m1 = srv.run_round(1)
    assert m1["clients_reported"] == 2 and not m1["skipped"]
    feed.extend([incoming(*a1),  # the same bytes again: round 1 is closed, round 2 open
                 incoming(*update_payload(fed, "client-a", 2, 3, like, rng)),
                 incoming(*update_payload(fed, "client-b", 2, 3, like, rng))])
    m2 = srv.run_round(2)
    assert m2["clients_reported"] == 2
    answers = [b for r, b in receipts_to(tr, "client-a") if r == 1 and b.ref_kind == Kind.UPDATE]
    assert len(answers) == 2
    assert answers[0].accepted
    assert answers[1].accepted, f"the redelivered, counted update was answered: {answers[1].reason!r}"
    assert srv.totals["late"] == 0 and srv.totals["duplicates"] == 1


def test_an_update_for_a_round_not_open_yet_is_not_answered_and_counts_when_sent_again(tmp_path: Path) -> None:
    """Round 1 closed, round 2 not open yet (between rounds, as a resumed server is before it runs
    the round its devices had trained): client A's round-2 update arrives. A refusal would be
    final for A (it rolls back and never offers that update again: the round then lacks it), so it
    is not answered and counted as ``early``; A's copy sent when round 2 starts is counted, and
    the one receipt A gets for round 2 accepts it. Before, A got "round 2 is closed"."""
    fed = "mem"
    srv, feed, like, rng = _two_clients(tmp_path)
    tr = srv.channel.transport
    feed.extend([incoming(*update_payload(fed, "client-a", 1, 2, like, rng)),
                 incoming(*update_payload(fed, "client-b", 1, 2, like, rng))])
    assert srv.run_round(1)["clients_reported"] == 2
    a2 = update_payload(fed, "client-a", 2, 3, like, rng)
    feed.append(incoming(*a2))
    srv._drain(until=lambda: not feed and srv.totals["early"] == 1)
    srv._drain()
    assert srv.totals["early"] == 1 and srv.totals["late"] == 0
    assert [b for r, b in receipts_to(tr, "client-a") if r == 2] == []
    feed.extend([incoming(*a2), incoming(*update_payload(fed, "client-b", 2, 3, like, rng))])
    m2 = srv.run_round(2)
    assert m2["clients_reported"] == 2 and m2["late"] == 0
    answers = [b for r, b in receipts_to(tr, "client-a") if r == 2 and b.ref_kind == Kind.UPDATE]
    assert [(b.accepted, b.reason) for b in answers] == [(True, "")], answers
    assert m2["early"] == 1  # it came before round 2 opened: round 2's line counts it
    from broker_server.run_end import refusals_from_metrics

    assert srv.refusal_totals()["early"] == refusals_from_metrics(srv.metrics)["early"] == 1


def test_receipt_of_the_resent_global_counts_after_a_server_reconnect(tmp_path: Path) -> None:
    """The server's link comes back mid-round (a broker restart): it sends the round's global
    model again to the agent it awaits, which never said what it holds (an older agent), as a
    copy on its own topic, and that agent's confirmation of the copy (its hash) counts in
    ``global_receipts``."""
    torch_model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    like = list(state_arrays(torch_model))
    rng = np.random.default_rng(1)
    fed = "mem"
    phase = [0]

    def feed() -> Incoming | None:
        globals_ = [p for t, p in srv.channel.transport.sent if t.endswith("/global")]
        if phase[0] == 0:  # the link came back: paho's thread calls this after the 2nd CONNACK
            phase[0] = 1
            srv.channel.transport.drop_link()  # listeners: the server re-sends the round
        elif phase[0] == 1 and len(globals_) == 2:  # the re-sent model reached the agent: it confirms it
            phase[0] = 2
            env = decode(globals_[-1]).envelope
            receipt = Receipt(ref_kind=int(Kind.GLOBAL), ref_seq=env.seq, accepted=True,
                              sha256=hashlib.sha256(globals_[-1]).digest())
            return incoming(topics.up(fed, "client-a", Kind.RECEIPT),
                            encode(Envelope(round=1, sender="client-a", seq=5, body=receipt)).payload)
        elif phase[0] == 2:
            phase[0] = 3
            return incoming(*update_payload(fed, "client-a", 1, 6, like, rng))
        return None

    srv = memory_server(tmp_path, model=torch_model, clients=["client-a"], rounds=1, feed=feed, fed=fed)
    tr = srv.channel.transport
    m = srv.run_round(1)
    assert srv.resyncs == 1
    assert [t.rsplit("/", 2)[-2:] for t, _ in tr.sent if t.endswith("/global")] == [["down", "global"],
                                                                                     ["client-a", "global"]]
    assert m["clients_reported"] == 1
    assert m["global_receipts"] == 1, "the agent's confirmation of the re-sent model was not counted"


def test_copy_of_a_counted_update_arriving_after_the_deadline_is_acknowledged(tmp_path: Path) -> None:
    """The server drains what arrived before the deadline; a copy of an update the round already
    counted (a resend after a lost receipt, a QoS 1 redelivery) that arrives meanwhile gets the
    answer the round gave: accepted, a duplicate, never late (a refusal would make the device
    roll back SCAFFOLD/FedDyn state the server has counted)."""
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


def test_eval_metric_values_the_server_takes() -> None:
    """Client metrics the server takes are fractions: finite numbers in [0, 1], not bools, strings
    or None."""
    assert [_is_fraction(v) for v in (0, 1, 0.5, 1.0)] == [True] * 4
    assert not any(_is_fraction(v) for v in ("0.5", float("nan"), float("inf"), -0.1, 7.0, True, None))


def test_updates_that_arrived_before_the_deadline_count_however_busy_the_server_is(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """Lateness is judged by arrival, not by when the server's single message thread gets to an
    update. Eight garbage messages and both clients' updates arrive together right after round
    1 starts (deadline 3 s: its clock starts before the global is encoded and published, which a
    busy machine slows); each garbage message costs the server 0.75 s (standing for an expensive
    hostile payload), so the updates are handled only after the deadline (8 × 0.75 s = 6 s): both
    are counted, none late, the round not skipped."""
    original = AggregationServer._handle

    def slow_handle(self, item):
        if isinstance(item, Rejected):
            time.sleep(0.75)
        return original(self, item)

    monkeypatch.setattr(AggregationServer, "_handle", slow_handle)
    torch_model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    like = list(state_arrays(torch_model))
    rng = np.random.default_rng(2)
    fed = "mem"
    sent: list[int] = []

    def feed() -> list[Incoming] | None:
        if sent:
            return None
        garbage = [incoming(topics.up(fed, "client-a", Kind.UPDATE), b"\xc1garbage") for _ in range(8)]
        updates = [incoming(*update_payload(fed, cid, 1, 2, like, rng)) for cid in ("client-a", "client-b")]
        sent.append(len(garbage) + len(updates))
        return garbage + updates

    srv = memory_server(tmp_path, model=torch_model, clients=["client-a", "client-b"], rounds=1, feed=feed,
                        fed=fed, deadline_s=3.0)
    m = srv.run_round(1)
    assert sent == [10]
    assert m["invalid"] == 8
    assert (m["clients_reported"], m["late"], m["skipped"]) == (2, 0, False)


def test_round_closes_when_its_last_awaited_update_is_handled(tmp_path: Path) -> None:
    """Both selected devices' updates are queued: the round closes as soon as the second one is
    handled, without asking the transport for another message (before the fix the server kept
    waiting until its half-second pump tick ran out, polling the empty queue)."""
    torch_model = build_model("lightcnn", in_channels=1, image_size=28, num_classes=10)
    like = list(state_arrays(torch_model))
    rng = np.random.default_rng(0)
    fed = "mem"
    feed: deque[Incoming] = deque()
    polls_after_last = [0]

    def next_message() -> Incoming | None:
        if feed:
            return feed.popleft()
        polls_after_last[0] += 1
        return None

    srv = memory_server(tmp_path, model=torch_model, clients=["client-a", "client-b"], rounds=1,
                        feed=next_message, fed=fed)
    feed.extend([incoming(*update_payload(fed, "client-a", 1, 2, like, rng)),
                 incoming(*update_payload(fed, "client-b", 1, 2, like, rng))])
    polls_after_last[0] = 0
    m1 = srv.run_round(1)
    assert m1["clients_reported"] == 2 and not m1["skipped"]
    assert polls_after_last[0] == 0, f"polled the empty queue {polls_after_last[0]} times after the last update"
